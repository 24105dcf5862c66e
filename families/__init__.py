"""The model families, one package each: what is true of a family alone (how its models are built and
sharded, its conditioning, latent layout, training target and samples), apart from the scripts'
training stories. The scripts pick the room from model_index.json's `_class_name` through FAMILIES.

    sd_unet/      SD-1.5 and SDXL UNets (StableDiffusionPipeline, StableDiffusionXLPipeline)
    flux/         FLUX.1 transformers (FluxKontextPipeline, FluxPipeline)
    qwen_image/   Qwen-Image-Edit-2509 / 2511 (QwenImageEditPlusPipeline), 1-3 reference images
    flux2/        FLUX.2 [klein] and [dev] (Flux2KleinPipeline, Flux2Pipeline), 1-4 reference images
    wan/          Wan 2.1 text to video (WanPipeline), distilled by train_dmd.py
    z_image/      Z-Image base, text to image (ZImagePipeline) and Omni edits from 1-4 references
                  (ZImageOmniPipeline), distilled by train_dmd.py
    spec.py       FamilySpec, and the Protocols a room answers for each script
    dit.py        what the transformer rooms share: the build (meta, LoRA / NF4, recipe, load)
    pipelines.py  what each pipeline holds and in which role the scripts hold it; which scripts train it
    tiny/         what the families' tiny test folders share (tokenizers, synthetic data)
    gpu.py        GpuCheck: what the GPU check (tools/gpu/) needs of a family

A family's package holds room.py (what the scripts ask of it; the package exposes its names), spec.py
(its FamilySpec), parallelism.py (its model classes' facts for parallel/: FSDP units, default LoRA targets,
attention dispatch), tiny.py (its tiny test folders) and gpu.py (its GPU-check facts: real-width parts,
reference inputs, rows' data); a new family is one more name in NAMES
(docs/architecture.md, "Adding a family"). Rooms import parallel/, data/, algorithms/, precision and
fsdp_utils; the scripts import the rooms, never the other way (tests/test_layout.py checks it).
"""
from __future__ import annotations

import importlib

from families import pipelines
from families.spec import FamilySpec
from parallel import model_facts

NAMES = ("sd_unet", "flux", "qwen_image", "flux2", "wan", "z_image")  # the families in the tables' order (the packages)

SPECS: tuple[FamilySpec, ...] = tuple(importlib.import_module(f"families.{name}.spec").SPEC for name in NAMES)
FAMILIES = {p.name: spec.room for spec in SPECS for p in spec.pipelines}  # pipeline -> its room
pipelines.gather(SPECS)
# model class -> its facts (parallel/model_facts.ModelFacts), from the specs' `models`: what the rooms and components
# pass to parallel/; registered there too (the same dict) for the callers that hold a model but not its family
MODELS = model_facts.register({cls: facts for spec in SPECS for cls, facts in spec.models.items()})


def spec_of(pipeline: str) -> FamilySpec:
    """The spec of the family that trains `pipeline` (model_index.json's `_class_name`)."""
    return next(spec for spec in SPECS if pipeline in spec.pipeline_names)
