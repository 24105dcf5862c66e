"""LoRA or full fine-tuning of an image-editing model with FSDP2, on samples (reference image(s),
edited target image, instruction): FLUX.1 Kontext (one context image), Qwen-Image-Edit-2509 / 2511
(one to three references), FLUX.2 [klein] / [dev] or Z-Image Omni (up to four), chosen by model_index.json
through families.FAMILIES; the family's room (families/flux/, qwen_image/, flux2/, z_image/) holds its
models, conditioning, latents and samples.

The transformer (12 B for FLUX.1 Kontext, 20 B for Qwen-Image-Edit) is the only trained part: it is
built on the meta device, sharded per block by its recipe (parallel/parallelize.py), and each rank
loads only its slices of the weights. The VAE is frozen and replicated; the text encoders (FLUX: CLIP
and T5; Qwen: Qwen2.5-VL, which also sees the reference images) run once before training to fill an
on-disk embedding cache and are freed.

    # 2 ranks (GPUs, or CPU with gloo) on the embedded default: the shipped tiny Kontext base
    # (assets/kontext_base) fine-tuned on the shipped "make it blue" pairs (assets/kontext_blue)
    torchrun --standalone --nproc_per_node=2 train_flux_kontext.py
    # one process, for debugging (same numbers as 2 ranks with half the per-rank batch)
    python train_flux_kontext.py --batch_size=2 --max_steps=20
    # real weights on 4 x 24 GB GPUs, the settings that
    #   python tools/memory_plan.py --model=flux-kontext-dev --world_size=4 --gpu_memory_gb=24
    # finds to fit: edit the paths, then
    bash recipes/kontext_4x24gb.sh
    # the "make it blue" demo: fine-tune the shipped base, then score base vs tuned
    bash demos/demo_kontext.sh
    # after a stop or preemption: the same command plus --resume=auto

Data (docs/data.md, "Your data"): a .jsonl of {"control": input image, "target": edited image, "prompt":
instruction} rows (paths relative to the file; "image" + "target", as the shipped pairs name them, also
reads), a folder of targets with same-stem .txt captions and a control/ folder (ai-toolkit's and
musubi-tuner's layout), or a Hugging Face datasets table; without any reference (an "image" and a prompt per
row, a caption folder without control/) the family's text-to-image model trains (FLUX.2, Z-Image). Outputs in
OUTPUT_DIR: metrics.jsonl, samples/step_XXXXXX.png (context | output | target per held-out pair),
checkpoints/step_XXXXXX/, export/ (a diffusers folder for FluxKontextPipeline.from_pretrained; with LORA_RANK > 0
the adapters, export/pytorch_lora_weights.safetensors, for pipe.load_lora_weights), text_cache/.

LoRA (LORA_RANK > 0): peft adapters on the transformer's attention and MLP projections, in fp32,
trained on a frozen base stored in the compute dtype, both sharded in the same per-block FSDP
units (parallel/lora.py says why); checkpoints hold only the adapters and their optimizer state.
    torchrun --standalone --nproc_per_node=2 train_flux_kontext.py --lora_rank=16 --lr=1e-4

Context parallelism (CONTEXT_PARALLEL = C > 1, for long sequences: Kontext at 1024 px is 8192 image
tokens + 512 text tokens per sample): each group of C consecutive ranks takes the same samples and
splits their token sequence C ways, with diffusers' Ulysses attention; FSDP2 still shards over all
ranks (fsdp_utils.build_meshes, parallel/context_parallel.py). Same updates as without it.
    torchrun --standalone --nproc_per_node=8 train_flux_kontext.py --context_parallel=4

Choices worth knowing: a global batch always comes from one resolution bucket (see
bucket_schedule), because the transformer's position ids are shared by the batch; latents are
encoded by the frozen VAE at every step unless CACHE_LATENTS (then once, beside the text cache; not
with RANDOM_FLIP, whose flips need fresh encodings); everything random in a step is drawn from (SEED, step),
so any world size / GRAD_ACCUM split gives the same updates and a resume continues bit for bit.

    python -m pytest tests/test_train_flux_kontext.py -q
"""
from __future__ import annotations

import functools
import hashlib
import os

import torch

import fsdp_utils
import precision
from algorithms import flux_kontext as km
from components import optim, profiling, trainer
from components.config import check_settings, script_constants
from core.dist import print0
from core.errors import ConfigError, run_main
from components.metrics import counting_flops, watch_model_flops
from components.optim import warmup_scheduler
from data.batches import micro_batch_positions
from data.buckets import (assign_buckets, bucket_schedule, load_pairs, make_buckets, mirrored_rows,  # noqa: F401
                          references, row_shapes, step_flips, step_indices, stretched)
from data.images import load_image, save_image_grid
from data.prefetch import Prefetcher
from data.randomness import VALIDATION_STREAM, drop_captions, per_sample_draws, step_generator
from data.sources import read_rows, text_to_image_source
from data.text_cache import cache_file, fill_in_rounds, save_atomic  # noqa: F401 - cache_file: read by tests
import families
from families.flux import encoder_identity  # noqa: F401 - the FLUX text cache's key, read by tests
from parallel import ema as ema_lib
from parallel.context_parallel import check_diffusers_supports_it, split_sequences
from parallel import attention, float8

# ----------------------------------------------------------------------------------------------
# config (every UPPER_CASE constant can be overridden as --name=value; the groups and the shared
# settings are in the same order in train_dmd.py, and mean the same: components/trainer.py)

