"""The Z-Image family (ZImagePipeline: Z-Image base, text to image), for train_dmd.py's flow setup: its single-stream
transformer built and sharded through parallel/'s generic recipe (one FSDP unit per ZImageTransformerBlock), its
VAE (FLUX.1's AutoencoderKL), its conditioning, its teacher's CFG and the distilled export's scheduler; and the
fine-tuning step and samples train_flux_kontext.py asks of a room (families/spec.EditingRoom): text-to-image rows,
tested against ZImagePipeline, and Omni edit rows, tested against ZImageOmniPipeline.

Conditioning is the pipeline's own (diffusers 0.42.1 pipelines/z_image/pipeline_z_image.py):
- the text: Qwen3 through the pipeline's encode_prompt (_encode_prompt: the prompt under the tokenizer's chat
  template with enable_thinking=True, padded to max_sequence_length (512, the template included), hidden_states[-2],
  only the unmasked tokens kept): a list of (L_i, D) tensors, one per prompt, which the transformer pads (to a
  multiple of 32 with its cap_pad_token, then to the batch's longest with an attention mask) itself;
- the latents (B, C, H/8, W/8): (z - shift_factor) * scaling_factor of the posterior's mode, handed to the
  transformer as a list of (C, 1, h, w), one per sample; tokens here are 2x2 patches (algorithms/flux_kontext
  .pack_latents), the DMD2 math's layout only: the transformer patchifies the unpacked latents itself;
- the timestep the model gets is 1 - σ (the pipeline's (1000 - t) / 1000; the transformer scales it by t_scale
  1000), so σ = 1 (noise) is t = 0;
- the sign: the pipeline negates the model's output before its Euler step, so the model predicts x0 - n and the
  flow velocity of this suite (v = n - x0, x̂0 = x_σ - σ·v) is its negation;
- the σ schedule: linspace(1, 1/N, N) under the scheduler's static shift (use_dynamic_shifting off: the pipeline's
  mu goes unused);
- the teacher's CFG in the pipeline's own form, pos + g (pos - neg) on the model's outputs, against the negative
  prompt "" (encode_prompt's default), at its guidance_scale g = 5.0: REAL_GUIDANCE_SCALE w is the suite's standard
  form neg + w (pos - neg), so g = w - 1 and the default w is 6. cfg_normalization (off by default; True caps each
  sample's norm at its conditional prediction's) is REAL_GUIDANCE_NORM none / scalar; cfg_truncation's default 1.0
  never drops the CFG (1 - σ <= 1), so nothing to train for it.

ZImageOmniPipeline (edits from references) is the same model called in omni mode: its conditioning is omni.py's,
which the functions below hand its runs to.

    python -m pytest tests/test_z_image.py tests/test_z_image_omni.py -q
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from algorithms import flux_kontext as km
from algorithms.dmd2 import Guidance
from core.dist import print0
from core.errors import ConfigError
from data.text_cache import fill_text_cache, folder_identity, load_entries
from families.dit import build_transformer as build_dit
from families.dit import distilled_scheduler  # noqa: F401 - the export's: the teacher's made neutral, stochastic
from families.pipelines import vae_scale_factor
import families.z_image.omni as omni
from families.z_image.parallelism import TRANSFORMER
from parallel import attention
from parallel.lora import Lora
from precision import dtype_name

NAME = "Z-Image"  # how the README and docs name the family
MAX_REFERENCES = omni.MAX_REFERENCES  # ZImageOmniPipeline's rows; ZImagePipeline's are prompts alone
NEGATIVE_PROMPT = ""  # encode_prompt's negative prompt when none is given
UNCONDITIONAL_PROMPT = NEGATIVE_PROMPT  # what CAPTION_DROPOUT trains: the text the pipeline's CFG pairs with
TEXT_READS_IMAGES = False
DEFAULT_RESOLUTION = 1024  # RESOLUTION 0: the pipeline's default 1024 x 1024
GUIDANCE_SCALE = 5.0  # the pipeline's default guidance_scale g, its own form pos + g (pos - neg)
NORMS = {"none": False, "scalar": 1.0}  # REAL_GUIDANCE_NORM -> the pipeline's cfg_normalization
SEQ_MULTI_OF = 32  # the transformer pads image and caption tokens to multiples of this
TEXT_PARTS = ("text_encoder", "tokenizer")


def edits(pipeline: str) -> bool:
    """A text-to-image row is a prompt alone; an Omni row has references."""
    return pipeline == omni.PIPELINE


# ----------------------------------------------------------------------------------------------
# models


def build_transformer(folder, mesh, prec, device, *, load, sharding, block_classes, lora=Lora(), seed=0,
                      base_dtype="", attention_backend=attention.DEFAULT, trainable=True, compute=None,
                      frozen_dtype=None, weights="", merge=None, fp8=""):
    """ZImageTransformer2DModel, as families/flux/room.py builds FLUX's (families/dit.py), sharded one unit per
    ZImageTransformerBlock by its model facts (parallelism.py). Its RoPE tables are made on the host at the first
    call (RopeEmbedder holds no buffer), so a meta build needs nothing more."""
    from diffusers import ZImageTransformer2DModel
    return build_dit(ZImageTransformer2DModel, TRANSFORMER, folder, mesh, prec, device, load=load, sharding=sharding,
                     block_classes=block_classes, lora=lora, seed=seed, base_dtype=base_dtype,
                     attention_backend=attention_backend, trainable=trainable, compute=compute,
                     frozen_dtype=frozen_dtype, weights=weights, merge=merge, fp8=fp8)


def load_vae(folder, dtype, device):
    """The frozen AutoencoderKL, replicated on every rank in its own dtype."""
    import fsdp_utils
    from diffusers import AutoencoderKL
    vae = AutoencoderKL.from_pretrained(folder, dtype=dtype, low_cpu_mem_usage=False)
    return fsdp_utils.prepare_frozen(vae, dtype, device)


def vae_factor(model_path) -> int:
    """Pixels per latent side, the pipeline's vae_scale_factor: 2 ** (len(block_out_channels) - 1) = 8."""
    from diffusers import AutoencoderKL
    return vae_scale_factor(AutoencoderKL.load_config(os.path.join(model_path, "vae")))


