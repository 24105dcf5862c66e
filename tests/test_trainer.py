"""components/trainer.py: the shared settings' one meaning (when logs, samples and checkpoints are due),
the log window, the pipeline a folder holds, the checks both scripts make before any work, and the
one LR warmup.

    python -m pytest tests/test_trainer.py -q
"""
from __future__ import annotations

import contextlib
import json
import os

import pytest
import torch

import components.metrics
import fsdp_utils
import train_dmd
import train_flux_kontext
from components.config import script_constants
from core.errors import ConfigError
from components.metrics import (ModelFlops, counting_flops, flop_kind, _FlopCount, peak_tflops, throughput,
                                watch_model_flops, window_add, window_metrics)
from components.optim import warmup_scheduler
from components.trainer import Run, check_shared_settings, due, pipeline_of


def test_due_counts_steps_and_zero_turns_off():
    assert [s for s in range(1, 11) if due(s, 4, 10)] == [4, 8, 10]
    assert [s for s in range(1, 11) if due(s, 4)] == [4, 8]
    assert not any(due(s, 0, 10) for s in range(1, 11))  # 0: never, not even at the end


def test_window_means_each_metric_over_the_steps_that_made_it():
    window = {}
    window_add(window, {"loss_dm": 1.0, "loss_fake": 2.0})
    window_add(window, {"loss_fake": 4.0, "grad_norm": 3.0})
    assert window_metrics(window, {"lr": 0.5}) == {"grad_norm": 3.0, "loss_dm": 1.0,
                                                                  "loss_fake": 3.0, "lr": 0.5}
    assert window == {}