# models and data
MODEL_PATH = ""  # FLUX.1 Kontext, Qwen-Image-Edit-2509/2511 or FLUX.2 folder (model_index.json); "" = the tiny Kontext
DATA_PATH = ""  # .jsonl {"control", "target", "prompt"}, folders, datasets (no control: text to image); "" = shipped
CONTROL_PATH = ""  # folder layout: the input images, matched to targets by stem; "" = DATA_PATH/control
MAX_REFERENCES = 0  # reference images per sample at most; 0 = the family's (Kontext 1, Qwen-Image-Edit 3, FLUX.2 4)
VAL_DATA_PATH = ""  # held-out pairs for samples and validation; "" = the last NUM_SAMPLE_PAIRS of DATA_PATH
OUTPUT_DIR = "out/flux_kontext"  # metrics.jsonl, samples/, checkpoints/, export/, text_cache/
RESOLUTION = 0  # target area = RESOLUTION^2 pixels; 0 = the family's pipeline's (1024), or the embedded default's 32
REFERENCE_AREA = 0  # Qwen-Image-Edit, FLUX.2: pixels of each reference the transformer sees; 0 = the pipeline's 1024^2
SKIP_BAD_SAMPLES = False  # bad data rows: False = stop with file:line, True = skip and count
DATASET_SPLIT = "train"  # datasets sources: the split to read (a save_to_disk DatasetDict or a hub dataset)
PROMPT_COLUMN = ""  # datasets sources: the prompt column; "" = the first of prompt, caption, text, instruction
CONTROL_COLUMN = ""  # datasets sources: the input image column; "" = control, context or source
TARGET_COLUMN = ""  # datasets sources: the edited image column; "" = target or edited (or image beside control)
CAPTION_DROPOUT = 0.0  # probability that a sample's prompt is replaced by "" (exact on resume)
TEXT_CACHE_DIR = ""  # text-embedding cache; "" = OUTPUT_DIR/text_cache (share it between runs)
CACHE_LATENTS = False  # encode each pair's images once per bucket into TEXT_CACHE_DIR/latents (no VAE in the step)
BUCKET_ASPECTS = [0.5, 0.75, 1.0, 1.333, 2.0]  # width/height ratios of the resolution buckets
RANDOM_FLIP = False  # flip context and target together, left-right, with probability 0.5
# schedule
MAX_STEPS = 200  # optimizer steps
BATCH_SIZE = 1  # pairs per rank per micro-batch
GRAD_ACCUM = 1  # micro-batches per optimizer step; global batch = BATCH_SIZE × data-parallel ranks × GRAD_ACCUM
SEED = 0  # data order, noise, timesteps, sample seeds: all drawn from (SEED, step), identical on every rank
# optimizer: AdamW
LR = 1e-5  # learning rate (full fine-tunes of FLUX use ~1e-5; LoRA uses ~1e-4)
ADAM_BETAS = [0.9, 0.999]  # AdamW betas (torch / diffusers example defaults)
WEIGHT_DECAY = 1e-4  # AdamW weight decay: diffusers' Kontext example's --adam_weight_decay default
ADAM_EPS = 1e-8  # AdamW epsilon
OPTIMIZER = "adamw"  # adamw (torch fused, fp32 states) | adamw8bit | adamw4bit (torchao)
WARMUP_STEPS = 10  # linear LR warmup over this many steps
LR_SCHEDULE = "constant"  # the LR after the warmup: constant | cosine | linear (both decay to 0 at MAX_STEPS)
MAX_GRAD_NORM = 1.0  # clip each model's total grad norm (0 = no clipping); a non-finite norm skips the step
EMA_DECAY = 0.0  # > 0: an EMA of the trained model (LoRA: of its adapters), shown in samples and exported instead of it
# flow matching (the diffusers Kontext example's settings)
MAX_SEQUENCE_LENGTH = 512  # T5 tokens (FLUX uses 512; capped at the tokenizer's model_max_length)
CONDITION_AREA = 0  # Qwen-Image-Edit: pixels of each reference the text encoder sees; 0 = the pipeline's 384^2
GUIDANCE = 0.0  # guidance-embedding value during training; 0 = the family's: Kontext 1, FLUX.2 [dev] 4 (its sampling)
WEIGHTING_SCHEME = "uniform"  # sigma density: uniform | logit_normal | mode (SD3 paper, sec. 3.1)
LOGIT_MEAN = 0.0  # logit_normal mean
LOGIT_STD = 1.0  # logit_normal std
MODE_SCALE = 1.29  # "mode" density scale (SD3 paper's value)
SHIFT = "1"  # σ shift s·σ/(1+(s-1)·σ), > 1 favours noisier σ; auto = the pipeline's own at each step's size
LOSS_WEIGHTING = "none"  # none | sigma_sqrt | cosmap (diffusers' compute_loss_weighting_for_sd3)
# LoRA
LORA_RANK = 0  # 0 = full fine-tuning; > 0 = peft LoRA adapters of this rank on a frozen base (use LR ~1e-4)
LORA_ALPHA = 0.0  # LoRA scaling = alpha / rank; 0 = alpha equal to LORA_RANK
LORA_TARGET_MODULES = []  # [] = the model's (r16: Qwen 23.6 M, FLUX 54.2 M); blocks = all block Linears (105.6, 65.4 M)
LORA_DROPOUT = 0.0  # dropout on the adapters' input
LORA_INIT = "gaussian"  # lora_A's init: gaussian (diffusers' examples) | default (peft's, the official DMD2 run)
BASE_DTYPE = ""  # LoRA: the frozen base's storage; "" = the compute dtype, nf4 = 4-bit NormalFloat (QLoRA)
LORA_EXPORT_MERGED = False  # LoRA: also write OUTPUT_DIR/export_merged/, a full pipeline with the adapters merged
# precision: one table decides every dtype (precision.py); frozen parts are stored in their compute dtype
PRECISION = "bf16-mixed"  # fp32 | bf16-mixed (fp32 master weights, bf16 compute) | bf16 (everything bf16)
FP8 = ""  # transformer blocks' Linears in float8 (torchao): tensorwise (float8 all-gather) | rowwise; "" = off
TEXT_ENCODER_DTYPE = ""  # frozen text encoders' dtype (here: for the text cache); "" = PRECISION's compute dtype
SHARD_TEXT_ENCODER = "auto"  # FLUX.2: the cache fill's encoder FSDP-sharded over the ranks: 1 | 0 | auto (> half a GPU)
VAE_DTYPE = ""  # frozen VAE's dtype; "" = PRECISION's compute dtype
TF32 = True  # CUDA: fp32 matmuls and convolutions in TF32; False = strict fp32
EXPORT_DTYPE = "bf16"  # dtype of the exported trained model (fp16/bf16 halve the file)
EXPORT_SYMLINKS = False  # the export's frozen parts: hard-linked (copied across filesystems); True = symlinks
# parallelism
PARALLELISM = "fsdp"  # fsdp (sharded, FSDP2) | ddp (full replica per rank, DistributedDataParallel)
BLOCK_CLASSES = []  # FSDP units; [] = the model's recipe (parallel/parallelize.py)
DP_REPLICATE = 1  # > 1: HSDP, shard within groups of WORLD_SIZE / DP_REPLICATE ranks, replicate across
CONTEXT_PARALLEL = 1  # ranks that split each sample's token sequence (Ulysses); 1 = off; see docs/parallelism.md
RESHARD_AFTER_FORWARD = "auto"  # 1: free gathered params after each forward (ZeRO-3); 0: keep them; auto: see docs
CPU_OFFLOAD = False  # keep sharded params, grads and optimizer state in host memory
ACTIVATION_CHECKPOINTING = False  # recompute each unit in backward instead of storing its activations
PREFETCH = 1  # units to all-gather ahead in forward / backward (0 = FSDP2's implicit order)
COMPILE = False  # torch.compile each FSDP unit's forward (block), AC -> compile -> fully_shard
ATTENTION_BACKEND = "native"  # native (torch SDPA, cuDNN off) | _native_cudnn | _native_flash | ...; checked at start
# fault tolerance
MAX_BAD_STEPS = 10  # non-finite loss/grad steps are skipped (on all ranks); this many in a row: save and stop
COLLECTIVE_TIMEOUT_S = 1800  # a collective waiting longer fails the run (a stuck rank); > the slowest save
# checkpoints, logging, samples, validation
SAVE_EVERY = 100  # steps between checkpoints, and always one at MAX_STEPS; 0 = only that one
KEEP_LAST = 2  # complete checkpoints kept
ASYNC_SAVE = False  # write checkpoints in the background while training goes on
RESUME = ""  # "" = fresh (OUTPUT_DIR without checkpoints), "new" = fresh beside them, "auto" = newest or fresh, a path
LOG_EVERY = 10  # steps between log lines / metrics.jsonl records, and one at MAX_STEPS; 0 = none
REPORT_TO = ""  # also log to: "" (metrics.jsonl only) | tensorboard | wandb | tensorboard,wandb
PROFILE_STEPS = []  # [first, last]: torch.profiler over these steps (first >= 2): traces and ops in OUTPUT_DIR/profile
WANDB_PROJECT = ""  # W&B project ("" = W&B's default); WANDB_MODE=offline works without a network
WANDB_RUN_NAME = ""  # W&B run name ("" = the OUTPUT_DIR folder name)
SAMPLE_EVERY = 100  # steps between sample grids, and one at MAX_STEPS; 0 = no samples
SAMPLE_PROMPTS = ""  # the sample grids' own prompts (Kontext: rows with "control"); "" = from the data
NUM_SAMPLE_PAIRS = 4  # held-out pairs, never trained on, for samples and validation
SAMPLE_STEPS = 28  # inference steps for samples (FluxKontextPipeline's default)
SAMPLE_GUIDANCE = 2.5  # guidance for samples (BFL's Kontext examples; FLUX.2's pipelines sample at 4, its recipes too)
VAL_EVERY = 50  # steps between validation losses on the held-out pairs (fixed sigmas and noise); 0 = none
VAL_SIGMAS = [0.25, 0.5, 0.75]  # noise levels each held-out pair is scored at

