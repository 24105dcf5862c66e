"""DMD2 distillation of an SD-1.5-family UNet into a 1-step (or few-step) generator, on FSDP2.

DMD2 = Yin et al. 2024, "Improved Distribution Matching Distillation for Fast Image Synthesis".
Three UNets start from the same teacher weights: the generator G (trained), the frozen teacher
("real score") and the fake score (trained to follow G's output distribution). Each is sharded
with `fully_shard` per BasicTransformerBlock / ResnetBlock2D and loaded straight into its shards.
Per step (two time scales, as published):
  - every DFAKE_GEN_UPDATE_RATIO steps, G steps on the distribution-matching loss `loss_dm`
    (+ GEN_CLS_LOSS_WEIGHT · `loss_gen_cls` with the GAN head)
  - every step, the fake score (+ GAN head) steps on its denoising loss `loss_fake` of the same
    pre-update G images (+ GUIDANCE_CLS_LOSS_WEIGHT · `loss_guidance_cls`)
The math lives in dmd_math.py; this file builds the models, runs the loop, saves and exports.

    # 2 ranks (GPUs, or CPU with gloo); embedded default (the shipped shapes teacher), a smoke run; demo_dmd.sh distils it for real
    torchrun --standalone --nproc_per_node=2 train_dmd.py
    # one process, for debugging (the same global batch as 2 ranks × BATCH_SIZE 2)
    python train_dmd.py --batch_size=4 --max_steps=20
    # real weights (SD-1.5 layout folder) and a prompts file, 8 GPUs, stage 1 as published
    torchrun --standalone --nproc_per_node=8 train_dmd.py --model_path=/models/stable-diffusion-v1-5 \
        --data_path=/data/prompts.txt --output_dir=out/sd15_stage1 --max_steps=40000 --batch_size=32 \
        --activation_checkpointing=1 --warmup_steps=500 --save_every=1000 --sample_every=500
    # stage 2 (GAN) on {"prompt", "image"} rows, generator and fake score from stage 1 (the teacher
    # stays the original model); new optimizers and LRs, as published
    torchrun --standalone --nproc_per_node=8 train_dmd.py --model_path=/models/stable-diffusion-v1-5 \
        --data_path=/data/laion.jsonl --output_dir=out/sd15_stage2 --max_steps=2000 --batch_size=32 \
        --init_from=out/sd15_stage1/checkpoints/step_040000 --use_gan=1 --generator_lr=5e-7 \
        --guidance_lr=5e-7 --activation_checkpointing=1
    # after a stop or preemption: the same command plus --resume=auto

1-step inference with the export (LCMScheduler's last step returns its x0 prediction):
    pipe = StableDiffusionPipeline.from_pretrained("out/dmd/export", torch_dtype=torch.float32)
    pipe.scheduler = LCMScheduler.from_config(pipe.scheduler.config)
    image = pipe(prompt, num_inference_steps=1, guidance_scale=0, timesteps=[999]).images[0]
"""
from __future__ import annotations

import functools
import os
import sys

import torch
import torch.nn as nn

import checkpoint
from algorithms import dmd2 as dm
import fsdp_utils
import data_utils
import run_utils
from run_utils import ConfigError, print0
from precision import Precision, component_row, format_audit, get_precision, parse_dtype

# ----------------------------------------------------------------------------------------------
# config (every UPPER_CASE constant can be overridden as --name=value)

