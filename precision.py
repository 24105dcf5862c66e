"""Named precision modes -> storage dtypes, FSDP2 MixedPrecisionPolicy, and a dtype audit.

One place decides every dtype in a run, so nothing is upcast behind the user's back:

    mode         trainable storage  compute  grad reduction  optimizer state
    fp32         fp32               fp32     fp32            fp32
    bf16-mixed   fp32 (master)      bf16     fp32            fp32
    bf16         bf16               bf16     bf16            bf16   (memory-starved runs)

Losses are always computed in fp32 (the scripts call `.float()` on predictions).
Frozen components (teacher, VAE, text encoders) are stored *in their compute dtype*: they never
need an fp32 master copy. Each has its own dtype, by default the mode's compute dtype, overridable
per component.

    python -m pytest tests/test_precision.py -q
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

DTYPES = {
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
}


def parse_dtype(name: str) -> torch.dtype:
    """'bf16' / 'bfloat16' / 'fp32' / ... -> torch.dtype, with a one-line error otherwise."""
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(set(DTYPES))}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))


@dataclass(frozen=True)
class Precision:
    name: str
    param_dtype: torch.dtype    # storage of trainable params, their grads and optimizer state
    compute_dtype: torch.dtype  # what matmuls / convs run in
    reduce_dtype: torch.dtype   # gradient reduce-scatter / all-reduce

    def mp_policy(self, compute_dtype: torch.dtype | None = None) -> MixedPrecisionPolicy:
        """Policy for trainable models: cast params to compute dtype for forward/backward,
        reduce grads in reduce_dtype, hand outputs back in fp32 so losses are fp32.
        `compute_dtype` overrides the mode's for one model (DMD2's fp32 fake score)."""
        return MixedPrecisionPolicy(param_dtype=compute_dtype or self.compute_dtype, reduce_dtype=self.reduce_dtype,
                                    output_dtype=torch.float32, cast_forward_inputs=True)

    def adapter_mp_policy(self, compute_dtype: torch.dtype | None = None) -> MixedPrecisionPolicy:
        """Policy for a LoRA model (parallel/lora.py): the frozen base is stored in the compute
        dtype and the adapters in fp32; everything is all-gathered in the compute dtype, adapter
        grads are reduced in fp32 (they are few), outputs handed back in fp32."""
        return MixedPrecisionPolicy(param_dtype=compute_dtype or self.compute_dtype, reduce_dtype=torch.float32,
                                    output_dtype=torch.float32, cast_forward_inputs=True)

    def frozen_dtype(self, override: str = "") -> torch.dtype:
        """Storage (= compute) dtype of a frozen component: the override if given, else compute."""
        return parse_dtype(override) if override else self.compute_dtype

    @staticmethod
    def frozen_mp_policy(dtype: torch.dtype) -> MixedPrecisionPolicy:
        """Frozen models are stored in their compute dtype: no cast, no gradient reduction."""
        return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype,
                                    output_dtype=torch.float32, cast_forward_inputs=True)


def apply_tf32(enabled: bool) -> None:
    """TF32 for fp32 matmuls and convolutions on CUDA (cuBLAS and cuDNN; no effect on CPU): an
    H100 runs them ~7x faster (~495 vs ~67 TFLOPS dense) with 10-bit mantissa products and fp32
    accumulation. torch's default is off for matmuls since 1.12; the official DMD2 code turns both
    on (main/train_sd.py), so its "full precision" fake-score pass runs in TF32. Off = strict
    IEEE fp32 everywhere."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    if hasattr(matmul, "fp32_precision"):  # torch >= 2.9
        matmul.fp32_precision = cudnn.fp32_precision = "tf32" if enabled else "ieee"
    else:
        matmul.allow_tf32 = cudnn.allow_tf32 = enabled


def tf32_matmuls() -> bool:
    """Whether fp32 matmuls run in TF32 now, read through the API apply_tf32 wrote with (torch
    refuses to read the legacy flag once the new one was set)."""
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):  # torch >= 2.9
        return matmul.fp32_precision == "tf32"
    return bool(matmul.allow_tf32)