_LATENT_CACHE_VERSION = 1  # part of every latent-cache key: bump when the encoding recipe changes
_LATENT_ROUND = 16  # pairs per rank between two collectives of the latent-cache fill
_DEFAULT_RESOLUTION = 32  # the embedded default's image side (assets/kontext_base was trained at 32 px)
_DEFAULTS = script_constants(globals())  # before any override: what a family told a setting it ignores checks

# ----------------------------------------------------------------------------------------------
# setup: the script's own settings checked before any work (components/trainer.py checks the shared ones),
# the embedded default


def validate_config() -> precision.Precision:
    """Everything checkable before any work; identical on every rank."""
    fsdp_utils.check_context_parallel(CONTEXT_PARALLEL, DP_REPLICATE, int(os.environ.get("WORLD_SIZE", 1)))
    if PARALLELISM == "ddp" and CONTEXT_PARALLEL > 1:
        raise ConfigError(f"PARALLELISM=ddp with CONTEXT_PARALLEL={CONTEXT_PARALLEL}: context parallelism is "
                          "built on the FSDP mesh; use fsdp")
    if CONTEXT_PARALLEL > 1:
        check_diffusers_supports_it()
    if FP8 and (PARALLELISM == "ddp" or CONTEXT_PARALLEL > 1):
        raise ConfigError(f"FP8={FP8} with {'PARALLELISM=ddp' if PARALLELISM == 'ddp' else 'CONTEXT_PARALLEL'}: "
                          "float8 training is built and tested on FSDP2 alone; use PARALLELISM=fsdp")
    float8.check_fp8(FP8, base_dtype=BASE_DTYPE if LORA_RANK else "")
    if CACHE_LATENTS and RANDOM_FLIP:
        raise ConfigError("CACHE_LATENTS with RANDOM_FLIP: a flip of the latents is not the latents of the flipped "
                          "image; turn one of them off")
    check_settings({
        "LR > 0": LR > 0, "len(ADAM_BETAS) == 2": len(ADAM_BETAS) == 2,
        f"LR_SCHEDULE in ({', '.join(optim.LR_SCHEDULES)})": LR_SCHEDULE in optim.LR_SCHEDULES,
        f"WEIGHTING_SCHEME in {km.SIGMA_SCHEMES}": WEIGHTING_SCHEME in km.SIGMA_SCHEMES,
        f"LOSS_WEIGHTING in {km.WEIGHTING_SCHEMES}": LOSS_WEIGHTING in km.WEIGHTING_SCHEMES,
        "SHIFT > 0 or auto": km.valid_shift(SHIFT), "LOGIT_STD > 0": LOGIT_STD > 0,
        "BUCKET_ASPECTS non-empty and > 0": bool(BUCKET_ASPECTS) and all(a > 0 for a in BUCKET_ASPECTS),
        "NUM_SAMPLE_PAIRS >= 0": NUM_SAMPLE_PAIRS >= 0, "SAMPLE_STEPS >= 1": SAMPLE_STEPS >= 1,
        "0 <= CAPTION_DROPOUT < 1": 0 <= CAPTION_DROPOUT < 1,
        "MAX_SEQUENCE_LENGTH >= 1": MAX_SEQUENCE_LENGTH >= 1, "VAL_EVERY >= 0": VAL_EVERY >= 0,
        "VAL_SIGMAS non-empty, each in (0, 1]": bool(VAL_SIGMAS) and all(0 < s <= 1 for s in VAL_SIGMAS),
    })
    return precision.get_precision(PRECISION)


