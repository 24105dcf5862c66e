"""The Z-Image family's spec: ZImagePipeline (Z-Image base, text to image) and ZImageOmniPipeline (edits from
references), each distilled by train_dmd.py and fine-tuned by train_flux_kontext.py (text-to-image rows; Omni: edit
rows). No context parallelism (ZImageTransformer2DModel has no _cp_plan: its check refuses it in one line); the
planner's built-ins `z-image`, `z-image-omni` (fine-tuning) and their `-dmd` plans (plan_spec.py, configs/); the
GPU check's --suite=z_image (gpu.py).

    python -m pytest tests/test_families.py tests/test_z_image.py tests/test_z_image_omni.py -q
"""
from __future__ import annotations

import families.z_image as room
from families.pipelines import Component
from families.spec import EditingRoom, FamilySpec, FlowDistillationRoom, PipelineSpec
from families.z_image import gpu, parallelism, plan_spec, tiny

_PARTS = (Component("transformer", "transformer", "trainable", "ZImageTransformer2DModel"),
          Component("vae", "vae", "replicated", "AutoencoderKL"),
          Component("text_encoder", "text_encoder", "offline"),  # Qwen3Model (or its ForCausalLM)
          Component("tokenizer", "tokenizer", "files"), Component("scheduler", "scheduler", "files"))


_OMNI = (*_PARTS, Component("siglip", "siglip", "offline", "Siglip2VisionModel"),  # its features cached, then freed
         Component("siglip_processor", "siglip_processor", "files"))


SPEC = FamilySpec(
    name="z_image", room=room,
    pipelines=(PipelineSpec("ZImagePipeline", _PARTS, ("train_dmd.py", "train_flux_kontext.py")),
               PipelineSpec("ZImageOmniPipeline", _OMNI, ("train_dmd.py", "train_flux_kontext.py"))),
    protocols={"train_dmd.py": FlowDistillationRoom, "train_flux_kontext.py": EditingRoom},
    default_resolution=room.DEFAULT_RESOLUTION,
    # refuses C > 1 in one line: ZImageTransformer2DModel has no _cp_plan (docs/families/z_image.md)
    check_context_parallel=room.check_context_parallel,
    tiny={"z_image": tiny.build_z_image, "z_image_omni": tiny.build_z_image_omni},  # tools/tiny_models.BUILDERS
    models=parallelism.MODELS,
    gpu=gpu.GPU,  # --suite=z_image: text-to-image LoRA and DMD2 at 1024 px
    # DMD_LOSS "" with its teacher's CFG: decoupled, the more valid at 4 and 1 steps on the CFG palette demo
    # (docs/dmd2.md), the loss Z-Image-Turbo was distilled with (Tongyi-MAI/Z-Image#56)
    dmd_loss="decoupled",
    **plan_spec.PLAN)  # the planner's fields: the built-in z-image, 512 text tokens, an NF4 teacher
