"""The tests' one way to launch things (pytest loads this file first; tests import from it):

    from tests.conftest import ROOT, launch, start, finish, run_ranks
    launch("train_dmd.py", ["--max_steps=2"], ranks=2)   # 2 ranks (or python for ranks=1), waited for
    proc = start("train_flux_kontext.py", args)          # the same, not waited for (runs side by side)
    proc = start(script, args, torchrun=True)            # real torchrun: signals, kills, process trees
    rc, log = finish(proc)                               # wait; on timeout the whole group is killed
    launch_all({"a": dict(script=..., args=...), ...})   # independent launches side by side, all waited for
    run_ranks(fn, 2, arg1, ...)   # fn(rank, world, *args) on 2 ranks with the group up

Launches are forked from a server that imported torch, diffusers, transformers and peft once
(tests/zygote.py: what each rank sees and how a launch ends are torchrun's, checked against it by
tests/test_zygote.py); that saves each launch the seconds of start-up that dominated the suite on
2 cores. run_ranks' ranks come from the same server (tests/rank_call.py). FSDP_TESTS_TORCHRUN=1
sends every launch through torchrun instead (and run_ranks through spawned processes). Every launch
runs in its own process session, so a timeout kills the launcher and all its ranks (none is left
running into the next test), with offline, one-thread-per-rank settings.
"""
from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn as nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch_env(**extra: str) -> dict:
    """os.environ without a parent launcher's rank variables, offline, one thread per rank, the
    project importable: what a test passes to a torchrun / python launch of a script."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    # the root first, the caller's PYTHONPATH kept: packages may come from it (the GPU check's wheels)
    path = os.pathsep.join([ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=path, **extra)
    return env


TIMEOUT = 300  # seconds a launched run may take before it counts as hung


def _tiny_cache() -> str:
    """Where the tiny folders (tools/tiny_models.ensure_default) are built once per test run and shared by every
    file and launch: $FSDP_DIFFUSION_CACHE where set (kept), else a temp folder removed at exit; inside it, a
    folder keyed by the builders' source (every file they come from: each family's tiny.py and the spec naming
    its builders, the shared families/tiny/, the cache's tools), so a kept cache never serves older builders."""
    import glob
    import hashlib
    import shutil
    import tempfile
    digest = hashlib.sha256()
    sources = [os.path.join(ROOT, "tools", name) for name in ("tiny_models.py", "build_once.py")]
    for pattern in (("tiny", "*.py"), ("*", "tiny.py"), ("*", "spec.py")):
        sources += sorted(glob.glob(os.path.join(ROOT, "families", *pattern)))
    for path in sources:
        with open(path, "rb") as f:
            digest.update(os.path.relpath(path, ROOT).encode() + b"\0" + f.read())
    base = os.environ.get("FSDP_DIFFUSION_CACHE")
    if not base:
        base = tempfile.mkdtemp(prefix="tiny_models")
        atexit.register(shutil.rmtree, base, ignore_errors=True)
    return os.path.join(base, digest.hexdigest()[:12])


TINY_CACHE = _tiny_cache()
os.environ["FSDP_DIFFUSION_CACHE"] = TINY_CACHE  # launches and ensure_default() without a folder share it


def tiny_default(kind: str) -> tuple[str, str]:
    """(model folder, data folder) of the tiny default `kind` (tools/tiny_models.BUILDERS), built once per test
    run. Shared: a test that changes a folder copies it first."""
    from tools import tiny_models
    return tiny_models.ensure_default(kind, TINY_CACHE)


def command(script: str, args=(), ranks: int = 2) -> list[str]:
    """torchrun of a repository script on `ranks` CPU ranks, or plain python for one."""
    path = script if os.path.isabs(script) else os.path.join(ROOT, script)
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
                if ranks > 1 else [sys.executable])
    return launcher + [path, *map(str, args)]


