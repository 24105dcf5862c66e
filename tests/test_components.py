"""components/ on one process (no process group: rank() is 0): RunLogger (metrics.jsonl, the
TensorBoard and W&B (offline) backends and their resume, REPORT_TO checks, the plain progress
lines printed when stdout is not a terminal), the --name=value parser, run_main's one-line errors.
No training; each test takes a few seconds at most.

    python -m pytest tests/test_components.py -q
"""
import glob
import json
import os
import re
import struct
import subprocess
import sys
import time

import pytest

from components.checks import check_output_dir, check_output_dir_shared, shared_folders
from components.config import apply_overrides
from core.dist import (agree, all_gather_objects, all_reduce, broadcast_from_rank0, comm_device, first_error,
                             mean_across_ranks, rank)
from core.errors import ConfigError
from components.logger import RunLogger, check_report_to, _installed
from tests.conftest import ROOT, tensorboard_scalars


@pytest.fixture(autouse=True)
def single_process(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert rank() == 0


def metric(step: int, seed: float = 0.0) -> dict:
    return {"loss": 1.0 / step + seed, "lr": 1e-4 * step, "skipped_steps": 0}


def run_steps(logger: RunLogger, steps, log_every: int = 1, seed: float = 0.0) -> None:
    for step in steps:
        logger.step_done(step, metric(step, seed) if step % log_every == 0 else None)


def read_jsonl(out) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_metrics_jsonl_and_lines_are_unchanged_without_backends(tmp_path, capsys):
    logger = RunLogger(str(tmp_path), 4, progress="bar")
    run_steps(logger, range(1, 5), log_every=2)
    logger.close()
    records = read_jsonl(tmp_path)
    assert [r["step"] for r in records] == [2, 4]
    assert list(records[0]) == ["step", "loss", "lr", "skipped_steps", "step_ms"]
    assert records[1]["loss"] == 0.25 and not os.path.exists(tmp_path / "tensorboard")
    assert "step 00002/4 | loss 0.5 | lr 0.0002 | skipped_steps 0 | " in capsys.readouterr().out


def test_tensorboard_scalars_config_and_images_match_metrics_jsonl(tmp_path):
    pytest.importorskip("tensorboard")
    from PIL import Image
    png = tmp_path / "grid.png"
    Image.new("RGB", (12, 8), (200, 10, 10)).save(png)
    logger = RunLogger(str(tmp_path), 6, report_to="tensorboard", config={"LR": 1e-4, "NAME": "x"}, progress="lines")
    run_steps(logger, range(1, 7), log_every=2)
    logger.log_scalars(6, {"eval_loss": 0.125})
    logger.log_images(6, "samples", str(png))
    logger.log_images(6, "missing", str(tmp_path / "nope.png"))  # a warning, not an error
    logger.close()

    records = read_jsonl(tmp_path)
    assert records[-1] == {"step": 6, "eval_loss": 0.125}
    scalars = tensorboard_scalars(tmp_path)
    assert set(scalars) == {"loss", "lr", "skipped_steps", "step_ms", "eval_loss"}
    for tag, points in scalars.items():
        expected = [(r["step"], r[tag]) for r in records if tag in r]
        assert [s for s, _ in points] == [s for s, _ in expected], tag
        assert [v for _, v in points] == pytest.approx([v for _, v in expected], rel=1e-6), tag

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    images = acc.Images("samples")
    assert [(i.step, i.width, i.height) for i in images] == [(6, 12, 8)]
    text = acc.Tensors("config/text_summary")
    assert text[0].step == 0 and b"LR" in text[0].tensor_proto.string_val[0]


def test_tensorboard_resume_continues_the_curves_without_duplicate_steps(tmp_path):
    """A run logs steps 1..8 and dies (its last checkpoint: step 5); the resumed run starts at 5
    and logs 6..10 with other values: TensorBoard shows 1..10 once, 6..8 from the resumed run."""
    pytest.importorskip("tensorboard")
    crashed = RunLogger(str(tmp_path), 10, report_to="tensorboard", config={"A": 1}, progress="lines")
    run_steps(crashed, range(1, 9))
    crashed.tb.flush()  # what a crash leaves on disk (the writer flushes every log step anyway)
    crashed.file.flush()
    resumed = RunLogger(str(tmp_path), 10, 5, report_to="tensorboard", config={"A": 1}, progress="lines")
    resumed.log_scalars(5, {"eval_loss": 9.0})  # a step the crashed run had: not logged again
    run_steps(resumed, range(6, 11), seed=100.0)
    resumed.close()
    crashed.close()

    loss = tensorboard_scalars(tmp_path)["loss"]
    assert [s for s, _ in loss] == list(range(1, 11))
    assert [v for _, v in loss] == pytest.approx([1 / s + (100.0 if s > 5 else 0.0) for s in range(1, 11)])
    assert "eval_loss" not in tensorboard_scalars(tmp_path)
    assert [r["step"] for r in read_jsonl(tmp_path)] == [*range(1, 9), *range(6, 11)]  # append-only log

    fresh = RunLogger(str(tmp_path), 3, report_to="tensorboard", progress="lines")  # RESUME="" in a used folder
    run_steps(fresh, range(1, 4), seed=7.0)
    fresh.close()
    assert tensorboard_scalars(tmp_path)["loss"] == [(s, pytest.approx(1 / s + 7.0)) for s in (1, 2, 3)]


def _wandb_history(run_folder) -> list[dict]:
    """The history rows of an offline W&B run file (run-<id>.wandb: a header, then records in
    32 KiB blocks, each record with a 7-byte header: crc, length, type full/first/middle/last)."""
    from wandb.proto import wandb_internal_pb2 as pb
    (path,) = glob.glob(os.path.join(run_folder, "run-*.wandb"))
    raw = open(path, "rb").read()
    assert raw[:4] == b":W&B"
    pos, chunk, rows = 7, b"", []
    while pos + 7 <= len(raw):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        _, n, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        if kind == 0:
            break
        chunk += raw[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows


def _logged_rows(folder, expected: int, wait_s: float = 30.0) -> list[dict]:
    """The run's history rows with a loss, read again for up to `wait_s` until `expected` are there:
    W&B's service process may still be writing the offline run file when finish() has returned on a
    loaded machine (the CI fast loop once read an empty history there)."""
    deadline = time.monotonic() + wait_s
    while True:
        rows = [r for r in _wandb_history(folder) if "loss" in r]
        if len(rows) >= expected or time.monotonic() > deadline:
            return rows
        time.sleep(0.5)


def test_wandb_offline_run_keeps_its_id_across_resume(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for name, sub in (("WANDB_DIR", "wandb_dir"), ("WANDB_CONFIG_DIR", "wandb_config"),
                      ("WANDB_CACHE_DIR", "wandb_cache"), ("WANDB_DATA_DIR", "wandb_data")):
        monkeypatch.setenv(name, str(tmp_path / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    from PIL import Image
    png = tmp_path / "grid.png"
    Image.new("RGB", (8, 8)).save(png)
    out = tmp_path / "out"

    logger = RunLogger(str(out), 6, report_to="wandb", config={"LR": 1e-4}, wandb_project="test",
                       progress="lines")
    run_steps(logger, range(1, 4))
    logger.log_images(3, "samples", str(png))
    logger.close()
    run_id = (out / "wandb_run_id.txt").read_text().strip()
    # W&B names an offline run's folder offline-run-<start, to the second>-<id>: a resume started
    # within the first run's second (this test is that fast) would share its folder. Real resumes
    # come minutes later; wait for the next second (a CI run once failed here on the collision).
    time.sleep(1 - time.time() % 1 + 0.01)
    resumed = RunLogger(str(out), 6, 3, report_to="wandb", config={"LR": 1e-4}, wandb_project="test",
                        progress="lines")
    run_steps(resumed, range(4, 7))
    resumed.close()

    assert (out / "wandb_run_id.txt").read_text().strip() == run_id
    first, second = sorted(glob.glob(str(out / "wandb" / f"offline-run-*-{run_id}")))
    records = read_jsonl(out)
    for folder, steps in ((first, [1, 2, 3]), (second, [4, 5, 6])):
        rows = _logged_rows(folder, len(steps))
        assert [r["_step"] for r in rows] == steps
        for row in rows:
            jsonl = next(r for r in records if r["step"] == row["_step"])
            assert {k: row[k] for k in ("loss", "lr", "step_ms")} == pytest.approx(
                {k: jsonl[k] for k in ("loss", "lr", "step_ms")})
    assert glob.glob(os.path.join(first, "files", "media", "images", "samples_*.png"))

    fresh = RunLogger(str(out), 2, report_to="wandb", wandb_project="test", progress="lines")
    fresh.close()
    assert (out / "wandb_run_id.txt").read_text().strip() != run_id  # a fresh start is a new W&B run


def test_report_to_is_checked_in_one_line(monkeypatch):
    assert check_report_to("") == [] and check_report_to("none") == []
    with pytest.raises(ConfigError) as e:
        check_report_to("nonsense")
    assert "REPORT_TO=nonsense" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="unknown logger 'mlflow'"):
        check_report_to("tensorboard,mlflow")
    monkeypatch.setitem(sys.modules, "wandb", None)  # find_spec then reports it missing
    with pytest.raises(ConfigError) as e:
        check_report_to("wandb")
    assert str(e.value) == "REPORT_TO=wandb: the wandb package is not installed (pip install wandb)"
    with pytest.raises(ConfigError, match="not installed"):
        RunLogger("unused", 10, report_to="wandb")
    if _installed("tensorboard"):
        assert check_report_to(" TensorBoard , tensorboard") == ["tensorboard"]


def test_progress_lines_without_a_terminal(tmp_path, capsys):
    logger = RunLogger(str(tmp_path), 10, progress="lines", progress_every_steps=4, progress_every_s=3600)
    run_steps(logger, range(1, 11), log_every=5)
    logger.close()
    out = capsys.readouterr().out
    assert "\r" not in out and logger.bar is None
    progress = [line for line in out.splitlines() if line.startswith("progress ")]
    assert [line.split()[1] for line in progress] == ["4/10", "8/10", "10/10"]
    assert progress[-1].startswith("progress 10/10 (100.0%) | ") and "elapsed " in progress[-1]
    assert "eta 0s" in progress[-1] and ("it/s" in progress[0] or "s/it" in progress[0])
    assert sum(line.startswith("step 00005/10 | loss 0.2 |") for line in out.splitlines()) == 1

    logger = RunLogger(str(tmp_path), 1000, 100, progress="lines", progress_every_s=0.0)  # time-based: every step
    run_steps(logger, range(101, 104), log_every=1000)
    logger.close()
    assert [line.split()[1] for line in capsys.readouterr().out.splitlines()] == ["101/1000", "102/1000", "103/1000"]


def test_auto_progress_follows_the_terminal(tmp_path, monkeypatch):
    class Tty:
        def __init__(self, tty):
            self.tty, self.text = tty, []

        def isatty(self):
            return self.tty

        def write(self, s):
            self.text.append(s)

        def flush(self):
            pass
    for tty in (True, False):
        monkeypatch.setattr(sys, "stdout", Tty(tty))
        logger = RunLogger(str(tmp_path), 3)
        assert (logger.bar is not None) == tty
        run_steps(logger, range(1, 4))
        logger.close()
        assert ("\r" in "".join(sys.stdout.text)) == tty


def test_paused_work_is_not_counted_in_step_ms(tmp_path):
    import time
    logger = RunLogger(str(tmp_path), 2, progress="lines")
    logger.step_done(1, None)
    with logger.paused():  # e.g. a validation pass before the step's log line
        time.sleep(0.3)
    logger.step_done(2, {"loss": 1.0})
    logger.close()
    assert read_jsonl(tmp_path)[-1]["step_ms"] < 200


# ----------------------------------------------------------------------------------------------
# settings and errors

def test_overrides_type_checked_and_case_insensitive():
    ns = {"MAX_STEPS": 10, "LR": 1e-4, "NAME": "x", "FLAG": False, "STEPS": [999, 749], "lower": 1}
    cfg = apply_overrides(ns, ["--max_steps=20", "--LR=3e-5", "--flag=true", "--steps=[999,500]",
                                          "--Name=y"])
    assert cfg == {"MAX_STEPS": 20, "LR": 3e-5, "NAME": "y", "FLAG": True, "STEPS": [999, 500]}
    assert apply_overrides(ns, ["--steps=999,1"])["STEPS"] == [999, 1]
    with pytest.raises(ConfigError, match="did you mean --max_steps"):
        apply_overrides(ns, ["--max_step=3"])
    with pytest.raises(ConfigError, match="expected int"):
        apply_overrides(ns, ["--max_steps=ten"])
    with pytest.raises(ConfigError, match="expected bool"):
        apply_overrides(ns, ["--flag=maybe"])
    with pytest.raises(ConfigError, match="--name=value"):
        apply_overrides(ns, ["max_steps=3"])


def test_run_main_config_error_is_one_line_exit_2():
    code = ("import sys; sys.path.insert(0, %r); from core import errors\n"
            "def main():\n    raise errors.ConfigError('bad thing')\n"
            "errors.run_main(main)\n") % ROOT
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == "error: bad thing"


# ----------------------------------------------------------------------------------------------
# collectives: one place puts their tensors on the group's device

COLLECTIVES = {"all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
               "broadcast_object_list", "barrier", "monitored_barrier", "reduce", "reduce_scatter",
               "reduce_scatter_tensor", "gather", "gather_object", "scatter", "scatter_object_list", "all_to_all",
               "all_to_all_single", "send", "recv", "isend", "irecv"}


def test_every_collective_goes_through_core_dist():
    """NCCL takes CUDA tensors only and gloo takes any, so a collective on a CPU tensor passes every
    CPU test and kills the first GPU run (data.text_cache.fill_text_cache's text-cache counts did).
    Only core/dist.py's helpers, which move each tensor to comm_device(), may call torch.distributed's
    collectives; everything else calls them."""
    import ast
    files = glob.glob(os.path.join(ROOT, "*.py"))
    for folder in ("core", "components", "data", "parallel", "algorithms", "tools", "demos"):
        files += glob.glob(os.path.join(ROOT, folder, "*.py"))
    offenders = []
    for path in files:
        if os.path.relpath(path, ROOT) == os.path.join("core", "dist.py"):
            continue
        for node in ast.walk(ast.parse(open(path).read())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVES
                    and isinstance(node.func.value, ast.Name) and node.func.value.id in ("dist", "torch.distributed")):
                offenders.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} dist.{node.func.attr}")
    assert not offenders, offenders


def _collectives_on_the_comm_device(rank, world):
    import torch
    seen = []
    real = torch.distributed.all_reduce

    def spy(t, *args, **kwargs):
        seen.append(t.device)
        return real(t, *args, **kwargs)
    torch.distributed.all_reduce = spy
    try:
        total = all_reduce(torch.tensor([float(rank + 1)]))
        assert total.item() == 3.0 and agree(rank == 0, True) == (False, True)
        assert mean_across_ranks({"loss": float(rank)}) == {"loss": 0.5}
    finally:
        torch.distributed.all_reduce = real
    assert seen and all(d == comm_device() for d in seen)
    assert broadcast_from_rank0(f"rank {rank}") == "rank 0"
    assert all_gather_objects(rank) == [0, 1]
    assert first_error("disk full" if rank == 1 else None) == "disk full"


@pytest.mark.slow
def test_collective_helpers_on_two_ranks():
    from tests.conftest import run_ranks
    run_ranks(_collectives_on_the_comm_device, 2)


def _shared_output_dir(rank, world, root):
    """Each rank's own folder stands for a node-local OUTPUT_DIR (or TEXT_CACHE_DIR): rank 1 does not
    see rank 0's file."""
    import socket
    ours = os.path.join(root, "shared")
    check_output_dir_shared(ours)  # one folder for all: fine
    check_output_dir_shared(ours, "TEXT_CACHE_DIR")  # twice in one folder: each probe is the run's own
    if rank == 0:  # rank 0 removes its probe after the last barrier
        assert not glob.glob(os.path.join(ours, ".shared_check*"))
    local = os.path.join(root, f"local{rank}")
    os.makedirs(local, exist_ok=True)
    for setting in ("OUTPUT_DIR", "TEXT_CACHE_DIR"):
        with pytest.raises(ConfigError, match=f"^{setting}=.*rank 1 on {socket.gethostname()} cannot see") as e:
            check_output_dir_shared(local, setting)
        assert "\n" not in str(e.value)


@pytest.mark.slow
def test_an_output_dir_that_some_rank_cannot_see_fails_on_every_rank(tmp_path):
    from tests.conftest import run_ranks
    os.makedirs(tmp_path / "shared")
    run_ranks(_shared_output_dir, 2, str(tmp_path))


def test_the_text_cache_is_checked_as_shared_where_it_lies_outside_the_output_dir(tmp_path):
    """TEXT_CACHE_DIR holds every rank's share of the text and latent caches: checked (writable, then
    shared) like OUTPUT_DIR unless it lies inside it; unset, it is OUTPUT_DIR/text_cache."""
    out = str(tmp_path / "out")
    os.makedirs(out)
    os.symlink(tmp_path / "elsewhere", tmp_path / "out" / "linked")
    assert shared_folders({"OUTPUT_DIR": out, "TEXT_CACHE_DIR": ""}) == {"OUTPUT_DIR": out}
    assert shared_folders({"OUTPUT_DIR": out, "TEXT_CACHE_DIR": os.path.join(out, "text_cache")}) == {"OUTPUT_DIR": out}
    assert shared_folders({"OUTPUT_DIR": out + "/", "TEXT_CACHE_DIR": out}) == {"OUTPUT_DIR": out + "/"}
    for cache in (str(tmp_path / "cache"), out + "_cache", os.path.join(out, "linked", "cache")):
        assert shared_folders({"OUTPUT_DIR": out, "TEXT_CACHE_DIR": cache}) == {"OUTPUT_DIR": out,
                                                                              "TEXT_CACHE_DIR": cache}
    with pytest.raises(ConfigError, match="^TEXT_CACHE_DIR='/proc/x' is not writable"):
        check_output_dir("/proc/x", "TEXT_CACHE_DIR")


@pytest.mark.slow  # launches the scripts
@pytest.mark.parametrize("script,flag", [("train_dmd.py", "--help"), ("train_flux_kontext.py", "-h")])
def test_help_prints_every_setting_grouped_and_exits_0(script, flag):
    """--help / -h: every setting with its default, type and comment, under the script's group
    comments."""
    from tests.conftest import launch
    from tests.test_readme import constants
    r = launch(script, [flag], ranks=1, timeout=120)
    listed = re.findall(r"^  --([a-z0-9_]+)=", r.stdout, flags=re.M)
    assert listed == [n.lower() for n in constants(script)]
    assert "\nmodels and data\n" in r.stdout and '  --seed=0 (int): ' in r.stdout


# ----------------------------------------------------------------------------------------------
# an unexpected failure is locatable from the log, the output folder and torchrun's summary

_FAILING_STEP = """
import runpy, sys
sys.path.insert(0, {root!r})
import algorithms.flux_kontext as km

def broken_loss(*args, **kwargs):
    raise RuntimeError("injected failure in the loss")

km.flow_matching_loss = broken_loss
sys.argv = ["train_flux_kontext.py", "--max_steps=2", "--output_dir={out}", "--sample_every=0", "--val_every=0"]
runpy.run_path({script!r}, run_name="__main__")
"""


@pytest.mark.slow
def test_an_unexpected_error_in_a_step_shows_its_traceback(tmp_path):
    import subprocess
    from tests.conftest import ROOT, launch_env
    out, error_file = tmp_path / "out", tmp_path / "elastic_error.json"
    driver = tmp_path / "driver.py"
    driver.write_text(_FAILING_STEP.format(root=ROOT, out=out, script=os.path.join(ROOT, "train_flux_kontext.py")))
    r = subprocess.run([sys.executable, str(driver)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=launch_env(TORCHELASTIC_ERROR_FILE=str(error_file)))
    assert r.returncode == 1, r.stderr[-3000:]
    assert "Traceback (most recent call last)" in r.stderr and "in micro_batch_loss" in r.stderr, r.stderr[-3000:]
    assert r.stderr.rstrip().endswith("[rank 0] error: RuntimeError: injected failure in the loss")
    saved = (out / "error_rank0.txt").read_text()
    assert "in micro_batch_loss" in saved and "in broken_loss" in saved
    record = json.loads(error_file.read_text())["message"]
    assert "injected failure" in record["message"] and "micro_batch_loss" in record["extraInfo"]["py_callstack"]


def test_launches_keep_the_callers_pythonpath(tmp_path, monkeypatch):
    import subprocess
    from tests.conftest import ROOT, launch_env
    (tmp_path / "only_on_the_callers_path.py").write_text("VALUE = 7\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    env = launch_env()
    assert env["PYTHONPATH"].split(os.pathsep) == [ROOT, str(tmp_path)]
    r = subprocess.run([sys.executable, "-c", "import only_on_the_callers_path, core.dist; "
                        "print(only_on_the_callers_path.VALUE)"], env=env, capture_output=True, text=True,
                       cwd=tmp_path)
    assert r.stdout.strip() == "7", r.stderr
