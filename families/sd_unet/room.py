"""The SD UNet family (SD-1.5's StableDiffusionPipeline, SDXL's StableDiffusionXLPipeline): how its
UNet is built and sharded (parallel/parallelize.py by its model facts, parallelism.py), its conditioning (CLIP
text embeddings; SDXL: two encoders and the added time/text conditions), its latent layout and VAE
scaling, its training target (ε-prediction on the DDPM schedule's alphas) and its samples; for
train_dmd.py's UNet setup also DMD2's refusals, the teacher's CFG, the models in their roles, the
prompt rows and real images, and the micro-batches on the device.

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
from data.batches import rank_micro_batches
from data.images import load_image, save_image_grid
from data.prefetch import to_device
from data.randomness import (POSTERIOR_STREAM, SAMPLE_NOISE_STREAM, drop_captions, per_sample_draws, sample_generator,
                             step_generator)
from data.sources import read_rows, source_kind
from families.pipelines import vae_scale_factor
from families.sd_unet.parallelism import UNET
from parallel import attention, lowbit
from parallel import ema as ema_lib
from parallel import lora as lora_lib
from parallel.loading import build_on_meta, fill_built_model
from parallel.parallelize import parallelize

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
    sharded by its units (parallelism.py), then each rank reads only its slices from `weights` (a UNet folder or
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
        lora_lib.add_lora(model, lora, UNET)
        if base_dtype == "nf4":
            lowbit.quantize_base(model, mesh.size() if mesh is not None else 1)
    if not load or not trainable:
        model.requires_grad_(False)
    if not trainable:
        model.eval()
        sharding = fsdp_utils.Sharding(compile=sharding.compile, frozen=True)
    parallelize(model, mesh, policy, sharding, block_classes, facts=UNET)
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
    latents = generator_latents(model, text, noise, sim_noise, step_list, alphas)
    fsdp_utils.reshard_all(model)  # no gathered copy left behind until the next grid
    if rank() == 0:
        save_image_grid(decode(vae, latents), path, nrow=4)


def generator_latents(model, text, noise, sim_noise, step_list, alphas) -> torch.Tensor:
    """The generator's sample latents over the whole step list, as inference runs it (every rank)."""
    last = len(step_list) - 1
    fresh = [sim_noise[:, i] for i in range(last)]
    z, _ = dm.backward_simulation(model, noise, step_list, last, text, alphas, fresh_noise=fresh)
    return dm.generator_forward(model, z, step_list[last], text, alphas)


def decode(vae, latents: torch.Tensor) -> torch.Tensor:
    """Latents -> images in about [-1, 1], as the pipelines decode them."""
    return vae.decode((latents / vae.config.scaling_factor).to(vae.dtype)).sample


# ----------------------------------------------------------------------------------------------
# DMD2 (train_dmd.py's UNet setup): its refusals, the teacher's CFG, the models in their roles, prompt
# rows and real images, micro-batches on the device, fixed sample inputs


_EDIT_SETTINGS = ("CONTROL_PATH", "MAX_REFERENCES", "BUCKET_ASPECTS", "REFERENCE_AREA", "CONDITION_AREA",
                  "CONTROL_COLUMN", "TARGET_COLUMN")  # the editing teachers' rows' settings: refused when given
_REAL_ORDER_SALT = 7_919  # REAL_DATA_PATH's epochs are permuted from SEED + this, apart from the prompts' order


def check_dmd_settings(settings: dict, changed: set) -> None:
    """What a UNet teacher does not take, refused in one line before any work (`changed`: the settings
    given a value other than the script's default)."""
    refused = [
        (f"FAKE_SCORE_TARGET={settings['FAKE_SCORE_TARGET']}", settings["FAKE_SCORE_TARGET"] != "flow",
         "its fake score trains on the noise, as published; the setting is for flow-matching teachers"),
        (f"REGRESSION_WEIGHT={settings['REGRESSION_WEIGHT']}", settings["REGRESSION_WEIGHT"] > 0,
         "the regression loss is built for flow-matching teachers (FLUX, Qwen-Image-Edit) only"),
        (f"DIVERSITY_WEIGHT={settings['DIVERSITY_WEIGHT']}", settings["DIVERSITY_WEIGHT"] > 0,
         "the first step's ODE target is built for flow-matching teachers only"),
        (f"STUDENT_SAMPLE_TYPE={settings['STUDENT_SAMPLE_TYPE']}", settings["STUDENT_SAMPLE_TYPE"] != "sde",
         "its few-step generator re-noises between steps, as published (the official sample_backward); the "
         "ODE step is built for flow-matching teachers"),
        (f"SHIFT={settings['SHIFT']}", settings["SHIFT"] != "1", "its timesteps are drawn uniformly over the DDPM "
         "range, as published; the σ shift is for flow-matching teachers"),
        ("TEACHER_LORA", settings["TEACHER_LORA"], "a flow teacher's setting; give a UNet fine-tune as its full "
         "folder (MODEL_PATH, or GENERATOR_INIT for the generator alone)"),
        (f"FP8={settings['FP8']}", settings["FP8"], "float8 training is built for the transformer rooms' blocks"),
        *[(name, name in changed, "a setting of the editing teachers' rows") for name in _EDIT_SETTINGS],
    ]
    for name, bad, why in refused:
        if bad:
            raise ConfigError(f"{name} with a UNet teacher: {why}")


