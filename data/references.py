"""Reference images of multi-reference edits (Qwen-Image-Edit-2509/2511: 1-3 per sample): the size
each one is resized to (data/buckets.py loads them and keeps a global batch to one shape).

    python -m pytest tests/test_data.py -q -k reference
"""
from __future__ import annotations

import math

# the pipeline's areas (diffusers pipeline_qwenimage_edit_plus.py: VAE_IMAGE_SIZE, CONDITION_IMAGE_SIZE)
VAE_REFERENCE_AREA = 1024 * 1024  # the references the transformer sees as latents
VL_REFERENCE_AREA = 384 * 384  # the references the Qwen2.5-VL text encoder sees
PIPELINE_MULTIPLE = 32  # calculate_dimensions rounds both sides to 32, whatever the VAE


def reference_size(height: int, width: int, area: int, multiple: int = PIPELINE_MULTIPLE) -> tuple[int, int]:
    """(h, w) an image of height x width is resized to: about `area` pixels at its aspect ratio,
    each side rounded to the nearest `multiple` (diffusers' calculate_dimensions; the pipeline uses
    32, the latents' 2x2 packing needs VAE factor x 2 = 16). Never below one multiple."""
    ratio = width / height
    w = math.sqrt(area * ratio)
    h = w / ratio
    return max(multiple, round(h / multiple) * multiple), max(multiple, round(w / multiple) * multiple)