# models and data
MODEL_PATH = ""  # SD-1.5-layout diffusers folder (unet/ vae/ text_encoder/ tokenizer/ scheduler/); "" = the shipped shapes teacher
DATA_PATH = ""  # .txt (a prompt per line) or .jsonl ("prompt", "image" for the GAN); "" = the teacher's prompts (or images)
OUTPUT_DIR = "out/dmd"  # metrics.jsonl, samples/, checkpoints/, export/
RESOLUTION = 0  # image side in px; 0 = unet sample_size × VAE factor (512 for SD-1.5, 32 for the shapes teacher)
SKIP_BAD_SAMPLES = False  # drop (and count) malformed data rows instead of stopping with file:line
# schedule (published: 39k steps, batch 32×64 GPUs); demo_dmd.sh sets the shapes-teacher demo's values
MAX_STEPS = 100  # training steps (a fake-score update each, a generator update every DFAKE_GEN_UPDATE_RATIO)
BATCH_SIZE = 2  # samples per rank per micro-batch (published SD-1.5: 32)
GRAD_ACCUM = 1  # micro-batches per optimizer step; global batch = BATCH_SIZE × world × GRAD_ACCUM
SEED = 0  # data order, noise, timesteps: all drawn from (SEED, step), identical on every rank
# DMD2, published SD-1.5 values (paper and the official code's SD-1.5 settings)
REAL_GUIDANCE_SCALE = 1.75  # teacher CFG scale inside the distribution-matching loss
DFAKE_GEN_UPDATE_RATIO = 10  # generator steps when step % ratio == 0 (step counted from 0)
CONDITIONING_TIMESTEP = 999  # 1-step generator: pure noise in, this timestep, x0 out
DENOISING_STEPS = []  # few-step generator timesteps, e.g. [999,749,499,249]; [] = 1-step
MIN_STEP_PERCENT = 0.02  # DM-loss timesteps t ~ U[MIN, MAX] × the train timesteps (official: 2 %...
MAX_STEP_PERCENT = 0.98  # ... to 98 %, so neither nearly clean nor pure-noise inputs)
GENERATOR_LR = 1e-5  # AdamW (0.9, 0.999), weight decay 0.01, for the generator
GUIDANCE_LR = 1e-5  # the same for the fake score (+ GAN head)
WARMUP_STEPS = 0  # linear LR warmup, counted in each optimizer's own steps (official flag default 500)
MAX_GRAD_NORM = 10.0  # gradient clipping of each model (0 = off)
EMA_DECAY = 0.0  # > 0: keep an EMA of the generator (updated per generator step), exported instead of it
# GAN stage (the paper's stage 2; off = stage 1 as published)
USE_GAN = False  # classifier head on the fake UNet's bottleneck; needs .jsonl rows with "image"
GEN_CLS_LOSS_WEIGHT = 1e-3  # generator GAN loss weight (published stage 2)
GUIDANCE_CLS_LOSS_WEIGHT = 1e-2  # discriminator loss weight (published stage 2)
DIFFUSION_GAN = True  # noise real and fake inputs of the head to t < DIFFUSION_GAN_MAX_TIMESTEP first
DIFFUSION_GAN_MAX_TIMESTEP = 1000  # published stage 2: the whole range
# precision: bf16 autocast as published; frozen parts are stored in their compute dtype
PRECISION = "bf16-mixed"  # fp32 | bf16-mixed (fp32 master weights, bf16 compute) | bf16
TEACHER_DTYPE = ""  # storage = compute dtype of the frozen teacher; "" = PRECISION's compute dtype
TEXT_ENCODER_DTYPE = ""  # "" = PRECISION's compute dtype (the official code keeps CLIP in fp32)
VAE_DTYPE = ""  # "" = PRECISION's compute dtype (the official code uses fp16 for SD-1.5's VAE)
EXPORT_DTYPE = "fp32"  # dtype of the exported UNet (fp16 halves the file)
# parallelism
PARALLELISM = "fsdp"  # fsdp (sharded, FSDP2) | ddp (full replica per rank, DistributedDataParallel; no GAN head)
BLOCK_CLASSES = ["BasicTransformerBlock", "ResnetBlock2D"]  # one fully_shard unit per block (as in DMD2's FSDP config)
DP_REPLICATE = 1  # > 1: HSDP, shard within groups of WORLD_SIZE / DP_REPLICATE ranks, replicate across
RESHARD_AFTER_FORWARD = True  # free gathered params after each block's forward (ZeRO-3); False = ZeRO-2-like
CPU_OFFLOAD = False  # keep trainable params, grads and optimizer state on the CPU
ACTIVATION_CHECKPOINTING = False  # recompute blocks in backward (the published run used it on GPUs)
PREFETCH = 0  # > 0: explicitly prefetch this many blocks ahead in forward and backward
# fault tolerance
MAX_BAD_STEPS = 10  # non-finite loss/grad steps are skipped (on all ranks); this many in a row: save and stop
COLLECTIVE_TIMEOUT_S = 1800  # a collective waiting longer fails the run (a stuck rank); > the slowest save
# checkpoints, logging, samples
SAVE_EVERY = 50  # steps between checkpoints (a final one is always written at MAX_STEPS)
KEEP_LAST = 2  # complete checkpoints kept
ASYNC_SAVE = False  # write checkpoints in the background while training goes on
RESUME = ""  # "" = fresh start, "auto" = newest checkpoint in OUTPUT_DIR (or fresh), or a checkpoint path
INIT_FROM = ""  # a checkpoint folder whose generator and fake score start a fresh run (stage 2 from stage 1)
LOG_EVERY = 10  # steps between log lines / metrics.jsonl records
SAMPLE_EVERY = 25  # steps between sample grids (0 = only at the end)
SAMPLE_COUNT = 8  # fixed prompts (the data's first distinct ones) and seeds in every grid
EVAL_AT_END = True  # score the export on the shapes task (shapes_eval.py) when the data is its prompts

# ----------------------------------------------------------------------------------------------
# helpers: config validation

