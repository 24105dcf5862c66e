"""DMD2 distillation of an SD-1.5 / SDXL UNet, a FLUX.1 (Kontext or text-to-image), Qwen-Image-Edit-2509 / 2511,
FLUX.2 ([klein] base, [dev]) or Wan 2.1 text-to-video transformer into a 1-step (or few-step) generator, on FSDP2.

DMD2 = Yin et al. 2024, "Improved Distribution Matching Distillation for Fast Image Synthesis".
Three copies of the teacher start from the same weights: the generator G (trained), the frozen
teacher ("real score") and the fake score (trained to follow G's output distribution). Each is
sharded by its family's recipe (a `fully_shard` unit per block, in execution order) and loaded
straight into its shards. Per step (two time scales, as published):
  - every DFAKE_GEN_UPDATE_RATIO steps, G steps on the distribution-matching loss `loss_dm`
    (+ GEN_CLS_LOSS_WEIGHT · `loss_gen_cls` with the GAN head); DMD_LOSS=decoupled (flow teachers with a CFG
    pair): on `loss_ca` + `loss_dm`, Decoupled DMD's two terms (docs/dmd2.md)
  - every step, the fake score (+ GAN head) steps on its denoising loss `loss_fake` of the same
    pre-update G images (+ GUIDANCE_CLS_LOSS_WEIGHT · `loss_guidance_cls`)
The math lives in algorithms/dmd2.py, each parametrisation's step beside it (ε-prediction UNets:
algorithms/dmd2_unet.py; flow matching: algorithms/dmd2_flow.py); what both scripts do around
the loop in components/trainer.py; its settings' checks in components/dmd_settings.py; what is true of a
model family alone in its room, families/.
MODEL_PATH's model_index.json names the family (families.FAMILIES): StableDiffusionPipeline (CLIP
text embeddings), StableDiffusionXLPipeline (two text encoders, added time/text conditions, fp32
VAE), FluxKontextPipeline or FluxPipeline, QwenImageEditPlusPipeline, Flux2KleinPipeline or Flux2Pipeline,
WanPipeline (docs/dmd2.md; each family's page in docs/families/); its setup
here (the UNets', or the one of every flow-matching room, which asks the room what differs) builds the
models, VAE, batches and losses, and one story (main) runs them through the same loop.

    # 2 ranks (GPUs, or CPU with gloo) on the embedded default (the shipped shapes teacher): a smoke run
    torchrun --standalone --nproc_per_node=2 train_dmd.py
    # one process, for debugging (the same global batch as 2 ranks × BATCH_SIZE 2)
    python train_dmd.py --batch_size=4 --max_steps=20
    # the published SD-1.5 runs, stage 1 and stage 2 (GAN, from stage 1); SDXL 4-step and 1-step:
    # set MODEL and DATA, then
    bash recipes/dmd_sd15_stage1.sh
    bash recipes/dmd_sd15_stage2.sh
    bash recipes/dmd_sdxl_4step.sh
    GENERATOR_INIT=/models/sdxl_ode_cond399.safetensors bash recipes/dmd_sdxl_1step.sh  # the ODE-pretrained generator
    bash recipes/dmd_sdxl_4step_lora.sh  # the official LoRA run (recipes/dmd_sd15_lora.sh: its settings on SD-1.5)
    # the shapes demo: distil the shipped teacher, then score teacher and student
    bash demos/demo_dmd.sh
    # after a stop or preemption: the same command plus --resume=auto
    # long sequences (Wan video, FLUX): each sample's tokens split over 4 ranks, 2 groups (docs/parallelism.md)
    torchrun --standalone --nproc_per_node=8 train_dmd.py --model_path=... --data_path=... --context_parallel=4

1-step inference with the export (LCMScheduler's last step returns its x0 prediction):
    pipe = StableDiffusionPipeline.from_pretrained("out/dmd/export", torch_dtype=torch.float32)
    pipe.scheduler = LCMScheduler.from_config(pipe.scheduler.config)
    image = pipe(prompt, num_inference_steps=1, guidance_scale=0, timesteps=[999]).images[0]

    python -m pytest tests/test_train_dmd.py -q
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable

import torch
import torch.nn as nn

import checkpoint
import families
import fsdp_utils
from algorithms import dmd2 as dm
from algorithms import dmd2_flow as flow_dm
from algorithms import dmd2_unet as unet_dm
from algorithms import flux_kontext as km
from components import optim, profiling, trainer
from components import dmd_settings, flow_samples
from components import dmd_validation as dmd_val
from components.config import script_constants
from core.dist import print0
from core.errors import run_main
from components.metrics import counting_flops, watch_model_flops
from components.optim import warmup_scheduler
from data.batches import micro_batch_positions
from data.buckets import bucket_schedule, load_pairs, make_buckets, references, row_shapes, step_indices
from data.prefetch import Prefetcher
from data.randomness import SAMPLE_NOISE_STREAM, drop_captions, per_sample_draws, step_generator
from data.sources import read_rows, source_kind
from families import dit, pipelines
from families import sd_unet as unet
from parallel import ema as ema_lib
from parallel import lora as lora_lib
from parallel import float8, lora_merge
from parallel.context_parallel import split_sequences
from parallel.parallelize import parallelize
from precision import Precision, component_row, get_precision, parse_dtype

# ----------------------------------------------------------------------------------------------
# config (every UPPER_CASE constant can be overridden as --name=value; the groups and the shared
# settings are in the same order in train_flux_kontext.py, and mean the same: components/trainer.py)

# models and data
MODEL_PATH = ""  # SD-1.5, SDXL, FLUX.1, Qwen-Image-Edit, FLUX.2 or Wan folder (model_index.json says); "" = shapes
TEACHER_LORA = ""  # flow teachers: a LoRA of MODEL_PATH (an export/, or kohya / ai-toolkit / musubi / ComfyUI keys that
# the pipeline's lora_state_dict converts): the teacher is base + it
GENERATOR_LORA = ""  # flow teachers, LORA_RANK > 0: a LoRA file (the forms TEACHER_LORA reads) whose adapters start the
# generator and its EMA, e.g. a few-step LoRA to continue (its rank LORA_RANK, its modules among the targets)
TEACHER_LORA_2 = ""  # two-expert teachers (Wan 2.2 A14B): the low-noise expert's (transformer_2) TEACHER_LORA
GENERATOR_LORA_2 = ""  # two-expert teachers: the low-noise expert's GENERATOR_LORA (a Lightning pair's second file)
DATA_PATH = ""  # prompts: .txt, .jsonl ("prompt"; "image" for the GAN), captions or datasets; "" = the teacher's
# (an editing teacher: rows as train_flux_kontext.py reads them, "control"(s) + "prompt"; "target" for the GAN)
CONTROL_PATH = ""  # editing teachers, folder layout: the reference images' folder(s); "" = DATA_PATH/control
MAX_REFERENCES = 0  # editing teachers: reference images per row at most; 0 = the family's (Kontext 1, Qwen 3, FLUX.2 4)
REAL_DATA_PATH = ""  # GAN real images apart from the prompts (folder, .jsonl, datasets); "" = DATA_PATH's "image"
OUTPUT_DIR = "out/dmd"  # metrics.jsonl, samples/, checkpoints/, export/
RESOLUTION = 0  # area RESOLUTION^2 px (UNets: side; Wan: height); 0 = the family's: SD-1.5 512, Wan 480, else 1024
NUM_FRAMES = 0  # video teachers (Wan): frames per clip, 4k + 1; 0 = the pipeline's 81
REFERENCE_AREA = 0  # Qwen-Image-Edit, FLUX.2: pixels of each reference the transformer sees; 0 = the pipeline's 1024^2
SKIP_BAD_SAMPLES = False  # bad data rows: False = stop with file:line, True = skip and count
DATASET_SPLIT = "train"  # datasets sources: the split to read (a save_to_disk DatasetDict or a hub dataset)
PROMPT_COLUMN = ""  # datasets sources: the prompt column; "" = the first of prompt, caption, text, instruction
CONTROL_COLUMN = ""  # datasets sources, editing teachers: the input image column; "" = control, context or source
TARGET_COLUMN = ""  # datasets sources, editing teachers: the edited image column (GAN); "" = target or edited
IMAGE_COLUMN = ""  # datasets sources: the real image column (GAN); "" = image
CAPTION_DROPOUT = 0.0  # probability that a sample's prompt becomes the family's unconditional one (exact on resume)
PROMPT_CACHE = 0  # UNets: keep up to this many distinct prompts' embeddings on the device (small prompt sets); 0 = off
TEXT_CACHE_DIR = ""  # flow teachers: the text-embedding cache; "" = OUTPUT_DIR/text_cache (share it between runs)
BUCKET_ASPECTS = [0.5, 0.75, 1.0, 1.333, 2.0]  # FLUX.1 Kontext: width/height ratios of the resolution buckets
# schedule (published: 39k steps, batch 32×64 GPUs; recipes/ hold the published runs, demos/demo_dmd.sh the demo's)
MAX_STEPS = 100  # training steps (a fake-score update each, a generator update every DFAKE_GEN_UPDATE_RATIO)
BATCH_SIZE = 2  # samples per rank per micro-batch (published SD-1.5: 32)
GRAD_ACCUM = 1  # micro-batches per optimizer step; global batch = BATCH_SIZE × data-parallel ranks × GRAD_ACCUM
SEED = 0  # data order, noise, timesteps, sample seeds: all drawn from (SEED, step), identical on every rank
# optimizer: AdamW (0.9, 0.999), weight decay 0.01, as published
GENERATOR_LR = 1e-5  # the generator's learning rate
GUIDANCE_LR = 1e-5  # the fake score's (+ GAN head's)
OPTIMIZER = "adamw"  # adamw (torch fused, fp32 states) | adamw8bit | adamw4bit (torchao)
WARMUP_STEPS = 0.0  # linear LR warmup over this many steps (official: 7.8125)
LR_SCHEDULE = "constant"  # the LR after the warmup: constant (published) | cosine | linear (to 0 at MAX_STEPS)
MAX_GRAD_NORM = 10.0  # clip each model's total grad norm (0 = no clipping); a non-finite norm skips the step
EMA_DECAY = 0.0  # > 0: an EMA of the generator (LoRA: of its adapters), sampled and exported
MAX_SEQUENCE_LENGTH = 512  # FLUX teachers: T5 tokens (capped at the tokenizer's model_max_length)
CONDITION_AREA = 0  # Qwen-Image-Edit teachers: pixels of each reference the text encoder sees; 0 = the pipeline's 384^2
# DMD2, published SD-1.5 values (paper and the official code's SD-1.5 settings)
REAL_GUIDANCE_SCALE = 0.0  # teacher CFG in the DM loss; 0 = per teacher: UNets 1.75 (published), FLUX 1, Qwen, klein 4
REAL_GUIDANCE_SCALE_2 = 0.0  # Wan 2.2 A14B teachers: the low-noise expert's CFG (guidance_scale_2); 0 = the above
REAL_GUIDANCE_NORM = ""  # its combination's rescale: none | token (the pipeline's per token) | scalar; "" = per teacher
DMD_LOSS = ""  # dmd2 | decoupled (loss_ca + loss_dm: teachers with a CFG pair); "" = the family's (Z-Image: decoupled)
DMD_CA_WEIGHT = 1.0  # decoupled: the CFG-augmentation term's weight (CFG'd teacher − conditional teacher)
DMD_DM_WEIGHT = 1.0  # decoupled: the distribution-matching term's weight (conditional teacher − fake score, no CFG)
FLUX_GUIDANCE = 0.0  # guidance-distilled teachers' embedded value for all three; 0 = FLUX.1 2.5, FLUX.2 [dev] 4
DFAKE_GEN_UPDATE_RATIO = 10  # the generator steps on steps 1, 1 + ratio, ... (official: iteration % ratio == 0, from 0)
CONDITIONING_TIMESTEP = 999  # 1-step generator: pure noise in, this timestep, x0 out (FLUX: σ = (t + 1) / 1000)
DENOISING_STEPS = []  # few-step generator timesteps, e.g. [999,749,499,249]; [] = 1-step
STUDENT_SAMPLE_TYPE = "sde"  # few-step flow generator between steps: sde (x̂0 + fresh noise, DMD2) | ode (Euler)
SHIFT = "1"  # flow teachers: DM-loss and fake-score σ shifted s·σ/(1+(s-1)·σ); auto = the pipeline's at the size
MIN_STEP_PERCENT = 0.02  # DM-loss timesteps t ~ U[MIN, MAX] × the train timesteps (official: 2 %...
MAX_STEP_PERCENT = 0.98  # ... to 98 %, so neither nearly clean nor pure-noise inputs)
FAKE_SCORE_TARGET = "flow"  # flow-matching teachers: the fake score's loss, flow (v-MSE) | x0 (x̂0-MSE = σ²·v-MSE)
REGRESSION_WEIGHT = 0.0  # > 0 (flow teachers, 1-step): + this × MSE(G(z), the teacher's ODE from z), DMD's loss
REGRESSION_STEPS = 28  # the teacher ODE's Euler steps for that target (every generator step: that many forwards)
DIVERSITY_WEIGHT = 0.0  # > 0 (flow, few-step): the 1st step regresses on the teacher's ODE, no DM loss there (DP-DMD)
DIVERSITY_ANCHOR = 5  # that target: the teacher's mean velocity over its first this-many of REGRESSION_STEPS steps
USE_GAN = False  # stage 2: a classifier head on the fake model's features; real images: "image" (edits, Wan: "target")
GEN_CLS_LOSS_WEIGHT = 1e-3  # generator GAN loss weight (published stage 2)
GUIDANCE_CLS_LOSS_WEIGHT = 1e-2  # discriminator loss weight (published stage 2)
DIFFUSION_GAN = True  # noise real and fake inputs of the head to t < DIFFUSION_GAN_MAX_TIMESTEP first
DIFFUSION_GAN_MAX_TIMESTEP = 1000  # published stage 2: the whole range
GAN_HEAD_FEATURES = "mid"  # the GAN head reads the bottleneck (mid, published) | the up-path output (up)
# LoRA
LORA_RANK = 0  # 0 = full fine-tuning; > 0 = peft LoRA adapters on the generator (official run: 64)
LORA_ALPHA = 0.0  # LoRA scaling = alpha / rank; 0 = alpha equal to LORA_RANK
LORA_TARGET_MODULES = []  # [] = the model's (r16: Qwen 23.6 M, FLUX 54.2 M); blocks = all block Linears (105.6, 65.4 M)
LORA_DROPOUT = 0.0  # dropout on the adapters' input
LORA_INIT = "gaussian"  # lora_A's init: gaussian (diffusers' examples) | default (peft's, the official DMD2 run)
BASE_DTYPE = ""  # LoRA: the frozen base's storage; "" = the compute dtype, nf4 = 4-bit NormalFloat (QLoRA)
FAKE_LORA = False  # with LORA_RANK > 0: the fake score trains LoRA adapters too (same settings) instead of all weights
LORA_EXPORT_MERGED = False  # LoRA: also write OUTPUT_DIR/export_merged/, a full pipeline with the adapters merged
# precision: one table decides every dtype (precision.py); frozen parts are stored in their compute dtype
PRECISION = "bf16-mixed"  # fp32 | bf16-mixed (fp32 master weights, bf16 compute) | bf16 (everything bf16)
FP8 = ""  # transformer blocks' Linears in float8 (torchao): tensorwise (float8 all-gather) | rowwise; "" = off
FAKE_SCORE_FP32 = False  # the fake score computes in the compute dtype (docs/dmd2.md); True = fp32, as published
FAKE_SCORE_ATTENTION_DTYPE = ""  # UNets, FAKE_SCORE_FP32: its attention (SDPA); "" = compute dtype, fp32 = published
TEACHER_DTYPE = ""  # storage = compute dtype of the frozen teacher; "" = PRECISION's compute dtype
TEXT_ENCODER_DTYPE = ""  # frozen text encoders' dtype; "" = PRECISION's compute dtype
SHARD_TEXT_ENCODER = "auto"  # FLUX.2: the cache fill's encoder FSDP-sharded over the ranks: 1 | 0 | auto (> half a GPU)
VAE_DTYPE = ""  # frozen VAE's dtype; "" = PRECISION's compute dtype (SDXL: fp32)
TF32 = True  # CUDA: fp32 matmuls and convolutions in TF32; False = strict fp32
VAE_PATH = ""  # a VAE folder to use instead of MODEL_PATH/vae (e.g. an fp16-safe SDXL VAE); linked into the export
EXPORT_DTYPE = "fp32"  # dtype of the exported trained model (fp16/bf16 halve the file)
EXPORT_SYMLINKS = False  # the export's frozen parts: hard-linked (copied across filesystems); True = symlinks
# parallelism
PARALLELISM = "fsdp"  # fsdp (sharded, FSDP2) | ddp (full replica per rank, DistributedDataParallel; DMD2: no GAN head)
BLOCK_CLASSES = []  # FSDP units; [] = the model's recipe (parallel/parallelize.py)
DP_REPLICATE = 1  # > 1: HSDP, shard within groups of WORLD_SIZE / DP_REPLICATE ranks, replicate across
CONTEXT_PARALLEL = 1  # flow teachers whose family has it (Wan, FLUX): ranks splitting each sample's tokens (Ulysses)
RESHARD_AFTER_FORWARD = "auto"  # 1: free gathered params after each forward (ZeRO-3); 0: keep them; auto: see docs
CPU_OFFLOAD = False  # keep sharded params, grads and optimizer state in host memory
ACTIVATION_CHECKPOINTING = False  # recompute each unit in backward instead of storing its activations
PREFETCH = 0  # units to all-gather ahead in forward / backward (0 = FSDP2's implicit order)
COMPILE = False  # torch.compile each FSDP unit's forward (block), AC -> compile -> fully_shard
CHANNELS_LAST = False  # UNets: every convolution in NHWC (generator, fake score, teacher, EMA): cuDNN's native layout
ATTENTION_BACKEND = "native"  # native (torch SDPA, cuDNN off) | _native_cudnn | _native_flash | ...; checked at start
# fault tolerance
MAX_BAD_STEPS = 10  # non-finite loss/grad steps are skipped (on all ranks); this many in a row: save and stop
COLLECTIVE_TIMEOUT_S = 1800  # a collective waiting longer fails the run (a stuck rank); > the slowest save
# checkpoints, logging, samples
SAVE_EVERY = 50  # steps between checkpoints, and always one at MAX_STEPS; 0 = only that one
KEEP_LAST = 2  # complete checkpoints kept
ASYNC_SAVE = False  # write checkpoints in the background while training goes on
RESUME = ""  # "" = fresh (OUTPUT_DIR without checkpoints), "new" = fresh beside them, "auto" = newest or fresh, a path
INIT_FROM = ""  # a checkpoint folder whose generator and fake score start a fresh run (stage 2 from stage 1)
GENERATOR_INIT = ""  # a UNet folder or .safetensors that starts the generator only (--generator_ckpt_path)
LOG_EVERY = 10  # steps between log lines / metrics.jsonl records, and one at MAX_STEPS; 0 = none
REPORT_TO = ""  # also log to: "" (metrics.jsonl only) | tensorboard | wandb | tensorboard,wandb
PROFILE_STEPS = []  # [first, last]: torch.profiler over these steps (first >= 2): traces and ops in OUTPUT_DIR/profile
WANDB_PROJECT = ""  # W&B project ("" = W&B's default); WANDB_MODE=offline works without a network
WANDB_RUN_NAME = ""  # W&B run name ("" = the OUTPUT_DIR folder name)
SAMPLE_EVERY = 25  # steps between sample grids, and one at MAX_STEPS; 0 = no samples
SAMPLE_PROMPTS = ""  # the sample grids' own prompts (Kontext: rows with "control"); "" = from the data
SAMPLE_COUNT = 8  # fixed prompts (the first distinct ones of SAMPLE_PROMPTS or the data) and seeds in every grid
VAL_EVERY = 0  # steps between validations: the student against the teacher (variety, distance, colour); 0 = none
VAL_PROMPTS = ""  # validation rows (as DATA_PATH reads them); "" = the data's last VAL_COUNT distinct ones
VAL_COUNT = 4  # validation prompts (rows)
VAL_SEEDS = 4  # seeds per validation prompt: the variety across seeds needs 2 or more
VAL_TEACHER_STEPS = 28  # the teacher's reference: its steps (flow: Euler, the pipeline's shift; UNets: DDIM)
COLLAPSE_WARN = 0.75  # the variety ratio (student / teacher) under this times its best so far: one warning line; 0 off
COLLAPSE_FLOOR = 0.4  # the variety ratio under this at any validation: the same warning (a collapse from the start)
COLLAPSE_STOP = False  # at that warning: stop the run (its checkpoints before that step kept)

_DEFAULTS = script_constants(globals())  # before any override: what changed_settings compares with

# ----------------------------------------------------------------------------------------------
# setup: the script's own settings checked before any work (components/trainer.py checks the shared ones),
# the embedded default


def current_settings() -> SimpleNamespace:
    """The script's settings as attributes, as components/dmd_settings.py reads them."""
    return SimpleNamespace(**script_constants(globals()))