def start(script: str, args=(), *, ranks: int = 2, env: dict | None = None, torchrun: bool = False):
    """Launch without waiting (stdout and stderr merged, text), in a process session of its own:
    forked from the pre-imported server (tests/zygote.py) where it can, else (and with torchrun,
    for tests that signal the launcher or walk its process tree) a torchrun subprocess.Popen."""
    env = env or launch_env()
    server = None if torchrun else _zygote(env)
    if server:
        return ZygoteLaunch(server, script, args, ranks, env)
    return subprocess.Popen(command(script, args, ranks), cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(proc, timeout: float = TIMEOUT) -> tuple[int, str]:
    """(exit code, output) of a started launch; past `timeout` its whole process group is killed
    and the test fails with the output's tail."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(proc.args[-6:])}: still running after {timeout}s (a rank hung?)\n{out[-3000:]}")
    return proc.returncode, out


def launch(script: str, args=(), *, ranks: int = 2, env: dict | None = None, timeout: float = TIMEOUT,
           check: bool = True) -> subprocess.CompletedProcess:
    """Launch and wait; with check, a non-zero exit fails the test showing the output's tail."""
    proc = start(script, args, ranks=ranks, env=env)
    rc, out = finish(proc, timeout)
    if check and rc != 0:
        pytest.fail(f"{' '.join(proc.args[-6:])} exited {rc}:\n{out[-3000:]}")
    return subprocess.CompletedProcess(proc.args, rc, out)


def launch_all(runs: dict, timeout: float = TIMEOUT, check: bool = True) -> dict:
    """Independent launches side by side, each waited for as `launch` does: {name: start()'s
    arguments as a dict (script, args, ranks, env)} -> {name: CompletedProcess}. On 2 cores one run
    leaves a core idle much of the time (one process, start-up, ranks waiting in collectives), which
    a second run fills. Whatever is still running when one fails is killed."""
    procs, done = {}, {}
    try:
        for name, kwargs in runs.items():
            procs[name] = start(**kwargs)
        for name, proc in procs.items():
            rc, out = finish(proc, timeout)
            if check and rc != 0:
                pytest.fail(f"{name}: {' '.join(proc.args[-6:])} exited {rc}:\n{out[-3000:]}")
            done[name] = subprocess.CompletedProcess(proc.args, rc, out)
    finally:
        kill_groups(procs.values())
    return done


def kill_groups(procs) -> None:
    """SIGKILL the process group of every launch still running, and reap it."""
    for proc in procs:
        if proc.returncode is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.communicate()


# environment variables the server's imports read at import time: a launch whose values differ
# goes through torchrun, where its ranks import with them
_IMPORT_TIME_ENV = ("TORCH", "PYTORCH", "OMP_", "MKL", "KMP", "HF_", "TRANSFORMERS", "DIFFUSERS", "CUDA", "NCCL",
                    "GLOO", "PYTHON", "COVERAGE")
_server: dict = {}


def _zygote(env: dict):
    """The running fast-launch server for a launch with `env`, or None (torchrun): turned off by
    FSDP_TESTS_TORCHRUN=1, under tools/cpu_coverage.sh (every rank must start coverage), with CUDA
    (a process that imported torch may have touched the driver, which forked children cannot
    inherit), or when it could not start."""
    if (os.environ.get("FSDP_TESTS_TORCHRUN") == "1" or "COVERAGE_PROCESS_START" in os.environ
            or torch.cuda.is_available()):
        return None
    if not _server:
        import tempfile
        folder = tempfile.mkdtemp(prefix="zygote")
        base = launch_env()
        proc = subprocess.Popen([sys.executable, "-m", "tests.zygote", os.path.join(folder, "socket")], cwd=ROOT,
                                env=base, stdout=subprocess.PIPE, stderr=open(os.path.join(folder, "log"), "w"),
                                text=True, start_new_session=True)
        ready = proc.stdout.readline().strip() == "ready"
        _server.update(proc=proc, folder=folder, env=base, ok=ready)

        def stop():
            import shutil
            proc.kill()
            proc.wait()
            shutil.rmtree(folder, ignore_errors=True)
        atexit.register(stop)
    if not _server["ok"] or _server["proc"].poll() is not None:
        return None
    keys = {k for k in set(env) | set(_server["env"]) if k.startswith(_IMPORT_TIME_ENV)}
    if any(env.get(k) != _server["env"].get(k) for k in keys):
        return None
    return _server


class ZygoteLaunch:
    """A launch forked by the server, with what the tests use of a Popen: pid (its process group:
    the launcher and its ranks), args, returncode, poll(), communicate(timeout)."""

    def __init__(self, server, script, args, ranks, env):
        path = script if os.path.isabs(script) else os.path.join(ROOT, script)
        self.args = command(script, args, ranks)
        self.returncode = None
        self._chunks = []
        request = {"script": path, "args": list(map(str, args)), "ranks": ranks, "env": env, "cwd": ROOT}
        read_end, write_end = os.pipe()
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._conn.connect(os.path.join(server["folder"], "socket"))
        socket.send_fds(self._conn, [json.dumps(request).encode()], [write_end])
        os.close(write_end)
        self._conn.settimeout(120)
        self.pid = json.loads(self._conn.recv(1 << 16))["pid"]
        self._output = os.fdopen(read_end, "rb")

    def poll(self) -> int | None:
        """The exit code once the launcher has answered with it, else None."""
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self.communicate()
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._output.closed:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and (left <= 0 or not select.select([self._output], [], [], left)[0]):
                raise subprocess.TimeoutExpired(self.args, timeout)
            chunk = os.read(self._output.fileno(), 1 << 16)
            if chunk:
                self._chunks.append(chunk)
            else:
                self._output.close()
        if self.returncode is None:
            self._conn.settimeout(None if deadline is None else max(deadline - time.monotonic(), 5))
            answer = self._conn.recv(1 << 16)  # empty: the launcher itself was killed
            self._conn.close()
            self.returncode = json.loads(answer)["rc"] if answer else -signal.SIGKILL
        return b"".join(self._chunks).decode("utf-8", errors="replace"), None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(local_rank, world, port, fn, args, errq):
    os.environ.update(RANK=str(local_rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local_rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      HF_HUB_OFFLINE="1")
    sys.path.insert(0, ROOT)
    import torch.distributed as dist
    import fsdp_utils
    try:
        fsdp_utils.init_distributed(timeout_s=120)
        fn(local_rank, world, *args)
        dist.barrier()
    except BaseException:
        errq.put(f"rank {local_rank}:\n{traceback.format_exc()}")
        os._exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # Every check has passed and the process groups are destroyed: leave without the interpreter's
    # finalization, where torch 2.13's gloo worker threads intermittently abort the process
    # ("terminate called without an active exception", SIGABRT; seen in 2 of 250 tests in one CI
    # run on this 2-core machine, never in the test bodies; cf. pytorch/pytorch#179291 and #190489).
    _save_coverage()  # tools/cpu_coverage.sh: os._exit skips coverage's own atexit save
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _save_coverage() -> None:
    try:
        import coverage
    except ImportError:
        return
    cov = coverage.Coverage.current()
    if cov is not None:
        cov.stop()
        cov.save()


def run_ranks(fn, world: int, *args) -> None:
    """Run fn(rank, world, *args) on `world` ranks with the process group up; a failure on any rank
    fails here, with its traceback. The ranks are forked from the launch server as a script's are
    (tests/rank_call.py: no import of torch and diffusers per rank), else spawned."""
    env = launch_env()
    if _zygote(env):
        import pickle
        import tempfile
        with tempfile.TemporaryDirectory(prefix="run_ranks") as folder:
            path = os.path.join(folder, "call.pkl")
            with open(path, "wb") as f:
                pickle.dump((fn, args), f)
            rc, out = finish(start(os.path.join(ROOT, "tests", "rank_call.py"), [path], ranks=world, env=env), 600)
        if rc != 0:
            raise AssertionError(f"{fn.__module__}.{fn.__qualname__} on {world} ranks exited {rc}:\n{out[-6000:]}")
        return
    ctx = mp.get_context("spawn")
    errq = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, errq)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
    for p in procs:
        if p.is_alive():
            p.kill()
    if not errq.empty():
        raise AssertionError(errq.get())
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    assert not bad, f"rank exit codes {[p.exitcode for p in procs]}"


def assert_loads_with_automodel(folder) -> None:
    """An exported component loads with diffusers.AutoModel, as the diffusers class its config
    names (not fully_shard's FSDP<Name> subclass), with exactly the exported tensors."""
    import diffusers
    from safetensors.torch import load_file
    folder = str(folder)
    config = json.load(open(os.path.join(folder, "config.json")))
    assert not config["_class_name"].startswith("FSDP") and "_name_or_path" not in config, config
    model = diffusers.AutoModel.from_pretrained(folder)
    assert type(model).__name__ == config["_class_name"] and type(model).__module__.startswith("diffusers.")
    weights = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            weights.update(load_file(os.path.join(folder, name)))
    state = model.state_dict()
    assert state.keys() == weights.keys()
    assert all(torch.equal(state[k].to(weights[k].dtype), weights[k]) for k in weights)


# the fields of a log record that measure time (differ between otherwise identical runs)
TIMING_FIELDS = {"step_ms", "data_wait_ms", "compute_ms", "images_per_s", "tokens_per_s", "mfu"}


def read_metrics(out_dir, timing: bool = True) -> list[dict]:
    """The records of OUTPUT_DIR/metrics.jsonl, in order (timing=False: without TIMING_FIELDS)."""
    with open(os.path.join(str(out_dir), "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return records if timing else [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in records]


def assert_metrics_match(a_dir, b_dir, keys=("loss", "val_loss", "grad_norm")) -> None:
    """Two runs' records step for step: each of `keys` a record of the first holds, the second holds within fp32
    reduction-order rounding (2 ranks against one process, context parallel against data parallel)."""
    for ra, rb in zip(read_metrics(a_dir), read_metrics(b_dir)):
        for k in keys:
            if k in ra:
                assert rb[k] == pytest.approx(ra[k], rel=1e-5, abs=1e-6), (ra["step"], k)


def tiny_flux(seed: int = 0, **overrides):
    """A random FluxTransformer2DModel of the diffusers test suite's tiny configuration (one double
    and one single block, 2 heads of 16), with `overrides` of its config."""
    from diffusers import FluxTransformer2DModel
    torch.manual_seed(seed)
    config = dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
                  num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8])
    return FluxTransformer2DModel(**{**config, **overrides})


def tiny_unet(sdxl: bool = False, seed: int = 0):
    """A random UNet2DConditionModel of two levels, in the SD-1.5 block layout (cross-attention
    down first, up last) or the SDXL one (the reverse, two transformer layers per block), for
    8 x 8 x 4 latents and 32-wide text embeddings."""
    from diffusers import UNet2DConditionModel
    torch.manual_seed(seed)
    down = ("CrossAttnDownBlock2D", "DownBlock2D")
    up = ("UpBlock2D", "CrossAttnUpBlock2D")
    return UNet2DConditionModel(
        block_out_channels=(32, 64), layers_per_block=1, sample_size=8, in_channels=4, out_channels=4,
        down_block_types=down[::-1] if sdxl else down, up_block_types=up[::-1] if sdxl else up,
        transformer_layers_per_block=2 if sdxl else 1, cross_attention_dim=32, norm_num_groups=8,
        attention_head_dim=4)


# ----------------------------------------------------------------------------------------------
# shared test helpers: a tiny model for the FSDP mechanics, reading what runs wrote, the Kontext
# script's test setup (the tiny default, a dataset with two aspect ratios, common settings)

KONTEXT_STEPS = 3  # the Kontext runs' MAX_STEPS


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class TinyNet(nn.Module):
    def __init__(self, d=16, n=3):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.out = nn.Linear(d, 1)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def make_data(steps, global_batch):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(global_batch, 8, generator=g), torch.randn(global_batch, 1, generator=g))
            for _ in range(steps)]