def validate_config(world: int) -> list[int]:
    """Reject bad or contradictory settings before any work. Returns the generator's step list."""
    for name, value, low in [("MAX_STEPS", MAX_STEPS, 1), ("BATCH_SIZE", BATCH_SIZE, 1),
                             ("GRAD_ACCUM", GRAD_ACCUM, 1), ("DFAKE_GEN_UPDATE_RATIO", DFAKE_GEN_UPDATE_RATIO, 1),
                             ("LOG_EVERY", LOG_EVERY, 1), ("SAVE_EVERY", SAVE_EVERY, 0),
                             ("SAMPLE_EVERY", SAMPLE_EVERY, 0), ("SAMPLE_COUNT", SAMPLE_COUNT, 1),
                             ("WARMUP_STEPS", WARMUP_STEPS, 0), ("RESOLUTION", RESOLUTION, 0),
                             ("MAX_BAD_STEPS", MAX_BAD_STEPS, 1), ("COLLECTIVE_TIMEOUT_S", COLLECTIVE_TIMEOUT_S, 1)]:
        if value < low:
            raise ConfigError(f"{name}={value}: must be >= {low}")
    fsdp_utils.check_dp_replicate(DP_REPLICATE, world)
    fsdp_utils.check_parallelism(PARALLELISM, CPU_OFFLOAD, DP_REPLICATE)
    if PARALLELISM == "ddp" and USE_GAN:
        raise ConfigError("PARALLELISM=ddp with USE_GAN=1: the GAN head runs the fake UNet several times per "
                          "backward, which DistributedDataParallel does not support; use fsdp")
    try:
        get_precision(PRECISION)
        for dtype in (TEACHER_DTYPE, TEXT_ENCODER_DTYPE, VAE_DTYPE, EXPORT_DTYPE):
            if dtype:
                parse_dtype(dtype)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not 0 <= EMA_DECAY < 1:
        raise ConfigError(f"EMA_DECAY={EMA_DECAY}: must be in [0, 1)")
    if not 0 <= MIN_STEP_PERCENT < MAX_STEP_PERCENT <= 1:
        raise ConfigError(f"MIN_STEP_PERCENT={MIN_STEP_PERCENT}, MAX_STEP_PERCENT={MAX_STEP_PERCENT}: need 0 <= min < max <= 1")
    if USE_GAN and DIFFUSION_GAN and DIFFUSION_GAN_MAX_TIMESTEP < 1:
        raise ConfigError(f"DIFFUSION_GAN_MAX_TIMESTEP={DIFFUSION_GAN_MAX_TIMESTEP}: must be >= 1")
    if INIT_FROM and not checkpoint.is_complete(INIT_FROM):
        raise ConfigError(f"INIT_FROM={INIT_FROM}: not a complete checkpoint folder")
    if MODEL_PATH and not DATA_PATH:
        raise ConfigError("MODEL_PATH is set but DATA_PATH is empty: give the prompts (.txt) or rows (.jsonl) to train on")
    try:
        steps = [int(t) for t in DENOISING_STEPS]
    except ValueError:
        raise ConfigError(f"DENOISING_STEPS={DENOISING_STEPS}: expected integers like [999,749,499,249]") from None
    if not 0 <= CONDITIONING_TIMESTEP < 1000:
        raise ConfigError(f"CONDITIONING_TIMESTEP={CONDITIONING_TIMESTEP}: must be in [0, 999]")
    if not steps:
        return [CONDITIONING_TIMESTEP]
    if steps != sorted(set(steps), reverse=True) or steps[0] >= 1000 or steps[-1] < 1:
        raise ConfigError(f"DENOISING_STEPS={steps}: must be strictly decreasing timesteps in [1, 999]")
    if steps[0] != CONDITIONING_TIMESTEP:
        raise ConfigError(f"DENOISING_STEPS starts at {steps[0]} but CONDITIONING_TIMESTEP={CONDITIONING_TIMESTEP}: "
                          "the first step must be the conditioning timestep (pure noise in)")
    return steps


# ----------------------------------------------------------------------------------------------
# helpers: model building

def build_unet(folder: str, mesh, dtype: torch.dtype, device: torch.device, *, trainable: bool,
               precision=None, cpu_offload: bool = False, load: bool = True) -> nn.Module:
    """A UNet2DConditionModel built on the meta device, sharded per block, then each rank reads
    only its slices from `folder` (load=False: allocated, unfilled and without grads, for the EMA).
    Trainable: mixed precision, checkpointing, offload, prefetch settings. Frozen: no grads ever,
    stored in `dtype` = its compute dtype. mesh=None (PARALLELISM=ddp): not sharded, every rank
    loads the whole model (the caller wraps a trainable one in DDP)."""
    from diffusers import UNet2DConditionModel

    model = fsdp_utils.build_on_meta(UNet2DConditionModel, folder).to(dtype)
    if not load or not trainable:
        model.requires_grad_(False)
    if not trainable:
        model.eval()
    if mesh is not None and trainable:
        fsdp_utils.apply_fsdp(model, mesh, precision.mp_policy(), block_classes=BLOCK_CLASSES,
                              reshard_after_forward=RESHARD_AFTER_FORWARD, cpu_offload=cpu_offload,
                              activation_checkpointing=ACTIVATION_CHECKPOINTING, prefetch=PREFETCH)
    elif mesh is not None:
        fsdp_utils.prepare_frozen(model, mesh, Precision.frozen_mp_policy(dtype), device, sharded=True, block_classes=BLOCK_CLASSES)
    return fsdp_utils.fill_built_model(model, folder, mesh, torch.device("cpu") if cpu_offload else device, load)


def build_models(unet_dir: str, mesh, precision, device: torch.device) -> dict[str, nn.Module]:
    """The trained models, all from the same teacher folder: generator and fake score (sharded,
    loaded slice by slice), the generator's EMA (sharded identically, so its update is shard-local)
    and the GAN head. These are what checkpoints hold."""
    trainable = dict(trainable=True, precision=precision, cpu_offload=CPU_OFFLOAD)
    models = {"generator": build_unet(unet_dir, mesh, precision.param_dtype, device, **trainable),
              "fake": build_unet(unet_dir, mesh, precision.param_dtype, device, **trainable)}
    if USE_GAN:
        models["head"] = build_gan_head(models["fake"].config.block_out_channels[-1], mesh, precision, device, SEED)
    if EMA_DECAY > 0:
        models["ema"] = build_unet(unet_dir, mesh, precision.param_dtype, device, load=False, **trainable)
        fsdp_utils.copy_params(models["ema"], models["generator"])
    return models


