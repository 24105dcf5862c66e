"""The Wan family (WanPipeline: Wan 2.1 T2V-1.3B / 14B, Wan 2.2 TI2V-5B as text to video, Wan 2.2 T2V-A14B's
two experts; WanImageToVideoPipeline: Wan 2.1 I2V-14B), for train_dmd.py's flow setup: its transformer built and
sharded through parallel/'s generic recipe (one FSDP unit per WanTransformerBlock; A14B: each expert so, experts.py
routing each sample), its VAE (AutoencoderKLWan, 2.1's or TI2V's 2.2, per-channel latents_mean / latents_std), its
conditioning, its video tokens and the distilled export's scheduler.

Conditioning is the pipeline's own (diffusers 0.42.1 pipelines/wan/pipeline_wan.py):
- the text: UMT5 through the pipeline's encode_prompt (_get_t5_prompt_embeds: prompt_clean, tokenized to
  MAX_SEQUENCE_LENGTH, the hidden states cut to the prompt's real length and zero-padded back to it). The trained
  length is MAX_SEQUENCE_LENGTH, 512 as the pipeline's __call__ (encode_prompt's own default is 226); the cache
  keeps the cut embeddings and load_text pads them, so the tensors are encode_prompt's;
- the latents (B, C, T, H/f, W/f), T = (frames - 1) / 4 + 1, f the VAE's scale_factor_spatial (2.1: 8 with 16
  channels; TI2V-5B's 2.2 VAE: 16 with 48): the posterior's mode normalised as the pipeline does, (mu -
  latents_mean) * (1 / latents_std) (encode_latents; a text-to-video teacher's DMD2 reads prompts only);
- frames 4k + 1 (NUM_FRAMES; the pipeline rounds others with a warning, here they are refused), height and width
  multiples of f x the patch's 2 (16; TI2V-5B: 32), where the pipeline would round them;
- the transformer's timestep is sigma * 1000 as a float, one per sample, or with TI2V-5B's expand_timesteps one
  per token (B, tokens), all the step's (text to video: the pipeline's mask[0][0][:, ::2, ::2] * t is all ones);
  its target the flow n - x0;
- the teacher's CFG as the pipeline computes it, uncond + g (cond - uncond), at its guidance_scale 5.0, against
  the negative prompt "" (diffusers' default, encode_prompt's `negative_prompt or ""`; Wan's own long negative
  prompt is not used). FastVideo's cond + w (cond - uncond) is w = g - 1;
- the flow shift is the UniPC scheduler's flow_shift (3.0 for Wan 2.1, 5.0 for TI2V-5B),
  algorithms/flux_kontext.pipeline_shift;
- image to video (Wan 2.1 I2V, pipeline_wan_i2v.py): each row's first image stretched to the clip's size
  (video_processor.preprocess), the condition channels prepare_latents builds (first_frame_condition: a 4-channel
  first-frame mask, then the video [image, zeros...] encoded and normalised) after the noisy latents, and the
  CLIP image tokens encode_image makes (hidden_states[-2] of the image as given), cached beside the text and
  passed to both calls of the teacher's CFG pair; Wan 2.2 I2V-A14B: the condition channels on both experts, no
  CLIP; TI2V-5B's image mode (expand_timesteps): the image alone encoded as the first latent frame, its tokens at
  t = 0 and their velocity the one whose x0 is the image's (WanCond.velocity).

Tokens: the transformer's own (1, 2, 2) patches in its order (frame, row, column), each patch's channels (c, dy,
dx) as its patch embedding reads them (pack_latents). Sizes: RESOLUTION is the height (480p, 720p; 0 = 480), the
width the Wan repos' for it (480 -> 832, 720 and 704 -> 1280; else 16:9), or height x BUCKET_ASPECTS' one ratio.

    python -m pytest tests/test_wan.py -q
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass

import torch

from algorithms.dmd2 import Guidance, cfg_combine
from algorithms.flux_kontext import pipeline_shift, shift_sigmas
from core.dist import map_shared, print0
from core.errors import ConfigError
from data.buckets import references
from data.images import image_digest, load_image, load_pil, pil_tensor
from data.text_cache import cache_file, fill_text_cache, folder_identity, load_entries
from families.dit import build_transformer as build_dit
from families.dit import scheduler_config
from families.wan.experts import Experts
from families.wan.parallelism import TRANSFORMER
from parallel import attention
from parallel.lora import Lora
from precision import dtype_name

NAME = "Wan"  # how the README and docs name the family
MAX_REFERENCES = 1  # image to video: the first frame (text to video reads none)
REFERENCE_WORDS = "the first frame as the pipeline conditions on it"  # channels (2.1 I2V) or clean tokens (TI2V)
I2V = "WanImageToVideoPipeline"
NEGATIVE_PROMPT = ""  # diffusers' default negative prompt (encode_prompt: negative_prompt or "")
UNCONDITIONAL_PROMPT = NEGATIVE_PROMPT  # what CAPTION_DROPOUT trains: the text the pipeline's CFG pairs with
TEXT_READS_IMAGES = False
DEFAULT_RESOLUTION = 480  # RESOLUTION 0: the pipeline's default height (480 x 832)
PIPELINE_WIDTHS = {480: 832, 720: 1280, 704: 1280}  # the Wan repos' landscape sizes by height (TI2V-5B's 720P: 704)
DEFAULT_FRAMES = 81  # NUM_FRAMES 0: the pipeline's default
GUIDANCE_SCALE = 5.0  # the pipeline's default guidance_scale: the teacher's in DMD2 (REAL_GUIDANCE_SCALE 0)
MULTIPLE = 16  # height and width without a model: multiples of 2.1's VAE 8 x the patch's 2 (side_multiple)
TEXT_PARTS = ("text_encoder", "tokenizer")
IMAGE_PARTS = ("image_encoder", "image_processor")  # 2.1 I2V's CLIP: its image tokens cached beside the text
I2V_TEXT_LENGTH = 512  # 2.1 I2V's attention takes the image tokens as all but the last 512 of its context


def edits(pipeline: str) -> bool:
    """An image-to-video row is a first image and a prompt; a text-to-video row a prompt alone."""
    return pipeline == I2V


def vae_config(model_path) -> dict:
    with open(os.path.join(model_path, "vae", "config.json")) as f:
        return json.load(f)


# ----------------------------------------------------------------------------------------------
# models


def build_transformer(folder, mesh, prec, device, *, load, sharding, block_classes, lora=Lora(), seed=0,
                      base_dtype="", attention_backend=attention.DEFAULT, trainable=True, compute=None,
                      frozen_dtype=None, weights="", merge=None, fp8=""):
    """WanTransformer3DModel, as families/flux/room.py builds FLUX's (families/dit.py), sharded one unit per
    WanTransformerBlock by its model facts (parallelism.py); with Wan 2.2 A14B's transformer_2 beside `folder`,
    both experts, each built so, as one model (experts.Experts: each sample to the expert its timestep picks)."""
    from diffusers import WanTransformer3DModel
    build = functools.partial(build_dit, WanTransformer3DModel, TRANSFORMER, mesh=mesh, prec=prec, device=device,
                              load=load, sharding=sharding, block_classes=block_classes, lora=lora, seed=seed,
                              base_dtype=base_dtype, attention_backend=attention_backend, trainable=trainable,
                              compute=compute, frozen_dtype=frozen_dtype, weights=weights, merge=merge, fp8=fp8,
                              prepare=prepare)
    root = os.path.dirname(os.path.abspath(folder))
    boundary = expert_boundary(root)
    if boundary is None:
        return build(folder)
    merges = merge if isinstance(merge, dict) else {"transformer": merge}  # each expert's own LoRA (TEACHER_LORA_2)
    return Experts(build(folder, merge=merges.get("transformer")),
                   build(os.path.join(root, "transformer_2"), merge=merges.get("transformer_2")), boundary)


def expert_boundary(model_path) -> float | None:
    """Wan 2.2 A14B's expert boundary as a timestep (boundary_ratio x the scheduler's num_train_timesteps: the
    pipeline's boundary_timestep); None for one transformer."""
    with open(os.path.join(model_path, "model_index.json")) as f:
        index = json.load(f)
    if index.get("transformer_2") in (None, [None, None]) or index.get("boundary_ratio") is None:
        return None
    return float(index["boundary_ratio"]) * scheduler_config(model_path).get("num_train_timesteps", 1000)


