"""Fault tolerance of the training scripts: preemption signals, SIGKILL at random moments (during
steps and during saves), non-finite steps, failed saves and bad inputs.

    HF_HUB_OFFLINE=1 python -m pytest tests/test_fault_tolerance.py -q

End to end on train_flux_kontext.py with the random tiny Kontext model of tools/tiny_models.py
(fp32, 2 CPU ranks, 32 px, a save every step):
  reference  an uninterrupted run to MAX_STEPS
  chain      one OUTPUT_DIR, interrupted three times and resumed with RESUME=auto each time:
             SIGTERM to one rank (all ranks finish the step, save, exit 143), SIGKILL of the
             torchrun launcher at a random moment (its workers, in sessions of their own, must exit
             by themselves, not train on as orphans), SIGKILL of one rank while a save is in
             progress (a step_XXXXXX.partial folder exists); the last resume runs to MAX_STEPS and
             its export must equal the reference bit for bit.
The runs that test torchrun itself (its summary of the ranks' exit codes, its own death) are real
torchrun; the others are forked from the launch server (tests/conftest.py), whose ranks get what
torchrun gives them and end as torchrun's do (tests/test_zygote.py), and the reference trains while
the chain is interrupted. The rest runs in process (errors found before any process group exists) or
on 2 ranks (run_ranks). The two one-process non-finite runs (Kontext, DMD) train side by side, and the
bad-data launch runs while the frozen rank's partner waits out its collective timeout.
"""
from __future__ import annotations

import errno
import glob
import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.conftest import (ROOT, Background, ZygoteLaunch, complete_steps, finish, launch_all, launch_env, load_export,
                            run_ranks, tiny_default)
from tests.conftest import start as start_script

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import train_flux_kontext as tfk
from components.config import script_constants
from core.dist import agree
from core.errors import ConfigError, RunError
from components.guard import NonFiniteGuard, is_finite

STEPS = 12  # tiny steps take ~0.1 s, and each kill lands within a step or two of what it waits for
TIMEOUT = 240  # per launch: a hung rank fails the test instead of blocking the suite


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("fault")
    env = launch_env()
    model, data = tiny_default("flux_kontext")
    common = [
        f"--model_path={model}",
        f"--data_path={os.path.join(data, 'data.jsonl')}",
        "--precision=fp32",
        "--resolution=32",
        "--num_sample_pairs=0",
        "--sample_every=0",
        "--log_every=1",
        "--save_every=1",
        "--keep_last=2",
        "--lr=1e-3",
        "--warmup_steps=0",
        "--export_dtype=fp32",
        f"--max_steps={STEPS}",
        f"--text_cache_dir={root / 'text_cache'}",
    ]
    return {"root": root, "env": env, "common": common}


def start(setup, out, args=(), ranks=2, torchrun=False):
    """torchrun for what tests the launcher itself (its summary, its own death); otherwise a launch
    forked from the launch server, whose ranks get what torchrun gives them (tests/zygote.py)."""
    return start_script("train_flux_kontext.py", setup["common"] + [f"--output_dir={out}", *args], ranks=ranks,
                        env=setup["env"], torchrun=torchrun)


def run(setup, out, args=(), ranks=2, timeout=TIMEOUT):
    return finish(start(setup, out, args, ranks), timeout)


def workers(proc) -> dict[int, int]:
    """{rank: pid} of a launch's rank processes: torchrun's workers by the RANK in their
    environment, the launch server's by their order (it forks rank 0 first)."""
    children = [int(pid) for pid in open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()]
    if isinstance(proc, ZygoteLaunch):
        return dict(enumerate(children))
    found = {}
    for pid in children:
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        ranks = [int(e[5:]) for e in env if e.startswith(b"RANK=")]
        if ranks:
            found[ranks[0]] = pid
    return found


def wait_for(pred, proc, timeout=TIMEOUT, poll=0.005):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        if proc.poll() is not None:
            return None
        time.sleep(poll)
    return None