def default_paths() -> tuple[str, str]:
    """The embedded default, shipped in assets/ and loaded through the same code path as real
    weights: the tiny Kontext base (demos/make_kontext_base.py rebuilds it) and the "make it blue"
    training pairs (demos/kontext_eval.py writes them)."""
    assets = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
    return os.path.join(assets, "kontext_base"), os.path.join(assets, "kontext_blue", "train.jsonl")


def resolve_defaults() -> dict:
    """Fill the "" / 0 settings (the embedded default, resolution, cache dir) and return the
    resolved config, which is what the run prints and every checkpoint records."""
    global MODEL_PATH, DATA_PATH, RESOLUTION, TEXT_CACHE_DIR, GUIDANCE
    if not MODEL_PATH:
        MODEL_PATH, default_data = default_paths()
        DATA_PATH = DATA_PATH or default_data
        RESOLUTION = RESOLUTION or _DEFAULT_RESOLUTION
    room = families.FAMILIES[trainer.pipeline_of(MODEL_PATH, "train_flux_kontext.py")]
    trainer.check_text_sharding(SHARD_TEXT_ENCODER, room)
    RESOLUTION = RESOLUTION or room.DEFAULT_RESOLUTION
    GUIDANCE = GUIDANCE or getattr(room, "default_guidance", lambda _: 1.0)(MODEL_PATH)
    TEXT_CACHE_DIR = TEXT_CACHE_DIR or os.path.join(OUTPUT_DIR, "text_cache")
    return script_constants(globals())


