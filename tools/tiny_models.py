"""Tiny but real diffusers model folders with random weights, for tests and tools.

They have the exact folder layout of SD-1.5, SDXL, FLUX.1 Kontext [dev] and Qwen-Image-Edit-2509,
are written with `save_pretrained` (safetensors) and read back through the same `from_pretrained`
path as real weights, so tests exercise the real loading code. Everything is built offline (no
hub). The scripts' embedded defaults are not these: they are the trained tiny models shipped in
`assets/`.

    python -m tools.tiny_models sd15        # build (or reuse) the default folders, print the paths
    python -m tools.tiny_models flux_kontext qwen_image_edit

The shapes, colours and captions of the synthetic datasets come from `tools/shapes.py` (the
world the demos use too).

Cache convention: `ensure_default(kind)` builds once (`tools.build_once.build_once`) under
`$FSDP_DIFFUSION_CACHE/tiny_<kind>_v1/` (default `~/.cache/fsdp_diffusion/tiny_<kind>_v1/`) with
`model/` (the diffusers folder) and `data/` (the default dataset, always holding a `data.jsonl`).
Bump `DEFAULTS_VERSION` whenever a tiny config changes, so stale caches are never reused.

Tiny configs (all fp32, deterministic from `seed`):
- sd15: 64x64 px images; VAE 4x down (3 blocks) -> 4x16x16 latents; UNet (32, 64) channels, so
  its mid block is 64x8x8 - the size SD-1.5's GAN head expects (conv s2 then conv s4 -> 1x1);
  CLIP text hidden 32, 32 tokens.
- sdxl: sd15's sizes with SDXL's parts: two CLIP encoders (the second projected, 16), their hidden
  states concatenated (64) for the UNet, which takes SDXL's text_time added conditions.
- flux_kontext: 64x64 px images; VAE 8x down (4 blocks) -> 4x8x8 latents, packed 2x2 -> 16 tokens
  of 16 channels; transformer hidden 32 (2 double + 2 single blocks); CLIP hidden 32 (pooled),
  T5 d_model 32. Use `max_sequence_length=32` for T5 (the pipeline default pads to 512).
- qwen_image_edit: VAE 8x down -> 16 latent channels (the real z_dim and latents_mean/std), packed
  2x2 -> 64-channel tokens (64 px -> 16); transformer hidden 32 (2 blocks, 2 heads of 16); Qwen2.5-VL
  text hidden 32 (2 layers), vision tower hidden 32 with the real patch 14, 2 frames, 2x2 merge;
  a Qwen2 byte-level BPE trained here, Qwen's 22 added tokens after it. Its dataset has two
  references per edit (64 px scene, 32 px colour swatch). The pipeline resizes every reference to
  a 1024^2 area for the VAE (384^2 for the VL encoder): about 10 s a reference on 2 CPU cores.
  Load the processor with `load_qwen_processor` where torchvision is missing.
Scripts should derive sizes from the configs: vae_scale_factor = 2 ** (len(vae block_out_channels)
- 1) (Qwen: 2 ** len(vae temperal_downsample)), default resolution = unet sample_size * vae_scale_factor.
"""
import contextlib
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from tools.build_once import READY, build_once  # noqa: F401 - READY: the marker of a finished folder
from tools.shapes import COLOURS, SHAPES, describe, draw_shape, random_scene

DEFAULTS_VERSION = 1  # part of the cache folder name; bump on any change to a tiny config
TEXT_MAX_LENGTH = 32  # CLIP context length (and T5 model_max_length) of the tiny tokenizers
IMAGE_SIZE = 64  # default image side in pixels for both tiny models and their datasets

# Words of the synthetic prompts (tools.shapes' COLOURS and SHAPES, then these). Tokenizers get
# whole-word pieces for them so that prompts stay short (about 10 tokens); any other lowercase
# text still tokenizes character by character.
OTHER_WORDS = ("a", "an", "the", "on", "of", "in", "and", "with", "make", "it", "turn", "into",
               "change", "to", "background", "photo", "image", "shape")
