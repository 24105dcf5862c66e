"""What the generic sharding and LoRA machinery needs to know of each model class it meets: which
module classes are its FSDP units, which layers LoRA adapts by default, whether its attention goes
through diffusers' dispatcher. What a family's pipeline holds, and how the scripts build it, is in
its room (families/).

    python -m pytest tests/test_parallelize.py -q
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

# LORA_TARGET_MODULES=blocks: every Linear inside the model's FSDP units but their modulation, as musubi-tuner
# (QwenImageTransformerBlock's Linears, "_mod_" excluded) and ai-toolkit adapt them
LORA_PRESETS = ("blocks",)


def _flux2_lora_targets(model) -> list[str]:
    """diffusers' FLUX.2 LoRA examples' targets (examples/dreambooth/train_dreambooth_lora_flux2_klein.py,
    `target_modules`): the double blocks' attention projections, the single blocks' fused QKV-MLP input and,
    by full name, their output Linear (a bare "to_out" would reach the double blocks' ModuleList too)."""
    return ["to_k", "to_q", "to_v", "to_out.0", "to_qkv_mlp_proj",
            *[f"single_transformer_blocks.{i}.attn.to_out" for i in range(len(model.single_transformer_blocks))]]


def _qwen_unused(model) -> list[str]:
    """The last block's text stream after attention (to_add_out, txt_mlp): the model returns the image
    stream only (diffusers transformer_qwenimage.py:979-983), so nothing reads them."""
    last = len(model.transformer_blocks) - 1
    return [f"transformer_blocks.{last}.attn.to_add_out", f"transformer_blocks.{last}.txt_mlp"]


@dataclass(frozen=True)
class ModelFacts:
    units: tuple[str, ...]  # module classes that each get their own fully_shard unit
    lora_targets: tuple[str, ...] | Callable  # default LoRA target suffixes (peft's target_modules), or (model) -> them
    attention_dispatcher: bool = False  # its attention goes through diffusers' dispatcher (set_attention_backend)
    unused: Callable | None = None  # (model) -> names of the modules whose output nothing reads: no gradient
    modulation: tuple[str, ...] = ()  # name parts of the units' modulation Linears, left out of the "blocks" preset


MODELS = {
    # DMD2's FSDP config wraps SD UNets per BasicTransformerBlock and ResnetBlock2D (accelerate's
    # TRANSFORMER_BASED_WRAP on those classes); the attention blocks nest inside Transformer2DModel.
    # LoRA: the attention projections (diffusers' text-to-image LoRA example's targets); the official
    # DMD2 SDXL LoRA run adapts more (families/sd_unet.DMD2_LORA_TARGETS): the recipes name those
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
        attention_dispatcher=True, modulation=("norm1.linear", "norm1_context.linear", "norm.linear")),
    # Qwen-Image (-Edit, -Edit-2509/2511): its `_no_split_modules`, the 60 dual-stream blocks (image and text
    # streams, joint attention). LoRA: diffusers' Qwen-Image LoRA example's default targets
    # (examples/dreambooth/train_dreambooth_lora_qwen_image.py, `target_modules` when --lora_layers is
    # unset): the image stream's attention projections only; the text stream's (add_q_proj, add_k_proj,
    # add_v_proj, to_add_out) and the MLPs (img_mlp / txt_mlp .net.0.proj, .net.2) are named targets.
    # Attention: QwenDoubleStreamAttnProcessor2_0 calls dispatch_attention_fn
    "QwenImageTransformer2DModel": ModelFacts(units=("QwenImageTransformerBlock",),
                                              lora_targets=("to_k", "to_q", "to_v", "to_out.0"),
                                              attention_dispatcher=True, unused=_qwen_unused,
                                              modulation=("img_mod.", "txt_mod.")),
    # FLUX.2 ([dev], [klein]): its `_no_split_modules`; the modulation Linears live in the root (shared by every
    # block), so the "blocks" preset takes every Linear of the blocks. Attention: Flux2AttnProcessor and
    # Flux2ParallelSelfAttnProcessor call dispatch_attention_fn
    "Flux2Transformer2DModel": ModelFacts(units=("Flux2TransformerBlock", "Flux2SingleTransformerBlock"),
                                          lora_targets=_flux2_lora_targets, attention_dispatcher=True),
}
