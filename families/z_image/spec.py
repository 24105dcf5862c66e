"""The Z-Image family's spec: ZImagePipeline (Z-Image base, text to image), distilled by train_dmd.py. No context
parallelism (ZImageTransformer2DModel has no _cp_plan: the planner refuses it in one line); the planner's built-in
`z-image` (plan_spec.py, configs/); no GPU-check rows yet.

    python -m pytest tests/test_families.py tests/test_z_image.py -q
"""
from __future__ import annotations

import families.z_image as room
from families.pipelines import Component
from families.spec import FamilySpec, FlowDistillationRoom, PipelineSpec
from families.z_image import parallelism, plan_spec, tiny

_PARTS = (Component("transformer", "transformer", "trainable", "ZImageTransformer2DModel"),
          Component("vae", "vae", "replicated", "AutoencoderKL"),
          Component("text_encoder", "text_encoder", "offline"),  # Qwen3Model (or its ForCausalLM)
          Component("tokenizer", "tokenizer", "files"), Component("scheduler", "scheduler", "files"))


SPEC = FamilySpec(
    name="z_image", room=room,
    pipelines=(PipelineSpec("ZImagePipeline", _PARTS, ("train_dmd.py",)),),
    protocols={"train_dmd.py": FlowDistillationRoom},
    default_resolution=room.DEFAULT_RESOLUTION,
    check_context_parallel=None,  # refused: ZImageTransformer2DModel has no _cp_plan (docs/families/z_image.md)
    tiny={"z_image": tiny.build_z_image},  # tools/tiny_models.BUILDERS
    models=parallelism.MODELS,
    **plan_spec.PLAN)  # the planner's fields: the built-in z-image, 512 text tokens, an NF4 teacher
