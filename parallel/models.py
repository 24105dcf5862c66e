"""The one table of per-model facts that the scripts, the recipes and the memory planner read:
which module classes are FSDP units, which layers LoRA adapts, which components each pipeline the
scripts train holds and in which role; and the order in which a model's forward runs its modules.

    python -m pytest tests/test_parallelize.py -q
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn


@dataclass(frozen=True)
class ModelFacts:
    units: tuple[str, ...]  # module classes that each get their own fully_shard unit
    lora_targets: tuple[str, ...]  # default LoRA target suffixes (peft's target_modules)
    attention_dispatcher: bool = False  # its attention goes through diffusers' dispatcher (set_attention_backend)


MODELS = {
    # DMD2's FSDP config wraps SD UNets per BasicTransformerBlock and ResnetBlock2D (accelerate's
    # TRANSFORMER_BASED_WRAP on those classes); the attention blocks nest inside Transformer2DModel.
    # LoRA: the attention projections (diffusers' text-to-image LoRA example's targets); the official
    # DMD2 SDXL LoRA run adapts more (DMD2_LORA_TARGETS below): the recipes name those
    "UNet2DConditionModel": ModelFacts(units=("BasicTransformerBlock", "ResnetBlock2D"),
                                       lora_targets=("to_q", "to_k", "to_v", "to_out.0")),
    # FLUX: its `_no_split_modules`, the units torchtitan's flux/parallelize.py shards. LoRA:
    # diffusers' FLUX Kontext LoRA example's default targets (examples/dreambooth/
    # train_dreambooth_lora_flux_kontext.py:1442-1456): attention and MLP projections of the
    # double-stream blocks (image and text streams), attention and proj_mlp of the single blocks
    "FluxTransformer2DModel": ModelFacts(
        units=("FluxTransformerBlock", "FluxSingleTransformerBlock"),
        lora_targets=("attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj", "attn.add_q_proj",
                      "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                      "ff_context.net.2", "proj_mlp"),
        attention_dispatcher=True),
}

# The official DMD2 LoRA run's targets (tianweiy/DMD2 main/sd_unified_model.py:47-62, its
# --generator_lora path, SDXL only there): attention, proj_in/out, feed-forward, the resnets' convs
# and time embedding projections, the down/up samplers' convs. recipes/dmd_*_lora.sh pass them as
# LORA_TARGET_MODULES (tests/test_recipes.py checks they are these).
DMD2_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2",
                     "conv1", "conv2", "conv_shortcut", "downsamplers.0.conv", "upsamplers.0.conv", "time_emb_proj")


# ----------------------------------------------------------------------------------------------
# pipelines: what each script builds from a diffusers folder, and how each part is held

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

PIPELINES["FluxPipeline"] = PIPELINES["FluxKontextPipeline"]  # FLUX.1 text-to-image: the same parts (DMD2 only)
FLUX_TEACHERS = ("FluxKontextPipeline", "FluxPipeline")  # train_dmd.py's FLUX path (algorithms/dmd2_flux.py)

SCRIPTS = {  # the pipelines each script trains (the first is its default layout)
    "train_dmd.py": ("StableDiffusionPipeline", "StableDiffusionXLPipeline", "FluxKontextPipeline", "FluxPipeline"),
    "train_flux_kontext.py": ("FluxKontextPipeline",),
}


def folder_layout(pipeline: str) -> dict[str, str | None]:
    """{subfolder: class model_index.json must name, or None} of a pipeline: what a script checks
    a MODEL_PATH for before any work."""
    return {c.subfolder: c.class_name for c in PIPELINES[pipeline]}


def trained_component(pipeline: str) -> Component:
    """The pipeline's (first) trainable component: its UNet or FLUX transformer."""
    return next(c for c in PIPELINES[pipeline] if c.role == "trainable")


# ----------------------------------------------------------------------------------------------
# execution order

def execution_order(model: nn.Module) -> list[nn.Module]:
    """`model` and its submodules, depth first, in the order its forward runs them.

    That is registration order except in diffusers' UNets, whose constructors register modules in
    another order than forward calls them: UNet2DConditionModel registers `up_blocks` before
    `mid_block` (forward: down, mid, up), and each cross-attention block registers `attentions`
    before `resnets` (forward: resnet 0, attention 0, resnet 1, ...; a mid block starts with an
    extra resnet). tests/test_parallelize.py checks this against forward pre-hooks of real UNets."""
    out = []

    def visit(m: nn.Module) -> None:
        out.append(m)
        for child in _children_in_forward_order(m):
            visit(child)
    visit(model)
    return out


def _children_in_forward_order(m: nn.Module) -> list[nn.Module]:
    children = dict(m.named_children())
    names = list(children)
    if "mid_block" in names and "up_blocks" in names:  # UNet2DConditionModel: down, mid, up
        names.remove("mid_block")
        names.insert(names.index("up_blocks"), "mid_block")
    if isinstance(children.get("resnets"), nn.ModuleList) and isinstance(children.get("attentions"), nn.ModuleList):
        resnets, attentions = list(children["resnets"]), [a for a in children["attentions"] if a is not None]
        if "Mid" in type(m).__name__:  # resnet 0, then (attention i, resnet i + 1)
            interleaved = resnets[:1] + [x for pair in zip(attentions, resnets[1:]) for x in pair]
        else:  # (resnet i, attention i)
            interleaved = [x for pair in zip(resnets, attentions) for x in pair]
        interleaved += [r for r in resnets if r not in interleaved]
        rest = [children[n] for n in names if n not in ("resnets", "attentions")]
        return interleaved + rest
    return [children[n] for n in names]


def units_in_order(model: nn.Module, class_names) -> list[nn.Module]:
    """The submodules of `model` whose class is one of `class_names`, in execution order."""
    return [m for m in execution_order(model) if m is not model and type(m).__name__ in class_names]


def vae_scale_factor(vae_config) -> int:
    """Pixels per latent side of an AutoencoderKL (its config, or config.json as a dict), as
    diffusers' pipelines compute it: 2 ** (levels - 1), 8 for SD and FLUX."""
    return 2 ** (len(vae_config["block_out_channels"]) - 1)