def build_gan_head(channels: int, mesh, precision, device: torch.device, seed: int) -> nn.Module:
    """The classifier head (dmd_math.ClassifierHead), randomly initialised from `seed` (the same
    full tensors on every rank, whatever the world size), then sharded as one FSDP unit."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = dm.ClassifierHead(channels)
    head.to(device=torch.device("cpu") if CPU_OFFLOAD else device, dtype=precision.param_dtype)
    fsdp_utils.apply_fsdp(head, mesh, precision.mp_policy(), block_classes=[], cpu_offload=CPU_OFFLOAD)
    return head


def load_frozen_parts(model_path: str, te_dtype: torch.dtype, vae_dtype: torch.dtype, device: torch.device):
    """Tokenizer, CLIP text encoder and VAE: small, frozen, replicated on every rank."""
    from diffusers import AutoencoderKL
    from transformers import CLIPTextModel, CLIPTokenizer

    tokenizer = CLIPTokenizer.from_pretrained(model_path, subfolder="tokenizer")
    text_encoder = CLIPTextModel.from_pretrained(model_path, subfolder="text_encoder")
    vae = AutoencoderKL.from_pretrained(model_path, subfolder="vae", low_cpu_mem_usage=False)
    fsdp_utils.prepare_frozen(text_encoder, None, Precision.frozen_mp_policy(te_dtype), device, sharded=False)
    fsdp_utils.prepare_frozen(vae, None, Precision.frozen_mp_policy(vae_dtype), device, sharded=False)
    return tokenizer, text_encoder, vae


def quiet_empty_fp32_warning() -> None:
    """diffusers 0.42 warns "modules ... should be kept in float32: []" on every `.to(dtype)` even
    when there are none (UNet, VAE): drop exactly that message, keep every other warning."""
    import logging
    logging.getLogger("diffusers.models.modeling_utils").addFilter(
        lambda record: "should be kept in float32: []" not in record.getMessage())


def make_optimizer(module: nn.Module, lr: float):
    """AdamW as published (betas 0.9/0.999, weight decay 0.01) with a constant LR after warmup."""
    opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=lr,
                            betas=(0.9, 0.999), weight_decay=0.01)
    return opt, run_utils.warmup_scheduler(opt, WARMUP_STEPS)


# ----------------------------------------------------------------------------------------------
# helpers: data and per-step randomness

def load_data(path: str, use_gan: bool, skip_bad: bool) -> tuple[list[dict], int]:
    """Rows {"prompt"[, "image"]}; a bad row is a ConfigError naming file:line (same on every rank)."""
    if use_gan and not path.endswith(".jsonl"):
        raise ConfigError(f"USE_GAN needs real images: DATA_PATH={path!r} must be a .jsonl with \"image\" fields")
    keys = ("prompt", "image") if use_gan else ("prompt",)
    return data_utils.load_records(path, required=keys, image_keys=keys[1:], skip_bad=skip_bad)


@torch.no_grad()
def encode_prompts(tokenizer, text_encoder, prompts: list[str], device: torch.device) -> torch.Tensor:
    """CLIP last_hidden_state (B, L, D) in fp32, padded to the tokenizer's max length as SD does."""
    ids = tokenizer(prompts, padding="max_length", max_length=tokenizer.model_max_length,
                    truncation=True, return_tensors="pt").input_ids.to(device)
    return text_encoder(ids).last_hidden_state.float()


def load_image(path: str, size: int) -> torch.Tensor:
    """(3, size, size) in [-1, 1]: shorter side resized to `size`, centre crop."""
    import numpy as np
    from PIL import Image

    with Image.open(path) as im:
        im = im.convert("RGB")
        scale = size / min(im.size)
        im = im.resize((max(size, round(im.width * scale)), max(size, round(im.height * scale))), Image.BICUBIC)
        left, top = (im.width - size) // 2, (im.height - size) // 2
        im = im.crop((left, top, left + size, top + size))
        arr = torch.from_numpy(np.asarray(im).copy())
    return arr.permute(2, 0, 1).float() / 127.5 - 1.0


@torch.no_grad()
def encode_images(vae, paths: list[str], size: int, device: torch.device) -> torch.Tensor:
    """VAE latents × scaling_factor (posterior mean: deterministic) of real images, fp32."""
    pixels = torch.stack([load_image(p, size) for p in paths]).to(device, vae.dtype)
    return vae.encode(pixels).latent_dist.mode().float() * vae.config.scaling_factor


