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
from families import FAMILIES, SPECS, pipelines, spec_of  # the rooms, the specs; what each pipeline holds


GIB = 2**30
RUNTIME_BYTES = 1 * GIB

DMD_SCRIPT = "train_dmd.py"  # the script that distils any family's pipeline (DMD2); the others fine-tune
# train_dmd.py's roles of a pipeline's one trained model (DMD2 on a transformer family): generator and fake
# score trained, the teacher frozen and sharded; the pipeline's other parts as its fine-tune holds them
DMD_ROLES = (("generator", "trainable"), ("fake_score", "trainable"), ("teacher", "frozen-sharded"))

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
    lora_targets: tuple = ()   # LORA_TARGET_MODULES: () = the model's (families.MODELS)
    fake_lora: bool = False    # DMD's FAKE_LORA: the fake score (every trainable part after the first) too
    context_parallel: int = 1  # train_flux_kontext.py's CONTEXT_PARALLEL: ranks splitting each sample's sequence
    fake_score_fp32: bool = False  # train_dmd.py's FAKE_SCORE_FP32: the fake score gathers and computes in fp32
    base_dtype: str = ""       # the scripts' BASE_DTYPE: "" = compute dtype, nf4 = 4-bit LoRA base (parallel/lowbit.py)
    optimizer: str = "adamw"   # the scripts' OPTIMIZER: adamw | adamw8bit | adamw4bit
    ema: bool = False          # the scripts' EMA_DECAY > 0: a copy of the trained model (LoRA: of its adapters)
    fp8: str = ""              # the scripts' FP8: "" | tensorwise (trained weights gathered in float8) | rowwise
    script: str = ""           # the script planned: "" = the pipeline's (default_script), or the name's (BUILTINS)
    gpu_memory_gb: float = 0.0  # the GPU planned for, where auto resharding asks (0: unknown)
    references: int | None = None  # reference images per sample (None: the family's, FamilySpec.references)
    reference_area: int = 0    # the scripts' REFERENCE_AREA, pixels of each reference (0: the pipeline's)
    text_encoder_dtype: str = ""  # the text-cache fill's encoders: "" = compute dtype, nf4 = their Linears in NF4
    frames: int | None = None  # video frames per sample (None: the family's FamilySpec.plan_frames; 0: images)

    @property
    def lora(self) -> lora_lib.Lora:
        return lora_lib.Lora(self.lora_rank, self.lora_alpha, tuple(self.lora_targets))








# ----------------------------------------------------------------------------------------------
# building the real-size models on meta, as the scripts hold them

def _builtins() -> dict:
    """{--model= name: (its configs' folder, the script it plans)}: each family spec's built-in models
    (FamilySpec.builtin_folder), and the DMD2 plan of those whose pipeline train_dmd.py distils besides its own
    script."""
    out = {}
    for spec in SPECS:
        for name, b in spec.builtins.items():
            out[name] = (spec.builtin_folder(name), "")
            pipeline = next(p for p in spec.pipelines if p.name == b.pipeline)
            if DMD_SCRIPT in pipeline.scripts and default_script(pipeline) != DMD_SCRIPT:
                out[b.dmd or f"{name}-dmd"] = (spec.builtin_folder(name), DMD_SCRIPT)
    return out


def model_folder(name: str) -> str:
    if name in BUILTINS and os.path.isdir(BUILTINS[name][0]):
        return BUILTINS[name][0]
    if os.path.isdir(name):
        return name
    raise SystemExit(f"plan: --model={name}: not a built-in configuration ({', '.join(sorted(BUILTINS))}) "
                     f"nor a folder")


