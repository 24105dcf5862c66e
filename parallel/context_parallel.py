"""Context parallelism for diffusers models by diffusers' own Ulysses attention, on the CP mesh
that fsdp_utils.build_meshes lays out (C consecutive ranks per group).

    python -m pytest tests/test_context_parallel.py -q
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

import fsdp_utils
from core.dist import print0
from core.errors import ConfigError
from parallel.ema import AdapterEMA


def check_diffusers_supports_it(model_class: str = "FluxTransformer2DModel") -> None:
    """Before any work: the installed diffusers has context parallelism (ContextParallelConfig and
    the model's _cp_plan arrived in diffusers 0.36; requirements.txt admits older releases for
    everything else)."""
    import diffusers
    try:
        import diffusers.models._modeling_parallel as modeling_parallel
    except ImportError:
        modeling_parallel = None
    supported = (hasattr(modeling_parallel, "ContextParallelConfig")
                 and getattr(getattr(diffusers, model_class), "_cp_plan", None) is not None)
    if not supported:
        raise ConfigError("CONTEXT_PARALLEL > 1 needs diffusers >= 0.36 "
                          f"(ContextParallelConfig, {model_class}._cp_plan); "
                          f"diffusers {diffusers.__version__} is installed: pip install -U diffusers")


@contextlib.contextmanager
def _accelerator_count_at_least_one():
    """diffusers' enable_parallelism records a device as rank % torch.accelerator.device_count(),
    which divides by zero on a CPU-only machine (diffusers/models/modeling_utils.py,
    _resolve_parallel_config); that device is not used by the CP attention or hooks. Only then,
    and only for the call, the count reads 1."""
    real = torch.accelerator.device_count
    if real() > 0:
        yield
        return
    torch.accelerator.device_count = lambda: 1
    try:
        yield
    finally:
        torch.accelerator.device_count = real


def enable_context_parallel(model: nn.Module, cp_mesh: DeviceMesh) -> None:
    """Context parallelism on a (sharded) diffusers model, by diffusers' own implementation:
    Ulysses attention (ContextParallelConfig(ulysses_degree=C)), whose autograd function
    all-to-alls q/k/v from sequence-split to head-split, runs the attention over the full
    sequence for H/C heads, and all-to-alls the output and, in backward, the grads back
    (diffusers/models/attention_dispatch.py, TemplatedUlyssesAttention). The model's _cp_plan
    (FluxTransformer2DModel: hidden_states, encoder_hidden_states, img_ids, txt_ids split along the
    sequence at the root; proj_out's output all-gathered, whose backward keeps this rank's slice)
    places the splits, so every rank of a CP group returns the full output.

    Why Ulysses and not ring: it is exact with the ordinary (flash / memory-efficient) SDPA kernel,
    needs two all-to-alls per attention instead of C-1 KV rotations, and FLUX's 24 heads divide
    every CP size a node offers (2, 4, 8); diffusers' ring attention merges partial results by their
    log-sum-exp, which its native SDPA backend (the one that runs everywhere, CPU included) cannot
    return. Gradient scale: every rank of a CP group
    computes the same loss from the gathered output, and its param grads hold only its tokens'
    share; FSDP2 averages over dp x cp ranks, so the caller multiplies the loss by C before
    backward (FSDP's set_gradient_divide_factor would do it, but needs PREMUL_SUM, which gloo lacks)."""
    from diffusers.models._modeling_parallel import ContextParallelConfig
    from diffusers.utils import logging as diffusers_logging
    config = ContextParallelConfig(ulysses_degree=cp_mesh["ulysses"].size(), mesh=cp_mesh)
    level = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()  # its "experimental feature" warning, once per model and rank
    try:
        with _accelerator_count_at_least_one():
            model.enable_parallelism(config=config)
    finally:
        diffusers_logging.set_verbosity(level)



def split_sequences(models, cp_mesh: DeviceMesh | None, context_parallel: int, world: int) -> tuple[int, int]:
    """CONTEXT_PARALLEL = C > 1: every forward of `models` (training, validation, samples) splits its sequence over
    its CP group (a model holding several pipeline parts, Wan 2.2 A14B's experts: each part, and it records C for
    its own calls); None entries and a LoRA EMA (adapter tensors, no forward) are passed over. Returns this rank's
    (data-parallel rank, data-parallel size): the ranks of a CP group read the same samples."""
    for model in models if cp_mesh is not None else ():
        if model is None or isinstance(model, AdapterEMA):
            continue
        parts = model.pipeline_parts().values() if hasattr(model, "pipeline_parts") else (model,)
        for part in parts:
            enable_context_parallel(part, cp_mesh)
        if hasattr(model, "context_parallel"):
            model.context_parallel = context_parallel
    dp_rank, dp_size = fsdp_utils.data_parallel_rank(context_parallel)
    if context_parallel > 1:
        print0(f"context parallel: {dp_size} data-parallel group(s) of {context_parallel} ranks; each group splits "
               f"its samples' sequence {context_parallel} ways (Ulysses attention); FSDP shards over all {world} ranks")
    return dp_rank, dp_size
