"""Know before launching: per-rank GPU memory of a training run, from real-size models on the meta
device, wrapped exactly as the training scripts wrap them, with a fake process group (no GPU, no
weights, seconds). What each script builds, and in which role, is families.pipelines.PIPELINES; each
sharded model goes through its recipe (parallel/parallelize.py), and the units are read off the
sharded model (fsdp_utils.fsdp_units): the planner repeats no wrapping decision.

    python tools/memory_plan.py --model=flux-kontext-dev --world_size=4 --gpu_memory_gb=24
    python tools/memory_plan.py --model=sd15-dmd --world_size=8 --batch_size=4 --resolution=512
    python tools/memory_plan.py --model=sdxl-dmd --world_size=8 --gpu_memory_gb=80
    python tools/memory_plan.py --model=/path/to/diffusers/folder --world_size=2
    python tools/memory_plan.py --fit_table --model=sdxl-dmd   # markdown: world sizes x GPU memory
    python tools/memory_plan.py --model=flux-kontext-dev --world_size=2 --lora_rank=16   # LoRA fine-tuning
    python tools/memory_plan.py --fit_table --model=flux-kontext-dev --lora_rank=16 \\
        --world_sizes=1,2,4 --gpu_memory_gbs=24
    python tools/memory_plan.py --model=flux-kontext-dev --world_size=8 --resolution=1024 --context_parallel=2
    python tools/memory_plan.py --cp_table --model=flux-kontext-dev   # which CP fits 1024 / 2048 px on 24 / 80 GB
    python tools/memory_plan.py --model=flux-kontext-dmd --world_size=8 --resolution=1024 \\
        --activation_checkpointing=1 --fake_score_fp32=0 --gpu_memory_gb=80   # DMD2 with a FLUX Kontext teacher
    python tools/memory_plan.py --model=qwen-image-edit --world_size=1 --lora_rank=16 --base_dtype=nf4 \\
        --gpu_memory_gb=24   # Qwen-Image-Edit-2509 LoRA on an NF4 base, 1024 px, target + 2 references
    python tools/memory_plan.py --model=flux2-dev --world_size=8 --lora_rank=16 --base_dtype=nf4 \\
        --resolution=1024 --activation_checkpointing=1 --gpu_memory_gb=24   # FLUX.2 [dev], 2 references
    python tools/memory_plan.py --flux2_table   # FLUX.2 [dev] / klein: the fewest GPUs per run of docs/planner.md

NAME is a built-in configuration (tools/real_size_configs/<NAME>/: configs only, no weights) or a
local diffusers folder (SD-1.5 / SDXL layout with unet/ -> train_dmd.py's models; FLUX layout with
transformer/ -> train_flux_kontext.py's, or with --script=train_dmd.py DMD2's; the built-in
flux-kontext-dmd is flux-kontext-dev so planned; a transformer/ holding a QwenImageTransformer2DModel is
Qwen-Image-Edit's, planned the same two ways, qwen-image-edit-dmd the built-in qwen-image-edit for DMD2;
flux2-dev-dmd, flux2-klein-4b-dmd and flux2-klein-9b-dmd the FLUX.2 built-ins for DMD2).
Optional components of the table (SDXL's text_encoder_2) are counted when the folder has them. Without
--resolution: the model's native resolution (UNet sample_size x VAE factor: 512 for SD-1.5, 1024 for SDXL;
512 for FLUX; 1024 for Qwen-Image-Edit, its pipeline's 1024^2 area). Qwen-Image-Edit's sequence: the target's
tokens and QWEN_REFERENCES (2) references' at the same resolution, and the Qwen2.5-VL prompt's QWEN_TEXT_TOKENS
(475: its reference images at 384^2 and the template); its text encoder is cached, then freed before the
transformer is built. What is counted, per rank:
  params / grads / optimizer  the local shards (AdamW: 2 states), in the precision mode's dtypes;
                              frozen parts in their own dtype (SDXL's VAE: fp32, as train_dmd.py holds
                              it); with CPU offload these live on the host
  gathered                    unsharded FSDP units in compute dtype: the largest two (current + prefetched)
                              with reshard-after-forward, all of them without; plus the largest
                              unit's reduce-scatter buffer
  activations                 bytes saved for backward by one forward of the trainable model at the
                              batch and resolution, measured on the meta device with saved-tensor
                              hooks (with activation checkpointing: block inputs + one block's worth);
                              attention counted as the GPU's flash / memory-efficient SDPA kernels
                              save it (q, k, v, out, fp32 logsumexp), not as the math reference that
                              runs on meta (two fp32 L x L matrices per call): flash_attention_saves
  runtime                     a fixed 1 GiB for the CUDA context and allocator slack
  ema                         with --ema=1 (the scripts' EMA_DECAY > 0): the trained model's shards again, in
                              its storage dtype (LoRA: its adapters, fp32); offloaded with it
The text-cache fill, before training, is a phase of its own (fill_phase): the offline components (text encoders,
cached then freed) sharded over the ranks in units of their _no_split_modules, units in flight, one no-grad
forward of a batch measured on meta, the runtime reserve. A plan fits only if both phases fit; where only the
fill does not, the fit takes the encoders in NF4 (--text_encoder_dtype=nf4).
FLUX.2 (flux2-dev, flux2-klein-4b, flux2-klein-9b; Flux2Pipeline / Flux2KleinPipeline by model_index.json): the
target's tokens, --references (2) references' at --reference_area (the pipeline's 1024^2), 512 text tokens.
DMD2's fake score is counted as train_dmd.py runs it (FAKE_SCORE_FP32, default off): in the mode's compute
dtype; --fake_score_fp32=1 (as published): its units gathered and its training forward's activations in fp32,
whatever the precision mode.

DMD2 with a FLUX.1 Kontext teacher (flux-kontext-dmd; train_dmd.py on a FLUX folder): the FLUX
pipeline's transformer in the DMD2 roles of the SD entries of families.pipelines.PIPELINES (generator and
fake score trainable, teacher frozen-sharded), each sharded by the FLUX recipe; the VAE replicated,
the text encoders offline. The activations are the larger of the generator's and the fake score's
training forwards over Kontext's text + target + context tokens (the generator's backward runs before
the fake score's forward). With --base_dtype=nf4 the frozen teacher is stored in NF4 like the LoRA
bases (NF4_TEACHER_KINDS); the UNet teacher is not.

LoRA (--lora_rank=R > 0; --lora_alpha, --lora_target_modules as the scripts' LORA_*): the adapters are added
with parallel.lora.add_lora to the meta model before its recipe shards it, as the scripts do, so the
units fsdp_units reads include them. The script's model (FLUX's transformer, DMD's generator; with
--fake_lora DMD's fake score too) is then counted as two rows: its base, frozen and stored in the
compute dtype (sharded; no grads, no optimizer state), and its adapters (`<name>.lora`: fp32 params,
fp32 grads, 2 fp32 AdamW states, sharded). Units are all-gathered in the compute dtype, adapters
included; only the adapter grads are reduce-scattered (fp32). Activations are measured on the LoRA
model, inputs without grad (as the latents are), so the hooks see what autograd keeps under LoRA:
each adapted Linear's input (lora_A's grad) and rank-r intermediate (lora_B's), no input of a frozen
Linear for a weight grad, and elsewhere what the input grads need (norms, attention, nonlinearities);
tests/test_memory_plan.py checks this count against a real-width FLUX block run on CPU. One LoRA model
(train_flux_kontext.py's) has almost no grads, so its step peaks where its activations do, at the turn
from forward to backward: the units in flight are those gathered then (in_flight_at_peak: the root,
the last unit, the one prefetched), not the two largest. With CPU offload the base shards live on
the host too (FSDP offloads every parameter of a unit). bf16 states change nothing under LoRA (the
base is already in the compute dtype, add_lora keeps adapters in fp32), so the fit search skips them.

Context parallelism (--context_parallel=C, train_flux_kontext.py's CONTEXT_PARALLEL; FLUX layout only):
the C ranks of a CP group take the same samples and each holds 1/C of the joint sequence (text +
target + context image tokens), with Ulysses attention (each rank attends over the full sequence for
H/C heads). The components are sharded on the script's mesh (fsdp_utils.build_meshes: FSDP over all
dp x cp ranks), so the state rows and the gathered units are as without CP. A rank's activations
(_cp_activations): one forward over the full sequence is measured, as without CP; token-wise tensors
and attention's flash saves (q, k, v, out over all tokens for H/C heads, logsumexp) are 1/C of it on
each rank, and what has no sequence dimension (timestep, guidance and pooled embeddings, each block's
modulation vectors: 3.2 MiB at batch 1, against 8.8 MiB per token) is whole on every rank: that part
is the constant of A(L) = a + b L, from a second meta forward at a quarter of the tokens. Added: the
all-to-all buffers of one attention call (q, k, v and the output, sent and received) and the final
output all-gathered for the loss. The global batch is batch x world / C.
Checked before any work, one line each: C >= 1, C x dp_replicate divides the world, C divides the
transformer's attention heads, the text tokens and the image tokens (target + context).
--cp_table: for resolutions x GPU memory, per world size, the smallest CP that fits and the
cheapest settings (cheapest_fit) it needs, then any larger CP that needs fewer.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import inspect
import json
import math
import os
import re
import sys
import warnings
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the repository root: fsdp_utils, precision
import fsdp_utils  # noqa: E402
from core.errors import ConfigError  # noqa: E402
from data.text_cache import fill_text_cache  # noqa: E402  (the text-cache fill's batch)
from components.warnings import quiet_known_warnings  # noqa: E402
from parallel import lora as lora_lib  # noqa: E402
from parallel import lowbit  # noqa: E402
from families import FAMILIES, pipelines  # noqa: E402  (the rooms; what each pipeline holds, in which role)
from parallel.model_facts import MODELS  # noqa: E402  (FSDP units and LoRA targets per model class)
from parallel.parallelize import parallelize  # noqa: E402  (the recipes)
from precision import dtype_name, get_precision  # noqa: E402

GIB = 2**30
RUNTIME_BYTES = 1 * GIB

# Which training script a folder is planned for, by its layout: {subfolder: (script, kind)}. The
# pipeline's entry in families.pipelines.PIPELINES says what it builds; kind picks the forward inputs.
# A unet/ folder is SD-1.5 unless it is SDXL (is_sdxl): then the kind is "sdxl".
LAYOUTS = {"unet": ("train_dmd.py", "sd15"), "transformer": ("train_flux_kontext.py", "flux_kontext")}
# a transformer/ folder whose model is not FLUX's: {transformer class: kind} (train_flux_kontext.py's too)
TRANSFORMER_KINDS = {"QwenImageTransformer2DModel": "qwen_image_edit", "Flux2Transformer2DModel": "flux2"}
# kinds whose pipelines differ in their other parts (FLUX.2 [dev]: Mistral-Small 3; klein: Qwen3): the one
# model_index.json names, else the first
KIND_PIPELINES = {"flux2": ("Flux2Pipeline", "Flux2KleinPipeline")}
# a layout planned for another script (Settings.script): {(kind, script): kind}. train_dmd.py distils a
# FLUX Kontext or Qwen-Image-Edit folder with DMD2: its trained model in DMD2's three roles (pipeline_components)
OTHER_SCRIPTS = {("flux_kontext", "train_dmd.py"): "flux_kontext_dmd",
                 ("qwen_image_edit", "train_dmd.py"): "qwen_image_edit_dmd", ("flux2", "train_dmd.py"): "flux2_dmd"}
# built-in names that plan a built-in configuration for another script: {name: (configuration, script)}
BUILTIN_SCRIPTS = {"flux-kontext-dmd": ("flux-kontext-dev", "train_dmd.py"),
                   "qwen-image-edit-dmd": ("qwen-image-edit", "train_dmd.py"),
                   **{f"{m}-dmd": (m, "train_dmd.py") for m in ("flux2-dev", "flux2-klein-4b", "flux2-klein-9b")}}
# DMD2 on a pipeline whose table entry trains one model: {kind: the kind whose pipeline and forward it has}
DMD_KINDS = {"flux_kontext_dmd": "flux_kontext", "qwen_image_edit_dmd": "qwen_image_edit", "flux2_dmd": "flux2"}
# kinds whose frozen teacher BASE_DTYPE=nf4 (with LoRA) stores in NF4 like the LoRA bases: train_dmd.py's
# transformer teachers (its UNet teacher stays in TEACHER_DTYPE)
NF4_TEACHER_KINDS = ("flux_kontext_dmd", "qwen_image_edit_dmd", "flux2_dmd")

# components a kind holds in fp32 whatever the precision: train_dmd.py keeps SDXL's VAE in fp32 by
# default (it overflows in fp16/bf16; the official DMD2 SDXL code does the same)
FP32_COMPONENTS = {"sdxl": ("vae",)}

# the resolution when none is given, for kinds without a UNet sample_size to take it from; Qwen-Image-Edit's
# pipeline works at a 1024^2 area (pipeline_qwenimage_edit_plus.py's VAE_IMAGE_SIZE)
DEFAULT_RESOLUTION = 512
NATIVE_RESOLUTION = {"qwen_image_edit": 1024, "flux2": FAMILIES["Flux2Pipeline"].DEFAULT_RESOLUTION}

# Qwen-Image-Edit-2509's sequence, per sample: the target's tokens, then each reference image's at the training
# resolution (the pipeline encodes references at its 1024^2 VAE_IMAGE_SIZE: the same tokens at 1024 px), all
# 2x2-packed 16-channel latents (64-channel tokens) at the VAE's factor 8; the text stream is the Qwen2.5-VL
# prompt's hidden states less the 64 system-prompt tokens the pipeline drops (prompt_template_encode_start_idx).
# The prompt holds per reference "Picture i: <|vision_start|>", its image tokens and "<|vision_end|>" (~7
# template tokens): the image, resized to the 384^2 CONDITION_IMAGE_SIZE, then by the Qwen2-VL processor to
# multiples of 28 (14 px patches, 2x2 merged: 392^2), gives (392 / 28)^2 = 196 tokens; then the instruction
# (planned at 64 tokens) and "<|im_end|>\n<|im_start|>assistant\n" (5).
QWEN_REFERENCES = 2
QWEN_CONDITION_TOKENS = round(384 / 28) ** 2  # 14 x 14 merged 28 px cells
QWEN_TEXT_TOKENS = QWEN_REFERENCES * (QWEN_CONDITION_TOKENS + 7) + 64 + 5

# FLUX.2's sequence, per sample: the target's (RESOLUTION / 16)^2 tokens, then each reference's: the pipeline
# downsizes a reference to its REFERENCE_AREA (1024^2) only if larger, so one at least that large gives
# REFERENCE_AREA / 16^2 tokens whatever the target's size (families/flux2.py, pipeline_size); then 512 text tokens.
# The built-in configs (tools/real_size_configs/flux2-*): [dev]'s transformer is diffusers'
# Flux2Transformer2DModel defaults, klein's as BFL's flux2 src/flux2/model.py (Klein4BParams, Klein9BParams;
# mirrored in kohya-ss/musubi-tuner src/musubi_tuner/flux_2/flux2_models.py); [dev]'s text encoder is the
# Mistral-Small-3.1-24B config musubi-tuner's flux_2/flux2_utils.py builds (M3_CONFIG_JSON), klein's Qwen3-4B /
# Qwen3-8B as its zimage/zimage_utils.py load_qwen3; the VAE is AutoencoderKLFlux2's defaults.
FLUX2_REFERENCES = 2

# the text-cache fill (before training, the "offline" components of families.pipelines.PIPELINES): each rank
# embeds its prompts in batches of data.text_cache.fill_text_cache's size, at the planned text length
TEXT_FILL_BATCH = inspect.signature(fill_text_cache).parameters["batch"].default

# LoRA adapters' storage dtype (hence their grads' and AdamW states'): parallel.lora.add_lora keeps them
# in fp32 whatever the precision mode; Precision.adapter_mp_policy reduce-scatters their grads in fp32
ADAPTER_DTYPE = torch.float32

# parallel/lowbit.py's storage, bytes per parameter. NF4: 4-bit codes, an 8-bit scale per 64 values
# and an fp32 factor per 64 x 256 (torchao's NF4Tensor; tests/test_lowbit.py measures 0.258 of bf16).
# torchao's AdamW states, each: 8-bit codes + an fp32 scale per 256; 4-bit codes + one per 128
# (torchao/optim/subclass_8bit.py, subclass_4bit.py defaults). Shards under 4096 values keep fp32
# states (torchao's rule); at real scale that is the biases and norms, not counted apart here.
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)
STATE_BYTES = {"adamw8bit": 1 + 4 / 256, "adamw4bit": 0.5 + 4 / 128}
# loading an NF4 base: each rank reads a whole tensor (stored bf16), casts it and quantises it
# (torchao's to_nf4 peaks at ~5.8 bytes/param of temporaries on a bf16 3072 x 12288 weight, measured)
NF4_LOAD_BYTES_PER_PARAM = 2 + 2 + 5.8


@dataclass(frozen=True)
class Holding:
    """How a component of a given role (families.pipelines.Component.role) sits in a rank's memory."""
    resident: bool  # in GPU memory during training (an offline one is used before, then freed)
    sharded: bool   # FSDP shards per unit, by the model's recipe (else a full replica on every rank)
    trained: bool   # grads and optimizer state; sharded by its recipe (parallel/parallelize.py)


