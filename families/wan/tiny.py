"""The Wan family's tiny test folders (its spec's `tiny`): a Wan 2.1 text-to-video layout and a Wan 2.2 TI2V-5B one
(both WanPipeline) with random weights, small enough that a 9-frame clip trains in seconds on CPU. Their dataset:
the coloured-shapes prompts.

wan_t2v: AutoencoderKLWan 8x down in space (3 levels) and 4x in time (the real temperal_downsample) to 4 latent
channels with made-up per-channel latents_mean / latents_std (so the normalisation is visible), 9 frames of
32 x 32 px -> 3 x 4 x 4 latents -> 12 tokens of (1, 2, 2) patches; WanTransformer3DModel of 2 blocks, 2 heads of 12
(rope 4 / 4 / 4 for frames / height / width); UMT5EncoderModel 16 wide with a Unigram tokenizer made here in the
UMT5 tokenizer's class (T5TokenizerFast: <pad> 0, </s> 1, <unk> 2, as google/umt5-xxl); the real repo's
UniPCMultistepScheduler config (flow sigmas, flow_shift 3.0: Wan2.1-T2V-1.3B-Diffusers/scheduler).

wan_ti2v: the same text encoder and a transformer of 8 in / out channels with TI2V-5B's layout: model_index.json's
expand_timesteps true, a 2.2-style AutoencoderKLWan as configs/wan2.2-ti2v-5b/vae holds it (is_residual, 12 in /
out channels of a 2 x 2 pixel patch, a decoder wider than the encoder, scale_factor_spatial 16) to 8 latent
channels with made-up latents_mean / latents_std, and the real repo's scheduler (flow_shift 5.0): 9 frames of 64 x
64 px -> 3 x 4 x 4 latents -> 12 tokens.

wan_a14b: wan_t2v with Wan 2.2 T2V-A14B's layout: a second expert (transformer_2, the same config, other weights)
and model_index.json's boundary_ratio 0.875.

wan_i2v: wan_t2v with Wan 2.1 I2V-14B's layout (WanImageToVideoPipeline): a transformer of 4 + 4 + 4 input
channels (the noisy latents, the 4-channel first-frame mask, the first frame's latents) reading CLIP image tokens
(image_dim 16, added_kv_proj_dim its inner 24), a CLIPVisionModelWithProjection 16 wide of 8 px patches at 32 px
(17 image tokens) and its CLIPImageProcessor (OpenAI CLIP's mean and std, 32 px); its dataset: 16 first images of
coloured shapes (40 px, stretched to the clip's size as the pipeline reads them) with their prompts.

wan_i2v_a14b: wan_i2v with Wan 2.2 I2V-A14B's layout: no CLIP (no image_dim, no image encoder), two experts of 4 + 4
+ 4 input channels, model_index.json's boundary_ratio 0.9; the same first images.

wan_ti2v_i2v: wan_ti2v as WanImageToVideoPipeline (TI2V-5B's image mode: expand_timesteps, its first frame in the
latents, no CLIP); the same first images.

    python -m pytest tests/test_tiny_models.py tests/test_wan.py -q
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

from families.tiny.data import make_image_prompt_dataset, make_prompt_data, write_jsonl
from families.tiny.models import seeded
from families.tiny.tokenizers import CHARS, WORDS

TEXT_MAX_LENGTH = 512  # the UMT5 tokenizer's model_max_length in the Wan repos: WanPipeline's 512 text tokens
LATENTS_MEAN = [0.1, -0.2, 0.05, 0.3]
LATENTS_STD = [0.9, 1.1, 1.3, 0.7]
TI2V_LATENTS_MEAN = [0.1, -0.2, 0.05, 0.3, -0.1, 0.2, 0.0, -0.3]
TI2V_LATENTS_STD = [0.9, 1.1, 1.3, 0.7, 0.5, 1.2, 0.8, 1.0]
# Wan-AI/Wan2.1-T2V-1.3B-Diffusers scheduler/scheduler_config.json (diffusers' UniPCMultistepScheduler)
SCHEDULER = dict(num_train_timesteps=1000, beta_start=0.0001, beta_end=0.02, beta_schedule="linear",
                 solver_order=2, prediction_type="flow_prediction", thresholding=False, predict_x0=True,
                 solver_type="bh2", lower_order_final=True, disable_corrector=[], use_flow_sigmas=True,
                 flow_shift=3.0, timestep_spacing="linspace", steps_offset=0, final_sigmas_type="zero")


def write_umt5_tokenizer(folder, max_length=TEXT_MAX_LENGTH, words=WORDS):
    """A tiny UMT5 tokenizer (T5TokenizerFast, the class google/umt5-xxl's tokenizer loads as): a Unigram model of
    `▁word` pieces for `words` and single characters, <pad> 0, </s> 1, <unk> 2. Returns the reloaded tokenizer."""
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [("▁" + word, -1.0) for word in words]  # a whole word beats its characters
    pieces += [(c, -3.0) for c in CHARS + CHARS[:26].upper()]
    tokenizer = T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=max_length)
    tokenizer.save_pretrained(folder)
    return T5TokenizerFast.from_pretrained(folder)


def make_tiny_wan_t2v(folder, seed=0, ti2v=False, a14b=False, i2v=False):
    """Write a Wan2.1-T2V-layout diffusers folder (WanPipeline: transformer, vae, text_encoder, tokenizer,
    scheduler), or with `ti2v` Wan2.2-TI2V-5B's (its 2.2 VAE, expand_timesteps, flow_shift 5), or with `a14b`
    Wan2.2-T2V-A14B's (a second expert, transformer_2, of other weights, boundary_ratio 0.875), or with `i2v`
    Wan2.1-I2V-14B's (WanImageToVideoPipeline: 12 input channels, CLIP image tokens). Returns the folder."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    folder = Path(folder)
    channels = 8 if ti2v else 4
    tokenizer = write_umt5_tokenizer(folder / "tokenizer")
    config = UMT5Config(vocab_size=len(tokenizer), d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
                        relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", pad_token_id=0,
                        eos_token_id=1, decoder_start_token_id=0)
    with seeded(seed):
        text_encoder = UMT5EncoderModel(config).eval()
    # I2V: the noisy latents, the first-frame mask (4: the VAE's frames per latent frame), its latents; 2.1's CLIP
    image = dict(in_channels=2 * channels + 4) if i2v and not ti2v else {}  # TI2V-5B: its first frame in the latents
    if i2v and not a14b and not ti2v:
        image.update(image_dim=16, added_kv_proj_dim=24)
    expert = functools.partial(
        WanTransformer3DModel, patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
        **{"in_channels": channels, **image}, out_channels=channels, text_dim=config.d_model, freq_dim=32,
        ffn_dim=48, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=64)
    with seeded(seed + 1):
        transformer = expert()
    transformer_2 = None
    if a14b:  # Wan-AI/Wan2.2-T2V-A14B-Diffusers: two experts of one config
        with seeded(seed + 3):
            transformer_2 = expert()
    with seeded(seed + 2):
        vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                               temperal_downsample=[False, True, True], latents_mean=LATENTS_MEAN,
                               latents_std=LATENTS_STD)
    if ti2v:  # Wan-AI/Wan2.2-TI2V-5B-Diffusers: vae/config.json's 2.2 layout, scheduler/ flow_shift 5
        with seeded(seed + 2):
            vae = AutoencoderKLWan(base_dim=8, decoder_base_dim=12, z_dim=channels, dim_mult=[1, 2, 2, 2],
                                   num_res_blocks=1, temperal_downsample=[False, True, True], is_residual=True,
                                   in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16,
                                   latents_mean=TI2V_LATENTS_MEAN, latents_std=TI2V_LATENTS_STD)
    if i2v:
        return _save_i2v(folder, tokenizer, text_encoder, vae, transformer, transformer_2, seed, ti2v)
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                       scheduler=UniPCMultistepScheduler(**{**SCHEDULER, "flow_shift": 5.0 if ti2v else 3.0}),
                       expand_timesteps=ti2v, transformer_2=transformer_2, boundary_ratio=0.875 if a14b else None)
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder


def _save_i2v(folder, tokenizer, text_encoder, vae, transformer, transformer_2, seed, ti2v=False):
    """WanImageToVideoPipeline's folder: the parts given, and a tiny CLIP vision encoder and its image processor
    (2.1), or the second expert and boundary_ratio 0.9 (2.2 A14B, no CLIP), or with `ti2v` TI2V-5B's image mode
    (expand_timesteps, flow_shift 5, no CLIP)."""
    from diffusers import UniPCMultistepScheduler, WanImageToVideoPipeline
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection
    config = CLIPVisionConfig(hidden_size=16, intermediate_size=32, projection_dim=16, num_hidden_layers=2,
                              num_attention_heads=2, image_size=32, patch_size=8)
    with seeded(seed + 4):
        image_encoder = CLIPVisionModelWithProjection(config).eval()
    processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    clip = {} if transformer_2 or ti2v else {"image_processor": processor, "image_encoder": image_encoder}
    scheduler = UniPCMultistepScheduler(**{**SCHEDULER, "flow_shift": 5.0 if ti2v else 3.0})
    pipe = WanImageToVideoPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                                   scheduler=scheduler, transformer_2=transformer_2, expand_timesteps=ti2v,
                                   boundary_ratio=0.9 if transformer_2 else None, **clip)
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder


def build_wan_t2v(root):
    """tiny_wan_t2v: the Wan 2.1 T2V folder and 32 coloured-shapes prompts (data/prompts.txt, data/data.jsonl)."""
    make_tiny_wan_t2v(root / "model")
    make_prompt_data(root / "data", 32)


def build_wan_ti2v(root):
    """tiny_wan_ti2v: the Wan 2.2 TI2V-5B folder and the same 32 prompts."""
    make_tiny_wan_t2v(root / "model", ti2v=True)
    make_prompt_data(root / "data", 32)


def build_wan_a14b(root):
    """tiny_wan_a14b: the Wan 2.2 T2V-A14B folder (two experts) and the same 32 prompts."""
    make_tiny_wan_t2v(root / "model", a14b=True)
    make_prompt_data(root / "data", 32)


def build_wan_i2v(root, a14b=False, ti2v=False):
    """tiny_wan_i2v: the Wan 2.1 I2V folder (`a14b`: tiny_wan_i2v_a14b, Wan 2.2 I2V-A14B's) and 16 first images with
    their prompts (data/data.jsonl: "control", "prompt")."""
    make_tiny_wan_t2v(root / "model", i2v=True, a14b=a14b, ti2v=ti2v)
    make_image_prompt_dataset(root / "data", 16, size=40)
    rows = [json.loads(line) for line in (root / "data" / "data.jsonl").read_text().splitlines()]
    write_jsonl(root / "data" / "data.jsonl", [{"control": r["image"], "prompt": r["prompt"]} for r in rows])


def build_wan_i2v_a14b(root):
    """tiny_wan_i2v_a14b: the Wan 2.2 I2V-A14B folder (two experts, no CLIP) and the same 16 first images."""
    build_wan_i2v(root, a14b=True)


def build_wan_ti2v_i2v(root):
    """tiny_wan_ti2v_i2v: the Wan 2.2 TI2V-5B folder as WanImageToVideoPipeline and the same 16 first images."""
    build_wan_i2v(root, ti2v=True)
