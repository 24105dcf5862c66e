"""The parallelize recipe, torchtitan-shaped (torchtitan/models/flux/infra/parallelize.py): activation
checkpointing of each unit -> torch.compile of each unit's forward -> `fully_shard` of the units in execution
order, the last-executed one kept unsharded after forward -> the root. The units are what the model's facts
(parallel/model_facts.py, its family's) name; a model without facts gets the detected ones. With mesh=None
(PARALLELISM=ddp) the same units get the same AC and compile, the model gets FSDP2's precision contract on its
forward, and nothing is sharded; the caller wraps a trained one in DDP (fsdp_utils.apply_ddp).

The scripts (their trained models and DMD2's frozen sharded teacher) and the memory planner
(tools/memory_plan.py) all shard through this, so wrapping knowledge exists once.

    python -m pytest tests/test_parallelize.py -q
"""
from __future__ import annotations

from collections import Counter

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from core.dist import print0
from fsdp_utils import Sharding, apply_precision, checkpoint_activations, find_block_classes, outermost, shard_units
from parallel.compile import compile_units
from parallel.execution_order import units_in_order
from parallel.model_facts import ModelFacts, facts_of


def parallelize(model: nn.Module, mesh: DeviceMesh | None, mp_policy: MixedPrecisionPolicy,
                sharding: Sharding = Sharding(), block_classes: list[str] | None = None,
                verbose: bool = True, facts: ModelFacts | None = None) -> list[nn.Module]:
    """A unit per module of the named classes (`block_classes`, each checked to exist: a misspelt one
    would silently make one unit of all), else of the model's unit classes (`facts`, or those registered
    for its class: the SD UNets' ResnetBlock2D and BasicTransformerBlock, the transformers' blocks), else of
    the detected ones (fsdp_utils.find_block_classes), in execution order (parallel.execution_order: a UNet's
    down, mid, up blocks, resnet before attention), so the unit kept gathered after forward is the last one
    forward runs. What is in no unit (stems, embedders, norm_out, proj_out) stays in the root unit."""
    facts = facts_of(model, facts)
    if block_classes or facts is None:
        names, why = find_block_classes(model, list(block_classes or []))
    else:
        names, why = list(facts.units), "its model facts"
    units = units_in_order(model, names)
    if verbose and mesh is not None:
        counts = " + ".join(f"{n} {name}" for name, n in Counter(type(u).__name__ for u in units).items())
        print0(f"fsdp: {type(model).__name__}: {len(units)} units ({counts or 'none'}; {why})")
    return _apply(model, units, mesh, mp_policy, sharding)


def _apply(model: nn.Module, units: list[nn.Module], mesh: DeviceMesh | None, mp_policy: MixedPrecisionPolicy,
           sharding: Sharding) -> list[nn.Module]:
    """torchtitan's order (torchtitan/models/llama3/infra/parallelize.py: apply_ac, apply_compile,
    apply_fsdp): activation checkpointing of the outermost units -> torch.compile of each innermost
    unit's forward (parallel/compile.py) -> fully_shard of each unit, then the root
    (fsdp_utils.shard_units); with mesh=None the precision contract instead (fsdp_utils.apply_precision)."""
    if sharding.activation_checkpointing:
        for u in outermost(units):
            checkpoint_activations(u)
    if sharding.compile:
        compile_units(units, mp_policy)
    if mesh is not None:
        shard_units(model, units, mesh, mp_policy, sharding)
    else:  # not sharded: FSDP2's precision contract on the model's own forward
        apply_precision(model, mp_policy)
    return units