def dmd_guidance(settings: dict) -> dm.Guidance:
    """The teacher's CFG against the empty prompt (unconditional): REAL_GUIDANCE_SCALE 0 is the published
    SD-1.5 value, REAL_GUIDANCE_NORM "" the published plain combination."""
    return dm.Guidance(settings["REAL_GUIDANCE_SCALE"] or 1.75, settings["REAL_GUIDANCE_NORM"] or "none")


def build_dmd_models(unet_dir: str, mesh, precision, device: torch.device, *, sharding: fsdp_utils.Sharding,
                     block_classes: list[str], ema_decay: float, seed: int, gan_head=None, head_features: str = "mid",
                     lora: lora_lib.Lora = lora_lib.Lora(), fake_lora: bool = False,
                     fake_compute: torch.dtype | None = None, fake_attention: torch.dtype | None = None,
                     channels_last: bool = False, generator_init: str = "", base_dtype: str = "") -> dict:
    """The trained models, all from the same teacher folder (the generator's weights from
    `generator_init` when given: GENERATOR_INIT): generator and fake score (sharded, loaded slice
    by slice; with `lora` the generator, and with `fake_lora` the fake score too, train LoRA
    adapters on a frozen base), the generator's EMA (sharded identically, so its update is
    shard-local; LoRA: of the adapters only) and the GAN head (`gan_head(channels)`, the script's
    build, for features of the bottleneck, or with head_features="up" of the up path). These are what
    checkpoints hold (of a LoRA model, the adapters).
    `fake_compute`: the fake score's compute dtype where it differs from the precision mode's
    (FAKE_SCORE_FP32): its units all-gather and compute in it, the storage is unchanged (under DDP,
    where nothing is gathered, a compute dtype wider than the storage becomes the storage: the fp32
    fake score of PRECISION=bf16 is stored, and keeps its AdamW state, in fp32). `fake_attention`:
    the fake score's attention products in this dtype where it differs from its compute dtype
    (FAKE_SCORE_ATTENTION_DTYPE); `channels_last`: every UNet's convolutions in NHWC (CHANNELS_LAST).
    `base_dtype`: the LoRA models' frozen base storage (BASE_DTYPE; the frozen teacher is not quantised)."""
    def make(adapters: lora_lib.Lora = lora_lib.Lora(), salt: int = 0, compute: torch.dtype | None = None,
             shard: fsdp_utils.Sharding = sharding, **kw):
        storage = precision.compute_dtype if adapters else precision.param_dtype  # LoRA: the base as computed
        if mesh is None and compute is not None and compute.itemsize > storage.itemsize:
            storage = compute  # a DDP replica computes in its storage dtype: no all-gather to widen it in
        policy = precision.adapter_mp_policy(compute) if adapters else precision.mp_policy(compute)
        return build_unet(unet_dir, mesh, storage, device, policy=policy, trainable=True, sharding=shard,
                          block_classes=block_classes, lora=adapters, seed=seed + salt,
                          base_dtype=base_dtype if adapters else "", channels_last=channels_last, **kw)
    attention = fake_attention if fake_attention != (fake_compute or precision.compute_dtype) else None
    models = {"generator": make(lora, weights=generator_init),
              "fake": make(lora if fake_lora else lora_lib.Lora(), salt=1, compute=fake_compute,
                           attention_dtype=attention)}
    if gan_head is not None:
        models["head"] = gan_head(models["fake"].config.block_out_channels[0 if head_features == "up" else -1])
    ema = ema_lib.build_ema(models["generator"], ema_decay,
                            functools.partial(make, load=False, shard=sharding.never_backward()))
    return models if ema is None else {**models, "ema": ema}