def read_checkpoint(out, step, flat: bool = False):
    """A DCP checkpoint folder read back offline (no process group) as one nested dict, or (flat)
    as {".model.generator.x.weight": tensor, ...} of its tensors only."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    path = os.path.join(out, f"state_{step}.pt")
    dcp_to_torch_save(os.path.join(out, "checkpoints", f"step_{step:06d}"), path)
    state = torch.load(path, weights_only=False)
    if not flat:
        return state
    tensors = {}

    def walk(prefix, obj):
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}", v)
        elif torch.is_tensor(obj):
            tensors[prefix] = obj
    walk("", state)
    return tensors


def assert_kontext_resumed_bit_exact(straight, resumed, step, models=("model.transformer", "model.ema")) -> dict:
    """Two Kontext runs' checkpoints of `step` hold the same `models` (transformer, EMA) and AdamW
    state bit for bit, and their last logged losses are equal (a resumed run against one run
    straight through). Returns the straight run's checkpoint."""
    a, b = read_checkpoint(straight, step), read_checkpoint(resumed, step)
    for name in models:
        assert a[name].keys() == b[name].keys(), name
        assert all(torch.equal(a[name][k], b[name][k]) for k in a[name]), name
    for key, state in a["optim.transformer"]["state"].items():
        for k, v in state.items():
            assert torch.equal(v, b["optim.transformer"]["state"][key][k]), (key, k)
    assert read_metrics(straight)[-1]["loss"] == read_metrics(resumed)[-1]["loss"]
    return a


