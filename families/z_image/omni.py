"""ZImageOmniPipeline (Z-Image Omni: an edit from one or more reference images) for train_dmd.py's flow setup and
train_flux_kontext.py's fine-tuning: the conditioning the pipeline builds (diffusers 0.42.1
pipelines/z_image/pipeline_z_image_omni.py), reached through the Z-Image room's functions (room.py hands a
ZImageOmniPipeline run here; the models, the latents' arithmetic, the σ schedule, the timestep, the sign and the CFG
are the base pipeline's, room.py's docstring):
- the text: _encode_prompt with num_condition_images = the row's reference count: the prompt cut into segments
  around the <|vision_start|> / <|vision_end|> template pieces (n + 2 segments with n references, one without), each
  tokenised, padded to max_sequence_length and masked on its own, hidden_states[-2] with each segment's unmasked
  tokens: per prompt a list of (L_j, D); the negative "" the same way, at the same count. Cached per (prompt, count);
- each reference: downsized to 1024^2 px at its ratio where larger (Flux2ImageProcessor._resize_to_target_area),
  centre-cut to multiples of 16 (preprocess(..., resize_mode="crop")), encoded one at a time as the pipeline does:
  vae.encode(image.bfloat16()) whatever the VAE's dtype (:309), so the VAE must be bf16 (an fp32 VAE raises a
  dtype error in the pipeline; refused here in one line), (mode - shift) * scale in bf16, then fp32: (C, 1, h, w);
- SigLIP: Siglip2ImageProcessor + Siglip2VisionModel of the downsized *uncut* image, last_hidden_state cut to its
  spatial_shapes and viewed (h, w, C) (prepare_siglip_embeds), cached per image as the Wan I2V room caches its CLIP
  tokens; the target's entry is None;
- the transformer in omni mode: x = references + [target], image_noise_mask [0] * n + [1] (the references' tokens
  at t = 1), the caption segments, the SigLIP list; the target's output is the prediction.

    python -m pytest tests/test_z_image_omni.py -q
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable

import torch

from algorithms import flux_kontext as km
from core.dist import print0
from core.errors import ConfigError
from data.buckets import references as row_references
from data.images import image_digest, image_size, load_pil
from data.text_cache import fill_text_cache, folder_identity, load_entries
from families.flux2 import room as flux2_room
from parallel import attention
from precision import MODES, dtype_name, parse_dtype

PIPELINE = "ZImageOmniPipeline"
MAX_REFERENCES = 4  # the pipeline takes any number; the suite reads at most this many per row
REFERENCE_AREA = 1024 * 1024  # references larger than this are downsized to it (pipeline_z_image_omni.py:520-525)
MULTIPLE = 16  # both sides cut to a multiple of the VAE factor x the 2x2 patch (:529-532)
MIN_SIDE, MAX_ASPECT = 64, 8  # Flux2ImageProcessor.check_image_input's defaults (:518)
IMAGE_PARTS = ("siglip", "siglip_processor")
TAG = "omni-"  # the cache identity's prefix: load_text reads Omni entries
SEQ_MULTI_OF = 32


def is_omni(settings) -> bool:
    return settings.get("PIPELINE") == PIPELINE


# ----------------------------------------------------------------------------------------------
# sizes and images: Flux2ImageProcessor's rule


def pipeline_size(height: int, width: int, area: int = REFERENCE_AREA) -> tuple[tuple[int, int], tuple[int, int]]:
    """((h, w) after the pipeline's downsizing, (h, w) after its cut to multiples of 16): the Omni pipeline prepares
    its references with FLUX.2's Flux2ImageProcessor, so the rule is the FLUX.2 room's (math.sqrt, as
    _resize_to_target_area computes it)."""
    return flux2_room.pipeline_size(height, width, area)


def resized_image(source, area: int = REFERENCE_AREA, mirror: bool = False):
    """The PIL image the pipeline keeps for SigLIP (resized_images): downsized (Lanczos) to `area` if larger."""
    from PIL import Image
    im = load_pil(source, mirror)
    (h, w), _ = pipeline_size(im.height, im.width, area)
    return im if (h, w) == (im.height, im.width) else im.resize((w, h), Image.Resampling.LANCZOS)


def load_image(source, area: int = REFERENCE_AREA, mirror: bool = False) -> torch.Tensor:
    """(3, h, w) in [-1, 1]: the image as the pipeline prepares a reference: resized_image, centre-cut to multiples
    of 16 (Flux2ImageProcessor._resize_and_crop, the FLUX.2 room's reading)."""
    return flux2_room.load_image(source, area, mirror)


# each reference by the pipeline's rule (REFERENCE_AREA, which Omni rows refuse: the pipeline's 1024^2), the target
# by the same rule at RESOLUTION^2: the FLUX.2 room's loader, as both pipelines prepare images alike
image_loader = flux2_room.image_loader


target_size = flux2_room.target_size  # the target by the references' rule at RESOLUTION^2; a prompt alone: its bucket


def reference_sizes(size, row, settings) -> tuple | None:
    """Each reference at its own size by the pipeline's rule; None for row None."""
    if row is None:
        return None
    sources = row_references(row)
    sizes = row.get("control_sizes") or [image_size(c) for c in sources]
    for source, (h, w) in zip(sources, sizes):
        if min(h, w) < MIN_SIDE or max(h / w, w / h) > MAX_ASPECT:
            raise ConfigError(f"{source}: a {w}x{h} px reference, which ZImageOmniPipeline refuses (sides of "
                              f"{MIN_SIDE} px or more, aspect ratio at most {MAX_ASPECT}: Flux2ImageProcessor."
                              "check_image_input); resize or drop that row")
    return tuple(pipeline_size(h, w)[1] for h, w in sizes)


# ----------------------------------------------------------------------------------------------
# conditioning: the caption segments and the SigLIP features, cached


def text_key(prompt: str, count: int) -> str:
    return f"omni text, {count} references\n{prompt}"


def siglip_key(source) -> str:
    return "siglip\n" + image_digest(source)


def load_encoders(model_path, dtype, device, parts):
    """A ZImageOmniPipeline holding only `parts` (its text encoder and tokenizer, or its SigLIP and processor)."""
    from diffusers import ZImageOmniPipeline
    others = ("transformer", "vae", "scheduler", "text_encoder", "tokenizer", *IMAGE_PARTS)
    pipe = ZImageOmniPipeline.from_pretrained(model_path, dtype=dtype, **{k: None for k in others if k not in parts})
    for name in parts:
        part = getattr(pipe, name)
        if isinstance(part, torch.nn.Module):
            part.to(device).eval()
    return pipe


def prepare_edit_text(texts, model_path, cache_dir, settings, dtype, device, length: int, text_parts) -> str:
    """Fill the cache for the (prompt, row) pairs: each prompt's segments at its row's reference count, and each
    reference's SigLIP features. Returns the identity (TAG + the encoders')."""
    identity = TAG + folder_identity(model_path, tuple(text_parts) + IMAGE_PARTS, length, dtype_name(dtype))
    items = {text_key(p, len(row_references(r))): (p, len(row_references(r))) for p, r in texts}

    def encode(pipe, part):
        out = {}
        for n in sorted({k for _, k in part}):  # one _encode_prompt per reference count (the template's pieces)
            prompts = [p for p, k in part if k == n]
            embeds = pipe._encode_prompt(list(prompts), device=device, max_sequence_length=length,
                                         num_condition_images=n)
            out.update({(p, n): [s.cpu().clone() for s in e] for p, e in zip(prompts, embeds)})
        return [{"prompt": p, "segments": out[(p, n)]} for p, n in part]

    computed, reused = fill_text_cache(items, cache_dir, identity,
                                       lambda: load_encoders(model_path, dtype, device, text_parts), encode)
    print0(f"text cache: {computed + reused} unique (prompt, reference count) pairs, computed {computed}, reused "
           f"{reused} ({cache_dir}; {length} tokens a segment with the Omni template, {dtype_name(dtype)})")
    sources = {siglip_key(s): s for _, r in texts for s in row_references(r)}

    def encode_images(pipe, part):  # one at a time, as the pipeline encodes each reference
        return [{"siglip": pipe.prepare_siglip_embeds([resized_image(s)], 1, device, torch.float32)[0][0]
                 .cpu().clone()} for s in part]
    computed, reused = fill_text_cache(sources, cache_dir, identity,
                                       lambda: load_encoders(model_path, dtype, device, IMAGE_PARTS), encode_images)
    print0(f"image cache: {computed + reused} references' SigLIP features, computed {computed}, reused {reused}")
    return identity


@dataclass
class OmniText:
    """A micro-batch's cached text: per sample its caption segments and its references' SigLIP features."""
    segments: list  # B lists of (L_j, D)
    siglip: list  # B lists of (h, w, C), one per reference

    def __len__(self):
        return len(self.segments)

    def __getitem__(self, part: slice):
        """The samples `part` of the batch."""
        return OmniText(self.segments[part], self.siglip[part])

    def __add__(self, other: "OmniText"):
        """This batch, then `other`'s (a CFG pair in one call), as lists add."""
        return OmniText(self.segments + other.segments, self.siglip + other.siglip)

    def __mul__(self, n: int):
        """The batch n times over, as a list repeats."""
        return OmniText(self.segments * n, self.siglip * n)


def load_text(texts, cache_dir, identity, device) -> OmniText | None:
    """The pairs' prompts as _encode_prompt returns them at their rows' reference counts, with the rows' SigLIP
    features."""
    if not texts:
        return None
    keys = [text_key(p, len(row_references(r))) for p, r in texts]
    segments = [[s.to(device) for s in e["segments"]] for e in load_entries(keys, cache_dir, identity)]
    siglip = [[e["siglip"].to(device) for e in load_entries([siglip_key(s) for s in row_references(r)], cache_dir,
                                                             identity)] for _, r in texts]
    return OmniText(segments, siglip)


# ----------------------------------------------------------------------------------------------
# DMD2: the micro-batch's conditioning


@torch.no_grad()
def encode_reference(vae, image: torch.Tensor) -> torch.Tensor:
    """One reference (3, H, W) in [-1, 1] -> (C, 1, h, w) fp32 as prepare_image_latents makes it: the fp32 pixels
    in its processor's layout cast to bf16 into the VAE, (mode - shift_factor) * scaling_factor in bf16."""
    param = next(vae.parameters())
    x = image[None].to(device=param.device, dtype=torch.float32).permute(0, 2, 3, 1)
    x = x.reshape(-1).view(x.shape).permute(0, 3, 1, 2)  # numpy's (B, H, W, C) memory, as preprocess leaves it
    z = vae.encode(x.bfloat16()).latent_dist.mode()[0]
    return ((z - vae.config.shift_factor) * vae.config.scaling_factor).unsqueeze(1).float()


def model_output(model, latents, timestep, text: list, references: list, siglip: list) -> torch.Tensor:
    """The transformer in omni mode as the pipeline calls it: per sample x = its references + [the target (C, 1, h,
    w)], the noise mask [0] * n + [1], its caption segments, its SigLIP list + [None] (None without references); the
    target's outputs stacked back to (B, C, h, w) in fp32 (not yet negated)."""
    targets = list(latents.unsqueeze(2).unbind(dim=0))
    x = [list(r) + [t] for r, t in zip(references, targets)]
    mask = [[0] * len(r) + [1] for r in references]
    feats = [list(s) + [None] if len(s) else None for s in siglip]
    out = model(x, timestep, [list(c) for c in text], siglip_feats=feats, image_noise_mask=mask,
                return_dict=False)[0]
    return torch.stack([o.float() for o in out], dim=0).squeeze(2)


@dataclass
class OmniCond:
    """One micro-batch's conditioning, shared by generator, teacher and fake score: the caption segments (and the
    negative prompt's at the same reference counts), the references' latents and SigLIP features (both calls of a
    CFG pair read the same ones, as the pipeline's), the target latent's (h, w)."""
    text: list  # B lists of (L_j, D)
    negative: list | None  # B lists of NEGATIVE_PROMPT's segments; None: no pair
    references: list  # B lists of (C, 1, h, w)
    siglip: list  # B lists of (h, w, C)
    size: tuple[int, int]
    timestep_of: Callable  # the room's: σ -> the timestep the transformer gets
    pipeline_cfg: Callable  # the room's: the pipeline's CFG (pos, neg, g, normalization)
    norms: dict  # the room's: REAL_GUIDANCE_NORM -> cfg_normalization

    def velocity(self, model, guidance: float, norm: str = "none"):
        """v(x_σ, σ) = n - x0 of `model` (room.ZImageCond.velocity's, in omni mode)."""
        pair = guidance > 1 and self.negative is not None

        def v(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
            b = x.shape[0]
            latents = km.unpack_latents(x, *self.size)
            timestep = self.timestep_of(torch.as_tensor(sigma, device=x.device).reshape(-1).expand(b))
            if pair:
                out = model_output(model, torch.cat([latents, latents]), torch.cat([timestep, timestep]),
                                   list(self.text) + list(self.negative), self.references * 2, self.siglip * 2)
                out = self.pipeline_cfg(out[:b], out[b:], guidance - 1, self.norms[norm])
            else:
                out = model_output(model, latents, timestep, self.text, self.references, self.siglip)
            return km.pack_latents(-out)
        return v


def dmd_cond(text: OmniText, negative: OmniText | None, vae, references: list, size, **room) -> OmniCond:
    """OmniCond of a micro-batch: references (B, 3, H, W) pixels per position, each sample's encoded alone; `room`
    the base room's timestep_of, pipeline_cfg and norms."""
    b = len(text.segments)
    latents = [[encode_reference(vae, r[i]) for r in references] for i in range(b)]
    return OmniCond(list(text.segments), list(negative.segments) if negative is not None else None, latents,
                    list(text.siglip), tuple(size), **room)


# ----------------------------------------------------------------------------------------------
# fine-tuning (train_flux_kontext.py): the references as the pipeline hands them over


@torch.no_grad()
def encode_references(vae, images: torch.Tensor) -> torch.Tensor:
    """References (B, 3, H, W) in [-1, 1] -> (B, C, h, w) fp32, each sample encoded alone as prepare_image_latents
    encodes it (encode_reference: bf16 into the VAE, the arithmetic in bf16)."""
    return torch.stack([encode_reference(vae, image)[:, 0] for image in images])


def sample_references(references: list, batch: int) -> list:
    """Per-reference latents [(B, C, h, w)] -> per sample the list of its references' (C, 1, h, w) in fp32: x's
    conditions as the pipeline passes them."""
    return [[r[i].unsqueeze(1).float() for r in references] for i in range(batch)]


# ----------------------------------------------------------------------------------------------
# start-up: the attention shapes, the refusals


def edit_attention_shapes(model_path, settings, shapes, batch, length: int, factor: int):
    """Per shape the noise refiner over the images' tokens (references and target, each padded to 32), the context
    refiner over the caption segments (each at most `length`, padded), the SigLIP refiner over the references'
    features (at most the processor's max_num_patches each, and the target's 32 pad rows), the main blocks over all;
    the VAE mid-block over the target's latent grid (forward only)."""
    def padded(n):
        return n + (-n) % SEQ_MULTI_OF
    with open(os.path.join(model_path, "transformer", "config.json")) as f:
        t = json.load(f)
    with open(os.path.join(model_path, "vae", "config.json")) as f:
        vae_channels = json.load(f)["block_out_channels"][-1]
    with open(os.path.join(model_path, "siglip_processor", "preprocessor_config.json")) as f:
        patches = json.load(f).get("max_num_patches", 256)
    heads = t["n_heads"]
    dim = t["dim"] // heads
    trained, vae = [], []
    for (h, w), refs in dict.fromkeys(shapes):
        image = sum(padded((a // (2 * factor)) * (b // (2 * factor))) for a, b in ((h, w), *refs))
        text = (len(refs) + 2 if refs else 1) * padded(length)
        sig = (len(refs) * padded(patches) + SEQ_MULTI_OF) if refs else 0
        trained += [attention.Shape(f"noise refiner at {h}x{w} + {len(refs)} references", batch, image, image,
                                    heads, dim),
                    attention.Shape("context refiner", batch, text, text, heads, dim)]
        trained += [attention.Shape("SigLIP refiner", batch, sig, sig, heads, dim)] if sig else []
        total = image + text + sig
        trained.append(attention.Shape(f"main blocks at {h}x{w}", batch, total, total, heads, dim))
        grid = (h // factor) * (w // factor)
        vae.append(attention.Shape(f"VAE mid-block at {h}x{w}", batch, grid, grid, 1, vae_channels, backward=False))
    return trained, vae


def vae_dtype(settings) -> torch.dtype:
    """Both scripts' VAE dtype: VAE_DTYPE, else PRECISION's compute dtype."""
    if settings.get("VAE_DTYPE"):
        return parse_dtype(settings["VAE_DTYPE"])
    return MODES[settings.get("PRECISION", "bf16-mixed")].compute_dtype


def reference_refusals(settings, changed: set) -> list:
    """(setting, refused?, why) of what both scripts refuse of Omni rows: a VAE other than bf16, REFERENCE_AREA,
    CONDITION_AREA."""
    vae = vae_dtype(settings)
    return [
        ("VAE_DTYPE", vae != torch.bfloat16, f"a {dtype_name(vae)} VAE (VAE_DTYPE, else PRECISION's compute dtype): "
         "ZImageOmniPipeline encodes every reference as vae.encode(image.bfloat16()) (pipeline_z_image_omni.py:309), "
         "which only a bf16 VAE takes; use VAE_DTYPE=bf16"),
        ("REFERENCE_AREA", "REFERENCE_AREA" in changed, "ZImageOmniPipeline downsizes references over 1024^2 px "
         "to that area; it has no setting for it"),
        ("CONDITION_AREA", "CONDITION_AREA" in changed, "Qwen-Image-Edit's setting; Z-Image's text encoder reads "
         "no image"),
    ]


def check_dmd_settings(pipeline, settings, changed: set, data_kind: str, norms) -> None:
    """What a Z-Image Omni teacher refuses, in one line before any work."""
    norm = settings.get("REAL_GUIDANCE_NORM") or "none"
    refused = [
        ("USE_GAN", settings.get("USE_GAN"), "the GAN head reads a double-stream block's image stream, which "
         "Z-Image's single-stream transformer has not; distil without it"),
        ("FLUX_GUIDANCE", "FLUX_GUIDANCE" in changed, "Z-Image has no guidance embedding; its teacher's guidance is "
         "CFG (REAL_GUIDANCE_SCALE, REAL_GUIDANCE_NORM)"),
        ("REAL_GUIDANCE_NORM", norm not in norms, "ZImageOmniPipeline's cfg_normalization caps each sample's norm "
         "(scalar) or nothing (none); it has no per-token rescale"),
        *reference_refusals(settings, changed)]
    for name, hit, why in refused:
        if hit:
            raise ConfigError(f"{name}={settings.get(name)} with a {pipeline} teacher: {why}")