def validate_config() -> list[int]:
    """Reject bad or contradictory settings before any work (components/dmd_settings.py). Returns the
    generator's step list."""
    return dmd_settings.validate(current_settings(), changed_settings(), default_paths()[0])


def changed_settings() -> set[str]:
    """The settings given a value other than the script's default."""
    return {k for k, v in script_constants(globals()).items() if v != _DEFAULTS[k]}


def read_lora_parts(pipeline: str, teacher: bool):
    """TEACHER_LORA[_2]'s (GENERATOR_LORA[_2]'s) adapters: None, the first part's LoraDelta, or with a second file
    {part: LoraDelta} (a two-expert model's, families/wan/experts.py)."""
    files = dmd_settings.lora_files(current_settings(), pipeline, teacher)
    if not files:
        return None
    deltas = {part: lora_merge.read_lora(file, pipeline=pipeline) for _, file, part in files}
    first = pipelines.trained_component(pipeline).subfolder
    return deltas[first] if list(deltas) == [first] else deltas


def part_deltas(model: nn.Module, deltas) -> list:
    """[(module, LoraDelta)]: a LoraDelta for the model's first part (itself, or its first pipeline part), or
    {part: LoraDelta} for each named part."""
    parts = model.pipeline_parts() if hasattr(model, "pipeline_parts") else None
    if not isinstance(deltas, dict):
        return [(next(iter(parts.values())) if parts else model, deltas)]
    return [(parts[name], delta) for name, delta in deltas.items()]


