"""The FLUX.1 family (FluxKontextPipeline: image editing; FluxPipeline: text-to-image): its
transformer and VAE as both scripts hold them (train_flux_kontext.py's trained transformer;
train_dmd.py's generator, fake score and teacher), built on meta, adapted, sharded by the FLUX
recipe, loaded slice by slice; the attention calls the start-up kernel check runs; its latent
layout (VAE factor, 2x2 packing into tokens); its samples; and the scheduler a distilled
generator's export carries. The packing, ids and forward live in algorithms/flux_kontext.py (the
training math reads them); its conditioning here: the T5 + CLIP text cache (data/text_cache.py
holds the generic cache) and the image tokens.

    python -m pytest tests/test_train_flux_kontext.py tests/test_train_dmd_kontext.py -q
"""
from __future__ import annotations

import json
import os

import torch

import fsdp_utils
from algorithms import dmd2_flow as flux_dm
from algorithms import flux_kontext as km
from algorithms.dmd2 import Guidance
from core.dist import print0
from core.errors import ConfigError
from data.buckets import references
from data.text_cache import fill_text_cache, folder_identity, load_entries
from families.dit import build_transformer as build_dit
from families.flux.parallelism import TRANSFORMER
from families.dit import NEUTRAL_SIGMAS, distilled_scheduler, distilled_scheduler_config  # noqa: F401 - FLUX's too
from families.pipelines import vae_scale_factor
from precision import dtype_name
from parallel import attention
from parallel.lora import Lora

NAME = "FLUX.1"  # how the README and docs name the family
MAX_REFERENCES = 1  # Kontext: one context image
UNCONDITIONAL_PROMPT = ""  # what CAPTION_DROPOUT trains: the empty prompt (diffusers' --proportion_empty_prompts)
TEXT_READS_IMAGES = False  # T5 + CLIP read the prompt alone
DEFAULT_RESOLUTION = 1024  # RESOLUTION 0: the pipelines' area (default_sample_size 128 x the VAE factor 8)


def edits(pipeline: str) -> bool:
    """Kontext edits an image: a context image's tokens join the target's (FluxPipeline: text to image)."""
    return pipeline == "FluxKontextPipeline"


# ----------------------------------------------------------------------------------------------
# models


def build_transformer(folder, mesh, prec, device, *, load, sharding, block_classes, lora=Lora(), seed=0,
                      base_dtype="", attention_backend=attention.DEFAULT, trainable=True, compute=None,
                      frozen_dtype=None, weights="", merge=None, fp8=""):
    """FluxTransformer2DModel on meta -> (LoRA: adapters added, see parallel/lora.py) -> the recipe
    by its model facts (parallelism.py; parallel/parallelize.py: fully_shard per block, then the root) -> each
    rank loads its slices (load=False: allocate only, e.g. for the EMA copy that is then filled from the model).
    With CPU offload the shards are materialised in host memory, where FSDP keeps them. mesh=None
    (DDP): the recipe's AC and compile only, every rank loads the whole model (the caller wraps it
    in DDP).

    Dtypes: full fine-tuning stores the params in PRECISION's storage dtype; LoRA stores the frozen
    base in the compute dtype (base_dtype="nf4": its Linear weights in 4-bit NF4, parallel/lowbit.py)
    and the adapters in fp32, in the same per-block units. `compute`: a compute dtype other than the
    mode's (DMD2's FAKE_SCORE_FP32). trainable=False (DMD2's teacher): no grads ever, stored and
    computed in `frozen_dtype` (its Linear weights in NF4 with base_dtype="nf4"), resharded after
    every forward. `weights`: another transformer folder to load from ("" = `folder`). `merge`: a LoRA export
    (parallel/lora_merge.LoraDelta) added into the base weights as they load (a DMD2 teacher's fine-tune)."""
    from diffusers import FluxTransformer2DModel
    return build_dit(FluxTransformer2DModel, TRANSFORMER, folder, mesh, prec, device, load=load,
                       sharding=sharding, block_classes=block_classes, lora=lora, seed=seed,
                       base_dtype=base_dtype, attention_backend=attention_backend, trainable=trainable,
                       compute=compute, frozen_dtype=frozen_dtype, weights=weights, merge=merge, fp8=fp8)


