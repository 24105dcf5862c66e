"""The Z-Image family's model facts (parallel/model_facts.ModelFacts): what the generic sharding, LoRA and FP8
machinery needs to know of ZImageTransformer2DModel (Z-Image, Z-Image-Turbo). The spec's `models`; the room passes
them to parallel/.

    python -m pytest tests/test_z_image.py -q
"""
from __future__ import annotations

from parallel.model_facts import ModelFacts

# Units: its `_no_split_modules`, each ZImageTransformerBlock: the noise refiner's (image tokens, modulated by the
# timestep), the context refiner's (caption tokens, no modulation) and the 30 main single-stream blocks over
# [image ; caption], in that execution order, the last not resharded after forward; the patch and caption embedders,
# the timestep embedder, the pad tokens and the final layer in the root unit. LoRA: diffusers' Z-Image LoRA example's
# default targets (examples/dreambooth/train_dreambooth_lora_z_image.py, `target_modules` when --lora_layers is
# unset): every block's attention projections; the FFN (feed_forward.w1 / w2 / w3) is a named target. Modulation:
# each modulated block's adaLN_modulation Linear, left out of the "blocks" preset. Attention:
# ZSingleStreamAttnProcessor calls dispatch_attention_fn (diffusers models/transformers/transformer_z_image.py).
# Nothing is unused in text to image (the SigLIP parts exist only where siglip_feat_dim is set: Omni)
TRANSFORMER = ModelFacts(units=("ZImageTransformerBlock",), lora_targets=("to_k", "to_q", "to_v", "to_out.0"),
                         attention_dispatcher=True, modulation=("adaLN_modulation.",))

MODELS = {"ZImageTransformer2DModel": TRANSFORMER}