def default_paths(use_gan: bool = False) -> tuple[str, str]:
    """The embedded default: the shapes teacher shipped in assets/ (demos/make_teacher.py rebuilds
    it), loaded through the same code path as real weights, with its prompts (or, for the GAN, its
    images)."""
    folder = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "shapes_teacher")
    return folder, os.path.join(folder, "data.jsonl" if use_gan else "prompts.txt")


def resolve_defaults() -> dict:
    """Fill the "" settings (the embedded default) and return the resolved config, which is what
    the run prints and every checkpoint records."""
    global MODEL_PATH, DATA_PATH, REAL_GUIDANCE_SCALE, REAL_GUIDANCE_NORM, FLUX_GUIDANCE, DMD_LOSS
    if not MODEL_PATH:
        MODEL_PATH, default_data = default_paths(USE_GAN)
        DATA_PATH = DATA_PATH or default_data
    pipeline = trainer.pipeline_of(MODEL_PATH, "train_dmd.py")
    room = families.FAMILIES[pipeline]
    guidance = room.dmd_guidance(script_constants(globals()))  # 0 and "": the family's teacher CFG
    REAL_GUIDANCE_SCALE, REAL_GUIDANCE_NORM = guidance.scale, guidance.norm
    if guidance.embedded is not None:  # 0: the guidance-distilled teacher's own value
        FLUX_GUIDANCE = guidance.embedded
    DMD_LOSS = dmd_settings.dmd_loss(current_settings(), room, pipeline)
    return script_constants(globals())


# ----------------------------------------------------------------------------------------------
# models


