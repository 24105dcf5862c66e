"""The FLUX.1 family in the GPU check (families/gpu.GpuCheck): Kontext's transformer at real width with fewer
double + single blocks beside its real VAE, CLIP-L and a one-layer T5 of the real width (random weights),
edits with one context image.

    python -m pytest tests/test_gpu_check.py -q -m "not slow"
"""
from __future__ import annotations

import os

from families.gpu import GpuCheck


def _vae(tiny: str, real: str):
    from diffusers import AutoencoderKL
    return AutoencoderKL.from_config(AutoencoderKL.load_config(os.path.join(real, "vae")))


def _clip(tiny: str, real: str):
    from transformers import CLIPTextConfig, CLIPTextModel
    return CLIPTextModel(CLIPTextConfig.from_pretrained(os.path.join(real, "text_encoder")))


def _t5(tiny: str, real: str):
    """One T5 layer of the real width (the transformer's joint_attention_dim), the tiny tokenizer's vocabulary."""
    from diffusers import FluxTransformer2DModel
    from transformers import T5Config, T5EncoderModel, T5TokenizerFast
    width = FluxTransformer2DModel.load_config(os.path.join(real, "transformer"))
    vocab = len(T5TokenizerFast.from_pretrained(os.path.join(tiny, "tokenizer_2")))
    return T5EncoderModel(T5Config(vocab_size=vocab, d_model=width["joint_attention_dim"], d_kv=64, d_ff=1024,
                                   num_layers=1, num_heads=8, feed_forward_proj="gated-gelu", pad_token_id=0,
                                   eos_token_id=1))


def reference_shape(folder, data, settings):
    """(T5's length, Kontext's one context at the target's size)."""
    from transformers import AutoTokenizer
    length = min(512, AutoTokenizer.from_pretrained(os.path.join(folder, "tokenizer_2")).model_max_length)
    return length, (settings["resolution"],)


GPU = GpuCheck(label="FLUX", configs="flux-kontext-dev",
               parts=(("vae", _vae), ("text_encoder", _clip), ("text_encoder_2", _t5)),
               keep=("tokenizer", "tokenizer_2", "scheduler"),
               reference_shape=reference_shape, blocks=("num_layers", "num_single_layers"), default_blocks=(2, 4))