def without_validation(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith("val_")}


def assert_dmd_resumed_bit_exact(straight, resumed, step: int = 4) -> None:
    """Two DMD2 runs' checkpoints of `step` hold the same generator, fake score, GAN head, EMA and both
    AdamW states bit for bit, and the resumed run logged what the straight one did after the resume."""
    a, b = read_checkpoint(straight, step, flat=True), read_checkpoint(resumed, step, flat=True)
    assert a.keys() == b.keys()
    for part in ("model.generator.", "model.fake.", "model.head.", "model.ema.", "optim.generator.", "optim.guidance."):
        assert any(k.startswith("." + part) for k in a), part
    for k in a:
        assert torch.equal(a[k], b[k]), k
    after = read_metrics(resumed, timing=False)  # validation (VAL_EVERY) left out: it changes no training number
    assert [without_validation(r) for r in read_metrics(straight, timing=False)[-len(after):]] == \
        [without_validation(r) for r in after]


def assert_two_ranks_equal_one_and_resumed(two_ranks, one, resumed, step: int = 4) -> None:
    """A family's DMD2 runs: 2 ranks log one process's losses (GRAD_ACCUM=2) within fp32 reduction-order rounding, and
    the run resumed from its step-2 checkpoint holds the straight one's models, EMA and both AdamW states at `step`
    bit for bit and logged what the straight one did after the resume."""
    two, single = read_metrics(two_ranks, timing=False), read_metrics(one, timing=False)
    for key in ("loss_fake", "loss_dm"):
        assert [r.get(key) is None for r in two] == [r.get(key) is None for r in single], key
        assert [r[key] for r in two if key in r] == pytest.approx([r[key] for r in single if key in r], rel=1e-4), key
    a, b = read_checkpoint(two_ranks, step, flat=True), read_checkpoint(resumed, step, flat=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for part in ("model.generator.", "model.fake.", "model.ema.", "optim.generator.", "optim.guidance."):
        assert any(k.startswith("." + part) for k in a), part
    assert read_metrics(resumed, timing=False)[-2:] == two[-2:]


VALIDATE = ["--val_every=2", "--val_count=1", "--val_seeds=2", "--val_teacher_steps=2"]  # train_dmd.py's, small
VAL_FIGURES = ("val_variety_ratio", "val_variety_ratio_latent", "val_teacher_distance", "val_saturation_drift",
               "val_colour_drift")


def assert_validated(out, steps, log: str = "") -> None:
    """A train_dmd.py run with VALIDATE: every figure logged at exactly `steps`, finite, with a grid each, the
    teacher's samples drawn once (one cache file); the run's log names the validation rows."""
    import math
    rows = read_metrics(out, timing=False)
    assert [r["step"] for r in rows if "val_variety_ratio" in r] == list(steps)
    for r in rows:
        if r["step"] in steps:
            assert all(math.isfinite(r[k]) for k in VAL_FIGURES), r
            assert r["val_variety_ratio"] > 0 and r["val_teacher_distance"] >= 0, r
    folder = os.path.join(str(out), "validation")
    assert sorted(n for n in os.listdir(folder) if n.endswith(".png")) == [f"step_{s:06d}.png" for s in steps]
    assert len([n for n in os.listdir(folder) if n.startswith("teacher_")]) == 1
    assert not log or "validation: 1 prompts x 2 seeds every 2 steps" in log, log[-3000:]


def chain(model, data, tuned_lora, root, env, args):
    """The path from a user's edits to a few-step editor, after the fine-tune that wrote `tuned_lora` (a
    LoRA export of `model`, trained on its NF4 base): DMD2 with base + that LoRA as the teacher (TEACHER_LORA,
    no merge; NF4 base, LoRA students), and beside it the same run on the folder tools/merge_lora.py
    writes. Any family's base runs it (FLUX.1 Kontext, FLUX.2: the same arguments but their own `args`)."""
    merged = root / "chain_merged"
    if not merged.exists():
        launch("tools/merge_lora.py", [model, tuned_lora, merged], ranks=1, env=env)
    common = args + [f"--data_path={data}", "--max_steps=2", "--denoising_steps=999,749,499,249", "--lora_rank=4",
                     "--fake_lora=1", "--base_dtype=nf4", "--save_every=0", "--sample_every=0", "--log_every=1",
                     "--dfake_gen_update_ratio=1", "--export_dtype=fp32"]
    out = {k: root / f"chain_{k}" for k in ("lora", "merged")}
    def job(args):
        return dict(script="train_dmd.py", ranks=2, env=env, args=args)
    done = launch_all({
        "lora": job(args=common + [f"--model_path={model}", f"--teacher_lora={tuned_lora}",
                                   f"--output_dir={out['lora']}"]),
        "merged": job(args=common + [f"--model_path={merged}", f"--output_dir={out['merged']}"])})
    return {"out": out, "logs": {k: v.stdout for k, v in done.items()}}


def write_pair(folder, name, size, colour, new_colour):
    """A context/target pair of `size` (w, h): one rectangle, recoloured in the target."""
    from PIL import Image, ImageDraw
    paths = []
    for sub, c in (("context", colour), ("target", new_colour)):
        image = Image.new("RGB", size, (30, 30, 30))
        w, h = size
        ImageDraw.Draw(image).rectangle((w // 4, h // 4, 3 * w // 4, 3 * h // 4), fill=c)
        os.makedirs(os.path.join(folder, sub), exist_ok=True)
        image.save(os.path.join(folder, sub, name))
        paths.append(f"{sub}/{name}")
    return paths


def make_mixed_dataset(folder):
    """16 pairs, alternately 64x64 and 96x48 (w x h); the last two (one of each) are held out."""
    colours = [(220, 40, 40), (40, 180, 60), (40, 70, 220), (240, 220, 40)]
    names = ["red", "green", "blue", "yellow"]
    rows = []
    for i in range(16):
        size = (64, 64) if i % 2 == 0 else (96, 48)
        a, b = i % 4, (i + 1) % 4
        context, target = write_pair(folder, f"{i:03d}.png", size, colours[a], colours[b])
        rows.append({"image": context, "target": target, "prompt": f"make the square {names[b]} {i}"})
    path = os.path.join(folder, "data.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return path, rows


@pytest.fixture(scope="module")
def kontext_setup(tmp_path_factory):
    """The tiny Kontext default, the mixed dataset and the common settings, once per test module."""
    return make_kontext_setup(tmp_path_factory.mktemp("kontext"))


def make_kontext_setup(root):
    """The tiny default (built once per test run), the mixed dataset, launch environment."""
    model_path, _ = tiny_default("flux_kontext")
    data, rows = make_mixed_dataset(str(root / "data"))
    env = launch_env()
    common = [
        f"--model_path={model_path}",
        f"--data_path={data}",
        f"--text_cache_dir={root / 'text_cache'}",
        "--precision=fp32",
        f"--max_steps={KONTEXT_STEPS}",
        "--log_every=1",
        "--num_sample_pairs=2",
        "--resolution=64",
        "--lr=1e-3",
        "--warmup_steps=0",
        "--export_dtype=fp32",
        "--sample_steps=1",
    ]
    return {"root": root, "env": env, "common": common, "model_path": model_path, "rows": rows, "data": data}


def dmd_run(args, env: dict, out_dir, ranks: int = 2) -> dict:
    """train_dmd.py with `args` into `out_dir`, as launch_all takes it."""
    return dict(script="train_dmd.py", args=list(args) + [f"--output_dir={out_dir}"], ranks=ranks, env=env)


def launch_kontext(setup, out, args, ranks=2, check=True):
    """train_flux_kontext.py with the setup's common settings, into `out`."""
    return launch(**kontext_run(setup, out, args, ranks), check=check)


def kontext_run(setup, out, args, ranks=2) -> dict:
    """launch_kontext's run as launch_all takes it."""
    return dict(script="train_flux_kontext.py", args=setup["common"] + [f"--output_dir={out}"] + args, ranks=ranks,
                env=setup["env"])


def load_export(out, component: str = "transformer") -> dict:
    """The exported trained model's tensors (OUTPUT_DIR/export/<component>/), by name."""
    from safetensors.torch import load_file
    return load_file(os.path.join(out, "export", component, "diffusion_pytorch_model.safetensors"))


# ----------------------------------------------------------------------------------------------
# where the suite's time goes: seconds per test file and per family / shared area (setup, call and teardown),
# printed at the end; the areas beside their budgets (tests/budgets.py, docs/testing.md)

_FILE_SECONDS: dict[str, float] = {}
_AREA_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    from tests.budgets import area_of
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration
    area = area_of(report.nodeid)
    _AREA_SECONDS[area] = _AREA_SECONDS.get(area, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter, config):
    if not _FILE_SECONDS:
        return
    terminalreporter.write_sep("=", "seconds per test file")
    for path, seconds in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1]):
        if seconds >= 1.0:
            terminalreporter.write_line(f"{seconds:7.1f}  {path}")
    from tests.budgets import report_lines
    half = {"not slow": "fast", "slow": "slow"}.get(config.option.markexpr.strip(), "all")
    terminalreporter.write_sep("=", f"seconds per family and shared area / budget ({half}; docs/testing.md)")
    for line in report_lines(_AREA_SECONDS, half):
        terminalreporter.write_line(line)


# ----------------------------------------------------------------------------------------------
# the rooms' files (test_compile, test_flux2, test_qwen_image, test_float8, test_context_parallel): one
# compiled-vs-eager check, and launches that overlap (a resume from a copy of a checkpoint, started as soon as
# that exists; a slow launch started early and waited for last)

def assert_trains_as_eager(eager, compiled, *, lr: float, steps: int, component: str = "transformer") -> None:
    """A COMPILE=1 run (OUTPUT_DIR `compiled`) trains as its eager twin (`eager`): steps 1..`steps` logged by
    both, the same losses and grad norms per step (1e-5 relative: fused kernels reorder fp32 sums), the same
    export keys of `component`, none with torch.compile's `_orig_mod.`, and its exported weights within a
    twentieth of one step's `lr` of eager's."""
    a, b = read_metrics(eager), read_metrics(compiled)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, steps + 1))
    for ra, rb in zip(a, b):
        for k in ("loss", "grad_norm"):
            assert rb[k] == pytest.approx(ra[k], rel=1e-5), (ra["step"], k, ra[k], rb[k])
    wa, wb = load_export(eager, component), load_export(compiled, component)
    assert wa.keys() == wb.keys() and not any("_orig_mod" in k for k in wb)
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=0, atol=lr / 20, msg=k)


