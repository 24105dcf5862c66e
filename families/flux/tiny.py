"""The FLUX.1 family's tiny test folder (its spec's `tiny`): a FLUX.1-Kontext layout with random weights.

flux_kontext: 64x64 px images; VAE 8x down (4 blocks) -> 4x8x8 latents, packed 2x2 -> 16 tokens of 16
channels; transformer hidden 32 (2 double + 2 single blocks); CLIP hidden 32 (pooled), T5 d_model 32. Use
`max_sequence_length=32` for T5 (the pipeline default pads to 512).

    python -m pytest tests/test_tiny_models.py -q
"""
from __future__ import annotations

from pathlib import Path

from families.tiny.data import make_edit_dataset
from families.tiny.models import IMAGE_SIZE, clip_text_encoder, seeded
from families.tiny.tokenizers import CHARS, TEXT_MAX_LENGTH, WORDS, write_clip_tokenizer


def write_t5_tokenizer(folder, max_length=TEXT_MAX_LENGTH):
    """Write a tiny T5 tokenizer (a Unigram model from (piece, score) pairs) into `folder`.

    Ids 0, 1, 2 are `<pad>`, `</s>`, `<unk>` as in T5; then `▁`, `▁word` pieces for WORDS and
    single characters (lower, upper, digits, punctuation). No `<extra_id_*>` sentinels. Returns
    the reloaded T5TokenizerFast.
    """
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [("▁" + word, -1.0) for word in WORDS]  # a whole word beats its characters
    pieces += [(c, -3.0) for c in CHARS + CHARS[:26].upper()]
    tokenizer = T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=max_length)
    tokenizer.save_pretrained(folder)
    return T5TokenizerFast.from_pretrained(folder)


def make_tiny_flux_kontext(folder, seed=0):
    """Write a FLUX.1-Kontext-layout diffusers folder (transformer, vae, 2 text encoders, ...).

    64x64 px images, VAE 8x down to 4x8x8 latents, packed 2x2 into 16 tokens of 16 channels.
    Returns the folder.
    """
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxKontextPipeline,
                           FluxTransformer2DModel)
    from transformers import T5Config, T5EncoderModel

    folder = Path(folder)
    tokenizer = write_clip_tokenizer(folder / "tokenizer")
    tokenizer_2 = write_t5_tokenizer(folder / "tokenizer_2")
    text_encoder = clip_text_encoder(tokenizer, seed)
    t5_config = T5Config(
        vocab_size=len(tokenizer_2), d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
        relative_attention_num_buckets=8, feed_forward_proj="gated-gelu",  # T5 v1.1, as FLUX
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    with seeded(seed + 1):
        text_encoder_2 = T5EncoderModel(t5_config).eval()
    latent_channels = 4
    with seeded(seed + 2):
        transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=4 * latent_channels, num_layers=2, num_single_layers=2,
            attention_head_dim=16, num_attention_heads=2, joint_attention_dim=t5_config.d_model,
            pooled_projection_dim=text_encoder.config.hidden_size, guidance_embeds=True,
            axes_dims_rope=(4, 4, 8))  # must sum to attention_head_dim
    with seeded(seed + 3):
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=latent_channels, sample_size=IMAGE_SIZE,
            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
            block_out_channels=(8, 16, 32, 32), layers_per_block=1, norm_num_groups=8,
            shift_factor=0.1159, scaling_factor=0.3611,  # the FLUX.1 VAE's values
            use_quant_conv=False, use_post_quant_conv=False)
    # scheduler_config.json of FLUX.1 [dev] / Kontext [dev]: resolution-dependent shift.
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
        max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)
    pipe = FluxKontextPipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, transformer=transformer)
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder


def build_flux_kontext(root):
    """tiny_flux_kontext: the Kontext folder and one-reference edits."""
    make_tiny_flux_kontext(root / "model")
    make_edit_dataset(root / "data", 32)
