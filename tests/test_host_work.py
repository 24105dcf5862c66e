"""tools/host_work.py: what counts as a model's own work.

    python -m pytest tests/test_host_work.py -q
"""
from __future__ import annotations

import torch
from diffusers import FluxTransformer2DModel, UNet2DConditionModel

from tools import host_work


def test_models_are_known_by_their_ancestry_under_fully_shard():
    """fully_shard swaps a model's class for FSDP<Model> (a subclass): still the model, its
    forward not host work; anything else (the VAE, CLIP, a head) is."""
    for cls in (UNet2DConditionModel, FluxTransformer2DModel):
        wrapped = type(f"FSDP{cls.__name__}", (cls,), {})
        assert host_work._is_model(object.__new__(cls)) and host_work._is_model(object.__new__(wrapped))
    assert not host_work._is_model(torch.nn.Linear(2, 2))
