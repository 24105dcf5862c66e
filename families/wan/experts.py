"""Wan 2.2 A14B's two experts as one trained model: `transformer` denoises where the timestep is at least the
boundary (boundary_ratio * num_train_timesteps: 875 for T2V-A14B), `transformer_2` below it, as WanPipeline picks
`current_model` per step. Here the choice is per sample: each micro-batch's samples go to the expert their own
timestep picks (the student's step, the teacher's and the fake score's re-noised σ), so each expert trains (and
its adapters or weights move) on its own σ range only.

Under FSDP every rank must call the same sharded modules in the same order, and σ differs across samples and
ranks: which experts a call needs is agreed across ranks first (one all-reduce of two flags), and a rank whose share
of a needed expert is empty calls it on one token of its first sample (C under context parallelism: one per
rank of its CP group, whose ranks hold the same samples) and adds 0 x that output, so that its
all-gathers and reduce-scatters (of zero gradients) meet the other ranks'. An expert no rank needs is not called
(its gradients stay None, as on one process).

    python -m pytest tests/test_wan.py -q -k experts
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn


class Experts(nn.Module):
    """(high-noise `transformer`, low-noise `transformer_2`) called as one WanTransformer3DModel."""

    def __init__(self, transformer: nn.Module, transformer_2: nn.Module, boundary: float):
        super().__init__()
        self.transformer, self.transformer_2 = transformer, transformer_2
        self.boundary = float(boundary)  # timesteps >= it: transformer
        self.context_parallel = 1  # C > 1: each expert splits its tokens C ways (parallel/context_parallel.py)

    @property
    def config(self):
        return self.transformer.config

    def pipeline_parts(self) -> dict:
        """The pipeline folder's components this model is (components/trainer.finish exports each)."""
        return {"transformer": self.transformer, "transformer_2": self.transformer_2}

    def forward(self, hidden_states, timestep, encoder_hidden_states, return_dict=False, **kwargs):
        t = timestep if timestep.ndim == 1 else timestep.amax(1)  # per-token: each sample's t (a clean first frame: 0)
        high = t >= self.boundary
        need = torch.stack([high.any(), (~high).any()]).int()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(need, op=dist.ReduceOp.MAX)
        parts, extra = [], None
        for expert, mine, needed in zip((self.transformer, self.transformer_2), (high, ~high), need.tolist()):
            if not needed:
                continue
            idx = mine.nonzero().squeeze(1)
            if idx.numel():
                out = expert(hidden_states=hidden_states[idx], timestep=timestep[idx],
                             encoder_hidden_states=encoder_hidden_states[idx], return_dict=False,
                             **{k: v[idx] if torch.is_tensor(v) else v for k, v in kwargs.items()})[0]
                parts.append((idx, out))
            else:  # another rank's samples need it: a call on C tokens (one per CP rank), counted 0 times
                p, c = expert.config.patch_size, self.context_parallel
                slab = ((slice(None, p[0]), slice(None, p[1]), slice(None, p[2] * c))
                        if hidden_states.shape[4] >= p[2] * c else (slice(None),) * 3)  # else the whole first clip
                one_in = hidden_states[:1, :, slab[0], slab[1], slab[2]]
                tokens = math.prod(n // q for n, q in zip(one_in.shape[2:], p))
                one = expert(hidden_states=one_in,
                             timestep=timestep[:1] if timestep.ndim == 1 else timestep[:1, :tokens],
                             encoder_hidden_states=encoder_hidden_states[:1], return_dict=False,
                             **{k: v[:1] if torch.is_tensor(v) else v for k, v in kwargs.items()})[0]
                extra = one.sum() * 0 if extra is None else extra + one.sum() * 0
        first = parts[0][1]
        out = first.new_zeros((hidden_states.shape[0], *first.shape[1:]))
        for idx, part in parts:
            out = out.index_put((idx,), part)
        return (out if extra is None else out + extra,)
