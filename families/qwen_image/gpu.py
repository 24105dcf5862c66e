"""The Qwen-Image-Edit family in the GPU check (families/gpu.GpuCheck): Qwen-Image-Edit-2509's transformer at real
width with fewer dual-stream blocks beside its real VAE and a one-layer Qwen2.5-VL of the real width (random
weights), edits with two references, the full export loaded as the pipeline.

    python -m pytest tests/test_gpu_check.py -q -m "not slow"
"""
from __future__ import annotations

import json
import os

from families.gpu import GpuCheck


def text_encoder_config(tiny: dict, real: str) -> dict:
    """The tiny folder's Qwen2.5-VL config (its vocabulary and special token ids: the tiny tokenizer's)
    at the real text and vision widths (`real`: the configs' folder), one layer of each: the text cache gets
    embeddings of the real width, computed at the real per-layer cost."""
    with open(os.path.join(real, "text_encoder", "config.json")) as f:
        real = json.load(f)
    text = {k: real[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                 "rms_norm_eps", "hidden_act", "max_position_embeddings")}
    section = real["rope_scaling"]["mrope_section"]
    text.update(num_hidden_layers=1, max_window_layers=1, layer_types=["full_attention"],
                rope_parameters={**tiny["text_config"]["rope_parameters"], "mrope_section": section})
    vision = {k: v for k, v in real["vision_config"].items() if k in tiny["vision_config"] and k != "model_type"}
    # one block, attending fully (the real tower's last of each 8 does); its merger to the text width
    vision.update(depth=1, fullatt_block_indexes=[0], out_hidden_size=real["hidden_size"])
    return {**tiny, "text_config": {**tiny["text_config"], **text},
            "vision_config": {**tiny["vision_config"], **vision}}


def _vae(tiny: str, real: str):
    from diffusers import AutoencoderKLQwenImage
    return AutoencoderKLQwenImage.from_config(AutoencoderKLQwenImage.load_config(os.path.join(real, "vae")))


def _text_encoder(tiny: str, real: str):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    with open(os.path.join(tiny, "text_encoder", "config.json")) as f:
        config = Qwen2_5_VLConfig.from_dict(text_encoder_config(json.load(f), real))
    return Qwen2_5_VLForConditionalGeneration(config)


def text_tokens(folder: str, data: str, condition_area: int) -> int:
    """The length of the prompt embeddings the run trains on: the first sample's prompt with its
    references (each at `condition_area`) through the pipeline's template and processor, less the
    system prompt's tokens it drops (encode_prompt without the encoder; the samples' prompts differ
    by a word at most)."""
    from diffusers import QwenImageEditPlusPipeline
    from transformers import Qwen2Tokenizer

    from families import qwen_image as qi
    with open(data) as f:
        row = json.loads(f.readline())
    pipe = QwenImageEditPlusPipeline(scheduler=None, vae=None, transformer=None, text_encoder=None,
                                     tokenizer=Qwen2Tokenizer.from_pretrained(os.path.join(folder, "tokenizer")),
                                     processor=qi.load_processor(os.path.join(folder, "processor")))
    images = qi.condition_images(pipe, [os.path.join(os.path.dirname(data), c) for c in qi.controls(row)],
                                 condition_area)
    # the pipeline's _get_qwen_prompt_embeds: "Picture i: " and the image's tokens before the prompt
    pictures = "".join(f"Picture {i + 1}: <|vision_start|><|image_pad|><|vision_end|>" for i in range(len(images)))
    ids = pipe.processor(text=[pipe.prompt_template_encode.format(pictures + row["prompt"])], images=images,
                         return_tensors="pt")["input_ids"]
    return ids.shape[1] - pipe.prompt_template_encode_start_idx


def reference_shape(folder, data, settings):
    """(the run's prompt length: text_tokens at the row's condition area, the row's two references at its
    reference area: square images; train_dmd.py reads its references at the target's size)."""
    extra = settings["extra"]
    side = round(extra.get("reference_area", settings["resolution"] ** 2) ** 0.5)
    return text_tokens(folder, data, extra["condition_area"]), (side,) * 2


def export_loads(export: str, base: str, settings: dict, data: str) -> bool:
    """A LoRA export's weights file; a full export as a user loads it: the whole QwenImageEditPlusPipeline (its
    processor through families.qwen_image.load_processor, which needs no torchvision)."""
    if settings.get("lora_rank"):
        return os.path.exists(os.path.join(export, "pytorch_lora_weights.safetensors"))
    import torch
    from diffusers import QwenImageEditPlusPipeline

    from families.qwen_image import load_processor
    processor = load_processor(os.path.join(export, "processor"))
    pipe = QwenImageEditPlusPipeline.from_pretrained(export, processor=processor, torch_dtype=torch.bfloat16)
    return pipe.transformer is not None and pipe.text_encoder is not None


# DMD2 with a Qwen-Image-Edit teacher as recipes/dmd_qwen_edit_4step_lora.sh runs it
DMD = {"denoising_steps": "999,749,499,249", "fake_score_fp32": 0, "lora_alpha": 8, "generator_lr": 5e-5,
       "guidance_lr": 4e-7}
TINY_AREA = 64 * 64  # the tiny rows' reference and condition areas (tests/test_qwen_image.py's)


def areas(tiny: bool, resolution: int, pipeline: bool = False) -> dict:
    """A row's REFERENCE_AREA and CONDITION_AREA: the pipeline's module constants (`pipeline`: VAE_IMAGE_SIZE
    too, 1024^2), else references at the target's RESOLUTION^2 as the memory planner plans them; tiny: TINY_AREA
    for the text encoder, RESOLUTION^2 for the VAE."""
    if tiny:
        return {"reference_area": resolution ** 2, "condition_area": TINY_AREA}
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus
    return {"reference_area": plus.VAE_IMAGE_SIZE if pipeline else resolution ** 2,
            "condition_area": plus.CONDITION_IMAGE_SIZE}


def suite(row, tiny: bool) -> list:
    """--suite=qwen_image: Qwen-Image-Edit-2509, two references per sample: LoRA at the pipeline's areas, a full
    fine-tune saved and resumed, and recipes/dmd_qwen_edit_4step_lora.sh's Lightning settings (LoRA r64 alpha 8
    generator, full fake score, AC; references at the target's size, as planned; teacher true CFG 4)."""
    lo, hi = (32, 64) if tiny else (512, 1024)
    edit, dmd = "train_flux_kontext.py", "train_dmd.py"
    return [row(f"qwen_edit_{hi}px_lora16_2refs", edit, "qwen_image", hi, 40, lora_rank=16,
                extra={"lora_alpha": 16, **areas(tiny, hi, pipeline=True)}),
            row(f"qwen_edit_{lo}px_full", edit, "qwen_image", lo, 190, resume=True, extra=areas(tiny, lo)),
            row(f"dmd_qwen_edit_{lo}px_4step_lora64_ac", dmd, "qwen_image", lo, 160, ac=True, lora_rank=64,
                resume=True, extra={**DMD, **areas(tiny, lo)})]


GPU = GpuCheck(suite=suite, label="Qwen-Image-Edit", configs="qwen-image-edit",
               parts=(("vae", _vae), ("text_encoder", _text_encoder)), keep=("tokenizer", "processor", "scheduler"),
               reference_shape=reference_shape, blocks=("num_layers",),
               default_blocks=(4,), data_references=2, reference_note=", target + 2 references", vae_frames=1,
               export_loads=export_loads)
