"""The FLUX.1 family (FluxKontextPipeline: image editing; FluxPipeline: text-to-image): its
transformer and VAE as both scripts hold them (train_flux_kontext.py's trained transformer;
train_dmd.py's generator, fake score and teacher), built on meta, adapted, sharded by the FLUX
recipe, loaded slice by slice; the attention calls the start-up kernel check runs; its latent
layout (VAE factor, 2x2 packing into tokens); its samples; and the scheduler a distilled
generator's export carries. The packing, ids and forward live in algorithms/flux_kontext.py (the
training math reads them), the T5 + CLIP text cache in data/text_cache.py.

    python -m pytest tests/test_train_flux_kontext.py tests/test_train_dmd_kontext.py -q
"""
from __future__ import annotations

import json
import os

import torch

import fsdp_utils
from algorithms import dmd2_flux as flux_dm
from algorithms import flux_kontext as km
from core.dist import rank
from core.errors import ConfigError
from data.images import save_image_grid
from families.pipelines import vae_scale_factor
from precision import Precision
from parallel import attention, lowbit
from parallel.loading import build_on_meta, fill_built_model
from parallel.lora import Lora, add_lora
from parallel.parallelize import parallelize_flux

PIPELINES = ("FluxKontextPipeline", "FluxPipeline")  # model_index.json's _class_name
DEFAULT_SAMPLE_SIZE = 128  # the pipelines' default_sample_size: x the VAE factor 8 = 1024 px


def is_kontext(pipeline: str) -> bool:
    """Kontext edits an image: a context image's tokens join the target's."""
    return pipeline == "FluxKontextPipeline"


# ----------------------------------------------------------------------------------------------
# models


def build_transformer(folder, mesh, prec, device, *, load, sharding, block_classes, lora=Lora(), seed=0,
                      base_dtype="", attention_backend=attention.DEFAULT, trainable=True, compute=None,
                      frozen_dtype=None, weights=""):
    """FluxTransformer2DModel on meta -> (LoRA: adapters added, see parallel/lora.py) -> the FLUX
    recipe (parallel/parallelize.py: fully_shard per block, then the root) -> each rank loads its
    slices (load=False: allocate only, e.g. for the EMA copy that is then filled from the model).
    With CPU offload the shards are materialised in host memory, where FSDP keeps them. mesh=None
    (DDP): the recipe's AC and compile only, every rank loads the whole model (the caller wraps it
    in DDP).

    Dtypes: full fine-tuning stores the params in PRECISION's storage dtype; LoRA stores the frozen
    base in the compute dtype (base_dtype="nf4": its Linear weights in 4-bit NF4, parallel/lowbit.py)
    and the adapters in fp32, in the same per-block units. `compute`: a compute dtype other than the
    mode's (DMD2's FAKE_SCORE_FP32). trainable=False (DMD2's teacher): no grads ever, stored and
    computed in `frozen_dtype` (its Linear weights in NF4 with base_dtype="nf4"), resharded after
    every forward. `weights`: another transformer folder to load from ("" = `folder`)."""
    from diffusers import FluxTransformer2DModel
    model = build_on_meta(FluxTransformer2DModel, folder)
    attention.set_backend(model, attention_backend)  # ATTENTION_BACKEND, checked at start
    shards = mesh.size() if mesh is not None else 1
    if not trainable:
        dtype = frozen_dtype or prec.compute_dtype
        model.to(dtype).requires_grad_(False).eval()
        if base_dtype == "nf4":
            lowbit.quantize_base(model, shards)
        frozen = fsdp_utils.Sharding(compile=sharding.compile, frozen=True)
        parallelize_flux(model, mesh, Precision.frozen_mp_policy(dtype), frozen, block_classes, verbose=False)
        return fill_built_model(model, weights or folder, mesh, device, True)
    storage = prec.compute_dtype if lora else prec.param_dtype
    if storage != torch.float32:  # storage dtype of the params (on meta: free)
        model.to(storage)
    if lora:
        add_lora(model, lora)
        if base_dtype == "nf4":
            lowbit.quantize_base(model, shards)
    policy = prec.adapter_mp_policy(compute) if lora else prec.mp_policy(compute)
    parallelize_flux(model, mesh, policy, sharding, block_classes, verbose=load)
    home = torch.device("cpu") if sharding.cpu_offload else device
    return fill_built_model(model, weights or folder, mesh, home, load, lora_seed=seed)


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
# latents


