"""What the families' tiny builders share: the image side, seeding, the CLIP text encoder (SD-1.5, SDXL,
FLUX.1), quiet logs while saving.

    python -m pytest tests/test_tiny_models.py -q
"""
from __future__ import annotations

import contextlib

import torch

IMAGE_SIZE = 64  # default image side in pixels for both tiny models and their datasets


@contextlib.contextmanager
def seeded(seed):
    """Seed torch for deterministic random init without disturbing the caller's RNG state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def clip_text_encoder(tokenizer, seed, projection_dim=32, hidden_act="quick_gelu", with_projection=False):
    """A 2-layer, 32-wide CLIPTextModel whose vocab and positions match `tokenizer`
    (with_projection: CLIPTextModelWithProjection, SDXL's second encoder)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=tokenizer.model_max_length,
        projection_dim=projection_dim, hidden_act=hidden_act,  # SD-1.5's CLIP ViT-L: quick_gelu
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    with seeded(seed):
        return (CLIPTextModelWithProjection if with_projection else CLIPTextModel)(config).eval()


@contextlib.contextmanager
def quiet_logs():
    """transformers' and diffusers' warnings off (expected ones: the PIL image processor fallback, the
    processor slot the Qwen builder writes itself)."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    levels = [(lib, lib.get_verbosity()) for lib in (transformers_logging, diffusers_logging)]
    for lib, _ in levels:
        lib.set_verbosity_error()
    try:
        yield
    finally:
        for lib, level in levels:
            lib.set_verbosity(level)