def native_cpu_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU computes bf16 matmuls natively (AVX-512 BF16 or AMX); without either, torch
    falls back to a reference kernel, minutes per step at real width. Unknown (not Linux): True."""
    try:
        with open(cpuinfo) as f:
            flags = f.read()
    except OSError:
        return True
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_bf16_warning(precision: Precision, device: torch.device, cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """The start-up warning when bf16 compute is asked for on a CPU without native bf16."""
    if device.type != "cpu" or precision.compute_dtype != torch.bfloat16 or native_cpu_bf16(cpuinfo):
        return None
    return (f"warning: PRECISION={precision.name} computes in bf16, which this CPU has no native support for "
            "(no avx512_bf16 / amx_bf16 in /proc/cpuinfo): bf16 matmuls run in a slow reference kernel; "
            "use --precision=fp32 on this machine")


MODES = {
    "fp32": Precision("fp32", torch.float32, torch.float32, torch.float32),
    "bf16-mixed": Precision("bf16-mixed", torch.float32, torch.bfloat16, torch.float32),
    "bf16": Precision("bf16", torch.bfloat16, torch.bfloat16, torch.bfloat16),
}


def get_precision(name: str) -> Precision:
    if name not in MODES:
        raise ValueError(f"PRECISION={name!r} is not a precision mode; choose one of {list(MODES)}")
    return MODES[name]


# ----------------------------------------------------------------------------------------------
# audit

def _local_numel(p: torch.Tensor) -> int:
    return p.to_local().numel() if hasattr(p, "to_local") else p.numel()


def _global_numel(p: torch.Tensor) -> int:
    return p.numel()  # DTensor.numel() is the global size


def _storage_name(p: torch.Tensor) -> str:
    """A parameter's storage dtype; "nf4" for a 4-bit base weight (torchao's NF4Tensor, whose
    nominal dtype is the one it dequantises to; parallel/lowbit.py)."""
    return "nf4" if type(getattr(p, "_local_tensor", p)).__name__ == "NF4Tensor" else dtype_name(p.dtype)


def component_row(name: str, module: torch.nn.Module, compute_dtype: torch.dtype) -> dict:
    """One audit row, read off the module itself (not off what we intended); "fp32, attention bf16"
    where its attention processors run SDPA in another dtype (parallel/attention.CastSdpaProcessor)."""
    params = list(module.parameters())
    attention = sorted({dtype_name(m.processor.sdpa_dtype) for m in module.modules()
                        if hasattr(getattr(m, "processor", None), "sdpa_dtype")})
    storage = sorted({_storage_name(p) for p in params}) or ["-"]
    trainable = sum(p.numel() for p in params if p.requires_grad)
    sharded = any(hasattr(p, "placements") for p in params)
    return {
        "component": name,
        "params": sum(_global_numel(p) for p in params),
        "local_params": sum(_local_numel(p) for p in params),
        "storage": "/".join(storage),
        "compute": dtype_name(compute_dtype) + (f", attention {'/'.join(attention)}" if attention else ""),
        "trainable": "yes" if trainable else "no",
        "sharded": "yes" if sharded else "no",
    }


def format_audit(rows: list[dict]) -> str:
    """The start-of-run dtype table: component, #params, storage dtype, compute dtype, trainable, sharded."""
    head = ["component", "params", "local_params", "storage", "compute", "trainable", "sharded"]
    cells = [head] + [[_fmt(r[h]) for h in head] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    lines = ["  ".join(c[i].ljust(widths[i]) for i in range(len(head))) for c in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(v) -> str:
    if isinstance(v, int):
        return f"{v / 1e9:.2f}B" if v >= 1e9 else f"{v / 1e6:.2f}M" if v >= 1e5 else str(v)
    return str(v)


def check_state_dict_dtypes(state_dict: dict, expected: torch.dtype, where: str = "checkpoint") -> dict:
    """On export: every floating tensor must be in `expected`. Returns {dtype: count}; raises on a stray."""
    counts: dict[str, int] = {}
    for key, t in state_dict.items():
        if not torch.is_tensor(t):
            continue
        counts[dtype_name(t.dtype)] = counts.get(dtype_name(t.dtype), 0) + 1
        if t.is_floating_point() and t.dtype != expected:
            raise ValueError(f"{where}: tensor {key!r} is {dtype_name(t.dtype)}, expected {dtype_name(expected)}")
    return counts