def draw_step_noise(seed: int, step: int, batch: int, shape: tuple, n_sim: int, use_gan: bool,
                    gan_max_t: int, num_train_timesteps: int) -> dict[str, torch.Tensor]:
    """All randomness of one step, drawn on CPU for the whole global batch (every micro-batch,
    every rank) in a fixed order, so it is independent of world size and GRAD_ACCUM layout."""
    g = data_utils.step_generator(seed, step)
    T = num_train_timesteps
    r = {"noise": torch.randn((batch, *shape), generator=g),
         "dm_t": dm.sample_dm_timesteps(batch, g, T, MIN_STEP_PERCENT, MAX_STEP_PERCENT),
         "dm_noise": torch.randn((batch, *shape), generator=g),
         "fake_t": dm.sample_fake_timesteps(batch, g, T),
         "fake_noise": torch.randn((batch, *shape), generator=g),
         "sim_noise": torch.randn((batch, n_sim, *shape), generator=g)}
    if use_gan:  # three independent head inputs: G's turn on fake, guidance turn on fake and real
        for name in ("gan_gen", "gan_fake", "gan_real"):
            r[name + "_t"] = torch.randint(0, gan_max_t, (batch,), generator=g)
            r[name + "_noise"] = torch.randn((batch, *shape), generator=g)
    return r


def micro_batches(step: int, rows: list[dict], noise: dict, world: int, rank: int, device: torch.device,
                  encode, encode_real) -> list[dict]:
    """This rank's share of each micro-batch of `step`: prompts' embeddings, real latents (GAN)
    and the matching slices of the step's noise. Chunk m of size BATCH_SIZE×world is micro-batch m."""
    chunk = BATCH_SIZE * world
    indices = data_utils.global_batch_indices(step, chunk * GRAD_ACCUM, len(rows), SEED)
    out = []
    for m in range(GRAD_ACCUM):
        mine = data_utils.rank_slice(indices[m * chunk:(m + 1) * chunk], rank, world)
        mb = {k: data_utils.rank_slice(v[m * chunk:(m + 1) * chunk], rank, world).to(device)
              for k, v in noise.items()}
        mb["text"] = encode([rows[i]["prompt"] for i in mine])
        if encode_real is not None:
            mb["real"] = encode_real([rows[i]["image"] for i in mine])
        out.append(mb)
    return out


# ----------------------------------------------------------------------------------------------
# helpers: the step

def generator_images(generator, mb: dict, step_list: list[int], index: int, alphas) -> torch.Tensor:
    """G's image latents for this micro-batch: 1-step from pure noise, or (few-step mode) from the
    input of step_list[index] built by backward simulation. Gradients as the caller's mode."""
    z = mb["noise"]
    if index > 0:
        fresh = [mb["sim_noise"][:, i] for i in range(index)]
        z, _ = dm.backward_simulation(generator, z, step_list, index, mb["text"], alphas, fresh_noise=fresh)
    return dm.generator_forward(generator, z, step_list[index], mb["text"], alphas)


def head_input(x: torch.Tensor, mb: dict, name: str, alphas) -> tuple[torch.Tensor, torch.Tensor]:
    """Input of the GAN head's UNet pass: clean x at t = 0, or (diffusion GAN) x noised to t."""
    if not DIFFUSION_GAN:
        return x, torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
    t = mb[name + "_t"]
    return dm.add_noise(x, mb[name + "_noise"], t, alphas, out_dtype=torch.float32), t


def generator_loss(x, mb, uncond, teacher, fake, head, alphas) -> tuple[torch.Tensor, dict]:
    """loss_dm (+ GEN_CLS_LOSS_WEIGHT · loss_gen_cls): the generator's objective on images x."""
    grad, _ = dm.dm_grad(x, mb["dm_t"], mb["dm_noise"], teacher, fake, mb["text"], uncond,
                         REAL_GUIDANCE_SCALE, alphas)
    loss_dm = dm.dm_loss(x, grad)
    logs = {"loss_dm": loss_dm.item()}
    if head is None:
        return loss_dm, logs
    loss_cls = dm.gen_cls_loss(dm.cls_logits(fake, head, *head_input(x, mb, "gan_gen", alphas), mb["text"]))
    logs["loss_gen_cls"] = loss_cls.item()
    return loss_dm + GEN_CLS_LOSS_WEIGHT * loss_cls, logs


def guidance_loss(x, mb, fake, head, alphas) -> tuple[torch.Tensor, dict]:
    """loss_fake (+ GUIDANCE_CLS_LOSS_WEIGHT · loss_guidance_cls) on detached generator images."""
    x = x.detach()
    loss_fake = dm.fake_score_loss(fake, x, mb["fake_noise"], mb["fake_t"], mb["text"], alphas)
    logs = {"loss_fake": loss_fake.item()}
    if head is None:
        return loss_fake, logs
    logits_fake = dm.cls_logits(fake, head, *head_input(x, mb, "gan_fake", alphas), mb["text"])
    logits_real = dm.cls_logits(fake, head, *head_input(mb["real"], mb, "gan_real", alphas), mb["text"])
    loss_cls = dm.guidance_cls_loss(logits_fake, logits_real)
    logs["loss_guidance_cls"] = loss_cls.item()
    return loss_fake + GUIDANCE_CLS_LOSS_WEIGHT * loss_cls, logs


