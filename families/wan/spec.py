"""The Wan family's spec: WanPipeline (Wan 2.1 text to video, Wan 2.2 TI2V-5B as text to video, Wan 2.2
T2V-A14B) and WanImageToVideoPipeline (Wan 2.1 I2V), distilled by train_dmd.py; the planner plans the six
built-ins (plan_spec.py), the trainer refuses in one line what its room does not take yet."""
from __future__ import annotations


import families.wan as room
from families.pipelines import Component
from families.spec import FamilySpec, FlowDistillationRoom, PipelineSpec
from families.wan import gpu, parallelism, plan_spec, tiny  # gpu: the GPU check's facts

# transformer_2: Wan 2.2 A14B's low-noise expert ([null, null] in the other folders' model_index.json)
_PARTS = (Component("transformer", "transformer", "trainable", "WanTransformer3DModel"),
          Component("transformer_2", "transformer_2", "trainable", "WanTransformer3DModel"),
          Component("vae", "vae", "replicated", "AutoencoderKLWan"),
          Component("text_encoder", "text_encoder", "offline", "UMT5EncoderModel"),
          Component("tokenizer", "tokenizer", "files"), Component("scheduler", "scheduler", "files"))


def example_inputs(config, batch: int, shapes, text_len: int, device, dtype) -> dict:
    """plan_spec.example_inputs (the pipelines' forward kwargs) on shapes' first entry, (T, h, w), or (h, w) as one
    frame."""
    grid = tuple(shapes[0]) if len(shapes[0]) == 3 else (1, *shapes[0])
    return plan_spec.example_inputs(config, batch, (grid, *shapes[1:]), text_len, device, dtype)


SPEC = FamilySpec(
    name="wan", room=room,
    pipelines=(PipelineSpec("WanPipeline", _PARTS, ("train_dmd.py",)),
               PipelineSpec("WanImageToVideoPipeline", (*_PARTS, Component(
                   "image_encoder", "image_encoder", "offline", "CLIPVisionModelWithProjection")), ("train_dmd.py",))),
    protocols={"train_dmd.py": FlowDistillationRoom},
    default_resolution=room.DEFAULT_RESOLUTION,
    check_context_parallel=room.check_context_parallel,
    tiny={"wan_t2v": tiny.build_wan_t2v, "wan_ti2v": tiny.build_wan_ti2v,  # tools/tiny_models.BUILDERS
          "wan_a14b": tiny.build_wan_a14b, "wan_i2v": tiny.build_wan_i2v,
          "wan_i2v_a14b": tiny.build_wan_i2v_a14b, "wan_ti2v_i2v": tiny.build_wan_ti2v_i2v},
    models=parallelism.MODELS, gpu=gpu.GPU,
    **{**plan_spec.PLAN, "example_inputs": example_inputs})  # the planner's fields: six built-ins, 81 frames