def build_gan_head(channels: int, native_size: int, mesh, precision, device: torch.device, seed: int,
                   cpu_offload: bool, features: str = "mid", make=None) -> nn.Module:
    """The classifier head (algorithms/dmd2.ClassifierHead), randomly initialised from `seed` (the
    same full tensors on every rank, whatever the world size), then sharded as one FSDP unit that
    gathers and computes in fp32 whatever the mode (grads reduced as the mode's): the official head
    runs outside bf16 autocast on fp32 features (tianweiy/DMD2 main/sd_guidance.py:155-164)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = make() if make is not None else dm.ClassifierHead(channels, native_size, features)
    head.to(device=torch.device("cpu") if cpu_offload else device, dtype=precision.param_dtype)
    parallelize(head, mesh, precision.mp_policy(torch.float32), fsdp_utils.Sharding(cpu_offload=cpu_offload))
    return head


def init_from(path: str, generator: nn.Module, fake: nn.Module, ema: nn.Module | None) -> None:
    """INIT_FROM: the generator and fake score of a checkpoint start a fresh run (weights only:
    optimizers, LR schedule and step start fresh; the EMA starts from the loaded generator)."""
    checkpoint.load_models(path, {"generator": generator, "fake": fake})
    if ema is not None:
        ema_lib.copy_params(ema, generator)
    print0(f"generator and fake score initialised from {path}")


def make_optimizer(module: nn.Module, lr: float, warmup_steps: float):
    """AdamW as published (betas 0.9/0.999, weight decay 0.01; torch's fused kernel, see
    components.optim.adamw) with the published warmup, its scheduler stepped once per iteration whether
    or not the optimizer stepped: the official code steps both schedulers every iteration
    (tianweiy/DMD2 main/train_sd.py:383, 408) with diffusers' constant_with_warmup (factor =
    s / warmup_step after s scheduler steps), and accelerate advances a prepared scheduler once per
    process per call ("500 / num_gpu steps", train_sd.py:204). So WARMUP_STEPS = warmup_step /
    num_processes iterations (500 / 64 = 7.8125 for the published runs), the first at LR 0."""
    opt = optim.make_optimizer(OPTIMIZER, [p for p in module.parameters() if p.requires_grad], lr=lr,
                                betas=(0.9, 0.999), weight_decay=0.01)
    return opt, warmup_scheduler(opt, warmup_steps, first_step=0, schedule=LR_SCHEDULE, total_steps=MAX_STEPS)


# ----------------------------------------------------------------------------------------------
# the loop


def val_settings() -> dmd_val.ValSettings:
    """VAL_EVERY's settings as components/dmd_validation.py reads them."""
    return dmd_val.ValSettings(VAL_EVERY, VAL_PROMPTS, VAL_COUNT, VAL_SEEDS, VAL_TEACHER_STEPS, COLLAPSE_WARN,
                               COLLAPSE_STOP, SEED, os.path.join(OUTPUT_DIR, "validation"), script_constants(globals()),
                               floor=COLLAPSE_FLOOR)


@dataclass(frozen=True)
class StepFns:
    """What the loop asks of a model family (the UNets or a flow teacher), each holding its models and settings."""
    batches: Callable  # (it, loaded) -> this rank's micro-batches on the device
    images: Callable  # (generator, mb, step index) -> G's images (latents or tokens)
    generator_loss: Callable  # (x, mb, fake) -> (loss, logs): loss_dm (+ the GAN term)
    guidance_loss: Callable  # (x, mb, fake) -> (loss, logs): loss_fake (+ the GAN term)


def add_logs(total: dict, logs: dict, weight: float) -> None:
    """Micro-batch values into the step's, in float64 as the log window sums them (no host sync)."""
    for k, v in logs.items():
        total[k] = total.get(k, 0.0) + v.double() * weight


def run_loop(run, start: int, steps: StepFns, load, n_steps: int, models: dict, trained: tuple, optimizers: tuple,
             schedulers: tuple, sample, skipped: int, validator=None) -> None:
    """The two-time-scale loop, the same for every model family. `trained` = (the generator and the
    fake score as their training forwards see them (DDP-wrapped under PARALLELISM=ddp), the guidance
    side: fake score (+ head)); step s (1-based, as in both scripts) is the official code's
    iteration it = s - 1, which decides the generator's turn and seeds the step's randomness; its
    data are read on a background thread while step s-1 runs."""
    d, generator, ema = run.d, models["generator"], models.get("ema")
    train_gen, train_fake, guidance = trained
    opt_g, opt_d = optimizers
    sched_g, sched_d = schedulers
    global_batch = BATCH_SIZE * d.world_size // CONTEXT_PARALLEL * GRAD_ACCUM  # a CP group's ranks share samples
    # CONTEXT_PARALLEL = C: each rank of a CP group computes the whole loss, its grads hold its tokens' share, and
    # FSDP averages over all dp x cp ranks: x C (parallel/context_parallel.py)
    with Prefetcher(lambda s: load(s - 1), MAX_STEPS, d.device) as prefetch:  # step s loads it = s - 1
        for step in range(start + 1, MAX_STEPS + 1):
            it = step - 1
            gen_turn = dm.should_update_generator(it, DFAKE_GEN_UPDATE_RATIO)
            index = dm.choose_step_index(it, SEED, n_steps) if n_steps > 1 else 0
            loaded, waited = prefetch.get(step)
            batches = steps.batches(it, loaded)
            logs, images = {"data_wait_ms": waited * 1000, **({"step_index": index} if n_steps > 1 else {})}, []
            with counting_flops(run, f"{gen_turn}-{index}", logs):  # MFU: FLOPs per kind of step
                # generator turn: images from G (with graph only when G steps), then its loss and backward.
                # Its update waits for the guidance turn: that one uses only detached images, so stepping
                # both after it is the published order, and one finiteness check covers both updates.
                with profiling.phase("generator_turn" if gen_turn else "generator_images"):
                    for m, mb in enumerate(batches):
                        with fsdp_utils.gradient_sync(train_gen, last_micro_batch=m == GRAD_ACCUM - 1):  # fwd, bwd
                            with torch.set_grad_enabled(gen_turn):
                                x = steps.images(train_gen, mb, index)
                            if gen_turn:
                                loss, parts = steps.generator_loss(x, mb, train_fake)
                                (loss * CONTEXT_PARALLEL / GRAD_ACCUM).backward()
                                add_logs(logs, parts, 1 / GRAD_ACCUM)
                        images.append(x.detach())
                    if gen_turn:
                        opt_d.zero_grad(set_to_none=True)  # the GAN term left grads on the fake model and head

                # guidance turn, every step: fake score (+ head) on the same pre-update images
                with profiling.phase("guidance_turn"):
                    for m, (mb, x) in enumerate(zip(batches, images)):
                        with fsdp_utils.gradient_sync(train_fake, last_micro_batch=m == GRAD_ACCUM - 1):  # fwd, bwd
                            loss, parts = steps.guidance_loss(x, mb, train_fake)
                            (loss * CONTEXT_PARALLEL / GRAD_ACCUM).backward()
                        add_logs(logs, parts, 1 / GRAD_ACCUM)
            updates = [(list(generator.parameters()), opt_g, "generator")] if gen_turn else []
            updates.append((list(guidance.parameters()), opt_d, "guidance"))
            lrs = {"lr_generator": sched_g.get_last_lr()[0], "lr_guidance": sched_d.get_last_lr()[0]}  # this step's
            if trainer.apply_updates(run, updates, logs, step) and gen_turn and ema is not None:
                ema_lib.ema_update(ema, generator, EMA_DECAY)
            sched_g.step()  # both every iteration, as published (make_optimizer)
            sched_d.step()
            state = {"samples_seen": step * global_batch, "skipped_samples": skipped,
                     **({"val_best": validator.best} if validator is not None else {})}
            validate = (functools.partial(validated, validator, step, state)
                        if validator is not None and trainer.due(step, VAL_EVERY) else None)
            trainer.end_step(run, step, logs, lrs, state, validate=validate, sample=sample,
                             work={"images": global_batch})


def validated(validator, step: int, state: dict) -> dict:
    """The step's validation figures; the checkpoint written after them holds COLLAPSE_WARN's best so far."""
    figures = validator(step)
    state["val_best"] = validator.best
    return figures


# ----------------------------------------------------------------------------------------------
# the families' DMD2 setups: each builds its models, trained views, VAE, batches, losses and samples
# from its room (families/), for the one story in main


@dataclass(frozen=True)
class Setup:
    """What main needs of a model family: built by its setup function (unet_setup, flow_setup)."""
    models: dict  # generator, fake[, head][, ema]: what checkpoints hold
    teacher: nn.Module  # the frozen real score
    trained: tuple  # (generator, fake score) as their training forwards see them (DDP-wrapped under ddp)
    guidance: nn.Module  # fake score (+ head): what the guidance optimizer steps
    audit: list  # the dtype rows of every component, for the start-up report
    caption: str  # the report's caption: resolution, latents or tokens
    n_steps: int  # the generator's sampling steps (1 = a 1-step generator)
    skipped: int  # bad data rows skipped
    inputs: Callable  # (final_weights) -> (StepFns, load, sample), after restore: fixed inputs, batches, losses
    scheduler: dict | None = None  # the scheduler config every export carries (None: the teacher's)
    export_note: str = ""  # how to sample the export, printed before it is written
    index: dict | None = None  # model_index.json entries the export sets (a distilled klein's is_distilled)
    base_lora: object = None  # TEACHER_LORA[_2]'s adapters (read_lora_parts): a LoRA export carries them too


