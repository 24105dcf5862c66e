"""The FLUX.2 family (Flux2KleinPipeline: FLUX.2 [klein] 4B / 9B and their base models; Flux2Pipeline:
FLUX.2 [dev], 32 B): its transformer built and sharded through parallel/'s generic recipe (one FSDP unit per
double- and single-stream block, as FLUX.1), its VAE (AutoencoderKLFlux2, BatchNorm-normalised latents), its
conditioning and its samples, for train_flux_kontext.py's editing fine-tuning with several references.

Conditioning is the pipelines' own (diffusers 0.42.1 pipelines/flux2/pipeline_flux2_klein.py, and
pipeline_flux2.py for [dev]):
- the text: the pipeline's encode_prompt (klein: Qwen3 under its chat template, enable_thinking=False, the
  hidden states of layers 9 / 18 / 27 stacked, :208-264; [dev]: Mistral-Small 3 under its system message,
  layers 10 / 20 / 30), padded to max_sequence_length (MAX_SEQUENCE_LENGTH, 512), no mask; text ids (0, 0, 0, l);
- each reference by the pipeline's rule (:745-756): downsized to REFERENCE_AREA (1024^2) only if larger
  (Lanczos), then centre-cut to multiples of 16, encoded alone (the posterior's mode), patchified 2x2 and
  normalised by the VAE's BatchNorm statistics (:464-477); ids (T, H, W, 0) with T = 10 + 10 i (:320-368);
- the target's tokens first (T = 0), the references' after; the loss reads the target's tokens only; a row
  without references (text to image) is the target's tokens alone, as the pipelines run a prompt alone;
- timestep σ (the pipeline passes t / 1000, the model multiplies by 1000); [dev] embeds the guidance value
  (GUIDANCE), klein has no guidance embedding and samples with true CFG against "" (not when is_distilled).

Latents are held here in the VAE's own layout (B, C, H/8, W/8), normalised: the BatchNorm acts per channel of
the 2x2-patchified latent, so normalising there and un-patchifying is exact, and FLUX.1's 2x2 packing of that
layout (algorithms/flux_kontext.pack_latents) is the pipeline's patchify-then-pack, token for token.

    python -m pytest tests/test_flux2.py -q
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

import torch

import fsdp_utils
from algorithms import flux_kontext as km
from algorithms.dmd2 import cfg_combine
from core.dist import all_gather_objects, print0
from core.errors import ConfigError
from data.images import image_size, load_pil, pil_tensor
from data.buckets import references as controls
from data.text_cache import fill_text_cache, folder_identity, load_entries
from families.dit import build_transformer as build_dit
from families.flux2.parallelism import TRANSFORMER
from families.dit import distilled_scheduler  # noqa: F401 - this family's export scheduler too
from families.dit import reference_attention_shapes
from families.pipelines import vae_scale_factor
from parallel import attention
from parallel.lora import Lora
from precision import dtype_name

NAME = "FLUX.2"  # how the README and docs name the family
# the pipelines take any number; four 1024^2 references already make a ~20 k-token sequence
MAX_REFERENCES = 4
SHARDED_TEXT_FILL = True  # SHARD_TEXT_ENCODER: its text encoder can be sharded over the ranks for the cache fill
NEGATIVE_PROMPT = ""  # klein's true CFG pairs the prompt with "" (pipeline_flux2_klein.py:714)
UNCONDITIONAL_PROMPT = NEGATIVE_PROMPT  # what CAPTION_DROPOUT trains
TEXT_READS_IMAGES = False  # Qwen3 / Mistral read the prompt alone
TEXT_TO_IMAGE = True  # rows without references train text to image: the pipelines' call with a prompt alone
DEFAULT_RESOLUTION = 1024  # RESOLUTION 0: the pipelines' area (default_sample_size 128 x the VAE factor 8)
REFERENCE_AREA = 1024 * 1024  # references larger than this are downsized to it (:748)
MULTIPLE = 16  # both sides cut to a multiple of the VAE factor x the 2x2 patch (:751)
# what the pipelines refuse in a reference before anything else (Flux2ImageProcessor.check_image_input, :769)
MIN_SIDE, MAX_ASPECT = 64, 8
TIME_OFFSET = 10  # reference i's ids have T = TIME_OFFSET * (i + 1) (_prepare_image_ids' scale)
TEXT_PARTS = ("text_encoder", "tokenizer")


def edits(pipeline: str) -> bool:
    """A FLUX.2 row edits its references, or (no reference) generates from its prompt."""
    return True


def pipeline_class(model_path):
    """Flux2KleinPipeline or Flux2Pipeline, as the folder's model_index.json names it."""
    import diffusers
    with open(os.path.join(model_path, "model_index.json")) as f:
        return getattr(diffusers, json.load(f)["_class_name"])


