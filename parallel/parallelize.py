"""The per-model parallelize recipes, torchtitan-shaped (torchtitan/models/flux/infra/parallelize.py):
activation checkpointing of each unit -> torch.compile of each unit's forward -> `fully_shard` of
the named units in execution order, the last-executed one kept unsharded after forward -> the
root. With mesh=None (PARALLELISM=ddp) the same units get the same AC and compile, the model gets
FSDP2's precision contract on its forward, and nothing is sharded; the caller wraps a trained one
in DDP (fsdp_utils.apply_ddp).

The scripts (their trained models and DMD2's frozen sharded teacher) and the memory planner
(tools/memory_plan.py) all shard through these, so wrapping knowledge exists once.

    python -m pytest tests/test_parallelize.py -q
"""
from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from core.dist import print0
from fsdp_utils import Sharding, apply_precision, checkpoint_activations, find_block_classes, outermost, shard_units
from parallel.compile import compile_units
from parallel.execution_order import units_in_order
from parallel.model_facts import MODELS


def parallelize_unet(model: nn.Module, mesh: DeviceMesh | None, mp_policy: MixedPrecisionPolicy,
                     sharding: Sharding = Sharding(), block_classes: list[str] | None = None,
                     verbose: bool = True) -> list[nn.Module]:
    """SD-1.5 / SDXL UNet2DConditionModel: a unit per ResnetBlock2D and BasicTransformerBlock of the
    down, mid and up blocks (unless `block_classes` names others), in execution order (down, mid,
    up; resnet before attention: parallel.execution_order), so the unit kept gathered after
    forward is the last up block's last resnet. The stem, time embedding and conv_out stay in the
    root unit."""
    names, _ = find_block_classes(model, list(block_classes or MODELS["UNet2DConditionModel"].units))
    units = units_in_order(model, names)
    if verbose and mesh is not None:
        print0(f"fsdp: {type(model).__name__}: {len(units)} units of {names}")
    return _apply(model, units, mesh, mp_policy, sharding)


def parallelize_flux(model: nn.Module, mesh: DeviceMesh | None, mp_policy: MixedPrecisionPolicy,
                     sharding: Sharding = Sharding(), block_classes: list[str] | None = None,
                     verbose: bool = True) -> list[nn.Module]:
    """FluxTransformer2DModel and Flux2Transformer2DModel: each double-stream block, then each single-stream
    block, as units (the last single block not resharded after forward); the input embedders (and FLUX.2's
    shared modulation), norm_out and proj_out in the root unit."""
    if block_classes:  # checked to exist: a misspelt class would silently make one unit of all
        units = units_in_order(model, find_block_classes(model, list(block_classes))[0])
    else:
        units = [*model.transformer_blocks, *model.single_transformer_blocks]
    if verbose and mesh is not None:
        print0(f"fsdp: {type(model).__name__}: {len(units)} units "
               f"({len(model.transformer_blocks)} double + {len(model.single_transformer_blocks)} single blocks)")
    return _apply(model, units, mesh, mp_policy, sharding)


def parallelize_qwen_image(model: nn.Module, mesh: DeviceMesh | None, mp_policy: MixedPrecisionPolicy,
                           sharding: Sharding = Sharding(), block_classes: list[str] | None = None,
                           verbose: bool = True) -> list[nn.Module]:
    """QwenImageTransformer2DModel: each dual-stream block as a unit (the last not resharded after
    forward); the input projections (img_in, txt_norm, txt_in), the time embedding, norm_out and
    proj_out in the root unit."""
    if block_classes:  # checked to exist, as for FLUX
        units = units_in_order(model, find_block_classes(model, list(block_classes))[0])
    else:
        units = list(model.transformer_blocks)
    if verbose and mesh is not None:
        print0(f"fsdp: {type(model).__name__}: {len(units)} units (dual-stream blocks)")
    return _apply(model, units, mesh, mp_policy, sharding)


RECIPES = {"UNet2DConditionModel": parallelize_unet, "FluxTransformer2DModel": parallelize_flux,
           "Flux2Transformer2DModel": parallelize_flux, "QwenImageTransformer2DModel": parallelize_qwen_image}


def parallelize(model: nn.Module, mesh: DeviceMesh | None, mp_policy: MixedPrecisionPolicy,
                sharding: Sharding = Sharding(), block_classes: list[str] | None = None,
                verbose: bool = True) -> list[nn.Module]:
    """The model's recipe (RECIPES, by class); any other model gets a unit per block of the named
    classes, or of the detected ones (fsdp_utils.find_block_classes), in execution order."""
    recipe = RECIPES.get(type(model).__name__)
    if recipe is not None:
        return recipe(model, mesh, mp_policy, sharding, block_classes, verbose)
    names, why = find_block_classes(model, block_classes)
    units = units_in_order(model, names)
    if verbose and mesh is not None:
        print0(f"fsdp: {type(model).__name__}: {len(units)} units of {names} ({why})")
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