def prepare(model) -> None:
    """What the meta skeleton needs before it is sharded and loaded: the RoPE tables (WanRotaryPosEmbed's
    non-persistent buffers, which a meta build leaves empty and no file holds) made on the host as plain
    attributes, moved to the input's device at the first call (a forward pre-hook)."""
    rope = model.rope
    with torch.device("cpu"):
        fresh = type(rope)(rope.attention_head_dim, rope.patch_size, rope.max_seq_len)
    for name in ("freqs_cos", "freqs_sin"):
        del rope._buffers[name]
        rope._non_persistent_buffers_set.discard(name)
        setattr(rope, name, getattr(fresh, name))

    def follow(module, args):
        device = args[0].device
        if module.freqs_cos.device != device:
            module.freqs_cos, module.freqs_sin = module.freqs_cos.to(device), module.freqs_sin.to(device)
    rope.register_forward_pre_hook(follow)


def load_vae(folder, dtype, device):
    """The frozen AutoencoderKLWan, replicated on every rank in its own dtype."""
    import fsdp_utils
    from diffusers import AutoencoderKLWan
    vae = AutoencoderKLWan.from_pretrained(folder, dtype=dtype, low_cpu_mem_usage=False)
    return fsdp_utils.prepare_frozen(vae, dtype, device)


def vae_factor(model_path) -> int:
    """Pixels per latent side, the pipeline's vae_scale_factor_spatial: 8 (TI2V-5B's 2.2 VAE: 16)."""
    return int(vae_config(model_path).get("scale_factor_spatial", 8))


def side_multiple(model_path) -> int:
    """What height and width are multiples of: the VAE's factor x the patch's height, as the pipeline's __call__
    rounds them (16; TI2V-5B: 32)."""
    with open(os.path.join(model_path, "transformer", "config.json")) as f:
        patch = json.load(f)["patch_size"]
    return vae_factor(model_path) * int(patch[1])


def expands_timesteps(vae) -> bool:
    """Whether the transformer takes one timestep per token (the pipeline's expand_timesteps): TI2V-5B's, whose 2.2
    VAE (is_residual) no other Wan reads; check_model refuses a folder where the two disagree. None: no VAE."""
    return bool(vae is not None and vae.config.get("is_residual"))


def temporal_factor(model_path) -> int:
    """Frames per latent frame after the first, the pipeline's vae_scale_factor_temporal: 4."""
    return int(vae_config(model_path).get("scale_factor_temporal", 4))


def latent_channels(vae) -> int:
    return vae.config.z_dim