def copy_checkpoint(out, step: int, to) -> None:
    """OUTPUT_DIR `out`'s checkpoint of `step` alone in a new OUTPUT_DIR `to`: a run with RESUME=auto there
    resumes where `out`'s run was at that step, as if stopped there (one launch fewer than a run stopped at
    `step` with the same settings, whose checkpoint is the same)."""
    import shutil
    name = os.path.join("checkpoints", f"step_{step:06d}")
    shutil.copytree(os.path.join(str(out), name), os.path.join(str(to), name))


def start_all(runs: dict, timeout: float = TIMEOUT):
    """launch_all's launches started now and waited for later, so that what the caller does meanwhile (other
    launches, in-process tests) overlaps them. Returns (wait, kill): wait(*names) waits for those launches
    (none named: all) as launch_all does, `timeout` counted from the start, and returns {name:
    CompletedProcess} of all waited for so far; a failure kills the rest. kill() ends whatever still runs (a
    fixture's teardown)."""
    procs = {name: start(**kwargs) for name, kwargs in runs.items()}
    deadline = time.monotonic() + timeout
    done: dict = {}

    def kill():
        kill_groups(procs.values())

    def wait(*names) -> dict:
        for name in names or procs:
            if name in done:
                continue
            proc = procs[name]
            try:
                rc, out = finish(proc, max(deadline - time.monotonic(), 1.0))
            except BaseException:
                kill()
                raise
            if rc != 0:
                kill()
                pytest.fail(f"{name}: {' '.join(proc.args[-6:])} exited {rc}:\n{out[-3000:]}")
            done[name] = subprocess.CompletedProcess(proc.args, rc, out)
        return done
    return wait, kill