def unet_setup(run: trainer.Run, room, step_list: list[int], precision: Precision) -> Setup:
    """DMD2 with an SD-1.5 or SDXL teacher: generator, fake score and teacher are UNets built by the
    UNet recipe (families/sd_unet/), each sharded per block (PARALLELISM=ddp: full replicas, the
    trainable ones wrapped in DDP for their training forwards; checkpoints, EMA, samples and export
    always use the unwrapped modules, whose names match); prompts encoded by the CLIP text encoders
    (SDXL: two, with the added time/text conditions), ε-prediction on the teacher's DDPM alphas."""
    d, sdxl = run.d, unet.is_sdxl(run.pipeline)
    columns = {"prompt": PROMPT_COLUMN, "image": IMAGE_COLUMN}
    rows, skipped, real_rows = unet.load_dmd_rows(DATA_PATH, USE_GAN, SKIP_BAD_SAMPLES, real_path=REAL_DATA_PATH,
                                                  columns=columns, split=DATASET_SPLIT)
    print0(f"data: {len(rows)} rows from {DATA_PATH}"
           + (f"; GAN real images: {len(real_rows)} from REAL_DATA_PATH={REAL_DATA_PATH}" if real_rows else "")
           + (f", {skipped} bad rows skipped" if skipped else ""))
    sample_rows = rows
    if SAMPLE_PROMPTS:
        sample_rows, _ = read_rows(SAMPLE_PROMPTS, ("prompt",), ("prompt",), skip_bad=False,
                                   setting="SAMPLE_PROMPTS", columns=columns, split=DATASET_SPLIT)
    val_rows = dmd_val.validation_rows(val_settings(), rows, lambda r: r["prompt"], lambda: read_rows(
        VAL_PROMPTS, ("prompt",), ("prompt",), skip_bad=False, setting="VAL_PROMPTS", columns=columns,
        split=DATASET_SPLIT)[0])

    shapes = unet.attention_shapes(MODEL_PATH, RESOLUTION, BATCH_SIZE, VAE_PATH)
    trainer.check_attention(run, *shapes, precision.compute_dtype)

    # models: generator, fake score (trainable) and teacher (frozen), each sharded per block
    mesh, _, sharding = trainer.mesh_and_sharding(run)
    unet_dir = os.path.join(MODEL_PATH, "unet")
    fake_compute = torch.float32 if FAKE_SCORE_FP32 else precision.compute_dtype
    fake_attention = parse_dtype(FAKE_SCORE_ATTENTION_DTYPE) if FAKE_SCORE_ATTENTION_DTYPE else precision.compute_dtype
    gan_head = functools.partial(build_gan_head, native_size=unet.gan_head_size(unet_dir, sdxl, GAN_HEAD_FEATURES),
                                 mesh=mesh, precision=precision, device=d.device, seed=SEED,
                                 cpu_offload=sharding.cpu_offload, features=GAN_HEAD_FEATURES) if USE_GAN else None
    models = unet.build_dmd_models(unet_dir, mesh, precision, d.device, sharding=sharding, block_classes=BLOCK_CLASSES,
                                   ema_decay=EMA_DECAY, seed=SEED, gan_head=gan_head, head_features=GAN_HEAD_FEATURES,
                                   lora=run.lora, fake_lora=FAKE_LORA, fake_compute=fake_compute,
                                   fake_attention=fake_attention, channels_last=CHANNELS_LAST,
                                   generator_init=GENERATOR_INIT, base_dtype=BASE_DTYPE)
    generator, fake, head = (models.get(k) for k in ("generator", "fake", "head"))
    if GENERATOR_INIT and not run.resume_path:
        print0(f"generator initialised from {GENERATOR_INIT} (fake score and teacher from {unet_dir})")
    teacher_dtype = precision.frozen_dtype(TEACHER_DTYPE)
    teacher = unet.build_unet(unet_dir, mesh, teacher_dtype, d.device, policy=Precision.frozen_mp_policy(teacher_dtype),
                              trainable=False, sharding=sharding, block_classes=BLOCK_CLASSES,
                              channels_last=CHANNELS_LAST)
    guidance = fake if head is None else nn.ModuleDict({"fake": fake, "head": head})
    train_gen, train_fake = generator, fake
    if mesh is None:  # DDP wrappers for the training forwards only
        train_gen, train_fake = fsdp_utils.apply_ddp(generator, d.device), fsdp_utils.apply_ddp(fake, d.device, False)
    vae_dtype = parse_dtype(VAE_DTYPE) if VAE_DTYPE else (torch.float32 if sdxl else precision.compute_dtype)
    tokenizers, text_encoders, vae = unet.load_frozen_parts(MODEL_PATH, sdxl,
                                                            precision.frozen_dtype(TEXT_ENCODER_DTYPE), vae_dtype,
                                                            VAE_PATH, d.device)
    watch_model_flops(run, [generator, fake, teacher], vae)  # MFU: the UNets' FLOPs; the VAE's apart
    alphas = unet.train_alphas(MODEL_PATH, d.device)
    resolution, latent_shape = unet.latent_layout(RESOLUTION, vae.config, generator.config)
    computes = {"fake": fake_compute, "head": torch.float32}  # FAKE_SCORE_FP32; the head always (build_gan_head)
    audit = [component_row(n, m, computes.get(n, precision.compute_dtype)) for n, m in models.items()]
    audit += [component_row(n, m, m.dtype) for n, m in zip(("teacher", "text_encoder", "text_encoder_2"),
                                                            (teacher, *text_encoders))]
    encode = unet.text_encoding(tokenizers, text_encoders, sdxl, resolution, d.device)
    if PROMPT_CACHE > 0:
        encode = unet.PromptCache(encode, PROMPT_CACHE)
    inputs = functools.partial(unet_inputs, d=d, encode=encode, sdxl=sdxl, vae=vae, teacher=teacher, head=head,
                               alphas=alphas, rows=rows, real_rows=real_rows, sample_rows=sample_rows,
                               val_rows=val_rows, resolution=resolution, latent_shape=latent_shape, step_list=step_list)
    return Setup(models, teacher, (train_gen, train_fake), guidance, audit + [component_row("vae", vae, vae.dtype)],
                 f"{resolution} px, latents {latent_shape}", len(step_list), skipped, inputs)


def unet_inputs(final_weights, *, d, encode, sdxl, vae, teacher, head, alphas, rows, real_rows, sample_rows,
                val_rows, resolution, latent_shape, step_list) -> tuple[StepFns, Callable, Callable, Callable | None]:
    """The UNet family's step: fixed inputs (the unconditional embedding of the teacher's CFG, sample
    prompts and noise), batches (prompt embeddings, real latents, per-sample draws), losses, and with
    VAL_EVERY the validator (the teacher's reference by DDIM under the DM loss's CFG)."""
    uncond = unet.unconditional(encode, sdxl)
    sample_prompts, sample_noise, sample_sim = unet.dmd_sample_inputs(sample_rows, SAMPLE_COUNT, latent_shape,
                                                                      len(step_list) - 1, SEED)
    sample_noise, sample_sim = sample_noise.to(d.device), sample_sim.to(d.device)  # drawn on the host, moved once
    sample_text = encode(sample_prompts)

    def sample(path):
        with final_weights() as model:
            unet.write_samples(model, vae, sample_text, sample_noise, sample_sim, step_list, alphas, path)
    losses = dm.Losses(head, GEN_CLS_LOSS_WEIGHT, GUIDANCE_CLS_LOSS_WEIGHT, DIFFUSION_GAN, REAL_GUIDANCE_SCALE,
                       REAL_GUIDANCE_NORM)
    validator = dmd_val.unet_validator(
        val_settings(), final_weights, room=unet, rows=val_rows, encode=encode, uncond=uncond,
        latent_shape=latent_shape, step_list=step_list, alphas=alphas, teacher=teacher, vae=vae,
        resolution=resolution, device=d.device) if val_rows else None
    draw = functools.partial(unet_dm.draw_sample_noise, shape=latent_shape, n_sim=len(step_list) - 1,
                             num_train_timesteps=len(alphas), step_percent=(MIN_STEP_PERCENT, MAX_STEP_PERCENT),
                             gan_max_t=DIFFUSION_GAN_MAX_TIMESTEP if USE_GAN else None)

    steps = StepFns(
        batches=lambda it, loaded: unet.dmd_micro_batches(it, loaded, SEED, d.device, draw, encode, vae),
        images=lambda model, mb, index: unet_dm.generator_images(model, mb, step_list, index, alphas),
        generator_loss=lambda x, mb, fake_: unet_dm.generator_loss(x, mb, teacher, fake_, alphas, uncond, losses),
        guidance_loss=lambda x, mb, fake_: unet_dm.guidance_loss(x, mb, fake_, alphas, losses))
    load = functools.partial(unet.load_dmd_step, rows=rows, batch_size=BATCH_SIZE, grad_accum=GRAD_ACCUM, seed=SEED,
                             d=d, real_size=resolution if USE_GAN else None, real_rows=real_rows,
                             caption_dropout=CAPTION_DROPOUT)
    return steps, load, sample, validator