# the role vocabulary of families.pipelines.Component (but "files": no weights); the table assigns the roles
HOLDING = {"trainable": Holding(resident=True, sharded=True, trained=True),
           "frozen-sharded": Holding(resident=True, sharded=True, trained=False),
           "replicated": Holding(resident=True, sharded=False, trained=False),
           "offline": Holding(resident=False, sharded=False, trained=False)}


@dataclass
class Part:
    """One component of a pipeline in families.pipelines.PIPELINES, built at real size on the meta device."""
    spec: pipelines.Component  # name, subfolder, role: from the table
    module: nn.Module | None    # None: not built (its sharded counts come from a cache)
    dtype: torch.dtype          # storage dtype (LoRA: of the frozen base)
    lora: lora_lib.Lora = lora_lib.Lora()  # adapters added before sharding (rank 0: none)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def holding(self) -> Holding:
        if self.spec.role not in HOLDING:
            raise SystemExit(f"plan: component {self.spec.name!r} has role {self.spec.role!r}, which the "
                             f"planner does not know how to count (known: {list(HOLDING)})")
        return HOLDING[self.spec.role]


@dataclass
class Settings:
    world_size: int
    precision: str = "bf16-mixed"
    cpu_offload: bool = False
    activation_checkpointing: bool = False
    reshard_after_forward: bool | None = True  # None: the scripts' auto (fsdp_utils.reshard_free_fits)
    dp_replicate: int = 1
    batch_size: int = 1
    resolution: int | None = None  # None: the model's native resolution (native_resolution)
    block_classes: tuple = ()  # the scripts' BLOCK_CLASSES: () = each model's recipe decides
    lora_rank: int = 0         # the scripts' LORA_RANK: 0 = full fine-tuning
    lora_alpha: float = 0.0    # LORA_ALPHA: 0 = the rank
    lora_targets: tuple = ()   # LORA_TARGET_MODULES: () = the model's in parallel.model_facts.MODELS
    fake_lora: bool = False    # DMD's FAKE_LORA: the fake score (every trainable part after the first) too
    context_parallel: int = 1  # train_flux_kontext.py's CONTEXT_PARALLEL: ranks splitting each sample's sequence
    fake_score_fp32: bool = False  # train_dmd.py's FAKE_SCORE_FP32: the fake score gathers and computes in fp32
    base_dtype: str = ""       # the scripts' BASE_DTYPE: "" = compute dtype, nf4 = 4-bit LoRA base (parallel/lowbit.py)
    optimizer: str = "adamw"   # the scripts' OPTIMIZER: adamw | adamw8bit | adamw4bit
    ema: bool = False          # the scripts' EMA_DECAY > 0: a copy of the trained model (LoRA: of its adapters)
    fp8: str = ""              # the scripts' FP8: "" | tensorwise (trained weights gathered in float8) | rowwise
    script: str = ""           # the script planned: "" = the layout's (LAYOUTS), or the name's (BUILTIN_SCRIPTS)
    gpu_memory_gb: float = 0.0  # the GPU planned for, where auto resharding asks (0: unknown)
    references: int | None = None  # FLUX.2: reference images per sample (None: FLUX2_REFERENCES)
    reference_area: int = 0    # FLUX.2: the scripts' REFERENCE_AREA, pixels of each reference (0: the pipeline's)
    text_encoder_dtype: str = ""  # the text-cache fill's encoders: "" = compute dtype, nf4 = their Linears in NF4

    @property
    def lora(self) -> lora_lib.Lora:
        return lora_lib.Lora(self.lora_rank, self.lora_alpha, tuple(self.lora_targets))


# ----------------------------------------------------------------------------------------------
# building the real-size models on meta, as the scripts hold them

def model_folder(name: str) -> str:
    builtin = os.path.join(HERE, "real_size_configs", BUILTIN_SCRIPTS.get(name, (name,))[0])
    if os.path.isdir(builtin):
        return builtin
    if os.path.isdir(name):
        return name
    choices = sorted(os.listdir(os.path.join(HERE, "real_size_configs")) + list(BUILTIN_SCRIPTS))
    raise SystemExit(f"plan: --model={name}: not a built-in configuration ({', '.join(choices)}) nor a folder")