def output_dir(args) -> str:
    """The OUTPUT_DIR a launch's arguments give (the last --output_dir=)."""
    return [a for a in map(str, args) if a.startswith("--output_dir=")][-1].split("=", 1)[1]


def launch_all_resuming(runs: dict, straight: str, resumed: dict, step: int = 2, timeout: float = TIMEOUT) -> dict:
    """launch_all(runs) and, as soon as run `straight` is done, `resumed` (start()'s arguments, RESUME=auto, its
    own OUTPUT_DIR) from a copy of `straight`'s step-`step` checkpoint (copy_checkpoint), beside the runs still
    going. {name: CompletedProcess}, the resumed run's under "resumed"."""
    wait, kill = start_all(runs, timeout)
    try:
        wait(straight)
        copy_checkpoint(output_dir(runs[straight]["args"]), step, output_dir(resumed["args"]))
        wait_resumed, kill_resumed = start_all({"resumed": resumed}, timeout)
        try:
            return {**wait(), **wait_resumed()}
        finally:
            kill_resumed()
    finally:
        kill()


# ----------------------------------------------------------------------------------------------
# launches kept on the launch server; what runs leave behind (checkpoints, TensorBoard)


def _inductor_cache_dir_set_once() -> None:
    """torch writes its inductor cache folder into os.environ the first time this process asks for it
    (any torch.compile, backend="eager" too; transformers' model loading, through torchao's inductor import).
    A TORCH* variable that differs from the launch server's
    sends a launch through torchrun, so without this every launch after the first in-process compile
    would pay torchrun's imports again. The same folder, set before the server starts."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    cache_dir()


_inductor_cache_dir_set_once()


def complete_steps(out) -> list[int]:
    """The steps of OUTPUT_DIR's complete checkpoints (their .metadata written), in order."""
    import glob
    return sorted(int(p[-6:]) for p in glob.glob(os.path.join(str(out), "checkpoints", "step_??????"))
                  if os.path.exists(os.path.join(p, ".metadata")))


