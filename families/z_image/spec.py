"""The Z-Image family's spec: ZImagePipeline (Z-Image base, text to image), distilled by train_dmd.py. No context
parallelism (ZImageTransformer2DModel has no _cp_plan, train_dmd.py takes none: the planner refuses it in one line);
no built-ins for the planner and no GPU-check rows yet.

    python -m pytest tests/test_families.py tests/test_z_image.py -q
"""
from __future__ import annotations

import torch

import families.z_image as room
from families.pipelines import Component
from families.spec import FamilySpec, FlowDistillationRoom, PipelineSpec
from families.z_image import parallelism, tiny

_PARTS = (Component("transformer", "transformer", "trainable", "ZImageTransformer2DModel"),
          Component("vae", "vae", "replicated", "AutoencoderKL"),
          Component("text_encoder", "text_encoder", "offline"),  # Qwen3Model (or its ForCausalLM)
          Component("tokenizer", "tokenizer", "files"), Component("scheduler", "scheduler", "files"))
TEXT_LEN = 512  # the pipeline's max_sequence_length, the chat template included; a prompt keeps its real tokens


def example_inputs(config, batch: int, shapes, text_len: int, device, dtype) -> dict:
    """ZImageTransformer2DModel's forward arguments as the room's velocity passes them: one (C, 1, h, w) latent per
    sample (shapes[0]: the target's (h, w)), the timestep (B,), one (text_len, cap_feat_dim) caption per sample."""
    h, w = shapes[0]
    return dict(x=[torch.randn(config["in_channels"], 1, h, w, device=device, dtype=dtype) for _ in range(batch)],
                t=torch.rand(batch, device=device, dtype=dtype),
                cap_feats=[torch.randn(text_len, config["cap_feat_dim"], device=device, dtype=dtype)
                           for _ in range(batch)], return_dict=False)


SPEC = FamilySpec(
    name="z_image", room=room,
    pipelines=(PipelineSpec("ZImagePipeline", _PARTS, ("train_dmd.py",)),),
    protocols={"train_dmd.py": FlowDistillationRoom},
    default_resolution=room.DEFAULT_RESOLUTION,
    text_len=TEXT_LEN,
    example_inputs=example_inputs,
    check_context_parallel=None,  # no _cp_plan; train_dmd.py takes no context parallelism
    tiny={"z_image": tiny.build_z_image},  # tools/tiny_models.BUILDERS
    models=parallelism.MODELS)