def latent_layout(resolution: int, vae_config) -> tuple[int, int, tuple[int, int, int]]:
    """(image side, latent side, latent shape (C, side, side)): RESOLUTION, or 0 = the pipelines'
    default size; a multiple of the VAE factor x 2, as the 2x2 packing into tokens needs."""
    factor = vae_scale_factor(vae_config)
    resolution = resolution or DEFAULT_SAMPLE_SIZE * factor
    if resolution % (2 * factor):
        raise ConfigError(f"RESOLUTION={resolution}: must be a multiple of {2 * factor} (VAE factor x 2x2 packing)")
    side = resolution // factor
    return resolution, side, (vae_config["latent_channels"], side, side)


def image_tokens(vae, pixels: torch.Tensor) -> torch.Tensor:
    """Images (B, 3, H, W) in [-1, 1] -> packed clean latent tokens (B, N, 4C), as Kontext's
    context images and the GAN's real targets enter the transformer."""
    return km.pack_latents(km.encode_latents(vae, pixels))


# ----------------------------------------------------------------------------------------------
# samples and the distilled export's scheduler


@torch.no_grad()
def write_samples(model, vae, cond, noise, sim_noise, sigmas, guidance, tiles: list, side: int,
                  path: str) -> None:
    """Every rank runs the sharded generator over the whole σ list; rank 0 decodes and writes the
    grid: context | output | target per Kontext row (grey where a row has no target), outputs alone
    for text-to-image."""
    tokens = flux_dm.sample_tokens(model, cond, noise, sim_noise, sigmas, guidance)
    fsdp_utils.reshard_all(model)
    if rank() != 0:
        return
    shift, scale = vae.config.shift_factor or 0.0, vae.config.scaling_factor
    latents = km.unpack_latents(tokens.float(), side, side) / scale + shift
    out = vae.decode(latents.to(vae.dtype)).sample.float().cpu().clamp(-1, 1)
    if not tiles:
        return save_image_grid(out, path, nrow=4)
    grid = [t for (context, target), o in zip(tiles, out) for t in (context, o, target)]
    save_image_grid(torch.stack(grid), path, nrow=3)


# FlowMatchEulerDiscreteScheduler's settings that move its σ list away from the one passed (diffusers 0.42
# set_timesteps: shift or resolution-dependent shift, stretch to a terminal σ, Karras / exponential / beta
# respacing, 1 − σ), each at its neutral value; base_shift, max_shift, *_image_seq_len and time_shift_type
# act only through use_dynamic_shifting
NEUTRAL_SIGMAS = {"use_dynamic_shifting": False, "shift": 1.0, "shift_terminal": None, "use_karras_sigmas": False,
                  "use_exponential_sigmas": False, "use_beta_sigmas": False, "invert_sigmas": False}


def distilled_scheduler_config(config: dict) -> dict:
    """The teacher's FlowMatchEulerDiscreteScheduler config made to sample the distilled generator:
    every σ-bending setting neutral (NEUTRAL_SIGMAS: the σ list trained is the one the pipeline
    passes, at any resolution), and stochastic sampling (x̂0 = x − σ·v, then re-noised to the next σ
    with fresh noise: diffusers scheduling_flow_match_euler_discrete.py:515-518), the generator's
    few-step inference."""
    out = {k: v for k, v in config.items() if not k.startswith("_") or k == "_class_name"}
    out.update(NEUTRAL_SIGMAS, stochastic_sampling=True)
    return out


def distilled_scheduler(model_path: str) -> dict:
    """The scheduler config every export of the distilled generator carries (export/, export_merged/):
    the teacher's made to sample the trained σ list (distilled_scheduler_config)."""
    with open(os.path.join(model_path, "scheduler", "scheduler_config.json")) as f:
        return distilled_scheduler_config(json.load(f))