def build_flow_transformers(run: trainer.Run, room, prec: Precision, base_lora=None) -> tuple:
    """(mesh, CP mesh or None, generator, fake score, teacher, EMA or None, the fake's compute dtype, the teacher's
    dtype):
    the three transformers of a flow-matching teacher built by its room, in this order: generator and
    fake score trainable (LoRA or full), the teacher frozen (NF4 with an NF4 LoRA base), the EMA sharded
    as the generator. With `base_lora` (TEACHER_LORA's adapters) all three load base + it (merged in fp32 as
    they load, before NF4): the fine-tune is the teacher and where both students start."""
    d = run.d
    mesh, cp_mesh, sharding = trainer.mesh_and_sharding(run, CONTEXT_PARALLEL)
    nf4 = BASE_DTYPE == "nf4" and bool(run.lora)
    fake_compute = torch.float32 if FAKE_SCORE_FP32 else prec.compute_dtype
    teacher_dtype = prec.frozen_dtype(TEACHER_DTYPE)
    build = functools.partial(room.build_transformer, os.path.join(MODEL_PATH, "transformer"), mesh, prec,
                              d.device, sharding=sharding, block_classes=BLOCK_CLASSES,
                              attention_backend=ATTENTION_BACKEND,
                              merge=base_lora, fp8=FP8)
    generator = build(load=True, lora=run.lora, seed=SEED, base_dtype=BASE_DTYPE if run.lora else "")
    if GENERATOR_LORA or GENERATOR_LORA_2:  # before the EMA copies it
        for part, delta in part_deltas(generator, read_lora_parts(run.pipeline, teacher=False)):
            lora_merge.load_adapters(part, delta)
        files = dmd_settings.lora_files(current_settings(), run.pipeline, False)
        print0("generator: its adapters from " + ", ".join(f"{n}={f}" for n, f, _ in files))
    fake_lora = run.lora if FAKE_LORA else lora_lib.Lora()
    fake = build(load=True, lora=fake_lora, seed=SEED + 1, compute=fake_compute,
                 base_dtype=BASE_DTYPE if fake_lora else "")
    teacher = build(load=True, trainable=False, frozen_dtype=teacher_dtype, base_dtype="nf4" if nf4 else "")
    generator.train()
    fake.train()
    ema = ema_lib.build_ema(generator, EMA_DECAY, functools.partial(build, load=False, lora=run.lora, seed=SEED,
                                                                    base_dtype=BASE_DTYPE if run.lora else "",
                                                                    sharding=sharding.never_backward()))
    return mesh, cp_mesh, generator, fake, teacher, ema, fake_compute, teacher_dtype


def flow_models(generator, fake, ema, mesh, side: int, prec: Precision, device: torch.device) -> tuple:
    """(what checkpoints hold: generator, fake[, head][, ema]; the GAN head or None; what the guidance
    optimizer steps: the fake score [+ head]) of a flow-matching run. With USE_GAN the head reads the
    fake's image stream after its double-stream blocks (algorithms/dmd2_flow.py), in fp32."""
    models = {"generator": generator, "fake": fake}
    head = None
    if USE_GAN:
        width = generator.config.num_attention_heads * generator.config.attention_head_dim
        grid = flow_dm.head_grid(side)
        head = build_gan_head(width, grid, mesh, prec, device, SEED, CPU_OFFLOAD,
                              make=functools.partial(flow_dm.TransformerHead, width, grid))
        models["head"] = head
    if ema is not None:
        models["ema"] = ema
    return models, head, fake if head is None else nn.ModuleDict({"fake": fake, "head": head})


# ----------------------------------------------------------------------------------------------
# flow-matching teachers (FLUX.1 Kontext and text-to-image, Qwen-Image-Edit): one story, the room says
# what differs. Rows are read, bucketed and loaded as train_flux_kontext.py reads them (data/buckets.py):
# each row's target at RESOLUTION^2 pixels by its bucket, its references at the family's sizes, one
# shape per global batch; text from the cache its fine-tuning fills


@dataclass(frozen=True)
class FlowData:
    """The rows of a flow teacher's run and their shapes (target (h, w), (each reference's (h, w)))."""
    rows: list  # training rows
    skipped: int  # bad rows skipped
    shapes: list  # the training shapes, numbered by first appearance
    members: list  # rows of each shape
    schedule: list  # (shape, k) of each iteration: one shape per global batch (data/buckets.bucket_schedule)
    sample_rows: list  # the sample grids' rows
    sample_shapes: list  # each sample row's shape
    edits: bool = True  # rows with references (else prompts alone: text to image)
    loader: Callable | None = None  # how the family's pipeline reads an image (room.image_loader; None: stretched)
    val_rows: list = field(default_factory=list)  # VAL_EVERY's rows (validation_rows)
    val_shapes: list = field(default_factory=list)  # each validation row's shape


def flow_data(room, settings: dict) -> FlowData:
    """Rows {"control"(s), "prompt"[, "target"]} (an editing teacher; the target is the GAN's real image,
    required with USE_GAN, and shown beside the samples) or {"prompt"} (text-to-image), the sample rows
    (the first SAMPLE_COUNT distinct ones of SAMPLE_PROMPTS or the data), their shapes and schedule."""
    edits = room.edits(settings["PIPELINE"]) and source_kind(DATA_PATH) != "txt"  # FLUX.2 takes prompts alone too
    roles, required = (("control", "target", "prompt"), ("control", "prompt")) if edits else (("prompt",),) * 2
    roles = ("target", *roles) if USE_GAN and not edits else roles  # a video room's real clips
    read = functools.partial(read_rows, roles=roles, split=DATASET_SPLIT, size_of="target" if edits else "",
                             columns={"control": CONTROL_COLUMN, "target": TARGET_COLUMN, "prompt": PROMPT_COLUMN},
                             max_references=MAX_REFERENCES or room.MAX_REFERENCES)
    rows, skipped = read(DATA_PATH, required=required + (("target",) if USE_GAN else ()), skip_bad=SKIP_BAD_SAMPLES,
                         control_path=CONTROL_PATH)
    if USE_GAN:  # e.g. a real clip's frame count, before any work
        getattr(room, "check_targets", lambda *_: None)(rows, settings)
    samples = (read(SAMPLE_PROMPTS, required=required, skip_bad=False, setting="SAMPLE_PROMPTS")[0] if SAMPLE_PROMPTS
               else rows)
    distinct = {(str(references(r)), r["prompt"]): r for r in reversed(samples)}  # the first of each
    sample_rows = list(reversed(distinct.values()))[:SAMPLE_COUNT]
    buckets = make_buckets(settings["RESOLUTION"], BUCKET_ASPECTS, 2 * room.vae_factor(MODEL_PATH))
    shapes, shape_of = row_shapes(room, rows, buckets, settings, seeded=False)
    members, schedule = bucket_schedule(shape_of, MAX_STEPS, SEED)
    sample_shapes = [s[i] for s, of in [row_shapes(room, sample_rows, buckets, settings, seeded=False)] for i in of]
    val_rows = dmd_val.validation_rows(val_settings(), rows, lambda r: (str(references(r)), r["prompt"]), lambda: read(
        VAL_PROMPTS, required=required, skip_bad=False, setting="VAL_PROMPTS")[0])
    val_shapes = [s[i] for s, of in [row_shapes(room, val_rows, buckets, settings, seeded=False)] for i in of]
    print0(f"data: {len(rows)} {'rows' if edits else 'prompts'} from {DATA_PATH}"
           + (f", {skipped} bad rows skipped" if skipped else "") + f"; {len(sample_rows)} sample rows; shapes "
           + ", ".join(f"{h}x{w}" + "".join(f" + {a}x{b}" for a, b in refs) + f": {len(m)}"
                       for ((h, w), refs), m in zip(shapes, members)))
    return FlowData(rows, skipped, shapes, members, schedule, sample_rows, sample_shapes, edits,
                    room.image_loader(settings), val_rows, val_shapes)


