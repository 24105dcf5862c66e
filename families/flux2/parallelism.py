"""The FLUX.2 family's model facts (parallel/model_facts.ModelFacts): what the generic sharding, LoRA and FP8
machinery needs to know of Flux2Transformer2DModel. The spec's `models`; the room passes them to parallel/.

    python -m pytest tests/test_parallelize.py -q
"""
from __future__ import annotations

from parallel.model_facts import ModelFacts


def lora_targets(model) -> list[str]:
    """diffusers' FLUX.2 LoRA examples' targets (examples/dreambooth/train_dreambooth_lora_flux2_klein.py,
    `target_modules`): the double blocks' attention projections, the single blocks' fused QKV-MLP input and,
    by full name, their output Linear (a bare "to_out" would reach the double blocks' ModuleList too)."""
    return ["to_k", "to_q", "to_v", "to_out.0", "to_qkv_mlp_proj",
            *[f"single_transformer_blocks.{i}.attn.to_out" for i in range(len(model.single_transformer_blocks))]]


# FLUX.2 ([dev], [klein]). Units: its `_no_split_modules`, each double-stream block, then each single-stream
# block (the last not resharded after forward); the input embedders, the shared modulation, norm_out and
# proj_out in the root unit. The modulation Linears live in the root (shared by every block), so the "blocks"
# preset takes every Linear of the blocks. Attention: Flux2AttnProcessor and Flux2ParallelSelfAttnProcessor call
# dispatch_attention_fn
TRANSFORMER = ModelFacts(units=("Flux2TransformerBlock", "Flux2SingleTransformerBlock"), lora_targets=lora_targets,
                         attention_dispatcher=True)

MODELS = {"Flux2Transformer2DModel": TRANSFORMER}
