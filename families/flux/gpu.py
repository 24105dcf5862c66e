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


def reference_inputs(folder, resolution, references, batch, text_len, device, dtype, g):
    """(FluxTransformer2DModel, its forward's inputs, images a step encodes): the target's and Kontext's context's
    packed tokens, the T5 embeddings and the pooled CLIP vector, σ, the embedded guidance."""
    import torch
    from diffusers import FluxTransformer2DModel

    from parallel import attention
    model = FluxTransformer2DModel.from_pretrained(os.path.join(folder, "transformer"), torch_dtype=dtype)
    attention.set_backend(model, attention.DEFAULT)
    c, side = model.config, resolution // 16
    image = 2 * side * side  # target + context tokens
    ids = torch.zeros(image, 3, device=device)
    args = dict(hidden_states=torch.randn(batch, image, c.in_channels, device=device, dtype=dtype, generator=g),
                encoder_hidden_states=torch.randn(batch, text_len, c.joint_attention_dim, device=device,
                                                  dtype=dtype, generator=g),
                pooled_projections=torch.randn(batch, c.pooled_projection_dim, device=device, dtype=dtype,
                                               generator=g),
                timestep=torch.full((batch,), 0.5, device=device), guidance=torch.ones(batch, device=device),
                txt_ids=torch.zeros(text_len, 3, device=device), img_ids=ids)
    return model, args, 2 * batch


def reference_shape(folder, data, settings):
    """(T5's length, no further references: the context is the reference's own)."""
    from transformers import AutoTokenizer
    return min(512, AutoTokenizer.from_pretrained(os.path.join(folder, "tokenizer_2")).model_max_length), ()


GPU = GpuCheck(label="FLUX", configs="flux-kontext-dev",
               parts=(("vae", _vae), ("text_encoder", _clip), ("text_encoder_2", _t5)),
               keep=("tokenizer", "tokenizer_2", "scheduler"), reference_inputs=reference_inputs,
               reference_shape=reference_shape, blocks=("num_layers", "num_single_layers"), default_blocks=(2, 4))