def finish_updates(updates: list, guard, logs: dict) -> bool:
    """The step's optimizer updates, [(params, optimizer, scheduler, name)]: clip each (the norm over
    all shards), then, only when every loss and norm is finite on every rank (one collective),
    step them all. Grads are zeroed and LR schedules advance either way. Returns whether it stepped."""
    for params, _, _, name in updates:
        logs[f"grad_norm_{name}"] = float(fsdp_utils.clip_grad_norm_(params, MAX_GRAD_NORM))
    ok = guard.step_ok(*[v for k, v in logs.items() if k.startswith(("loss", "grad_norm"))])
    for _, opt, sched, _ in updates:
        if ok:
            opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
    return ok


def add_logs(total: dict, logs: dict, weight: float) -> None:
    for k, v in logs.items():
        total[k] = total.get(k, 0.0) + v * weight


def window_add(window: dict, logs: dict) -> None:
    """Collect a step's values for the next log line: each metric is averaged over the steps of
    the logging window that produced it (so loss_dm, made every DFAKE_GEN_UPDATE_RATIO steps,
    shows up whenever the window held a generator step)."""
    for k, v in logs.items():
        total, count = window.get(k, (0.0, 0))
        window[k] = (total + float(v), count + 1)


def window_metrics(window: dict, lrs: dict) -> dict:
    """The log line: window means, losses averaged over ranks too (grad norms are global already)."""
    means = {k: total / count for k, (total, count) in window.items()}
    metrics = run_utils.mean_across_ranks({k: v for k, v in means.items() if k.startswith("loss")})
    metrics.update({k: v for k, v in means.items() if not k.startswith("loss")}, **lrs)
    window.clear()
    return dict(sorted(metrics.items()))


# ----------------------------------------------------------------------------------------------
# helpers: samples

def sample_inputs(rows: list[dict], count: int, shape: tuple, n_sim: int, seed: int):
    """Fixed sample prompts (the data's first distinct ones) and fixed noise, the same every time."""
    prompts = list(dict.fromkeys(r["prompt"] for r in rows))[:count]
    g = data_utils.step_generator(seed, 0, stream=7)
    return prompts, torch.randn((len(prompts), *shape), generator=g), torch.randn((len(prompts), n_sim, *shape), generator=g)


@torch.no_grad()
def write_samples(model, vae, text, noise, sim_noise, step_list, alphas, path: str) -> None:
    """Every rank runs the sharded generator (the same forwards everywhere); rank 0 decodes and
    writes the grid. Few-step mode runs the whole step list, as inference does."""
    last = len(step_list) - 1
    fresh = [sim_noise[:, i] for i in range(last)]
    z, _ = dm.backward_simulation(model, noise, step_list, last, text, alphas, fresh_noise=fresh)
    latents = dm.generator_forward(model, z, step_list[last], text, alphas)
    fsdp_utils.reshard_all(model)  # no gathered copy left behind until the next grid
    if run_utils.rank() == 0:
        images = vae.decode((latents / vae.config.scaling_factor).to(vae.dtype)).sample
        data_utils.save_image_grid(images, path, nrow=4)


# ----------------------------------------------------------------------------------------------
# main

def default_paths() -> tuple[str, str]:
    """The embedded default: the shapes teacher shipped in assets/ (make_teacher.py rebuilds it),
    loaded through the same code path as real weights, with its prompts (or images, for the GAN)."""
    folder = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "shapes_teacher")
    return folder, os.path.join(folder, "data.jsonl" if USE_GAN else "prompts.txt")


MODEL_COMPONENTS = {"unet": "UNet2DConditionModel", "vae": "AutoencoderKL", "text_encoder": "CLIPTextModel",
                    "tokenizer": None, "scheduler": None}