def default_guidance(model_path) -> float:
    """GUIDANCE 0's value for fine-tuning: [dev]'s DEV_GUIDANCE; klein (no guidance embedding) 1, unused."""
    return DEV_GUIDANCE if guided(model_path) else 1.0


def is_distilled(model_path) -> bool:
    """A step-wise distilled klein (FLUX.2-klein-4B / -9B, not their -base): model_index.json's is_distilled, by
    which Flux2KleinPipeline samples without CFG whatever guidance_scale it gets (pipeline_flux2_klein.py,
    do_classifier_free_guidance)."""
    with open(os.path.join(model_path, "model_index.json")) as f:
        return bool(json.load(f).get("is_distilled", False))


def transformer_config(model_path) -> dict:
    with open(os.path.join(model_path, "transformer", "config.json")) as f:
        return json.load(f)


def _unwrapped(model):
    return getattr(model, "module", model)  # DDP's wrapper holds the model as .module


# ----------------------------------------------------------------------------------------------
# models


def build_transformer(folder, mesh, prec, device, *, load, sharding, block_classes, lora=Lora(), seed=0,
                      base_dtype="", attention_backend=attention.DEFAULT, trainable=True, compute=None,
                      frozen_dtype=None, weights="", merge=None, fp8=""):
    """Flux2Transformer2DModel, as families/flux/room.py builds FLUX.1's (families/dit.py), sharded one unit per
    double- and single-stream block by its model facts (parallelism.py)."""
    from diffusers import Flux2Transformer2DModel
    return build_dit(Flux2Transformer2DModel, TRANSFORMER, folder, mesh, prec, device, load=load,
                     sharding=sharding, block_classes=block_classes, lora=lora, seed=seed, base_dtype=base_dtype,
                     attention_backend=attention_backend, trainable=trainable, compute=compute,
                     frozen_dtype=frozen_dtype, weights=weights, merge=merge, fp8=fp8)


def load_vae(folder, dtype, device):
    """The frozen AutoencoderKLFlux2, replicated on every rank in its own dtype (its BatchNorm in eval: the
    running statistics are the latents' normalisation)."""
    from diffusers import AutoencoderKLFlux2
    vae = AutoencoderKLFlux2.from_pretrained(folder, dtype=dtype, low_cpu_mem_usage=False)
    return fsdp_utils.prepare_frozen(vae, dtype, device)


def vae_factor(model_path) -> int:
    """Pixels per latent side: 2 ** (levels - 1), 8 for the real VAE (the pipeline's vae_scale_factor)."""
    from diffusers import AutoencoderKLFlux2
    return vae_scale_factor(AutoencoderKLFlux2.load_config(os.path.join(model_path, "vae")))


def latent_channels(vae) -> int:
    return vae.config.latent_channels


