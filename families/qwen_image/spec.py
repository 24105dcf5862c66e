"""The Qwen-Image-Edit family's spec: QwenImageEditPlusPipeline (2509 / 2511), trained by both scripts."""
from __future__ import annotations

import torch

import families.qwen_image as room
from families.qwen_image import gpu, parallelism, tiny  # gpu: the GPU check's facts
from families.pipelines import Component
from families.spec import Builtin, EditingRoom, FamilySpec, FlowDistillationRoom, PipelineSpec

_PARTS = (Component("transformer", "transformer", "trainable", "QwenImageTransformer2DModel"),
          Component("vae", "vae", "replicated", "AutoencoderKLQwenImage"),
          Component("text_encoder", "text_encoder", "offline", "Qwen2_5_VLForConditionalGeneration"),
          Component("tokenizer", "tokenizer", "files"), Component("processor", "processor", "files"),
          Component("scheduler", "scheduler", "files"))
# the Qwen2.5-VL prompt less the 64 system tokens the pipeline drops: per reference (two) "Picture i:" and its
# vision markers (~7 tokens) around its image at the 384^2 condition area (14 x 14 merged 28 px cells), then
# the instruction (64) and the closing template (5)
TEXT_LEN = 2 * (round(384 / 28) ** 2 + 7) + 64 + 5


def example_inputs(config, batch: int, shapes, text_len: int, device, dtype) -> dict:
    """QwenImageTransformer2DModel's forward kwargs as the room's forward passes them: the [target ; references]
    2x2-packed tokens with one img_shapes entry (1, h/2, w/2) per image (shapes: the (h, w) latents, the target
    first), σ (B,), no guidance, the text (B, text_len, D) unpadded (mask None, as the pipeline drops an all-ones
    one)."""
    grids = [(1, h // 2, w // 2) for h, w in shapes]
    tokens = sum(h * w for _, h, w in grids)
    return dict(hidden_states=torch.randn(batch, tokens, config["in_channels"], device=device, dtype=dtype),
                timestep=torch.rand(batch, device=device, dtype=dtype), guidance=None,
                encoder_hidden_states=torch.randn(batch, text_len, config["joint_attention_dim"], device=device,
                                                  dtype=dtype),
                encoder_hidden_states_mask=None, img_shapes=[grids] * batch, return_dict=False)


def plan_references(resolution: int, factor: int, count, area: int) -> tuple:
    """The memory planner's references: `count` (default 2) at the target's square size (the pipeline encodes
    references at its 1024^2 VAE_IMAGE_SIZE: the same tokens at 1024 px)."""
    return ((resolution // factor, resolution // factor),) * (2 if count is None else count)


SPEC = FamilySpec(
    name="qwen_image", room=room,
    pipelines=(PipelineSpec("QwenImageEditPlusPipeline", _PARTS, ("train_dmd.py", "train_flux_kontext.py")),),
    protocols={"train_dmd.py": FlowDistillationRoom, "train_flux_kontext.py": EditingRoom},
    default_resolution=room.DEFAULT_RESOLUTION,
    text_len=TEXT_LEN,
    example_inputs=example_inputs,
    check_context_parallel=room.check_context_parallel,
    tiny={"qwen_image_edit": tiny.build_qwen_image_edit},  # tools/tiny_models.BUILDERS
    models=parallelism.MODELS,
    gpu=gpu.GPU,
    builtins={"qwen-image-edit": Builtin("QwenImageEditPlusPipeline")},
    plan_names={"QwenImageEditPlusPipeline": "qwen_image_edit"},
    plan_references=plan_references, references=2,
    nf4_teacher=True)