WORDS = tuple(COLOURS) + SHAPES + OTHER_WORDS
CHARS = "abcdefghijklmnopqrstuvwxyz0123456789.,!?'-"


# ----------------------------------------------------------------------------------------------
# tokenizers

def write_clip_tokenizer(folder, max_length=TEXT_MAX_LENGTH):
    """Write a tiny CLIP BPE tokenizer (vocab.json, merges.txt + tokenizer.json) into `folder`.

    Vocab: every char of CHARS alone and with `</w>`, whole-word pieces for WORDS (see
    `_word_merges`), then `<|startoftext|>`, `<|endoftext|>` last, as in real CLIP. Returns
    the reloaded CLIPTokenizer.
    """
    from transformers import CLIPTokenizer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = {c + suffix: 0 for suffix in ("", "</w>") for c in CHARS}
    merges = _word_merges(WORDS)
    vocab.update({a + b: 0 for a, b in merges})
    vocab = {piece: i for i, piece in enumerate(vocab)}
    for special in ("<|startoftext|>", "<|endoftext|>"):
        vocab[special] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab, indent=1))
    lines = ["#version: 0.2"] + [f"{a} {b}" for a, b in merges]
    (folder / "merges.txt").write_text("\n".join(lines) + "\n")
    tokenizer = CLIPTokenizer.from_pretrained(folder, model_max_length=max_length)
    tokenizer.save_pretrained(folder)  # adds tokenizer.json / tokenizer_config.json
    return CLIPTokenizer.from_pretrained(folder)


def _bpe(word, ranks):
    """CLIP-style BPE of one word: merge the best-ranked adjacent pair until none is ranked."""
    pieces = list(word[:-1]) + [word[-1] + "</w>"]
    while len(pieces) > 1:
        pairs = zip(pieces, pieces[1:])
        rank, i = min((ranks.get(pair, len(ranks)), i) for i, pair in enumerate(pairs))
        if rank == len(ranks):
            break
        pieces[i:i + 2] = [pieces[i] + pieces[i + 1]]
    return pieces


def _word_merges(words):
    """Merges (in rank order) under which BPE turns every word of `words` into one token.

    Naive per-word merge chains interfere (green's "g r" splits background's "back|g"), so add
    one merge at a time for the first word still in pieces and re-run BPE until none is.
    """
    merges = []
    while True:
        ranks = {pair: r for r, pair in enumerate(merges)}
        unfinished = next((p for p in (_bpe(w, ranks) for w in words) if len(p) > 1), None)
        if unfinished is None:
            return merges
        merges.append((unfinished[0], unfinished[1]))


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


# The system prompt of QwenImageEditPlusPipeline's prompt template (diffusers 0.42.1
# pipeline_qwenimage_edit_plus.py), without its special tokens: the Qwen tokenizer learns its words whole.
QWEN_EDIT_SYSTEM_PROMPT = (
    "Describe the key features of the input image (color, shape, size, texture, objects, background), then "
    "explain how the user's text instruction should alter or modify the image. Generate a new image that meets "
    "the user's requirements while maintaining consistency with the original input where appropriate.")
QWEN_EDIT_WORDS = ("colour", "picture")  # of the two-reference edit prompts (make_two_reference_edit_dataset)
# Qwen2.5-VL's added tokens in id order, as (token, special): ids 151643..151664 there, right after the
# BPE vocabulary; here right after the tiny one. The text encoder config points at these ids.
QWEN_ADDED_TOKENS = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
    ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False))