def latent_channels(vae) -> int:
    return vae.config.latent_channels


encode_latents = km.encode_latents  # (mode - shift_factor) * scaling_factor, fp32: the pipelines' image latents


def image_tokens(vae, pixels: torch.Tensor) -> torch.Tensor:
    """Images (B, 3, H, W) in [-1, 1] -> packed clean latent tokens (B, N, 4C) in fp32."""
    return km.pack_latents(encode_latents(vae, pixels))


@torch.no_grad()
def decode_latents(vae, latents: torch.Tensor) -> torch.Tensor:
    """Latents (B, C, h, w) -> images (B, 3, H, W) in [-1, 1], fp32 on CPU, by the pipeline's arithmetic (cast to
    the VAE's dtype, / scaling_factor + shift_factor)."""
    z = latents.to(next(vae.parameters()).dtype)
    z = z / vae.config.scaling_factor + vae.config.shift_factor
    return vae.decode(z, return_dict=False)[0].float().cpu()


@torch.no_grad()
def decode_tokens(vae, tokens: torch.Tensor, size) -> torch.Tensor:
    """Packed tokens of a (h, w) latent -> images (B, 3, H, W), fp32 on CPU (decode_latents)."""
    return decode_latents(vae, km.unpack_latents(tokens.float(), *size))


# ----------------------------------------------------------------------------------------------
# sizes


def target_size(size, row, settings) -> tuple[int, int]:
    """The target at its bucket's size (a square of RESOLUTION px: prompts alone have no aspect); Omni: omni.py's."""
    return omni.target_size(size, row, settings) if omni.is_omni(settings) else size


def reference_sizes(size, row, settings) -> tuple | None:
    """No references: text to image; Omni: omni.py's."""
    if omni.is_omni(settings):
        return omni.reference_sizes(size, row, settings)
    return None if row is None else ()


def image_loader(settings):
    return omni.image_loader(settings) if omni.is_omni(settings) else None


def text_length(settings) -> int:
    """max_sequence_length: the template and the prompt together (the pipeline's 512)."""
    return int(settings["MAX_SEQUENCE_LENGTH"])


def _padded(n: int) -> int:
    return n + (-n) % SEQ_MULTI_OF


