"""Reference images of multi-reference edits (Qwen-Image-Edit-2509/2511: 1-3 per sample): the size
each one is resized to, its loading, and the key that keeps one global batch to samples of one
shape.

    python -m pytest tests/test_data.py -q -k reference
"""
from __future__ import annotations

import math

import torch

from data.images import image_size, load_image

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


def load_reference(source, area: int, multiple: int = PIPELINE_MULTIPLE) -> torch.Tensor:
    """(3, h, w) in [-1, 1] of a reference image at reference_size. Loaded by the same resize and
    centre crop as a target (data.images.load_image), not the pipeline's stretch: a reference and a
    target of one size then hold the same pixels, so an unchanged region is not shifted between
    them. The crop removes what rounding the sides changed in the aspect ratio (up to about 4 % of
    a side at 1024^2 pixels for aspect ratios up to 4:1, 9 % at 384^2)."""
    return load_image(source, *reference_size(*image_size(source), area, multiple))


def batch_key(target_bucket, reference_buckets) -> tuple:
    """What one global batch must share: (the number of references, the target's bucket, each
    reference's bucket in order). Buckets are whatever the caller sizes by (a bucket index, or an
    (h, w) from reference_size); samples with equal keys stack into one tensor per position."""
    return (len(reference_buckets), target_bucket, tuple(reference_buckets))


def group_by_key(keys) -> tuple[list[int], list[tuple]]:
    """(group of each sample, the key of each group): groups numbered in order of first appearance,
    so the list can stand where a bucket index per sample is expected (one group per global batch)."""
    index: dict[tuple, int] = {}
    groups = [index.setdefault(key, len(index)) for key in keys]
    return groups, list(index)
