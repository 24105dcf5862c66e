"""The SD UNet family in the GPU check (families/gpu.GpuCheck): SD-1.5's real UNet, VAE and CLIP with random
weights, DMD2 on a prompts file, the plain reference with its NHWC row.

    python -m pytest tests/test_gpu_check.py -q -m "not slow"
"""
from __future__ import annotations

import os

from families.gpu import GpuCheck
from families.sd_unet.room import to_channels_last


def _unet(tiny: str, real: str):
    from diffusers import UNet2DConditionModel
    return UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(os.path.join(real, "unet")))


def _vae(tiny: str, real: str):
    from diffusers import AutoencoderKL
    return AutoencoderKL.from_config(AutoencoderKL.load_config(os.path.join(real, "vae")))


def _clip(tiny: str, real: str):
    from transformers import CLIPTextConfig, CLIPTextModel
    return CLIPTextModel(CLIPTextConfig.from_pretrained(os.path.join(real, "text_encoder")))


def reference_shape(folder, data, settings):
    """(CLIP's context, no references)."""
    from transformers import AutoTokenizer
    return min(512, AutoTokenizer.from_pretrained(os.path.join(folder, "tokenizer")).model_max_length), ()


GPU = GpuCheck(label="SD-1.5", configs="sd15-dmd", parts=(("unet", _unet), ("vae", _vae), ("text_encoder", _clip)),
               keep=("tokenizer", "scheduler"), reference_shape=reference_shape,
               data_references=0, channels_last=to_channels_last)
