"""What a family is to the rest of the code: its `FamilySpec` (one per package, families/<name>/spec.py:
its pipelines and the scripts that train each, its default sizes, its model's example inputs, its context
parallel check, its tiny test folders) and the interface its room answers, one `typing.Protocol` per role:

    EditingRoom          what train_flux_kontext.py asks every editing room
    FlowDistillationRoom what train_dmd.py's flow_setup asks every flow-matching room
    UnetDistillationRoom what train_dmd.py's unet_setup asks the UNet room

The first two share `TransformerRoom` (the build, the VAE, sizes, the text cache), which data/buckets.py
reads too. A room is a module: the members are its functions and constants (`self` stands for the module);
the scripts call the functions with the parameter names written here, and tests/test_families.py checks
every room against the Protocols its spec names and that these Protocols hold every name the scripts ask.

    python -m pytest tests/test_families.py -q
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Mapping, Protocol

import torch

from families.pipelines import Component
from parallel.model_facts import ModelFacts

SCRIPTS = ("train_dmd.py", "train_flux_kontext.py")  # the scripts a family's pipelines may name
# what a script reads with getattr and a default: a room that has it says so
OPTIONAL = {
    "NEGATIVE_PROMPT": "true CFG in train_flux_kontext.py's samples: its `sample` then takes `negative`",
    "SHARDED_TEXT_FILL": "SHARD_TEXT_ENCODER=1 accepted (components/trainer.check_text_sharding)",
    "prepare": "what a meta build of the trained model leaves unset (tools/memory_plan.py reads it)",
    "default_guidance": "(model_path) -> GUIDANCE 0's value (train_flux_kontext.py): the guidance embedding's "
                        "training value; else 1",
    "TEXT_TO_IMAGE": "True: train_flux_kontext.py also fine-tunes on rows without references (the family's "
                     "text-to-image model: the target's tokens and the text alone); else such rows are refused",
    "is_distilled": "(model_path) -> True where the pipeline samples without CFG whatever its guidance "
                    "(train_flux_kontext.py's samples then take no negative prompt)",
    "encode_references": "(vae, images (B, 3, H, W)) -> the references' latents (B, C, h, w) as its pipeline encodes "
                         "them, where that differs from encode_latents (train_flux_kontext.py); else encode_latents",
    "sampling_shift": "(model_path, tokens, steps) -> the pipeline's σ shift where its scheduler config does not "
                      "say it (DMD2 validation's teacher reference)",
    # a video room (train_dmd.py's flow setup; the image rooms' defaults in algorithms/dmd2_flow.py)
    "latent_grid": "(size, settings) -> the latent grid of a target of `size` px ((T, h, w) for a video); else "
                   "(h/f, w/f)",
    "pack_latents": "(latents (B, C, *grid)) -> tokens (B, N, D), the order its model reads; else 2x2 patches "
                    "row by row (algorithms/flux_kontext.pack_latents)",
    "generator_sigmas": "(model_path, sigmas) -> the student's σ list where its export's scheduler makes its own "
                        "(a pipeline that passes no σ); else DENOISING_STEPS' (t + 1) / 1000",
    "check_targets": "(rows, settings) -> None: USE_GAN's real targets checked before any work where a row's "
                     "file can be wrong in ways opening it does not show (a video's frame count); else none",
    "frames_tile": "(clips (..., 3, F, H, W)) -> the image a sample grid shows of a clip (a video room's real "
                   "target beside its sample); else the target is an image already",
    "REFERENCE_WORDS": "how the start-up report names a row's reference where it enters as channels, not tokens "
                       "(an image-to-video first frame); else its token count",
}


# ----------------------------------------------------------------------------------------------
# the rooms' interface, by role


class Room(Protocol):
    NAME: str  # how the README, the docs and one-line errors name the family


class DistillationRoom(Room, Protocol):
    """What train_dmd.py asks every room before it picks a setup."""

    def dmd_guidance(self, settings) -> Any:
        """The teacher's guidance (algorithms/dmd2.Guidance) from the script's settings."""


class TransformerRoom(Room, Protocol):
    """What both scripts ask every transformer room (and data/buckets.row_shapes, for both)."""
    MAX_REFERENCES: int  # reference images a row may hold
    UNCONDITIONAL_PROMPT: str  # what CAPTION_DROPOUT trains
    DEFAULT_RESOLUTION: int  # RESOLUTION 0: the pipelines' area, RESOLUTION^2 pixels

    def edits(self, pipeline) -> bool: ...  # the pipeline's rows have references (else prompts alone)

    def build_transformer(self, folder, mesh, prec, device, *, load, sharding, block_classes, lora=..., seed=0,
                          base_dtype="", attention_backend=..., trainable=True, compute=None, frozen_dtype=None,
                          weights="", merge=None, fp8="") -> torch.nn.Module: ...

    def load_vae(self, folder, dtype, device) -> torch.nn.Module: ...

    def vae_factor(self, model_path) -> int: ...

    def latent_channels(self, vae) -> int: ...

    def target_size(self, size, row, settings) -> tuple[int, int]: ...

    def reference_sizes(self, size, row, settings) -> tuple | None: ...

    def image_loader(self, settings) -> Callable | None: ...

    def edit_attention_shapes(self, model_path, settings, shapes, batch, context_parallel) -> tuple[list, list]: ...

    def prepare_edit_text(self, texts, model_path, cache_dir, settings, dtype, device) -> str: ...

    def load_text(self, texts, cache_dir, identity, device) -> Any: ...


class EditingRoom(TransformerRoom, Protocol):
    """train_flux_kontext.py: an editing fine-tune's steps, validation and samples."""
    TEXT_READS_IMAGES: bool  # the text encoder reads the references: a mirrored row has its own text

    def check_edit_settings(self, model_path, settings, changed) -> None: ...

    def check_context_parallel(self, model_path, context_parallel, settings, shapes) -> None: ...

    def encode_latents(self, vae, images) -> torch.Tensor: ...

    def repeat_text(self, text, i, n) -> Any: ...

    def text_row(self, text, i) -> Any: ...

    def model_inputs(self, x0, references, noise, sigmas) -> dict: ...

    def forward(self, transformer, inputs, sigmas, guidance, text) -> torch.Tensor: ...

    def sample_pipeline(self, scheduler, vae, transformer) -> Any: ...

    def sample(self, pipe, vae, references, text, size, steps, guidance, generator) -> torch.Tensor: ...