def _patchify(z):
    b, c, h, w = z.shape  # the pipeline's _patchify_latents (:371)
    return z.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(b, 4 * c, h // 2, w // 2)


def _unpatchify(z):
    b, c, h, w = z.shape  # its _unpatchify_latents (:380)
    return z.reshape(b, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c // 4, 2 * h, 2 * w)


def _bn_stats(vae, like):
    """The VAE BatchNorm's mean and std over the patchified channels (:473-476), in `like`'s dtype."""
    mean = vae.bn.running_mean.view(1, -1, 1, 1).to(like.device, like.dtype)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(like.device, like.dtype)
    return mean, std


def encode_latents(vae, images: torch.Tensor) -> torch.Tensor:
    """Images (B, 3, H, W) in [-1, 1] -> normalised latents (B, C, H/8, W/8) in fp32: the pipeline's
    _encode_vae_image (the posterior's mode, patchify, BatchNorm statistics, :464-477) in the VAE's dtype,
    un-patchified."""
    param = next(vae.parameters())
    # in the memory layout of the pipeline's image processor (numpy's (B, H, W, C) permuted): the VAE's
    # convolutions then run the pipeline's kernels and round as it does
    x = images.to(device=param.device, dtype=param.dtype).permute(0, 2, 3, 1)
    x = x.reshape(-1).view(x.shape).permute(0, 3, 1, 2)  # every stride canonical, the batch's too
    with torch.no_grad():
        z = _patchify(vae.encode(x).latent_dist.mode())
        mean, std = _bn_stats(vae, z)
    return _unpatchify((z - mean) / std).float()


def image_tokens(vae, pixels: torch.Tensor) -> torch.Tensor:
    """Images (B, 3, H, W) in [-1, 1] -> packed clean latent tokens (B, N, 4C) in fp32."""
    return km.pack_latents(encode_latents(vae, pixels))


@torch.no_grad()
def decode_latents(vae, latents: torch.Tensor) -> torch.Tensor:
    """Normalised latents (B, C, h, w) -> images (B, 3, H, W) in [-1, 1], fp32 on CPU: the pipeline's
    de-normalisation in the latents' dtype, then the decoder in the VAE's (:896-904)."""
    z = _patchify(latents)
    mean, std = _bn_stats(vae, z)
    z = _unpatchify(z * std + mean)
    return vae.decode(z.to(next(vae.parameters()).dtype), return_dict=False)[0].float().cpu()


# ----------------------------------------------------------------------------------------------
# sizes and images: the pipeline's rule for references, the same rule for the target


def pipeline_size(height: int, width: int, area: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """((h, w) after the pipeline's downsizing, (h, w) after its cut to multiples of 16) of an image of
    height x width: downsized to `area` pixels at its ratio only if larger (Flux2ImageProcessor.
    _resize_to_target_area: int() of each side), then each side cut down to a multiple of 16."""
    if height * width > area:
        scale = math.sqrt(area / (width * height))
        height, width = int(height * scale), int(width * scale)
    return (height, width), (height // MULTIPLE * MULTIPLE, width // MULTIPLE * MULTIPLE)


def load_image(source, area: int, mirror: bool = False) -> torch.Tensor:
    """(3, h, w) in [-1, 1]: an image as the pipeline prepares a reference (:745-756): downsized (Lanczos)
    to `area` if larger, centre-cut to multiples of 16 (Flux2ImageProcessor._resize_and_crop), mirrored
    first with `mirror`."""
    from PIL import Image
    im = load_pil(source, mirror)
    (h, w), (ch, cw) = pipeline_size(im.height, im.width, area)
    if (h, w) != (im.height, im.width):
        im = im.resize((w, h), Image.Resampling.LANCZOS)
    left, top = (w - cw) // 2, (h - ch) // 2
    return pil_tensor(im.crop((left, top, left + cw, top + ch)))


def reference_area(settings) -> int:
    return settings.get("REFERENCE_AREA") or REFERENCE_AREA


def image_loader(settings):
    """How a row's images are read (data/buckets.load_pairs): each reference by the pipeline's rule at
    REFERENCE_AREA, the target by the same rule at RESOLUTION^2, so an aligned pair stays aligned."""
    areas = {"reference": reference_area(settings), "target": settings["RESOLUTION"] ** 2}

    def load(source, size, mirror, role):
        image = load_image(source, areas[role], mirror)
        if tuple(image.shape[1:]) != tuple(size):
            raise ValueError(f"{source}: read as {tuple(image.shape[1:])}, its shape says {tuple(size)}")
        return image
    return load


def target_size(size, row, settings) -> tuple[int, int]:
    """The target by the references' rule at RESOLUTION^2: what the pipeline outputs for it as picture 1
    (its default height and width); a prompt alone (text to image): the bucket's size."""
    if not row.get("size") and "target" not in row:
        return tuple(size)
    h, w = row.get("size") or image_size(row["target"])
    return pipeline_size(h, w, settings["RESOLUTION"] ** 2)[1]


def reference_sizes(size, row, settings) -> tuple | None:
    """Each reference at its own size by the pipeline's rule (REFERENCE_AREA); None for row None."""
    if row is None:
        return None
    sizes = row.get("control_sizes") or [image_size(c) for c in controls(row)]
    for source, (h, w) in zip(controls(row), sizes):
        check_reference(source, h, w)
    return tuple(pipeline_size(h, w, reference_area(settings))[1] for h, w in sizes)


def check_reference(source, height: int, width: int) -> None:
    """A reference the pipelines would refuse (a side under MIN_SIDE px, an aspect ratio over MAX_ASPECT),
    refused in one line naming the image: training on it would teach an input the pipelines never take."""
    if min(height, width) < MIN_SIDE or max(height / width, width / height) > MAX_ASPECT:
        raise ConfigError(f"{source}: a {width}x{height} px reference, which FLUX.2's pipelines refuse (sides of "
                          f"{MIN_SIDE} px or more, aspect ratio at most {MAX_ASPECT}: "
                          "Flux2ImageProcessor.check_image_input); resize or drop that row")


# ----------------------------------------------------------------------------------------------
# conditioning: the pipeline's text embeddings, cached


def text_length(settings) -> int:
    return int(settings["MAX_SEQUENCE_LENGTH"])


def load_text_encoder(model_path, dtype, device):
    """The folder's pipeline holding only its text encoder and tokenizer (the classes model_index.json
    names): its encode_prompt is the pipeline's own text path."""
    pipe = pipeline_class(model_path).from_pretrained(model_path, transformer=None, vae=None, scheduler=None,
                                                      dtype=dtype)
    pipe.text_encoder.to(device).eval()
    return pipe


def load_sharded_text_encoder(model_path, dtype, device):
    """The pipeline holding its text encoder sharded over every rank (parallel/text_encoder.py) and its
    tokenizer: the fill's forwards are then collectives (data/text_cache.fill_text_cache, sharded=True)."""
    import transformers
    from fsdp_utils import build_meshes
    from parallel.text_encoder import sharded_text_encoder
    with open(os.path.join(model_path, "model_index.json")) as f:
        cls = getattr(transformers, json.load(f)["text_encoder"][1])
    encoder = sharded_text_encoder(cls, os.path.join(model_path, "text_encoder"), build_meshes(device)[0], dtype,
                                   device)
    return pipeline_class(model_path).from_pretrained(model_path, text_encoder=encoder, transformer=None, vae=None,
                                                      scheduler=None)


def shard_text_encoder(model_path, settings, dtype, device) -> bool:
    """SHARD_TEXT_ENCODER: 1 | 0 | auto (with several ranks on GPUs, when the encoder's weights in `dtype`
    take over half of one GPU's memory: [dev]'s 24 B Mistral-Small is 48 GB in bf16)."""
    from core.dist import world_size
    choice = str(settings.get("SHARD_TEXT_ENCODER", "auto"))
    if choice != "auto":
        return choice == "1" and world_size() > 1
    if world_size() == 1 or device.type != "cuda":
        return False
    from parallel.loading import tensor_shapes
    numel = sum(math.prod(s) for s in tensor_shapes(os.path.join(model_path, "text_encoder")).values())
    return numel * torch.finfo(dtype).bits // 8 > torch.cuda.get_device_properties(device).total_memory // 2


def template_tokens(pipe, prompt: str) -> int:
    """The tokens `prompt` takes under the pipeline's template before encode_prompt cuts them to
    max_sequence_length from the right (klein: the chat template, pipeline_flux2_klein.py:226-239; [dev]: the
    system message, pipeline_flux2.py:322-332)."""
    if type(pipe).__name__ == "Flux2Pipeline":
        from diffusers.pipelines.flux2.pipeline_flux2 import format_input
        return len(pipe.tokenizer.apply_chat_template(format_input([prompt]), add_generation_prompt=False,
                                                      tokenize=True, return_dict=True)["input_ids"][0])
    text = pipe.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                              add_generation_prompt=True, enable_thinking=False)
    return len(pipe.tokenizer(text)["input_ids"])


def prepare_edit_text(texts, model_path, cache_dir, settings, dtype, device) -> str:
    """Fill the text cache for the (prompt, row) pairs' prompts (each rank its share, the encoder freed
    after; sharded over the ranks where SHARD_TEXT_ENCODER says); returns the encoder identity. Says how
    many of the prompts it encodes run past MAX_SEQUENCE_LENGTH under the template: the pipeline cuts them
    from the right without a word, and [dev]'s system message alone takes hundreds of tokens."""
    length = text_length(settings)
    identity = folder_identity(model_path, TEXT_PARTS, length, dtype_name(dtype))
    cut = set()  # the prompts this rank encodes whose template runs past `length`

    def encode(pipe, part):
        cut.update(p for p in part if template_tokens(pipe, p) > length)
        embeds, _ = pipe.encode_prompt(prompt=list(part), device=device, max_sequence_length=length)
        return [{"prompt": p, "prompt_embeds": e.clone()} for p, e in zip(part, embeds.cpu())]

    sharded = shard_text_encoder(model_path, settings, dtype, device)
    load = load_sharded_text_encoder if sharded else load_text_encoder
    computed, reused = fill_text_cache({p: p for p, _ in texts}, cache_dir, identity,
                                       lambda: load(model_path, dtype, device), encode, sharded=sharded)
    print0(f"text cache: {computed + reused} unique prompts, computed {computed}, reused {reused} ({cache_dir}; "
           f"{length} tokens, {dtype_name(dtype)}{', encoder sharded' if sharded else ''})")
    cut = sorted(set().union(*all_gather_objects(sorted(cut))))
    if cut:
        print0(f"text cache: {len(cut)} prompts encoded here run past MAX_SEQUENCE_LENGTH={length} "
               f"tokens under the pipeline's template and were cut from the right as the pipeline cuts them "
               f"(the first: {cut[0][:80]!r}); raise MAX_SEQUENCE_LENGTH to keep them whole")
    return identity


def load_text(texts, cache_dir, identity, device):
    """(B, L, D) embeddings of the pairs' prompts, from the cache."""
    if not texts:
        return None
    return torch.stack([e["prompt_embeds"] for e in load_entries([p for p, _ in texts], cache_dir, identity)]
                       ).to(device)


def repeat_text(text, i, n):
    return text[i:i + 1].expand(n, -1, -1)


def text_row(text, i):
    return text[i:i + 1]


def text_ids(embeds: torch.Tensor) -> torch.Tensor:
    """(B, L, 4) ids (0, 0, 0, l) of the text tokens (the pipeline's _prepare_text_ids)."""
    b, length = embeds.shape[:2]
    ids = torch.zeros(length, 4, dtype=torch.long, device=embeds.device)
    ids[:, 3] = torch.arange(length, device=embeds.device)
    return ids.expand(b, -1, -1)


def image_ids(sizes, device) -> torch.Tensor:
    """(N, 4) ids (T, H, W, 0) of [target ; references] tokens, sizes the packed grids (h, w): the target's
    T = 0 (_prepare_latent_ids), reference i's T = 10 (i + 1) (_prepare_image_ids)."""
    out = []
    for i, (h, w) in enumerate(sizes):
        t = torch.tensor([0 if i == 0 else TIME_OFFSET * i], device=device)
        out.append(torch.cartesian_prod(t, torch.arange(h, device=device), torch.arange(w, device=device),
                                        torch.zeros(1, dtype=torch.long, device=device)))
    return torch.cat(out)


# ----------------------------------------------------------------------------------------------
# editing fine-tuning (train_flux_kontext.py; families/spec.EditingRoom lists what the script asks of a room)


def check_reference_area(settings) -> None:
    """REFERENCE_AREA above the pipelines' 1024^2: they downsize every larger reference to 1024^2 (hard-coded,
    :774), so the transformer would train on references they never produce."""
    if settings.get("REFERENCE_AREA", 0) > REFERENCE_AREA:
        raise ConfigError(f"REFERENCE_AREA={settings['REFERENCE_AREA']}: FLUX.2's pipelines downsize every "
                          f"reference to at most {REFERENCE_AREA} px (1024^2, not a setting of theirs), so larger "
                          "references are never what they feed the transformer; use 0 (1024^2) or less")


def check_edit_settings(model_path, settings, changed: set) -> None:
    """What this family refuses, in one line before any work (`changed`: the settings given a value other
    than the script's default)."""
    for name, why in (("BUCKET_ASPECTS", "the target and references keep their own ratios, as the pipeline "
                                         "sizes them (REFERENCE_AREA, RESOLUTION)"),
                      ("CONDITION_AREA", "FLUX.2's text encoder reads the prompt alone")):
        if name in changed:
            raise ConfigError(f"{name}={settings[name]}: not used by FLUX.2: {why}")
    check_reference_area(settings)
    if settings["SHIFT"] == "auto":
        raise ConfigError("SHIFT=auto: FLUX.2's pipeline shift (compute_empirical_mu) depends on the sampling step "
                          "count as well as the size; give a number (1 = none)")
    guided = transformer_config(model_path).get("guidance_embeds", True)
    if settings["GUIDANCE"] not in (0, 1.0) and not guided:
        raise ConfigError(f"GUIDANCE={settings['GUIDANCE']}: this FLUX.2 transformer has no guidance embedding "
                          "(klein's guidance is true CFG: SAMPLE_GUIDANCE for samples); leave GUIDANCE at 1")


def check_context_parallel(model_path, context_parallel, settings, shapes) -> None:
    """With CONTEXT_PARALLEL = C > 1, before any model is built: Ulysses splits the attention heads C ways, and
    the transformer's _cp_plan splits the text tokens and the image tokens (target + references) C ways each, so
    all three must divide by C, at every shape the run uses (`shapes`: training, validation, samples)."""
    if context_parallel == 1:
        return
    heads = transformer_config(model_path)["num_attention_heads"]
    if heads % context_parallel:
        raise ConfigError(f"CONTEXT_PARALLEL={context_parallel}: the transformer's {heads} attention heads "
                          "(transformer/config.json) do not divide by it (Ulysses splits the heads)")
    if text_length(settings) % context_parallel:
        raise ConfigError(f"CONTEXT_PARALLEL={context_parallel}: MAX_SEQUENCE_LENGTH={text_length(settings)} text "
                          "tokens do not divide by it; set it to a multiple")
    factor = vae_factor(model_path)
    for size, sizes in sorted(set(shapes)):
        tokens = sum((h // (2 * factor)) * (w // (2 * factor)) for h, w in (size, *sizes))
        if tokens % context_parallel:
            raise ConfigError(f"CONTEXT_PARALLEL={context_parallel}: a target of {size[0]}x{size[1]} with references "
                              f"{', '.join(f'{h}x{w}' for h, w in sizes) or 'none'} makes {tokens} image tokens, not "
                              "divisible by it; resize those images, or set REFERENCE_AREA / RESOLUTION")


def edit_attention_shapes(model_path, settings, shapes, batch, context_parallel):
    """The run's attention calls for the start-up kernel check (families/dit.reference_attention_shapes)."""
    with open(os.path.join(model_path, "vae", "config.json")) as f:
        vae_channels = json.load(f)["block_out_channels"][-1]
    return reference_attention_shapes(model_path, text_length(settings), shapes, vae_factor(model_path), batch,
                                      vae_channels, context_parallel)


def model_inputs(x0, references, noise, sigmas) -> dict:
    """[noisy target ; each clean reference] tokens with their ids, and the flow-matching target n - x0 on
    the target's tokens."""
    ids = image_ids([(z.shape[-2] // 2, z.shape[-1] // 2) for z in (x0, *references)], x0.device)
    return {**km.edit_tokens(x0, references, noise, sigmas), "img_ids": ids.expand(x0.shape[0], -1, -1)}


def guidance_input(transformer, guidance, batch, device):
    """[dev]'s embedded guidance value per sample; None for a transformer without the embedding (klein)."""
    if not _unwrapped(transformer).config.guidance_embeds:
        return None
    return torch.full((batch,), float(guidance), device=device, dtype=torch.float32)


def forward(transformer, inputs, sigmas, guidance, text):
    """The transformer on model_inputs' tokens: timestep σ (B,), the text with its ids, [dev]'s guidance."""
    hidden = inputs["hidden_states"]
    b = hidden.shape[0]
    timestep = torch.as_tensor(sigmas, device=hidden.device).reshape(-1).expand(b)
    return transformer(hidden_states=hidden, encoder_hidden_states=text, timestep=timestep,
                       img_ids=inputs["img_ids"], txt_ids=text_ids(text),
                       guidance=guidance_input(transformer, guidance, b, hidden.device), return_dict=False)[0]


def sample_pipeline(scheduler, vae, transformer):
    return scheduler, transformer


def sampling_shift(model_path: str, tokens: int, steps: int) -> float:
    """The shift s of the pipelines' σ at `steps` steps for `tokens` packed target tokens: their exponential
    time shift by compute_empirical_mu (pipeline_flux2_klein.py) is s·σ / (1 + (s − 1)·σ) with s = e^mu on
    linspace(1, 1/steps), which is the uniform grid's first `steps` points."""
    from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu
    return math.exp(compute_empirical_mu(image_seq_len=tokens, num_steps=steps))


@torch.no_grad()
def sample(pipe, vae, references, text, size, steps, guidance, generator, negative=None) -> torch.Tensor:
    """One edit (3, h, w) on CPU by the pipeline's denoising loop (:770-890) on latents: its noise drawn as it
    draws it, σ = linspace(1, 1/steps) with compute_empirical_mu of the target's tokens and the step count,
    the references' clean tokens after the noisy target's; [dev]: the guidance embedding; klein: true CFG
    against `negative` when `guidance` > 1."""
    import numpy as np
    from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu, retrieve_timesteps
    from diffusers.utils.torch_utils import randn_tensor
    scheduler, transformer = pipe
    device, dtype = text.device, text.float().dtype
    f = 2 ** (len(vae.config.block_out_channels) - 1)
    h, w = 2 * (size[0] // (f * 2)), 2 * (size[1] // (f * 2))
    c = latent_channels(vae)
    latents = randn_tensor((1, 4 * c, h // 2, w // 2), generator=generator, device=device, dtype=dtype)
    latents = latents.flatten(2).transpose(1, 2)  # the pipeline's _pack_latents
    refs = [image_tokens(vae, r).to(device, dtype) for r in references]
    ids = image_ids([(h // 2, w // 2), *[(r.shape[-2] // f // 2, r.shape[-1] // f // 2) for r in references]],
                    device)[None]
    mu = compute_empirical_mu(image_seq_len=latents.shape[1], num_steps=steps)
    timesteps, _ = retrieve_timesteps(scheduler, steps, device, sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    scheduler.set_begin_index(0)
    g = guidance_input(transformer, guidance, 1, device)
    cfg = g is None and guidance > 1 and negative is not None
    for t in timesteps:
        model_input = torch.cat([latents, *refs], dim=1)
        timestep = t.expand(1).to(latents.dtype) / 1000

        def velocity(embeds):
            return transformer(hidden_states=model_input, encoder_hidden_states=embeds.float(), timestep=timestep,
                               img_ids=ids, txt_ids=text_ids(embeds), guidance=g,
                               return_dict=False)[0][:, :latents.shape[1]]
        pred = velocity(text)
        if cfg:
            neg = velocity(negative)
            pred = neg + guidance * (pred - neg)
        latents = scheduler.step(pred, t, latents, return_dict=False)[0]
    return decode_latents(vae, km.unpack_latents(latents, h, w))[0]


# ----------------------------------------------------------------------------------------------
# DMD2 (train_dmd.py's flow setup): the guidance side, a micro-batch's conditioning, the samples' decoding, the
# refusals, the distilled export

TRUE_CFG_SCALE = 4.0  # Flux2KleinPipeline's default guidance_scale: klein-base samples with true CFG at it
# [dev]'s embedded guidance wherever it is not given (GUIDANCE and FLUX_GUIDANCE 0): Flux2Pipeline's default
# guidance_scale, the value it is sampled at, so a fine-tune learns at the value it is used with
DEV_GUIDANCE = 4.0
# DMD2's real score for klein-base: its CFG pair rescaled per token (algorithms/dmd2.cfg_combine), the
# normalisation docs/demos.md measured on Qwen-Image-Edit (it kept the teacher's variety and saturation where
# plain CFG did not) and LightX2V's klein choice; the pipeline itself samples with plain CFG (REAL_GUIDANCE_NORM=none)
CFG_NORM = "token"


def guided(model_path) -> bool:
    """[dev]: the guidance embedding; klein: none."""
    return bool(transformer_config(model_path).get("guidance_embeds", False))


def dmd_guidance(settings):
    """[dev]: every transformer takes FLUX_GUIDANCE as its embedded input, the teacher no CFG pair; klein-base: the
    teacher's true CFG against "" (REAL_GUIDANCE_SCALE, 0: the pipeline's 4; REAL_GUIDANCE_NORM, "": CFG_NORM),
    the generator and the fake score without guidance; the export is a distilled klein, which ignores guidance."""
    from algorithms.dmd2 import Guidance
    if guided(settings["MODEL_PATH"]):
        value = settings["FLUX_GUIDANCE"] or DEV_GUIDANCE
        return Guidance(settings["REAL_GUIDANCE_SCALE"] or 1.0, settings["REAL_GUIDANCE_NORM"] or "none",
                        embedded=value, export_call=f"guidance_scale={value}")
    scale, norm = settings["REAL_GUIDANCE_SCALE"] or TRUE_CFG_SCALE, settings["REAL_GUIDANCE_NORM"] or CFG_NORM
    return Guidance(scale, norm, negative=NEGATIVE_PROMPT if scale > 1 else None, export_call="")


@dataclass
class Flux2Cond:
    """One micro-batch's conditioning, shared by generator, teacher and fake score: its text (and the negative
    prompt's for klein's true CFG), the references' clean tokens and their latent sizes, as fine-tuning builds
    them (model_inputs, forward)."""
    text: torch.Tensor  # (B, L, D)
    negative: torch.Tensor | None  # (B, L, D) of NEGATIVE_PROMPT, for the teacher's true CFG; None: no pair
    references: list  # [(B, Nr, 4C) packed clean reference latents]
    size: tuple[int, int]  # the target latent's (h, w)
    reference_sizes: list = field(default_factory=list)  # each reference latent's (h, w)

    def velocity(self, model, guidance: float, norm: str = "none"):
        """v(x_σ, σ) of `model`: x_σ the packed target tokens (B, Nt, 4C), the references after them, the
        prediction cut back to the target's. [dev]: `guidance` is the embedded value. klein, `guidance` > 1 (the
        teacher): true CFG v_neg + s (v − v_neg), the pair as one batch of 2B, rescaled by `norm`."""
        grids = [(h // 2, w // 2) for h, w in (self.size, *self.reference_sizes)]
        ids = image_ids(grids, self.text.device)
        pair = not _unwrapped(model).config.guidance_embeds and guidance > 1 and self.negative is not None

        def v(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
            hidden = torch.cat([x, *(r.to(x.dtype) for r in self.references)], dim=1)
            b = x.shape[0]
            sigma = torch.as_tensor(sigma, device=x.device).reshape(-1).expand(b)
            if pair:
                inputs = {"hidden_states": torch.cat([hidden, hidden]), "img_ids": ids.expand(2 * b, -1, -1)}
                out = forward(model, inputs, torch.cat([sigma, sigma]), guidance, torch.cat([self.text, self.negative]))
                out = out[:, :x.shape[1]].float()
                return cfg_combine(out[:b], out[b:], guidance, norm)
            inputs = {"hidden_states": hidden, "img_ids": ids.expand(b, -1, -1)}
            return forward(model, inputs, sigma, guidance, self.text)[:, :x.shape[1]].float()
        return v


def dmd_cond(text, negative, vae, references: list, size) -> Flux2Cond:
    """Flux2Cond of a micro-batch: references (B, 3, H, W) pixels per position (none: text to image), encoded and
    packed."""
    f = 2 ** (len(vae.config.block_out_channels) - 1)
    return Flux2Cond(text, negative, [image_tokens(vae, r) for r in references], size,
                     [(r.shape[-2] // f, r.shape[-1] // f) for r in references])


@torch.no_grad()
def decode_tokens(vae, tokens: torch.Tensor, size) -> torch.Tensor:
    """Packed latent tokens of a (h, w) latent -> images (B, 3, H, W), fp32 on CPU (decode_latents)."""
    return decode_latents(vae, km.unpack_latents(tokens.float(), *size))


def distilled_index(model_path) -> dict:
    """A distilled klein export says is_distilled, as BFL's 4-step klein does: Flux2KleinPipeline then samples
    without CFG whatever guidance_scale it is given ([dev]'s pipeline has no such flag)."""
    return {"is_distilled": True} if pipeline_class(model_path).__name__ == "Flux2KleinPipeline" else {}


def check_dmd_settings(pipeline, settings, changed: set, data_kind: str) -> None:
    """What a FLUX.2 teacher refuses, in one line before any work."""
    check_reference_area(settings)
    if is_distilled(settings["MODEL_PATH"]):  # DMD2 needs the teacher's score at every σ, under its CFG
        raise ConfigError(f"MODEL_PATH={settings['MODEL_PATH']} is a step-wise distilled klein (model_index.json "
                          "is_distilled): its few steps were distilled without CFG, so it is no score to match and "
                          "CFG on it is a wrong target; distil klein-base (FLUX.2-klein-base-4B / -9B, or a "
                          "fine-tune of it)")
    dev = guided(settings["MODEL_PATH"])
    refused = [
        ("BUCKET_ASPECTS", "BUCKET_ASPECTS" in changed,
         "the target and references keep their own ratios, as the pipeline sizes them"),
        ("FLUX_GUIDANCE", "FLUX_GUIDANCE" in changed and not dev,
         "klein has no guidance embedding; its teacher's guidance is true CFG (REAL_GUIDANCE_SCALE, "
         "REAL_GUIDANCE_NORM)"),
        ("REAL_GUIDANCE_SCALE", dev and settings["REAL_GUIDANCE_SCALE"] not in (0, 1),
         "[dev] is guidance-distilled: its guidance is the embedded FLUX_GUIDANCE, not a CFG pair"),
        ("SHIFT", settings.get("SHIFT") == "auto",
         "FLUX.2's pipeline shift depends on the sampling step count as well as the size; give a number"),
    ]
    for name, hit, why in refused:
        if hit:
            raise ConfigError(f"{name}={settings[name]} with a {pipeline} teacher: {why}")