@pytest.fixture(scope="module")
def reference_run(setup):
    """The uninterrupted run, trained while the chain is interrupted (`reference` waits for it)."""
    proc = start(setup, setup["root"] / "reference")
    yield proc
    if proc.poll() is None:  # a failure left it running
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


@pytest.fixture(scope="module")
def reference(setup, reference_run, chain):
    rc, log = finish(reference_run)
    assert rc == 0, log[-3000:]
    return setup["root"] / "reference"


@pytest.fixture(scope="module")
def chain(setup, reference_run):
    """Interrupt one run three ways, resuming after each; returns what each interruption left."""
    out, rng, events = setup["root"] / "chain", random.Random(0), {}
    # 1. SIGTERM to rank 1 only once a checkpoint exists: both ranks stop together after a save, and
    #    torchrun's summary shows their exit code
    proc = start(setup, out, torchrun=True)
    assert wait_for(lambda: complete_steps(out), proc), "no checkpoint before the run ended"
    os.kill(workers(proc)[1], signal.SIGTERM)
    events["sigterm"] = (*finish(proc), complete_steps(out))
    # 2. SIGKILL of the torchrun launcher alone at a random moment after the next checkpoint: its
    #    workers (in sessions of their own) must notice and exit within seconds, not train on
    proc = start(setup, out, ["--resume=auto"], torchrun=True)
    last = events["sigterm"][2][-1]
    assert wait_for(lambda: any(s > last for s in complete_steps(out)), proc)
    pids = list(workers(proc).values())
    time.sleep(rng.uniform(0, 0.3))
    os.kill(proc.pid, signal.SIGKILL)
    finish(proc)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in pids):
        time.sleep(0.05)
    events["orphans"] = [p for p in pids if os.path.exists(f"/proc/{p}")]
    for p in events["orphans"]:
        os.kill(p, signal.SIGKILL)
    events["kill_group"] = complete_steps(out)
    # 3. SIGKILL of rank 1 while a save is in progress (its .partial folder exists)
    proc, t0 = start(setup, out, ["--resume=auto"]), time.time()
    last = events["kill_group"][-1]

    def new_partial():  # made by this run (the launcher kill may have left a stale one behind)
        found = []
        for p in glob.glob(os.path.join(out, "checkpoints", "*.partial")):
            try:
                if int(p[-14:-8]) > last and os.stat(p).st_ctime > t0:
                    found.append(p)
            except OSError:  # renamed away meanwhile
                pass
        return found
    partial = wait_for(new_partial, proc, poll=0.001)
    if partial:
        os.kill(workers(proc)[1], signal.SIGKILL)
    events["kill_in_save"] = (bool(partial), *finish(proc), complete_steps(out))
    # 4. resume to the end
    events["final"] = run(setup, out, ["--resume=auto"])
    return out, events


@pytest.mark.slow
def test_sigterm_saves_at_the_step_reached_and_exits_143(chain):
    _, events = chain
    rc, log, steps = events["sigterm"]
    assert rc != 0 and steps and steps[-1] < STEPS, log[-3000:]
    assert re.search(rf"stopped: checkpoint saved at step {steps[-1]}; rerun with --resume=auto", log), log[-3000:]
    assert re.findall(r"exitcode\s*:\s*(-?\d+)", log) and set(re.findall(r"exitcode\s*:\s*(-?\d+)", log)) == {"143"}, \
        log[-3000:]


@pytest.mark.slow
def test_killed_runs_resume_bit_exact(chain, reference):
    out, events = chain
    caught_in_save, rc, log, steps = events["kill_in_save"]
    assert not events["orphans"], "workers kept running after their launcher was killed"
    assert events["kill_group"][-1] < STEPS, events["kill_group"]  # killed mid-run
    assert caught_in_save, f"no save was caught in progress {steps}:\n{log[-3000:]}"
    assert rc != 0 and steps[-1] < STEPS, log[-2000:]  # the killed save was not made complete
    rc, log = events["final"]
    assert rc == 0, log[-3000:]
    assert f"resumed from {out}" in log
    ref, got = load_export(reference), load_export(out)
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)


