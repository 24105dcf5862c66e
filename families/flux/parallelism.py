"""The FLUX.1 family's model facts (parallel/model_facts.ModelFacts): what the generic sharding, LoRA and FP8
machinery needs to know of FluxTransformer2DModel. The spec's `models`; the room passes them to parallel/.

    python -m pytest tests/test_parallelize.py -q
"""
from __future__ import annotations

from parallel.model_facts import ModelFacts

# Units: its `_no_split_modules`, the units torchtitan's flux/parallelize.py shards: each double-stream block,
# then each single-stream block (the last not resharded after forward); the input embedders, norm_out and
# proj_out in the root unit. LoRA: diffusers' FLUX Kontext LoRA example's default targets
# (examples/dreambooth/train_dreambooth_lora_flux_kontext.py:1442-1456): attention and MLP projections of the
# double-stream blocks (image and text streams), attention and proj_mlp of the single blocks
TRANSFORMER = ModelFacts(
    units=("FluxTransformerBlock", "FluxSingleTransformerBlock"),
    lora_targets=("attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj", "attn.add_q_proj",
                  "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                  "ff_context.net.2", "proj_mlp"),
    attention_dispatcher=True, modulation=("norm1.linear", "norm1_context.linear", "norm.linear"))

MODELS = {"FluxTransformer2DModel": TRANSFORMER}
