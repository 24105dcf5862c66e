"""The Wan family's spec: WanPipeline (Wan 2.1 text to video), distilled by train_dmd.py."""
from __future__ import annotations

import torch

import families.wan as room
from families.pipelines import Component
from families.spec import FamilySpec, FlowDistillationRoom, PipelineSpec
from families.wan import parallelism, tiny

_PARTS = (Component("transformer", "transformer", "trainable", "WanTransformer3DModel"),
          Component("vae", "vae", "replicated", "AutoencoderKLWan"),
          Component("text_encoder", "text_encoder", "offline", "UMT5EncoderModel"),
          Component("tokenizer", "tokenizer", "files"), Component("scheduler", "scheduler", "files"))


def example_inputs(config, batch: int, shapes, text_len: int, device, dtype) -> dict:
    """WanTransformer3DModel's forward kwargs as the room's velocity passes them: the latents (B, C, T, h, w) of
    shapes' first entry, (T, h, w) or (h, w) (one frame), the timestep sigma * 1000 (B,), the text (B, text_len,
    D) zero-padded (no mask)."""
    grid = tuple(shapes[0]) if len(shapes[0]) == 3 else (1, *shapes[0])
    return dict(hidden_states=torch.randn(batch, config["in_channels"], *grid, device=device, dtype=dtype),
                timestep=torch.rand(batch, device=device, dtype=dtype) * 1000,
                encoder_hidden_states=torch.randn(batch, text_len, config["text_dim"], device=device, dtype=dtype),
                return_dict=False)


SPEC = FamilySpec(
    name="wan", room=room,
    pipelines=(PipelineSpec("WanPipeline", _PARTS, ("train_dmd.py",)),),
    protocols={"train_dmd.py": FlowDistillationRoom},
    default_resolution=room.DEFAULT_RESOLUTION,
    text_len=512,  # MAX_SEQUENCE_LENGTH, the pipeline's padded length
    example_inputs=example_inputs,
    check_context_parallel=None,  # train_dmd.py takes no context parallelism yet
    tiny={"wan_t2v": tiny.build_wan_t2v},  # tools/tiny_models.BUILDERS
    models=parallelism.MODELS)