@pytest.fixture(scope="module")
def non_finite_runs(setup):
    """The one-process runs of both scripts with an exploding LR, side by side (launch_all):
    {"kontext" | "dmd": (OUTPUT_DIR, CompletedProcess)}."""
    outs = {name: setup["root"] / f"nonfinite_{name}" for name in ("kontext", "dmd")}
    dmd = ["--precision=fp32", "--generator_lr=1e30", "--dfake_gen_update_ratio=1", "--max_bad_steps=2",
           "--save_every=0", "--sample_every=0", "--log_every=1", "--batch_size=2", "--max_steps=10"]
    done = launch_all({
        "kontext": dict(script="train_flux_kontext.py", ranks=1, env=setup["env"],
                        args=setup["common"] + [f"--output_dir={outs['kontext']}", "--lr=1e30", "--max_bad_steps=2",
                                                "--save_every=0"]),
        "dmd": dict(script="train_dmd.py", ranks=1, env=setup["env"], args=dmd + [f"--output_dir={outs['dmd']}"]),
    }, timeout=TIMEOUT, check=False)
    return {name: (outs[name], done[name]) for name in outs}


@pytest.mark.slow
def test_non_finite_steps_are_skipped_then_the_run_stops(non_finite_runs):
    """LR 1e30: step 1 blows the weights up, every later loss is non-finite; after MAX_BAD_STEPS
    of them in a row the run saves and stops with an error."""
    out, proc = non_finite_runs["kontext"]
    rc, log = proc.returncode, proc.stdout
    assert rc == 1, log[-3000:]
    assert "error: 2 non-finite steps in a row (MAX_BAD_STEPS=2) at step 3; checkpoint saved" in log
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["skipped_steps"] for r in records] == [0, 1, 2]
    state = json.load(open(out / "checkpoints" / "step_000003" / "trainer_state.json"))
    assert state["skipped_steps"] == 2 and state["bad_steps_in_a_row"] == 2


def _guard_on_two_ranks(rank, world):
    import torch
    guard = NonFiniteGuard(max_in_a_row=2)

    def step_ok(*values):  # as components.trainer.apply_updates decides: device tensors, one agreement
        return guard.record(agree(is_finite(*(torch.tensor(v) for v in values)))[0])
    assert step_ok(1.0, 2.0)
    assert not step_ok(float("nan") if rank == 1 else 1.0, 2.0)  # rank 0 skips too
    assert not guard.exhausted and guard.state() == {"skipped_steps": 1, "bad_steps_in_a_row": 1}
    assert not step_ok(1.0, float("inf") if rank == 0 else 1.0)
    assert guard.exhausted and "MAX_BAD_STEPS=2" in str(guard.error(7))
    assert step_ok(1.0, 1.0) and guard.in_a_row == 0 and guard.skipped == 2


@pytest.mark.slow
def test_non_finite_on_one_rank_skips_on_all():
    run_ranks(_guard_on_two_ranks, 2)


def _failing_saves(rank, world, out):
    import checkpoint
    import torch.distributed.checkpoint.filesystem as fs
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    ckpt = checkpoint.Checkpointer(out, {"m": model}, {"m": (model, opt)}, {}, {}, keep_last=2)
    ckpt.write(1, {})
    real_save, real_stream = torch.save, fs.FileSystem.create_stream
    for where in ("rng", "dcp"):
        def full(*a, **k):
            raise OSError(errno.ENOSPC, "No space left on device", str(a[0]) if a else "?")
        if rank == 1:
            if where == "rng":
                torch.save = full
            else:
                fs.FileSystem.create_stream = lambda self, path, mode: full(path)
        try:
            with pytest.raises(RunError, match=r"checkpoint save to .*step_000002\.partial failed .*No space left"):
                ckpt.write(2, {})
        finally:
            torch.save, fs.FileSystem.create_stream = real_save, real_stream
        torch.distributed.barrier()
        assert checkpoint.list_checkpoints(out) == [(1, os.path.join(out, "checkpoints", "step_000001"))]
        assert not os.path.exists(os.path.join(out, "checkpoints", "step_000002.partial"))
        torch.distributed.barrier()  # rank 0's next save re-creates the .partial: check first


