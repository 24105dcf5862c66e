"""The SD UNet family's tiny test folders (its spec's `tiny`): SD-1.5 and SDXL layouts with random weights.

- sd15: 64x64 px images; VAE 4x down (3 blocks) -> 4x16x16 latents; UNet (32, 64) channels, so its mid block
  is 64x8x8 - the size SD-1.5's GAN head expects (conv s2 then conv s4 -> 1x1); CLIP text hidden 32, 32 tokens.
- sdxl: sd15's sizes with SDXL's parts: two CLIP encoders (the second projected, 16), their hidden states
  concatenated (64) for the UNet, which takes SDXL's text_time added conditions.

    python -m pytest tests/test_tiny_models.py -q
"""
from __future__ import annotations

from pathlib import Path

from families.tiny.data import make_image_prompt_dataset, make_prompts_file
from families.tiny.models import IMAGE_SIZE, clip_text_encoder, seeded
from families.tiny.tokenizers import write_clip_tokenizer


def _sd_vae(seed, **config):
    """The tiny 4-channel, 4x-down AutoencoderKL of the SD-1.5 and SDXL folders (64 px -> 16x16);
    `config` adds each model's own values (scaling factor, upcast)."""
    from diffusers import AutoencoderKL

    with seeded(seed):
        return AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=4, sample_size=IMAGE_SIZE,
            down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
            block_out_channels=(16, 32, 32), layers_per_block=1, norm_num_groups=8, **config)


def make_tiny_sd15(folder, seed=0):
    """Write an SD-1.5-layout diffusers folder (unet, vae, text_encoder, tokenizer, scheduler).

    64x64 px images, VAE 4x down to 4x16x16 latents, UNet sample_size 16. Returns the folder.
    """
    from diffusers import DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel

    folder = Path(folder)
    tokenizer = write_clip_tokenizer(folder / "tokenizer")  # keeps vocab.json + merges.txt
    text_encoder = clip_text_encoder(tokenizer, seed)
    with seeded(seed + 1):
        unet = UNet2DConditionModel(
            sample_size=IMAGE_SIZE // 4, in_channels=4, out_channels=4,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=8,
            cross_attention_dim=text_encoder.config.hidden_size, attention_head_dim=4)
    vae = _sd_vae(seed + 2, scaling_factor=0.18215)  # SD-1.5's VAE scaling factor
    # SD-1.5's noise schedule (scheduler_config.json of runwayml/stable-diffusion-v1-5).
    scheduler = DDIMScheduler(
        num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
        prediction_type="epsilon", clip_sample=False, set_alpha_to_one=False, steps_offset=1)
    pipe = StableDiffusionPipeline(
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, scheduler=scheduler,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder


def make_tiny_sdxl(folder, seed=0):
    """Write an SDXL-layout diffusers folder (unet, vae, text_encoder, text_encoder_2, tokenizer,
    tokenizer_2, scheduler) that StableDiffusionXLPipeline loads: two CLIP text encoders (the
    second with a projection, whose pooled output is SDXL's `text_embeds`), a UNet with
    `addition_embed_type="text_time"` taking their concatenated penultimate hidden states
    (32 + 32 = 64 wide) and the (text_embeds, time_ids) added conditions; 64 px, 16x16 latents."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel

    folder = Path(folder)
    tokenizer = write_clip_tokenizer(folder / "tokenizer")
    tokenizer_2 = write_clip_tokenizer(folder / "tokenizer_2")
    text_encoder = clip_text_encoder(tokenizer, seed)
    # SDXL's second encoder (OpenCLIP bigG): gelu, and a projection whose output is text_embeds
    text_encoder_2 = clip_text_encoder(tokenizer_2, seed + 3, projection_dim=16, hidden_act="gelu",
                                        with_projection=True)
    config_2 = text_encoder_2.config
    time_dim = 8  # addition_time_embed_dim: each of the 6 time ids embedded to 8 numbers
    with seeded(seed + 1):
        unet = UNet2DConditionModel(
            sample_size=IMAGE_SIZE // 4, in_channels=4, out_channels=4,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=8,
            cross_attention_dim=text_encoder.config.hidden_size + config_2.hidden_size,
            attention_head_dim=(2, 4), transformer_layers_per_block=(1, 2), use_linear_projection=True,
            addition_embed_type="text_time", addition_time_embed_dim=time_dim,
            projection_class_embeddings_input_dim=6 * time_dim + config_2.projection_dim)
    vae = _sd_vae(seed + 2, scaling_factor=0.13025, force_upcast=True)  # SDXL's VAE scaling factor
    # SDXL's noise schedule (stabilityai/stable-diffusion-xl-base-1.0 scheduler_config.json)
    scheduler = EulerDiscreteScheduler(
        num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
        prediction_type="epsilon", steps_offset=1, timestep_spacing="leading")
    pipe = StableDiffusionXLPipeline(
        vae=vae, text_encoder=text_encoder, text_encoder_2=text_encoder_2, tokenizer=tokenizer,
        tokenizer_2=tokenizer_2, unet=unet, scheduler=scheduler)
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder


def build_sd15(root):
    """tiny_sd15: the SD-1.5 folder, prompts and prompt + image rows."""
    make_tiny_sd15(root / "model")
    make_prompts_file(root / "data" / "prompts.txt", 64)  # DMD stage 1: text prompts only
    make_image_prompt_dataset(root / "data", 64)  # DMD stage 2: real images for the GAN


def build_sdxl(root):
    """tiny_sdxl: the SDXL folder, prompts and prompt + image rows."""
    make_tiny_sdxl(root / "model")
    make_prompts_file(root / "data" / "prompts.txt", 64)
    make_image_prompt_dataset(root / "data", 64)
