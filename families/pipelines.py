"""What each pipeline the scripts train holds, by model_index.json's `_class_name`: its components,
where each lives in the folder, in which role the scripts hold it; which pipelines each script
trains; and the VAE factor all of them share.

    python -m pytest tests/test_parallelize.py -q
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Component:
    name: str       # what the script calls it
    subfolder: str  # where it lives in the diffusers pipeline folder
    role: str       # trainable | frozen-sharded | replicated | offline (text embeddings cached, then freed)
    #               | files (tokenizer, scheduler: configs the script reads, no weights)
    class_name: str | None = None  # the class model_index.json must name for it (None: any)


_SD15 = (Component("generator", "unet", "trainable", "UNet2DConditionModel"),
         Component("fake_score", "unet", "trainable", "UNet2DConditionModel"),
         Component("teacher", "unet", "frozen-sharded", "UNet2DConditionModel"),
         Component("vae", "vae", "replicated", "AutoencoderKL"),
         Component("text_encoder", "text_encoder", "replicated", "CLIPTextModel"))
_SD_FILES = (Component("tokenizer", "tokenizer", "files"), Component("scheduler", "scheduler", "files"))

PIPELINES = {  # by model_index.json's _class_name
    "StableDiffusionPipeline": _SD15 + _SD_FILES,
    "StableDiffusionXLPipeline": _SD15 + (
        Component("text_encoder_2", "text_encoder_2", "replicated", "CLIPTextModelWithProjection"),
        *_SD_FILES, Component("tokenizer_2", "tokenizer_2", "files")),
    "FluxKontextPipeline": (
        Component("transformer", "transformer", "trainable", "FluxTransformer2DModel"),
        Component("vae", "vae", "replicated", "AutoencoderKL"),
        Component("text_encoder", "text_encoder", "offline"), Component("text_encoder_2", "text_encoder_2", "offline"),
        Component("tokenizer", "tokenizer", "files"), Component("tokenizer_2", "tokenizer_2", "files"),
        Component("scheduler", "scheduler", "files")),
}

PIPELINES["QwenImageEditPlusPipeline"] = (
    Component("transformer", "transformer", "trainable", "QwenImageTransformer2DModel"),
    Component("vae", "vae", "replicated", "AutoencoderKLQwenImage"),
    Component("text_encoder", "text_encoder", "offline", "Qwen2_5_VLForConditionalGeneration"),
    Component("tokenizer", "tokenizer", "files"), Component("processor", "processor", "files"),
    Component("scheduler", "scheduler", "files"))
_FLUX2_PARTS = (Component("transformer", "transformer", "trainable", "Flux2Transformer2DModel"),
                Component("vae", "vae", "replicated", "AutoencoderKLFlux2"))
_FLUX2_FILES = (Component("tokenizer", "tokenizer", "files"), Component("scheduler", "scheduler", "files"))
# FLUX.2 [dev]: Mistral-Small 3 (24 B) as its text encoder; [klein]: Qwen3 (4 B / 8 B). Both cached, then freed
PIPELINES["Flux2Pipeline"] = (*_FLUX2_PARTS, Component("text_encoder", "text_encoder", "offline",
                                                       "Mistral3ForConditionalGeneration"), *_FLUX2_FILES)
PIPELINES["Flux2KleinPipeline"] = (*_FLUX2_PARTS, Component("text_encoder", "text_encoder", "offline",
                                                            "Qwen3ForCausalLM"), *_FLUX2_FILES)
PIPELINES["FluxPipeline"] = PIPELINES["FluxKontextPipeline"]  # FLUX.1 text-to-image: the same parts (DMD2 only)

SCRIPTS = {  # the pipelines each script trains (the first is its default layout)
    "train_dmd.py": ("StableDiffusionPipeline", "StableDiffusionXLPipeline", "FluxKontextPipeline", "FluxPipeline",
                     "QwenImageEditPlusPipeline", "Flux2KleinPipeline", "Flux2Pipeline"),
    "train_flux_kontext.py": ("FluxKontextPipeline", "QwenImageEditPlusPipeline", "Flux2KleinPipeline",
                              "Flux2Pipeline"),
}


def folder_layout(pipeline: str) -> dict[str, str | None]:
    """{subfolder: class model_index.json must name, or None} of a pipeline: what a script checks
    a MODEL_PATH for before any work."""
    return {c.subfolder: c.class_name for c in PIPELINES[pipeline]}


def trained_component(pipeline: str) -> Component:
    """The pipeline's (first) trainable component: its UNet or FLUX transformer."""
    return next(c for c in PIPELINES[pipeline] if c.role == "trainable")




def vae_scale_factor(vae_config) -> int:
    """Pixels per latent side of an AutoencoderKL (its config, or config.json as a dict), as
    diffusers' pipelines compute it: 2 ** (levels - 1), 8 for SD and FLUX."""
    return 2 ** (len(vae_config["block_out_channels"]) - 1)
