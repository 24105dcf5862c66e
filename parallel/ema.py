"""EMA of sharded parameters: a full copy of the model sharded like it, or (LoRA) an fp32 copy
of its adapters only; updated shard by shard with no communication, swapped in for samples and
export.

    python -m pytest tests/test_ema.py -q
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from fsdp_utils import local_tensor, reshard_all
from parallel.lora import is_adapter


class AdapterEMA(nn.Module):
    """EMA of a LoRA model's adapters only: one fp32 copy per trainable parameter (sharded like it,
    so the update is shard-local and DCP reshards it), not a second copy of the frozen base."""

    def __init__(self, model: nn.Module):
        super().__init__()
        reshard_all(model)  # sharded params, not a gathered unit's
        self.shadow = nn.ParameterList([nn.Parameter(p.detach().clone(), requires_grad=False)
                                        for p in model.parameters() if p.requires_grad])


def _ema_pairs(ema: nn.Module, model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(ema param, model param) pairs: an AdapterEMA pairs with the model's trainable params, a
    full EMA copy with all of them."""
    src = [p for p in model.parameters() if p.requires_grad] if isinstance(ema, AdapterEMA) else model.parameters()
    return list(zip(ema.parameters(), src, strict=True))


@torch.no_grad()
def ema_update(ema: nn.Module, model: nn.Module, decay: float) -> None:
    """ema ← decay·ema + (1−decay)·model, shard by shard (both sharded identically, no comms).
    `ema` is a full copy of the model or an AdapterEMA of its trainable (LoRA) params."""
    reshard_all(ema)
    reshard_all(model)
    pairs = [(local_tensor(pe), local_tensor(pm)) for pe, pm in _ema_pairs(ema, model)]
    # one foreach call instead of a kernel per parameter (hundreds per UNet); the same lerp
    torch._foreach_lerp_([le for le, _ in pairs], [lm.to(le.dtype) for le, lm in pairs], 1.0 - decay)


@torch.no_grad()
def copy_params(dst: nn.Module, src: nn.Module) -> None:
    """Copy the local shards of src into dst (identically sharded), e.g. to start an EMA (dst may
    be an AdapterEMA of src)."""
    reshard_all(dst)
    reshard_all(src)
    for pd, ps in _ema_pairs(dst, src):
        local_tensor(pd).copy_(local_tensor(ps))


@contextlib.contextmanager
def output_weights(model: nn.Module, ema: nn.Module | None):
    """The module that samples and exports use: the model, its full EMA copy, or (AdapterEMA) the
    model with the EMA adapters swapped in for the duration (shard-local, swapped back after)."""
    if not isinstance(ema, AdapterEMA):
        yield model if ema is None else ema
        return
    reshard_all(model)
    locals_ = [(local_tensor(pe), local_tensor(pm)) for pe, pm in _ema_pairs(ema, model)]

    def swap():
        with torch.no_grad():
            for le, lm in locals_:
                tmp = lm.clone()
                lm.copy_(le)
                le.copy_(tmp)
    swap()
    try:
        yield model
    finally:
        reshard_all(model)
        swap()



def build_ema(model: nn.Module, decay: float, empty_copy) -> nn.Module | None:
    """The EMA a script keeps when decay > 0 (else None), starting equal to `model`: of a LoRA
    model its adapters (AdapterEMA), else a full copy made by `empty_copy()` (the model's own
    build, allocated and sharded identically, unfilled), frozen and filled from `model`."""
    if decay <= 0:
        return None
    if any(is_adapter(n) for n, _ in model.named_parameters()):
        return AdapterEMA(model)
    ema = empty_copy()
    ema.requires_grad_(False).eval()
    copy_params(ema, model)
    return ema
