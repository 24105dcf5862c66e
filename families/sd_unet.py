"""The SD UNet family (SD-1.5's StableDiffusionPipeline, SDXL's StableDiffusionXLPipeline): how its
UNet is built and sharded (the UNet recipe of parallel/parallelize.py), its conditioning (CLIP text
embeddings; SDXL: two encoders and the added time/text conditions), its latent layout and VAE
scaling, its training target (ε-prediction on the DDPM schedule's alphas) and its samples.

    python -m pytest tests/test_train_dmd.py tests/test_train_dmd_sdxl.py -q
"""
from __future__ import annotations

import functools
import json
import os

import torch
import torch.nn as nn

import fsdp_utils
from algorithms import dmd2 as dm
from core.dist import rank
from core.errors import ConfigError
from data.images import save_image_grid
from data.prefetch import to_device
from families.pipelines import vae_scale_factor
from parallel import attention, lowbit
from parallel import lora as lora_lib
from parallel.loading import build_on_meta, fill_built_model
from parallel.parallelize import parallelize_unet

PIPELINES = ("StableDiffusionPipeline", "StableDiffusionXLPipeline")  # model_index.json's _class_name
NAME = "SD UNets"  # how the README and docs name the family

# The official DMD2 LoRA run's targets (tianweiy/DMD2 main/sd_unified_model.py:47-62, its
# --generator_lora path, SDXL only there): attention, proj_in/out, feed-forward, the resnets' convs
# and time embedding projections, the down/up samplers' convs. recipes/dmd_*_lora.sh pass them as
# LORA_TARGET_MODULES (tests/test_recipes.py checks they are these).
DMD2_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2",
                     "conv1", "conv2", "conv_shortcut", "downsamplers.0.conv", "upsamplers.0.conv", "time_emb_proj")


def is_sdxl(pipeline: str) -> bool:
    """SDXL: two text encoders, added time/text conditions, an fp32 VAE by default."""
    return pipeline == "StableDiffusionXLPipeline"


# ----------------------------------------------------------------------------------------------
# models


def build_unet(folder: str, mesh, dtype: torch.dtype, device: torch.device, *, policy, trainable: bool,
               sharding: fsdp_utils.Sharding, block_classes: list[str], load: bool = True,
               lora: lora_lib.Lora = lora_lib.Lora(), seed: int = 0, weights: str = "",
               base_dtype: str = "", attention_dtype: torch.dtype | None = None,
               channels_last: bool = False) -> nn.Module:
    """A UNet2DConditionModel built on the meta device from `folder`'s config, stored in `dtype`,
    sharded by the UNet recipe, then each rank reads only its slices from `weights` (a UNet folder or
    one .safetensors file; "" = `folder`) (load=False: allocated, unfilled and without grads, for
    the EMA). Trainable: `policy` is the precision's mixed-precision policy and
    `sharding` applies; with `lora`, peft adapters (fp32, initialised from `seed`) train on the
    frozen base, which the caller stores in its compute dtype (parallel/lora.py; base_dtype="nf4":
    its Linear weights in 4-bit NF4, parallel/lowbit.py). Frozen: no grads
    ever, stored in its compute dtype (the frozen policy), resharded after every forward. mesh=None
    (PARALLELISM=ddp): the recipe's AC and compile only, every rank loads the whole model (the
    caller wraps a trainable one in DDP). `attention_dtype`: its attention products (SDPA) run in
    this dtype, whatever its compute dtype (parallel/attention.CastSdpaProcessor); `channels_last`:
    its convolutions read and hand on NHWC activations (to_channels_last)."""
    from diffusers import UNet2DConditionModel

    model = build_on_meta(UNet2DConditionModel, folder).to(dtype)
    if attention_dtype is not None:
        model.set_attn_processor(attention.CastSdpaProcessor(attention_dtype))
    if channels_last:
        to_channels_last(model)
    if trainable and lora:
        lora_lib.add_lora(model, lora)
        if base_dtype == "nf4":
            lowbit.quantize_base(model, mesh.size() if mesh is not None else 1)
    if not load or not trainable:
        model.requires_grad_(False)
    if not trainable:
        model.eval()
        sharding = fsdp_utils.Sharding(compile=sharding.compile, frozen=True)
    parallelize_unet(model, mesh, policy, sharding, block_classes)
    home = torch.device("cpu") if sharding.cpu_offload else device
    return fill_built_model(model, weights or folder, mesh, home, load, lora_seed=seed)


def _nhwc_input(conv: nn.Module, args: tuple) -> tuple:
    return (args[0].contiguous(memory_format=torch.channels_last), *args[1:])