def _mean_inv_std(vae, like):
    """latents_mean and 1 / latents_std as (1, C, 1, 1, 1), in `like`'s device and dtype (the pipeline's)."""
    c = vae.config.z_dim
    mean = torch.tensor(vae.config.latents_mean).view(1, c, 1, 1, 1).to(like.device, like.dtype)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, c, 1, 1, 1).to(like.device, like.dtype)
    return mean, inv_std


def encode_latents(vae, video: torch.Tensor) -> torch.Tensor:
    """Videos (B, 3, F, H, W) in [-1, 1] -> normalised latents (B, C, T, H/8, W/8) in fp32: the posterior's mode
    (sample_mode="argmax"), (mu - latents_mean) * (1 / latents_std)."""
    param = next(vae.parameters())
    with torch.no_grad():
        mu = vae.encode(video.to(device=param.device, dtype=param.dtype)).latent_dist.mode().float()
    mean, inv_std = _mean_inv_std(vae, mu)
    return (mu - mean) * inv_std


@torch.no_grad()
def decode_latents(vae, latents: torch.Tensor) -> torch.Tensor:
    """Normalised latents (B, C, T, h, w) -> videos (B, 3, F, H, W) in [-1, 1], fp32 on CPU, by the pipeline's
    arithmetic (cast to the VAE's dtype, / (1 / latents_std) + latents_mean)."""
    z = latents.to(next(vae.parameters()).dtype)
    mean, inv_std = _mean_inv_std(vae, z)
    return vae.decode(z / inv_std + mean, return_dict=False)[0].float().cpu()


# ----------------------------------------------------------------------------------------------
# sizes and tokens


def num_frames(settings) -> int:
    return int(settings.get("NUM_FRAMES") or DEFAULT_FRAMES)


def video_size(settings) -> tuple[int, int]:
    """(height, width) px of every clip: RESOLUTION the height (0: 480), the width the Wan repos' for it (else
    16:9), or height x BUCKET_ASPECTS' ratio where it holds one; either may come out refused (check_sizes)."""
    h = int(settings.get("RESOLUTION") or DEFAULT_RESOLUTION)
    aspects = settings.get("BUCKET_ASPECTS") or []
    if len(aspects) == 1:
        return h, round(h * float(aspects[0]))
    m = side_multiple(settings["MODEL_PATH"]) if settings.get("MODEL_PATH") else MULTIPLE
    return h, PIPELINE_WIDTHS.get(h, round(h * 16 / 9 / m) * m)


def target_size(size, row, settings) -> tuple[int, int]:
    """Every clip at video_size, whatever the bucket."""
    return video_size(settings)


def reference_sizes(size, row, settings) -> tuple | None:
    """Image to video: the first image at the clip's size (the pipeline's video_processor.preprocess(image,
    height, width) stretches it there); text to video: none."""
    if row is None:
        return None
    return (video_size(settings),) if references(row) else ()


def image_loader(settings):
    """How a row's pictures are read: the first image (role "reference") stretched to the clip's size (Lanczos, no
    crop), as the pipeline's video_processor.preprocess reads it; the GAN's real clip (role "target") as
    load_clip reads it, NUM_FRAMES frames."""
    frames = num_frames(settings)

    def load(source, size, mirror, role):
        return load_clip(source, size, frames) if role == "target" else load_image(source, *size, stretch=True,
                                                                                    mirror=mirror)
    return load


def clip_frames(source) -> int:
    """The frame count of an animated image file (GIF, animated WebP or PNG); ValueError naming it otherwise."""
    from PIL import Image
    if not isinstance(source, str) or not os.path.isfile(source):
        raise ValueError(f"clip {source} not found: a clip is an animated image file (GIF, WebP, PNG)")
    try:
        with Image.open(source) as im:
            return int(getattr(im, "n_frames", 1))
    except Exception as e:  # noqa: BLE001 - any decoder failure means an unreadable file
        raise ValueError(f"clip {source} is unreadable as an animated image ({type(e).__name__}): give GIF, "
                         "animated WebP or PNG frames") from None


def check_clip(source, frames: int) -> None:
    """A ValueError naming the file where it is no animated image of `frames` frames or more."""
    n = clip_frames(source)
    if n < frames:
        raise ValueError(f"clip {source} has {n} frames; NUM_FRAMES={frames} reads the first {frames}")


def load_clip(source, size, frames: int) -> torch.Tensor:
    """(3, frames, H, W) in [-1, 1]: the first `frames` frames of an animated image file, each stretched to the
    clip's size (Lanczos, as the first image is); fewer frames than that is a ValueError naming the file."""
    from PIL import Image
    check_clip(source, frames)
    out = []
    with Image.open(source) as im:
        for i in range(frames):
            im.seek(i)
            out.append(pil_tensor(im.convert("RGB").resize((size[1], size[0]), Image.Resampling.LANCZOS)))
    return torch.stack(out, dim=1)


def check_targets(rows, settings) -> None:
    """Before any work: every row's real clip (the GAN's "target") holds NUM_FRAMES frames or more. Each rank reads
    the rows rank::world; every rank refuses the first bad row (core.dist.map_shared)."""
    frames = num_frames(settings)

    def error(row) -> str | None:
        try:
            check_clip(row["target"], frames)
        except ValueError as e:
            return str(e)
    first = next((e for e in map_shared(error, rows) if e is not None), None)
    if first is not None:
        raise ConfigError(f"DATA_PATH={settings['DATA_PATH']}: {first}")


