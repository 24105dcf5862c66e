"""What a step is worth: model FLOPs by the peak they run against (MFU), throughput, CUDA peaks and
the logging window's means.

    python -m pytest tests/test_trainer.py -q
"""
from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import precision
from core.dist import all_reduce, mean_across_ranks

# dense tensor-core peaks (TFLOP/s, no sparsity) of the GPUs MFU is reported for, by device name (NVIDIA's
# datasheets): bf16/fp16, TF32 (fp32 matmuls with allow_tf32), fp32 without TF32, float8 (FP8=...: twice bf16's;
# None where the GPU has no float8 tensor cores, which parallel/float8.check_fp8 refuses)
PEAK_TFLOPS = {"H100 PCIe": (756, 378, 51, 1513), "H100 NVL": (835, 418, 60, 1671), "H100": (989, 495, 67, 1979),
               "H200": (989, 495, 67, 1979), "GH200": (989, 495, 67, 1979), "B200": (2250, 1100, 80, 4500),
               "A100": (312, 156, 19.5, None), "L40S": (362, 181, 91.6, 733), "L4": (121, 60, 30.3, 242.5),
               "A10G": (70, 35, 31.2, None), "RTX 4090": (165, 82.6, 82.6, 330.3)}
PEAK_KINDS = ("bf16", "tf32", "fp32", "fp8")
FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def peak_tflops(device: torch.device) -> dict[str, float] | None:
    """{"bf16", "tf32", "fp32": the GPU's dense peak} from PEAK_TFLOPS (the first name that
    matches), else None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((dict(zip(PEAK_KINDS, v)) for k, v in PEAK_TFLOPS.items() if k in name), None)


def flop_kind(dtype: torch.dtype) -> str:
    """Which peak a matmul of `dtype` runs against: fp32 is TF32 where torch allows it."""
    if dtype in (torch.bfloat16, torch.float16):
        return "bf16"
    if dtype in FLOAT8:
        return "fp8"
    return "tf32" if precision.tf32_matmuls() else "fp32"


def tensor_flop_kind(t: torch.Tensor) -> str:
    """flop_kind of a matmul's operand. torchao's float8 training tensors report their high-precision dtype while
    the matmul runs on their float8 codes (`_data`, torch._scaled_mm inside their dispatch, which a mode above them
    does not see): they count against the float8 peak."""
    codes = getattr(t, "_data", None)
    return flop_kind(codes.dtype if torch.is_tensor(codes) and codes.dtype in FLOAT8 else t.dtype)


class _FlopCount(TorchDispatchMode):
    """Sums the FLOPs of the ops torch's flop counter knows (matmuls, convolutions, attention) as
    they run, by the peak they run against (flop_kind of their first input). torch's
    FlopCounterMode also tracks modules by wrapping their outputs in autograd functions, which
    changes the order gradients are summed in (not bit-identical to an uncounted step); this mode
    only watches, so a counted step computes exactly what an uncounted one does."""

    def __init__(self):
        super().__init__()
        from torch.utils.flop_counter import flop_registry
        self.registry, self.by_kind = flop_registry, {}

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        count = self.registry.get(func._overloadpacket)
        if count is not None:
            first = next((a for a in args if torch.is_tensor(a)), None)
            kind = tensor_flop_kind(first) if first is not None else "bf16"
            self.by_kind[kind] = self.by_kind.get(kind, 0) + count(*args, **kwargs, out_val=out)
        return out


class _Counted:
    """Counts what one set of modules' own forward calls dispatch, by peak kind, each call's count
    times `factor(grad enabled)`; nested calls of the set count once."""

    def __init__(self, modules, factor):
        self.factor, self.active, self.by_kind, self._counter, self._depth = factor, False, {}, None, 0
        for m in modules:
            m.register_forward_pre_hook(self._enter)
            m.register_forward_hook(self._exit)

    def _enter(self, module, args):
        self._depth += 1
        if self.active and self._depth == 1:
            self._counter = _FlopCount().__enter__()
            self._grad = torch.is_grad_enabled()

    def _exit(self, module, args, output):
        self._depth -= 1
        if self._counter is not None and self._depth == 0:
            self._counter.__exit__(None, None, None)
            for kind, n in self._counter.by_kind.items():
                self.by_kind[kind] = self.by_kind.get(kind, 0) + n * self.factor(self._grad)
            self._counter = None


class ModelFlops:
    """MFU's numerator: model FLOPs. Counts what the watched models' own forward calls dispatch
    (matmuls, convolutions, attention), x3 for a call run with gradients enabled (its backward
    computes input and weight gradients, each as much as the forward), by the peak each runs
    against. So the VAE, text encoders and optimizer are not in it, nor AC's recomputation. For
    HFU the forwards of the activation-checkpointed units run with gradients are counted apart
    (`recomputed`): backward runs each of them once more."""

    def __init__(self, models: list[torch.nn.Module]):
        units = [u for m in models for u in m.modules() if getattr(u, "activation_checkpointed", False)]
        self._model = _Counted(models, lambda grad: 3 if grad else 1)
        self._recomputed = _Counted(units, lambda grad: 1 if grad else 0)

    @property
    def by_kind(self) -> dict:
        return self._model.by_kind

    @property
    def recomputed(self) -> dict:
        return self._recomputed.by_kind

    @contextlib.contextmanager
    def counting(self):
        """Count the watched forwards inside: {kind: FLOPs} in `by_kind` (and `recomputed`)."""
        for c in (self._model, self._recomputed):
            c.active, c.by_kind = True, {}
        try:
            yield self
        finally:
            self._model.active = self._recomputed.active = False


def watch_model_flops(run, models: list[torch.nn.Module], vae: torch.nn.Module | None = None) -> None:
    """The models whose forward and backward are the step's model FLOPs (the trained, frozen
    teacher and fake score networks; not the VAE or text encoders), where MFU is reported; `vae`:
    its forwards are counted apart (`vae_tflop`, and in HFU)."""
    if peak_tflops(run.d.device) is not None and not run.config["COMPILE"]:
        run.model_flops = ModelFlops(models)
        run.vae_flops = ModelFlops([vae]) if vae is not None else None


def _seconds_at_peak(by_kind: dict, peaks: dict) -> float:
    return sum(n / (peaks[k] * 1e12) for k, n in by_kind.items())


def _add(*counts: dict) -> dict:
    out = {}
    for c in counts:
        for k, n in c.items():
            out[k] = out.get(k, 0) + n
    return out


@contextlib.contextmanager
def counting_flops(run, kind: str, logs: dict):
    """Around a step's forwards and backwards: the first step of each `kind` counts on this rank
    the watched models' FLOPs (ModelFlops), their recomputation under AC and the VAE's forwards;
    later steps of that kind reuse the counts. logs gets `peak_s` (the seconds the model FLOPs take
    at the GPU's peaks: MFU = peak_s / step time), `hw_peak_s` (the same for model + recomputation
    + VAE: HFU), `model_tflop` and `vae_tflop`. Only where MFU is reported (a GPU of PEAK_TFLOPS;
    watch_model_flops): watching every op costs more than a small model's step. Not under COMPILE
    (a dispatch mode would change what dynamo traces): no MFU there."""
    counter = run.model_flops
    if counter is None or kind in run.flops:
        yield
    else:
        vae = run.vae_flops.counting() if run.vae_flops is not None else contextlib.nullcontext()
        with counter.counting(), vae:
            yield
        run.flops[kind] = {"model": dict(counter.by_kind), "recomputed": dict(counter.recomputed),
                           "vae": dict(run.vae_flops.by_kind) if run.vae_flops is not None else {}}
    if kind in run.flops:
        peaks, counts = peak_tflops(run.d.device), run.flops[kind]
        logs["peak_s"] = _seconds_at_peak(counts["model"], peaks)
        logs["hw_peak_s"] = _seconds_at_peak(_add(counts["model"], counts["recomputed"], counts["vae"]), peaks)
        logs["model_tflop"] = sum(counts["model"].values()) / 1e12
        logs["vae_tflop"] = sum(counts["vae"].values()) / 1e12


def throughput(metrics: dict, work: dict, d) -> dict:
    """The logging window's rates from its mean step time (`step_s`, popped): images/s (and
    tokens/s) over all ranks, the mean data wait against the rest of the step (compute_ms), MFU
    (this rank's model FLOPs at the GPU's peaks, `peak_s`, over the step time) where the GPU is
    known, and on CUDA the peak memory allocated and reserved since setup (max over ranks: one
    collective, on logging steps only)."""
    step_s, out = metrics.pop("step_s"), {}
    peak_s, hw_peak_s = metrics.pop("peak_s", None), metrics.pop("hw_peak_s", None)
    for name, n in work.items():
        out[f"{name}_per_s"] = n / step_s
    if "data_wait_ms" in metrics:
        out["compute_ms"] = step_s * 1000 - metrics["data_wait_ms"]
    if peak_s is not None:
        out["mfu"] = peak_s / step_s
    if hw_peak_s is not None:  # model FLOPs plus AC's recomputation and the VAE's forwards
        out["hfu"] = hw_peak_s / step_s
    if d.device.type == "cuda":
        mem = torch.tensor([torch.cuda.max_memory_allocated(d.device), torch.cuda.max_memory_reserved(d.device)],
                           dtype=torch.float64, device=d.device)
        allocated, reserved = all_reduce(mem, op=torch.distributed.ReduceOp.MAX).tolist()
        out.update(cuda_peak_gib=allocated / 2**30, cuda_reserved_gib=reserved / 2**30)
    return out


def window_add(window: dict, logs: dict) -> None:
    """Collect a step's values for the next log line: each metric is averaged over the steps of
    the logging window that produced it (so DMD2's loss_dm, made every DFAKE_GEN_UPDATE_RATIO
    steps, shows up whenever the window held a generator step)."""
    for k, v in logs.items():
        total, count = window.get(k, (0.0, 0))
        window[k] = (total + (v.double() if torch.is_tensor(v) else float(v)), count + 1)  # no host sync


def window_metrics(window: dict, extra: dict) -> dict:
    """The log line: window means, losses averaged over ranks too (grad norms are global already)."""
    means = {k: float(total) / count for k, (total, count) in window.items()}  # the logging step's syncs
    metrics = mean_across_ranks({k: v for k, v in means.items() if k.startswith("loss")})
    metrics.update({k: v for k, v in means.items() if not k.startswith("loss")}, **extra)
    window.clear()
    return dict(sorted(metrics.items()))
