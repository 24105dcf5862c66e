"""The two-reference "make the <shape> the colour of picture 2" task of demos/qwen_edit_eval.py at 64 px,
evaluated through diffusers' ZImageOmniPipeline (Z-Image's edits from several references).

The task, its splits and its scores are qwen_edit_eval's (picture 1 a shape on a background, picture 2 a
plain swatch; train 4096, held-out 64, retention 64 one-reference "make it <colour>" edits), drawn at 64 px:
the pipeline refuses a reference under 64 px a side (Flux2ImageProcessor.check_image_input).

Generation is the pipeline's own call (ZImageOmniPipeline.__call__): every reference as given (64^2 is under
its 1024^2 area and a multiple of 16), the target at 64^2, the prompt's segments encoded to
MAX_SEQUENCE_LENGTH tokens each (the length the demo trains at), CFG off (guidance_scale 0) unless a
true CFG is asked for. The VAE runs in bf16: the pipeline encodes references as `image.bfloat16()`
(pipeline_z_image_omni.py:309), which only a bf16 VAE takes.

    python -m demos.z_image_edit_eval --compare base=assets/z_image_edit_base tuned=out/z_image_edit_demo/export
    python -m demos.z_image_edit_eval --make_data=out/z_image_edit_task    # write the splits, print the paths
"""
from __future__ import annotations

import os
import sys

import numpy as np

from demos import qwen_edit_eval as qe

IMAGE_SIZE = 64  # the pipeline's smallest reference side
MAX_SEQUENCE_LENGTH = 32  # text tokens per caption segment: the tiny tokenizer's segments are under 32


def load_pipeline(folder, lora=None):
    """ZImageOmniPipeline.from_pretrained(folder) in fp32, its VAE in bf16; with `lora`, plus
    pipe.load_lora_weights(lora)."""
    import torch
    from diffusers import ZImageOmniPipeline
    pipe = ZImageOmniPipeline.from_pretrained(folder, torch_dtype=torch.float32)
    if lora:
        pipe.load_lora_weights(lora)
    pipe.vae.to(torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe, rows, steps=20, seed=0, true_cfg=1.0) -> list[np.ndarray]:
    """Edited images (HxWx3 uint8) for `rows`, one pipeline call per row (its references are one prompt's
    images) at the target's size. `true_cfg` is the suite's standard CFG w (neg + w (pos - neg)); the
    pipeline's guidance_scale is g = w - 1 (pos + g (pos - neg), against ""), so w = 1 is guidance_scale 0:
    CFG off. Generator seeded with seed + index (the global RNG too); qwen_edit_eval.generate's signature."""
    return qe.pipeline_outputs(pipe, rows, seed, height=IMAGE_SIZE, width=IMAGE_SIZE, num_inference_steps=steps,
                               guidance_scale=max(true_cfg - 1.0, 0.0), max_sequence_length=MAX_SEQUENCE_LENGTH)


Z_IMAGE = qe.EditFamily("z_image_edit", __doc__, IMAGE_SIZE, load_pipeline, generate)

# qwen_edit_eval's task at 64 px through this pipeline: its splits, evaluation and command line
ensure_task_data, evaluate, main = Z_IMAGE.ensure_task_data, Z_IMAGE.evaluate, Z_IMAGE.main

if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