def test_pipeline_of_reads_model_index(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionXLPipeline"}))
    assert pipeline_of(str(tmp_path), "train_dmd.py") == "StableDiffusionXLPipeline"
    # a pipeline the script does not train: the script's default, whose folder check names what is missing
    assert pipeline_of(str(tmp_path), "train_flux_kontext.py") == "FluxKontextPipeline"
    assert pipeline_of(str(tmp_path / "missing"), "train_dmd.py") == "StableDiffusionPipeline"


@pytest.mark.parametrize("script", [train_dmd, train_flux_kontext], ids=["dmd", "kontext"])
@pytest.mark.parametrize("change, message", [
    ({"LOG_EVERY": -1}, "LOG_EVERY, SAVE_EVERY, SAMPLE_EVERY >= 0"), ({"GRAD_ACCUM": 0}, "GRAD_ACCUM >= 1"),
    ({"PRECISION": "fp8"}, "fp8"), ({"LORA_RANK": -1}, "LORA_RANK=-1"), ({"PARALLELISM": "zero"}, "PARALLELISM"),
    ({"EXPORT_DTYPE": "int4"}, "int4"),
])
def test_shared_settings_are_checked_alike(script, change, message):
    settings = {**script_constants(vars(script)), **change}
    with pytest.raises(ConfigError, match=message):
        check_shared_settings(settings)


@pytest.mark.parametrize("first_step, factors", [(0, [0.0, 0.4, 0.8, 1.0]), (1, [0.4, 0.8, 1.0, 1.0])])
def test_one_warmup_two_conventions(first_step, factors):
    """first_step=0: the official DMD2 schedule (LR 0 at the first iteration, fractional warmup
    allowed); 1: the first update already at LR / warmup (the Kontext script's)."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = warmup_scheduler(opt, 2.5, first_step=first_step)
    seen = []
    for _ in factors:
        seen.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert seen == pytest.approx(factors)


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
@pytest.mark.parametrize("first_step", [0, 1])
def test_decaying_schedules_are_diffusers(schedule, first_step):
    """LR_SCHEDULE cosine / linear: diffusers' get_cosine_schedule_with_warmup / get_linear_schedule_with_warmup
    factors at every step (first_step 1: one step ahead), down to 0 at MAX_STEPS; a resumed scheduler goes on."""
    from diffusers.optimization import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup
    make = get_cosine_schedule_with_warmup if schedule == "cosine" else get_linear_schedule_with_warmup
    total, warmup = 20, 4

    def factors(sched, opt, n):
        out = []
        for _ in range(n):
            out.append(sched.get_last_lr()[0])
            opt.step()
            sched.step()
        return out
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    ref_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    ours = factors(warmup_scheduler(opt, warmup, first_step, schedule, total), opt, total)
    theirs = factors(make(ref_opt, warmup, total), ref_opt, total + 1)[first_step:][:total]
    assert ours == pytest.approx(theirs, abs=1e-12)
    resumed = warmup_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), warmup, first_step)
    resumed.load_state_dict(warmup_scheduler(opt, warmup, first_step, schedule, total).state_dict())
    assert resumed.lr_lambdas[0](7) == pytest.approx(ours[7])


def _reads_per_step(script: str, args: list[str], tmp_path) -> int:
    """Tensor-to-host reads per step outside logging steps (tests/sync_count_driver.py): the
    difference between a 4-step and a 2-step run whose only logging step is the last."""
    import json
    from tests.conftest import ROOT, finish, start

    procs = {
        steps: start(
            os.path.join(ROOT, "tests", "sync_count_driver.py"),
            [script, *args, f"--max_steps={steps}", "--log_every=100", "--save_every=0", "--sample_every=0",
             "--precision=fp32", f"--output_dir={tmp_path / str(steps)}"],
            ranks=1,
        )
        for steps in (2, 4)
    }  # both at once: their startup overlaps
    total = {}
    for steps, proc in procs.items():
        rc, out = finish(proc)
        assert rc == 0, out[-3000:]
        line = next(line for line in out.splitlines() if line.startswith("SYNCS "))
        total[steps] = sum(json.loads(line[6:]).values())
    return (total[4] - total[2]) // 2


@pytest.mark.slow
@pytest.mark.parametrize("script, args", [("train_dmd.py", ["--dfake_gen_update_ratio=1"]),
                                          ("train_flux_kontext.py", ["--val_every=0", "--grad_accum=2"])],
                         ids=["dmd", "kontext"])
def test_one_host_sync_per_step_outside_logging_steps(script, args, tmp_path):
    """Losses and grad norms stay device tensors until a logging step; the step's one read is the
    collective that agrees on finiteness and stop signals (components.trainer.apply_updates): no
    read of loss_dm, loss_fake or a grad norm on a step that logs nothing."""
    assert _reads_per_step(script, args, tmp_path) == 1


def test_throughput_fields_from_the_window():
    """images/s (and tokens/s) from the window's mean step time, the data wait against the rest,
    MFU = the model FLOPs' time at the GPU's peaks over the step time; nothing CUDA on a CPU run."""
    d = type("D", (), {"device": torch.device("cpu")})()
    metrics = {"loss": 1.0, "step_s": 0.5, "data_wait_ms": 100.0}
    out = throughput(metrics, {"images": 64, "tokens": 64 * 2048}, d)
    assert out == pytest.approx({"images_per_s": 128.0, "tokens_per_s": 128.0 * 2048, "compute_ms": 400.0})
    assert "step_s" not in metrics  # turned into rates, not logged raw
    assert peak_tflops(torch.device("cpu")) is None
    metrics = {"step_s": 0.5, "peak_s": 0.2}
    assert throughput(metrics, {"images": 1}, d)["mfu"] == pytest.approx(0.4)
    assert "peak_s" not in metrics


class _Net(torch.nn.Module):
    def __init__(self, checkpointed: bool = False):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)
        if checkpointed:  # AC as the recipes apply it: a's forward runs again in backward
            fsdp_utils.checkpoint_activations(self.a)

    def forward(self, x):
        return self.b(self.a(x))


def test_model_flops_are_the_watched_forwards_times_three_with_gradients():
    import precision
    fwd = 2 * 8 * 16 * 32 + 2 * 8 * 32 * 4
    for checkpointed in (False, True):
        net, other = _Net(checkpointed), torch.nn.Linear(16, 16)
        flops = ModelFlops([net])
        x = torch.randn(8, 16)
        net(x).sum().backward()  # not counting yet
        with flops.counting():
            net(x).sum().backward()  # forward + backward: 3x, the recomputation not counted
            with torch.no_grad():
                net(x)  # forward only: 1x
            other(x) @ torch.randn(16, 16)  # not a watched model
        assert flops.by_kind == {"tf32" if precision.tf32_matmuls() else "fp32": 4 * fwd}, checkpointed


def test_float8_linears_count_against_the_float8_peak():
    """FP8's Linears (torchao Float8Linear, emulated here) hand their matmuls float8 training tensors that report
    bf16: each of the three matmuls per Linear (forward, grad input, grad weight) counts as "fp8", the peak they
    run against on the GPU; the same model without float8 counts "bf16". Every GPU whose float8 peak is known has
    it above its bf16 peak and about twice it at most (the datasheets round: L40S 733 against 362; a sparse figure
    entered by mistake would be 4x)."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    fwd = 2 * 2 * 32 * 64 * 64  # two 64 x 64 Linears on 32 rows
    for recipe in ("tensorwise", "rowwise"):
        counts = {}
        for fp8 in (False, True):
            net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)).to(torch.bfloat16)
            if fp8:
                config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
                convert_to_float8_training(net, config=config)
            flops = ModelFlops([net])
            with flops.counting():
                net(torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)).float().sum().backward()
            counts[fp8] = flops.by_kind
        assert counts == {False: {"bf16": 3 * fwd}, True: {"fp8": 3 * fwd}}, recipe
    for name, peaks in components.metrics.PEAK_TFLOPS.items():
        assert len(peaks) == len(components.metrics.PEAK_KINDS), name
        assert peaks[3] is None or peaks[0] < peaks[3] <= 2.05 * peaks[0], name


