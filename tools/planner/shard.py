"""Sharding the built components on a fake process group, through the scripts' own recipes."""
from __future__ import annotations

import contextlib
import copy
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_utils
from core.errors import ConfigError
from parallel import lora as lora_lib
from parallel import lowbit
from parallel.parallelize import parallelize  # the recipes
from tools.planner.build import Part, Settings

# ----------------------------------------------------------------------------------------------
# sharding with a fake process group

@contextlib.contextmanager
def fake_world(world_size: int):
    """A process group of `world_size` fake ranks (we are rank 0): collectives are no-ops."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        if owned:
            dist.destroy_process_group()


def shard_components(parts: list[Part], s: Settings, precision) -> dict:
    """Shard each component at world size s.world_size as the scripts do: trainable ones by their
    model's recipe (parallel/parallelize.py), frozen-sharded ones by the same recipe after
    fsdp_utils.prepare_frozen. A component with LoRA (Part.lora) gets its adapters by
    parallel.lora.add_lora after the cast to its storage dtype and before its recipe, which then
    shards it with the adapter policy, as the scripts do. Returns {name: local and global parameter
    counts, and the FSDP units fully_shard made (as fsdp_utils.fsdp_units reads them off the
    sharded model: [(module name, params)], root last); with LoRA also the trainable (adapter)
    counts: local, global and per unit}."""
    out = {}
    block_classes = list(s.block_classes) or None
    # the units and shards do not depend on it; auto is resolved by plan (reshard_free)
    sharding = fsdp_utils.Sharding(s.reshard_after_forward is not False, s.cpu_offload, s.activation_checkpointing)
    done = {}  # {how a component is built and sharded: its name}: DMD2's generator and fake score alike, once
    with fake_world(s.world_size), warnings.catch_warnings():
        # torch's note on slicing the flattened dp x cp dim (build_meshes with CP) is not the user's concern
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")
        # the script's FSDP mesh: with CP, FSDP shards over all dp x cp ranks (the CP mesh is not needed here)
        mesh = fsdp_utils.build_meshes(torch.device("cpu"), s.dp_replicate, s.context_parallel)[0]
        for c in parts:
            alike = (c.spec.subfolder, c.spec.role, c.dtype, c.lora, fill_sharded(c, s))
            if alike in done:
                out[c.name] = copy.deepcopy(out[done[alike]])
                continue
            done[alike] = c.name
            c.module.to(c.dtype)
            if c.lora:
                try:
                    _add_lora_on_meta(c.module, c.lora)
                except ConfigError as e:
                    raise SystemExit(f"plan: --lora_target_modules: {e}") from None
            if c.holding.sharded and block_classes:  # a misspelt class would silently make one whole-model unit
                try:
                    fsdp_utils.find_block_classes(c.module, block_classes)
                except ConfigError as e:
                    raise SystemExit(f"plan: --block_classes: {e}") from None
            fp8_names = _fp8_names(c.module) if c.holding.sharded and c.holding.trained and not c.lora else []
            if c.holding.sharded and c.holding.trained:
                policy = precision.adapter_mp_policy() if c.lora else precision.mp_policy()
                parallelize(c.module, mesh, policy, sharding, block_classes, verbose=False)
            elif c.holding.sharded or fill_sharded(c, s):
                fsdp_utils.prepare_frozen(c.module, c.dtype)
                # an offline encoder is sharded in units of its own (its _no_split_modules), not the trained model's
                parallelize(c.module, mesh, precision.frozen_mp_policy(c.dtype), fsdp_utils.Sharding(frozen=True),
                            block_classes if c.holding.sharded else None, verbose=False)
            elif not c.holding.resident:
                fsdp_utils.prepare_frozen(c.module, c.dtype)
            total = sum(p.numel() for p in c.module.parameters())
            units = fsdp_utils.fsdp_units(c.module) if c.holding.sharded or fill_sharded(c, s) else [("<root>", total)]
            local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in c.module.parameters())
            out[c.name] = {"local": local, "global": total, "units": units}
            # what BASE_DTYPE=nf4 would quantise: the frozen Linear weights lowbit accepts, of a LoRA base or
            # of a frozen sharded model (a teacher: FamilySpec.nf4_teacher)
            if c.lora or (c.holding.sharded and not c.holding.trained) or not c.holding.resident:
                weights = [m.weight for m in c.module.modules() if isinstance(m, nn.Linear)
                           and not m.weight.requires_grad and lowbit.nf4_blocks(m.weight.shape) is not None]
                out[c.name].update(nf4_global=sum(w.numel() for w in weights),
                                   nf4_largest=max((w.numel() for w in weights), default=0))
            if c.holding.sharded and c.holding.trained and not c.lora:  # what FP8=tensorwise gathers in float8
                out[c.name]["fp8_units"] = _fp8_per_unit(c.module, units, fp8_names)
                out[c.name]["fp8_count"] = len(fp8_names)
            if c.lora or c.holding.trained:
                trainable = [p for p in c.module.parameters() if p.requires_grad]
                out[c.name].update(
                    trainable_local=sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                                        for p in trainable),
                    trainable_global=sum(p.numel() for p in trainable),
                    trainable_units=_trainable_per_unit(c.module, units))
    return out


def fill_sharded(c: Part, s: Settings) -> bool:
    """An offline component (a text encoder run once before training to fill the text cache) is sharded
    over the ranks for that fill, unless there is one rank (a whole copy: nothing to gather)."""
    return not c.holding.resident and s.world_size > 1


def _fp8_names(model: nn.Module) -> list[str]:
    """The Linears FP8 converts (parallel/float8.py), read off the model before it is sharded (its block
    classes' names); none for a model FP8 does not know (no model facts in its family's parallelism.py)."""
    from parallel import float8
    try:
        return float8.fp8_linears(model)
    except ConfigError:
        return []


def _fp8_per_unit(model: nn.Module, units: list[tuple[str, int]], names: list[str]) -> list[int]:
    """Per unit (fsdp_units' order), the weight elements of the Linears `names` (FP8's): under FP8=tensorwise
    a full model's unit gathers these in float8 (1 byte) and the rest in its compute dtype."""
    unit_names = [n for n, _ in units[:-1]]
    out = dict.fromkeys(unit_names, 0)
    for name in names:
        unit = next((u for u in unit_names if name.startswith(u + ".")), None)
        if unit is not None:
            out[unit] += model.get_submodule(name).weight.numel()
    return [out[n] for n in unit_names] + [0]


def _add_lora_on_meta(model: nn.Module, lora: lora_lib.Lora) -> None:
    """parallel.lora.add_lora with peft's new adapter layers made on meta too (it makes them on the
    default device, then moves them to the base's: at rank 64, seconds of CPU init per 12 B model)."""
    with torch.device("meta"):
        lora_lib.add_lora(model, lora)


def _trainable_per_unit(model: nn.Module, units: list[tuple[str, int]]) -> list[int]:
    """For fsdp_units' list (inner units first, root last), the parameters that require grad among
    those each unit owns (its own, not those of units nested in it): what its reduce-scatter carries."""
    owned, out = set(), []
    for name, _ in units:
        module = model if name == "<root>" else model.get_submodule(name)
        ps = [p for p in module.parameters() if id(p) not in owned]
        owned.update(id(p) for p in ps)
        out.append(sum(p.numel() for p in ps if p.requires_grad))
    return out