def write_qwen_tokenizer(folder, corpus=None, added=QWEN_ADDED_TOKENS, chat_template=None):
    """Write a tiny Qwen2 byte-level BPE tokenizer (tokenizer.json + tokenizer_config.json) into `folder`.

    Qwen2's normalizer, pre-tokenizer and decoder; merges trained here (the `tokenizers` library) on
    the pipeline's chat template, "Picture N: " and WORDS, so those words are one token each and the
    template's system part is 64 tokens as with the real tokenizer (the pipeline drops that many);
    any other text still encodes, byte by byte. Then QWEN_ADDED_TOKENS; eos <|im_end|>, pad
    <|endoftext|>, no bos / unk, as Qwen2.5-VL-Instruct's tokenizer_config.json. Returns the reloaded
    Qwen2Tokenizer. `corpus`, `added`, `chat_template`: another Qwen's (write_qwen3_tokenizer).
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AddedToken, Qwen2Tokenizer

    qwen2 = Qwen2Tokenizer(unk_token=None, eos_token=None, pad_token=None).backend_tokenizer
    bpe = Tokenizer(models.BPE())
    bpe.normalizer, bpe.pre_tokenizer = qwen2.normalizer, qwen2.pre_tokenizer
    words = WORDS + QWEN_EDIT_WORDS
    corpus = corpus or [f"system\n{QWEN_EDIT_SYSTEM_PROMPT}\nuser\nassistant\n",
                        " ".join(f"Picture {i}:" for i in range(1, 4)), " ".join(words), "\n".join(words)]
    # every byte in the alphabet; a vocabulary larger than the corpus needs: each corpus word ends whole
    trainer = trainers.BpeTrainer(vocab_size=4096, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    bpe.train_from_iterator(corpus, trainer)
    model = json.loads(bpe.to_str())["model"]
    tokenizer = Qwen2Tokenizer(vocab=model["vocab"], merges=[tuple(m) for m in model["merges"]], unk_token=None,
                               eos_token=None, pad_token=None, model_max_length=131072, errors="replace")
    tokenizer.add_tokens([AddedToken(t, special=special, normalized=False) for t, special in added])
    tokenizer.eos_token, tokenizer.pad_token = "<|im_end|>", "<|endoftext|>"
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(folder)
    return Qwen2Tokenizer.from_pretrained(folder)


# Qwen3's added tokens (Qwen2.5's, then the tool-response and thinking markers), and its chat template's
# output for one user turn (FLUX.2 [klein] encodes its prompts so, enable_thinking=False): the real template
# is longer (tools, reasoning history); for this input it renders the same text.
QWEN3_ADDED_TOKENS = QWEN_ADDED_TOKENS + (("<tool_response>", False), ("</tool_response>", False),
                                          ("<think>", False), ("</think>", False))
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}")


def write_qwen3_tokenizer(folder):
    """A tiny Qwen3 tokenizer (write_qwen_tokenizer's BPE, trained on the chat template and WORDS), with
    Qwen3's added tokens and chat template. Returns the reloaded Qwen2Tokenizer."""
    words = WORDS + QWEN_EDIT_WORDS
    corpus = ["user\nassistant\n\n\n", " ".join(words), "\n".join(words)]
    return write_qwen_tokenizer(folder, corpus, QWEN3_ADDED_TOKENS, QWEN3_CHAT_TEMPLATE)


# ----------------------------------------------------------------------------------------------
# model folders

@contextlib.contextmanager
def seeded(seed):
    """Seed torch for deterministic random init without disturbing the caller's RNG state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _clip_text_encoder(tokenizer, seed, projection_dim=32, hidden_act="quick_gelu", with_projection=False):
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
    text_encoder = _clip_text_encoder(tokenizer, seed)
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
    text_encoder = _clip_text_encoder(tokenizer, seed)
    # SDXL's second encoder (OpenCLIP bigG): gelu, and a projection whose output is text_embeds
    text_encoder_2 = _clip_text_encoder(tokenizer_2, seed + 3, projection_dim=16, hidden_act="gelu",
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
    text_encoder = _clip_text_encoder(tokenizer, seed)
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


# processor/preprocessor_config.json of Qwen2.5-VL (and so of Qwen-Image-Edit): 14 px patches, 2 frames,
# 2x2 merge, 3136 .. 12845056 pixels, CLIP mean and std; the video file repeats it for the video processor.
QWEN_VL_PREPROCESSOR = {
    "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}


def _write_qwen_processor(folder, tokenizer):
    """Write processor/ as the real folder has it: the tokenizer's files, preprocessor_config.json
    (Qwen2VLImageProcessor) and video_preprocessor_config.json (Qwen2VLVideoProcessor). Written
    directly: transformers 5 cannot build a Qwen2VLProcessor to save without torchvision."""
    folder = Path(folder)
    tokenizer.save_pretrained(folder)
    for name, kind in (("preprocessor_config.json", "image"), ("video_preprocessor_config.json", "video")):
        config = {**QWEN_VL_PREPROCESSOR, f"{kind}_processor_type": f"Qwen2VL{kind.title()}Processor",
                  "processor_class": "Qwen2VLProcessor"}
        (folder / name).write_text(json.dumps(config, indent=2) + "\n")


def load_qwen_processor(folder):
    """The family room's processor loader (families/qwen_image.load_processor)."""
    from families.qwen_image import load_processor
    return load_processor(folder)


@contextlib.contextmanager
def _quiet_logs():
    """transformers' and diffusers' warnings off (expected ones: the PIL image processor fallback, the
    processor slot left for `_write_qwen_processor`)."""
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


def _qwen_vl_text_encoder(tokenizer, seed, hidden=32):
    """A 2-layer Qwen2_5_VLForConditionalGeneration, text hidden `hidden`, with a 2-block vision tower
    of the real geometry whose merger outputs `hidden`; token ids from `tokenizer`."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    head_dim = hidden // 2
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=-(-len(tokenizer) // 64) * 64,  # padded past the tokenizer, as the real 152064
            hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, rms_norm_eps=1e-6, max_position_embeddings=128000, max_window_layers=2,
            bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"),
            # multimodal RoPE: (t, h, w) sections of the head_dim/2 frequencies, the real 16:24:24
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                             "mrope_section": [head_dim // 8, 3 * head_dim // 16, 3 * head_dim // 16]}),
        vision_config=dict(
            depth=2, hidden_size=hidden, intermediate_size=2 * hidden, num_heads=2, out_hidden_size=hidden,
            patch_size=14, temporal_patch_size=2, spatial_merge_size=2, window_size=112,
            fullatt_block_indexes=[1], tokens_per_second=2, hidden_act="silu"),  # the last block attends fully
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))
    with seeded(seed):
        return Qwen2_5_VLForConditionalGeneration(config).eval()


def make_tiny_qwen_image_edit(folder, seed=0):
    """Write a Qwen-Image-Edit-2509-layout diffusers folder (QwenImageEditPlusPipeline: transformer,
    vae, text_encoder, tokenizer, processor, scheduler).

    VAE 8x down to 16 latent channels, packed 2x2 into 64-channel tokens (64 px -> 16 tokens);
    transformer hidden 32 (2 blocks); Qwen2.5-VL text hidden 32 with a vision tower of the real
    geometry (patch 14, temporal patch 2, 2x2 merge, 112 px windows). Returns the folder.
    """
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageEditPlusPipeline,
                           QwenImageTransformer2DModel)

    folder = Path(folder)
    tokenizer = write_qwen_tokenizer(folder / "tokenizer")
    text_encoder = _qwen_vl_text_encoder(tokenizer, seed)
    z_dim = 16  # the Qwen-Image VAE's latent channels
    with seeded(seed + 1):
        # Qwen-Image-Edit-2509's transformer config but for the sizes: no zero_cond_t (2511 has it)
        transformer = QwenImageTransformer2DModel(
            patch_size=2, in_channels=4 * z_dim, out_channels=z_dim, num_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=text_encoder.config.text_config.hidden_size,
            guidance_embeds=False, axes_dims_rope=(4, 6, 6))  # (frame, h, w), must sum to the head dim
    with seeded(seed + 2):
        # 3 downsamples (8x), the first spatial only, as the real one (base_dim 96, dim_mult (1, 2, 4, 4),
        # 2 res blocks); latents_mean / latents_std: the class defaults, the real VAE's 16 per-channel values
        vae = AutoencoderKLQwenImage(
            base_dim=4, z_dim=z_dim, dim_mult=[1, 2, 2, 2], num_res_blocks=1, temperal_downsample=[False, True, True])
    # scheduler/scheduler_config.json of Qwen/Qwen-Image (and the Edit models): exponential
    # resolution-dependent shift, stretched so the last sigma is 0.02
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
        base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")
    pipe = QwenImageEditPlusPipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, processor=None,
        transformer=transformer)
    with _quiet_logs():  # "processor=None cannot be saved": written below
        pipe.save_pretrained(folder, safe_serialization=True)
    _write_qwen_processor(folder / "processor", tokenizer)
    index = json.loads((folder / "model_index.json").read_text())
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    (folder / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return folder


def _qwen3_text_encoder(tokenizer, seed, hidden=16, layers=28):
    """A Qwen3ForCausalLM `hidden` wide with `layers` layers: FLUX.2 [klein] stacks the hidden states of
    layers 9, 18 and 27 (the pipeline's text_encoder_out_layers), so it needs at least 27 (Qwen3-4B has 36)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    ids = tokenizer.convert_tokens_to_ids
    config = Qwen3Config(
        vocab_size=-(-len(tokenizer) // 64) * 64, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=hidden // 2,
        rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=True,
        bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"), pad_token_id=ids("<|endoftext|>"))
    with seeded(seed):
        return Qwen3ForCausalLM(config).eval()


def _flux2_parts(text_width, seed, guidance_embeds):
    """The tiny FLUX.2 transformer (its text input `text_width` wide), VAE and scheduler."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

    latent_channels = 4
    with seeded(seed + 1):
        transformer = Flux2Transformer2DModel(
            patch_size=1, in_channels=4 * latent_channels, num_layers=1, num_single_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=text_width, timestep_guidance_channels=32,
            axes_dims_rope=(4, 4, 4, 4), guidance_embeds=guidance_embeds)
    with seeded(seed + 2):
        vae = AutoencoderKLFlux2(
            latent_channels=latent_channels, block_out_channels=(8, 16, 32, 32), layers_per_block=1,
            norm_num_groups=8, sample_size=IMAGE_SIZE)
    # scheduler_config.json of FLUX.2: shift 3 with dynamic shifting; the pipeline passes its own mu
    # (compute_empirical_mu of the token count and the step count)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True)
    return transformer, vae, scheduler


def make_tiny_flux2_klein(folder, seed=0):
    """Write a FLUX.2-[klein]-base-layout diffusers folder (Flux2KleinPipeline: transformer, vae, text_encoder,
    tokenizer, scheduler; is_distilled false, so the pipeline samples with true CFG).

    64 px images, VAE 8x down to 4 latent channels, patchified 2x2 into 16-channel tokens (64 px -> 16 tokens);
    transformer hidden 32 (1 double + 2 single blocks, no guidance embedding, as klein); Qwen3 text encoder 16
    wide with 28 layers (embeddings 3 x 16 = 48 wide). Returns the folder.
    """
    from diffusers import Flux2KleinPipeline

    folder = Path(folder)
    tokenizer = write_qwen3_tokenizer(folder / "tokenizer")
    text_encoder = _qwen3_text_encoder(tokenizer, seed)
    transformer, vae, scheduler = _flux2_parts(3 * text_encoder.config.hidden_size, seed, guidance_embeds=False)
    pipe = Flux2KleinPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                              transformer=transformer, is_distilled=False)
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder


# Mistral-Small-3.1's special tokens as its tokenizer numbers them (ids 0..19; its other 980 are <SPECIAL_n>
# placeholders, left out here)
MISTRAL_SPECIAL_TOKENS = (
    "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]", "[PREFIX]", "[MIDDLE]",
    "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]")
# Mistral-Small-3.1's chat template for what FLUX.2 [dev] gives it (format_input, pipeline_flux2.py:65-120: a
# system message, then user turns of text and image blocks): the real template also has assistant turns, string
# contents and a dated default system message; for this input it renders the same text.
MISTRAL_CHAT_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}{%- if message['role'] == 'system' %}"
    "{{- '[SYSTEM_PROMPT]' + message['content'][0]['text'] + '[/SYSTEM_PROMPT]' }}{%- else %}{{- '[INST]' }}"
    "{%- for block in message['content'] %}{%- if block['type'] == 'text' %}{{- block['text'] }}"
    "{%- else %}{{- '[IMG]' }}{%- endif %}{%- endfor %}{{- '[/INST]' }}{%- endif %}{%- endfor %}")
# Mistral-Small-3.1's Pixtral image processor: 14 px patches, at most 1540 px a side, CLIP mean and std
PIXTRAL_PREPROCESSOR = {
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "patch_size": {"height": 14, "width": 14}, "size": {"longest_edge": 1540}, "resample": 3}


def write_pixtral_processor(folder):
    """Write FLUX.2 [dev]'s tokenizer/ folder, tiny: Mistral-Small-3.1's PixtralProcessor (tokenizer, image processor,
    chat template; patch 14, 2x2 merge). The tokenizer: MISTRAL_SPECIAL_TOKENS at ids 0..19, then a byte-level BPE
    (as Tekken) trained here on the pipeline's system message and WORDS, so the message's words are mostly one
    token; <s> prepended, <pad> on the left (the Llama tokenizers' side). Returns the reloaded processor."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PixtralImageProcessor, PixtralProcessor, TokenizersBackend

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    words = WORDS + QWEN_EDIT_WORDS
    trainer = trainers.BpeTrainer(vocab_size=4096, special_tokens=list(MISTRAL_SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    # each word alone and after a space: a prompt's first word follows [INST] directly
    bpe.train_from_iterator([SYSTEM_MESSAGE, " " + " ".join(words), "\n".join(words)], trainer)
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)])
    tokenizer = TokenizersBackend(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                  pad_token="<pad>", padding_side="left", model_max_length=131072)
    processor = PixtralProcessor(image_processor=PixtralImageProcessor(**PIXTRAL_PREPROCESSOR), tokenizer=tokenizer,
                                 patch_size=14, spatial_merge_size=2, chat_template=MISTRAL_CHAT_TEMPLATE)
    processor.save_pretrained(folder)
    return PixtralProcessor.from_pretrained(folder)


def _mistral3_text_encoder(tokenizer, seed, hidden=16, layers=32):
    """A Mistral3ForConditionalGeneration: a Mistral text model `hidden` wide with `layers` layers (FLUX.2 [dev]
    stacks the hidden states of layers 10, 20 and 30; Mistral-Small-3.1 has 40) and a 1-block Pixtral vision tower
    of the real patch 14 and 2x2 merge; token ids from `tokenizer`."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    config = Mistral3Config(
        text_config=dict(
            model_type="mistral", vocab_size=-(-len(tokenizer) // 64) * 64, hidden_size=hidden,
            intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
            head_dim=hidden // 2, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=1000000000.0,
            sliding_window=None, bos_token_id=ids("<s>"), eos_token_id=ids("</s>"), pad_token_id=ids("<pad>")),
        vision_config=dict(
            model_type="pixtral", hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
            num_attention_heads=2, head_dim=hidden // 2, patch_size=14, image_size=1540),
        image_token_index=ids("[IMG]"), spatial_merge_size=2, tie_word_embeddings=False)
    with seeded(seed):
        return Mistral3ForConditionalGeneration(config).eval()


def make_tiny_flux2_dev(folder, seed=0):
    """Write a FLUX.2-[dev]-layout diffusers folder (Flux2Pipeline: transformer, vae, text_encoder, tokenizer,
    scheduler): make_tiny_flux2_klein's sizes, VAE and scheduler, its transformer with the guidance embedding (as
    [dev]); a Mistral3ForConditionalGeneration text encoder 16 wide with 32 text layers (embeddings 3 x 16 = 48
    wide) and its PixtralProcessor as the tokenizer (write_pixtral_processor). Returns the folder."""
    from diffusers import Flux2Pipeline

    folder = Path(folder)
    processor = write_pixtral_processor(folder / "tokenizer")
    text_encoder = _mistral3_text_encoder(processor.tokenizer, seed)
    transformer, vae, scheduler = _flux2_parts(3 * text_encoder.config.text_config.hidden_size, seed,
                                               guidance_embeds=True)
    pipe = Flux2Pipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=processor,
                         transformer=transformer)
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder


# ----------------------------------------------------------------------------------------------
# synthetic data

def _write_jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def make_prompts_file(path, n, seed=0):
    """Write `n` prompts like "a red circle on a blue background", one per line. Returns path."""
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n):
        shape, colour, background, _ = random_scene(rng, IMAGE_SIZE)
        lines.append(describe(shape, colour, background))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n".join(lines) + "\n")
    return Path(path)


def make_image_prompt_dataset(folder, n, size=IMAGE_SIZE, seed=0):
    """Write `n` PNGs of coloured shapes under folder/images and folder/data.jsonl with rows
    {"prompt", "image"} (image path relative to folder). Returns the data.jsonl path."""
    folder = Path(folder)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        shape, colour, background, box = random_scene(rng, size)
        image = draw_shape(size, shape, COLOURS[colour], COLOURS[background], box)
        image.save(folder / "images" / f"{i:05d}.png")
        rows.append({"prompt": describe(shape, colour, background),
                     "image": f"images/{i:05d}.png"})
    _write_jsonl(folder / "data.jsonl", rows)
    return folder / "data.jsonl"


def make_edit_dataset(folder, n, size=IMAGE_SIZE, seed=0):
    """Write `n` image-editing pairs: folder/context/i.png (a shape on a plain background),
    folder/target/i.png (the same shape and place, recoloured), and folder/data.jsonl with rows
    {"image": context path, "target": target path, "prompt": "make the circle blue"} (paths
    relative to folder). Returns the data.jsonl path."""
    folder = Path(folder)
    for sub in ("context", "target"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        shape, colour, background, box = random_scene(rng, size)
        new_colour = str(rng.choice([c for c in COLOURS if c not in (colour, background)]))
        draw_shape(size, shape, COLOURS[colour], COLOURS[background], box).save(
            folder / "context" / f"{i:05d}.png")
        draw_shape(size, shape, COLOURS[new_colour], COLOURS[background], box).save(
            folder / "target" / f"{i:05d}.png")
        rows.append({"image": f"context/{i:05d}.png", "target": f"target/{i:05d}.png",
                     "prompt": f"make the {shape} {new_colour}"})
    _write_jsonl(folder / "data.jsonl", rows)
    return folder / "data.jsonl"


def make_two_reference_edit_dataset(folder, n, size=IMAGE_SIZE, seed=0):
    """Write `n` edits with two reference images (Qwen-Image-Edit-2509's multi-image input):
    folder/control/i.png (a shape on a plain background, size px), folder/swatch/i.png (a plain
    size/2 px square of a new colour), folder/target/i.png (the first with the shape in the swatch's
    colour), and folder/data.jsonl with rows {"control": [control path, swatch path], "target":
    target path, "prompt": "make the circle the colour of picture 2"} (paths relative to folder).
    Returns the data.jsonl path."""
    folder = Path(folder)
    for sub in ("control", "swatch", "target"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        shape, colour, background, box = random_scene(rng, size)
        new_colour = str(rng.choice([c for c in COLOURS if c not in (colour, background)]))
        draw_shape(size, shape, COLOURS[colour], COLOURS[background], box).save(folder / "control" / f"{i:05d}.png")
        Image.new("RGB", (size // 2, size // 2), COLOURS[new_colour]).save(folder / "swatch" / f"{i:05d}.png")
        draw_shape(size, shape, COLOURS[new_colour], COLOURS[background], box).save(
            folder / "target" / f"{i:05d}.png")
        rows.append({"control": [f"control/{i:05d}.png", f"swatch/{i:05d}.png"], "target": f"target/{i:05d}.png",
                     "prompt": f"make the {shape} the colour of picture 2"})
    _write_jsonl(folder / "data.jsonl", rows)
    return folder / "data.jsonl"


# ----------------------------------------------------------------------------------------------
# cached defaults

def _build_sd15(root):
    make_tiny_sd15(root / "model")
    make_prompts_file(root / "data" / "prompts.txt", 64)  # DMD stage 1: text prompts only
    make_image_prompt_dataset(root / "data", 64)  # DMD stage 2: real images for the GAN


def _build_sdxl(root):
    make_tiny_sdxl(root / "model")
    make_prompts_file(root / "data" / "prompts.txt", 64)
    make_image_prompt_dataset(root / "data", 64)


def _build_flux_kontext(root):
    make_tiny_flux_kontext(root / "model")
    make_edit_dataset(root / "data", 32)


def _build_qwen_image_edit(root):
    make_tiny_qwen_image_edit(root / "model")
    make_two_reference_edit_dataset(root / "data", 32)


def _build_flux2_data(root):
    make_two_reference_edit_dataset(root / "data", 32)


def _build_flux2_klein(root):
    make_tiny_flux2_klein(root / "model")
    _build_flux2_data(root)


def _build_flux2_dev(root):
    make_tiny_flux2_dev(root / "model")
    _build_flux2_data(root)


BUILDERS = {"sd15": _build_sd15, "sdxl": _build_sdxl, "flux_kontext": _build_flux_kontext,
            "qwen_image_edit": _build_qwen_image_edit, "flux2_klein": _build_flux2_klein,
            "flux2_dev": _build_flux2_dev}


def default_cache_dir():
    """$FSDP_DIFFUSION_CACHE, else ~/.cache/fsdp_diffusion."""
    return Path(os.environ.get("FSDP_DIFFUSION_CACHE", "~/.cache/fsdp_diffusion")).expanduser()


def ensure_default(kind, cache_dir=None, timeout=600.0):
    """Build the tiny default for `kind` (a key of BUILDERS: "sd15", "flux2_dev", ...) once;
    return (model_path, data_path) as strings: <cache_dir>/tiny_<kind>_v<N>/{model,data}.

    Safe for many ranks at once (`tools.build_once.build_once`): one of them builds in a temp folder,
    under a lock file beside the folder, and publishes it with an atomic rename (READY marker
    inside); everyone else reuses it.
    """
    if kind not in BUILDERS:
        raise ValueError(f"unknown tiny default {kind!r}; choose from {sorted(BUILDERS)}")
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = cache_dir / f"tiny_{kind}_v{DEFAULTS_VERSION}"
    build_once(final, BUILDERS[kind], timeout, ready_text=f"tiny {kind} defaults v{DEFAULTS_VERSION}\n")
    return str(final / "model"), str(final / "data")


if __name__ == "__main__":
    for name in sys.argv[1:] or sorted(BUILDERS):
        print(name, *ensure_default(name))
