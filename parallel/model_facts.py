"""What the generic sharding, LoRA and FP8 machinery needs to know of a model class (`ModelFacts`): which
module classes are its FSDP units, which layers LoRA adapts by default, whether its attention goes through
diffusers' dispatcher. Each family states its model classes' facts in its package
(families/<name>/parallelism.py, the spec's `models`); the rooms and components pass them to parallel/,
which imports no family. `MODELS` is their registry by class name (families/__init__.py fills it from the
specs), for the callers that hold a model but not its family (the memory planner, tests).

    python -m pytest tests/test_parallelize.py -q
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch.nn as nn

# LORA_TARGET_MODULES=blocks: every Linear inside the model's FSDP units but their modulation, as musubi-tuner
# (QwenImageTransformerBlock's Linears, "_mod_" excluded) and ai-toolkit adapt them
LORA_PRESETS = ("blocks",)


@dataclass(frozen=True)
class ModelFacts:
    # module classes that each get their own fully_shard unit: every module of them, in execution order
    # (parallel/execution_order.py), is a unit (parallel/parallelize.py)
    units: tuple[str, ...]
    lora_targets: tuple[str, ...] | Callable  # default LoRA target suffixes (peft's target_modules), or (model) -> them
    attention_dispatcher: bool = False  # its attention goes through diffusers' dispatcher (set_attention_backend)
    unused: Callable | None = None  # (model) -> names of the modules whose output nothing reads: no gradient
    modulation: tuple[str, ...] = ()  # name parts of the units' modulation Linears, left out of the "blocks" preset

    def default_targets(self, model: nn.Module) -> list[str]:
        return list(self.lora_targets(model) if callable(self.lora_targets) else self.lora_targets)

    def unused_modules(self, model: nn.Module) -> list[str]:
        return self.unused(model) if self.unused is not None else []


MODELS: dict[str, ModelFacts] = {}  # model class name -> its facts: the families' (register)


def register(models: Mapping[str, ModelFacts]) -> dict[str, ModelFacts]:
    """Add the families' facts to MODELS, and return MODELS."""
    MODELS.update(models)
    return MODELS


def facts_of(model: nn.Module, facts: ModelFacts | None = None) -> ModelFacts | None:
    """`facts` where the caller passes them, else those registered for the model's class (None: none known)."""
    return facts if facts is not None else MODELS.get(type(model).__name__)
