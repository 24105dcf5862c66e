"""The model families, one room each: what is true of a family alone (how its models are built and
sharded, its conditioning, latent layout, training target and samples), apart from the scripts'
training stories. The scripts pick the room from model_index.json's `_class_name` through FAMILIES.

    sd_unet/      SD-1.5 and SDXL UNets (StableDiffusionPipeline, StableDiffusionXLPipeline)
    flux/         FLUX.1 transformers (FluxKontextPipeline, FluxPipeline)
    qwen_image/   Qwen-Image-Edit-2509 / 2511 (QwenImageEditPlusPipeline), 1-3 reference images
    flux2/        FLUX.2 [klein] and [dev] (Flux2KleinPipeline, Flux2Pipeline), 1-4 reference images
    dit.py        what the transformer rooms share: the build (meta, LoRA / NF4, recipe, load)
    pipelines.py  what each pipeline holds and in which role the scripts hold it; which scripts train it

Each family is a package whose room.py the package exposes. A new family is one more room here,
listed in FAMILIES, with its pipeline's components in pipelines.py (docs/architecture.md, "Adding a
family", lists what a room writes). Rooms import parallel/, data/, algorithms/, precision and
fsdp_utils; the scripts import the rooms, never the other way (tests/test_layout.py checks it).
"""
from __future__ import annotations

from families import flux, flux2, qwen_image, sd_unet

FAMILIES = {pipeline: room for room in (sd_unet, flux, qwen_image, flux2) for pipeline in room.PIPELINES}