def step_shifts(shapes, schedule, scheduler_config, vae_factor) -> dict:
    """{target (h, w): SHIFT's value} for every size the run trains at (SHIFT=auto: the pipeline's own,
    from the target's packed token count), printed once."""
    sizes = sorted({shapes[b][0] for b, _ in schedule})
    shifts = {s: km.sigma_shift(SHIFT, scheduler_config, (s[0] // vae_factor // 2) * (s[1] // vae_factor // 2))
              for s in sizes}
    if SHIFT == "auto":
        print0("σ shift (SHIFT=auto, the pipeline's at each target size): "
               + ", ".join(f"{h}x{w} {v:.3f}" for (h, w), v in shifts.items()))
    return shifts


def step_sizes(shapes, schedule) -> list:
    """The first step's shape and the largest one the run trains on: the shapes to check first."""
    used = {shapes[b] for b, _ in schedule}
    return [shapes[schedule[0][0]], max(used, key=lambda s: sum(h * w for h, w in (s[0], *s[1])))]


def reference_limit(room, pipeline) -> int:
    """MAX_REFERENCES, or the family's own (0 for a pipeline that edits nothing: text to image); over it: refused."""
    most = room.MAX_REFERENCES if room.edits(pipeline) else 0
    if MAX_REFERENCES > most:
        raise ConfigError(f"MAX_REFERENCES={MAX_REFERENCES}: {pipeline} takes at most {most}")
    return MAX_REFERENCES or most


def cached_texts(room, pipeline, train, held_out, sample_rows) -> tuple[list, str | None]:
    """The (prompt, row) pairs the text cache holds (the rows', CAPTION_DROPOUT's unconditional text, RANDOM_FLIP's
    mirrored rows where the text encoder reads the images), and the samples' negative prompt (true CFG) or None."""
    trained = [(r["prompt"], r) for r in train] + [(room.UNCONDITIONAL_PROMPT, r) for r in train if CAPTION_DROPOUT]
    texts = trained + [(r["prompt"], r) for r in held_out + sample_rows]
    if RANDOM_FLIP and room.TEXT_READS_IMAGES:  # a flipped step's text reads the mirrored references
        print0(f"RANDOM_FLIP: {pipeline}'s text encoder reads the reference images, so the text cache also "
               f"holds the {len(trained)} training entries with their references mirrored")
        texts += [(p, {**r, "mirror": True}) for p, r in trained]
    distilled = getattr(room, "is_distilled", lambda _: False)(MODEL_PATH)  # its pipeline skips CFG
    if distilled and SAMPLE_GUIDANCE > 1:
        print0(f"samples: {pipeline} is step-wise distilled (model_index.json is_distilled): sampled without CFG, "
               f"as its pipeline does; SAMPLE_GUIDANCE={SAMPLE_GUIDANCE} is not used")
    cfg = SAMPLE_GUIDANCE > 1 and not distilled
    negative = getattr(room, "NEGATIVE_PROMPT", None) if cfg else None  # true CFG in samples
    return texts + ([(negative, r) for r in sample_rows] if negative is not None else []), negative


# ----------------------------------------------------------------------------------------------
# models


def build_models(room, model_path, prec, mesh, device, *, sharding, block_classes, ema_decay, vae_dtype, lora, seed,
                 base_dtype="", attention_backend=attention.DEFAULT, fp8=""):
    """(transformer, ema or None, vae, scheduler): the trained transformer sharded and loaded, its
    EMA sharded identically and copied from it (LoRA: an EMA of the adapters only), the frozen
    VAE, the sampling scheduler."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    folder = os.path.join(model_path, "transformer")
    build = functools.partial(room.build_transformer, folder, mesh, prec, device, sharding=sharding,
                              block_classes=block_classes, lora=lora, seed=seed, base_dtype=base_dtype,
                              attention_backend=attention_backend, fp8=fp8)
    transformer = build(load=True)
    transformer.train()
    ema = ema_lib.build_ema(transformer, ema_decay, functools.partial(build, load=False,
                                                                      sharding=sharding.never_backward()))
    vae = room.load_vae(os.path.join(model_path, "vae"), vae_dtype, device)
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(model_path, subfolder="scheduler")
    return transformer, ema, vae, scheduler


# ----------------------------------------------------------------------------------------------
# latent cache (CACHE_LATENTS): each training pair's control and target latents at its bucket


def vae_identity(model_path, dtype) -> str:
    """What the latents depend on besides the images and the bucket: the VAE's files (config
    text, weight sizes and mtimes) and its dtype."""
    parts = [f"v{_LATENT_CACHE_VERSION}", precision.dtype_name(dtype)]
    folder = os.path.join(model_path, "vae")
    for name in sorted(os.listdir(folder)):
        st = os.stat(os.path.join(folder, name))
        parts.append(f"vae/{name}:{st.st_size}:{st.st_mtime_ns}")
        if name.endswith(".json"):
            with open(os.path.join(folder, name), "rb") as f:
                parts.append(hashlib.sha256(f.read()).hexdigest())
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def image_hash(source, size) -> str:
    """A file's bytes, or (a datasets image) its pixels at `size`."""
    h = hashlib.sha256()
    if isinstance(source, str):
        with open(source, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    else:
        h.update(load_image(source, *size, stretch=True).numpy().tobytes())
    return h.hexdigest()


def latent_file(cache_dir, identity, row, shape) -> str:
    """The cache file of a pair at its bucket: the target's size and every reference's (REFERENCE_AREA and the
    bucket set them; a file's hash is its bytes alone) are part of the key."""
    size, sizes = shape
    controls = "\n".join(f"{tuple(s)}:{image_hash(c, s)}" for c, s in zip(references(row), sizes))
    key = hashlib.sha256(f"{identity}\n{size}\n{controls}\n{image_hash(row['target'], size)}".encode()).hexdigest()
    return os.path.join(cache_dir, "latents", key[:2], key + ".pt")


@torch.no_grad()
def fill_latent_cache(room, train, bucket_of, shapes, vae, cache_dir, identity, loader=None) -> list[str]:
    """Each rank hashes and, where missing from the cache, encodes its share (rows rank::world),
    one image at a time, so a pair's latents are the same whatever the world size or the batch it
    trains in; in rounds of _LATENT_ROUND pairs with a collective after each (fill_in_rounds), so no
    rank waits in one collective for the slowest rank's whole share. Returns every training row's
    cache file (the same list on every rank)."""
    read, encode_refs = loader or stretched, getattr(room, "encode_references", room.encode_latents)

    def work(rows):
        files = {i: latent_file(cache_dir, identity, train[i], shapes[bucket_of[i]]) for i in rows}
        missing = [i for i, f in files.items() if not os.path.exists(f)]
        for i in missing:
            size, sizes = shapes[bucket_of[i]]
            controls = [encode_refs(vae, read(c, s, False, "reference")[None])[0].cpu()
                        for c, s in zip(references(train[i]), sizes)]
            target = room.encode_latents(vae, read(train[i]["target"], size, False, "target")[None])[0].cpu()
            save_atomic({"control": controls[0] if len(controls) == 1 else controls, "target": target}, files[i])
        return files, len(missing)

    shares = [share for r in fill_in_rounds(list(range(len(train))), work, _LATENT_ROUND, "pairs") for share in r]
    files = [f for _, f in sorted((i, f) for share, _ in shares for i, f in share.items())]
    computed = sum(n for _, n in shares)
    print0(f"latent cache: {len(train)} pairs, computed {computed}, reused {len(train) - computed} "
           f"({os.path.join(cache_dir, 'latents')})")
    return files


def load_latents(files) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(reference latents [(B, C, h, w) per reference], target latents (B, C, h, w)) of a
    micro-batch's samples, from the cache."""
    items = [torch.load(f, weights_only=True) for f in files]
    controls = [it["control"] if isinstance(it["control"], list) else [it["control"]] for it in items]
    return ([torch.stack([c[j] for c in controls]) for j in range(len(controls[0]))],
            torch.stack([it["target"] for it in items]))


# ----------------------------------------------------------------------------------------------
# data: pairs, resolution buckets, one bucket per global batch


_PAIR = ("control", "target", "prompt")  # a row's fields (data.sources.ALIASES: the names accepted for each)
_T2I = ("target", "prompt")  # a text-to-image row's ("image" reads as its target)


def load_data(data_path, num_held_out, resolution, aspects, multiple, skip_bad, *, control_path="", val_path="",
              columns=None, split="train", max_references=1, room=None):
    """(train rows, held-out rows, buckets, bucket of each train row). Rows {"control", "target",
    "prompt", "size"} from any kind of source (data.sources.read_rows: .jsonl, folder, datasets), or
    text-to-image rows {"target", "prompt", "size"} where the source names no reference (a room without
    TEXT_TO_IMAGE refuses them). Held out for samples and validation, never trained on: the first
    `num_held_out` rows of `val_path`, or without one the last `num_held_out` rows of `data_path`. Bad rows
    stop the run (file:line, or the file / dataset row) or are skipped."""
    t2i = text_to_image_source(data_path, control_path=control_path, columns=columns, split=split)
    if t2i and room is not None and not getattr(room, "TEXT_TO_IMAGE", False):
        raise ConfigError(f"DATA_PATH={data_path}: rows without a reference image (text to image); {room.NAME} is "
                          "fine-tuned here on edits only: give every row its control image (a \"control\" key, "
                          "a control/ folder or CONTROL_PATH, a control column or CONTROL_COLUMN)")
    if not t2i and room is not None and max_references == 0:
        raise ConfigError(f"DATA_PATH={data_path}: rows with reference images; this {room.NAME} pipeline takes none "
                          "(text to image: an image and its prompt per row); edits train on its editing pipeline")
    if val_path and text_to_image_source(val_path, columns=columns, split=split, setting="VAL_DATA_PATH") != t2i:
        raise ConfigError(f"VAL_DATA_PATH={val_path}: its rows {'have' if t2i else 'lack'} reference images, "
                          f"DATA_PATH's {'do not' if t2i else 'do'}: held-out rows are of the trained kind")
    fields = _T2I if t2i else _PAIR
    read = functools.partial(read_rows, roles=fields, required=fields, skip_bad=skip_bad, columns=columns,
                             split=split, size_of="target", max_references=max_references)
    rows, skipped = read(data_path, **({} if t2i else {"control_path": control_path}))
    if val_path:
        val_rows, val_skipped = read(val_path, setting="VAL_DATA_PATH")
        train, held_out, skipped = rows, val_rows[:num_held_out], skipped + val_skipped
        source = f"the first of VAL_DATA_PATH={val_path}"
    else:
        if len(rows) <= num_held_out:
            raise ConfigError(f"{data_path}: {len(rows)} usable pairs; need more than NUM_SAMPLE_PAIRS={num_held_out}")
        train, held_out = rows[:len(rows) - num_held_out], rows[len(rows) - num_held_out:]
        source = "the last rows of DATA_PATH, as VAL_DATA_PATH is unset"
    buckets = make_buckets(resolution, aspects, multiple)
    bucket_of = assign_buckets(train, buckets)
    sizes = ", ".join(f"{h}x{w}: {bucket_of.count(i)}" for i, (h, w) in enumerate(buckets) if i in bucket_of)
    print0(f"data: {len(train)} training pairs, {len(held_out)} held out for samples and validation ({source}), "
           f"{skipped} bad rows skipped; buckets (h x w: pairs) {sizes}")
    return train, held_out, buckets, bucket_of


def load_sample_rows(path, held_out, columns, split, max_references=1, t2i=False) -> list[dict]:
    """The sample grids' rows: SAMPLE_PROMPTS' {"control", "prompt"[, "target"]} rows (text to image: {"prompt"[,
    "target"]}, a .txt of prompts too), or the held-out pairs when it is unset."""
    if not path:
        return held_out
    rows, _ = read_rows(path, _T2I if t2i else _PAIR, ("prompt",) if t2i else ("control", "prompt"), skip_bad=False,
                        setting="SAMPLE_PROMPTS", columns=columns, split=split, size_of="target",
                        max_references=max_references)
    print0(f"samples: {len(rows)} prompts from SAMPLE_PROMPTS={path}")
    return rows


# ----------------------------------------------------------------------------------------------
# the step (and the validation loss of the held-out pairs)


def sample_randomness(g, latent_shape, sigma_kwargs) -> dict:
    """One sample's noise level and noise, from its own generator on the run's device (drawn by
    the rank that holds the sample only; data.randomness.per_sample_draws)."""
    return {"sigma": km.sample_sigmas(1, generator=g, **sigma_kwargs)[0],
            "noise": torch.randn(latent_shape, generator=g, device=g.device)}


def load_step(step, room, train, members, schedule, shapes, global_batch, micro_global, dp_rank, dp_size, grad_accum,
              seed, random_flip, cache_dir, identity, caption_dropout=0.0, latent_files=None, loader=None) -> dict:
    """Host side of step `step` on this rank (data.prefetch.Prefetcher runs it a step ahead): the
    step's shape and, per micro-batch, this rank's samples' positions in the global batch, every image
    of each sample (one resize, crop and flip; with `latent_files`, their cached latents instead) and
    the cached text embeddings (of "" for a dropped caption), on CPU."""
    indices = step_indices(step - 1, members, schedule, global_batch, seed)
    shape = shapes[schedule[step - 1][0]]
    flips = step_flips(seed, step, global_batch, random_flip)
    batches = []
    for m in range(grad_accum):  # micro-batch m = m-th chunk of the global batch, split over DP groups
        mine = micro_batch_positions(m, micro_global, dp_rank, dp_size)
        rows = [train[indices[i]] for i in mine]
        text_rows = mirrored_rows(rows, flips[mine])  # the cache keys of flipped samples
        prompts = drop_captions([r["prompt"] for r in rows], seed, step, mine, caption_dropout,
                                room.UNCONDITIONAL_PROMPT)
        text = room.load_text(list(zip(prompts, text_rows)), cache_dir, identity, torch.device("cpu"))
        if latent_files is not None:
            refs, target = load_latents([latent_files[indices[i]] for i in mine])
            batches.append({"mine": mine, "reference_latents": refs, "target_latents": target, "text": text})
        else:
            refs, target = load_pairs(rows, shape, flips[mine], loader=loader)
            batches.append({"mine": mine, "references": refs, "target": target, "text": text})
    return {"shape": shape, "batches": batches}


def micro_batch_loss(room, transformer, vae, mb, sigmas, noise, text, guidance, loss_weighting):
    """One micro-batch on this rank (tensors on the run's device): encode the images (or take their
    cached latents), build the room's [noisy target ; clean references] tokens, predict, and return
    the fp32 flow-matching loss on the target tokens."""
    if "target_latents" in mb:
        x0, refs = mb["target_latents"], mb["reference_latents"]
    else:
        x0 = room.encode_latents(vae, mb["target"])
        refs = [getattr(room, "encode_references", room.encode_latents)(vae, r) for r in mb["references"]]
    inputs = room.model_inputs(x0, refs, noise, sigmas)
    pred = room.forward(transformer, inputs, sigmas, guidance, text)
    weights = km.loss_weighting(sigmas, loss_weighting)
    return km.flow_matching_loss(pred, inputs["target"], inputs["n_target_tokens"], weights)


def validation_inputs(shapes, sigmas, latent_channels, vae_factor, seed):
    """Fixed (shape, sigmas, noise) per held-out pair: the same at every validation and in every
    run with this SEED, so the validation loss is comparable across steps and runs."""
    g = step_generator(seed, 0, stream=VALIDATION_STREAM)
    return [(shape, torch.tensor(sigmas),
             torch.randn(len(sigmas), latent_channels, shape[0][0] // vae_factor, shape[0][1] // vae_factor,
                         generator=g))
            for shape in shapes]


@torch.no_grad()
def validation_loss(room, transformer, vae, pairs, inputs, text, guidance, loss_weighting, device,
                    loader=None) -> float:
    """The flow-matching loss of the held-out pairs (never trained on) at fixed sigmas and noise,
    averaged; every rank computes the same (FSDP gathers inside each forward)."""
    losses = []
    for i, (row, (shape, sigmas, noise)) in enumerate(zip(pairs, inputs)):
        n = len(sigmas)
        refs, target = load_pairs([row], shape, [False], loader=loader)
        mb = {"references": [r.expand(n, -1, -1, -1).to(device) for r in refs],
              "target": target.expand(n, -1, -1, -1).to(device)}
        losses.append(micro_batch_loss(room, transformer, vae, mb, sigmas.to(device), noise.to(device),
                                       room.repeat_text(text, i, n), guidance, loss_weighting).item())
    fsdp_utils.reshard_all(transformer)
    return sum(losses) / len(losses)


# ----------------------------------------------------------------------------------------------
# samples: held-out pairs through the family's own pipeline with the current weights


def sample_grid(room, transformer, vae, scheduler, pairs, shapes, text, steps, guidance, seed, device, loader=None,
                negative_text=None):
    """Rows of references | output | target (N*(R+2), 3, H, W) in [-1, 1], R the most references of
    a row, padded to a common size (a missing reference or a SAMPLE_PROMPTS row without a target:
    a grey tile), and R + 2. `negative_text`: the negative prompt's text per row (true CFG), or None. Every
    rank runs the same calls (FSDP gathers inside each transformer forward); the room runs its pipeline on
    latents and decodes here, so the VAE may keep its own dtype."""
    pipe, read = room.sample_pipeline(scheduler, vae, transformer), loader or stretched
    most = max(len(references(r)) for r in pairs)
    tiles = []
    for i, (row, shape) in enumerate(zip(pairs, shapes)):
        refs = [read(c, s, False, "reference")[None] for c, s in zip(references(row), shape[1])]
        h, w = shape[0]
        target = read(row["target"], (h, w), False, "target")[None] if "target" in row else torch.zeros(1, 3, h, w)
        negative = {"negative": room.text_row(negative_text, i)} if negative_text is not None else {}
        out = room.sample(pipe, vae, [r.to(device) for r in refs], room.text_row(text, i), shape[0], steps,
                          guidance, torch.Generator().manual_seed(seed + i), **negative)
        blank = [torch.zeros(3, h, w)] * (most - len(refs))
        tiles += [r[0] for r in refs] + blank + [out.clamp(-1, 1), target[0]]
    fsdp_utils.reshard_all(transformer)
    hmax, wmax = max(t.shape[1] for t in tiles), max(t.shape[2] for t in tiles)
    return torch.stack([torch.nn.functional.pad(t, (0, wmax - t.shape[2], 0, hmax - t.shape[1]))
                        for t in tiles]), most + 2


# ----------------------------------------------------------------------------------------------
# main: config -> distributed init -> data and text cache -> models (meta, sharded, loaded) ->
# optimizer -> resume -> loop -> export -> teardown (components/trainer.py: what both scripts do before
# and after the loop)


def print_sampling_length() -> None:
    """The export's loading line's max_sequence_length, where the run trained with another than the pipelines' own
    default (FLUX pads the text to it without a mask, so the length changes the text the model reads)."""
    length = _DEFAULTS["MAX_SEQUENCE_LENGTH"]
    if MAX_SEQUENCE_LENGTH != length:
        print0(f"sampling the export: pipe(..., max_sequence_length={MAX_SEQUENCE_LENGTH}), the length it trained "
               f"with (the pipeline's default {length} changes the text it reads)")


def main():
    run, prec = trainer.start(globals(), validate_config, resolve_defaults)
    d = run.d
    room = families.FAMILIES[run.pipeline]  # the model family: its models, conditioning, latents and samples
    settings = {**script_constants(globals()), "PIPELINE": run.pipeline}  # the family's room reads which pipeline
    room.check_edit_settings(MODEL_PATH, settings, {k for k, v in _DEFAULTS.items() if settings[k] != v})
    loader = room.image_loader(settings)  # how the family's pipeline reads an image (None: stretched)

    # data, shapes (target bucket and reference sizes) and the text-embedding cache (the text encoder
    # lives only inside this call)
    vae_factor = room.vae_factor(MODEL_PATH)
    columns = {"control": CONTROL_COLUMN, "target": TARGET_COLUMN, "prompt": PROMPT_COLUMN}
    most = reference_limit(room, run.pipeline)
    train, held_out, buckets, _ = load_data(DATA_PATH, NUM_SAMPLE_PAIRS, RESOLUTION, BUCKET_ASPECTS, 2 * vae_factor,
                                            SKIP_BAD_SAMPLES, control_path=CONTROL_PATH, val_path=VAL_DATA_PATH,
                                            columns=columns, split=DATASET_SPLIT, max_references=most, room=room)
    sample_rows = load_sample_rows(SAMPLE_PROMPTS, held_out, columns, DATASET_SPLIT, most, "control" not in train[0])
    shapes, bucket_of = row_shapes(room, train, buckets, settings)
    members, schedule = bucket_schedule(bucket_of, MAX_STEPS, SEED)
    val_shapes = [s[i] for s, of in [row_shapes(room, held_out, buckets, settings)] for i in of]
    sample_row_shapes = [s[i] for s, of in [row_shapes(room, sample_rows, buckets, settings)] for i in of]
    room.check_context_parallel(MODEL_PATH, CONTEXT_PARALLEL, settings,
                                [shapes[b] for b, _ in schedule] + val_shapes + sample_row_shapes)
    texts, negative = cached_texts(room, run.pipeline, train, held_out, sample_rows)
    identity = room.prepare_edit_text(texts, MODEL_PATH, TEXT_CACHE_DIR, settings,
                                      prec.frozen_dtype(TEXT_ENCODER_DTYPE), d.device)

    trainer.check_attention(run, *room.edit_attention_shapes(MODEL_PATH, settings, step_sizes(shapes, schedule),
                                                             BATCH_SIZE, CONTEXT_PARALLEL), prec.compute_dtype)

    # models: the transformer sharded per block (PARALLELISM=ddp: a full replica wrapped in DDP for
    # its training forwards; checkpoints, EMA, samples and export always use `transformer`)
    mesh, cp_mesh, sharding = trainer.mesh_and_sharding(run, CONTEXT_PARALLEL)
    transformer, ema, vae, scheduler = build_models(room, MODEL_PATH, prec, mesh, d.device, sharding=sharding,
                                                    block_classes=BLOCK_CLASSES, ema_decay=EMA_DECAY,
                                                    vae_dtype=prec.frozen_dtype(VAE_DTYPE), lora=run.lora, seed=SEED,
                                                    base_dtype=BASE_DTYPE, attention_backend=ATTENTION_BACKEND, fp8=FP8)
    dp_rank, dp_size = split_sequences((transformer, ema), cp_mesh, CONTEXT_PARALLEL, d.world_size)
    train_model = transformer if mesh is not None else fsdp_utils.apply_ddp(transformer, d.device)
    watch_model_flops(run, [transformer], vae)  # MFU: the transformer's FLOPs; the VAE's apart

    # optimizer: AdamW (OPTIMIZER: torch's fused kernel, see components.optim.adamw, or torchao's 8-/4-bit
    # states, parallel/lowbit.py), with a linear warmup
    params = [p for p in transformer.parameters() if p.requires_grad]
    optimizer = optim.make_optimizer(OPTIMIZER, params, lr=LR, betas=tuple(ADAM_BETAS), eps=ADAM_EPS,
                                      weight_decay=WEIGHT_DECAY)
    float8.precompute_scales_after_steps(optimizer, transformer)  # FP8=tensorwise: the next all-gathers' scales
    lr_sched = warmup_scheduler(optimizer, WARMUP_STEPS, schedule=LR_SCHEDULE, total_steps=MAX_STEPS)
    models = {"transformer": transformer, **({"ema": ema} if ema is not None else {})}
    audit = [precision.component_row(k, m, prec.compute_dtype) for k, m in models.items()]
    trainer.report_components(run, f"{RESOLUTION} px", audit + [precision.component_row("vae", vae, vae.dtype)],
                              models, {"transformer": optimizer})

    # checkpoints (the checkpointer decides when), resume
    start = trainer.restore(run, models, {"transformer": (transformer, optimizer)}, {"transformer": lr_sched})
    float8.refresh_scales(transformer)

    global_batch, micro_global = BATCH_SIZE * dp_size * GRAD_ACCUM, BATCH_SIZE * dp_size
    sigma_kwargs = dict(scheme=WEIGHTING_SCHEME, logit_mean=LOGIT_MEAN, logit_std=LOGIT_STD, mode_scale=MODE_SCALE)
    shifts = step_shifts(shapes, schedule, scheduler.config, vae_factor)
    final_weights = functools.partial(ema_lib.output_weights, transformer, ema)  # what samples show, export writes
    val_text = room.load_text([(r["prompt"], r) for r in held_out], TEXT_CACHE_DIR, identity, d.device)
    sample_text = room.load_text([(r["prompt"], r) for r in sample_rows], TEXT_CACHE_DIR, identity, d.device)
    negative_text = (room.load_text([(negative, r) for r in sample_rows], TEXT_CACHE_DIR, identity, d.device)
                     if negative is not None else None)  # true CFG in samples
    channels = room.latent_channels(vae)
    val_inputs = validation_inputs(val_shapes, VAL_SIGMAS, channels, vae_factor, SEED)

    def validate():
        with final_weights() as model:
            return {"val_loss": validation_loss(room, model, vae, held_out, val_inputs, val_text, GUIDANCE,
                                                LOSS_WEIGHTING, d.device, loader)}

    def sample(path):
        with final_weights() as model:
            grid, nrow = sample_grid(room, model, vae, scheduler, sample_rows, sample_row_shapes, sample_text,
                                     SAMPLE_STEPS, SAMPLE_GUIDANCE, SEED, d.device, loader, negative_text)
        if d.rank == 0:
            save_image_grid(grid, path, nrow=nrow)

    # the loop: step s (1-based, as in both scripts) trains on data batch s-1 of the bucket
    # schedule and draws its randomness from (SEED, s); its images and embeddings are loaded on a
    # background thread while step s-1 runs
    latent_files = (fill_latent_cache(room, train, bucket_of, shapes, vae, TEXT_CACHE_DIR,
                                      vae_identity(MODEL_PATH, vae.dtype), loader) if CACHE_LATENTS else None)
    load = functools.partial(load_step, room=room, train=train, members=members, schedule=schedule, shapes=shapes,
                             global_batch=global_batch, micro_global=micro_global, dp_rank=dp_rank, dp_size=dp_size,
                             grad_accum=GRAD_ACCUM, seed=SEED, random_flip=RANDOM_FLIP, cache_dir=TEXT_CACHE_DIR,
                             identity=identity, caption_dropout=CAPTION_DROPOUT, latent_files=latent_files,
                             loader=loader)
    with Prefetcher(load, MAX_STEPS, d.device) as prefetch:
        for step in range(start + 1, MAX_STEPS + 1):
            data, waited = prefetch.get(step)
            (h, w), sizes = data["shape"]
            draw = functools.partial(sample_randomness, latent_shape=(channels, h // vae_factor, w // vae_factor),
                                     sigma_kwargs={**sigma_kwargs, "shift": shifts[(h, w)]})
            loss_sum = 0.0  # a float64 device tensor after the first micro-batch: read on logging steps only
            logs, lr = {"data_wait_ms": waited * 1000}, lr_sched.get_last_lr()[0]
            with counting_flops(run, f"{h}x{w}", logs), profiling.phase("forward_backward"):  # MFU: per bucket size
                for m, mb in enumerate(data["batches"]):
                    rand = per_sample_draws(SEED, step, mb["mine"], d.device, draw)  # this rank's only
                    with fsdp_utils.gradient_sync(train_model, last_micro_batch=m == GRAD_ACCUM - 1):  # fwd and bwd
                        loss = micro_batch_loss(room, train_model, vae, mb, rand["sigma"], rand["noise"], mb["text"],
                                                GUIDANCE, LOSS_WEIGHTING) / GRAD_ACCUM
                        # FSDP reduce-scatters (averages over ranks) after every micro-batch; the ranks of a CP
                        # group each hold a 1/C share of one loss's grads, hence x C (parallel/context_parallel.py)
                        (loss * CONTEXT_PARALLEL).backward()
                    loss_sum = loss_sum + loss.detach().double()
            logs["loss"] = loss_sum
            if trainer.apply_updates(run, [(params, optimizer, "")], logs, step) and ema is not None:
                ema_lib.ema_update(ema, transformer, EMA_DECAY)
            lr_sched.step()
            tokens = sum((a // vae_factor // 2) * (b // vae_factor // 2) for a, b in ((h, w), *sizes))  # image tokens
            trainer.end_step(run, step, logs, {"lr": lr}, {"samples_seen": step * global_batch},
                             validate=validate if held_out and trainer.due(step, VAL_EVERY) else None,
                             sample=sample if sample_rows else None,
                             work={"images": global_batch, "tokens": global_batch * tokens})

    print_sampling_length()
    trainer.finish(run, final_weights)


if __name__ == "__main__":
    run_main(main)