def to_channels_last(model: nn.Module) -> nn.Module:
    """CHANNELS_LAST: every Conv2d of `model` reads its input in NHWC (a no-op where it already is),
    so cuDNN runs its NHWC kernels instead of converting layouts on every call (nchwToNhwcKernel)
    and hands its output on in NHWC. A forward pre-hook rather than `model.to(memory_format=...)`:
    FSDP2 all-gathers a weight contiguous in NCHW whatever its shard's layout, and a conv takes
    NHWC when its input or its weight is (torch's cudnn_conv_suggest_memory_format). Returns `model`."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            m.register_forward_pre_hook(_nhwc_input)
    return model


def load_frozen_parts(model_path: str, sdxl: bool, te_dtype: torch.dtype, vae_dtype: torch.dtype,
                      vae_path: str, device: torch.device):
    """Tokenizers, CLIP text encoders (SDXL: the second with its projection) and the VAE (from
    `vae_path` when given): small, frozen, replicated on every rank."""
    from diffusers import AutoencoderKL
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    tokenizers = [CLIPTokenizer.from_pretrained(model_path, subfolder="tokenizer")]
    encoders = [CLIPTextModel.from_pretrained(model_path, subfolder="text_encoder")]
    if sdxl:
        tokenizers.append(CLIPTokenizer.from_pretrained(model_path, subfolder="tokenizer_2"))
        encoders.append(CLIPTextModelWithProjection.from_pretrained(model_path, subfolder="text_encoder_2"))
    vae = (AutoencoderKL.from_pretrained(vae_path, low_cpu_mem_usage=False) if vae_path else
           AutoencoderKL.from_pretrained(model_path, subfolder="vae", low_cpu_mem_usage=False))
    for encoder in encoders:
        fsdp_utils.prepare_frozen(encoder, te_dtype, device)
    fsdp_utils.prepare_frozen(vae, vae_dtype, device)
    return tokenizers, encoders, vae


def gan_head_size(unet_dir: str, sdxl: bool, features: str = "mid") -> int:
    """The GAN head's native input: the bottleneck side at the native resolution (SD-1.5 8 as the
    official head, SDXL 32), or with features="up" the latent side (SD-1.5 64, SDXL 128)."""
    from diffusers import UNet2DConditionModel
    config = UNet2DConditionModel.load_config(unet_dir)
    if features == "up":
        return max(4, 1 << (config["sample_size"].bit_length() - 1))  # a power of two, as the head's stages halve
    return config["sample_size"] // 2 ** (len(config["block_out_channels"]) - 1) if sdxl else 8


# ----------------------------------------------------------------------------------------------
# latents, target, attention shapes


def latent_layout(resolution: int, vae_config, unet_config) -> tuple[int, tuple[int, int, int]]:
    """(image side, latent shape): RESOLUTION, or 0 = the UNet's native sample_size x the VAE factor."""
    factor = vae_scale_factor(vae_config)
    resolution = resolution or unet_config.sample_size * factor
    if resolution % factor:
        raise ConfigError(f"RESOLUTION={resolution}: must be a multiple of the VAE factor {factor}")
    return resolution, (unet_config.in_channels, resolution // factor, resolution // factor)


def train_alphas(model_path: str, device: torch.device) -> torch.Tensor:
    """The training target's schedule: the teacher scheduler's ᾱ_t (DDPM, ε-prediction), on `device`."""
    from diffusers import DDPMScheduler
    return DDPMScheduler.from_pretrained(model_path, subfolder="scheduler").alphas_cumprod.to(device)



def attention_shapes(model_path: str, resolution: int, batch: int, vae_path: str = "") -> tuple[list, list]:
    """The run's attention calls for the start-up kernel check: at every UNet level with
    cross-attention, its self-attention over the latent grid and its cross-attention to the text
    tokens (trained: forward and backward), and the VAE mid-block's single head at the latent grid
    (forward only). diffusers' UNet reads `attention_head_dim` as the head count when
    `num_attention_heads` is unset (unet_2d_condition.py)."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from diffusers.configuration_utils import FrozenDict
    unet = UNet2DConditionModel.load_config(os.path.join(model_path, "unet"))
    vae = AutoencoderKL.load_config(vae_path or os.path.join(model_path, "vae"))
    with open(os.path.join(model_path, "text_encoder", "config.json")) as f:
        text = json.load(f).get("max_position_embeddings", 77)
    _, (_, side, _) = latent_layout(resolution, FrozenDict(vae), FrozenDict(unet))  # attribute access, as .config
    heads = unet.get("num_attention_heads") or unet["attention_head_dim"]
    trained = []
    for i, (kind, channels) in enumerate(zip(unet["down_block_types"], unet["block_out_channels"])):
        if "CrossAttn" not in kind:
            continue
        h = heads[i] if isinstance(heads, (list, tuple)) else heads
        grid = (side >> i) ** 2
        trained += [attention.Shape(f"UNet level {i} self-attention", batch, grid, grid, h, channels // h),
                    attention.Shape(f"UNet level {i} cross-attention", batch, grid, text, h, channels // h)]
    vae_mid = attention.Shape("VAE mid-block", batch, side * side, side * side, 1, vae["block_out_channels"][-1],
                              backward=False)
    return trained, [vae_mid]


# ----------------------------------------------------------------------------------------------
# conditioning: prompts and real images


@torch.no_grad()
def encode_prompts(tokenizer, text_encoder, prompts: list[str], device: torch.device) -> torch.Tensor:
    """CLIP last_hidden_state (B, L, D) in fp32, padded to the tokenizer's max length as SD does."""
    ids = tokenizer(prompts, padding="max_length", max_length=tokenizer.model_max_length,
                    truncation=True, return_tensors="pt").input_ids
    return text_encoder(to_device(ids, device)).last_hidden_state.float()


@torch.no_grad()
def encode_prompts_sdxl(tokenizers, text_encoders, prompts: list[str], size: int, device: torch.device) -> dm.Cond:
    """SDXL's conditioning as the official code builds it (tianweiy/DMD2 main/sdxl/sdxl_text_encoder.py
    lines 18-40; main/sd_unified_model.py lines 113-120, 251-256): both encoders' penultimate hidden
    states concatenated (B, L, 768 + 1280), the second encoder's projected pooled output as
    `text_embeds`, and `time_ids` = (original size, crop top-left, target size) =
    (size, size, 0, 0, size, size), all fp32."""
    hidden = []
    for tokenizer, encoder in zip(tokenizers, text_encoders):
        ids = tokenizer(prompts, padding="max_length", max_length=tokenizer.model_max_length,
                        truncation=True, return_tensors="pt").input_ids
        out = encoder(to_device(ids, device), output_hidden_states=True)
        hidden.append(out.hidden_states[-2])
    pooled = out[0]  # the last encoder's (CLIPTextModelWithProjection) text_embeds
    time_ids = to_device(torch.tensor([[size, size, 0, 0, size, size]], dtype=torch.float32), device)
    return dm.Cond(torch.cat(hidden, dim=-1).float(),
                   {"text_embeds": pooled.float(), "time_ids": time_ids.repeat(len(prompts), 1)})


def text_encoding(tokenizers, text_encoders, sdxl: bool, size: int, device: torch.device):
    """prompts -> the UNet's conditioning: CLIP embeddings (SD-1.5) or SDXL's dm.Cond."""
    if sdxl:
        return functools.partial(encode_prompts_sdxl, tokenizers, text_encoders, size=size, device=device)
    return functools.partial(encode_prompts, tokenizers[0], text_encoders[0], device=device)


class PromptCache:
    """`encode` with each distinct prompt encoded once, alone, and its embedding kept on the device
    (up to `size` prompts; later ones are encoded alone each time). Alone, so an embedding never
    depends on which prompts shared its batch: the same on any world size and after a resume,
    whatever the cache held. The text encoders then run on a step's new prompts only."""

    def __init__(self, encode, size: int):
        self.encode, self.size, self.store = encode, size, {}

    def one(self, prompt: str):
        hit = self.store.get(prompt)
        if hit is None:
            hit = self.encode([prompt])
            if len(self.store) < self.size:
                self.store[prompt] = hit
        return hit

    def __call__(self, prompts: list[str]):
        return functools.reduce(dm.cat_cond, [self.one(p) for p in prompts])


def unconditional(encode, sdxl: bool):
    """The teacher's CFG unconditional input: SD-1.5 the embedding of "" (official); SDXL zeros for
    both the token and the pooled embeddings, with the same time_ids (official
    main/sd_unified_model.py lines 258-262)."""
    empty = encode([""])
    if not sdxl:
        return empty
    return dm.Cond(torch.zeros_like(empty.text), {"text_embeds": torch.zeros_like(empty.added["text_embeds"]),
                                                  "time_ids": empty.added["time_ids"]})


@torch.no_grad()
def encode_images(vae, pixels: torch.Tensor, generators: list) -> torch.Tensor:
    """VAE latents × scaling_factor of real images (pixels in [-1, 1] on the device), fp32: a
    sample of the posterior, as the official code takes it (tianweiy/DMD2
    main/sdxl/generate_vae_latents.py:86, `latent_dist.sample()`, once, offline; here a fresh sample
    each time an image is drawn), each image's noise from its own generator (per-sample streams:
    exact on resume and on any world size)."""
    posterior = vae.encode(pixels.to(vae.dtype)).latent_dist
    return posterior.sample(generator=generators).float() * vae.config.scaling_factor


# ----------------------------------------------------------------------------------------------
# samples


@torch.no_grad()
def write_samples(model, vae, text, noise, sim_noise, step_list, alphas, path: str) -> None:
    """Every rank runs the sharded generator (the same forwards everywhere); rank 0 decodes and
    writes the grid. Few-step mode runs the whole step list, as inference does."""
    last = len(step_list) - 1
    fresh = [sim_noise[:, i] for i in range(last)]
    z, _ = dm.backward_simulation(model, noise, step_list, last, text, alphas, fresh_noise=fresh)
    latents = dm.generator_forward(model, z, step_list[last], text, alphas)
    fsdp_utils.reshard_all(model)  # no gathered copy left behind until the next grid
    if rank() == 0:
        images = vae.decode((latents / vae.config.scaling_factor).to(vae.dtype)).sample
        save_image_grid(images, path, nrow=4)
