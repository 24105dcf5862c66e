"""The Z-Image family in the GPU check (families/gpu.GpuCheck): Z-Image's transformer at real width (3840, 30 heads)
with fewer main and refiner blocks beside its real VAE (FLUX.1's AutoencoderKL) and a narrow Qwen3 of the real width
(random weights); at 1024 x 1024 a text-to-image LoRA fine-tune as recipes/z_image_t2i_lora.sh runs it and DMD2 to a
4-step LoRA student, each saved, resumed, exported and the export sampled by ZImagePipeline as users load it.

    bash tools/gpu_check.sh --suite=z_image --skip_tests --out=$OUT      # on a GPU (docs/gpu.md)
    python tools/gpu_check.py --tiny --cpu --suite=z_image               # the tiny Z-Image on CPU: 32 px
    python -m pytest tests/test_gpu_check.py -q -k z_image
"""
from __future__ import annotations

import json
import os

from families.gpu import GpuCheck, export_pipeline, qwen3_config_at_real_width, true_cfg_calls

SAMPLES = 24  # the rows' prompts (and images): each launch encodes all of them into its text cache
TINY_SAMPLES = 8  # the tiny rows': 4 to train on beside the 4 the fine-tune holds out for samples
# a prompt of at least this many words is cut at MAX_SEQUENCE_LENGTH by any tokenizer (a word is a token at least):
# the rows' text then has the length the planner plans (the spec's 512), not a short prompt's
PROMPT_WORDS = 600
FT_GUIDANCE = 4.0  # the fine-tune export's samples: recipes/z_image_t2i_lora.sh's SAMPLE_GUIDANCE, true CFG


def _vae(tiny: str, real: str):
    from diffusers import AutoencoderKL
    return AutoencoderKL.from_config(AutoencoderKL.load_config(os.path.join(real, "vae")))


def _text_encoder(tiny: str, real: str):
    from transformers import Qwen3Config, Qwen3Model
    # the tiny's 2 layers (the pipeline reads hidden_states[-2]) at 2560, the transformer's cap_feat_dim
    with open(os.path.join(tiny, "text_encoder", "config.json")) as f:
        return Qwen3Model(Qwen3Config.from_dict(qwen3_config_at_real_width(json.load(f), real)))


