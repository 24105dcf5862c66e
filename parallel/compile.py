"""torch.compile per FSDP unit: each innermost unit's forward compiled in place, in torchtitan's
order AC -> compile -> fully_shard (parallel/parallelize.py applies it), with a one-line report of
graphs, breaks and compile time, and the compiler check made before any work.

    python -m pytest tests/test_compile.py -q
"""
from __future__ import annotations

from collections import Counter

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from core.errors import ConfigError

# What is compiled is each unit's `forward`, patched on the instance as fsdp_utils.checkpoint_activations does: the
# block's own forward, or with activation checkpointing the checkpoint wrapper, so the recompute
# is inside the compiled region (a checkpoint higher-order op that AOTAutograd replays in the
# backward graph). That is torchtitan's order, AC -> compile -> fully_shard
# (torchtitan/models/llama3/infra/parallelize.py: apply_ac, then apply_compile per TransformerBlock,
# then apply_fsdp). torchtitan swaps each block for torch.compile's OptimizedModule, whose
# state-dict keys gain an `_orig_mod.` prefix; patching `forward` keeps the module tree, parameter
# names, checkpoints, exports, EMA and LoRA code exactly as without compile. FSDP2's pre- and
# post-forward hooks run in nn.Module.__call__, around the patched forward, so, as in torchtitan,
# all-gathers, reduce-scatters and dtype casts stay eager, outside the compiled region, and the
# compiled graph takes the unsharded parameters as inputs.
#
# Sharing and recompiles. Dynamo inlines nn.Module calls and lifts parameters to graph inputs (the
# only behaviour in current torch), caching compiled code per Python code object behind guards on
# input and parameter shapes, dtypes, requires_grad and grad mode. So all blocks of one class and
# shape share one compiled graph (FLUX: one per block kind for the whole stack, per grad mode), and
# each other shape adds an entry to that code object's cache: the UNet's ResnetBlock2D at every
# (in, out) channel pair and its BasicTransformerBlock at every width, and, with activation
# checkpointing, all unit classes share the checkpoint wrapper's one code object. Past
# `torch._dynamo.config.recompile_limit` entries (8) dynamo stops compiling that code object and
# runs it eagerly; the shipped 2-level shapes UNet with AC hit that in its first forward (9 unit
# shapes). compile_units therefore raises the limit to 4 entries per distinct unit shape in this
# process ({grad, no grad} x {first input shapes, dynamic shapes after an input shape changes}):
# it bounds the cache without ever falling back to eager. compile_report counts what happened.
#
# Graph breaks, measured (torch 2.13, diffusers 0.42.1, CPU): none without context parallelism.
# FLUX: 0 in FluxTransformerBlock
# and FluxSingleTransformerBlock (one graph each). UNet: 0 in ResnetBlock2D and BasicTransformerBlock,
# whose Python-side branches (deprecated `scale` kwarg checks, norm-type and attention-processor
# dispatch, peft's LoRA layer loops) are resolved at trace time and guarded, not broken on. DMD's
# first fp32 step on the shapes teacher compiles 27 graphs, 9 unit shapes x {trained params with
# grad (generator and fake score share them), the same without grad (the fake score inside the DM
# loss), the frozen teacher}; its samples add 9 (a new batch size: dynamic shapes). Measured with
# and without AC, with LoRA, in fp32 and bf16-mixed, under FSDP and DDP. Even the whole
# UNet2DConditionModel and FluxTransformer2DModel trace as one graph each
# (forward and backward). The root units stay eager here by design (their stem, time embedding,
# samplers and Transformer2DModel projections run once per forward, around FSDP's root hooks).
# The one break seen: FLUX with CONTEXT_PARALLEL > 1, at each attention. diffusers' Ulysses
# attention is an autograd.Function whose backward (attention_dispatch.py,
# _native_attention_backward_op) calls requires_grad_(True) on its saved q/k/v to recompute SDPA
# under enable_grad, a side effect dynamo cannot trace inside the Function, so the all-to-all
# attention runs eagerly between two compiled graphs per block (tiny FLUX, 2 ranks, CP 2: 9
# graphs, 9 breaks; losses and grad norms equal to eager CP).

_COMPILED_UNIT_SHAPES: set = set()  # (class, compute dtype, parameter shapes/dtypes/requires_grad) compiled here


_ENTRIES_PER_UNIT_SHAPE = 4


def compile_units(units: list[nn.Module], mp_policy: MixedPrecisionPolicy | None = None) -> list[nn.Module]:
    """torch.compile (inductor) the forward of each innermost unit of `units` in place (a unit that
    holds another unit stays eager: compiling it would pull the inner unit's FSDP hooks into the
    graph). Call after activation checkpointing and before fully_shard. Returns the compiled units."""
    inner = _innermost(units)
    compute = mp_policy.param_dtype if mp_policy is not None else None
    for u in inner:
        _COMPILED_UNIT_SHAPES.add((type(u).__name__, compute,
                                   tuple((tuple(p.shape), p.dtype, p.requires_grad) for p in u.parameters())))
        u.forward = torch.compile(u.forward)
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, _ENTRIES_PER_UNIT_SHAPE * len(_COMPILED_UNIT_SHAPES))
    cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, cfg.recompile_limit)
    return inner


def compile_report(label: str = "compile") -> str:
    """One line about torch.compile in this process so far: graphs compiled (recompiles included),
    graph breaks with their deduplicated reasons, recompile-limit fallbacks to eager, seconds spent
    compiling (dynamo + AOTAutograd + inductor, forward and backward)."""
    from torch._dynamo.utils import calculate_time_spent, counters
    breaks = counters["graph_break"]
    line = (f"{label}: {counters['stats']['unique_graphs']} graphs, {sum(breaks.values())} graph breaks "
            f"({calculate_time_spent().get('total_wall_time', 0.0):.1f} s compiling)")
    fallbacks = sum(n for reason, n in counters["unimplemented"].items() if "recompile limit" in reason.lower())
    if fallbacks:
        line += f"; recompile limit hit {fallbacks}x (those calls run eagerly)"
    if breaks:
        reasons = Counter()
        for reason, n in breaks.items():
            reasons[_break_reason(reason)] += n
        line += "; breaks: " + "; ".join(f"{r} (x{n})" for r, n in reasons.most_common())
    return line


def _break_reason(message: str) -> str:
    """A graph-break counter key (dynamo's multi-line message) as one short line: its title and
    its explanation, e.g. "Failed to trace builtin operator: Dynamo does not know how to trace
    builtin operator `print` ..."."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    why = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Explanation:")), "")
    return (lines[0] + (f": {why}" if why else ""))[:200] if lines else "?"


def check_compile(compile: bool) -> None:
    """COMPILE=1 checked before any work: inductor needs a C++ compiler on CPU (g++, or whatever
    torch._inductor.config.cpp.cxx names) and triton on GPUs."""
    if not compile:
        return
    if torch.cuda.is_available():
        from torch.utils._triton import has_triton
        if not has_triton():
            raise ConfigError("COMPILE=1 on GPUs needs triton (inductor's GPU code generator): pip install triton")
        return
    from torch._inductor import cpp_builder
    try:
        cpp_builder.get_cpp_compiler()
    except Exception as e:  # noqa: BLE001 - whatever the search raises, the message says what is missing
        raise ConfigError(f"COMPILE=1 on CPU needs a C++ compiler for inductor (g++): {e}") from None


def _innermost(units: list[nn.Module]) -> list[nn.Module]:
    ids = {id(u) for u in units}
    return [u for u in units if not any(id(m) in ids for m in u.modules() if m is not u)]