def load_vae(folder, dtype, device):
    """The frozen VAE, replicated on every rank in its own dtype."""
    from diffusers import AutoencoderKL
    vae = AutoencoderKL.from_pretrained(folder, dtype=dtype, low_cpu_mem_usage=False)  # small: plain load
    return fsdp_utils.prepare_frozen(vae, dtype, device)


def attention_shapes(model_path, text_length, sizes, vae_factor, batch, context_parallel):
    """The run's attention calls for the start-up kernel check: the transformer's joint attention
    over text + target + context tokens (Ulysses: all tokens, heads / C per rank) at each (h, w) in
    `sizes`, and the VAE mid-block's single head of its channels at the latent grid (forward only)."""
    with open(os.path.join(model_path, "transformer", "config.json")) as f:
        t = json.load(f)
    with open(os.path.join(model_path, "vae", "config.json")) as f:
        vae_channels = json.load(f)["block_out_channels"][-1]
    trained, vae = [], []
    for h, w in dict.fromkeys(sizes):
        image = (h // (2 * vae_factor)) * (w // (2 * vae_factor))
        tokens = text_length + 2 * image
        trained.append(attention.Shape(f"transformer at {h}x{w}", batch, tokens, tokens,
                                       t["num_attention_heads"] // context_parallel, t["attention_head_dim"]))
        grid = (h // vae_factor) * (w // vae_factor)
        vae.append(attention.Shape(f"VAE mid-block at {h}x{w}", batch, grid, grid, 1, vae_channels, backward=False))
    return trained, vae


# ----------------------------------------------------------------------------------------------
# conditioning: T5 token embeddings + the pooled CLIP vector per prompt, cached (data/text_cache.py)

TEXT_PARTS = ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")


def t5_length(model_path, max_length) -> int:
    """MAX_SEQUENCE_LENGTH capped at the T5 tokenizer's model_max_length (32 for the tiny one)."""
    with open(os.path.join(model_path, "tokenizer_2", "tokenizer_config.json")) as f:
        limit = json.load(f).get("model_max_length", max_length)
    return int(min(max_length, limit))


def encoder_identity(model_path, max_length, dtype) -> str:
    """What the embeddings depend on besides the prompt: encoder and tokenizer files, the T5 length
    and the dtype."""
    return folder_identity(model_path, TEXT_PARTS, max_length, dtype_name(dtype))


def load_text_encoders(model_path, dtype, device):
    """A FluxKontextPipeline holding only CLIP + T5 and their tokenizers: its encode_prompt is
    exactly the pipeline's own text path, so cached embeddings equal what it would compute."""
    from diffusers import FluxKontextPipeline
    from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5TokenizerFast
    return FluxKontextPipeline(
        scheduler=None, vae=None, transformer=None,
        tokenizer=CLIPTokenizer.from_pretrained(os.path.join(model_path, "tokenizer")),
        tokenizer_2=T5TokenizerFast.from_pretrained(os.path.join(model_path, "tokenizer_2")),
        text_encoder=CLIPTextModel.from_pretrained(os.path.join(model_path, "text_encoder"),
                                                   dtype=dtype).to(device).eval(),
        text_encoder_2=T5EncoderModel.from_pretrained(os.path.join(model_path, "text_encoder_2"),
                                                      dtype=dtype).to(device).eval())


def prepare_text_cache(prompts, model_path, cache_dir, max_length, dtype, device) -> str:
    """Fill the text-embedding cache for `prompts` (each rank its share, the encoders freed after);
    returns the encoder identity (the cache key's other part)."""
    length = t5_length(model_path, max_length)
    identity = encoder_identity(model_path, length, dtype)

    def encode(pipe, part):
        embeds, pooled, _ = pipe.encode_prompt(part, prompt_2=None, device=device, max_sequence_length=length)
        return [{"prompt": p, "prompt_embeds": e.clone(), "pooled": v.clone()}
                for p, e, v in zip(part, embeds.cpu(), pooled.cpu())]

    computed, reused = fill_text_cache({p: p for p in prompts}, cache_dir, identity,
                                       lambda: load_text_encoders(model_path, dtype, device), encode)
    print0(f"text cache: {computed + reused} unique prompts, computed {computed}, reused {reused} "
           f"({cache_dir}; T5 length {length}, {dtype_name(dtype)})")
    return identity


def load_text_embeds(prompts, cache_dir, identity, device):
    """(B, T, D) T5 embeddings and (B, D) pooled CLIP vectors for `prompts`, read from the cache."""
    if not prompts:
        return None
    items = load_entries(prompts, cache_dir, identity)
    embeds = torch.stack([it["prompt_embeds"] for it in items]).to(device)
    pooled = torch.stack([it["pooled"] for it in items]).to(device)
    return embeds, pooled


# ----------------------------------------------------------------------------------------------
# latents


def image_tokens(vae, pixels: torch.Tensor) -> torch.Tensor:
    """Images (B, 3, H, W) in [-1, 1] -> packed clean latent tokens (B, N, 4C), as Kontext's
    context images and the GAN's real targets enter the transformer."""
    return km.pack_latents(km.encode_latents(vae, pixels))


# ----------------------------------------------------------------------------------------------
# editing fine-tuning (train_flux_kontext.py): what the script asks of an editing room. `settings`
# are the script's resolved constants; a shape is (target (h, w), (each reference's (h, w))); text
# entries are keyed by (prompt, row) pairs; latents are (B, C, h, w)


def check_edit_settings(model_path, settings, changed: set) -> None:
    """FLUX.1 Kontext takes every setting of the script but the Qwen-Image-Edit ones (`changed`: the
    settings given a value other than the script's default)."""
    for name in sorted(changed & {"REFERENCE_AREA", "CONDITION_AREA"}):
        raise ConfigError(f"{name}={settings[name]}: a Qwen-Image-Edit setting; FLUX.1 Kontext's context image "
                          "enters at the target's size (RESOLUTION, BUCKET_ASPECTS)")


def vae_factor(model_path) -> int:
    from diffusers import AutoencoderKL
    return vae_scale_factor(AutoencoderKL.load_config(os.path.join(model_path, "vae")))


def target_size(size, row, settings) -> tuple[int, int]:
    """The target at its resolution bucket's size."""
    return size


def reference_sizes(size, row, settings) -> tuple:
    """Kontext's one context image enters at the target's size (the bucket's); a prompt alone
    (text to image) has none."""
    return (size,) if row is None or references(row) else ()


def image_loader(settings):
    """How a row's images are read (data/buckets.load_pairs): None, stretched to their sizes as the pipeline's
    image processor resizes them."""
    return None


def check_context_parallel(model_path, context_parallel, settings, shapes) -> None:
    """With CONTEXT_PARALLEL = C > 1, before any model is built: Ulysses splits the attention heads
    C ways, and the sequence is split C ways at the transformer's input, text tokens and image
    tokens (target + context, 2 x (h/2f) x (w/2f) for an h x w bucket) each on their own, so all
    three must divide by C. `shapes` = every shape the run will use (training buckets, samples)."""
    if context_parallel == 1:
        return
    with open(os.path.join(model_path, "transformer", "config.json")) as f:
        heads = json.load(f)["num_attention_heads"]
    if heads % context_parallel:
        raise ConfigError(f"CONTEXT_PARALLEL={context_parallel}: the transformer's {heads} attention heads "
                          f"(transformer/config.json) do not divide by it (Ulysses splits the heads)")
    text_length = t5_length(model_path, settings["MAX_SEQUENCE_LENGTH"])
    if text_length % context_parallel:
        raise ConfigError(f"CONTEXT_PARALLEL={context_parallel}: {text_length} T5 tokens (MAX_SEQUENCE_LENGTH, "
                          f"capped by the tokenizer) do not divide by it; set MAX_SEQUENCE_LENGTH to a multiple")
    factor = vae_factor(model_path)
    for h, w in sorted({shape[0] for shape in shapes}):
        tokens = 2 * (h // (2 * factor)) * (w // (2 * factor))
        if tokens % context_parallel:
            raise ConfigError(f"CONTEXT_PARALLEL={context_parallel}: the {h}x{w} bucket has {tokens} image tokens "
                              f"(target + context), not divisible by it; change RESOLUTION or BUCKET_ASPECTS")


def edit_attention_shapes(model_path, settings, shapes, batch, context_parallel):
    return attention_shapes(model_path, t5_length(model_path, settings["MAX_SEQUENCE_LENGTH"]),
                            [shape[0] for shape in shapes], vae_factor(model_path), batch, context_parallel)


def prepare_edit_text(texts, model_path, cache_dir, settings, dtype, device) -> str:
    """The text cache of the (prompt, row) pairs: FLUX's embeddings depend on the prompt alone."""
    return prepare_text_cache([p for p, _ in texts], model_path, cache_dir, settings["MAX_SEQUENCE_LENGTH"],
                              dtype, device)


def load_text(texts, cache_dir, identity, device):
    return load_text_embeds([p for p, _ in texts], cache_dir, identity, device)


def repeat_text(text, i, n):
    """Sample i's text, n times (validation scores one pair at several σ)."""
    return text[0][i:i + 1].expand(n, -1, -1), text[1][i:i + 1].expand(n, -1)


def text_row(text, i):
    return text[0][i:i + 1], text[1][i:i + 1]


encode_latents = km.encode_latents


def latent_channels(vae) -> int:
    return vae.config.latent_channels


def model_inputs(x0, references, noise, sigmas) -> dict:
    """[noisy target ; clean context] tokens and ids (algorithms/flux_kontext.py)."""
    return km.build_model_inputs(x0, references[0], noise, sigmas)


def forward(transformer, inputs, sigmas, guidance, text):
    return km.transformer_forward(transformer, inputs, sigmas, guidance, *text)


def sample_pipeline(scheduler, vae, transformer):
    """FluxKontextPipeline around the trained transformer, without text encoders (the cache holds the text)."""
    from diffusers import FluxKontextPipeline
    pipe = FluxKontextPipeline(scheduler=scheduler, vae=vae, transformer=transformer, text_encoder=None,
                               tokenizer=None, text_encoder_2=None, tokenizer_2=None)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@torch.no_grad()
def sample(pipe, vae, references, text, size, steps, guidance, generator) -> torch.Tensor:
    """One edit (3, h, w) on CPU: the context goes in as latents and the output comes out as latents,
    decoded here in the VAE's own dtype (the pipeline would cast to the text's)."""
    h, w = size
    tokens = pipe(image=encode_latents(vae, references[0]), prompt_embeds=text[0].float(),
                  pooled_prompt_embeds=text[1].float(), height=h, width=w, max_area=h * w, num_inference_steps=steps,
                  guidance_scale=guidance, generator=generator, output_type="latent").images
    f = vae_scale_factor(vae.config)
    shift, scale = vae.config.shift_factor or 0.0, vae.config.scaling_factor
    latents = km.unpack_latents(tokens.float(), h // f, w // f) / scale + shift
    return vae.decode(latents.to(next(vae.parameters()).dtype)).sample.float().cpu()[0]


# ----------------------------------------------------------------------------------------------
# DMD2 (train_dmd.py's flow setup): what it asks of a flow room besides fine-tuning's


def check_dmd_settings(pipeline, settings, changed: set, data_kind: str) -> None:
    """What a FLUX.1 teacher refuses, in one line before any work. REAL_GUIDANCE_SCALE is 0 (resolved to 1:
    no teacher CFG) unless set: an explicit value other than 1 is refused."""
    kontext = edits(pipeline)
    refused = [
        ("USE_GAN=1", settings["USE_GAN"] and not kontext,
         "the GAN's real images are Kontext pairs' targets; a text-to-image teacher has none"),
        (f"REAL_GUIDANCE_SCALE={settings['REAL_GUIDANCE_SCALE']:g}", settings["REAL_GUIDANCE_SCALE"] not in (0, 1),
         "FLUX.1 is guidance-distilled, its guidance is the embedded value FLUX_GUIDANCE, not a CFG pair; "
         "set FLUX_GUIDANCE and leave REAL_GUIDANCE_SCALE at 0 (docs/families/flux.md)"),
        *[(name, name in changed, "a Qwen-Image-Edit setting; FLUX.1 Kontext's context image enters at the "
           "target's size (RESOLUTION, BUCKET_ASPECTS)") for name in ("REFERENCE_AREA", "CONDITION_AREA")],
        *[(name, name in changed and not kontext, "a setting of editing rows; a text-to-image teacher reads prompts")
          for name in ("CONTROL_PATH", "MAX_REFERENCES", "CONTROL_COLUMN", "TARGET_COLUMN", "BUCKET_ASPECTS")],
    ]
    for name, bad, why in refused:
        if bad:
            raise ConfigError(f"{name} with a {pipeline} teacher: {why}")
    if kontext and data_kind == "txt":
        raise ConfigError(f"DATA_PATH={settings['DATA_PATH']} holds prompts only; a {pipeline} teacher edits images: "
                          "give pairs with a \"control\" image and a \"prompt\" (.jsonl, folder or datasets, as "
                          "train_flux_kontext.py reads them)")


DMD_GUIDANCE = 2.5  # FLUX_GUIDANCE 0: BFL's Kontext examples sample at 2.5 (the pipeline's default is 3.5)


def dmd_guidance(settings) -> Guidance:
    """Guidance-distilled: every transformer takes FLUX_GUIDANCE as an embedded input, the teacher no CFG pair
    (check_dmd_settings refuses a REAL_GUIDANCE_SCALE other than 1, validate_config a REAL_GUIDANCE_NORM)."""
    guidance = settings["FLUX_GUIDANCE"] or DMD_GUIDANCE
    return Guidance(settings["REAL_GUIDANCE_SCALE"] or 1.0, settings["REAL_GUIDANCE_NORM"] or "none",
                    embedded=guidance, export_call=f"guidance_scale={guidance}")


def dmd_cond(text, negative, vae, references: list, size) -> flux_dm.FluxCond:
    """FluxCond of a micro-batch: the cached (T5, pooled CLIP) text, Kontext's context pixels (B, 3, H, W)
    encoded and packed (none for text to image), the target latent's (h, w). No negative: no CFG pair."""
    return flux_dm.FluxCond(text[0], text[1], image_tokens(vae, references[0]) if references else None, size)


@torch.no_grad()
def decode_tokens(vae, tokens: torch.Tensor, size) -> torch.Tensor:
    """Packed latent tokens of a (h, w) latent -> images (B, 3, H, W) in [-1, 1]-ish, fp32 on CPU."""
    shift, scale = vae.config.shift_factor or 0.0, vae.config.scaling_factor
    latents = km.unpack_latents(tokens.float(), *size) / scale + shift
    return vae.decode(latents.to(vae.dtype)).sample.float().cpu()


def distilled_index(model_path) -> dict:
    """model_index.json entries a distilled generator's pipeline export sets: none."""
    return {}
