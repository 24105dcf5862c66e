"""The two-reference "make the <shape> the colour of picture 2" task of demos/qwen_edit_eval.py at 64 px,
evaluated through diffusers' Flux2KleinPipeline (FLUX.2 [klein]'s multi-image input).

The task, its splits and its scores are qwen_edit_eval's (picture 1 a shape on a background, picture 2 a
plain swatch; train 4096, held-out 64, retention 64 one-reference "make it <colour>" edits), drawn at 64 px:
the pipeline refuses a reference under 64 px a side (Flux2ImageProcessor.check_image_input).

Generation is the pipeline's own call (Flux2KleinPipeline.__call__): every reference as given (64^2 is under
its 1024^2 area and a multiple of 16), the target at 64^2, true CFG off (guidance_scale 1), the prompt
encoded to MAX_SEQUENCE_LENGTH tokens, the length the demo trains at (MAX_SEQUENCE_LENGTH).

    python -m demos.flux2_edit_eval --compare base=assets/flux2_edit_base tuned=out/flux2_edit_demo/export
    python -m demos.flux2_edit_eval --make_data=out/flux2_edit_task    # write the splits, print the paths
"""
from __future__ import annotations

import os
import sys

import numpy as np

from demos import qwen_edit_eval as qe

IMAGE_SIZE = 64  # the pipeline's smallest reference side
MAX_SEQUENCE_LENGTH = 32  # text tokens: the chat-templated prompts are under 32 with the tiny tokenizer


def load_pipeline(folder, lora=None):
    """Flux2KleinPipeline.from_pretrained(folder) in fp32; with `lora`, plus pipe.load_lora_weights(lora)."""
    import torch
    from diffusers import Flux2KleinPipeline
    pipe = Flux2KleinPipeline.from_pretrained(folder, torch_dtype=torch.float32)
    if lora:
        pipe.load_lora_weights(lora)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe, rows, steps=20, seed=0, true_cfg=1.0) -> list[np.ndarray]:
    """Edited images (HxWx3 uint8) for `rows`, one pipeline call per row (its references are one prompt's
    images) at the target's size, true CFG against "" at guidance_scale `true_cfg` (1: off), generator seeded
    with seed + index (the global RNG too); qwen_edit_eval.generate's signature."""
    return qe.pipeline_outputs(pipe, rows, seed, height=IMAGE_SIZE, width=IMAGE_SIZE, num_inference_steps=steps,
                               guidance_scale=true_cfg, max_sequence_length=MAX_SEQUENCE_LENGTH)


FLUX2 = qe.EditFamily("flux2_edit", __doc__, IMAGE_SIZE, load_pipeline, generate)

# qwen_edit_eval's task at 64 px through this pipeline: its splits, evaluation and command line
ensure_task_data, evaluate, main = FLUX2.ensure_task_data, FLUX2.evaluate, FLUX2.main

if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
