"""The FLUX.2 family's spec: [klein] (Flux2KleinPipeline) and [dev] (Flux2Pipeline), trained by both scripts."""
from __future__ import annotations

import math

import torch

import families.flux2 as room
from families.flux2 import gpu, parallelism, tiny  # gpu: the GPU check's facts
from families.pipelines import Component
from families.spec import Builtin, EditingRoom, FamilySpec, FlowDistillationRoom, PipelineSpec

_PARTS = (Component("transformer", "transformer", "trainable", "Flux2Transformer2DModel"),
          Component("vae", "vae", "replicated", "AutoencoderKLFlux2"))
_FILES = (Component("tokenizer", "tokenizer", "files"), Component("scheduler", "scheduler", "files"))
_BOTH = ("train_dmd.py", "train_flux_kontext.py")


def example_inputs(config, batch: int, shapes, text_len: int, device, dtype) -> dict:
    """Flux2Transformer2DModel's forward kwargs as the room's forward passes them: the [target ; references]
    2x2-packed tokens (shapes: the (h, w) latents, the target first) with their 4-D ids (T, H, W, 0), the text
    (B, text_len, D) with its ids (0, 0, 0, l), σ (B,), [dev]'s embedded guidance (B,) in fp32 (klein: None)."""
    ids = room.image_ids([(h // 2, w // 2) for h, w in shapes], device)
    text = torch.randn(batch, text_len, config["joint_attention_dim"], device=device, dtype=dtype)
    guided = config.get("guidance_embeds", True)
    return dict(hidden_states=torch.randn(batch, ids.shape[0], config["in_channels"], device=device, dtype=dtype),
                encoder_hidden_states=text, timestep=torch.rand(batch, device=device, dtype=dtype),
                img_ids=ids.expand(batch, -1, -1), txt_ids=room.text_ids(text),
                guidance=torch.ones(batch, device=device, dtype=torch.float32) if guided else None, return_dict=False)


def plan_references(resolution: int, factor: int, count, area: int) -> tuple:
    """The memory planner's references: `count` (default 2) square images at least `area` (default the pipeline's
    REFERENCE_AREA) large, so each downsized to it and cut to multiples of 16 by the pipeline's rule
    (pipeline_size), whatever the target's size: their latents' (h, w), 2 per 2x2-packed token."""
    area = area or room.REFERENCE_AREA
    side = math.isqrt(area)
    h, w = room.pipeline_size(side, side, area)[1]
    return ((2 * (h // room.MULTIPLE), 2 * (w // room.MULTIPLE)),) * (2 if count is None else count)


SPEC = FamilySpec(
    name="flux2", room=room,
    # [klein]: Qwen3 (4 B / 8 B) as its text encoder; [dev]: Mistral-Small 3 (24 B). Both cached, then freed
    pipelines=(PipelineSpec("Flux2KleinPipeline", (*_PARTS, Component(
                   "text_encoder", "text_encoder", "offline", "Qwen3ForCausalLM"), *_FILES), _BOTH),
               PipelineSpec("Flux2Pipeline", (*_PARTS, Component(
                   "text_encoder", "text_encoder", "offline", "Mistral3ForConditionalGeneration"), *_FILES), _BOTH)),
    protocols={"train_dmd.py": FlowDistillationRoom, "train_flux_kontext.py": EditingRoom},
    default_resolution=room.DEFAULT_RESOLUTION,
    text_len=512,  # MAX_SEQUENCE_LENGTH, the pipelines' padded length
    example_inputs=example_inputs,
    check_context_parallel=room.check_context_parallel,
    tiny={"flux2_klein": tiny.build_flux2_klein, "flux2_dev": tiny.build_flux2_dev},  # tools/tiny_models.BUILDERS
    models=parallelism.MODELS,
    gpu=gpu.GPU,
    # the built-in configs: [dev]'s transformer is diffusers' Flux2Transformer2DModel defaults, klein's as BFL's
    # flux2 src/flux2/model.py (Klein4BParams, Klein9BParams; mirrored in kohya-ss/musubi-tuner
    # src/musubi_tuner/flux_2/flux2_models.py); [dev]'s text encoder is the Mistral-Small-3.1-24B config
    # musubi-tuner's flux_2/flux2_utils.py builds (M3_CONFIG_JSON), klein's Qwen3-4B / Qwen3-8B as its
    # zimage/zimage_utils.py load_qwen3; the VAE is AutoencoderKLFlux2's defaults
    builtins={"flux2-dev": Builtin("Flux2Pipeline"), "flux2-klein-4b": Builtin("Flux2KleinPipeline"),
              "flux2-klein-9b": Builtin("Flux2KleinPipeline")},
    plan_names={"Flux2KleinPipeline": "flux2", "Flux2Pipeline": "flux2"},
    plan_references=plan_references, references=2, reference_area=room.REFERENCE_AREA,
    nf4_teacher=True)
