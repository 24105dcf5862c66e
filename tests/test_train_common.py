"""train_common.py: the shared settings' one meaning (when logs, samples and checkpoints are due),
the log window, the pipeline a folder holds, the checks both scripts make before any work, and the
one LR warmup.

    python -m pytest tests/test_train_common.py -q
"""
from __future__ import annotations

import contextlib
import json
import os

import pytest
import torch

import run_utils
import train_common
import train_dmd
import train_flux_kontext
from run_utils import ConfigError


def test_due_counts_steps_and_zero_turns_off():
    assert [s for s in range(1, 11) if train_common.due(s, 4, 10)] == [4, 8, 10]
    assert [s for s in range(1, 11) if train_common.due(s, 4)] == [4, 8]
    assert not any(train_common.due(s, 0, 10) for s in range(1, 11))  # 0: never, not even at the end


def test_window_means_each_metric_over_the_steps_that_made_it():
    window = {}
    train_common.window_add(window, {"loss_dm": 1.0, "loss_fake": 2.0})
    train_common.window_add(window, {"loss_fake": 4.0, "grad_norm": 3.0})
    assert train_common.window_metrics(window, {"lr": 0.5}) == {"grad_norm": 3.0, "loss_dm": 1.0,
                                                                  "loss_fake": 3.0, "lr": 0.5}
    assert window == {}