@pytest.mark.slow
def test_failed_save_stops_all_ranks_and_keeps_the_previous_checkpoint(tmp_path):
    run_ranks(_failing_saves, 2, str(tmp_path))


@pytest.fixture(scope="module")
def bad_data_run(setup, tmp_path_factory):
    """test_bad_data_on_two_ranks_exits_with_one_line_and_no_hang's launch in the background: the
    stuck-rank test starts it once its rank is frozen, to train while rank 0 waits out its timeout."""
    folder = tmp_path_factory.mktemp("bad_data")
    (folder / "corrupt.png").write_bytes(b"not an image")
    data = folder / "data.jsonl"
    data.write_text(json.dumps({"image": "corrupt.png", "target": "corrupt.png", "prompt": "p"}) + "\n")
    background = Background(run, setup, folder / "out", [f"--data_path={data}"], 2, 120)
    yield folder, data, background
    background.join()


@pytest.mark.slow
def test_stuck_rank_becomes_an_error_after_the_collective_timeout(setup, tmp_path, bad_data_run):
    """Rank 1 is frozen (SIGSTOP) mid-run: rank 0, waiting in a collective, fails after
    COLLECTIVE_TIMEOUT_S with an error naming it, instead of hanging for ever."""
    out = tmp_path / "stuck"
    proc = start(setup, out, ["--collective_timeout_s=5", "--save_every=0", "--max_steps=1000"])
    metrics = out / "metrics.jsonl"
    assert wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2, proc)
    pids = workers(proc)
    os.kill(pids[1], signal.SIGSTOP)
    stopped = time.monotonic()
    bad_data_run[2].start()  # beside the wait
    try:
        gone = wait_for(lambda: not os.path.exists(f"/proc/{pids[0]}") or
                        open(f"/proc/{pids[0]}/stat").read().split()[2] == "Z", proc, timeout=90, poll=0.2)
        waited = time.monotonic() - stopped
    finally:
        os.kill(pids[1], signal.SIGKILL)  # the frozen rank's node is reclaimed
    rc, log = finish(proc)
    assert rc != 0, log[-3000:]
    assert gone or proc.returncode is not None, log[-3000:]
    assert waited < 60, f"rank 0 took {waited:.0f}s to give up"
    assert re.search(r"rank 0\b.*(timed out|Timed out|timeout)", log), log[-3000:]


# ----------------------------------------------------------------------------------------------
# bad inputs: one line, exit != 0, before any work


def main_error(monkeypatch, module, argv) -> str:
    """The ConfigError main() raises for `argv` (settings restored afterwards)."""
    saved = script_constants(vars(module))
    monkeypatch.setattr(sys, "argv", ["script.py", *argv])
    try:
        with pytest.raises(ConfigError) as info:
            module.main()
    finally:
        vars(module).update(saved)
    return str(info.value)


def test_bad_settings_and_model_folders_fail_before_any_work(monkeypatch, tmp_path):
    kontext, _ = tiny_default("flux_kontext")
    (tmp_path / "file").write_text("x")
    (tmp_path / "no_index").mkdir()
    partial_model = tmp_path / "partial_model"
    partial_model.mkdir()
    (partial_model / "model_index.json").write_text(open(os.path.join(kontext, "model_index.json")).read())
    os.symlink(os.path.join(kontext, "transformer"), partial_model / "transformer")
    cases = [(["--max_stepz=3"], "did you mean --max_steps"),
             (["--max_steps=ten"], "--max_steps='ten': expected int"),
             (["--max_bad_steps=0"], "MAX_BAD_STEPS >= 1"),
             (["--collective_timeout_s=0"], "COLLECTIVE_TIMEOUT_S > 0"),
             (["--parallelism=ddp", "--cpu_offload=1"], "CPU offload is an FSDP feature"),
             ([f"--output_dir={tmp_path / 'file' / 'out'}"], "is not writable"),
             ([f"--model_path={tmp_path / 'nope'}"], "no such folder"),
             ([f"--model_path={tmp_path / 'no_index'}"], "no model_index.json"),
             ([f"--model_path={partial_model}"], "missing vae/, text_encoder/, text_encoder_2/, tokenizer/")]
    for argv, message in cases:
        assert message in main_error(monkeypatch, tfk, [f"--output_dir={tmp_path / 'out'}", *argv]), argv