class FlowDistillationRoom(TransformerRoom, DistillationRoom, Protocol):
    """train_dmd.py's flow_setup: DMD2 with a flow-matching teacher."""

    def check_dmd_settings(self, pipeline, settings, changed, data_kind) -> None: ...

    def check_context_parallel(self, model_path, context_parallel, settings, shapes) -> None: ...

    def dmd_cond(self, text, negative, vae, references, size) -> Any: ...

    def image_tokens(self, vae, pixels) -> torch.Tensor: ...

    def decode_tokens(self, vae, tokens, size) -> torch.Tensor: ...

    def distilled_scheduler(self, model_path, sigmas) -> dict: ...

    def distilled_index(self, model_path) -> dict: ...


class UnetDistillationRoom(DistillationRoom, Protocol):
    """train_dmd.py's unet_setup: DMD2 with an SD-1.5 or SDXL teacher."""
    PromptCache: type  # PromptCache(encode, size): each distinct prompt encoded once

    def is_sdxl(self, pipeline) -> bool: ...

    def check_dmd_settings(self, settings, changed) -> None: ...

    def load_dmd_rows(self, path, use_gan, skip_bad, *, real_path="", columns=None, split="train") -> tuple: ...

    def attention_shapes(self, model_path, resolution, batch, vae_path="") -> tuple[list, list]: ...

    def gan_head_size(self, unet_dir, sdxl, features="mid") -> int: ...

    def build_dmd_models(self, unet_dir, mesh, precision, device, *, sharding, block_classes, ema_decay, seed,
                         gan_head=None, head_features="mid", lora=..., fake_lora=False, fake_compute=None,
                         fake_attention=None, channels_last=False, generator_init="", base_dtype="") -> dict: ...

    def build_unet(self, folder, mesh, dtype, device, *, policy, trainable, sharding, block_classes, load=True,
                   lora=..., seed=0, weights="", base_dtype="", attention_dtype=None,
                   channels_last=False) -> torch.nn.Module: ...

    def load_frozen_parts(self, model_path, sdxl, te_dtype, vae_dtype, vae_path, device) -> tuple: ...

    def train_alphas(self, model_path, device) -> torch.Tensor: ...

    def latent_layout(self, resolution, vae_config, unet_config) -> tuple: ...

    def text_encoding(self, tokenizers, text_encoders, sdxl, size, device) -> Callable: ...

    def unconditional(self, encode, sdxl) -> Any: ...

    def dmd_sample_inputs(self, rows, count, shape, n_sim, seed) -> tuple: ...

    def write_samples(self, model, vae, text, noise, sim_noise, step_list, alphas, path) -> None: ...

    def generator_latents(self, model, text, noise, sim_noise, step_list, alphas) -> torch.Tensor: ...

    def decode(self, vae, latents) -> torch.Tensor: ...

    def dmd_micro_batches(self, it, loaded, seed, device, draw, encode, vae) -> list: ...

    def load_dmd_step(self, it, rows, batch_size, grad_accum, seed, d, real_size, real_rows=None,
                      caption_dropout=0.0) -> list: ...


# ----------------------------------------------------------------------------------------------
# the spec


@dataclass(frozen=True)
class PipelineSpec:
    """One diffusers pipeline a family trains, by model_index.json's `_class_name`."""
    name: str
    components: tuple[Component, ...]  # what its folder holds, in which role the scripts hold it
    scripts: tuple[str, ...]  # the scripts that train it
    resolution: int | None = None  # its native side in pixels where it differs from the family's