def main() -> None:
    config = run_utils.apply_overrides(globals(), sys.argv[1:])
    step_list = validate_config(int(os.environ.get("WORLD_SIZE", 1)))
    precision = get_precision(PRECISION)
    model_path, data_path = MODEL_PATH, DATA_PATH
    if not model_path:
        model_path, default_data = default_paths()
        data_path = data_path or default_data
    run_utils.check_model_folder(model_path, "StableDiffusionPipeline", MODEL_COMPONENTS)
    run_utils.check_output_dir(OUTPUT_DIR)

    d = fsdp_utils.init_distributed(cpu_offload=CPU_OFFLOAD, timeout_s=COLLECTIVE_TIMEOUT_S)
    print0(f"config ({d.world_size} ranks, {d.backend}):\n{run_utils.format_config(config)}")
    print0(f"model {model_path}, data {data_path}" + ("" if MODEL_PATH else " (embedded default)"))
    stopper = run_utils.GracefulStop()
    quiet_empty_fp32_warning()
    rows, skipped = load_data(data_path, USE_GAN, SKIP_BAD_SAMPLES)
    print0(f"data: {len(rows)} rows from {data_path}" + (f", {skipped} bad rows skipped" if skipped else ""))
    resume_path = checkpoint.resolve_resume(RESUME, OUTPUT_DIR)  # a bad path fails here, before any work

    # models: generator, fake score (trainable) and teacher (frozen), each sharded per block
    # (PARALLELISM=ddp: full replicas, the trainable ones wrapped in DDP for their training forwards;
    # checkpoints, EMA, samples and export always use the unwrapped modules, whose names match)
    from diffusers import DDPMScheduler
    mesh = fsdp_utils.build_mesh(d.device, DP_REPLICATE) if PARALLELISM == "fsdp" else None
    models = build_models(os.path.join(model_path, "unet"), mesh, precision, d.device)
    generator, fake, head, ema = (models.get(k) for k in ("generator", "fake", "head", "ema"))
    teacher = build_unet(os.path.join(model_path, "unet"), mesh, precision.frozen_dtype(TEACHER_DTYPE),
                         d.device, trainable=False)
    guidance = fake if head is None else nn.ModuleDict({"fake": fake, "head": head})
    train_gen, train_fake = generator, fake
    if mesh is None:
        ddp = functools.partial(fsdp_utils.apply_ddp, device=d.device, mp_policy=precision.mp_policy(),
                                block_classes=BLOCK_CLASSES, activation_checkpointing=ACTIVATION_CHECKPOINTING)
        train_gen, train_fake = ddp(generator), ddp(fake, verbose=False)
    tokenizer, text_encoder, vae = load_frozen_parts(
        model_path, precision.frozen_dtype(TEXT_ENCODER_DTYPE), precision.frozen_dtype(VAE_DTYPE), d.device)
    alphas = DDPMScheduler.from_pretrained(model_path, subfolder="scheduler").alphas_cumprod.to(d.device)
    num_train_timesteps = len(alphas)
    vae_factor = 2 ** (len(vae.config.block_out_channels) - 1)
    resolution = RESOLUTION or generator.config.sample_size * vae_factor
    if resolution % vae_factor:
        raise ConfigError(f"RESOLUTION={resolution}: must be a multiple of the VAE factor {vae_factor}")
    latent_shape = (generator.config.in_channels, resolution // vae_factor, resolution // vae_factor)

    # optimizers: separate AdamW for the generator and for the guidance side (fake score + head)
    opt_g, sched_g = make_optimizer(generator, GENERATOR_LR)
    opt_d, sched_d = make_optimizer(guidance, GUIDANCE_LR)
    optimizers = {"generator": (generator, opt_g), "guidance": (guidance, opt_d)}
    schedulers = {"generator": sched_g, "guidance": sched_d}
    audit = [component_row(n, m, precision.compute_dtype) for n, m in models.items()]
    audit += [component_row("teacher", teacher, precision.frozen_dtype(TEACHER_DTYPE)),
              component_row("text_encoder", text_encoder, text_encoder.dtype), component_row("vae", vae, vae.dtype)]
    print0(f"components ({resolution} px, latents {latent_shape}):\n{format_audit(audit)}")
    memory_table = functools.partial(fsdp_utils.memory_report, {**models, "teacher": teacher},
                                     {"generator": opt_g, "guidance": opt_d})
    print0(f"memory at start:\n{memory_table()}")

    # resume
    ckpt = checkpoint.Checkpointer(OUTPUT_DIR, KEEP_LAST, ASYNC_SAVE)
    start_step, guard = 0, run_utils.NonFiniteGuard(MAX_BAD_STEPS)
    if resume_path:
        meta = ckpt.load(resume_path, models, optimizers, schedulers)
        start_step = meta["step"]
        guard.load(meta)
        print0(f"resumed from {resume_path}: continuing after step {start_step}")
    elif INIT_FROM:  # weights only: optimizers, LR schedule and step start fresh
        ckpt.load(INIT_FROM, {"generator": generator, "fake": fake}, {}, {})
        if ema is not None:
            fsdp_utils.copy_params(ema, generator)
        print0(f"generator and fake score initialised from {INIT_FROM}")

    # fixed inputs: the unconditional embedding (the teacher's CFG), sample prompts and noise
    encode = functools.partial(encode_prompts, tokenizer, text_encoder, device=d.device)
    encode_real = functools.partial(encode_images, vae, size=resolution, device=d.device) if USE_GAN else None
    uncond = encode([""])
    sample_prompts, sample_noise, sample_sim = sample_inputs(rows, SAMPLE_COUNT, latent_shape, len(step_list) - 1, SEED)
    sample = functools.partial(write_samples, ema if ema is not None else generator, vae, encode(sample_prompts),
                               sample_noise.to(d.device), sample_sim, step_list, alphas)
    global_batch = BATCH_SIZE * d.world_size * GRAD_ACCUM
    logger = run_utils.RunLogger(OUTPUT_DIR, MAX_STEPS, start_step)
    saved_at, window = (start_step if resume_path else -1), {}

    # the loop: `step` counts completed steps before this one (the official 0-based iteration)
    for step in range(start_step, MAX_STEPS):
        gen_turn = dm.should_update_generator(step, DFAKE_GEN_UPDATE_RATIO)
        index = dm.choose_step_index(step, SEED, len(step_list)) if len(step_list) > 1 else 0
        noise = draw_step_noise(SEED, step, global_batch, latent_shape, len(step_list) - 1, USE_GAN,
                                DIFFUSION_GAN_MAX_TIMESTEP, num_train_timesteps)
        batches = micro_batches(step, rows, noise, d.world_size, d.rank, d.device, encode, encode_real)
        logs, images = ({"step_index": index} if len(step_list) > 1 else {}), []

        # generator turn: images from G (with graph only when G steps), then its loss and backward.
        # Its update waits for the guidance turn: that one uses only detached images, so stepping
        # both after it is the published order, and one finiteness check covers both updates.
        for mb in batches:
            with torch.set_grad_enabled(gen_turn):
                x = generator_images(train_gen, mb, step_list, index, alphas)
            if gen_turn:
                loss, parts = generator_loss(x, mb, uncond, teacher, train_fake, head, alphas)
                (loss / GRAD_ACCUM).backward()
                add_logs(logs, parts, 1 / GRAD_ACCUM)
            images.append(x.detach())
        if gen_turn:
            opt_d.zero_grad(set_to_none=True)  # the GAN term left grads on the fake UNet and head

        # guidance turn, every step: fake score (+ head) on the same pre-update images
        for mb, x in zip(batches, images):
            loss, parts = guidance_loss(x, mb, train_fake, head, alphas)
            (loss / GRAD_ACCUM).backward()
            add_logs(logs, parts, 1 / GRAD_ACCUM)
        updates = [(list(guidance.parameters()), opt_d, sched_d, "guidance")]
        if gen_turn:
            updates.insert(0, (list(generator.parameters()), opt_g, sched_g, "generator"))
        if finish_updates(updates, guard, logs):
            if gen_turn and ema is not None:
                fsdp_utils.ema_update(ema, generator, EMA_DECAY)
        else:
            print0(f"step {step + 1}: non-finite loss or grad norm on some rank, updates skipped on all "
                   f"({guard.in_a_row} in a row, {guard.skipped} in all)")

        done = step + 1
        window_add(window, logs)
        if done % LOG_EVERY == 0 or done == MAX_STEPS:
            lrs = {"lr_generator": sched_g.get_last_lr()[0], "lr_guidance": sched_d.get_last_lr()[0],
                   "skipped_steps": guard.skipped}
            logger.step_done(done, window_metrics(window, lrs))
        else:
            logger.step_done(done, None)
        ckpt.poll()
        if (SAMPLE_EVERY and done % SAMPLE_EVERY == 0) or done == MAX_STEPS:
            sample(os.path.join(OUTPUT_DIR, "samples", f"step_{done:06d}.png"))
        trainer_state = {"samples_seen": done * global_batch, "skipped_samples": skipped, **guard.state()}
        if (SAVE_EVERY and done % SAVE_EVERY == 0) or done == MAX_STEPS:
            ckpt.save(done, models, optimizers, schedulers, trainer_state, config)
            saved_at = done
        stop = done < MAX_STEPS and stopper.should_stop()
        if stop or guard.exhausted:
            if saved_at != done:
                ckpt.save(done, models, optimizers, schedulers, trainer_state, config)
            ckpt.wait()
            if guard.exhausted:
                raise guard.error(done)
            raise run_utils.Preempted(stopper.signal_received(), f"checkpoint saved at step {done}; rerun with --resume=auto")

    # the final checkpoint and samples were written in the loop at MAX_STEPS; export
    logger.close()
    ckpt.wait()
    # the memory report after training (its peak is training's, not the export gather's)
    print0(f"memory after training:\n{memory_table()}")
    exported = {"unet": ema if ema is not None else generator}
    checkpoint.export_pipeline(model_path, os.path.join(OUTPUT_DIR, "export"), exported, parse_dtype(EXPORT_DTYPE))
    if EVAL_AT_END and d.rank == 0:
        evaluate_export(os.path.join(OUTPUT_DIR, "export"), [r["prompt"] for r in rows], step_list)
    fsdp_utils.cleanup_distributed()  # its barrier holds the other ranks while rank 0 evaluates


def evaluate_export(export: str, prompts: list[str], step_list: list[int]) -> None:
    """Rank 0: the shapes-task scores (prompt adherence, Fréchet distance, diversity; see
    shapes_eval.py) of the exported generator with its own sampler, printed and written to
    OUTPUT_DIR/eval.json. Skipped unless every training prompt is a shapes prompt."""
    import json

    from demos import shapes_eval as se
    unique = set(prompts)
    try:
        for p in unique:
            se.parse_prompt(p)
    except ValueError:
        print0("eval: skipped (the data is not the shapes task's prompts)")
        return
    order = {p: i for i, p in enumerate(se.all_prompts())}  # the task's order, as shapes_eval uses
    prompts = sorted(unique, key=lambda p: (order.get(p, len(order)), p))
    n = len(step_list)
    if n > 1 and step_list != dm.denoising_step_list(n):
        print0(f"eval: skipped (DENOISING_STEPS={step_list} is not a shapes_eval few-step schedule)")
        return
    metrics, _, _ = se.evaluate_folder(export, "onestep" if n == 1 else "fewstep", steps=n, prompts=prompts)
    name = f"student, {n} step{'s' if n > 1 else ''}"
    print0("eval of the export on the shapes task:\n" + se.markdown_table([(name, metrics)], metrics["real_diversity"]))
    with open(os.path.join(OUTPUT_DIR, "eval.json"), "w") as f:
        json.dump(metrics, f, indent=1)


if __name__ == "__main__":
    run_utils.run_main(main)