def test_bad_data_is_named_by_file_and_line(tmp_path):
    from PIL import Image
    Image.new("RGB", (32, 32)).save(tmp_path / "ok.png")
    (tmp_path / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    good = {"image": "ok.png", "target": "ok.png", "prompt": "p"}
    cases = [("{not json", ":2: not valid JSON"),
             (json.dumps({**good, "target": "missing.png"}), ":2: image .*missing.png not found"),
             (json.dumps({**good, "image": "corrupt.png"}), ":2: image .*corrupt.png is unreadable"),
             (json.dumps({"control": "ok.png", "prompt": "p"}), ":2: missing or empty 'target'"),
             (json.dumps({"image": "ok.png", "prompt": "p"}), ":2: a row without a reference image among rows with")]
    for i, (line, message) in enumerate(cases):
        path = tmp_path / f"d{i}.jsonl"
        path.write_text(json.dumps(good) + "\n" + line + "\n")
        with pytest.raises(ConfigError, match=re.escape(str(path)) + message):
            tfk.load_data(str(path), 0, 32, [1.0], 16, skip_bad=False)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ConfigError, match="no usable samples"):
        tfk.load_data(str(tmp_path / "empty.jsonl"), 0, 32, [1.0], 16, skip_bad=False)


@pytest.mark.slow
def test_bad_data_on_two_ranks_exits_with_one_line_and_no_hang(bad_data_run):
    folder, data, background = bad_data_run
    rc, log = background.result()
    assert rc != 0
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {data}:1: image {folder / 'corrupt.png'} is unreadable (UnidentifiedImageError)"], \
        log[-2000:]


# ----------------------------------------------------------------------------------------------
# train_dmd.py: the same guarantees


@pytest.mark.slow
def test_dmd_non_finite_steps_are_skipped_then_the_run_stops(non_finite_runs):
    """Generator LR 1e30: its first update blows it up, every later DM loss is non-finite; both
    updates of a bad step are skipped together, and MAX_BAD_STEPS in a row save and stop."""
    out, proc = non_finite_runs["dmd"]
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "error: 2 non-finite steps in a row (MAX_BAD_STEPS=2) at step 3; checkpoint saved" in proc.stdout
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["skipped_steps"] for r in records] == [0, 1, 2]
    state = json.load(open(out / "checkpoints" / "step_000003" / "trainer_state.json"))
    assert state["skipped_steps"] == 2 and state["bad_steps_in_a_row"] == 2


