"""What the memory planner (tools/planner/) plans of the Z-Image family: its FamilySpec's planner fields, as one
dict of keyword arguments (`PLAN`) that families/z_image/spec.py's SPEC takes (`FamilySpec(..., **plan_spec.PLAN)`):
the built-ins `z-image` and `z-image-dmd` (configs/, sourced in CONFIGS.md), 512 text tokens, the transformer's
forward inputs on meta, the teacher in NF4 with an NF4 LoRA base (as train_dmd.py builds it).

    python tools/memory_plan.py --model=z-image-dmd --world_size=1 --lora_rank=64 --fake_lora=1 --base_dtype=nf4
    python -m pytest tests/test_memory_plan.py -q -k z_image
"""
from __future__ import annotations

import torch

from families.spec import Builtin

TEXT_LEN = 512  # the pipeline's max_sequence_length, the chat template included; a prompt keeps its real tokens


def example_inputs(config, batch: int, shapes, text_len: int, device, dtype) -> dict:
    """ZImageTransformer2DModel's forward arguments as the room's velocity passes them: one (C, 1, h, w) latent per
    sample (shapes[0]: the target's (h, w)), the timestep (B,), one (text_len, cap_feat_dim) caption per sample."""
    h, w = shapes[0]
    return dict(x=[torch.randn(config["in_channels"], 1, h, w, device=device, dtype=dtype) for _ in range(batch)],
                t=torch.rand(batch, device=device, dtype=dtype),
                cap_feats=[torch.randn(text_len, config["cap_feat_dim"], device=device, dtype=dtype)
                           for _ in range(batch)], return_dict=False)


def plan_tokens(config, shapes) -> int:
    """The image tokens of the target's (h, w) latents: one per 2 x 2 patch (all_patch_size), before the
    transformer pads them to a multiple of 32."""
    p = config["all_patch_size"][0]
    return (shapes[0][0] // p) * (shapes[0][1] // p)


# FamilySpec(**PLAN): ZImagePipeline is fine-tuned (--model=z-image) and distilled (--model=z-image-dmd).
# Z-Image-Turbo is not built in: its transformer, text encoder and VAE configs are the base's (only its
# scheduler's shift, 3.0, differs, which the planner does not read), and a distilled model is no DMD2 teacher
PLAN = dict(
    text_len=TEXT_LEN,  # at most 512 tokens: the planner plans a prompt of the full length
    example_inputs=example_inputs,
    plan_tokens=plan_tokens,
    builtins={"z-image": Builtin("ZImagePipeline")},
    plan_names={"ZImagePipeline": "z_image"},
    nf4_teacher=True)  # train_dmd.py: BASE_DTYPE=nf4 with LoRA stores the frozen teacher in NF4 too