def check_context_parallel(model_path, context_parallel, settings, shapes) -> None:
    """CONTEXT_PARALLEL > 1 is refused for this family (its spec has no check, so train_dmd.py and the planner
    refuse it first): ZImageTransformer2DModel has no _cp_plan, and its caption and image tokens are padded per
    sample to multiples of 32 before the main blocks."""
    if context_parallel > 1:
        raise ConfigError(f"CONTEXT_PARALLEL={context_parallel}: not for Z-Image here (ZImageTransformer2DModel has "
                          "no _cp_plan); use CONTEXT_PARALLEL=1")


def edit_attention_shapes(model_path, settings, shapes, batch, context_parallel):
    """The run's attention calls for the start-up kernel check: per shape the noise refiner over the image tokens,
    the context refiner over the caption's (at most MAX_SEQUENCE_LENGTH), the main blocks over both (each padded to
    a multiple of 32), and the VAE mid-block's single head of its channels over the latent grid (forward only)."""
    if omni.is_omni(settings):
        return omni.edit_attention_shapes(model_path, settings, shapes, batch, text_length(settings),
                                          vae_factor(model_path))
    with open(os.path.join(model_path, "transformer", "config.json")) as f:
        t = json.load(f)
    with open(os.path.join(model_path, "vae", "config.json")) as f:
        vae_channels = json.load(f)["block_out_channels"][-1]
    heads, f = t["n_heads"], vae_factor(model_path)
    dim, text = t["dim"] // heads, _padded(text_length(settings))
    trained, vae = [], []
    for (h, w), _ in dict.fromkeys(shapes):
        image = _padded((h // (2 * f)) * (w // (2 * f)))
        trained += [attention.Shape(f"noise refiner at {h}x{w}", batch, image, image, heads, dim),
                    attention.Shape("context refiner", batch, text, text, heads, dim),
                    attention.Shape(f"main blocks at {h}x{w}", batch, image + text, image + text, heads, dim)]
        grid = (h // f) * (w // f)
        vae.append(attention.Shape(f"VAE mid-block at {h}x{w}", batch, grid, grid, 1, vae_channels, backward=False))
    return trained, vae


# ----------------------------------------------------------------------------------------------
# conditioning: the pipeline's Qwen3 embeddings, cached as it returns them (unmasked tokens only)


def load_text_encoder(model_path, dtype, device):
    """A ZImagePipeline holding only its Qwen3 encoder and tokenizer: its encode_prompt is the pipeline's text
    path."""
    from diffusers import ZImagePipeline
    pipe = ZImagePipeline.from_pretrained(model_path, transformer=None, vae=None, scheduler=None, dtype=dtype)
    pipe.text_encoder.to(device).eval()
    return pipe


def prepare_edit_text(texts, model_path, cache_dir, settings, dtype, device) -> str:
    """Fill the text cache for the (prompt, row) pairs' prompts (each rank its share, the encoder freed after):
    encode_prompt's embeddings at MAX_SEQUENCE_LENGTH, each prompt's unmasked tokens. Returns the encoder
    identity."""
    length = text_length(settings)
    if omni.is_omni(settings):
        return omni.prepare_edit_text(texts, model_path, cache_dir, settings, dtype, device, length, TEXT_PARTS)
    identity = folder_identity(model_path, TEXT_PARTS, length, dtype_name(dtype))

    def encode(pipe, part):
        embeds, _ = pipe.encode_prompt(prompt=list(part), do_classifier_free_guidance=False,
                                       max_sequence_length=length, device=device)
        return [{"prompt": p, "prompt_embeds": e.cpu().clone()} for p, e in zip(part, embeds)]

    computed, reused = fill_text_cache({p: p for p, _ in texts}, cache_dir, identity,
                                       lambda: load_text_encoder(model_path, dtype, device), encode)
    print0(f"text cache: {computed + reused} unique prompts, computed {computed}, reused {reused} ({cache_dir}; "
           f"{length} tokens with the chat template, {dtype_name(dtype)})")
    return identity


def load_text(texts, cache_dir, identity, device) -> list | None:
    """The pairs' prompts as encode_prompt returns them: a list of (L_i, D) embeddings."""
    if identity.startswith(omni.TAG):  # ZImageOmniPipeline's segments and SigLIP features
        return omni.load_text(texts, cache_dir, identity, device)
    if not texts:
        return None
    return [e["prompt_embeds"].to(device) for e in load_entries([p for p, _ in texts], cache_dir, identity)]


# ----------------------------------------------------------------------------------------------
# DMD2 (train_dmd.py's flow setup): a micro-batch's conditioning, the guidance, refusals, the export


def model_output(model, latents: torch.Tensor, timestep: torch.Tensor, text: list) -> torch.Tensor:
    """The transformer as the pipeline calls it: latents (B, C, h, w) as a list of (C, 1, h, w), the timestep
    (B,) it gets, the caption list; its output list stacked back to (B, C, h, w) in fp32 (not yet negated)."""
    out = model(list(latents.unsqueeze(2).unbind(dim=0)), timestep, list(text), return_dict=False)[0]
    return torch.stack([o.float() for o in out], dim=0).squeeze(2)


def pipeline_cfg(pos: torch.Tensor, neg: torch.Tensor, g: float, normalization=False) -> torch.Tensor:
    """The pipeline's CFG on the model's outputs, per sample: pos + g (pos - neg) in fp32, its norm capped at
    `normalization` x pos's where that is set (cfg_normalization)."""
    out = []
    for p, n in zip(pos.float(), neg.float()):
        pred = p + g * (p - n)
        if normalization and float(normalization) > 0.0:
            most = torch.linalg.vector_norm(p) * float(normalization)
            norm = torch.linalg.vector_norm(pred)
            if norm > most:
                pred = pred * (most / norm)
        out.append(pred)
    return torch.stack(out, dim=0)


def timestep_of(sigma: torch.Tensor) -> torch.Tensor:
    """The timestep the pipeline hands the transformer at σ: (1000 - t) / 1000 with its scheduler's t = σ·1000."""
    return (1000 - sigma.float() * 1000) / 1000


@dataclass
class ZImageCond:
    """One micro-batch's conditioning, shared by generator, teacher and fake score: its text and the negative
    prompt's (the teacher's CFG pair), as encode_prompt's lists, and the target latent's (h, w)."""
    text: list  # B tensors (L_i, D)
    negative: list | None  # B tensors of NEGATIVE_PROMPT, for the teacher's CFG; None: no pair
    size: tuple[int, int]

    def velocity(self, model, guidance: float, norm: str = "none"):
        """v(x_σ, σ) = n - x0 of `model`: the tokens (B, N, 4C) unpacked to (B, C, h, w), the transformer called as
        the pipeline calls it (timestep 1 - σ, the caption list), its output negated (the model predicts x0 - n)
        and packed back. guidance > 1 (the teacher, the standard form's w): the pipeline's CFG at g = w - 1, the
        pair in one call of 2B as the pipeline batches it, capped per sample with norm "scalar"."""
        pair = guidance > 1 and self.negative is not None

        def v(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
            b = x.shape[0]
            latents = km.unpack_latents(x, *self.size)
            timestep = timestep_of(torch.as_tensor(sigma, device=x.device).reshape(-1).expand(b))
            if pair:
                out = model_output(model, torch.cat([latents, latents]), torch.cat([timestep, timestep]),
                                   list(self.text) + list(self.negative))
                out = pipeline_cfg(out[:b], out[b:], guidance - 1, NORMS[norm])
            else:
                out = model_output(model, latents, timestep, self.text)
            return km.pack_latents(-out)
        return v


def dmd_cond(text, negative, vae, references: list, size) -> ZImageCond:
    """ZImageCond of a micro-batch: `size` the latent's (h, w); omni.OmniCond of an Omni one."""
    if isinstance(text, omni.OmniText):
        return omni.dmd_cond(text, negative, vae, references, size, timestep_of=timestep_of,
                             pipeline_cfg=pipeline_cfg, norms=NORMS)
    return ZImageCond(list(text), list(negative) if negative is not None else None, tuple(size))


def dmd_guidance(settings) -> Guidance:
    """No guidance embedding: the teacher's CFG against NEGATIVE_PROMPT (REAL_GUIDANCE_SCALE w in the standard form,
    0: the pipeline's guidance_scale 5 + 1; REAL_GUIDANCE_NORM, "": none, the pipeline's cfg_normalization off);
    the export samples without it (guidance_scale=0)."""
    scale = settings["REAL_GUIDANCE_SCALE"] or GUIDANCE_SCALE + 1
    norm = settings["REAL_GUIDANCE_NORM"] or "none"
    return Guidance(scale, norm, negative=NEGATIVE_PROMPT if scale > 1 else None, export_call="guidance_scale=0.0")


def check_dmd_settings(pipeline, settings, changed: set, data_kind: str) -> None:
    """What a Z-Image teacher refuses, in one line before any work."""
    if pipeline == omni.PIPELINE:
        return omni.check_dmd_settings(pipeline, settings, changed, data_kind, NORMS)
    norm = settings.get("REAL_GUIDANCE_NORM") or "none"
    refused = [
        ("USE_GAN", settings.get("USE_GAN"), "the GAN head reads a double-stream block's image stream and a "
         "text-to-image teacher's rows have no real images; distil without it"),
        ("FLUX_GUIDANCE", "FLUX_GUIDANCE" in changed, "Z-Image has no guidance embedding; its teacher's guidance is "
         "CFG (REAL_GUIDANCE_SCALE, REAL_GUIDANCE_NORM)"),
        ("REAL_GUIDANCE_NORM", norm not in NORMS, "ZImagePipeline's cfg_normalization caps each sample's norm "
         "(scalar) or nothing (none); it has no per-token rescale"),
        ("BUCKET_ASPECTS", "BUCKET_ASPECTS" in changed, "a prompt alone has no aspect; every target is a square of "
         "RESOLUTION px"),
    ]
    refused += [(name, name in changed, "a setting of editing rows; a text-to-image teacher reads prompts")
                for name in ("CONTROL_PATH", "MAX_REFERENCES", "CONTROL_COLUMN", "TARGET_COLUMN", "REFERENCE_AREA",
                             "CONDITION_AREA")]
    for name, hit, why in refused:
        if hit:
            raise ConfigError(f"{name}={settings.get(name)} with a {pipeline} teacher: {why}")


def distilled_index(model_path) -> dict:
    """model_index.json entries a distilled generator's pipeline export sets: none."""
    return {}


# ----------------------------------------------------------------------------------------------
# fine-tuning (families/spec.EditingRoom: what train_flux_kontext.py asks of a room): ZImagePipeline on
# text-to-image rows (the target's image and its prompt), ZImageOmniPipeline on edit rows (omni.py's conditioning: a
# row's references, their SigLIP features, the caption segments) or prompts alone; the transformer called as the
# pipeline calls it

TEXT_TO_IMAGE = True  # rows without references: ZImagePipeline's only kind, ZImageOmniPipeline's call without images
encode_references = omni.encode_references  # Omni rows' references, each alone in bf16 (ZImagePipeline has none)


def check_edit_settings(model_path, settings, changed: set) -> None:
    """What fine-tuning Z-Image refuses, in one line before any work."""
    guidance = settings["SAMPLE_GUIDANCE"]
    refused = [
        ("GUIDANCE", settings["GUIDANCE"] not in (0, 1.0), "Z-Image has no guidance embedding; its samples' CFG is "
         "SAMPLE_GUIDANCE, ZImagePipeline's guidance_scale"),
        ("SAMPLE_GUIDANCE", 0 < guidance <= 1, "ZImagePipeline applies CFG at any guidance_scale > 0 (pos + g (pos - "
         "neg)); the samples pair the prompt with \"\" above 1: give 0 (no CFG) or more than 1"),
    ]
    if omni.is_omni(settings):
        refused += [*omni.reference_refusals(settings, changed),
                    ("BUCKET_ASPECTS", "BUCKET_ASPECTS" in changed, "ZImageOmniPipeline keeps the target's and each "
                     "reference's own ratio (Flux2ImageProcessor's rule at RESOLUTION^2 and 1024^2)"),
                    ("RANDOM_FLIP", settings.get("RANDOM_FLIP"), "the references' SigLIP features are cached per "
                     "image, unflipped, so a flipped step would read another image's features")]
    else:
        refused += [(name, name in changed, "a setting of editing rows; ZImagePipeline is fine-tuned on text-to-image "
                     "rows (ZImageOmniPipeline takes edit rows)")
                    for name in ("CONTROL_PATH", "MAX_REFERENCES", "CONTROL_COLUMN", "REFERENCE_AREA",
                                 "CONDITION_AREA")]
    for name, hit, why in refused:
        if hit:
            raise ConfigError(f"{name}={settings.get(name)}: {why}")


def repeat_text(text, i, n):
    return text[i:i + 1] * n  # a list of embeddings or omni.OmniText


def text_row(text, i):
    return text[i:i + 1]


def model_inputs(x0, references, noise, sigmas) -> dict:
    """The noisy target's tokens (2x2-packed: the loss's layout; forward unpacks them), the flow-matching target
    n - x0 on them, the latent's (h, w), and each sample's references as (C, 1, h, w) (Omni; none in text to
    image)."""
    return {**km.edit_tokens(x0, [], noise, sigmas), "size": tuple(x0.shape[-2:]),
            "references": omni.sample_references(references, x0.shape[0])}


def forward(transformer, inputs, sigmas, guidance, text):
    """v = n - x0 of the transformer on model_inputs' tokens, called as the pipeline calls it (the latents as a
    list of (C, 1, h, w), the timestep 1 - σ, the caption list; Omni text: omni.model_output's call with the
    references, their SigLIP features and the caption segments), its output negated; `guidance` unused (no
    embedding)."""
    hidden = inputs["hidden_states"]
    timestep = timestep_of(torch.as_tensor(sigmas, device=hidden.device).reshape(-1).expand(hidden.shape[0]))
    latents = km.unpack_latents(hidden, *inputs["size"])
    if isinstance(text, omni.OmniText):
        out = omni.model_output(transformer, latents, timestep, text.segments, inputs["references"], text.siglip)
    else:
        out = model_output(transformer, latents, timestep, text)
    return km.pack_latents(-out)


def sample_pipeline(scheduler, vae, transformer):
    return scheduler, transformer


@torch.no_grad()
def sample(pipe, vae, references, text, size, steps, guidance, generator, negative=None) -> torch.Tensor:
    """One image (3, h, w) on CPU by ZImagePipeline's loop on latents (ZImageOmniPipeline's, the same loop, for Omni
    text: its references (1, 3, H, W) encoded each alone, in omni mode): its noise drawn as it draws it (fp32), σ =
    linspace(1, 1/steps) through its scheduler (mu passed as it passes it), the timestep 1 - t / 1000, its CFG pos + g
    (pos - neg) against `negative` (g = `guidance`, its guidance_scale) with the pair in one call, the output
    negated into the scheduler's step."""
    from diffusers.pipelines.z_image.pipeline_z_image import (calculate_shift, get_default_z_image_sigmas,
                                                              retrieve_timesteps)
    from diffusers.utils.torch_utils import randn_tensor
    scheduler, transformer = pipe
    device, f = next(vae.parameters()).device, 2 ** (len(vae.config.block_out_channels) - 1)
    h, w = 2 * (size[0] // (f * 2)), 2 * (size[1] // (f * 2))
    latents = randn_tensor((1, latent_channels(vae), h, w), generator=generator, device=device, dtype=torch.float32)
    c = scheduler.config
    mu = calculate_shift((h // 2) * (w // 2), c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                         c.get("base_shift", 0.5), c.get("max_shift", 1.15))
    timesteps, _ = retrieve_timesteps(scheduler, steps, device, sigmas=get_default_z_image_sigmas(steps), mu=mu)
    scheduler.set_begin_index(0)
    refs = [omni.encode_reference(vae, r[0]) for r in references]

    def output(x, timestep, texts):
        if isinstance(texts, omni.OmniText):
            return omni.model_output(transformer, x, timestep, texts.segments, [refs] * len(texts), texts.siglip)
        return model_output(transformer, x, timestep, texts)
    cfg = guidance > 0 and negative is not None
    for t in timesteps:
        timestep = (1000 - t.expand(1)) / 1000
        if cfg:
            out = output(latents.repeat(2, 1, 1, 1), timestep.repeat(2), text + negative)
            pred = pipeline_cfg(out[:1], out[1:], guidance)
        else:
            pred = output(latents, timestep, text)
        latents = scheduler.step(-pred, t, latents, return_dict=False)[0]
    return decode_latents(vae, latents)[0]