def flow_setup(run: trainer.Run, room, timesteps: list[int], prec: Precision) -> Setup:
    """DMD2 with a flow-matching teacher: generator, fake score and teacher are the family's transformers
    built by its room (as train_flux_kontext.py builds its one), the text comes from the cache fine-tuning
    fills (with the negative prompt's, for a teacher that samples with true CFG), every reference is read
    as fine-tuning reads it, and the step is algorithms/dmd2_flow.py's, in the same loop as the UNets'."""
    d = run.d
    settings = {**script_constants(globals()), "RESOLUTION": RESOLUTION or room.DEFAULT_RESOLUTION,
                "PIPELINE": run.pipeline}
    # the student's σ: DENOISING_STEPS' (t + 1) / 1000, or the list a video room's export scheduler makes itself
    sigmas = getattr(room, "generator_sigmas", lambda _, s: s)(MODEL_PATH, flow_dm.timestep_sigmas(timesteps))
    data = flow_data(room, settings)
    if CONTEXT_PARALLEL > 1:  # every shape a forward sees splits evenly, before any model is built
        room.check_context_parallel(MODEL_PATH, CONTEXT_PARALLEL, settings,
                                    data.shapes + data.sample_shapes + data.val_shapes)
    trainer.check_attention(run, *room.edit_attention_shapes(MODEL_PATH, settings, data.shapes, BATCH_SIZE,
                                                             CONTEXT_PARALLEL), prec.compute_dtype)

    # the text cache (the encoders loaded only where entries are missing, then freed), before the models
    cache_dir = TEXT_CACHE_DIR or run.output("text_cache")
    guide = room.dmd_guidance(settings)  # an embedded guidance value, or the teacher's CFG pair and its negative
    texts = [(r["prompt"], r) for r in data.rows + data.sample_rows + data.val_rows]
    texts += [(room.UNCONDITIONAL_PROMPT, r) for r in data.rows] if CAPTION_DROPOUT > 0 else []
    texts += [(guide.negative, r) for r in data.rows] if guide.negative is not None else []
    reference = dmd_val.reference_guidance(room, settings)  # the validation teacher's
    texts += [(reference.negative, r) for r in data.val_rows] if reference.negative is not None else []
    identity = room.prepare_edit_text(texts, MODEL_PATH, cache_dir, settings, prec.frozen_dtype(TEXT_ENCODER_DTYPE),
                                      d.device)

    # models: generator and fake score (trainable, LoRA or full), teacher (frozen; NF4 with a NF4 LoRA base)
    factor = room.vae_factor(MODEL_PATH)
    # read once (the builds and the export); another tool's key form through the pipeline's lora_state_dict
    base_lora = read_lora_parts(run.pipeline, teacher=True)
    mesh, cp_mesh, generator, fake, teacher, ema, fake_compute, teacher_dtype = build_flow_transformers(
        run, room, prec, base_lora)
    dp = split_sequences((generator, fake, teacher, ema), cp_mesh, CONTEXT_PARALLEL, d.world_size)
    models, head, guidance = flow_models(generator, fake, ema, mesh, min(data.shapes[0][0]) // factor, prec,
                                         d.device)
    vae_dtype = parse_dtype(VAE_DTYPE) if VAE_DTYPE else prec.compute_dtype
    vae = room.load_vae(VAE_PATH or os.path.join(MODEL_PATH, "vae"), vae_dtype, d.device)
    watch_model_flops(run, [generator, fake, teacher], vae)  # MFU: the transformers' FLOPs; the VAE's apart
    computes = {"fake": fake_compute, "head": torch.float32}
    audit = [component_row(n, m, computes.get(n, prec.compute_dtype)) for n, m in models.items()]
    audit += [component_row("teacher", teacher, teacher_dtype), component_row("vae", vae, vae.dtype)]
    (h, w), refs = data.shapes[0]
    grid = functools.partial(flow_dm.latent_grid, room, factor=factor, settings=settings)  # (size px) -> latent grid
    tokens = [flow_dm.token_count(grid(s)) for s in ((h, w), *refs)]
    frames = f" x {grid((h, w))[0]} latent frames" if len(grid((h, w))) > 2 else ""  # a video room's
    words = getattr(room, "REFERENCE_WORDS", None)  # a reference that adds no tokens (a video's first frame)
    caption = (f"{h}x{w} px{frames} ({len(data.shapes)} shape(s)), {tokens[0]} target"
               + "".join(f" + {t} reference" for t in tokens[1:] if words is None) + " tokens"
               + (f" + {words}" if words and refs else "") + f", σ {sigmas}, " + guide.words())
    inputs = functools.partial(flow_inputs, room=room, d=d, dp=dp, vae=vae, teacher=teacher, head=head, data=data,
                               sigmas=sigmas, cache_dir=cache_dir, identity=identity, guide=guide, grid=grid,
                               channels=room.latent_channels(vae), edits=data.edits)
    index = room.distilled_index(MODEL_PATH)
    note = export_note(run, guide, sigmas, index, own_sigmas=hasattr(room, "generator_sigmas"),
                       more=list(getattr(generator, "pipeline_parts", dict)())[1:])
    return Setup(models, teacher, (generator, fake), guidance, audit, caption, len(sigmas), data.skipped, inputs,
                 dit.student_sampler(room.distilled_scheduler(MODEL_PATH, sigmas), STUDENT_SAMPLE_TYPE), note, index,
                 base_lora)


def load_flow_step(it: int, *, room, data: FlowData, cache_dir: str, identity: str, negative: str | None,
                   dp: tuple[int, int]) -> dict:
    """Host side of iteration `it` on this rank (the Prefetcher runs it a step ahead): the step's shape
    and, per micro-batch, this rank's positions in the global batch, the cached text of its prompts
    (the family's unconditional one where CAPTION_DROPOUT drops one; `negative`'s for the teacher's CFG
    pair), its reference images and, with USE_GAN, its targets, on CPU."""
    shape = data.shapes[data.schedule[it][0]]
    dp_rank, dp_size = dp  # the ranks of a CP group read the same samples
    indices = step_indices(it, data.members, data.schedule, BATCH_SIZE * dp_size * GRAD_ACCUM, SEED)
    cpu, batches = torch.device("cpu"), []
    for m in range(GRAD_ACCUM):
        mine = micro_batch_positions(m, BATCH_SIZE * dp_size, dp_rank, dp_size)
        picked = [data.rows[indices[i]] for i in mine]
        prompts = drop_captions([r["prompt"] for r in picked], SEED, it, mine, CAPTION_DROPOUT,
                                room.UNCONDITIONAL_PROMPT)
        references_, target = load_pairs(picked, shape, [False] * len(picked), target=USE_GAN, loader=data.loader)
        batches.append({"mine": mine, "text": room.load_text(list(zip(prompts, picked)), cache_dir, identity, cpu),
                        "negative": (room.load_text([(negative, r) for r in picked], cache_dir, identity, cpu)
                                     if negative is not None else None),
                        "references": references_, "target": target})
    return {"shape": shape, "batches": batches}