def long_prompt(prompt: str) -> str:
    """`prompt` repeated to PROMPT_WORDS words at least."""
    words = prompt.split()
    return " ".join(words * -(-PROMPT_WORDS // len(words)))


def data(root: str, size: int, tiny: bool, script: str) -> str:
    """The rows' data (GpuCheck.data): DMD2's prompts .txt, the fine-tune's text-to-image rows ("image" + "prompt",
    `size` px coloured shapes) as data.jsonl; every prompt PROMPT_WORDS long, so the text is MAX_SEQUENCE_LENGTH
    tokens, as the planner and the plain reference count it."""
    from families.tiny.data import make_image_prompt_dataset, make_prompts_file
    n, suffix = (TINY_SAMPLES, "_tiny") if tiny else (SAMPLES, "")
    if script == "train_dmd.py":
        path = os.path.join(root, f"z_image_prompts{suffix}.txt")
        if not os.path.exists(path):
            make_prompts_file(path, n)
            with open(path) as f:
                prompts = f.read().splitlines()
            with open(path, "w") as f:
                f.write("".join(long_prompt(p) + "\n" for p in prompts))
        return path
    folder = os.path.join(root, f"z_image_t2i_{size}{suffix}")
    path = os.path.join(folder, "data.jsonl")
    if not os.path.isdir(folder):
        make_image_prompt_dataset(folder, n, size=size)
        with open(path) as f:
            rows = [json.loads(line) for line in f]
        with open(path, "w") as f:
            f.write("".join(json.dumps({**r, "prompt": long_prompt(r["prompt"])}) + "\n" for r in rows))
    return path


def reference_shape(folder, data, settings):
    """(the text at the run's length: the rows' prompts fill MAX_SEQUENCE_LENGTH, no references: text to image)."""
    return int(settings["extra"].get("max_sequence_length", 512)), ()


def first_prompt(data: str) -> str:
    with open(data) as f:
        line = f.readline()
    return json.loads(line)["prompt"] if data.endswith(".jsonl") else line.strip()


def export_samples(export: str, base: str, s: dict, data: str) -> bool:
    """A row's LoRA export sampled as docs/families/z_image.md loads it: ZImagePipeline.from_pretrained(base),
    load_lora_weights(export), 4 steps at the row's size on the first prompt. The fine-tune's with its true CFG
    (guidance_scale FT_GUIDANCE, the base's scheduler); DMD2's without CFG (guidance_scale=0) on the export's
    scheduler, the transformer seeing the trained σ list (as 1 - σ, the timestep the pipeline passes). Passes when the
    image is finite and of the row's size, the adapters are in the transformer, and it saw 4 timesteps (DMD2: the
    trained ones)."""
    import numpy as np
    import torch
    from diffusers import ZImagePipeline

    from algorithms.dmd2_flow import timestep_sigmas
    pipe, seen = export_pipeline(ZImagePipeline, export, base, s)
    side, dmd = s["resolution"], "denoising_steps" in s["extra"]
    with torch.no_grad():
        images = pipe(prompt=first_prompt(data), height=side, width=side, num_inference_steps=4,
                      guidance_scale=0.0 if dmd else FT_GUIDANCE, output_type="np",
                      generator=torch.Generator().manual_seed(0),
                      max_sequence_length=int(s["extra"].get("max_sequence_length", 512))).images
    adapters = any(".lora_A." in n for n, _ in pipe.transformer.named_parameters())
    finite, shape = bool(np.isfinite(images).all()), tuple(images.shape)
    trained = [1 - x for x in timestep_sigmas(str(s["extra"]["denoising_steps"]).split(","))] if dmd else None
    print(f"export sampled in 4 steps{' without CFG' if dmd else f' at CFG {FT_GUIDANCE}'}: {shape} image, "
          f"timesteps seen {[round(t, 4) for t in seen]}" + (f", trained {trained}" if dmd else "")
          + f", adapters {adapters}, finite {finite}", flush=True)
    steps = len(seen) == 4 and (not dmd or all(abs(a - b) < 1e-3 for a, b in zip(seen, trained)))
    return finite and shape == (1, side, side, 3) and adapters and steps


# text-to-image LoRA as recipes/z_image_t2i_lora.sh runs it (rank 64, alpha 64, gaussian init, AC, bf16 export)
Z_IMAGE_LORA = {"lora_alpha": 64, "lora_init": "gaussian", "lr": 1e-4, "warmup_steps": 0}
# DMD2 of the base teacher to 4 steps as recipes/dmd_z_image_8step_lora.sh runs it (a LoRA r64 generator and fake
# score, the teacher's CFG 5 as one batch of 2, the family's DMD_LOSS: decoupled), with a bf16 base (the recipe's
# NF4 base is the 24 GB card's choice)
Z_IMAGE_DMD = {"denoising_steps": "999,749,499,249", "conditioning_timestep": 999, "fake_score_fp32": 0,
               "lora_alpha": 64, "fake_lora": 1, "generator_lr": 5e-5, "guidance_lr": 5e-5, "real_guidance_scale": 5.0}


def suite(row, tiny: bool) -> list:
    """--suite=z_image: at 1024 x 1024 (4096 image tokens + the 512 of the text; tiny: 32 px, 32 tokens of text), the
    text-to-image LoRA fine-tune and DMD2 to a 4-step LoRA student, each with AC, saved, resumed, exported and the
    export sampled in 4 steps; each beside the plain reference of its transformer (the teacher's CFG pair and the
    frozen-weight backward among its calls) and the planner's peak."""
    side = 32 if tiny else 1024
    text = {"max_sequence_length": 32} if tiny else {}
    return [row(f"z_image_{side}px_t2i_lora64_ac", "train_flux_kontext.py", "z_image", side, 90, ac=True,
                lora_rank=64, resume=True, export_dtype="bf16", extra={**Z_IMAGE_LORA, **text}),
            row(f"dmd_z_image_{side}px_4step_lora64_ac", "train_dmd.py", "z_image", side, 130, ac=True,
                lora_rank=64, resume=True, export_dtype="bf16", ref=True, extra={**Z_IMAGE_DMD, **text})]


GPU = GpuCheck(suite=suite, label="Z-Image", configs="z-image",
               parts=(("vae", _vae), ("text_encoder", _text_encoder)), keep=("tokenizer", "scheduler"),
               reference_shape=reference_shape, dmd_calls=true_cfg_calls, data=data,
               blocks=("n_layers", "n_refiner_layers"), default_blocks=(2, 1), data_references=0,
               reference_note=", text to image", true_cfg=True, export_loads=export_samples,
               encodes_target=False)  # DMD2 of text to image encodes nothing (the LoRA fine-tune's row has no V column)
