"""The FLUX.1 family's spec: Kontext (both scripts) and text-to-image (DMD2 only)."""
from __future__ import annotations

import torch

import families.flux as room
from families.flux import gpu, parallelism, tiny  # gpu: the GPU check's facts
from algorithms import flux_kontext as km
from families.pipelines import Component
from families.spec import Builtin, EditingRoom, FamilySpec, FlowDistillationRoom, PipelineSpec

_PARTS = (Component("transformer", "transformer", "trainable", "FluxTransformer2DModel"),
          Component("vae", "vae", "replicated", "AutoencoderKL"),
          Component("text_encoder", "text_encoder", "offline"),
          Component("text_encoder_2", "text_encoder_2", "offline"),
          Component("tokenizer", "tokenizer", "files"), Component("tokenizer_2", "tokenizer_2", "files"),
          Component("scheduler", "scheduler", "files"))


def example_inputs(config, batch: int, shapes, text_len: int, device, dtype) -> dict:
    """FluxTransformer2DModel's forward kwargs as algorithms/flux_kontext.transformer_forward passes them: the
    [target ; context] 2x2-packed tokens (shapes: the target's (h, w) latent, then Kontext's one context, none for
    text to image) and their ids (N, 3), the T5 embeddings (B, text_len, D) with zero ids, the pooled CLIP vector,
    σ (B,), the embedded guidance (B,) in fp32 where the model has one."""
    if len(shapes) > 2:
        raise ValueError(f"FLUX.1 takes one context image, not {len(shapes) - 1}")
    ids = km.sequence_ids(tuple(shapes[0]), tuple(shapes[1]) if len(shapes) > 1 else None, device)
    guided = config.get("guidance_embeds", False)
    return dict(hidden_states=torch.randn(batch, ids.shape[0], config["in_channels"], device=device, dtype=dtype),
                encoder_hidden_states=torch.randn(batch, text_len, config["joint_attention_dim"], device=device,
                                                  dtype=dtype),
                pooled_projections=torch.randn(batch, config["pooled_projection_dim"], device=device, dtype=dtype),
                timestep=torch.rand(batch, device=device, dtype=dtype), img_ids=ids,
                txt_ids=torch.zeros(text_len, 3, device=device, dtype=ids.dtype),
                guidance=torch.ones(batch, device=device, dtype=torch.float32) if guided else None, return_dict=False)


def plan_references(resolution: int, factor: int, count, area: int) -> tuple:
    """Kontext's one context image, planned at the target's square size (the memory planner)."""
    return ((resolution // factor, resolution // factor),)


SPEC = FamilySpec(
    name="flux", room=room,
    pipelines=(PipelineSpec("FluxKontextPipeline", _PARTS, ("train_dmd.py", "train_flux_kontext.py")),
               PipelineSpec("FluxPipeline", _PARTS, ("train_dmd.py",))),  # text to image: the same parts
    protocols={"train_dmd.py": FlowDistillationRoom, "train_flux_kontext.py": EditingRoom},
    default_resolution=room.DEFAULT_RESOLUTION,
    text_len=512,  # T5's MAX_SEQUENCE_LENGTH
    example_inputs=example_inputs,
    check_context_parallel=room.check_context_parallel,
    tiny={"flux_kontext": tiny.build_flux_kontext},  # tools/tiny_models.BUILDERS
    models=parallelism.MODELS,
    gpu=gpu.GPU,
    builtins={"flux-kontext-dev": Builtin("FluxKontextPipeline", dmd="flux-kontext-dmd")},
    plan_names={"FluxKontextPipeline": "flux_kontext", "FluxPipeline": "flux"},
    plan_resolution=512,
    text_tokenizer="tokenizer_2",  # T5's
    plan_references=plan_references, references=1,
    nf4_teacher=True,
    bench_medium={"flux_kontext": dict(num_layers=4, num_single_layers=8, attention_head_dim=64,
                                       num_attention_heads=6, axes_dims_rope=(16, 24, 24))})
