"""The SD UNet family's model facts (parallel/model_facts.ModelFacts): what the generic sharding, LoRA and FP8
machinery needs to know of UNet2DConditionModel. The spec's `models`; the room passes them to parallel/.

    python -m pytest tests/test_parallelize.py -q
"""
from __future__ import annotations

from parallel.model_facts import ModelFacts

# DMD2's FSDP config wraps SD UNets per BasicTransformerBlock and ResnetBlock2D (accelerate's
# TRANSFORMER_BASED_WRAP on those classes); the attention blocks nest inside Transformer2DModel, and the
# units come in execution order (down, mid, up; resnet before attention: parallel/execution_order.py), so the
# unit kept gathered after forward is the last up block's last resnet or attention. The stem, time embedding
# and conv_out stay in the root unit.
# LoRA: the attention projections (diffusers' text-to-image LoRA example's targets); the official DMD2 SDXL
# LoRA run adapts more (families/sd_unet.DMD2_LORA_TARGETS): the recipes name those
UNET = ModelFacts(units=("BasicTransformerBlock", "ResnetBlock2D"), lora_targets=("to_q", "to_k", "to_v", "to_out.0"))

MODELS = {"UNet2DConditionModel": UNET}