def test_pipeline_of_reads_model_index(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionXLPipeline"}))
    assert train_common.pipeline_of(str(tmp_path), "train_dmd.py") == "StableDiffusionXLPipeline"
    # a pipeline the script does not train: the script's default, whose folder check names what is missing
    assert train_common.pipeline_of(str(tmp_path), "train_flux_kontext.py") == "FluxKontextPipeline"
    assert train_common.pipeline_of(str(tmp_path / "missing"), "train_dmd.py") == "StableDiffusionPipeline"


@pytest.mark.parametrize("script", [train_dmd, train_flux_kontext], ids=["dmd", "kontext"])
@pytest.mark.parametrize("change, message", [
    ({"LOG_EVERY": -1}, "LOG_EVERY, SAVE_EVERY, SAMPLE_EVERY >= 0"), ({"GRAD_ACCUM": 0}, "GRAD_ACCUM >= 1"),
    ({"PRECISION": "fp8"}, "fp8"), ({"LORA_RANK": -1}, "LORA_RANK=-1"), ({"PARALLELISM": "zero"}, "PARALLELISM"),
    ({"EXPORT_DTYPE": "int4"}, "int4"),
])
def test_shared_settings_are_checked_alike(script, change, message):
    settings = {**run_utils.script_constants(vars(script)), **change}
    with pytest.raises(ConfigError, match=message):
        train_common.check_shared_settings(settings)


@pytest.mark.parametrize("first_step, factors", [(0, [0.0, 0.4, 0.8, 1.0]), (1, [0.4, 0.8, 1.0, 1.0])])
def test_one_warmup_two_conventions(first_step, factors):
    """first_step=0: the official DMD2 schedule (LR 0 at the first iteration, fractional warmup
    allowed); 1: the first update already at LR / warmup (the Kontext script's)."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = run_utils.warmup_scheduler(opt, 2.5, first_step=first_step)
    seen = []
    for _ in factors:
        seen.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert seen == pytest.approx(factors)


def _reads_per_step(script: str, args: list[str], tmp_path) -> int:
    """Tensor-to-host reads per step outside logging steps (tests/sync_count_driver.py): the
    difference between a 4-step and a 2-step run whose only logging step is the last."""
    import json
    import subprocess
    import sys
    from tests.conftest import ROOT, launch_env
    procs = {steps: subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "sync_count_driver.py"), script, *args,
                                      f"--max_steps={steps}", "--log_every=100", "--save_every=0", "--sample_every=0",
                                      "--precision=fp32", f"--output_dir={tmp_path / str(steps)}"],
                                     cwd=ROOT, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for steps in (2, 4)}  # both at once: their startup overlaps
    total = {}
    for steps, proc in procs.items():
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-3000:]
        line = next(line for line in out.splitlines() if line.startswith("SYNCS "))
        total[steps] = sum(json.loads(line[6:]).values())
    return (total[4] - total[2]) // 2


@pytest.mark.slow
@pytest.mark.parametrize("script, args", [("train_dmd.py", ["--dfake_gen_update_ratio=1"]),
                                          ("train_flux_kontext.py", ["--val_every=0", "--grad_accum=2"])],
                         ids=["dmd", "kontext"])
def test_one_host_sync_per_step_outside_logging_steps(script, args, tmp_path):
    """Losses and grad norms stay device tensors until a logging step; the step's one read is the
    collective that agrees on finiteness and stop signals (train_common.apply_updates). Before:
    4 reads per DMD2 step (loss_dm, loss_fake, two grad norms) and 3 per Kontext step at
    GRAD_ACCUM=2 (two losses, the grad norm), plus two agreement reads on more than one rank."""
    assert _reads_per_step(script, args, tmp_path) == 1


def test_throughput_fields_from_the_window(monkeypatch):
    """images/s (and tokens/s) from the window's mean step time, the data wait against the rest,
    MFU against the GPU's peak where one is known; nothing CUDA on a CPU run."""
    d = type("D", (), {"device": torch.device("cpu")})()
    metrics = {"loss": 1.0, "step_s": 0.5, "data_wait_ms": 100.0, "flops": 2e12}
    out = train_common.throughput(metrics, {"images": 64, "tokens": 64 * 2048}, d)
    assert out == pytest.approx({"images_per_s": 128.0, "tokens_per_s": 128.0 * 2048, "compute_ms": 400.0})
    assert "step_s" not in metrics and "flops" not in metrics  # turned into rates, not logged raw
    assert train_common.peak_tflops(torch.device("cpu")) is None
    monkeypatch.setattr(train_common, "peak_tflops", lambda device: 8.0)  # a GPU with an 8 TFLOP/s peak
    out = train_common.throughput({"step_s": 0.5, "flops": 2e12}, {"images": 1}, d)
    assert out["mfu"] == pytest.approx(2e12 / 0.5 / 8e12)


def test_flops_counted_once_per_kind_of_step(monkeypatch):
    cpu = type("D", (), {"device": torch.device("cpu")})()
    run = type("R", (), {"config": {"COMPILE": False}, "flops": {}, "d": cpu})()
    logs = {}
    with train_common.counting_flops(run, "big", logs):  # no MFU on a CPU: nothing counted
        torch.randn(8, 16) @ torch.randn(16, 4)
    assert logs == {} and run.flops == {}
    monkeypatch.setattr(train_common, "peak_tflops", lambda device: 8.0)  # a GPU with a known peak
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    logs = {}
    with train_common.counting_flops(run, "big", logs):
        a @ b
    assert logs["flops"] == run.flops["big"] == 2 * 8 * 16 * 4
    logs = {}
    with train_common.counting_flops(run, "big", logs):
        a @ b @ torch.randn(4, 4)  # not counted again: the kind's count is reused
    assert logs["flops"] == 2 * 8 * 16 * 4
    compiled = type("R", (), {"config": {"COMPILE": True}, "flops": {}, "d": cpu})()
    logs = {}
    with train_common.counting_flops(compiled, "big", logs):
        a @ b
    assert logs == {} and compiled.flops == {}


def test_counting_flops_computes_exactly_what_an_uncounted_step_does():
    """The FLOP-counting mode only watches: a counted forward and backward gives bit-identical
    outputs and gradients (torch's FlopCounterMode reorders gradient sums through its module
    tracker; the resume tests caught that when counting ran on CPU)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.SiLU(), torch.nn.Conv2d(8, 8, 3),
                                torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 4))
    x = torch.randn(4, 3, 8, 8)
    results = []
    for counted in (False, True):
        model.zero_grad(set_to_none=True)
        counter = train_common._FlopCount() if counted else contextlib.nullcontext()
        with counter:
            out = model(x)
            (out ** 2).sum().backward()
        results.append([out.detach()] + [p.grad for p in model.parameters()])
    assert counter.total > 2 * 4 * 8 * 6 * 6 * 8 * 3 * 3  # the convolutions and the linear layer were counted
    assert all(torch.equal(a, b) for a, b in zip(*results))
