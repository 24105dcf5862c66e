"""The FLUX.2 family in the GPU check (families/gpu.GpuCheck): klein-base-4B's transformer at real width with fewer
double + single blocks beside its real VAE and a narrow Qwen3 of the real width (random weights), DMD2 on edits
with one reference, the teacher's true-CFG pair timed apart, the export sampled in 4 steps.

    python -m pytest tests/test_gpu_check.py -q -m "not slow"
"""
from __future__ import annotations

import json
import os

from families.gpu import GpuCheck, export_pipeline, qwen3_config_at_real_width, true_cfg_calls


def _vae(tiny: str, real: str):
    from diffusers import AutoencoderKLFlux2
    return AutoencoderKLFlux2.from_config(AutoencoderKLFlux2.load_config(os.path.join(real, "vae")))


def _text_encoder(tiny: str, real: str):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    # the tiny klein's 28 layers (the pipeline stacks the hidden states of layers 9, 18 and 27), 3 x 2560 wide
    with open(os.path.join(tiny, "text_encoder", "config.json")) as f:
        return Qwen3ForCausalLM(Qwen3Config.from_dict(qwen3_config_at_real_width(json.load(f), real)))


def reference_shape(folder, data, settings):
    """(the text padded to the run's length, the pairs' one context at the target's size)."""
    return int(settings["extra"].get("max_sequence_length", 512)), (settings["resolution"],)


def export_samples(export: str, base: str, s: dict, data: str) -> bool:
    """A klein DMD2 export sampled as BFL's distilled klein is: the full export's Flux2KleinPipeline, or the base
    folder with is_distilled=True, load_lora_weights and the export's scheduler; 4 steps at the row's size on the
    first pair's context and prompt. Passes when the image is finite and the transformer saw the trained σ list."""
    import numpy as np
    import torch
    from diffusers import Flux2KleinPipeline
    from PIL import Image

    from algorithms.dmd2_flow import timestep_sigmas
    pipe, seen = export_pipeline(Flux2KleinPipeline, export, base, s, is_distilled=True)
    with open(data) as f:
        row = json.loads(f.readline())
    context = Image.open(os.path.join(os.path.dirname(data), row["image"])).convert("RGB")
    side = s["resolution"]
    images = pipe(image=[context], prompt=row["prompt"], num_inference_steps=4, height=side, width=side,
                  output_type="np", generator=torch.Generator().manual_seed(0),
                  max_sequence_length=int(s["extra"].get("max_sequence_length", 512))).images
    trained = timestep_sigmas(str(s["extra"]["denoising_steps"]).split(","))
    finite = bool(np.isfinite(images).all())
    print(f"export sampled in 4 steps: σ seen {seen}, trained {trained}, finite {finite}", flush=True)
    return finite and len(seen) == len(trained) and all(abs(a - b) < 1e-3 for a, b in zip(seen, trained))


# DMD2 with a klein-base teacher as recipes/dmd_flux2_klein_4step_lora.sh runs it, with bf16 bases and a full fake
# score (the recipe's NF4 bases and LoRA fake score are the 24 GB card's choice)
KLEIN_DMD = {"denoising_steps": "999,749,499,249", "fake_score_fp32": 0, "lora_alpha": 64, "generator_lr": 5e-5,
             "guidance_lr": 5e-5, "real_guidance_scale": 4.0, "real_guidance_norm": "token"}


def suite(row, tiny: bool) -> list:
    """--suite=flux2: klein-base DMD2, a LoRA r64 generator, the full fake score, the teacher's true CFG 4 with
    the token rescale, AC; saved, resumed and exported at 512 px (the export sampled in 4 steps), timed at 1024."""
    klein = {**KLEIN_DMD, **({"max_sequence_length": 32} if tiny else {})}
    lo, hi = (64, 64) if tiny else (512, 1024)  # Flux2ImageProcessor refuses a reference under 64 px
    return [row(f"dmd_flux2_klein_{lo}px_4step_lora64_ac", "train_dmd.py", "flux2", lo, 170, ac=True, lora_rank=64,
                resume=True, export_dtype="bf16", extra=klein),
            row(f"dmd_flux2_klein_{hi}px_4step_lora64_ac_timed", "train_dmd.py", "flux2", hi, 120, ac=True,
                lora_rank=64, export_dtype="bf16", extra=klein)]


GPU = GpuCheck(suite=suite, label="FLUX.2 klein", configs="flux2-klein-4b",
               parts=(("vae", _vae), ("text_encoder", _text_encoder)), keep=("tokenizer", "scheduler"),
               reference_shape=reference_shape, dmd_calls=true_cfg_calls,
               blocks=("num_layers", "num_single_layers"), default_blocks=(2, 4),
               reference_note=", target + 1 reference", true_cfg=True, export_loads=export_samples,
               encodes_target=False)  # the rows are DMD2's: the generator makes the target