def test_flops_counted_once_per_kind_of_step(monkeypatch):
    cpu = type("D", (), {"device": torch.device("cpu")})()
    run = Run({"COMPILE": False}, "", cpu, None, None, None)
    watch_model_flops(run, [torch.nn.Linear(4, 4)])  # no MFU on a CPU: nothing watched
    assert run.model_flops is None
    logs = {}
    with counting_flops(run, "big", logs):
        pass
    assert logs == {} and run.flops == {}
    monkeypatch.setattr(components.metrics, "peak_tflops", lambda device: {"bf16": 8.0, "tf32": 4.0, "fp32": 1.0})
    net, vae = _Net(checkpointed=True).to(torch.bfloat16), torch.nn.Linear(16, 8).to(torch.bfloat16)
    watch_model_flops(run, [net], vae)
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    logs = {}
    with counting_flops(run, "big", logs):
        with torch.no_grad():
            latents = vae(x)  # the VAE: counted apart, and in the hardware count
        net(x + latents.sum()).sum().backward()  # AC: a's forward runs again in backward
    fwd, a_fwd, vae_fwd = 2 * 8 * 16 * 32 + 2 * 8 * 32 * 4, 2 * 8 * 16 * 32, 2 * 8 * 16 * 8
    assert run.flops["big"]["model"] == {"bf16": 3 * fwd}
    assert run.flops["big"]["vae"] == {"bf16": vae_fwd}
    assert run.flops["big"]["recomputed"] == {"bf16": a_fwd}  # backward runs a's forward once more
    assert logs["peak_s"] == pytest.approx(3 * fwd / 8e12)
    assert logs["hw_peak_s"] == pytest.approx((3 * fwd + a_fwd + vae_fwd) / 8e12)
    assert logs["vae_tflop"] == pytest.approx(vae_fwd / 1e12)
    logs = {}
    with counting_flops(run, "big", logs), torch.no_grad():
        net(x)  # not counted again: the kind's count is reused
    assert logs["model_tflop"] == pytest.approx(3 * fwd / 1e12)
    out = components.metrics.throughput({"step_s": 2 * logs["hw_peak_s"], **logs}, {}, cpu)
    assert out["hfu"] == pytest.approx(0.5) and out["mfu"] < out["hfu"]
    compiled = Run({"COMPILE": True}, "", cpu, None, None, None)
    watch_model_flops(compiled, [net])
    assert compiled.model_flops is None


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
        counter = _FlopCount() if counted else contextlib.nullcontext()
        with counter:
            out = model(x)
            (out ** 2).sum().backward()
        results.append([out.detach()] + [p.grad for p in model.parameters()])
    assert counter.total > 2 * 4 * 8 * 6 * 6 * 8 * 3 * 3  # the convolutions and the linear layer were counted
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_flop_kind_reads_tf32_through_the_api_that_set_it():
    """torch >= 2.9 refuses to read the legacy allow_tf32 flag once fp32_precision was set (as
    precision.apply_tf32 does): the first GPU run's DMD2 steps died on it."""
    import precision
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision if hasattr(matmul, "fp32_precision") else matmul.allow_tf32
    try:
        for on in (True, False):
            precision.apply_tf32(on)
            assert flop_kind(torch.float32) == ("tf32" if on else "fp32")
        assert flop_kind(torch.bfloat16) == "bf16"
    finally:
        if hasattr(matmul, "fp32_precision"):
            matmul.fp32_precision = before
        else:
            matmul.allow_tf32 = before
