"""LoRA under FSDP2: peft adapters on a frozen base, inside the same per-block FSDP units.

Dtypes inside one unit: the base is frozen and stored in its compute dtype (bf16 in the bf16
modes), the adapters are trainable and stored in fp32 (so their grads and AdamW state are fp32).
They share their block's FSDP unit: FSDP2 shards per parameter and, with the unit's
MixedPrecisionPolicy(param_dtype=compute), all-gathers every parameter of the unit cast to the
compute dtype, so mixed storage dtypes are fine; only parameters that require grad get grads,
reduce-scattered in `Precision.adapter_mp_policy`'s fp32. Separate units per adapter would add
two tiny all-gathers per targeted Linear (hundreds per step) for nothing.

    python -m pytest tests/test_lora.py -q
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn as nn

from core.errors import ConfigError
from fsdp_utils import fill_local, local_tensor
from parallel.model_facts import LORA_PRESETS, ModelFacts, facts_of


@dataclass(frozen=True)
class Lora:
    """The scripts' LORA_* settings. rank 0 = no adapters (full fine-tuning)."""
    rank: int = 0
    alpha: float = 0.0  # scaling = alpha / rank; 0 = alpha equal to rank (scaling 1)
    # module-name suffixes (peft's target_modules); () = the model's defaults (its ModelFacts.lora_targets)
    targets: tuple[str, ...] = ()
    dropout: float = 0.0
    init: str = "gaussian"  # lora_A's init (lora_B = 0 either way): "gaussian" or peft's "default" (kaiming-uniform)

    def __bool__(self) -> bool:
        return self.rank > 0

    @classmethod
    def from_settings(cls, config: dict) -> "Lora":
        """The scripts' LORA_RANK, LORA_ALPHA, LORA_TARGET_MODULES, LORA_DROPOUT, LORA_INIT."""
        return cls(config["LORA_RANK"], config["LORA_ALPHA"], tuple(config["LORA_TARGET_MODULES"]),
                   config["LORA_DROPOUT"], config["LORA_INIT"])

    @property
    def peft_init(self) -> bool | str:
        """LoraConfig's init_lora_weights for `init`: True is peft's default (kaiming-uniform)."""
        return True if self.init == "default" else self.init


INITS = ("gaussian", "default")  # LORA_INIT's choices (init_lora draws both)


def check_lora(lora: Lora) -> None:
    """The settings alone (before any model exists)."""
    if lora.rank < 0:
        raise ConfigError(f"LORA_RANK={lora.rank}: must be >= 0 (0 = full fine-tuning)")
    if lora.alpha < 0 or not 0 <= lora.dropout < 1:
        raise ConfigError(f"LORA_ALPHA={lora.alpha}, LORA_DROPOUT={lora.dropout}: need alpha >= 0 and 0 <= dropout < 1")
    if lora.init not in INITS:
        raise ConfigError(f"LORA_INIT={lora.init!r}: choose one of {', '.join(INITS)}")


def lora_targets(model: nn.Module, lora: Lora, facts: ModelFacts | None = None) -> list[str]:
    """The target suffixes, each checked to name at least one Linear/Conv of `model` (peft's rule:
    a module whose full name equals the target or ends with "." + target); a target that matches
    nothing is a ConfigError naming it (peft alone would ignore it when another one matches). No
    targets: the model's defaults (`facts`, or those registered for its class: parallel.model_facts)."""
    facts = facts_of(model, facts)
    targets = list(lora.targets) or (facts.default_targets(model) if facts is not None else [])
    if not targets:
        raise ConfigError(f"LORA_TARGET_MODULES is empty and {type(model).__name__} has no default targets")
    names = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    unused = facts.unused_modules(model) if facts is not None else []
    if targets == ["blocks"]:
        return block_linears(model, facts, unused)
    if any(t in LORA_PRESETS for t in targets):
        raise ConfigError(f"LORA_TARGET_MODULES={targets}: a preset ({', '.join(LORA_PRESETS)}) stands alone")
    for t in targets:
        hits = [n for n in names if n == t or n.endswith("." + t)]
        if not hits:
            raise ConfigError(f"LORA_TARGET_MODULES: {t!r} matches no Linear or Conv2d module of "
                              f"{type(model).__name__} (e.g. {sorted({n.split('.')[-1] for n in names})[:8]})")
        dead = [n for n in hits if any(n == u or n.startswith(u + ".") for u in unused)]
        if dead:
            raise ConfigError(f"LORA_TARGET_MODULES: {t!r} adapts {dead[0]}, whose output nothing reads in "
                              f"{type(model).__name__}, so it would get no gradient; name the modules to adapt "
                              f"by longer suffixes that leave out {', '.join(unused)}")
    return targets


