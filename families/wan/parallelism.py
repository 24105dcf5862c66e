"""The Wan family's model facts (parallel/model_facts.ModelFacts): what the generic sharding, LoRA and FP8 machinery
needs to know of WanTransformer3DModel (Wan 2.1 T2V / I2V, Wan 2.2 TI2V-5B, each expert of the A14B pair). The
spec's `models`; the room passes them to parallel/.

    python -m pytest tests/test_parallelize.py tests/test_wan.py -q
"""
from __future__ import annotations

from parallel.model_facts import ModelFacts

# Units: its `_no_split_modules`, each WanTransformerBlock (self-attention, cross-attention to the text (2.1 I2V:
# and the CLIP image tokens, through attn2's add_k_proj / add_v_proj), the FFN), the last not resharded after
# forward; the patch embedding, the condition embedder (time, text, 2.1 I2V's image projection), norm_out, proj_out
# and the output scale_shift_table in the root unit. LoRA: the layers the Wan LoRAs people use adapt (LightX2V's
# and the 4-step Lightning LoRAs: self_attn / cross_attn q, k, v, o and ffn.0 / ffn.2 of each block), in diffusers'
# names as its Wan LoRA converter maps them (loaders/lora_conversion_utils.py,
# _convert_non_diffusers_wan_lora_to_diffusers: attn1 / attn2 to_q, to_k, to_v, to_out.0; ffn.net.0.proj,
# ffn.net.2), so that such a LoRA can start the generator (GENERATOR_LORA); diffusers' LoRA tests adapt the
# attention alone (tests/lora/utils.py, `denoiser_target_modules`). Modulation: a block's is its scale_shift_table
# (a Parameter, no Linear) plus the root's shared condition_embedder.time_proj, so the "blocks" preset takes every
# Linear of the blocks. Attention: WanAttnProcessor calls dispatch_attention_fn (diffusers
# models/transformers/transformer_wan.py, both the attention and 2.1 I2V's image attention). Nothing is unused: the
# forward reads every module it builds (image_embedder only where image_dim is set)
TRANSFORMER = ModelFacts(units=("WanTransformerBlock",),
                         lora_targets=("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"),
                         attention_dispatcher=True)

MODELS = {"WanTransformer3DModel": TRANSFORMER}