def tensorboard_scalars(out) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} of OUTPUT_DIR/tensorboard as TensorBoard's reader sees them (orphaned data
    purged, every point kept)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(os.path.join(str(out), "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


class Background:
    """fn(*args) in a thread of its own, started once (start() again does nothing): a launch that one test
    starts beside its own idle wait and another test checks. result() starts it if need be, waits for it
    and returns its value or raises its exception; join() waits for it if it was started."""

    def __init__(self, fn, *args):
        import threading
        self._thread = threading.Thread(target=self._run, args=(fn, *args), daemon=True)
        self._value, self._error = None, None

    def _run(self, fn, *args):
        try:
            self._value = fn(*args)
        except BaseException as e:  # pytest.fail's too
            self._error = e

    def start(self) -> None:
        if self._thread.ident is None:
            self._thread.start()

    def join(self) -> None:
        if self._thread.ident is not None:
            self._thread.join()

    def result(self):
        self.start()
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


# ----------------------------------------------------------------------------------------------
# train_dmd.py's end-to-end files (test_train_dmd*.py): one teacher's settings, its runs side by side, resumes

class DmdRuns:
    """train_dmd.py runs of one test module: the module's `common` settings (its teacher, data, steps) first,
    each run's own after (a later setting wins), each into `root`/<name>, with the tests' launch environment
    (the shared tiny folders' cache)."""

    def __init__(self, root, common):
        self.root, self.common, self.env = root, list(common), launch_env()

    def run(self, name: str, args=(), ranks: int = 2) -> dict:
        """The run as launch_all takes it."""
        return dmd_run(self.common + list(args), self.env, self.root / name, ranks)

    def launch_all(self, runs: dict) -> dict:
        """{name: (args, ranks)} side by side -> {name: (OUTPUT_DIR, output)}."""
        done = launch_all({name: self.run(name, *spec) for name, spec in runs.items()})
        return {name: (self.root / name, done[name].stdout) for name in runs}

    def resumed(self, name: str, source, step: int, args=()) -> tuple:
        """RESUME=auto into root/<name> from a copy of `source`'s checkpoint at `step`: (OUTPUT_DIR, output)."""
        folder = f"step_{step:06d}"
        copy_checkpoint(source, step, self.root / name)
        out = self.launch_all({name: ([*args, "--resume=auto"], 2)})[name]
        assert "resumed from" in out[1] and f"{folder} (step {step})" in out[1], out[1][-3000:]
        return out