def _config(folder: str, subfolder: str) -> dict:
    path = os.path.join(folder, subfolder, "config.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def default_script(pipeline) -> str:
    """The script a pipeline's folder is planned for (a PipelineSpec): its fine-tune, else train_dmd.py."""
    return next((s for s in pipeline.scripts if s != DMD_SCRIPT), DMD_SCRIPT)


BUILTINS = _builtins()


def pipeline_of(folder: str) -> str:
    """The pipeline a folder holds: model_index.json's `_class_name`; without one, of the pipelines whose trained
    model's class the folder's has, the one of which it holds the most weighted parts (SDXL's second text encoder
    tells it from SD-1.5; a transformer's config alone, the first listed)."""
    index = os.path.join(folder, "model_index.json")
    if os.path.exists(index):
        with open(index) as f:
            name = json.load(f).get("_class_name", "")
        if name in FAMILIES:
            return name
    best = None
    for spec in SPECS:
        for p in spec.pipelines:
            parts = [c for c in p.components if c.role != "files"]
            trained = next(c for c in parts if c.role == "trainable")
            if _config(folder, trained.subfolder).get("_class_name") != trained.class_name:
                continue
            held = sum(_holds(folder, c) for c in parts)
            if best is None or held > best[0]:
                best = (held, p.name)
    if best is None:
        raise SystemExit(f"plan: {folder}: no model_index.json naming a pipeline of families/ "
                         f"({', '.join(FAMILIES)}), nor the trained model of one")
    return best[1]


def _null_components(folder: str) -> set:
    """The parts model_index.json names [null, null]: the pipeline's optional components this model has not."""
    index = os.path.join(folder, "model_index.json")
    if not os.path.exists(index):
        return set()
    with open(index) as f:
        return {k for k, v in json.load(f).items() if isinstance(v, list) and not any(v)}


def _holds(folder: str, c) -> bool:
    """The folder has component `c` (its subfolder, of its class where both say one)."""
    if not os.path.isdir(os.path.join(folder, c.subfolder)):
        return False
    cfg = _config(folder, c.subfolder)
    cls = cfg.get("_class_name") or (cfg.get("architectures") or [None])[0]
    return c.class_name is None or cls is None or cls == c.class_name


def _pipeline_spec(pipeline: str):
    return next(p for p in spec_of(pipeline).pipelines if p.name == pipeline)


def _one_model(pipeline: str) -> bool:
    """The pipeline's parts train one model, or experts of one (Wan 2.2 A14B's transformer and transformer_2), each
    trainable part its own subfolder: train_dmd.py then holds each in DMD_ROLES. (SD's generator and fake score
    share the UNet's subfolder: their roles are the table's.)"""
    trained = [c.subfolder for c in pipelines.trained_components(pipeline)]
    return len(set(trained)) == len(trained)


def layout(folder: str, script: str = "") -> tuple[str, str]:
    """(training script, kind) for a pipeline folder: the script its pipeline is planned for (default_script)
    or `script`, one that trains it; the kind is the plan's label, its family spec's plan_names (DMD2 of a
    pipeline that trains one model: + "_dmd")."""
    pipeline = pipeline_of(folder)
    p, spec = _pipeline_spec(pipeline), spec_of(pipeline)
    if script and script not in p.scripts:
        raise SystemExit(f"plan: --script={script}: {pipeline} is trained by {', '.join(p.scripts)} only")
    script = script or default_script(p)
    kind = spec.plan_names.get(pipeline, spec.name)
    return script, kind + ("_dmd" if script == DMD_SCRIPT and _one_model(pipeline) else "")


def with_script(name: str, s: Settings) -> Settings:
    """`s` with the script a built-in name plans for (BUILTINS) when it names none."""
    script = BUILTINS.get(name, ("", ""))[1]
    return dataclasses.replace(s, script=script) if script and not s.script else s


def pipeline_components(pipeline: str, script: str = "") -> list:
    """The components with weights that `script` (default: the pipeline's, default_script) builds for
    `pipeline` (its table entry's, in its order; tokenizers and schedulers, role "files", hold no memory the
    planner counts). train_dmd.py on a pipeline that trains one model: that model in DMD_ROLES, then the
    pipeline's other components; its experts too, each after the first in the roles named with its suffix
    (transformer_2: generator_2, fake_score_2, teacher_2)."""
    parts = [c for c in pipelines.PIPELINES[pipeline] if c.role != "files"]
    if (script or default_script(_pipeline_spec(pipeline))) != DMD_SCRIPT or not _one_model(pipeline):
        return parts
    trained = [c for c in parts if c.role == "trainable"]
    roles = [dataclasses.replace(t, name=name + t.name[len(trained[0].name):], role=role)
             for t in trained for name, role in DMD_ROLES]
    return roles + [c for c in parts if c not in trained]


def vae_factor(folder: str) -> int:
    """Pixels per latent side: the room's vae_factor where it has one, else the AutoencoderKL rule."""
    room = FAMILIES[pipeline_of(folder)]
    if hasattr(room, "vae_factor"):
        return room.vae_factor(folder)
    with open(os.path.join(folder, "vae", "config.json")) as f:
        return pipelines.vae_scale_factor(json.load(f))


def text_length(folder: str) -> int:
    """The text tokens the trained model reads: its spec's text_len, capped at its text_tokenizer's
    model_max_length when the folder has that tokenizer (e.g. 32 for the tiny defaults)."""
    spec = spec_of(pipeline_of(folder))
    text = spec.text_len
    tok = os.path.join(folder, spec.text_tokenizer, "tokenizer_config.json")
    if spec.text_tokenizer and os.path.exists(tok):
        with open(tok) as f:
            text = int(min(text, json.load(f).get("model_max_length", text)))
    return text


def native_resolution(folder: str) -> int:
    """The side the script trains at by default: the trained model's sample_size x the VAE factor where its
    config has one (the UNets: train_dmd.py's RESOLUTION=0, 512 for SD-1.5, 1024 for SDXL); else its spec's
    plan_resolution or the pipeline's native side."""
    pipeline = pipeline_of(folder)
    trained = pipelines.trained_component(pipeline)
    size = _config(folder, trained.subfolder).get("sample_size")
    if isinstance(size, int):
        return size * vae_factor(folder)
    spec = spec_of(pipeline)
    return spec.plan_resolution or spec.resolution(pipeline)


def frames(folder: str, s: Settings) -> int:
    """The video frames per sample planned: s.frames, else the family's plan_frames (0: images)."""
    return spec_of(pipeline_of(folder)).plan_frames if s.frames is None else s.frames


def target_size(folder: str, s: Settings) -> tuple:
    """(the target's (h, w) in pixels, its latent shape) at s.resolution: its spec's plan_target (a video's
    (frames, h, w) latents), else a square of s.resolution and its (h, w) latents."""
    factor, spec = vae_factor(folder), spec_of(pipeline_of(folder))
    if spec.plan_target is not None:
        return spec.plan_target(s.resolution, factor, frames(folder, s))
    latent = (s.resolution // factor, s.resolution // factor)
    return tuple(x * factor for x in latent), latent


def plans_references(folder: str) -> bool:
    """The folder's pipeline edits (its room's `edits`) and its family plans references (FamilySpec.plan_references):
    a family's text-to-image pipeline (Z-Image's ZImagePipeline beside Omni) plans its target alone."""
    pipeline = pipeline_of(folder)
    return spec_of(pipeline).plan_references is not None and FAMILIES[pipeline].edits(pipeline)


def latent_shapes(folder: str, s: Settings) -> tuple:
    """The trained model's latents per sample at s.resolution: the target's (target_size: (h, w), or a video's
    (frames, h, w)), then each reference's (its spec's plan_references: s.references of them at s.reference_area
    where it plans them by area)."""
    factor, spec = vae_factor(folder), spec_of(pipeline_of(folder))
    target = target_size(folder, s)[1]
    if not plans_references(folder):
        return (target,)
    return (target, *spec.plan_references(s.resolution, factor, s.references, s.reference_area))


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
    its spec's fp32_components); a part model_index.json sets to null, or an expert the folder lacks, is skipped
    (Wan 2.1's transformer_2, Wan 2.2 I2V's image encoder). build=False:
    the specs and dtypes only (module None). With `lora`, the first trainable component (the script's model, and
    its experts: generator_2) and, with `fake_lora`, the other trainable ones get adapters (Part.lora, added when
    sharded) and their base is stored in the compute dtype, as the scripts store it. `script`: as layout's."""
    script, kind = layout(folder, script)
    # what the family's room does to its transformer's meta skeleton in every role before the cast, the
    # adapters and the recipe (families/dit.py's `prepare`; Qwen-Image: freezing outputs that feed nothing)
    pipeline = pipeline_of(folder)
    prepare = getattr(FAMILIES[pipeline], "prepare", None)
    trained_subs = list(dict.fromkeys(c.subfolder for c in pipelines.trained_components(pipeline)))
    fp32 = spec_of(pipeline).fp32_components.get(pipeline, ())
    parts, model = [], None  # model: the script's (the first trainable component), whose experts share its LoRA
    for spec in pipeline_components(pipeline, script):
        if spec.subfolder in _null_components(folder) or (
                spec.subfolder in trained_subs[1:] and not os.path.isdir(os.path.join(folder, spec.subfolder))):
            continue  # a part this model has not (Wan 2.1's transformer_2, Wan 2.2 I2V's image encoder)
        part = Part(spec, meta_model(os.path.join(folder, spec.subfolder)) if build else None, precision.compute_dtype)
        if build and prepare is not None and spec.subfolder in trained_subs:
            prepare(part.module)
        if part.holding.trained and model is None:
            model = spec.name
        if part.holding.trained and lora and (fake_lora or spec.name.startswith(model)):
            part.lora = lora  # the base keeps the compute dtype
        elif part.holding.trained:
            part.dtype = precision.param_dtype
        elif spec.name in fp32:
            part.dtype = torch.float32
        parts.append(part)
    if fake_lora and sum(1 for q in parts if q.lora) < 2:
        raise SystemExit(f"plan: --fake_lora: {script} trains no second model (only DMD's fake score takes it), "
                         f"or --lora_rank is 0")
    return script, kind, parts


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