def _config(folder: str, subfolder: str) -> dict:
    path = os.path.join(folder, subfolder, "config.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def is_sdxl(folder: str) -> bool:
    """An SDXL pipeline folder: its UNet takes SDXL's micro-conditioning (addition_embed_type
    "text_time"), or it has the second text encoder, or its model_index.json says so."""
    index = os.path.join(folder, "model_index.json")
    if os.path.exists(index):
        with open(index) as f:
            if "StableDiffusionXL" in json.load(f).get("_class_name", ""):
                return True
    return (_config(folder, "unet").get("addition_embed_type") == "text_time"
            or os.path.isdir(os.path.join(folder, "text_encoder_2")))


def layout(folder: str, script: str = "") -> tuple[str, str]:
    """(training script, kind) for a pipeline folder, by which trained model's subfolder it has (and
    for transformer/, which model: TRANSFORMER_KINDS); `script`: plan it for that one (OTHER_SCRIPTS)
    instead of the layout's."""
    for sub, (default, kind) in LAYOUTS.items():
        if not os.path.isdir(os.path.join(folder, sub)):
            continue
        if kind == "sd15" and is_sdxl(folder):
            kind = "sdxl"
        if sub == "transformer":
            kind = TRANSFORMER_KINDS.get(_config(folder, sub).get("_class_name", ""), kind)
        if script and script != default:
            if (kind, script) not in OTHER_SCRIPTS:
                raise SystemExit(f"plan: --script={script}: a {sub}/ folder is planned for {default} only")
            return script, OTHER_SCRIPTS[kind, script]
        return default, kind
    raise SystemExit(f"plan: {folder}: neither an SD-1.5/SDXL layout (unet/) nor a FLUX layout (transformer/)")


def with_script(name: str, s: Settings) -> Settings:
    """`s` with the script a built-in name plans for (BUILTIN_SCRIPTS) when it names none."""
    return dataclasses.replace(s, script=BUILTIN_SCRIPTS[name][1]) if name in BUILTIN_SCRIPTS and not s.script else s


PIPELINE_OF_KIND = {"sd15": "StableDiffusionPipeline", "sdxl": "StableDiffusionXLPipeline",
                    "flux_kontext": "FluxKontextPipeline", "qwen_image_edit": "QwenImageEditPlusPipeline",
                    "flux2": KIND_PIPELINES["flux2"][0]}


def pipeline_of(folder: str, kind: str) -> str:
    """The pipeline (families.pipelines.PIPELINES key) whose table entry plans a folder of this kind: for
    a kind of several (KIND_PIPELINES), the one model_index.json names."""
    kind = DMD_KINDS.get(kind, kind)
    index = os.path.join(folder, "model_index.json")
    if kind in KIND_PIPELINES and os.path.exists(index):
        with open(index) as f:
            name = json.load(f).get("_class_name")
        if name in KIND_PIPELINES[kind]:
            return name
    return PIPELINE_OF_KIND[kind]


def pipeline_components(kind: str, pipeline: str | None = None) -> list:
    """The components with weights that the script builds for a pipeline kind (the table's, in its
    order; tokenizers and schedulers, role "files", hold no memory the planner counts), of `pipeline`
    (default: the kind's). A DMD_KINDS kind: the SD-1.5 entry's DMD2 roles (generator, fake score,
    teacher) of its pipeline's trained model, then that pipeline's other components."""
    if kind not in DMD_KINDS:
        return [c for c in pipelines.PIPELINES[pipeline or PIPELINE_OF_KIND[kind]] if c.role != "files"]
    pipeline = pipelines.PIPELINES[pipeline or PIPELINE_OF_KIND[DMD_KINDS[kind]]]
    dmd = pipelines.PIPELINES[PIPELINE_OF_KIND["sd15"]]
    trained, dmd_trained = (next(c for c in p if c.role == "trainable") for p in (pipeline, dmd))
    roles = [dataclasses.replace(c, subfolder=trained.subfolder, class_name=trained.class_name)
             for c in dmd if c.subfolder == dmd_trained.subfolder]
    return roles + [c for c in pipeline if c != trained and c.role != "files"]


def native_resolution(folder: str, kind: str) -> int:
    """The side the script trains at by default: UNet sample_size x VAE factor (train_dmd.py's
    RESOLUTION=0: 512 for SD-1.5, 1024 for SDXL); NATIVE_RESOLUTION's for Qwen-Image-Edit (1024),
    DEFAULT_RESOLUTION for FLUX."""
    size = _config(folder, "unet").get("sample_size") if kind in ("sd15", "sdxl") else None
    if not isinstance(size, int):
        return NATIVE_RESOLUTION.get(DMD_KINDS.get(kind, kind), DEFAULT_RESOLUTION)
    return size * _folder_shapes(folder, kind)[0]


def meta_model(folder: str) -> nn.Module:
    """The model a component folder's config.json declares (diffusers `_class_name`, transformers
    `architectures`, e.g. SDXL's CLIPTextModelWithProjection), built from that config on the meta
    device: no memory, no init."""
    path = os.path.join(folder, "config.json")
    if not os.path.exists(path):
        raise SystemExit(f"plan: {folder}: no config.json")
    with open(path) as f:
        cfg = json.load(f)
    if cfg.get("_class_name"):
        import diffusers
        cls = getattr(diffusers, cfg["_class_name"])
        with torch.device("meta"):
            return cls.from_config(cls.load_config(folder))
    if cfg.get("architectures"):
        import transformers
        cls = getattr(transformers, cfg["architectures"][0])
        with torch.device("meta"):
            return cls(cls.config_class.from_pretrained(folder))
    raise SystemExit(f"plan: {path}: names no model class (no _class_name / architectures)")


def build_components(folder: str, precision, build: bool = True, lora: lora_lib.Lora = lora_lib.Lora(),
                     fake_lora: bool = False, script: str = "") -> tuple[str, str, list[Part]]:
    """(script, kind, components): what families.pipelines.PIPELINES says the script for this
    folder's layout builds, each at real size on meta in its storage dtype (trainable: the
    precision's param dtype; everything frozen: its compute dtype, as the scripts' defaults, except
    FP32_COMPONENTS). Optional components the folder lacks are skipped. build=False: the specs and
    dtypes only (module None). With `lora`, the first trainable component (the script's model) and,
    with `fake_lora`, the other trainable ones get adapters (Part.lora, added when sharded) and
    their base is stored in the compute dtype, as the scripts store it. `script`: as layout's."""
    script, kind = layout(folder, script)
    # what the family's room does to its transformer's meta skeleton in every role before the cast, the
    # adapters and the recipe (families/dit.py's `prepare`; Qwen-Image: freezing outputs that feed nothing)
    pipeline = pipeline_of(folder, kind)
    prepare = getattr(FAMILIES[pipeline], "prepare", None)
    trained_sub = next(c.subfolder for c in pipelines.PIPELINES[pipeline] if c.role == "trainable")
    parts = []
    for spec in pipeline_components(kind, pipeline):
        part = Part(spec, meta_model(os.path.join(folder, spec.subfolder)) if build else None, precision.compute_dtype)
        if build and prepare is not None and spec.subfolder == trained_sub:
            prepare(part.module)
        if part.holding.trained and lora and (fake_lora or not any(q.holding.trained for q in parts)):
            part.lora = lora  # the base keeps the compute dtype
        elif part.holding.trained:
            part.dtype = precision.param_dtype
        elif spec.name in FP32_COMPONENTS.get(kind, ()):
            part.dtype = torch.float32
        parts.append(part)
    if fake_lora and sum(1 for q in parts if q.lora) < 2:
        raise SystemExit(f"plan: --fake_lora: {script} trains no second model (only DMD's fake score takes it), "
                         f"or --lora_rank is 0")
    return script, kind, parts


# ----------------------------------------------------------------------------------------------
# sharding with a fake process group

@contextlib.contextmanager
def fake_world(world_size: int):
    """A process group of `world_size` fake ranks (we are rank 0): collectives are no-ops."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        if owned:
            dist.destroy_process_group()


def shard_components(parts: list[Part], s: Settings, precision) -> dict:
    """Shard each component at world size s.world_size as the scripts do: trainable ones by their
    model's recipe (parallel/parallelize.py), frozen-sharded ones by the same recipe after
    fsdp_utils.prepare_frozen. A component with LoRA (Part.lora) gets its adapters by
    parallel.lora.add_lora after the cast to its storage dtype and before its recipe, which then
    shards it with the adapter policy, as the scripts do. Returns {name: local and global parameter
    counts, and the FSDP units fully_shard made (as fsdp_utils.fsdp_units reads them off the
    sharded model: [(module name, params)], root last); with LoRA also the trainable (adapter)
    counts: local, global and per unit}."""
    out = {}
    block_classes = list(s.block_classes) or None
    # the units and shards do not depend on it; auto is resolved by plan (reshard_free)
    sharding = fsdp_utils.Sharding(s.reshard_after_forward is not False, s.cpu_offload, s.activation_checkpointing)
    done = {}  # {how a component is built and sharded: its name}: DMD2's generator and fake score alike, once
    with fake_world(s.world_size), warnings.catch_warnings():
        # torch's note on slicing the flattened dp x cp dim (build_meshes with CP) is not the user's concern
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")
        # the script's FSDP mesh: with CP, FSDP shards over all dp x cp ranks (the CP mesh is not needed here)
        mesh = fsdp_utils.build_meshes(torch.device("cpu"), s.dp_replicate, s.context_parallel)[0]
        for c in parts:
            alike = (c.spec.subfolder, c.spec.role, c.dtype, c.lora, fill_sharded(c, s))
            if alike in done:
                out[c.name] = copy.deepcopy(out[done[alike]])
                continue
            done[alike] = c.name
            c.module.to(c.dtype)
            if c.lora:
                try:
                    _add_lora_on_meta(c.module, c.lora)
                except ConfigError as e:
                    raise SystemExit(f"plan: --lora_target_modules: {e}") from None
            if c.holding.sharded and block_classes:  # a misspelt class would silently make one whole-model unit
                try:
                    fsdp_utils.find_block_classes(c.module, block_classes)
                except ConfigError as e:
                    raise SystemExit(f"plan: --block_classes: {e}") from None
            fp8_names = _fp8_names(c.module) if c.holding.sharded and c.holding.trained and not c.lora else []
            if c.holding.sharded and c.holding.trained:
                policy = precision.adapter_mp_policy() if c.lora else precision.mp_policy()
                parallelize(c.module, mesh, policy, sharding, block_classes, verbose=False)
            elif c.holding.sharded or fill_sharded(c, s):
                fsdp_utils.prepare_frozen(c.module, c.dtype)
                # an offline encoder is sharded in units of its own (its _no_split_modules), not the trained model's
                parallelize(c.module, mesh, precision.frozen_mp_policy(c.dtype), fsdp_utils.Sharding(frozen=True),
                            block_classes if c.holding.sharded else None, verbose=False)
            elif not c.holding.resident:
                fsdp_utils.prepare_frozen(c.module, c.dtype)
            total = sum(p.numel() for p in c.module.parameters())
            units = fsdp_utils.fsdp_units(c.module) if c.holding.sharded or fill_sharded(c, s) else [("<root>", total)]
            local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in c.module.parameters())
            out[c.name] = {"local": local, "global": total, "units": units}
            # what BASE_DTYPE=nf4 would quantise: the frozen Linear weights lowbit accepts, of a LoRA base or
            # of a frozen sharded model (a teacher: NF4_TEACHER_KINDS)
            if c.lora or (c.holding.sharded and not c.holding.trained) or not c.holding.resident:
                weights = [m.weight for m in c.module.modules() if isinstance(m, nn.Linear)
                           and not m.weight.requires_grad and lowbit.nf4_blocks(m.weight.shape) is not None]
                out[c.name].update(nf4_global=sum(w.numel() for w in weights),
                                   nf4_largest=max((w.numel() for w in weights), default=0))
            if c.holding.sharded and c.holding.trained and not c.lora:  # what FP8=tensorwise gathers in float8
                out[c.name]["fp8_units"] = _fp8_per_unit(c.module, units, fp8_names)
                out[c.name]["fp8_count"] = len(fp8_names)
            if c.lora or c.holding.trained:
                trainable = [p for p in c.module.parameters() if p.requires_grad]
                out[c.name].update(
                    trainable_local=sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                                        for p in trainable),
                    trainable_global=sum(p.numel() for p in trainable),
                    trainable_units=_trainable_per_unit(c.module, units))
    return out


def fill_sharded(c: Part, s: Settings) -> bool:
    """An offline component (a text encoder run once before training to fill the text cache) is sharded
    over the ranks for that fill, unless there is one rank (a whole copy: nothing to gather)."""
    return not c.holding.resident and s.world_size > 1


def _fp8_names(model: nn.Module) -> list[str]:
    """The Linears FP8 converts (parallel/float8.py), read off the model before it is sharded (its block
    classes' names); none for a model FP8 does not know (no blocks in parallel/model_facts.py)."""
    from parallel import float8
    try:
        return float8.fp8_linears(model)
    except ConfigError:
        return []


def _fp8_per_unit(model: nn.Module, units: list[tuple[str, int]], names: list[str]) -> list[int]:
    """Per unit (fsdp_units' order), the weight elements of the Linears `names` (FP8's): under FP8=tensorwise
    a full model's unit gathers these in float8 (1 byte) and the rest in its compute dtype."""
    unit_names = [n for n, _ in units[:-1]]
    out = dict.fromkeys(unit_names, 0)
    for name in names:
        unit = next((u for u in unit_names if name.startswith(u + ".")), None)
        if unit is not None:
            out[unit] += model.get_submodule(name).weight.numel()
    return [out[n] for n in unit_names] + [0]


def _add_lora_on_meta(model: nn.Module, lora: lora_lib.Lora) -> None:
    """parallel.lora.add_lora with peft's new adapter layers made on meta too (it makes them on the
    default device, then moves them to the base's: at rank 64, seconds of CPU init per 12 B model)."""
    with torch.device("meta"):
        lora_lib.add_lora(model, lora)


def _trainable_per_unit(model: nn.Module, units: list[tuple[str, int]]) -> list[int]:
    """For fsdp_units' list (inner units first, root last), the parameters that require grad among
    those each unit owns (its own, not those of units nested in it): what its reduce-scatter carries."""
    owned, out = set(), []
    for name, _ in units:
        module = model if name == "<root>" else model.get_submodule(name)
        ps = [p for p in module.parameters() if id(p) not in owned]
        owned.update(id(p) for p in ps)
        out.append(sum(p.numel() for p in ps if p.requires_grad))
    return out


# ----------------------------------------------------------------------------------------------
# activations, measured on meta

ATTENTION_NOTE = "attention counted as flash/memory-efficient SDPA saves it: q, k, v, out, logsumexp"


class _FlashSDPA(torch.autograd.Function):
    """scaled_dot_product_attention saving for backward what the GPU's flash / memory-efficient
    kernels save: q, k, v, the output and an fp32 logsumexp of shape (..., heads, L_q) (plus the
    mask, when one is given: the memory-efficient kernel keeps its attention bias). The output is
    the original SDPA's, computed without grad (on meta nothing is materialised; elsewhere its
    L x L temporaries are freed, not saved); backward recomputes through the original (math) SDPA."""

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        kw = dict(attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale)
        if enable_gqa:
            kw["enable_gqa"] = True
        out = _ORIGINAL_SDPA(q, k, v, **kw)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.kw = kw
        ctx.save_for_backward(q, k, v, out, lse, *([attn_mask] if torch.is_tensor(attn_mask) else []))
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v = (t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors[:3])
        with torch.enable_grad():
            out = _ORIGINAL_SDPA(q, k, v, **ctx.kw)
        wanted = [t for t in (q, k, v) if t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad)) if wanted else iter(())
        return tuple(next(grads) if t.requires_grad else None for t in (q, k, v)) + (None,) * 5


_ORIGINAL_SDPA = torch.nn.functional.scaled_dot_product_attention


def _flash_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return _FlashSDPA.apply(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


@contextlib.contextmanager
def flash_attention_saves():
    """Within: torch.nn.functional.scaled_dot_product_attention (which diffusers' attention calls,
    looked up at call time) is _FlashSDPA, so saved-tensor hooks count what a GPU's flash /
    memory-efficient kernel keeps for backward, not the math reference's L x L matrices (meta and CPU
    run the math one). The original is restored on exit."""
    F = torch.nn.functional
    previous = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _flash_sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = previous


@dataclass(frozen=True)
class ActivationProfile:
    """What one forward saves for backward, by where it is saved: `outside` every unit (embedders,
    final norm and projection), and per outermost unit in forward order `blocks`: (its name, bytes
    saved inside it, bytes of its tensor inputs: what activation checkpointing keeps of it)."""
    outside: int
    blocks: tuple[tuple[str, int, int], ...]

    def total(self, checkpointing: bool) -> int:
        """The activations at their peak, the turn from forward to backward. With checkpointing:
        outside + every block's inputs + the largest block's saves (recomputed one block at a time)."""
        if checkpointing:
            return self.outside + sum(i for _, _, i in self.blocks) + max((a for _, a, _ in self.blocks), default=0)
        return self.outside + sum(a for _, a, _ in self.blocks)

    def timeline(self, checkpointing: bool) -> list[tuple[str, int]]:
        """(unit, activations held while it runs, forward or backward) in forward order: all saved
        outside, what the units before it keep (checkpointing: their inputs) and its own saves."""
        out, kept = [], self.outside
        for name, saved, inputs in self.blocks:
            out.append((name, kept + saved + (inputs if checkpointing else 0)))
            kept += inputs if checkpointing else saved
        return out


def activation_profile(model: nn.Module, inputs: dict, unit_names: list[str],
                       flash_attention: bool = True) -> ActivationProfile:
    """What autograd saves for backward in one forward (saved-tensor hooks; parameters excluded,
    views counted once), by unit (ActivationProfile). `unit_names`: the submodules (by name) that are
    FSDP units; the outermost of them are the blocks activation checkpointing recomputes.
    `flash_attention`: attention saves what the GPU's flash / memory-efficient SDPA saves
    (flash_attention_saves); False: what the math reference saves (two fp32 L x L per call). The
    hooks see what autograd really keeps: ops save an input only where a grad needs it, so under
    LoRA (frozen base, inputs without grad) the count is of what LoRA keeps."""
    params = {id(p) for p in model.parameters()}
    seen, per_block, outside, block_inputs = set(), {}, [0], {}
    current: list = [None]

    def pack(t):
        base = t._base if t._base is not None else t
        if id(base) in params or id(t) in params or id(base) in seen:
            return t
        seen.add(id(base))
        keep.append(base)
        n = base.numel() * base.element_size()
        if current[0] is None:
            outside[0] += n
        else:
            per_block[current[0]] = per_block.get(current[0], 0) + n
        return t

    keep: list = []
    hooks = []
    blocks = {n: model.get_submodule(n) for n in unit_names}
    inside = [set(o.modules()) for o in blocks.values()]
    outer = {n: b for n, b in blocks.items() if not any(b is not o and b in m for o, m in zip(blocks.values(), inside))}

    def hooks_for(name):
        def enter(mod, args, kwargs):
            if current[0] is None:
                current[0] = name
                block_inputs[name] = sum(a.numel() * a.element_size() for a in list(args) + list(kwargs.values())
                                         if torch.is_tensor(a))

        def leave(mod, args, kwargs, out):
            if current[0] == name:
                current[0] = None
        return enter, leave

    for name, b in outer.items():
        enter, leave = hooks_for(name)
        hooks.append(b.register_forward_pre_hook(enter, with_kwargs=True))
        hooks.append(b.register_forward_hook(leave, with_kwargs=True))
    try:
        attention = flash_attention_saves() if flash_attention else contextlib.nullcontext()
        with attention, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(**inputs)
    finally:
        for h in hooks:
            h.remove()
    # block_inputs is filled in forward order (dicts keep insertion order)
    return ActivationProfile(outside[0], tuple((n, per_block.get(n, 0), i) for n, i in block_inputs.items()))


def activation_bytes(model: nn.Module, inputs: dict, unit_names: list[str], checkpointing: bool,
                     flash_attention: bool = True) -> int:
    """Bytes autograd saves for backward in one forward (activation_profile), with checkpointing:
    what is saved outside blocks + every block's inputs + the largest block's own saved bytes."""
    return activation_profile(model, inputs, unit_names, flash_attention).total(checkpointing)


def _folder_shapes(folder: str, kind: str) -> tuple[int, int]:
    """(pixels per latent, text tokens) as the scripts see them: the VAE's downsampling factor
    (8 for the real models; AutoencoderKLQwenImage's is 2 ** its temporal downsamplings, as its
    pipelines compute it) and the tokenizer length (CLIP 77 / T5 512, capped at the tokenizer's
    model_max_length when the folder has tokenizers, e.g. 32 for the tiny defaults; Qwen-Image-Edit:
    QWEN_TEXT_TOKENS, the prompt with its reference images, not padded to a length)."""
    with open(os.path.join(folder, "vae", "config.json")) as f:
        vae = json.load(f)
    if kind.startswith("qwen_image_edit"):
        return 2 ** len(vae["temperal_downsample"]), QWEN_TEXT_TOKENS
    factor = 2 ** (len(vae["block_out_channels"]) - 1)
    clip = kind in ("sd15", "sdxl")
    text = 77 if clip else 512
    tok = os.path.join(folder, "tokenizer" if clip else "tokenizer_2", "tokenizer_config.json")
    if os.path.exists(tok):
        with open(tok) as f:
            text = int(min(text, json.load(f).get("model_max_length", text)))
    return factor, text


def _pooled_dim(folder: str, unet_config) -> int:
    """SDXL's pooled text embedding width: text_encoder_2's projection_dim (1280), else what the
    UNet's add embedding takes besides the time ids (projection_class_embeddings_input_dim - 6 x
    addition_time_embed_dim)."""
    dim = _config(folder, "text_encoder_2").get("projection_dim")
    if dim:
        return int(dim)
    return unet_config.projection_class_embeddings_input_dim - 6 * unet_config.addition_time_embed_dim


def _meta_inputs(kind: str, model: nn.Module, batch: int, resolution: int, dtype: torch.dtype,
                 factor: int = 8, text: int | None = None, pooled: int | None = None, references: tuple = ()) -> dict:
    """The trainable model's forward inputs on meta. SDXL: encoder_hidden_states (B, 77, 2048) and
    added_cond_kwargs text_embeds (B, pooled) + time_ids (B, 6), as train_dmd.py passes them.
    Qwen-Image-Edit: the target's and QWEN_REFERENCES references' tokens and their img_shapes, the
    prompt's hidden states without a mask (the pipeline drops an all-ones one). FLUX.2: the target's
    tokens and those of `references` (their (h, w) token grids, reference_grids), 4-D ids, the padded
    text, [dev]'s guidance."""
    cfg = model.config
    text = text or (77 if kind in ("sd15", "sdxl") else 512)
    with torch.device("meta"):
        if kind in ("sd15", "sdxl"):
            lat = resolution // factor
            inputs = dict(sample=torch.empty(batch, cfg.in_channels, lat, lat, dtype=dtype, requires_grad=True),
                          timestep=torch.zeros(batch, dtype=torch.long),
                          encoder_hidden_states=torch.empty(batch, text, cfg.cross_attention_dim, dtype=dtype),
                          return_dict=False)
            if kind == "sdxl":
                pooled = pooled or cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim
                n_time = (cfg.projection_class_embeddings_input_dim - pooled) // cfg.addition_time_embed_dim
                inputs["added_cond_kwargs"] = {"text_embeds": torch.empty(batch, pooled, dtype=dtype),
                                               "time_ids": torch.empty(batch, n_time, dtype=dtype)}
            return inputs
        if kind == "qwen_image_edit":  # target + QWEN_REFERENCES references, each its own (frame, h, w) for RoPE
            side = resolution // (2 * factor)
            shapes = [(1, side, side)] * (1 + QWEN_REFERENCES)
            return dict(hidden_states=torch.empty(batch, len(shapes) * side * side, cfg.in_channels, dtype=dtype,
                                                  requires_grad=True),
                        encoder_hidden_states=torch.empty(batch, text, cfg.joint_attention_dim, dtype=dtype),
                        timestep=torch.empty(batch, dtype=dtype), img_shapes=[shapes] * batch, return_dict=False)
        if kind == "flux2":  # [target ; references], as families/flux2.model_inputs packs them
            side = resolution // (2 * factor)
            tokens = side * side + sum(h * w for h, w in references)
            return dict(hidden_states=torch.empty(batch, tokens, cfg.in_channels, dtype=dtype, requires_grad=True),
                        encoder_hidden_states=torch.empty(batch, text, cfg.joint_attention_dim, dtype=dtype),
                        timestep=torch.empty(batch, dtype=dtype),
                        img_ids=torch.zeros(batch, tokens, 4, dtype=torch.long),
                        txt_ids=torch.zeros(batch, text, 4, dtype=torch.long),
                        guidance=torch.empty(batch) if cfg.guidance_embeds else None, return_dict=False)
        tokens = _image_tokens(resolution, factor)  # target + context: VAE factor, 2x2 packing
        return dict(hidden_states=torch.empty(batch, tokens, cfg.in_channels, dtype=dtype, requires_grad=True),
                    encoder_hidden_states=torch.empty(batch, text, cfg.joint_attention_dim, dtype=dtype),
                    pooled_projections=torch.empty(batch, cfg.pooled_projection_dim, dtype=dtype),
                    timestep=torch.empty(batch, dtype=dtype), img_ids=torch.zeros(tokens, 3),
                    txt_ids=torch.zeros(text, 3), guidance=torch.empty(batch), return_dict=False)


# ----------------------------------------------------------------------------------------------
# context parallelism (train_flux_kontext.py's CONTEXT_PARALLEL)

def check_context_parallel(folder: str, s: Settings) -> dict:
    """The checks train_flux_kontext.py makes before any work (fsdp_utils.check_context_parallel,
    families/flux.check_context_parallel), on the planner's flags: SystemExit with one line if one fails.
    Returns the sequence CP splits: {"heads", "text", "image"} (image: target + context tokens at
    s.resolution, the model's native one if None); {} without CP (nothing is read)."""
    c = s.context_parallel
    if not isinstance(c, int) or c < 1:
        raise SystemExit(f"plan: --context_parallel={c}: must be >= 1 (1 = off)")
    if c == 1:
        return {}
    script, kind = layout(folder, s.script)
    if kind != "flux_kontext":
        raise SystemExit(_no_cp(f"--context_parallel={c}", os.path.basename(os.path.normpath(folder)), script, kind))
    if s.world_size % (c * s.dp_replicate):
        raise SystemExit(f"plan: --context_parallel={c} x --dp_replicate={s.dp_replicate} does not divide "
                         f"--world_size={s.world_size}")
    heads = _config(folder, "transformer")["num_attention_heads"]
    if heads % c:
        raise SystemExit(f"plan: --context_parallel={c}: the transformer's {heads} attention heads do not divide "
                         f"by it (Ulysses splits the heads)")
    factor, text = _folder_shapes(folder, kind)
    if text % c:
        raise SystemExit(f"plan: --context_parallel={c}: the {text} text tokens (T5 length) do not divide by it")
    resolution = s.resolution or native_resolution(folder, kind)
    image = _image_tokens(resolution, factor)
    if image % c:
        raise SystemExit(f"plan: --context_parallel={c}: {resolution} px has {image} image tokens (target + context, "
                         f"2 x ({resolution}/{2 * factor})^2), not divisible by it; change --resolution")
    return dict(heads=heads, text=text, image=image)


def _no_cp(flag: str, name: str, script: str, kind: str) -> str:
    """The one line refusing context parallelism for a layout other than FLUX Kontext's fine-tune."""
    if script == "train_flux_kontext.py":  # another family of the script: its CP is not planned
        return f"plan: {flag}: context parallelism is planned for FLUX Kontext only; {name} is {kind}"
    return (f"plan: {flag}: context parallelism is train_flux_kontext.py's (FLUX layout); {name} is planned for "
            f"{script}, which has none")


def _cp_activations(folder: str, trainable: Part, kind: str, unit_names: tuple, dtype: torch.dtype, s: Settings,
                    sequence: dict, one_forward: int, activations) -> dict:
    """A CP rank's activations: {"per_rank", "whole", "buffers"}. Ulysses keeps on each rank the
    token-wise tensors of its 1/C of the sequence, and attention's flash saves over all tokens for
    H/C heads (1/C too); what has no sequence dimension (timestep, guidance and pooled embeddings,
    the modulation vectors) is whole on every rank. With flash saves every saved tensor is linear in
    the tokens, A(L) = a + b L: a second meta forward at a quarter of the text and image tokens gives
    a. Added: the all-to-all buffers of one attention call (q, k, v and the output, each sent and
    received: 8 x L/C x inner width) and the final output all-gathered for the loss (fp32)."""
    ac, c, text, image = s.activation_checkpointing, s.context_parallel, sequence["text"], sequence["image"]
    factor = _folder_shapes(folder, kind)[0]
    small_res, small_text = s.resolution // 2, max(1, text // 4)
    n1, n2 = text + image, small_text + _image_tokens(small_res, factor)
    small = activations(folder, trainable.spec.subfolder, kind, unit_names, dtype, s.batch_size, small_res,
                        trainable.lora, small_text).total(ac)
    whole = min(one_forward, max(0, (n1 * small - n2 * one_forward) // (n1 - n2)))
    cfg = _config(folder, trainable.spec.subfolder)
    inner = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    out_channels = cfg.get("out_channels") or cfg["in_channels"]
    buffers = (8 * s.batch_size * n1 * inner // c * _size(dtype)
               + s.batch_size * image * out_channels * (c - 1) // c * _size(torch.float32))
    return dict(per_rank=whole + -(-(one_forward - whole) // c) + buffers, whole=whole, buffers=buffers)


def reference_grids(kind: str, s: Settings) -> tuple:
    """FLUX.2's references as (h, w) token grids: s.references (FLUX2_REFERENCES) images at least
    s.reference_area (the pipeline's REFERENCE_AREA) large, so each downsized to it and cut to multiples of 16
    by the pipeline's rule (families/flux2.pipeline_size), square; () for other kinds."""
    if DMD_KINDS.get(kind, kind) != "flux2":
        return ()
    room = FAMILIES["Flux2Pipeline"]
    area = s.reference_area or room.REFERENCE_AREA
    side = math.isqrt(area)
    h, w = room.pipeline_size(side, side, area)[1]
    return ((h // room.MULTIPLE, w // room.MULTIPLE),) * (FLUX2_REFERENCES if s.references is None else s.references)


def _image_tokens(resolution: int, factor: int) -> int:
    """FLUX Kontext's image tokens at a square resolution: target + context, 2x2-packed latents."""
    return 2 * (resolution // (2 * factor)) ** 2


# ----------------------------------------------------------------------------------------------
# the plan

def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@functools.lru_cache(maxsize=None)
def _activations(folder: str, subfolder: str, kind: str, unit_names: tuple, dtype: torch.dtype, batch: int,
                 resolution: int, lora: lora_lib.Lora = lora_lib.Lora(), text: int = 0,
                 references: tuple = ()) -> ActivationProfile:
    """What one forward of the trainable model (folder/subfolder) saves, by unit (activation_profile),
    its blocks being the units of `unit_names`: those its recipe made. With `lora`: of the model with
    its adapters (computed in `dtype`, as FSDP all-gathers them) on a frozen base, its inputs not
    requiring grad (the latents do not), so autograd saves what LoRA keeps: each adapted Linear's
    input (lora_A's grad) and its rank-r intermediate (lora_B's), and of the frozen layers only what
    the input grads need. `text`: the text tokens (0: the folder's); `references`: FLUX.2's reference grids."""
    model = meta_model(os.path.join(folder, subfolder)).to(dtype)
    if lora:
        _add_lora_on_meta(model, lora)
        model.to(dtype)
    factor, folder_text = _folder_shapes(folder, kind)
    pooled = _pooled_dim(folder, model.config) if kind == "sdxl" else None
    inputs = _meta_inputs(kind, model, batch, resolution, dtype, factor, text or folder_text, pooled, references)
    if lora:
        for x in inputs.values():
            if torch.is_tensor(x):
                x.requires_grad_(False)
    return activation_profile(model, inputs, list(unit_names))


# the built-in real-size configs never change within a process: their shard counts and measured
# activations are kept for every later plan (tests and fit tables plan the same models many times)
_BUILTIN_SHARDS: dict = {}


@functools.lru_cache(maxsize=None)
def _builtin_activations(*args, **kwargs) -> ActivationProfile:
    return _activations(*args, **kwargs)


def plan(name: str, s: Settings, shard_cache: dict | None = None) -> dict:
    """Per-rank GPU bytes by category (and host bytes with CPU offload) for these settings.
    `shard_cache`: a dict to keep shard_components' counts in across calls that differ only in
    precision, CPU offload, checkpointing, batch or resolution (the counts do not depend on them:
    fully_shard splits each parameter's dim 0 over the mesh whatever its dtype or where it lives);
    a built-in configuration always keeps them in one dict for the process (_BUILTIN_SHARDS).
    LoRA (s.lora_rank > 0): see the module's docstring; the LoRA components' rows are their frozen
    base (name) and their adapters (name + ".lora"), and the plan says what is trainable (`lora`).
    Context parallelism (s.context_parallel = C > 1, FLUX only; checked first, check_context_parallel):
    sharded on the script's dp x cp mesh; the activations are a rank's share of one forward's over the
    full sequence (_cp_activations), and the plan has `cp`: the degree, the sequence it splits, that
    one forward's activations, the part held whole and the buffers. DMD2 on FLUX Kontext (s.script
    train_dmd.py on a FLUX folder, or the name flux-kontext-dmd): the three transformers of
    pipeline_components, the teacher in NF4 with BASE_DTYPE=nf4 under LoRA (NF4_TEACHER_KINDS).
    s.ema: an "ema" row, a copy of the trained model's shards in its storage dtype (LoRA: of its
    adapters, fp32), wherever they live."""
    s = with_script(name, s)
    precision = get_precision(s.precision)
    folder = model_folder(name)
    builtin = os.path.dirname(os.path.abspath(folder)) == os.path.join(HERE, "real_size_configs")
    if builtin:  # whoever plans them (memo_planner too): the built-in configs are sharded once per process
        shard_cache = _BUILTIN_SHARDS
    activations = _builtin_activations if builtin else _activations
    sequence = check_context_parallel(folder, s)
    kind = layout(folder, s.script)[1]
    if (s.references is not None or s.reference_area) and DMD_KINDS.get(kind, kind) != "flux2":
        raise SystemExit(f"plan: --references / --reference_area: FLUX.2's; {name} is {kind}, planned with its "
                         f"pipeline's references")
    # resharding after forward, like checkpointing and offload, changes what fully_shard keeps, not its shards
    key = (os.path.abspath(folder), s.world_size, s.dp_replicate, tuple(s.block_classes))
    if kind in DMD_KINDS:  # the same folder, other components
        key += (kind,)
    if s.lora:  # the adapters change the counts (alpha does not); a full fine-tune keeps its key
        key += (s.lora_rank, tuple(s.lora_targets), s.fake_lora)
    if s.context_parallel > 1:  # another mesh (same shards: FSDP spans dp x cp), so sharded again
        key += (s.context_parallel,)
    key += (repr(MODELS), repr(pipelines.PIPELINES))  # the recipes' unit classes and roles decide the shards
    cached = shard_cache is not None and key in shard_cache
    script, kind, comps = build_components(folder, precision, build=not cached, lora=s.lora, fake_lora=s.fake_lora,
                                           script=s.script)
    forward = DMD_KINDS.get(kind, kind)  # the forward's inputs (DMD2 on FLUX: Kontext's, measured once for both)
    if s.resolution is None:
        s = dataclasses.replace(s, resolution=native_resolution(folder, kind))
    trainable = next(c for c in comps if c.holding.trained)
    sharded = shard_cache[key] if cached else shard_components(comps, s, precision)
    if shard_cache is not None:
        shard_cache[key] = sharded
    # the outermost units are the blocks the recipe checkpoints; the root (listed last) is not a block
    unit_names = tuple(n for n, _ in sharded[trainable.name]["units"][:-1])
    ac = s.activation_checkpointing
    refs = reference_grids(kind, s)
    profile = activations(folder, trainable.spec.subfolder, forward, unit_names, precision.compute_dtype,
                          s.batch_size, s.resolution, trainable.lora, references=refs)
    acts = profile.total(ac)
    for c in comps:  # LoRA: a trained model without adapters (DMD's full fake score) may save more
        if s.lora and c.holding.trained and c is not trainable:
            names = tuple(n for n, _ in sharded[c.name]["units"][:-1])
            acts = max(acts, activations(folder, c.spec.subfolder, forward, names, precision.compute_dtype,
                                         s.batch_size, s.resolution, c.lora, references=refs).total(ac))
    # DMD's FAKE_SCORE_FP32: the fake score's units are gathered and its training forward saves in fp32
    fp32_compute = {c.name for c in comps if c.name == "fake_score" and c.holding.trained and s.fake_score_fp32}
    for c in comps:
        if c.name in fp32_compute and precision.compute_dtype != torch.float32:
            names = tuple(n for n, _ in sharded[c.name]["units"][:-1])
            acts = max(acts, activations(folder, c.spec.subfolder, forward, names, torch.float32, s.batch_size,
                                         s.resolution, c.lora, references=refs).total(ac))
    one_forward = acts
    if s.context_parallel > 1:  # FLUX Kontext only (check_context_parallel): one trained model
        cp = _cp_activations(folder, trainable, forward, unit_names, precision.compute_dtype, s, sequence, one_forward,
                             activations)
        acts = cp["per_rank"]
    p_size, c_size, r_size = _size(precision.param_dtype), _size(precision.compute_dtype), _size(precision.reduce_dtype)

    def compute_size(c: Part) -> int:
        return _size(torch.float32) if c.name in fp32_compute else c_size

    # FP8=tensorwise: a full trained model's FP8 weights gathered in float8 (as the scripts decide it)
    from parallel import float8
    float8_gather = s.fp8 == "tensorwise" and float8.gathers_in_float8(False, s.world_size // s.dp_replicate)

    def trained_unit_bytes(c: Part) -> list[int]:  # a full trained model's gathered units; FP8's weights in float8
        fp8 = sharded[c.name]["fp8_units"] if float8_gather else [0] * len(sharded[c.name]["units"])
        return [u * compute_size(c) - f * (compute_size(c) - 1) for (_, u), f in zip(sharded[c.name]["units"], fp8)]
    rows, gathered_units, result_load, lora_units = {}, [], [], {}
    nf4_teacher = kind in NF4_TEACHER_KINDS and s.base_dtype == "nf4" and s.lora_rank > 0
    for c in comps:
        info, h = sharded[c.name], c.holding
        if not h.resident:
            rows[c.name] = dict(params=0, grads=0, optim=0, note="text embeddings cached before training",
                                sharded=False)
            continue
        local = info["local"] if h.sharded else info["global"]
        note = c.spec.role + (" (fp32)" if c.name in FP32_COMPONENTS.get(kind, ()) else "") + \
            (" (fp32 compute)" if c.name in fp32_compute and c_size != _size(torch.float32) else "")
        if c.lora:  # the frozen base, then its adapters: only they have grads and optimizer state
            n, a = info["trainable_local"], _size(ADAPTER_DTYPE)
            base_local = local - n
            if s.base_dtype == "nf4":  # the quantised share of the base, the rest (biases, norms, ...) as is
                base_bytes, load_peak, units = _nf4_base(info, base_local, _size(c.dtype), compute_size(c),
                                                         s.world_size)
                result_load.append(load_peak)
            else:
                base_bytes = base_local * _size(c.dtype)
                units = [u * compute_size(c) for _, u in info["units"]]  # base and adapters, in compute dtype
            gathered_units += units
            lora_units[c.name] = {name: b for (name, _), b in zip(info["units"], units)}
            rows[c.name] = dict(params=base_bytes, grads=0, optim=0,
                                note=f"frozen LoRA base ({'nf4' if s.base_dtype == 'nf4' else dtype_name(c.dtype)})",
                                count=info["global"] - info["trainable_global"], local_count=base_local, sharded=True)
            rows[c.name + ".lora"] = dict(params=n * a, grads=n * a, optim=int(n * _state_bytes(s.optimizer, a)),
                                          note=f"LoRA adapters, rank {c.lora.rank} ({dtype_name(ADAPTER_DTYPE)})"
                                          + _optimizer_note(s.optimizer),
                                          count=info["trainable_global"], local_count=n, sharded=True, adapters=True)
            continue
        if nf4_teacher and h.sharded and not h.trained:  # stored and gathered as the NF4 LoRA bases are
            base_bytes, load_peak, units = _nf4_base(info, local, _size(c.dtype), _size(c.dtype), s.world_size)
            result_load.append(load_peak)
            gathered_units += units
            rows[c.name] = dict(params=base_bytes, grads=0, optim=0, note=f"{note} (nf4)", count=info["global"],
                                local_count=local, sharded=True)
            continue
        trained = (info["trainable_local"] if h.sharded else info["trainable_global"]) if h.trained else 0
        rows[c.name] = dict(params=local * _size(c.dtype), grads=trained * p_size,
                            optim=int(trained * _state_bytes(s.optimizer, p_size)),
                            note=note + (_optimizer_note(s.optimizer) if h.trained else ""),
                            count=info["global"], local_count=local, sharded=h.sharded)
        if h.sharded and h.trained:
            gathered_units += trained_unit_bytes(c)
            if s.fp8 == "tensorwise":  # + one fp32 scale per converted weight, precomputed every step
                rows[c.name]["note"] += ", FP8: weights gathered in float8"
                rows[c.name]["params"] += 4 * info["fp8_count"]
        elif h.sharded:
            gathered_units += [u * _size(c.dtype) for _, u in info["units"]]
    biggest = sorted(gathered_units, reverse=True)
    free = reshard_free(comps, sharded, s, compute_size)
    copies = sum(sum(trained_unit_bytes(c)) if c.holding.trained and not c.lora else
                 sum(u * compute_size(c) for _, u in sharded[c.name]["units"]) for c in comps if c.name in free)
    trained_parts = [c for c in comps if c.holding.trained]
    frozen_sharded = [c for c in comps if c.holding.resident and c.holding.sharded and not c.holding.trained]
    at_peak = None
    if trainable.lora and trained_parts == [trainable] and not frozen_sharded and not free:
        at_peak = in_flight_at_peak(profile, lora_units[trainable.name], ac)
    if free and free == {c.name for c in trained_parts}:  # kept gathered from forward to backward
        gathered = copies
    elif at_peak is not None:  # one LoRA model: its few grads put the step's peak where the activations peak
        gathered = at_peak
    else:  # any others hold two units at a time, counted beside all the activations and grads
        gathered = copies + sum(biggest[:2])
    if s.lora:  # reduce-scatter input of the largest unit's grads: LoRA units' adapters only, in fp32
        gathered += max(max(sharded[c.name]["trainable_units"]) * _size(ADAPTER_DTYPE) if c.lora else
                        max(u for _, u in sharded[c.name]["units"]) * r_size for c in comps if c.holding.trained)
    else:
        # reduce-scatter input of the largest unit
        gathered += max(u for _, u in sharded[trainable.name]["units"]) * r_size
    if s.ema:  # sharded like the model it copies (train_*.py's ema_lib.build_ema), so offloaded with it
        rows = _with_ema(rows, trainable, sharded[trainable.name])
    trained = {c.name for c in comps if c.holding.trained} | {c.name + ".lora" for c in comps if c.lora} | {"ema"}
    states = sum(r["params"] + r["grads"] + r["optim"] for n, r in rows.items() if n in trained)
    frozen = sum(r["params"] for n, r in rows.items() if n not in trained)
    host = states if s.cpu_offload else 0
    gpu = (0 if s.cpu_offload else states) + frozen + gathered + acts + RUNTIME_BYTES
    result = dict(kind=kind, script=script, rows=rows, gathered=gathered, reshard_free=sorted(free),
                  at_peak=at_peak is not None,
                  largest_unit=biggest[0] if biggest else 0,
                  activations=acts, runtime=RUNTIME_BYTES, gpu_total=gpu, host_total=host, settings=s,
                  units={c.name: sharded[c.name]["units"] for c in comps if c.holding.sharded})
    if s.context_parallel > 1:
        result["cp"] = dict(sequence, degree=s.context_parallel, one_forward=one_forward, whole=cp["whole"],
                            buffers=cp["buffers"])
    if result_load:  # BASE_DTYPE=nf4: the host peak while loading (meta path), per rank
        result["load_peak"] = max(result_load)
    if s.lora:  # what trains: {component: (adapter params, all its params incl. adapters)}, and the targets
        result["lora"] = {c.name: (sharded[c.name]["trainable_global"], sharded[c.name]["global"])
                          for c in comps if c.lora}
        result["lora_targets"] = tuple(s.lora_targets) or default_lora_targets(folder, trainable.spec.subfolder)
    if refs:
        result["references"] = refs
    fill = fill_phase(folder, kind, comps, sharded, s, precision)
    if fill:
        result["fill"] = fill
    return result


@functools.lru_cache(maxsize=None)
def default_lora_targets(folder: str, subfolder: str) -> tuple:
    """The model's default LoRA targets (parallel.model_facts.MODELS); a callable default is asked of the
    model, built on meta."""
    default = getattr(MODELS.get(_config(folder, subfolder).get("_class_name", "")), "lora_targets", ())
    return tuple(default(meta_model(os.path.join(folder, subfolder))) if callable(default) else default)


# ----------------------------------------------------------------------------------------------
# the text-cache fill: the offline components, before training

class _LiveBytes(TorchDispatchMode):
    """The peak of the bytes held at once by the tensors the ops within create, each counted until it is
    freed (views and in-place results share an input's storage: not counted): what a forward without grad
    holds beyond its weights, on meta."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0

    def _free(self, n: int) -> None:
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not any(r.alias_info is not None for r in func._schema.returns):
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    n = t.numel() * t.element_size()
                    self.live += n
                    weakref.finalize(t, self._free, n)
            self.peak = max(self.peak, self.live)
        return out


@functools.lru_cache(maxsize=None)
def fill_activations(folder: str, subfolder: str, dtype: torch.dtype, batch: int, text: int) -> int:
    """The peak bytes beyond the weights of one forward without grad of a text encoder over `batch` prompts
    of `text` tokens (at most its positions), as the pipelines' encode_prompt runs it: a language model
    (Qwen2.5-VL, Mistral 3, Qwen3) keeps every layer's hidden states (they read middle layers) and its logits,
    without a KV cache; CLIP and T5 return their last state. The mask is given 4-D (the data-dependent checks
    of a 2-D one cannot run on meta); attention runs meta's math SDPA, so one layer's L x L scores count."""
    model = meta_model(os.path.join(folder, subfolder)).to(dtype)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    text = min(text, getattr(config, "max_position_embeddings", None) or text)
    language_model = model.get_output_embeddings() is not None
    with torch.device("meta"):
        kw = dict(input_ids=torch.zeros(batch, text, dtype=torch.long),
                  attention_mask=torch.ones(batch, 1, text, text, dtype=torch.bool),
                  output_hidden_states=language_model)
    if "use_cache" in inspect.signature(model.forward).parameters:
        kw["use_cache"] = False
    live = _LiveBytes()
    with torch.no_grad(), live:
        model(**kw)
    return live.peak


def fill_phase(folder: str, kind: str, comps: list[Part], sharded: dict, s: Settings, precision) -> dict | None:
    """The text-cache fill's per-rank peak, before training (None without offline components): every offline
    component loaded at once in the compute dtype (s.text_encoder_dtype nf4: its Linear weights in NF4), sharded
    over the ranks in units of its own _no_split_modules (fill_sharded), run one at a time on TEXT_FILL_BATCH
    prompts of the text length: its shards, the units in flight (the root, which stays gathered through the
    forward, and the two largest blocks: current and prefetched; with NF4 one Linear dequantised), the
    activations without grad (fill_activations) and the runtime reserve. Freed before the trained model is built."""
    offline = [c for c in comps if not c.holding.resident]
    if not offline:
        return None
    text, size = _folder_shapes(folder, kind)[1], _size(precision.compute_dtype)
    params = gathered = acts = 0
    for c in offline:
        info = sharded[c.name]
        if s.text_encoder_dtype == "nf4":
            shard, _, units = _nf4_base(info, info["local"], size, size, max(1, s.world_size))
        else:
            shard, units = info["local"] * size, [u * size for _, u in info["units"]]
        params += shard
        if fill_sharded(c, s):
            blocks = sorted(units[:-1], reverse=True)
            gathered = max(gathered, units[-1] + sum(blocks[:2]))
        elif s.text_encoder_dtype == "nf4":  # whole, dequantised one Linear at a time
            gathered = max(gathered, info["nf4_largest"] * size)
        acts = max(acts, fill_activations(folder, c.spec.subfolder, precision.compute_dtype, TEXT_FILL_BATCH, text))
    return dict(components={c.name: sharded[c.name]["global"] for c in offline}, params=params, gathered=gathered,
                activations=acts, runtime=RUNTIME_BYTES, total=params + gathered + acts + RUNTIME_BYTES,
                batch=TEXT_FILL_BATCH, text=text, sharded=any(fill_sharded(c, s) for c in offline),
                dtype="nf4" if s.text_encoder_dtype == "nf4" else dtype_name(precision.compute_dtype))


def peak_bytes(p: dict) -> int:
    """A plan's per-GPU peak over its phases: training, and the text-cache fill before it."""
    return max(p["gpu_total"], (p.get("fill") or {}).get("total", 0))


def in_flight_at_peak(profile: ActivationProfile, unit_bytes: dict, checkpointing: bool) -> int | None:
    """The all-gathered bytes in flight when one model's activations and units together peak, for
    {unit name: gathered bytes} (root "<root>"): at each unit, in forward or backward, the root (FSDP2
    keeps it gathered), that unit and the neighbour prefetched (the next in forward, the previous in
    backward), beside the activations held then (ActivationProfile.timeline); at least the root and
    the last unit, kept gathered from forward to backward. None where the profile's units are not
    the sharded ones (then the caller's bound applies)."""
    timeline = profile.timeline(checkpointing)
    if not timeline or any(n not in unit_bytes for n, _ in timeline):
        return None
    root, g = unit_bytes.get("<root>", 0), [unit_bytes[n] for n, _ in timeline]
    peak = max(t + root + g[i] + max(g[i - 1] if i else 0, g[i + 1] if i + 1 < len(g) else 0)
               for i, (_, t) in enumerate(timeline))
    return max(peak - profile.total(checkpointing), root + g[-1])


def reshard_free(comps: list[Part], sharded: dict, s: Settings, compute_size) -> set[str]:
    """The trained components that keep their gathered params from forward to backward: all of them
    with reshard_after_forward=False; with auto (None) those the scripts' rule keeps
    (fsdp_utils.reshard_free_fits: one rank per shard group, the compute copy at most a share of
    s.gpu_memory_gb; unknown memory: none)."""
    if s.reshard_after_forward:
        return set()
    free = set()
    for c in comps:
        if not c.holding.trained:
            continue
        copy = sum(u for _, u in sharded[c.name]["units"]) * compute_size(c)
        if s.reshard_after_forward is False or not fsdp_utils.reshard_free_fits(
                s.world_size // s.dp_replicate, s.cpu_offload, copy, int(s.gpu_memory_gb * GIB))[0]:
            free.add(c.name)
    return free


def _nf4_base(info: dict, base_local: int, stored: int, compute: int, world: int) -> tuple[int, int, list[int]]:
    """A frozen base whose Linear weights BASE_DTYPE=nf4 quantises (shard_components' nf4 counts):
    (its shard's bytes, the host peak while loading it, the bytes of each unit in flight). The rest
    (biases, norms, ...) stays in the stored dtype (`stored` bytes); units are gathered as codes plus
    the rest in the compute dtype, and one Linear's weight is dequantised at a time."""
    q = -(-info["nf4_global"] // world)
    base_bytes = int(q * NF4_BYTES + (base_local - q) * stored)
    load_peak = int(base_bytes + info["nf4_largest"] * NF4_LOAD_BYTES_PER_PARAM)
    frac = info["nf4_global"] / max(1, info["global"] - info.get("trainable_global", 0))
    unit_bytes = frac * NF4_BYTES + (1 - frac) * compute
    temp = info["nf4_largest"] * compute
    return base_bytes, load_peak, [int(u * unit_bytes) + temp for _, u in info["units"]]


def _with_ema(rows: dict, trainable: Part, info: dict) -> dict:
    """`rows` with an "ema" row after the trained model's: a copy of its local shards in its storage
    dtype, or (LoRA) of its adapters in theirs (parallel/ema.py's AdapterEMA); no grads, no state."""
    if trainable.lora:
        n, count, dtype, what = info["trainable_local"], info["trainable_global"], ADAPTER_DTYPE, "adapters"
    else:
        n, count, dtype, what = info["local"], info["global"], trainable.dtype, "weights"
    row = dict(params=n * _size(dtype), grads=0, optim=0, count=count, local_count=n, sharded=True,
               adapters=bool(trainable.lora), note=f"EMA of {trainable.name}'s {what} ({dtype_name(dtype)})")
    after = trainable.name + (".lora" if trainable.lora else "")
    out = {}
    for name, r in rows.items():
        out[name] = r
        if name == after:
            out["ema"] = row
    return out


# what cheapest_fit tries, in order of what it costs in speed: (checkpointing, CPU offload, bf16 states)
FIT_ORDER = [(False, False, False), (True, False, False), (False, False, True), (True, False, True),
             (False, True, False), (True, True, False), (True, True, True)]


def _state_bytes(optimizer: str, param_bytes: int) -> float:
    """Bytes per parameter of AdamW's two states under OPTIMIZER: adamw keeps them in the params'
    dtype, torchao's 8-/4-bit ones block-quantised whatever it is."""
    return 2 * (STATE_BYTES[optimizer] if optimizer in STATE_BYTES else param_bytes)


def _optimizer_note(optimizer: str) -> str:
    return f", {optimizer} states" if optimizer != "adamw" else ""


def cheapest_fit(name: str, s: Settings, gpu_bytes: int, planner=None, cpu_offload: bool = True,
                 nf4_text_encoder: bool = True) -> tuple[Settings, dict] | None:
    """Settings that fit, in order of what they cost in speed: nothing, checkpointing, bf16
    states, CPU offload (slowest; not tried without `cpu_offload`), and their combinations; both
    phases must fit: training, and the text-cache fill before it, whose encoders go NF4
    (text_encoder_dtype; not without `nf4_text_encoder`) where they do not fit as they are (none of
    the training settings changes the fill). `planner`: plan, or a cached one."""
    planner = planner or plan
    for ac, off, bf16 in FIT_ORDER:
        if (bf16 and s.lora_rank > 0) or (off and not cpu_offload):  # LoRA: the base is in the compute dtype
            continue
        trial = Settings(**{**s.__dict__, "activation_checkpointing": ac, "cpu_offload": off,
                            "precision": "bf16" if bf16 else s.precision,
                            "gpu_memory_gb": gpu_bytes / GIB})  # what auto resharding decides on
        result = planner(name, trial)
        if result["gpu_total"] > gpu_bytes:
            continue
        if peak_bytes(result) <= gpu_bytes:
            return trial, result
        if s.text_encoder_dtype != "nf4" and nf4_text_encoder:
            trial = dataclasses.replace(trial, text_encoder_dtype="nf4")
            result = planner(name, trial)
            if peak_bytes(result) <= gpu_bytes:
                return trial, result
        return None
    return None


def fewest_gpus(name: str, s: Settings, gpu_bytes: int, world_sizes=(1, 2, 4, 8), planner=None,
                **fit) -> tuple[Settings, dict] | None:
    """The smallest of `world_sizes` with settings that fit (cheapest_fit, `fit` its options), and
    those settings and their plan; None if none does."""
    for ws in world_sizes:
        found = cheapest_fit(name, dataclasses.replace(s, world_size=ws), gpu_bytes, planner, **fit)
        if found is not None:
            return found
    return None


def format_plan(name: str, p: dict) -> str:
    s = p["settings"]
    head = (f"plan: {name} ({p['kind']}), world size {s.world_size} (dp_replicate {s.dp_replicate}), "
            f"{s.precision}, batch {s.batch_size}/{'CP group' if 'cp' in p else 'rank'} at {s.resolution}px, "
            f"activation_checkpointing={int(s.activation_checkpointing)}, cpu_offload={int(s.cpu_offload)}, "
            f"reshard_after_forward={int(not p['reshard_free'])}"
            + (f" (auto{': ' + ', '.join(p['reshard_free']) if p['reshard_free'] else ''})"
               if s.reshard_after_forward is None else ""))
    if s.lora:
        head += f", LoRA rank {s.lora_rank} (alpha {s.lora_alpha or s.lora_rank:g}) on {', '.join(p['lora'])}"
    lines = [head] + _reference_lines(p) + _cp_lines(p)
    lines.append(f"{'component':<16}{'params':>10}{'on rank':>10}"
                 f"{'param GiB':>11}{'grad GiB':>10}{'optim GiB':>11}  role")
    for n, r in p["rows"].items():
        count, local = (_count(r.get(k, 0), r.get("adapters", False)) for k in ("count", "local_count"))
        lines.append(f"{n:<16}{count:>10}{local:>10}{r['params'] / GIB:>11.2f}{r['grads'] / GIB:>10.2f}"
                     f"{r['optim'] / GIB:>11.2f}  {r['note']}")
    where = "host (CPU offload)" if s.cpu_offload else "GPU"
    acts = f"activations (measured on meta): {p['activations'] / GIB:.2f} GiB"
    if "cp" in p:
        cp = p["cp"]
        acts = (f"activations (measured on meta over the full sequence; per rank its 1/{s.context_parallel}, "
                f"{cp['whole'] / 2**20:.1f} MiB without a sequence dimension held whole, {cp['buffers'] / 2**20:.1f} "
                f"MiB of all-to-all and output buffers): {p['activations'] / GIB:.2f} GiB "
                f"({cp['one_forward'] / GIB:.2f} GiB for one forward without CP)")
    if s.lora:
        lines += _lora_lines(p)
        acts += (" (LoRA: as autograd keeps them on a frozen base: adapted Linears' inputs and rank-r "
                 "intermediates, what the input grads need elsewhere; no frozen weight's grad inputs)")
    lines += [f"model states on: {where}" + (f", {p['host_total'] / GIB:.2f} GiB per rank" if s.cpu_offload else ""),
              f"all-gathered units in flight{' at the activations peak' if p.get('at_peak') else ''}: "
              f"{p['gathered'] / GIB:.2f} GiB "
              f"(largest unit {p['largest_unit'] / GIB:.2f} GiB)",
              acts,
              ATTENTION_NOTE,
              f"runtime reserve: {p['runtime'] / GIB:.2f} GiB",
              *([f"host peak while loading the NF4 base (meta path, per rank): {p['load_peak'] / GIB:.2f} GiB "
                 "(its NF4 shards + one whole tensor read, cast and quantised)"] if "load_peak" in p else []),
              f"TOTAL per GPU: {p['gpu_total'] / GIB:.2f} GiB"]
    return "\n".join(lines + _fill_lines(p))


def _reference_lines(p: dict) -> list[str]:
    """format_plan's words on FLUX.2's sequence (none for other kinds)."""
    if "references" not in p:
        return []
    s, refs = p["settings"], p["references"]
    area = s.reference_area or FAMILIES["Flux2Pipeline"].REFERENCE_AREA
    side = math.isqrt(area)
    return [f"sequence per sample: {(s.resolution // 16) ** 2} target tokens ({s.resolution}^2 / 16^2) + "
            f"{len(refs)} reference(s) x {refs[0][0] * refs[0][1] if refs else 0} tokens (each downsized to "
            f"{f'{side}^2' if side * side == area else area} px if larger) + 512 text tokens"]


def _fill_lines(p: dict) -> list[str]:
    """format_plan's words on the text-cache fill (none without offline components)."""
    f = p.get("fill")
    if not f:
        return []
    s = p["settings"]
    where = f"sharded over {s.world_size} ranks" if f["sharded"] else "whole on the one rank"
    return [f"text-cache fill, before training ({', '.join(f'{n} {c / 1e9:.2f}B' for n, c in f['components'].items())}"
            f" in {f['dtype']}, {where}, freed before the trained model is built): params {f['params'] / GIB:.2f} + "
            f"units in flight {f['gathered'] / GIB:.2f} + activations {f['activations'] / GIB:.2f} (batch "
            f"{f['batch']} x {f['text']} tokens, no grad) + runtime {f['runtime'] / GIB:.2f} = "
            f"{f['total'] / GIB:.2f} GiB",
            f"PEAK per GPU (training, text-cache fill): {peak_bytes(p) / GIB:.2f} GiB"]


def _cp_lines(p: dict) -> list[str]:
    """format_plan's words on context parallelism (none without it)."""
    if "cp" not in p:
        return []
    s, cp = p["settings"], p["cp"]
    c, tokens = cp["degree"], cp["text"] + cp["image"]
    groups = s.world_size // c
    return [f"context parallel {c}: each rank holds 1/{c} of the sequence ({cp['text']} text + {cp['image']} image "
            f"tokens (target + context) = {tokens}, {tokens // c} per rank); Ulysses attention over all {tokens} "
            f"tokens for {cp['heads'] // c} of {cp['heads']} heads per rank",
            f"global batch {s.batch_size} x {s.world_size} / {c} = {s.batch_size * groups} per step (x GRAD_ACCUM): "
            f"{groups} data-parallel group(s) of {c} ranks, each group's ranks on the same samples; "
            f"model states sharded over all {s.world_size} ranks, as without CP"]


def _count(n: int, adapters: bool = False) -> str:
    """A parameter count as the table prints it: billions, or millions for adapters ("-": none)."""
    if not n:
        return "-"
    return f"{n / 1e6:.2f}M" if adapters else f"{n / 1e9:.2f}B"


def _lora_lines(p: dict) -> list[str]:
    """What trains under LoRA: per LoRA component its adapter count and share (peft's trainable%:
    of all its parameters, adapters included), and the targets; then every trained parameter."""
    lines = []
    for name, (adapters, total) in p["lora"].items():
        lines.append(f"trainable in {name}: {adapters:,} LoRA params = {100 * adapters / total:.2f}% of its "
                     f"{total / 1e9:.2f}B (base frozen: no grads, no optimizer state)")
    # per-block names (FLUX.2's single blocks' to_out) as one pattern each
    targets = dict.fromkeys(re.sub(r"\.\d+\.", ".*.", t) for t in p["lora_targets"])
    lines.append(f"LoRA targets: {', '.join(targets)}")
    trained = sum(r["count"] for r in p["rows"].values() if r["grads"])
    if trained != sum(a for a, _ in p["lora"].values()):  # a full model trains beside (DMD's fake score)
        lines.append(f"trainable in all: {trained:,} params (with the full "
                     f"{', '.join(n for n, r in p['rows'].items() if r['grads'] and not r.get('adapters'))})")
    return lines


def _setting_name(s: Settings, base_precision: str) -> str:
    parts = (["bf16 states"] if s.precision != base_precision else []) + \
            (["AC"] if s.activation_checkpointing else []) + (["CPU offload"] if s.cpu_offload else []) + \
            (["NF4 text encoder"] if s.text_encoder_dtype == "nf4" else [])
    return " + ".join(parts) or "as is"


def fit_table(name: str, world_sizes=(2, 4, 8), gpu_memory_gbs=(24, 40, 80), batch_size: int = 1,
              resolution: int | None = None, precision: str = "bf16-mixed", **lora) -> str:
    """A markdown table: per world size, the per-rank params (all components) / grads / optimizer /
    activations (without and with activation checkpointing) in GiB as planned, and per GPU memory
    the cheapest settings that fit (cheapest_fit's order) with their GPU total, or "does not fit".
    Plans are memoised, and the sharded counts kept per world size (plan's shard_cache). `lora`:
    Settings' lora_rank / lora_alpha / lora_targets / fake_lora, and context_parallel (every world
    size planned with that CP)."""
    planner = memo_planner()
    gbs = list(gpu_memory_gbs)
    lines = []
    for ws in world_sizes:
        base = Settings(world_size=ws, precision=precision, batch_size=batch_size, resolution=resolution,
                        reshard_after_forward=None, **lora)  # the scripts' auto, decided per GPU memory
        p = planner(name, base)
        if not lines:
            r = p["settings"]
            lines += [f"{name} ({p['kind']}), {precision}, batch {r.batch_size}/GPU at {r.resolution} px"
                      + (_lora_caption(p) if r.lora else "") + _cp_caption(p) + ". Per-rank GiB "
                      "as planned without checkpointing or offload (params: every component's local share); "
                      "per GPU memory (budget N GiB): the cheapest settings that fit, and their per-GPU total. "
                      f"Activations: {ATTENTION_NOTE}.", "",
                      "| GPUs | params | grads | optimizer | activations | activations (AC) | total as is | "
                      + " | ".join(f"{g:g} GB" for g in gbs) + " |",
                      "|" + "---:|" * 7 + "---|" * len(gbs)]
        ac = planner(name, Settings(**{**base.__dict__, "activation_checkpointing": True}))
        rows = p["rows"].values()
        cols = [sum(r[k] for r in rows) for k in ("params", "grads", "optim")]
        cols += [p["activations"], ac["activations"], p["gpu_total"]]
        cells = []
        for g in gbs:
            fit = cheapest_fit(name, base, int(g * GIB), planner)
            cells.append("does not fit" if fit is None else
                         f"{_setting_name(fit[0], precision)} ({fit[1]['gpu_total'] / GIB:.1f})")
        lines.append(f"| {ws} | " + " | ".join(f"{c / GIB:.2f}" for c in cols) + " | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def memo_planner():
    """plan, memoised per Settings, the sharded counts kept across settings that share them (plan's
    shard_cache): what fit_table and cp_table plan with."""
    shard_cache, memo = {}, {}

    def planner(n: str, t: Settings) -> dict:
        key = (n, *sorted(t.__dict__.items()))
        if key not in memo:
            memo[key] = plan(n, t, shard_cache)
        return memo[key]
    return planner


def _cp_caption(p: dict) -> str:
    """fit_table's words on context parallelism (none without it)."""
    if "cp" not in p:
        return ""
    c = p["cp"]["degree"]
    return (f", context parallel {c} (each rank holds 1/{c} of the sequence: activations are one forward's / {c}, "
            f"plus what has no sequence dimension and the all-to-all buffers; global batch = batch x GPUs / {c})")


def cp_frontier(name: str, base: Settings, gpu_bytes: int, context_parallels,
                planner=None) -> list[tuple[Settings, dict]]:
    """The context-parallel sizes worth knowing for these settings and this GPU memory: the smallest CP
    with which anything fits (with cheapest_fit's settings for it), then each larger CP that needs
    less (earlier in FIT_ORDER: fewer of AC, bf16 states, CPU offload), up to one that fits as is.
    CP sizes the world size, heads or tokens do not allow (check_context_parallel) are skipped.
    [] if nothing fits at any of them."""
    folder, out, best = model_folder(name), [], len(FIT_ORDER)
    for c in sorted(set(context_parallels)):
        trial = dataclasses.replace(base, context_parallel=c)
        try:
            check_context_parallel(folder, trial)
        except SystemExit:
            continue
        fit = cheapest_fit(name, trial, gpu_bytes, planner)
        if fit is None:
            continue
        t = fit[0]
        rank = FIT_ORDER.index((t.activation_checkpointing, t.cpu_offload, t.precision != base.precision))
        if rank < best:
            out.append(fit)
            best = rank
        if rank == 0:
            break
    return out


def cp_table(name: str, resolutions=(1024, 2048), gpu_memory_gbs=(24, 80), world_sizes=(8,),
             context_parallels=(1, 2, 4, 8), batch_size: int = 1, precision: str = "bf16-mixed",
             planner=None, **lora) -> str:
    """A markdown table for FLUX Kontext: which context parallelism fits. Rows: resolution x GPU
    memory (a budget of N GiB); columns: the activations per rank of one forward (and with
    activation checkpointing) at CP 1, then per world size the smallest CP that fits with the cheapest
    settings it needs (cheapest_fit) and its per-GPU total in GiB, then any larger CP that needs less
    (cp_frontier). `planner`: plan, or a stand-in (default: memo_planner()). `lora`: as fit_table's."""
    folder = model_folder(name)
    script, kind = layout(folder, with_script(name, Settings(1, **lora)).script)
    if kind != "flux_kontext":
        raise SystemExit(_no_cp("--cp_table", name, script, kind))
    for c in context_parallels:  # the other checks are per cell: a CP size they rule out is skipped there
        if c < 1:
            raise SystemExit(f"plan: --context_parallels: {c}: must be >= 1 (1 = off)")
    planner = planner or memo_planner()
    cps, gbs, wss = sorted(set(context_parallels)), list(gpu_memory_gbs), list(world_sizes)
    lines = []
    for res in resolutions:
        base = Settings(world_size=wss[0], precision=precision, batch_size=batch_size, resolution=res, **lora)
        p = planner(name, base)
        ac = planner(name, dataclasses.replace(base, activation_checkpointing=True))
        if not lines:
            lines += [f"{name} ({p['kind']}), {precision}, batch {batch_size} per CP group"
                      + (_lora_caption(p) if base.lora else "") + ". Per GPU count and GPU memory (budget N GiB): "
                      f"the smallest context parallelism (CP c: each rank holds 1/c of the sequence; global batch "
                      f"= batch x GPUs / c) that fits, with the cheapest settings it needs and its per-GPU total "
                      f"in GiB; then any larger CP that needs less. CP tried: {', '.join(map(str, cps))} (those the "
                      f"GPU count, the attention heads and the token counts divide). Activations per rank: one "
                      f"forward's (measured on meta) / c, plus what has no sequence dimension and the all-to-all "
                      f"buffers; {ATTENTION_NOTE}.", "",
                      "| resolution | GPU memory | activations at CP 1 (AC) | "
                      + " | ".join(f"{w} GPUs" for w in wss) + " |",
                      "|---:|---:|---:|" + "---|" * len(wss)]
        for g in gbs:
            cells = []
            for ws in wss:
                front = cp_frontier(name, dataclasses.replace(base, world_size=ws), int(g * GIB), cps, planner)
                cells.append("; ".join(f"CP {t.context_parallel}: {_setting_name(t, precision)} "
                                       f"({r['gpu_total'] / GIB:.1f})" for t, r in front)
                             or f"does not fit at CP <= {max(cps)}")
            lines.append(f"| {p['settings'].resolution} px | {g:g} GB | {p['activations'] / GIB:.2f} "
                         f"({ac['activations'] / GIB:.2f}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def check_lora_targets(name: str, lora: lora_lib.Lora, script: str = "") -> list[str]:
    """The LoRA targets of the model a configuration trains (its first trainable component), each
    checked to name a layer of it (parallel.lora.lora_targets; SystemExit naming a bad one)."""
    folder = model_folder(name)
    _, kind = layout(folder, with_script(name, Settings(1, script=script)).script)
    spec = next(c for c in pipeline_components(kind, pipeline_of(folder, kind)) if HOLDING[c.role].trained)
    try:
        return lora_lib.lora_targets(meta_model(os.path.join(folder, spec.subfolder)), lora)
    except ConfigError as e:
        raise SystemExit(f"plan: --lora_target_modules: {e}") from None


def _lora_caption(p: dict) -> str:
    """fit_table's words on LoRA: rank, trainable adapter params per LoRA model, and how it is counted."""
    s = p["settings"]
    each = ", ".join(f"{n} {a / 1e6:.2f}M ({100 * a / total:.2f}%)" for n, (a, total) in p["lora"].items())
    full = [n for n, r in p["rows"].items() if r["grads"] and not r.get("adapters")]
    return (f", LoRA rank {s.lora_rank} (alpha {s.lora_alpha or s.lora_rank:g}), trainable adapter params: {each}"
            + (f" ({', '.join(full)} fully trained)" if full else "")
            + f"; frozen base in {dtype_name(get_precision(s.precision).compute_dtype)} without grads or optimizer "
            f"state, adapters fp32 with fp32 grads and AdamW states; activations measured on the LoRA model, as "
            f"autograd keeps them on a frozen base" + ("; units in flight at the activations peak" if p.get("at_peak")
                                                        else ""))


# ----------------------------------------------------------------------------------------------
# low-bit storage (parallel/lowbit.py): where BASE_DTYPE and OPTIMIZER make a run fit


def _fit_without_offload(name: str, s: Settings, gpu_bytes: int, planner) -> str:
    """The cheapest no-offload settings that fit (as is, AC, bf16 states, AC + bf16 states; bf16
    states only for full fine-tunes), as "settings (GiB)", else "needs CPU offload"."""
    for ac, bf16 in ((False, False), (True, False), (False, True), (True, True)):
        if bf16 and s.lora_rank:
            continue
        t = Settings(**{**s.__dict__, "activation_checkpointing": ac, "precision": "bf16" if bf16 else s.precision})
        p = planner(name, t)
        if p["gpu_total"] <= gpu_bytes:
            return f"{_setting_name(t, s.precision)} ({p['gpu_total'] / GIB:.1f})"
    return "needs CPU offload"


def _ddp_total(p: dict) -> int:
    """A DDP replica's GPU bytes from a world-size-1 plan: nothing is all-gathered (an NF4 base still
    dequantises one Linear weight at a time: kept), grads all-reduced in place (buckets ~ grads)."""
    return p["gpu_total"] - p["gathered"] + p["rows"].get("transformer.lora", {}).get("grads", 0)


def _largest_batch(name: str, s: Settings, gpu_bytes: int, planner, total=lambda p: p["gpu_total"],
                   limit: int = 64) -> int:
    """The largest batch per GPU (1..limit, doubling then bisecting) whose plan fits; 0: none."""
    def fits(b):
        return total(planner(name, Settings(**{**s.__dict__, "batch_size": b}))) <= gpu_bytes
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def lowbit_tables(name: str, rank: int = 16, gpu_gb: float = 24) -> str:
    """Markdown: (1) full fine-tune on 4 GPUs per OPTIMIZER, LoRA on 1 and 2 GPUs per BASE_DTYPE x
    OPTIMIZER, at 512 and 1024 px: the cheapest no-offload settings that fit `gpu_gb` and their
    GiB; (2) the seed plan's comparison on 4 x `gpu_gb`: bf16-base and NF4-base LoRA under DDP (a
    replica per GPU) and FSDP2, batch-1 GiB and the largest batch that fits, with and without AC."""
    planner, budget = memo_planner(), int(gpu_gb * GIB)
    head = (f"{name}: the cheapest settings without CPU offload that fit {gpu_gb:g} GB per GPU (per-GPU GiB "
            f"planned), batch 1/GPU, bf16-mixed; LoRA rank {rank} on the model's default targets. "
            f"Activations: {ATTENTION_NOTE}.")
    lines = [head, "", "| run | GPUs | BASE_DTYPE | OPTIMIZER | 512 px | 1024 px |", "|---|---:|---|---|---|---|"]
    cases = [("full fine-tune", 4, "", o) for o in lowbit.OPTIMIZERS]
    cases += [("LoRA", ws, b, o) for ws in (1, 2) for b in ("", "nf4") for o in ("adamw", "adamw8bit")]
    for run, ws, base, opt in cases:
        cells = []
        for res in (512, 1024):
            s = Settings(world_size=ws, resolution=res, lora_rank=rank if run == "LoRA" else 0, base_dtype=base,
                         optimizer=opt)
            cells.append(_fit_without_offload(name, s, budget, planner))
        lines.append(f"| {run} | {ws} | {base or 'bf16'} | {opt} | " + " | ".join(cells) + " |")
    lines += ["", f"LoRA rank {rank}, 512 px, 4 x {gpu_gb:g} GB: DDP (a replica per GPU: a world-size-1 plan without "
              "all-gathered units) vs FSDP2; per-GPU GiB at batch 1, and the largest batch per GPU that fits "
              "(without / with activation checkpointing).", "",
              "| layout | per-GPU GiB (batch 1) | base GiB | largest batch | largest batch (AC) |",
              "|---|---:|---:|---:|---:|"]
    for label, ddp, base in (("BF16 DDP", True, ""), ("NF4-base DDP", True, "nf4"),
                             ("BF16 FSDP2", False, ""), ("NF4-base FSDP2", False, "nf4")):
        s = Settings(world_size=1 if ddp else 4, resolution=512, lora_rank=rank, base_dtype=base)
        total = _ddp_total if ddp else (lambda p: p["gpu_total"])
        p = planner(name, s)
        batches = [_largest_batch(name, Settings(**{**s.__dict__, "activation_checkpointing": ac}), budget, planner,
                                  total) for ac in (False, True)]
        lines.append(f"| {label} | {total(p) / GIB:.2f} | {p['rows']['transformer']['params'] / GIB:.2f} | "
                     + " | ".join(str(b) for b in batches) + " |")
    return "\n".join(lines)


# docs/planner.md's FLUX.2 rows: (run, built-in name, settings, GPU memory in GB, world sizes tried)
FLUX2_ROWS = [(f"{model} LoRA r16, {base or 'bf16'} base", name, dict(lora_rank=16, base_dtype=base), gb, (1, 2, 4, 8))
              for model, name, gbs in (("[dev]", "flux2-dev", (24, 48, 80)), ("klein 4B", "flux2-klein-4b", (24,)),
                                       ("klein 9B", "flux2-klein-9b", (24,)))
              for base in ("nf4", "") for gb in gbs]
FLUX2_ROWS += [("[dev] full fine-tune", "flux2-dev", {}, 80, (8,)),
               ("klein 4B full fine-tune", "flux2-klein-4b", {}, 80, (1, 2, 4, 8)),
               ("klein 9B full fine-tune", "flux2-klein-9b", {}, 80, (1, 2, 4, 8))]


def flux2_table(planner=None) -> str:
    """Markdown: for each FLUX.2 run of FLUX2_ROWS at 1024 px with FLUX2_REFERENCES references, bf16-mixed,
    batch 1, auto resharding, the fewest GPUs that fit (fewest_gpus) with the cheapest settings, and the fewest
    without CPU offload or an NF4 text encoder; each with its training and text-cache fill peaks in GiB."""
    planner = planner or memo_planner()
    lines = ["| run | GPU | fewest GPUs: settings (training / fill GiB) | without CPU offload or an NF4 text encoder |",
             "|---|---|---|---|"]
    for label, name, over, gb, worlds in FLUX2_ROWS:
        s = Settings(world_size=worlds[0], resolution=1024, reshard_after_forward=None, **over)
        cells = []
        for fit in ({}, dict(cpu_offload=False, nf4_text_encoder=False)):
            found = fewest_gpus(name, s, int(gb * GIB), worlds, planner, **fit)
            cells.append(f"none of {', '.join(map(str, worlds))}" if found is None else
                         f"{found[0].world_size}: {_setting_name(found[0], s.precision)} "
                         f"({found[1]['gpu_total'] / GIB:.2f} / {found[1]['fill']['total'] / GIB:.2f})")
        lines.append(f"| {label} | {gb:g} GB | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python tools/memory_plan.py", description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="a built-in configuration or a diffusers folder (required but for --flux2_table)")
    ap.add_argument("--world_size", type=int, default=None, help="required, except with --fit_table")
    ap.add_argument("--gpu_memory_gb", type=float, default=0.0)
    ap.add_argument("--batch_size", type=int, default=1)
    ap.add_argument("--resolution", type=int, default=None,
                    help="image side in px (default: the model's native one: 512 SD-1.5 and FLUX, 1024 SDXL)")
    ap.add_argument("--precision", default="bf16-mixed", choices=["fp32", "bf16-mixed", "bf16"])
    ap.add_argument("--cpu_offload", type=int, default=0)
    ap.add_argument("--activation_checkpointing", type=int, default=0)
    ap.add_argument("--reshard_after_forward", default="auto",
                    help="auto (the scripts' default: 0 for a model alone in its shard group whose compute copy "
                         "fits 10%% of --gpu_memory_gb, else 1) | 1 | 0")
    ap.add_argument("--dp_replicate", type=int, default=1)
    ap.add_argument("--block_classes", default="",
                    help="comma-separated FSDP unit classes, as the scripts' BLOCK_CLASSES (default: the recipe's)")
    ap.add_argument("--fit_table", action="store_true",
                    help="print a markdown table of the cheapest fitting settings, --world_sizes x --gpu_memory_gbs")
    ap.add_argument("--world_sizes", default=None, help="with --fit_table (default 2,4,8) or --cp_table (default 8)")
    ap.add_argument("--gpu_memory_gbs", default=None,
                    help="with --fit_table (default 24,40,80) or --cp_table (default 24,80)")
    ap.add_argument("--context_parallel", type=int, default=1,
                    help="FLUX Kontext: ranks that split each sample's sequence, as train_flux_kontext.py's "
                         "CONTEXT_PARALLEL (1 = off); activations per rank: about one forward's / C")
    ap.add_argument("--cp_table", action="store_true",
                    help="FLUX Kontext: markdown table of the smallest context parallelism that fits, "
                         "--resolutions x --gpu_memory_gbs, per --world_sizes")
    ap.add_argument("--context_parallels", default="1,2,4,8", help="with --cp_table: the CP sizes to try")
    ap.add_argument("--resolutions", default="1024,2048", help="with --cp_table")
    ap.add_argument("--lora_rank", type=int, default=0,
                    help="plan LoRA fine-tuning with adapters of this rank, as the scripts' LORA_RANK "
                         "(0: full fine-tuning)")
    ap.add_argument("--lora_alpha", type=float, default=0.0, help="the scripts' LORA_ALPHA (0: the rank)")
    ap.add_argument("--lora_target_modules", default="",
                    help="comma-separated module-name suffixes to adapt, as the scripts' LORA_TARGET_MODULES "
                         "(default: the model's in parallel/model_facts.py)")
    ap.add_argument("--fake_lora", type=int, default=0,
                    help="DMD with --lora_rank: the fake score trains LoRA adapters too (train_dmd.py's FAKE_LORA)")
    ap.add_argument("--fake_score_fp32", type=int, default=0,
                    help="DMD: the fake score gathers and computes in fp32, as published "
                         "(train_dmd.py's FAKE_SCORE_FP32, default off)")
    ap.add_argument("--base_dtype", default="", choices=list(lowbit.BASE_DTYPES),
                    help="LoRA: the frozen base's storage, as the scripts' BASE_DTYPE (nf4: 4-bit, parallel/lowbit.py)")
    ap.add_argument("--optimizer", default="adamw", choices=list(lowbit.OPTIMIZERS),
                    help="the scripts' OPTIMIZER: adamw (fp32/bf16 states) | adamw8bit | adamw4bit (torchao)")
    ap.add_argument("--fp8", default="", choices=["", "tensorwise", "rowwise"],
                    help="the scripts' FP8: the blocks' Linears in float8 (tensorwise: a full model's weights "
                         "gathered in float8, half the bytes of bf16)")
    ap.add_argument("--ema", type=int, default=0,
                    help="count an EMA of the trained model, as the scripts' EMA_DECAY > 0 (LoRA: of its adapters)")
    ap.add_argument("--script", default="", choices=["", *pipelines.SCRIPTS],
                    help="the training script to plan for (default: the folder's layout's, or the built-in name's); "
                         "train_dmd.py on a FLUX Kontext folder: DMD2 with three FLUX transformers")
    ap.add_argument("--lowbit_table", action="store_true",
                    help="FLUX Kontext: markdown tables of BASE_DTYPE x OPTIMIZER on 1/2/4 x 24 GB at 512 and "
                         "1024 px, and BF16/NF4-base LoRA under DDP and FSDP2 with their largest batch")
    ap.add_argument("--references", type=int, default=None,
                    help=f"FLUX.2: reference images per sample (default {FLUX2_REFERENCES}), each planned at "
                         "--reference_area")
    ap.add_argument("--reference_area", type=int, default=0,
                    help="FLUX.2: the scripts' REFERENCE_AREA, pixels of each reference (0: the pipeline's 1024^2)")
    ap.add_argument("--text_encoder_dtype", default="", choices=["", "nf4"],
                    help="the text-cache fill's encoders: the compute dtype, or their Linears in NF4")
    ap.add_argument("--flux2_table", action="store_true",
                    help="FLUX.2: markdown table of the fewest GPUs that fit each run of docs/planner.md (FLUX2_ROWS)")
    a = ap.parse_args(argv)
    # what importing transformers/diffusers prints with torchao installed (its CUDA-only kernel libraries,
    # torch's pytree notice), as the scripts silence it: before the first model is built
    quiet_known_warnings()
    if a.flux2_table:
        print(flux2_table())
        return 0
    if not a.model:
        ap.error("--model is required")
    if a.lowbit_table:
        print(lowbit_tables(a.model))
        return 0
    if a.base_dtype == "nf4" and not a.lora_rank:
        ap.error("--base_dtype=nf4 needs --lora_rank > 0 (only a frozen LoRA base is quantised)")
    lora = dict(lora_rank=a.lora_rank, lora_alpha=a.lora_alpha, fake_lora=bool(a.fake_lora),
                fake_score_fp32=bool(a.fake_score_fp32), base_dtype=a.base_dtype, optimizer=a.optimizer,
                ema=bool(a.ema), script=a.script, fp8=a.fp8, references=a.references,
                reference_area=a.reference_area, text_encoder_dtype=a.text_encoder_dtype,
                lora_targets=tuple(t.strip() for t in a.lora_target_modules.split(",") if t.strip()))
    try:
        lora_lib.check_lora(Settings(1, **lora).lora)
    except ConfigError as e:
        ap.error(str(e))
    if not a.lora_rank and (a.fake_lora or lora["lora_targets"] or a.lora_alpha):
        ap.error("--lora_alpha, --lora_target_modules and --fake_lora need --lora_rank > 0")
    if a.fit_table and a.cp_table:
        ap.error("--fit_table and --cp_table: one table at a time")
    if a.cp_table and a.context_parallel != 1:
        ap.error("--cp_table tries every --context_parallels size; --context_parallel is for a plan or --fit_table")
    table = a.fit_table or a.cp_table
    world_sizes = [int(w) for w in (a.world_sizes or ("8" if a.cp_table else "2,4,8")).split(",")]
    gbs = [float(g) for g in (a.gpu_memory_gbs or ("24,80" if a.cp_table else "24,40,80")).split(",")]
    if a.world_size is None and not table:
        ap.error("--world_size is required (or --fit_table / --cp_table)")
    # context parallelism's checks, one line each, before any work (no model is built for them)
    for ws in ([] if a.cp_table else world_sizes if a.fit_table else [a.world_size]):
        check_context_parallel(model_folder(a.model), with_script(a.model, Settings(
            ws, dp_replicate=a.dp_replicate, resolution=a.resolution, context_parallel=a.context_parallel,
            script=a.script)))
    from diffusers.utils import logging as dlogging
    dlogging.set_verbosity_error()
    if a.lora_rank:  # unknown targets fail here, on one meta model, as in the scripts, before any planning
        check_lora_targets(a.model, Settings(1, **lora).lora, a.script)
    if a.cp_table:
        print(cp_table(a.model, [int(r) for r in a.resolutions.split(",")], gbs, world_sizes,
                       [int(c) for c in a.context_parallels.split(",")], a.batch_size, a.precision, **lora))
        return 0
    if a.fit_table:
        cp = {"context_parallel": a.context_parallel} if a.context_parallel != 1 else {}
        print(fit_table(a.model, world_sizes, gbs, a.batch_size, a.resolution, a.precision, **lora, **cp))
        return 0
    s = Settings(a.world_size, a.precision, bool(a.cpu_offload), bool(a.activation_checkpointing),
                 fsdp_utils.parse_reshard(a.reshard_after_forward), a.dp_replicate, a.batch_size, a.resolution,
                 tuple(c for c in a.block_classes.split(",") if c), **lora, context_parallel=a.context_parallel,
                 gpu_memory_gb=a.gpu_memory_gb)
    result = plan(a.model, s)
    print(format_plan(a.model, result))
    if a.gpu_memory_gb > 0:
        budget = int(a.gpu_memory_gb * GIB)
        if peak_bytes(result) <= budget:
            print(f"fits in {a.gpu_memory_gb:g} GB per GPU" + (" (training and the text-cache fill)"
                                                               if "fill" in result else ""))
            return 0
        fit = cheapest_fit(a.model, s, budget)
        if fit is None:
            print(f"does NOT fit in {a.gpu_memory_gb:g} GB per GPU with any of activation checkpointing, "
                  f"bf16 states, CPU offload" + (", an NF4 text encoder for the text-cache fill" if "fill" in result
                                                 else "") + ": add GPUs or lower batch/resolution")
            return 1
        t, r = fit
        print(f"does NOT fit in {a.gpu_memory_gb:g} GB; cheapest settings that fit: "
              f"--precision={t.precision} --activation_checkpointing={int(t.activation_checkpointing)} "
              f"--cpu_offload={int(t.cpu_offload)}"
              + (f" --context_parallel={t.context_parallel}" if t.context_parallel > 1 else "")
              + (f" --text_encoder_dtype={t.text_encoder_dtype} (the scripts take no NF4 text encoder yet)"
                 if t.text_encoder_dtype else "")
              + f" ({peak_bytes(r) / GIB:.2f} GiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