@dataclass(frozen=True)
class FamilySpec:
    """A model family: families/<name>/ (room.py, spec.py, parallelism.py, tiny.py, gpu.py), listed in
    families/__init__.py."""
    name: str  # its package under families/: one name per family
    room: ModuleType  # the package, whose names are the room's (families.FAMILIES' values)
    pipelines: tuple[PipelineSpec, ...]
    protocols: Mapping[str, type]  # script -> the Protocol the room answers for it
    default_resolution: int  # the real models' native side in pixels (RESOLUTION 0)
    text_len: int  # the text tokens the trained model reads by default (the planner's length)
    # (config, batch, shapes, text_len, device, dtype) -> the trained model's forward kwargs: `config` its
    # config, `shapes` one latent size per image ((h, w): the target first, then each reference; a video's target:
    # plan_target's latent shape, e.g. (frames, h, w))
    example_inputs: Callable[..., dict]
    # the context-parallel check before any work (the room's); None: the family takes no context parallelism
    check_context_parallel: Callable | None
    tiny: Mapping[str, Callable] = field(default_factory=dict)  # tiny default kind -> build(root): model/, data/
    # parallelism: model class -> what parallel/ needs to know of it (its FSDP units, default LoRA targets,
    # attention dispatch: ModelFacts), from families/<name>/parallelism.py; the trained classes at least
    models: Mapping[str, ModelFacts] = field(default_factory=dict)
    # the GPU check (tools/gpu/)
    gpu: Any = None  # its families/gpu.GpuCheck (families/<name>/gpu.py's GPU); None: no GPU check rows
    # the memory planner (tools/planner/): its built-in --model= names, and what it plans that differs by family
    builtins: Mapping[str, Builtin] = field(default_factory=dict)  # name -> its configs: builtin_folder(name)
    plan_names: Mapping[str, str] = field(default_factory=dict)  # pipeline -> the plan's label (DMD2 of it: + _dmd)
    plan_resolution: int = 0  # the planner's default side where a model has no sample_size (0: the pipeline's)
    text_tokenizer: str = ""  # the tokenizer whose model_max_length caps text_len ("": text_len as is)
    # (resolution, vae factor, count or None, area or 0) -> the reference latents' (h, w) planned beside the target
    plan_references: Callable | None = None
    references: int = 0  # reference images per sample the planner plans by default
    reference_area: int = 0  # > 0: references planned at this pixel area (--references / --reference_area apply)
    nf4_teacher: bool = False  # train_dmd.py's frozen teacher in NF4 like the LoRA bases with BASE_DTYPE=nf4
    fp32_components: Mapping[str, tuple] = field(default_factory=dict)  # pipeline -> parts the scripts keep fp32
    # video: the frames per sample the planner plans by default (--num_frames); 0: images
    plan_frames: int = 0
    # (resolution, vae factor, frames) -> (the target's (h, w) in pixels, its latent shape: example_inputs'
    # shapes[0]); None: a square of `resolution`, latents (h // factor, w // factor)
    plan_target: Callable | None = None
    # (config, shapes) -> the trained model's image tokens per sample; None: its example inputs' first tensor's dim 1
    plan_tokens: Callable | None = None
    # (pipeline, offline component's subfolder, prompts, references) -> the sequences (or images) one forward of that
    # encoder runs in the text-cache fill for `prompts` prompts with `references` references each; None: the prompts
    fill_batch: Callable | None = None
    # (config, reference latent shapes) -> the planner's words on the tokens per sample besides the target's, the
    # references' and the text's (Z-Image Omni's SigLIP tokens and template segments); None: nothing more
    sequence_extras: Callable | None = None
    # tools/bench/: tiny default kind -> the trained model's config changes that make it a medium one (tens of M
    # params, so the benchmarks' state bytes and step times are not lost in fixed costs); none: no medium rows
    bench_medium: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # train_dmd.py's DMD_LOSS "": the generator's objective for a teacher of this family that runs a CFG pair
    # (docs/dmd2.md's decoupled-against-dmd2 tables choose it); a teacher without a pair takes dmd2
    dmd_loss: str = "dmd2"

    def builtin_folder(self, name: str) -> str:
        """The real model `name`'s configs (no weights): families/<name>/configs/<built-in name>/."""
        return os.path.join(os.path.dirname(os.path.abspath(self.room.__file__)), "configs", name)

    @property
    def pipeline_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.pipelines)

    def resolution(self, pipeline: str) -> int:
        """The native side of `pipeline` in pixels."""
        return next(p.resolution or self.default_resolution for p in self.pipelines if p.name == pipeline)


@dataclass(frozen=True)
class Builtin:
    """A real model the memory planner plans by name (--model=), from its configs in the family's
    configs/<name>/ (FamilySpec.builtin_folder; no weights). Where train_dmd.py distils it besides the
    pipeline's own script, `<name>-dmd` (or `dmd`) plans that."""
    pipeline: str  # its model_index.json's _class_name
    dmd: str = ""  # the DMD2 plan's name where it is not <name>-dmd
