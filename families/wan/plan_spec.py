"""What the memory planner (tools/planner/) plans of the Wan family: its FamilySpec's planner fields, as one dict
of keyword arguments (`PLAN`) that families/wan/spec.py's SPEC takes (`FamilySpec(..., **plan_spec.PLAN)`):
the six built-ins (configs/), 81 frames at 480p by default, the video target's shape and tokens, the
transformer's forward inputs on meta.

    python tools/memory_plan.py --model=wan2.1-t2v-1.3b --world_size=1 --lora_rank=16
    python -m pytest tests/test_memory_plan.py -q -k wan
"""
from __future__ import annotations

import math

import torch

from families.spec import Builtin

FRAMES = 81  # the pipelines' num_frames default: 5 s at 16 fps
RESOLUTION = 480  # 480p: 480 x 832, the pipelines' default height and width
TEMPORAL = 4  # both Wan VAEs' scale_factor_temporal: 4k + 1 frames make k + 1 latent frames
WIDTHS = {480: 832, 720: 1280}  # Wan's own sizes (832*480, 1280*720; TI2V-5B's 1280*704)
IMAGE_TOKENS = 257  # 2.1 I2V's CLIP ViT-H/14 at 224 px: 16 x 16 patches + the class token


def plan_size(resolution: int, factor: int) -> tuple[int, int]:
    """The (height, width) in pixels planned for `resolution`p: height and width multiples of the VAE factor x the
    2 x 2 patch (16 for 2.1 and A14B, 32 for TI2V-5B: its 720p is 704 x 1280), width Wan's (832 at 480p, 1280 at
    720p), else 16:9."""
    m = 2 * factor
    width = WIDTHS.get(resolution) or m * round(resolution * 16 / 9 / m)
    return resolution // m * m, width // m * m


def plan_target(resolution: int, factor: int, frames: int) -> tuple:
    """((h, w) pixels, (latent frames, h, w) latents) of a clip of `frames` frames at `resolution`p."""
    if frames < 1 or (frames - 1) % TEMPORAL:
        raise SystemExit(f"plan: --num_frames={frames}: Wan takes 4k + 1 frames (e.g. 81, 121)")
    h, w = plan_size(resolution, factor)
    return (h, w), (1 + (frames - 1) // TEMPORAL, h // factor, w // factor)


def plan_tokens(config, shapes) -> int:
    """The video tokens of the target's (frames, h, w) latents: one per (t, h, w) patch (1 x 2 x 2)."""
    return math.prod(n // p for n, p in zip(shapes[0], config["patch_size"]))


def example_inputs(config, batch: int, shapes, text_len: int, device, dtype) -> dict:
    """WanTransformer3DModel's forward kwargs as the pipelines pass them: the latents (B, C, T, H, W) (2.1 / A14B
    I2V: 36 channels, the noisy 16 + the first-frame mask 4 + its latents 16), the UMT5 text (B, text_len, 4096),
    the timestep σ·1000 (B,), or per token (B, tokens) for TI2V-5B (expand_timesteps: its 48-channel latents are the
    2.2 VAE's, which only it reads), and 2.1 I2V's CLIP image tokens (B, 257, 1280) where its config has image_dim."""
    t, h, w = shapes[0]
    x = torch.randn(batch, config["in_channels"], t, h, w, device=device, dtype=dtype)
    text = torch.randn(batch, text_len, config["text_dim"], device=device, dtype=dtype)
    per_token = config["in_channels"] == 48 and config.get("out_channels") == 48
    steps = (batch, plan_tokens(config, shapes)) if per_token else (batch,)
    out = dict(hidden_states=x, timestep=torch.rand(*steps, device=device, dtype=dtype) * 1000,
               encoder_hidden_states=text, return_dict=False)
    if config.get("image_dim"):
        out["encoder_hidden_states_image"] = torch.randn(batch, IMAGE_TOKENS, config["image_dim"], device=device,
                                                         dtype=dtype)
    return out


# FamilySpec(**PLAN): every built-in is a pipeline train_dmd.py alone trains, so --model=<name> plans DMD2
PLAN = dict(
    text_len=512,  # the pipelines' max_sequence_length: UMT5's text cut to its length, zero-padded to 512
    example_inputs=example_inputs,
    builtins={"wan2.1-t2v-1.3b": Builtin("WanPipeline"), "wan2.1-t2v-14b": Builtin("WanPipeline"),
              "wan2.1-i2v-14b": Builtin("WanImageToVideoPipeline"), "wan2.2-ti2v-5b": Builtin("WanPipeline"),
              "wan2.2-t2v-a14b": Builtin("WanPipeline"), "wan2.2-i2v-a14b": Builtin("WanImageToVideoPipeline")},
    plan_names={"WanPipeline": "wan", "WanImageToVideoPipeline": "wan_i2v"},
    plan_resolution=RESOLUTION, plan_frames=FRAMES, plan_target=plan_target, plan_tokens=plan_tokens)