def flow_inputs(final_weights, *, room, d, dp, vae, teacher, head, data: FlowData, sigmas, cache_dir, identity,
                guide: dm.Guidance, grid, channels, edits) -> tuple[StepFns, Callable, Callable, Callable | None]:
    """A flow teacher's step: fixed sample inputs (per sample shape, in order of first appearance: its
    rows' text and references, noise of the whole σ list), batches (cached text, packed references
    and real tokens, per-sample draws at the step's shape), losses, and with VAL_EVERY the validator. `grid`: a
    target's latent grid (its size px -> (h/f, w/f), a video's (T, h, w)); tokens by the room's pack_latents."""
    pack = getattr(room, "pack_latents", km.pack_latents)
    guidance = 1.0 if guide.embedded is None else guide.embedded  # all three transformers' input; CFG in Losses
    ode = STUDENT_SAMPLE_TYPE == "ode"  # between the student's steps, here as in the export's scheduler
    groups = flow_samples.sample_groups(
        room, data.sample_rows, data.sample_shapes, loader=data.loader, grid=grid, channels=channels, sigmas=sigmas,
        pack=pack, vae=vae, cache_dir=cache_dir, identity=identity,
        g=step_generator(SEED, 0, stream=SAMPLE_NOISE_STREAM), device=d.device, edits=edits)

    def sample(path):
        with final_weights() as model:
            flow_samples.write_samples(room, model, vae, groups, sigmas, guidance, edits, path, ode)
    validator = dmd_val.flow_validator(
        val_settings(), final_weights, room=room, rows=data.val_rows, shapes=data.val_shapes, loader=data.loader,
        guide=guide, sigmas=sigmas, cache_dir=cache_dir, identity=identity, teacher=teacher, vae=vae, grid=grid,
        pack=pack, channels=channels, device=d.device, ode=ode) if data.val_rows else None

    shifts = {s[0]: flow_shift(s[0], flow_dm.token_count(grid(s[0]))) for s in data.shapes}
    losses = dm.Losses(head, GEN_CLS_LOSS_WEIGHT, GUIDANCE_CLS_LOSS_WEIGHT, DIFFUSION_GAN,
                       real_guidance_scale=guide.scale, real_guidance_norm=guide.norm, fake_target=FAKE_SCORE_TARGET,
                       real_guidance_scale_2=guide.scale_2,
                       regression_weight=REGRESSION_WEIGHT, regression_steps=REGRESSION_STEPS, dmd_loss=DMD_LOSS,
                       ca_weight=DMD_CA_WEIGHT, dm_weight=DMD_DM_WEIGHT, diversity_weight=DIVERSITY_WEIGHT,
                       diversity_anchor=DIVERSITY_ANCHOR)
    # DIVERSITY_WEIGHT's teacher ODE: the σ schedule the teacher's pipeline samples at each shape
    ode_shifts = {s[0]: dit.teacher_sampling_shift(room, MODEL_PATH, flow_dm.token_count(grid(s[0])), REGRESSION_STEPS)
                  for s in data.shapes} if DIVERSITY_WEIGHT else {}

    def batches(it, loaded):
        (h, w), _ = loaded["shape"]
        size = grid((h, w))
        index = dm.choose_step_index(it, SEED, len(sigmas)) if len(sigmas) > 1 else 0  # run_loop's, for the CA σ
        draw = functools.partial(flow_dm.draw_sample_noise, shape=(channels, *size), n_sim=len(sigmas) - 1,
                                 sigma_range=(MIN_STEP_PERCENT, MAX_STEP_PERCENT),
                                 gan_max_sigma=DIFFUSION_GAN_MAX_TIMESTEP / 1000 if USE_GAN else None,
                                 shift=shifts[(h, w)], ca_max_sigma=sigmas[index] if DMD_LOSS == "decoupled" else None)
        out = []
        for host in loaded["batches"]:
            mb = flow_dm.pack_draws(per_sample_draws(SEED, it, host["mine"], d.device, draw), pack)
            mb["cond"] = room.dmd_cond(host["text"], host["negative"], vae, host["references"], size)
            mb["step_index"], mb["ode_shift"] = index, ode_shifts.get((h, w))
            if host["target"] is not None:  # the GAN's real images: the rows' targets, encoded as the references are
                mb["real"] = room.image_tokens(vae, host["target"])
            out.append(mb)
        return out
    steps = StepFns(
        batches=batches,
        images=lambda model, mb, index: flow_dm.generator_images(model, mb, sigmas, index, guidance, ode),
        generator_loss=lambda x, mb, fake_: flow_dm.generator_loss(x, mb, teacher, fake_, guidance, losses),
        guidance_loss=lambda x, mb, fake_: flow_dm.guidance_loss(x, mb, fake_, guidance, losses))
    load = functools.partial(load_flow_step, room=room, data=data, cache_dir=cache_dir, identity=identity,
                             negative=guide.negative, dp=dp)
    return steps, load, sample, validator


def flow_shift(size: tuple[int, int], tokens: int) -> float:
    """SHIFT's value for a target of `size` px, `tokens` tokens (SHIFT=auto: the teacher pipeline's own there)."""
    shift = km.sigma_shift(SHIFT, dit.scheduler_config(MODEL_PATH), tokens)
    if SHIFT != "1":
        print0(f"σ shift of the DM loss and the fake score at {size[0]}x{size[1]}: {shift:.3f} ({tokens} target "
               f"tokens, SHIFT={SHIFT})")
    return shift


def export_note(run: trainer.Run, guide: dm.Guidance, sigmas: list[float], index: dict, own_sigmas=False,
                more=()) -> str:
    """How to sample the export: every export carrying the generator samples in len(sigmas) steps with
    the scheduler made for it (`own_sigmas`: which makes the list itself), without the teacher's guidance pair;
    `more`: the pipeline components the generator holds after its first (a LoRA of each in export/<name>)."""
    n = len(sigmas)
    call = (f"num_inference_steps={n}" if own_sigmas or sigmas == [1 - i / n for i in range(n)] else
            f"num_inference_steps={n}, sigmas={sigmas}")
    kwargs = "".join(f", {k}={v}" for k, v in index.items())  # what the export's model_index.json sets
    if MAX_SEQUENCE_LENGTH != _DEFAULTS["MAX_SEQUENCE_LENGTH"]:  # the pipelines' default: the text it trained with
        call += f", max_sequence_length={MAX_SEQUENCE_LENGTH}"
    how = (f"{run.pipeline}.from_pretrained(export)" if not run.lora else
           f"{run.pipeline}.from_pretrained(MODEL_PATH{kwargs}) + load_lora_weights(export) + "
           + "".join(f"load_lora_weights(export/{m}, load_into_{m}=True) + " for m in more) + "its scheduler "
           "FlowMatchEulerDiscreteScheduler.from_pretrained(export, subfolder='scheduler')"
           + (f", or {run.pipeline}.from_pretrained(export_merged)" if LORA_EXPORT_MERGED else ""))
    return f"sampling the export: {how}; pipe(..., {call}{', ' + guide.export_call if guide.export_call else ''})"


# ----------------------------------------------------------------------------------------------
# main: config -> distributed init -> the family's setup (models meta, sharded, loaded; VAE; data) ->
# optimizers -> resume -> loop -> export -> teardown (components/trainer.py: what both scripts do
# before and after the loop)


def main() -> None:
    run, step_list = trainer.start(globals(), validate_config, resolve_defaults)
    room = families.FAMILIES[run.pipeline]  # the model family: every flow-matching room shares one setup
    family = (unet_setup if room is unet else flow_setup)(run, room, step_list, get_precision(PRECISION))
    generator, fake, ema = (family.models.get(k) for k in ("generator", "fake", "ema"))

    # optimizers: separate AdamW for the generator and for the guidance side (fake score + head)
    opt_g, sched_g = make_optimizer(generator, GENERATOR_LR, WARMUP_STEPS)
    opt_d, sched_d = make_optimizer(family.guidance, GUIDANCE_LR, WARMUP_STEPS)
    float8.precompute_scales_after_steps(opt_g, generator)  # FP8=tensorwise: the next all-gathers' scales
    float8.precompute_scales_after_steps(opt_d, fake)
    trainer.report_components(run, family.caption, family.audit, {**family.models, "teacher": family.teacher},
                              {"generator": opt_g, "guidance": opt_d})

    # checkpoints (the checkpointer decides when), resume; or weights only from INIT_FROM
    start = trainer.restore(run, family.models, {"generator": (generator, opt_g), "guidance": (family.guidance, opt_d)},
                            {"generator": sched_g, "guidance": sched_d})
    if not run.resume_path and INIT_FROM:
        init_from(INIT_FROM, generator, fake, ema)
    for model in (generator, fake):  # FP8=tensorwise: the scales of the weights as they start
        float8.refresh_scales(model)

    # the loop, on the family's fixed inputs, batches and losses
    final_weights = functools.partial(ema_lib.output_weights, generator, ema)  # what samples show, export writes
    steps, load, sample, validator = family.inputs(final_weights)
    if validator is not None:
        validator.before_stop = run.ckpt.wait  # COLLAPSE_STOP: a save in flight is finished first
        if run.resume_path:  # the collapse warning goes on from the first run's best variety ratio
            validator.best = checkpoint.read_meta(run.resume_path).get("val_best", 0.0)
    run_loop(run, start, steps, load, family.n_steps, family.models, (*family.trained, family.guidance),
             (opt_g, opt_d), (sched_g, sched_d), sample, family.skipped, validator)

    # export
    if family.export_note:
        print0(family.export_note)
    trainer.finish(run, final_weights, frozen={"vae": VAE_PATH} if VAE_PATH else None, scheduler=family.scheduler,
                   base_lora=family.base_lora, index=family.index)


if __name__ == "__main__":
    run_main(main)
