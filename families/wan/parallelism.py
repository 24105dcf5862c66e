"""The Wan family's model facts (parallel/model_facts.ModelFacts): what the generic sharding, LoRA and FP8 machinery
needs to know of WanTransformer3DModel. The spec's `models`. (Minimal: the planner's facts and the real configs
live beside it in configs/.)

    python -m pytest tests/test_parallelize.py tests/test_wan.py -q
"""
from __future__ import annotations

from parallel.model_facts import ModelFacts

# Wan 2.1 / 2.2. Units: its `_no_split_modules`, each WanTransformerBlock (self-attention, cross-attention to the
# text, FFN); the patch embedding, the time / text embedder, norm_out and proj_out in the root unit. LoRA: the
# layers the Wan LoRAs people use adapt (LightX2V's and the Lightning LoRAs: self_attn / cross_attn q, k, v, o and
# ffn.0 / ffn.2 of each block), in diffusers' names as its Wan LoRA converter maps them
# (loaders/lora_conversion_utils.py, _convert_non_diffusers_wan_lora_to_diffusers: attn1 / attn2 to_q, to_k, to_v,
# to_out.0; ffn.net.0.proj, ffn.net.2). Attention: WanAttnProcessor calls dispatch_attention_fn
TRANSFORMER = ModelFacts(units=("WanTransformerBlock",),
                         lora_targets=("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"),
                         attention_dispatcher=True)

MODELS = {"WanTransformer3DModel": TRANSFORMER}