def load_dmd_rows(path: str, use_gan: bool, skip_bad: bool, *, real_path: str = "", columns: dict | None = None,
                  split: str = "train") -> tuple[list[dict], int, list[dict] | None]:
    """(prompt rows {"prompt"[, "image"]}, bad rows skipped, real rows {"image"[, "prompt"]} or
    None) from any kind of source (data.sources.read_rows: .txt, .jsonl, folder, datasets). The GAN's
    real images come from `real_path` when given (with their own captions, "" where none), else
    from the prompt rows' "image". A bad row is a ConfigError naming file:line (or the file /
    dataset row), the same on every rank."""
    own_images = use_gan and not real_path
    if own_images and source_kind(path) == "txt":
        raise ConfigError(f"USE_GAN needs real images: DATA_PATH={path!r} holds prompts only; give rows with "
                          "\"image\" (.jsonl, folder, datasets) or REAL_DATA_PATH")
    roles = ("prompt", "image") if own_images else ("prompt",)
    rows, skipped = read_rows(path, roles, roles, skip_bad=skip_bad, columns=columns, split=split)
    if not (use_gan and real_path):
        return rows, skipped, None
    real, real_skipped = read_rows(real_path, ("image", "prompt"), ("image",), skip_bad=skip_bad,
                                   setting="REAL_DATA_PATH", columns=columns, split=split)
    return rows, skipped + real_skipped, real


def load_dmd_step(it: int, rows: list[dict], batch_size: int, grad_accum: int, seed: int, d: fsdp_utils.Dist,
                  real_size: int | None, real_rows: list[dict] | None = None,
                  caption_dropout: float = 0.0) -> list[dict]:
    """Host side of iteration `it` on this rank (data.prefetch.Prefetcher runs it a step ahead): per
    micro-batch, this rank's samples' positions in the global batch, their prompts ("" where
    CAPTION_DROPOUT drops one) and (GAN, real_size given) the real images as pixels, on CPU: the
    prompt rows' own, or with `real_rows` (REAL_DATA_PATH) images drawn in their own seeded order
    with their own captions, as the official code draws real images apart from the prompts."""
    shares = rank_micro_batches(it, len(rows), batch_size, grad_accum, d.rank, d.world_size, seed)
    real_shares = shares
    if real_rows is not None:  # the same positions, drawn from the real rows' own order
        real_shares = rank_micro_batches(it, len(real_rows), batch_size, grad_accum, d.rank, d.world_size,
                                         seed + _REAL_ORDER_SALT)
    out = []
    for (mine, picked), (_, real_picked) in zip(shares, real_shares):
        prompts = drop_captions([rows[i]["prompt"] for i in picked], seed, it, mine, caption_dropout)
        mb = {"mine": mine, "prompts": prompts}
        if real_size is not None:
            source = rows if real_rows is None else real_rows
            mb["pixels"] = torch.stack([load_image(source[i]["image"], real_size, real_size) for i in real_picked])
            if real_rows is not None:
                mb["real_prompts"] = [real_rows[i].get("prompt", "") for i in real_picked]
        out.append(mb)
    return out


def dmd_micro_batches(it: int, loaded: list[dict], seed: int, device: torch.device, draw, encode,
                      vae) -> list[dict]:
    """This rank's share of each micro-batch of iteration `it` on the device: prompts' embeddings,
    real latents (GAN) and its samples' randomness, each sample's drawn on the run's device from
    (seed, it, its position in the global batch) by `draw` (dmd2_unet.draw_sample_noise), so no rank draws
    another's and any world size or GRAD_ACCUM layout sees the same numbers."""
    out = []
    for host in loaded:
        mb = per_sample_draws(seed, it, host["mine"], device, draw)
        mb["text"] = encode(host["prompts"])
        if "real_prompts" in host:  # REAL_DATA_PATH: the real images' own captions (else their rows' prompts)
            mb["real_text"] = encode(host["real_prompts"])
        if "pixels" in host:  # the posterior sample's noise: a second stream of the same samples
            gens = [sample_generator(seed, it, i, device, POSTERIOR_STREAM) for i in host["mine"]]
            mb["real"] = encode_images(vae, host["pixels"], gens)
        out.append(mb)
    return out


def dmd_sample_inputs(rows: list[dict], count: int, shape: tuple, n_sim: int, seed: int):
    """Fixed sample prompts (the first distinct ones of `rows`: SAMPLE_PROMPTS' or the data's) and
    fixed noise, the same every time."""
    prompts = list(dict.fromkeys(r["prompt"] for r in rows))[:count]
    g = step_generator(seed, 0, stream=SAMPLE_NOISE_STREAM)
    return (prompts, torch.randn((len(prompts), *shape), generator=g),
            torch.randn((len(prompts), n_sim, *shape), generator=g))
