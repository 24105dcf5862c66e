"""The Qwen-Image-Edit family's model facts (parallel/model_facts.ModelFacts): what the generic sharding, LoRA
and FP8 machinery needs to know of QwenImageTransformer2DModel. The spec's `models`; the room passes them to
parallel/ and freezes what nothing reads (room.freeze_unused).

    python -m pytest tests/test_parallelize.py -q
"""
from __future__ import annotations

from parallel.model_facts import ModelFacts


def unused(model) -> list[str]:
    """The last block's text stream after attention (to_add_out, txt_mlp): the model returns the image
    stream only (diffusers transformer_qwenimage.py:979-983), so nothing reads them."""
    last = len(model.transformer_blocks) - 1
    return [f"transformer_blocks.{last}.attn.to_add_out", f"transformer_blocks.{last}.txt_mlp"]


# Qwen-Image (-Edit, -Edit-2509/2511). Units: its `_no_split_modules`, the 60 dual-stream blocks (image and
# text streams, joint attention), the last not resharded after forward; the input projections (img_in,
# txt_norm, txt_in), the time embedding, norm_out and proj_out in the root unit. LoRA: diffusers' Qwen-Image
# LoRA example's default targets (examples/dreambooth/train_dreambooth_lora_qwen_image.py, `target_modules`
# when --lora_layers is unset): the image stream's attention projections only; the text stream's
# (add_q_proj, add_k_proj, add_v_proj, to_add_out) and the MLPs (img_mlp / txt_mlp .net.0.proj, .net.2) are
# named targets. Attention: QwenDoubleStreamAttnProcessor2_0 calls dispatch_attention_fn
TRANSFORMER = ModelFacts(units=("QwenImageTransformerBlock",), lora_targets=("to_k", "to_q", "to_v", "to_out.0"),
                         attention_dispatcher=True, unused=unused, modulation=("img_mod.", "txt_mod."))

MODELS = {"QwenImageTransformer2DModel": TRANSFORMER}
