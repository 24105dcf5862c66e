"""The memory planner's settings and what it builds: which script and pipeline a folder is planned for,
the components it holds in which role and dtype, each built at real size on the meta device (the
package's docstring: tools/planner/__init__.py)."""
from __future__ import annotations

import dataclasses
import inspect
import json
import os
from dataclasses import dataclass

import torch
import torch.nn as nn

from data.text_cache import fill_text_cache  # the text-cache fill's batch
from parallel import lora as lora_lib
from families import FAMILIES, pipelines  # the rooms; what each pipeline holds, in which role

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tools/: its real_size_configs/

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
# REFERENCE_AREA / 16^2 tokens whatever the target's size (families/flux2/, pipeline_size); then 512 text tokens.
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


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