def test_dmd_bad_settings_and_model_folders_fail_before_any_work(monkeypatch, tmp_path):
    import train_dmd
    teacher = os.path.join(ROOT, "assets", "shapes_teacher")
    kontext, _ = tiny_default("flux_kontext")
    (tmp_path / "file").write_text("x")
    partial_model = tmp_path / "partial_model"
    partial_model.mkdir()
    (partial_model / "model_index.json").write_text(open(os.path.join(teacher, "model_index.json")).read())
    os.symlink(os.path.join(teacher, "unet"), partial_model / "unet")
    prompts = os.path.join(teacher, "prompts.txt")
    cases = [(["--max_bad_steps=0"], "MAX_BAD_STEPS >= 1"),
             (["--collective_timeout_s=0"], "COLLECTIVE_TIMEOUT_S > 0"),
             (["--parallelism=ddp", "--cpu_offload=1"], "CPU offload is an FSDP feature"),
             (["--parallelism=ddp", "--use_gan=1"], "PARALLELISM=ddp with USE_GAN=1"),
             (["--generator_lr=fast"], "--generator_lr='fast': expected float"),
             ([f"--output_dir={tmp_path / 'file' / 'out'}"], "is not writable"),
             ([f"--model_path={kontext}", f"--data_path={prompts}"],
              "holds prompts only; a FluxKontextPipeline teacher edits images"),
             ([f"--model_path={kontext}", f"--data_path={prompts}", "--use_gan=1", f"--real_data_path={prompts}"],
              "REAL_DATA_PATH with a FluxKontextPipeline teacher"),
             ([f"--model_path={kontext}", f"--data_path={prompts}", "--use_gan=1", "--gan_head_features=up"],
              "GAN_HEAD_FEATURES=up with a FluxKontextPipeline teacher"),
             ([f"--model_path={partial_model}", f"--data_path={prompts}"], "missing vae/, text_encoder/, tokenizer/"),
             ([f"--model_path={tmp_path / 'nope'}", f"--data_path={prompts}"], "no such folder")]
    for argv, message in cases:
        assert message in main_error(monkeypatch, train_dmd, [f"--output_dir={tmp_path / 'out'}", *argv]), argv


@pytest.mark.slow
def test_dmd_sigterm_saves_and_resume_matches(tmp_path):
    """SIGTERM to one rank of train_dmd.py: both ranks finish the step, save and exit 143; the
    resumed run ends bit-identical to an uninterrupted one."""
    steps = 10  # the SIGTERM lands after step 3, with steps to spare (a step or two is enough)
    common = ["--precision=fp32", "--dfake_gen_update_ratio=2", "--save_every=0", "--sample_every=0",
              "--log_every=1", "--batch_size=1", f"--max_steps={steps}", "--generator_lr=1e-3", "--guidance_lr=1e-3"]

    def launch_dmd(out, *extra):
        return start_script("train_dmd.py", [*common, f"--output_dir={out}", *extra])
    proc = launch_dmd(tmp_path / "cut")
    ref = launch_dmd(tmp_path / "ref")
    metrics = tmp_path / "cut" / "metrics.jsonl"
    assert wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, proc)
    os.kill(workers(proc)[1], signal.SIGTERM)
    rc, log = finish(proc)
    saved = complete_steps(tmp_path / "cut")
    assert rc != 0 and len(saved) == 1 and 3 <= saved[0] < steps, log[-3000:]
    assert f"stopped: checkpoint saved at step {saved[0]}; rerun with --resume=auto" in log, log[-3000:]
    rc, log = finish(launch_dmd(tmp_path / "cut", "--resume=auto"))
    assert rc == 0, log[-3000:]
    rc, log = finish(ref)
    assert rc == 0, log[-3000:]
    from safetensors.torch import load_file
    a, b = (load_file(str(tmp_path / r / "export" / "unet" / "diffusion_pytorch_model.safetensors"))
            for r in ("ref", "cut"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_second_signal_exits_at_once():
    """The first SIGTERM only asks the loop to stop after the step; a second one ends the process
    at once with 128 + signal (here the "step" never ends, so only the second signal can stop it),
    unless it is the same SIGTERM delivered twice (SLURM + torchrun, within the window)."""
    code = ("import os, signal, sys, time\n"
            f"sys.path.insert(0, {ROOT!r})\n"
            "from core.errors import GracefulStop\n"
            "stop = GracefulStop(duplicate_window_s=1.0)\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "time.sleep(0.2)\n"
            "assert stop.signum == signal.SIGTERM\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "time.sleep(0.2)\n"
            "print('first signal noted, its duplicate ignored', flush=True)\n"
            "time.sleep(1.0)\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "time.sleep(30)\n"
            "print('still running')\n")
    proc = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stdout
    assert "first signal noted, its duplicate ignored" in proc.stdout and "still running" not in proc.stdout
    assert "finishing this step and saving a checkpoint" in proc.stdout
