"""FP8 training of the transformer rooms' block Linears with torchao float8, applied on the meta skeleton
before fully_shard, as torchtitan applies it (torchtitan components/quantization/float8.py).

Which Linears: every Linear inside the model's FSDP units (its blocks) but their modulation, the modules
nothing reads and LoRA adapters (parallel/lora.block_linears' choice) and those whose dims are not
multiples of 16 (the fp8 GEMM's tile rule, diffusers' `--do_fp8_training` filter). Embedders, norms and the
final projection lie outside the blocks and stay in the compute dtype, as diffusers' example and
torchtitan leave them. Weights stay stored as before (fp32 master, bf16 compute copies): each forward casts
input and weight to e4m3, each backward the output grad to e5m2, with a dynamic scale per tensor
(tensorwise) or per row (rowwise). A checkpoint and an export hold the ordinary high-precision weights.

Recipes (torchao Float8LinearConfig.from_recipe_name):
- tensorwise: FSDP2 all-gathers the trained weights in float8 (half the bytes of bf16), their scales
  precomputed once per optimizer step for all of them (precompute_float8_dynamic_scale_for_fsdp, an
  optimizer post-step hook here), as torchao's FSDP2 recipe does;
- rowwise: per-row scales (more accurate, no float8 all-gather).
On a CPU the casts and GEMMs are emulated (emulate=True): the same numerics, no speed.

    python -m pytest tests/test_float8.py -q
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from core.dist import print0
from core.errors import ConfigError
from parallel.model_facts import ModelFacts, facts_of

RECIPES = ("tensorwise", "rowwise")


def check_fp8(recipe: str, *, base_dtype: str, device: torch.device | None = None) -> None:
    """FP8's settings (before any work) and, given, the device (as the models are built): one line for what
    cannot run."""
    if not recipe:
        return
    if recipe not in RECIPES:
        raise ConfigError(f"FP8={recipe!r}: choose tensorwise, rowwise or '' (off)")
    if base_dtype == "nf4":
        raise ConfigError("FP8 with BASE_DTYPE=nf4: a 4-bit base has no high-precision weight to cast to float8; "
                          "choose one of them")
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        raise ConfigError("FP8 needs torchao (pip install torchao, requirements-dev.txt)") from None
    if device is not None and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        name = torch.cuda.get_device_name(device)
        major, minor = torch.cuda.get_device_capability(device)
        raise ConfigError(f"FP8={recipe}: {name} (sm_{major}{minor}) has no float8 tensor cores; FP8 needs "
                          "sm_89 or later (L4, L40S, H100, H200, B200)")


def fp8_linears(model: nn.Module, facts: ModelFacts | None = None) -> list[str]:
    """The full names of the Linears FP8 converts (module docstring), by the model's facts (`facts`, or those
    registered for its class: parallel/model_facts.py)."""
    from parallel.lora import block_linears
    facts = facts_of(model, facts)
    unused = facts.unused_modules(model) if facts is not None else []
    # a LoRA-wrapped layer lists its base_layer (the frozen Linear) and its adapters' Linears: the adapters stay
    names = [n for n in block_linears(model, facts, unused) if ".lora_" not in n]
    return [n for n in names if model.get_submodule(n).in_features % 16 == 0
            and model.get_submodule(n).out_features % 16 == 0]


def gathers_in_float8(lora: bool, shard_ranks: int) -> bool:
    """Whether FP8=tensorwise all-gathers a model's weights in float8: a full model (LoRA's base is frozen) whose
    shard group has ranks to gather from. On a group of one there is nothing to gather, and FSDP2 leaves a weight
    with an all-gather extension unsharded there (fsdp_utils.unsharded_on_one_rank). The scripts and the planner
    both ask here."""
    return not lora and shard_ranks > 1


def convert(model: nn.Module, recipe: str, *, float8_all_gather: bool, emulate: bool,
            facts: ModelFacts | None = None) -> int:
    """Swap the chosen Linears (fp8_linears, by `facts`) for torchao Float8Linear, in place, on the meta
    skeleton before the parallelize recipe. `float8_all_gather` (tensorwise, trained weights): FSDP2 gathers
    them in float8. Returns how many were converted."""
    if not recipe:
        return 0
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    check_fp8(recipe, base_dtype="", device=None if emulate else torch.device("cuda", torch.cuda.current_device()))
    chosen = set(fp8_linears(model, facts))
    if not chosen:
        return 0
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate,
                                 enable_fsdp_float8_all_gather=float8_all_gather and recipe == "tensorwise")
    convert_to_float8_training(model, config=config, module_filter_fn=lambda _, fqn: fqn in chosen)
    total = sum(isinstance(m, nn.Linear) for m in model.modules())
    print0(f"FP8 {recipe}: {len(chosen)} of {type(model).__name__}'s {total} Linears in float8"
           + (", trained weights all-gathered in float8" if config.enable_fsdp_float8_all_gather else "")
           + (" (emulated: no float8 hardware)" if emulate else ""))
    return len(chosen)


def uses_float8_all_gather(model: nn.Module) -> bool:
    return any(getattr(getattr(m, "config", None), "enable_fsdp_float8_all_gather", False)
               for m in model.modules() if type(m).__name__ == "Float8Linear")


def precompute_scales_after_steps(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """With float8 all-gather: after every optimizer step, every trained weight's float8 scale for the next
    all-gathers, computed for all of them at once (one all-reduce of the amaxes)."""
    if uses_float8_all_gather(model):
        optimizer.register_step_post_hook(lambda *_: refresh_scales(model))


def refresh_scales(model: nn.Module) -> None:
    """The scales precompute_scales_after_steps keeps, made now: once the weights are loaded or restored, so
    that every step (the first of a run, of a resumed one) gathers with precomputed scales, whichever way the
    run got there."""
    if uses_float8_all_gather(model):
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
        precompute_float8_dynamic_scale_for_fsdp(model)
