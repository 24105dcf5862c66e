"""The Z-Image family's tiny test folders (its spec's `tiny`): a Z-Image layout (ZImagePipeline) and an Omni layout
(ZImageOmniPipeline) with random weights, small enough that DMD2 of a 32 px target trains in seconds on CPU. Their
datasets: the coloured-shapes prompts; two-reference edits (a 64 px shape and a 64 px colour swatch) for Omni.

z_image: AutoencoderKL as FLUX.1's (8x down, FLUX.1's shift_factor / scaling_factor) to 4 latent channels, 32 x 32
px -> 4 x 4 latents -> 4 tokens of 2x2 patches (padded to 32 by the transformer); ZImageTransformer2DModel 32 wide
(2 heads of 16, rope 4 / 6 / 6), 1 noise and 1 context refiner block, 2 main blocks; a Qwen3Model 16 wide with 2
layers (the pipeline reads hidden_states[-2]) and a tiny Qwen3 tokenizer made here in the Qwen tokenizer's class
(Qwen2Tokenizer) with Qwen3's chat template, which takes enable_thinking; the base model's scheduler config
(FlowMatchEulerDiscreteScheduler, static shift 6.0, no dynamic shifting; Turbo's is 3.0).

z_image_omni: the same parts, the transformer with SigLIP inputs (siglip_feat_dim 16: its siglip embedder and one
siglip refiner block), a Siglip2VisionModel 16 wide with 1 layer (patch 16) and a Siglip2ImageProcessor of at most
16 patches (the real one: 256 patches of so400m's 1152 features).

    python -m pytest tests/test_tiny_models.py tests/test_z_image.py -q
"""
from __future__ import annotations

from pathlib import Path

from families.flux2.tiny import _qwen3_text_encoder, write_qwen3_tokenizer
from families.tiny.data import make_prompt_data, make_two_reference_edit_dataset
from families.tiny.models import seeded

LATENT_CHANNELS = 4
# Tongyi-MAI/Z-Image scheduler/scheduler_config.json as the issue gives it: a static shift (6.0 for the base, 3.0
# for Turbo) that the pipeline applies to its own linspace(1, 1/N, N); its mu goes unused
SCHEDULER = dict(num_train_timesteps=1000, shift=6.0, use_dynamic_shifting=False)


SIGLIP = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, patch_size=16,
              num_patches=16)
SIGLIP_PROCESSOR = dict(patch_size=16, max_num_patches=16)


def make_tiny_z_image(folder, seed=0, omni=False):
    """Write a Z-Image-layout diffusers folder (ZImagePipeline: transformer, vae, text_encoder, tokenizer,
    scheduler; `omni`: ZImageOmniPipeline, + siglip, siglip_processor). Returns the folder."""
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImageOmniPipeline, ZImagePipeline,
                           ZImageTransformer2DModel)

    folder = Path(folder)
    tokenizer = write_qwen3_tokenizer(folder / "tokenizer")
    # a Qwen3Model of 2 layers (the pipeline reads the hidden states of the layer before the last)
    text_encoder = _qwen3_text_encoder(tokenizer, seed, layers=2, causal_lm=False)
    with seeded(seed + 1):
        transformer = ZImageTransformer2DModel(
            all_patch_size=(2,), all_f_patch_size=(1,), in_channels=LATENT_CHANNELS, dim=32, n_layers=2,
            n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=text_encoder.config.hidden_size,
            axes_dims=[4, 6, 6], axes_lens=[1024, 64, 64], siglip_feat_dim=SIGLIP["hidden_size"] if omni else None)
    with seeded(seed + 2):
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=LATENT_CHANNELS, sample_size=32,
            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
            block_out_channels=(8, 16, 32, 32), layers_per_block=1, norm_num_groups=8,
            shift_factor=0.1159, scaling_factor=0.3611,  # the FLUX.1 VAE's values, which Z-Image uses
            use_quant_conv=False, use_post_quant_conv=False)
    parts = dict(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER), vae=vae, text_encoder=text_encoder,
                 tokenizer=tokenizer, transformer=transformer)
    if omni:
        from transformers import Siglip2ImageProcessor, Siglip2VisionConfig, Siglip2VisionModel
        with seeded(seed + 3):
            siglip = Siglip2VisionModel(Siglip2VisionConfig(**SIGLIP)).eval()
        pipe = ZImageOmniPipeline(**parts, siglip=siglip, siglip_processor=Siglip2ImageProcessor(**SIGLIP_PROCESSOR))
    else:
        pipe = ZImagePipeline(**parts)
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder


def build_z_image(root):
    """tiny_z_image: the Z-Image folder and 32 coloured-shapes prompts (data/prompts.txt, data/data.jsonl)."""
    make_tiny_z_image(root / "model")
    make_prompt_data(root / "data", 32)


def build_z_image_omni(root):
    """tiny_z_image_omni: the Omni folder and 32 two-reference edits (64 px images: the pipeline refuses a side
    under 64 px, Flux2ImageProcessor.check_image_input)."""
    make_tiny_z_image(root / "model", omni=True)
    make_two_reference_edit_dataset(root / "data", 32, swatch=64)