def block_linears(model: nn.Module, facts: ModelFacts | None, unused: list[str]) -> list[str]:
    """The "blocks" preset: the full names of the Linears inside the model's FSDP units (its blocks), but
    their modulation and the modules nothing reads."""
    if facts is None:
        raise ConfigError(f"LORA_TARGET_MODULES=blocks: no block classes known for {type(model).__name__}")
    out = []
    for name, unit in model.named_modules():
        if type(unit).__name__ in facts.units:
            out += [f"{name}.{n}" for n, m in unit.named_modules() if isinstance(m, nn.Linear)
                    and not any(part in f"{n}." for part in facts.modulation)]
    return [n for n in out if not any(n == u or n.startswith(u + ".") for u in unused)]


def check_lora_targets(class_name: str, folder: str, lora: Lora, facts: ModelFacts | None = None) -> list[str]:
    """lora_targets on the diffusers model `class_name` of `folder`, built on the meta device (no
    memory, a second or two for 12 B): bad targets fail before any work."""
    import diffusers
    cls = getattr(diffusers, class_name)
    with torch.device("meta"):
        return lora_targets(cls.from_config(cls.load_config(folder)), lora, facts)


def add_lora(model: nn.Module, lora: Lora, facts: ModelFacts | None = None) -> nn.Module:
    """peft LoRA adapters (diffusers' `add_adapter` with a `LoraConfig`) on the targets of `model`
    (lora_targets; `facts`: the model's, for its defaults) (on the meta device before sharding, or
    materialised): the base frozen, the adapters trainable and stored in fp32. Call before the parallelize
    recipe, so each adapter lands in its block's FSDP unit, and after casting the base to its storage dtype."""
    from peft import LoraConfig
    targets = lora_targets(model, lora, facts)
    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=lora.rank, lora_alpha=lora.alpha or lora.rank, lora_dropout=lora.dropout,
                                 target_modules=targets, init_lora_weights=lora.peft_init))
    for name, p in model.named_parameters():
        if is_adapter(name):
            p.data = p.data.float()
            p.requires_grad_(True)
    return model


def is_adapter(name: str) -> bool:
    """Whether a parameter name is a LoRA adapter's (peft's `<layer>.lora_A.<adapter>.weight`)."""
    return ".lora_A." in name or ".lora_B." in name


def safetensors_key(name: str) -> str:
    """The tensor name in the model's safetensors for a (possibly LoRA-wrapped) parameter: peft
    moves a targeted layer's own weight to `<layer>.base_layer.weight`."""
    return name.replace(".base_layer.", ".")


@torch.no_grad()
def init_lora(model: nn.Module, seed: int) -> None:
    """Initialise the adapters as peft does for the init their LoraConfig names (add_lora), lora_B
    = 0 so the model starts equal to its base, and lora_A (peft 0.21 tuners/lora/layer.py:335-340,
    `reset_lora_parameters`): "gaussian" ~ N(0, 1/rank²); peft's default (init_lora_weights=True)
    kaiming-uniform with a = √5, i.e. U(±1/√fan_in), fan_in = in_features (Conv2d: in_channels ×
    kernel area). Each full lora_A is drawn from a generator seeded by (seed, name), and this rank
    keeps its rows: the same adapters whatever the world size."""
    init = model.peft_config["default"].init_lora_weights if hasattr(model, "peft_config") else "gaussian"
    for name, p in model.named_parameters():
        if not is_adapter(name):
            continue
        if ".lora_B." in name:
            local_tensor(p).zero_()
            continue
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        if init is True:
            full = torch.nn.init.kaiming_uniform_(torch.empty(p.shape), a=math.sqrt(5), generator=g)
        else:
            full = torch.randn(p.shape, generator=g) / p.shape[0]  # std 1/rank (peft: normal_(std=1/r))
        fill_local(p, lambda index: full[index])