def latent_grid(size, settings) -> tuple[int, int, int]:
    """A clip of `size` px and NUM_FRAMES frames as its latent grid (T, h, w), as the pipeline's prepare_latents."""
    model_path = settings["MODEL_PATH"]
    f = vae_factor(model_path)
    return (num_frames(settings) - 1) // temporal_factor(model_path) + 1, size[0] // f, size[1] // f


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, T, h, w) -> (B, T * h/2 * w/2, 4C): the transformer's (1, 2, 2) patches in its order (frame, row,
    column), channels (c, dy, dx) as its patch embedding's weights read them."""
    b, c, t, h, w = latents.shape
    x = latents.reshape(b, c, t, h // 2, 2, w // 2, 2).permute(0, 2, 3, 5, 1, 4, 6)
    return x.reshape(b, t * (h // 2) * (w // 2), 4 * c)


def unpack_latents(tokens: torch.Tensor, grid) -> torch.Tensor:
    """pack_latents' inverse: (B, N, 4C) -> (B, C, T, h, w) of the latent grid (T, h, w)."""
    t, h, w = grid
    b, _, d = tokens.shape
    x = tokens.reshape(b, t, h // 2, w // 2, d // 4, 2, 2).permute(0, 4, 1, 2, 5, 3, 6)
    return x.reshape(b, d // 4, t, h, w)


def edit_attention_shapes(model_path, settings, shapes, batch, context_parallel):
    """The run's attention calls for the start-up kernel check: per shape the transformer's self-attention over
    its video tokens and cross-attention to the text (MAX_SEQUENCE_LENGTH tokens; 2.1 I2V: and to its CLIP image
    tokens), and the VAE decoder mid-block's one head over a latent frame (forward only)."""
    with open(os.path.join(model_path, "transformer", "config.json")) as f:
        t = json.load(f)
    v = vae_config(model_path)
    heads, dim, text = t["num_attention_heads"], t["attention_head_dim"], int(settings["MAX_SEQUENCE_LENGTH"])
    image = 0
    if t.get("image_dim"):  # CLIP's patches and its class token
        with open(os.path.join(model_path, "image_encoder", "config.json")) as f:
            c = json.load(f)
        image = (c["image_size"] // c["patch_size"]) ** 2 + 1
    trained, vae, c = [], [], context_parallel  # CP: self-attention over all tokens for H/C heads (Ulysses),
    for size, _ in dict.fromkeys(shapes):  # the cross-attentions from this rank's 1/C of the tokens
        grid = latent_grid(size, settings)
        tokens = grid[0] * (grid[1] // 2) * (grid[2] // 2)
        trained += [attention.Shape(f"self-attention at {size[0]}x{size[1]}", batch, tokens, tokens, heads // c, dim),
                    attention.Shape(f"cross-attention at {size[0]}x{size[1]}", batch, tokens // c, text, heads, dim)]
        if image:
            trained.append(attention.Shape(f"image cross-attention at {size[0]}x{size[1]}", batch, tokens // c, image,
                                           heads, dim))
        cells = grid[1] * grid[2]  # the decoder's mid-block attends within one latent frame at a time
        width = (v.get("decoder_base_dim") or v["base_dim"]) * v["dim_mult"][-1]  # TI2V's decoder is wider
        vae.append(attention.Shape(f"VAE mid-block at {size[0]}x{size[1]}", batch, cells, cells, 1, width,
                                   backward=False))
    return trained, vae


def check_context_parallel(model_path, context_parallel, settings, shapes) -> None:
    """With CONTEXT_PARALLEL = C > 1, before any model is built. The transformer's _cp_plan (diffusers
    models/transformers/transformer_wan.py, WanTransformer3DModel._cp_plan) splits the video tokens entering the
    first block, their rotary embedding and TI2V's per-token timesteps C ways, and gathers proj_out's output;
    self-attention runs Ulysses over the heads; the text (and 2.1 I2V's CLIP tokens) stays whole on every rank,
    cross-attended from each rank's share. So the heads and every clip's video tokens divide by C, at every shape
    the run uses (`shapes`: training, samples, validation); the text length need not."""
    if context_parallel == 1:
        return
    with open(os.path.join(model_path, "transformer", "config.json")) as f:
        t = json.load(f)
    if t["num_attention_heads"] % context_parallel:
        raise ConfigError(f"CONTEXT_PARALLEL={context_parallel}: the transformer's {t['num_attention_heads']} "
                          "attention heads (transformer/config.json) do not divide by it (Ulysses splits the heads)")
    p, settings = t["patch_size"], {**settings, "MODEL_PATH": model_path}
    for size, _ in sorted(set(shapes)):
        grid = latent_grid(size, settings)
        tokens = (grid[0] // p[0]) * (grid[1] // p[1]) * (grid[2] // p[2])
        if tokens % context_parallel:
            raise ConfigError(f"CONTEXT_PARALLEL={context_parallel}: a {num_frames(settings)}-frame clip at "
                              f"{size[0]}x{size[1]} makes {tokens} video tokens ({grid[0]} x {grid[1] // p[1]} x "
                              f"{grid[2] // p[2]}), not divisible by it; choose NUM_FRAMES or RESOLUTION to make them")


# ----------------------------------------------------------------------------------------------
# conditioning: the pipeline's UMT5 embeddings, cached at their real length


def text_length(settings) -> int:
    return int(settings["MAX_SEQUENCE_LENGTH"])


def load_text_encoder(model_path, dtype, device):
    """A WanPipeline holding only its UMT5 encoder and tokenizer: its encode_prompt is the pipeline's text path."""
    from diffusers import WanPipeline
    pipe = WanPipeline.from_pretrained(model_path, transformer=None, vae=None, scheduler=None, dtype=dtype)
    pipe.text_encoder.to(device).eval()
    return pipe


def prepare_edit_text(texts, model_path, cache_dir, settings, dtype, device) -> str:
    """Fill the text cache for the (prompt, row) pairs' prompts (each rank its share, the encoder freed after):
    encode_prompt's embeddings at MAX_SEQUENCE_LENGTH, kept cut to each prompt's real length (its tokens,
    with </s>, after prompt_clean; the rest is the pipeline's zeros). Returns the encoder identity."""
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean
    length = text_length(settings)
    identity = folder_identity(model_path, TEXT_PARTS, length, dtype_name(dtype))

    def encode(pipe, part):
        embeds, _ = pipe.encode_prompt(prompt=list(part), do_classifier_free_guidance=False,
                                       max_sequence_length=length, device=device)
        real = pipe.tokenizer([prompt_clean(p) for p in part], max_length=length, truncation=True,
                              add_special_tokens=True).input_ids
        return [{"prompt": p, "prompt_embeds": e[:len(ids)].cpu().clone(), "length": length}
                for p, e, ids in zip(part, embeds, real)]

    sources = {image_key(s): s for s in (first_image(row) for _, row in texts) if s is not None}
    if sources and has_image_encoder(model_path):  # 2.1 I2V: the same identity names both kinds of entry
        identity = folder_identity(model_path, TEXT_PARTS + IMAGE_PARTS, length, dtype_name(dtype))
    computed, reused = fill_text_cache({p: p for p, _ in texts}, cache_dir, identity,
                                       lambda: load_text_encoder(model_path, dtype, device), encode)
    print0(f"text cache: {computed + reused} unique prompts, computed {computed}, reused {reused} ({cache_dir}; "
           f"{length} tokens, {dtype_name(dtype)})")
    if sources and has_image_encoder(model_path):
        def encode_images(pipe, part):  # one at a time, as the pipeline encodes its one image
            return [{"image_embeds": pipe.encode_image(load_pil(s), device)[0].cpu().clone()} for s in part]
        computed, reused = fill_text_cache(sources, cache_dir, identity,
                                           lambda: load_image_encoder(model_path, dtype, device), encode_images)
        print0(f"image cache: {computed + reused} first images' CLIP tokens, computed {computed}, reused {reused}")
    return identity


def has_image_encoder(model_path) -> bool:
    """Whether the folder holds 2.1 I2V's CLIP image encoder (2.2's image to video has none)."""
    with open(os.path.join(model_path, "model_index.json")) as f:
        return json.load(f).get("image_encoder") not in (None, [None, None])


def load_image_encoder(model_path, dtype, device):
    """A WanImageToVideoPipeline holding only its CLIP image encoder and image processor: its encode_image is the
    pipeline's (the processor's 224 px crop of the image as given, the encoder's hidden_states[-2])."""
    from diffusers import WanImageToVideoPipeline
    from transformers import CLIPImageProcessor, CLIPVisionModelWithProjection
    encoder = CLIPVisionModelWithProjection.from_pretrained(os.path.join(model_path, "image_encoder"), dtype=dtype)
    processor = CLIPImageProcessor.from_pretrained(os.path.join(model_path, "image_processor"))
    return WanImageToVideoPipeline(tokenizer=None, text_encoder=None, vae=None, scheduler=None,
                                   image_processor=processor, image_encoder=encoder.to(device).eval())


def first_image(row):
    """A row's first image (image to video), None for a prompt alone."""
    refs = references(row) if row else []
    return refs[0] if refs else None


def image_key(source) -> str:
    """The cache key of a first image's CLIP tokens: its bytes (a file's, else its pixels')."""
    return "first image\n" + image_digest(source)


def load_text(texts, cache_dir, identity, device):
    """(B, L, D) embeddings of the pairs' prompts, zero-padded to the length they were encoded at: the tensor
    encode_prompt returns; with 2.1 I2V's first images (rows with one, where the cache holds their CLIP tokens),
    (that, (B, 257, 1280) encode_image's image tokens)."""
    if not texts:
        return None
    entries = load_entries([p for p, _ in texts], cache_dir, identity)
    e0 = entries[0]["prompt_embeds"]
    out = torch.zeros(len(entries), int(entries[0]["length"]), e0.shape[1], dtype=e0.dtype)
    for i, e in enumerate(entries):
        out[i, :e["prompt_embeds"].shape[0]] = e["prompt_embeds"]
    sources = [first_image(row) for _, row in texts]
    if any(s is None for s in sources) or not os.path.exists(cache_file(cache_dir, identity, image_key(sources[0]))):
        return out.to(device)
    images = load_entries([image_key(s) for s in sources], cache_dir, identity)
    return out.to(device), torch.stack([e["image_embeds"] for e in images]).to(device)


# ----------------------------------------------------------------------------------------------
# DMD2 (train_dmd.py's flow setup): a micro-batch's conditioning, the guidance, samples, refusals, the export


@dataclass
class WanCond:
    """One micro-batch's conditioning, shared by generator, teacher and fake score: its text and the negative
    prompt's (the teacher's CFG pair), the latent grid its tokens unpack to, how the timestep is passed and, for
    image to video, the first frame's condition channels and 2.1's CLIP image tokens (both calls of a CFG pair
    read the same ones, as the pipeline's)."""
    text: torch.Tensor  # (B, L, D) UMT5 embeddings, zero-padded as encode_prompt pads them
    negative: torch.Tensor | None  # (B, L, D) of NEGATIVE_PROMPT, for the teacher's CFG; None: no pair
    size: tuple[int, int, int]  # the latent grid (T, h, w)
    per_token: bool = False  # TI2V-5B's expand_timesteps: the timestep (B, tokens), else (B,)
    # I2V: (B, 4 + C, T, h, w) the first-frame mask and latents; TI2V-5B's image mode (per_token): (B, C, 1, h, w)
    # the first frame's latents, which stand in for the first latent frame at t = 0
    condition: torch.Tensor | None = None
    image: torch.Tensor | None = None  # (B, 257, 1280) 2.1 I2V's CLIP image tokens

    def velocity(self, model, guidance: float, norm: str = "none", guidance_2: float | None = None):
        """v(x_sigma, sigma) of `model`: the tokens (B, N, 4C) unpacked to (B, C, T, h, w), the transformer called
        as the pipeline calls it (timestep sigma * 1000, per sample or per token, the text), the prediction packed
        back. guidance > 1 (the teacher): CFG uncond + g (cond - uncond), the pair as one batch of 2B, rescaled by
        `norm`. TI2V-5B's image mode: the first latent frame's tokens are the image's at t = 0 (the pipeline's
        (1 - mask) * condition + mask * latents and mask * t), and their velocity is the one whose x0 is the image's
        latents, (x - first) / sigma, so every model's x0 keeps the first frame clean. `guidance_2` (A14B, `model` the
        Experts pair): the low-noise expert's scale, for each sample below the boundary (the pipeline's
        current_guidance_scale)."""
        pair = guidance > 1 and self.negative is not None
        first = self.condition if self.per_token else None

        def v(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
            b = x.shape[0]
            latents = unpack_latents(x, self.size)
            if first is not None:
                latents = torch.cat([first.to(latents.dtype), latents[:, :, 1:]], dim=2)
            elif self.condition is not None:  # the pipeline's torch.cat([latents, condition], dim=1)
                latents = torch.cat([latents, self.condition.to(latents.dtype)], dim=1)
            sigma = torch.as_tensor(sigma, device=x.device).reshape(-1).expand(b)
            timestep = (sigma * 1000).float()
            if self.per_token:  # every token at its sample's t, in the tokens' order (the pipeline's mask * t)
                timestep = timestep[:, None].expand(b, x.shape[1])
                if first is not None:
                    mask = torch.ones(x.shape[1], device=x.device)
                    mask[:first.shape[-1] * first.shape[-2] // 4] = 0
                    timestep = timestep * mask
            image = {} if self.image is None else {"encoder_hidden_states_image": self.image}
            if pair:
                image = {k: torch.cat([i, i]) for k, i in image.items()}
                out = model(hidden_states=torch.cat([latents, latents]), timestep=torch.cat([timestep, timestep]),
                            encoder_hidden_states=torch.cat([self.text, self.negative]), return_dict=False,
                            **image)[0]
                out = pack_latents(out).float()
                scale = guidance if guidance_2 is None else torch.where(
                    sigma * 1000 >= model.boundary, guidance, guidance_2).float()[:, None, None]
                out = cfg_combine(out[:b], out[b:], scale, norm)
            else:
                out = pack_latents(model(hidden_states=latents, timestep=timestep, encoder_hidden_states=self.text,
                                         return_dict=False, **image)[0]).float()
            if first is None:
                return out
            tokens = pack_latents(first.float())
            n = tokens.shape[1]
            kept = (x[:, :n].float() - tokens) / sigma.float().view(b, 1, 1)
            return torch.cat([kept, out[:, n:]], dim=1)
        return v

    def head_features(self, model, x: torch.Tensor, sigma: torch.Tensor, guidance: float) -> torch.Tensor:
        """The GAN head's input (algorithms/dmd2_flow.cls_logits): the hidden states of the last WanTransformerBlock
        under this conditioning, (B, D, T, h/2, w/2) fp32 with the graph kept. Every video token there has attended
        over the whole clip and the text; Wan has no double-stream blocks, so the last block's output stands where
        FLUX's double-stream image stream does. What follows it (norm_out, proj_out) runs unused."""
        captured = []
        handle = model.blocks[-1].register_forward_hook(lambda module, args, out: captured.append(out))
        try:
            self.velocity(model, guidance)(x, sigma)
        finally:
            handle.remove()
        hidden = captured[0].float()  # (B, N, D): the first call's (a recomputation would append again)
        t, h, w = self.size
        return hidden.transpose(1, 2).reshape(hidden.shape[0], hidden.shape[2], t, h // 2, w // 2)


def dmd_cond(text, negative, vae, references: list, size) -> WanCond:
    """WanCond of a micro-batch: `size` the latent grid (latent_grid); per-token timesteps with TI2V's VAE; with
    image to video's first images (B, 3, H, W) their condition channels (first_frame_condition; TI2V-5B: the image
    alone encoded, its first latent frame), and the CLIP image tokens load_text gave beside the text (the
    negative's are the same images')."""
    text, image = text if isinstance(text, tuple) else (text, None)
    negative = negative[0] if isinstance(negative, tuple) else negative
    condition = None
    if references and expands_timesteps(vae):  # TI2V-5B: the image alone encoded (prepare_latents' expand path)
        condition = encode_latents(vae, references[0][:, :, None])
    elif references:
        condition = first_frame_condition(vae, references[0], size)
    return WanCond(text, negative, tuple(size), expands_timesteps(vae), condition, image)


def first_frame_condition(vae, image: torch.Tensor, grid) -> torch.Tensor:
    """2.1 I2V's condition channels as the pipeline's prepare_latents builds them: the video [first image,
    zeros...] of the clip's frames encoded (the posterior's mode, normalised), after a 4-channel mask that is 1 on
    the first latent frame (its 4 frames: the image) and 0 after. (B, 4 + C, T, h, w) fp32."""
    t, h, w = grid
    step = vae.config.scale_factor_temporal
    b = image.shape[0]
    video = torch.cat([image[:, :, None], image.new_zeros(b, 3, (t - 1) * step, *image.shape[-2:])], dim=2)
    latents = encode_latents(vae, video)
    mask = torch.zeros(b, step, t, h, w, device=latents.device, dtype=latents.dtype)
    mask[:, :, 0] = 1
    return torch.cat([mask, latents], dim=1)


def image_tokens(vae, pixels: torch.Tensor) -> torch.Tensor:
    """Videos (B, 3, F, H, W) (or images (B, 3, H, W), one frame) in [-1, 1] -> packed clean latent tokens."""
    return pack_latents(encode_latents(vae, pixels if pixels.ndim == 5 else pixels[:, :, None]))


@torch.no_grad()
def decode_tokens(vae, tokens: torch.Tensor, size) -> torch.Tensor:
    """Packed tokens of a latent grid (T, h, w) -> each clip's first, middle and last frames side by side, images
    (B, 3, H, 3W) in [-1, 1], fp32 on CPU: what the sample grids and the validation's figures show."""
    return frames_tile(decode_latents(vae, unpack_latents(tokens.float(), size)))


def frames_tile(video: torch.Tensor) -> torch.Tensor:
    """Clips (..., 3, F, H, W) -> (..., 3, H, 3W): the first, middle and last frames side by side, as the sample
    grids show a clip (a generated one, or the GAN's real one beside it)."""
    f = video.shape[-3]
    return torch.cat([video[..., i, :, :] for i in (0, f // 2, f - 1)], dim=-1)


def dmd_guidance(settings) -> Guidance:
    """No guidance embedding: the teacher's CFG against NEGATIVE_PROMPT (REAL_GUIDANCE_SCALE, 0: the pipeline's
    GUIDANCE_SCALE; REAL_GUIDANCE_NORM, "": none, the pipeline's plain CFG); the export samples without it."""
    scale, norm = settings["REAL_GUIDANCE_SCALE"] or GUIDANCE_SCALE, settings["REAL_GUIDANCE_NORM"] or "none"
    return Guidance(scale, norm, negative=NEGATIVE_PROMPT if scale > 1 else None, export_call="guidance_scale=1.0",
                    scale_2=settings.get("REAL_GUIDANCE_SCALE_2") or None)


def check_sizes(settings) -> None:
    """The clip's frames and sides as the pipeline takes them, refused in one line where it would round them."""
    frames, (h, w), m = num_frames(settings), video_size(settings), side_multiple(settings["MODEL_PATH"])
    if frames < 1 or (frames - 1) % 4:
        raise ConfigError(f"NUM_FRAMES={frames}: Wan takes 4k + 1 frames (the VAE keeps the first and packs each 4 "
                          f"after it); the pipeline would round it to {max(frames // 4 * 4 + 1, 1)}")
    if h % m or w % m or h <= 0 or w <= 0:
        raise ConfigError(f"a {h}x{w} px clip (RESOLUTION={settings.get('RESOLUTION')}, BUCKET_ASPECTS="
                          f"{settings.get('BUCKET_ASPECTS')}): WanPipeline takes heights and widths that are "
                          f"multiples of {m} with this model (its VAE's {m // 2} x the patch's 2)")


def check_model(pipeline, model_path) -> None:
    """The Wan teachers this room distils: WanPipeline's text to video (Wan 2.1 1.3B, 14B; Wan 2.2 TI2V-5B, whose
    per-token timesteps come with its 2.2 VAE; Wan 2.2 T2V-A14B's two experts) and WanImageToVideoPipeline's Wan
    2.1 I2V-14B (36 input channels, CLIP image tokens), Wan 2.2 I2V-A14B (36 input channels, two experts, no
    CLIP) and TI2V-5B's image mode (expand_timesteps: its 48 channels); what else a folder holds is refused in one
    line (the planner plans all six built-ins)."""
    with open(os.path.join(model_path, "model_index.json")) as f:
        index = json.load(f)
    expand, residual = bool(index.get("expand_timesteps")), bool(vae_config(model_path).get("is_residual"))
    experts = index.get("transformer_2") not in (None, [None, None])
    why = ("transformer_2 and boundary_ratio come together (Wan 2.2 A14B's two experts)"
           if experts != (index.get("boundary_ratio") is not None) else
           f"expand_timesteps={expand} with {'the 2.2' if residual else 'a 2.1'} VAE (is_residual={residual}): "
           "only TI2V-5B's per-token timesteps with its 2.2 VAE are known" if expand != residual else "")
    if pipeline == I2V and not why:
        with open(os.path.join(model_path, "transformer", "config.json")) as f:
            config = json.load(f)
        channels, z = config.get("in_channels"), vae_config(model_path).get("z_dim", 16)
        clip = (bool(config.get("image_dim")), has_image_encoder(model_path))
        why = (f"the transformer takes {channels} input channels, not TI2V-5B's {z} (its first frame in the latents)"
               if expand and channels != z else
               f"the transformer takes {channels} input channels, not 2 x {z} + 4 (the noisy latents, the "
               "first-frame mask, the first frame's latents)" if not expand and channels != 2 * z + 4 else
               f"the transformer's image_dim and the image_encoder come together (image_dim "
               f"{config.get('image_dim')}, image_encoder {'present' if clip[1] else 'absent'})"
               if clip[0] != clip[1] else "")
    if why:
        raise ConfigError(f"MODEL_PATH={model_path}: a {pipeline} teacher: {why}; Wan 2.1 T2V and I2V, Wan 2.2 "
                          "TI2V-5B (text and image to video), T2V-A14B and I2V-A14B distil today")


def check_dmd_settings(pipeline, settings, changed: set, data_kind: str) -> None:
    """What a Wan teacher refuses, in one line before any work."""
    check_model(pipeline, settings["MODEL_PATH"])
    check_sizes(settings)
    i2v = pipeline == I2V
    refused = [
        ("DATA_PATH", i2v and data_kind == "txt", "a .txt holds prompts alone; image to video reads a first image "
         "per row (a .jsonl with \"control\" and \"prompt\", or the folder layout)"),
        ("MAX_SEQUENCE_LENGTH", i2v and int(settings["MAX_SEQUENCE_LENGTH"]) != I2V_TEXT_LENGTH,
         f"2.1 I2V's attention reads all but the last {I2V_TEXT_LENGTH} context tokens as the image's"),
        ("USE_GAN", settings.get("USE_GAN") and expert_boundary(settings["MODEL_PATH"]) is not None,
         "the GAN head reads one transformer's last block; a two-expert teacher (Wan 2.2 A14B) has two"),
        ("FLUX_GUIDANCE", "FLUX_GUIDANCE" in changed, "Wan has no guidance embedding; its teacher's guidance is "
         "CFG (REAL_GUIDANCE_SCALE, REAL_GUIDANCE_NORM)"),
        ("BUCKET_ASPECTS", len(settings.get("BUCKET_ASPECTS") or []) > 1 and "BUCKET_ASPECTS" in changed,
         "a Wan run has one clip size: give one ratio (width / height), or none for the pipeline's"),
        ("CONDITIONING_TIMESTEP", settings.get("CONDITIONING_TIMESTEP") != 999,
         "WanPipeline's first step is pure noise (999)"),
    ]
    refused += [(name, name in changed, "its first image is read at the clip's size" if i2v else
                 "Wan reads no reference image") for name in ("REFERENCE_AREA", "CONDITION_AREA")]
    experts = expert_boundary(settings["MODEL_PATH"]) is not None
    refused += [(name, bool(settings.get(name)) and not experts, "it adapts a two-expert teacher's low-noise "
                 "transformer_2 (Wan 2.2 A14B); this one has one transformer") for name in ("TEACHER_LORA_2",
                                                                                           "GENERATOR_LORA_2")]
    refused.append(("REAL_GUIDANCE_SCALE_2", settings.get("REAL_GUIDANCE_SCALE_2") and (
        not experts or dmd_guidance(settings).scale <= 1),
        "it is the low-noise expert's CFG of a two-expert teacher (Wan 2.2 A14B)" if not experts else
        "WanPipeline runs no CFG pair where guidance_scale (REAL_GUIDANCE_SCALE) is <= 1, for either expert"))
    for name, hit, why in refused:
        if hit:
            raise ConfigError(f"{name}={settings.get(name)} with a {pipeline} teacher: {why}")
    try:
        steps = [int(t) for t in settings.get("DENOISING_STEPS") or []]
    except ValueError:  # train_dmd.py's own check says what it expects
        return
    if len(steps) > 1 and any(abs(t - (999 - i * (999 - steps[-1]) / (len(steps) - 1))) > 1
                              for i, t in enumerate(steps)):
        raise ConfigError(f"DENOISING_STEPS={steps} with a {pipeline} teacher: WanPipeline passes no σ, so the "
                          "export's scheduler samples its own even grid: give steps evenly spaced from 999 "
                          "(e.g. [999,749,499,249])")


def flow_shift(model_path) -> float:
    """The teacher's flow shift: its UniPC scheduler's flow_shift (algorithms/flux_kontext.pipeline_shift)."""
    return pipeline_shift(scheduler_config(model_path), 0)


def distilled_scheduler(model_path, sigmas=None) -> dict:
    """The export's scheduler: FlowMatchEulerDiscreteScheduler with stochastic sampling (x0 = x - sigma v, then
    re-noised to the next sigma with fresh noise: the generator's few-step inference), shifted by the teacher's
    flow_shift and, for several steps, stretched to the last trained sigma (shift_terminal): WanPipeline calls
    set_timesteps(num_inference_steps) without sigmas, so this scheduler itself makes the trained list
    (generator_sigmas) at the trained step count."""
    n = len(sigmas or [1.0])
    config = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000,
              "shift": flow_shift(model_path), "use_dynamic_shifting": False, "stochastic_sampling": True,
              "shift_terminal": round(float(sigmas[-1]), 6) if n > 1 else None}
    return config


def generator_sigmas(model_path, sigmas: list[float]) -> list[float]:
    """The student's sigma list: the one the export's scheduler (distilled_scheduler) samples at len(sigmas)
    steps, from 1 to the last DENOISING_STEPS' sigma shifted by the teacher's flow_shift (its steps between
    spaced as that scheduler spaces them), so the generator trains, re-noises and is sampled at the same sigmas."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    last = round(float(shift_sigmas(torch.tensor(sigmas[-1], dtype=torch.float64), flow_shift(model_path))), 6)
    config = distilled_scheduler(model_path, [1.0] * (len(sigmas) - 1) + [last])
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
    scheduler.set_timesteps(len(sigmas))
    return [float(s) for s in scheduler.sigmas[:-1]]


def distilled_index(model_path) -> dict:
    """model_index.json entries a distilled generator's pipeline export sets: none (its scheduler's class is
    written with its scheduler, components/export.export_pipeline)."""
    return {}

