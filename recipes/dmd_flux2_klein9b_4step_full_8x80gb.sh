#!/usr/bin/env bash
# FLUX.2 klein-base-9B to a 4-step klein by DMD2 with a full generator and a full fake score (bf16 compute),
# a bf16 teacher, AC, 1024^2, on 8 x 80 GB; the teacher's true CFG 4 against "", rescaled per token.
# `python tools/memory_plan.py --model=flux2-klein-9b-dmd --world_size=8 --resolution=1024
# --activation_checkpointing=1 --fake_score_fp32=0 --gpu_memory_gb=80` plans 47.0 GiB per GPU (the text-cache
# fill before it 12.9; planned, not measured). The export is a Flux2KleinPipeline folder with is_distilled:
# from_pretrained(export)(prompt, image=[...], num_inference_steps=4).
#
#   MODEL=/models/FLUX.2-klein-base-9B DATA=/data/edits.jsonl bash recipes/dmd_flux2_klein9b_4step_full_8x80gb.sh
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:?set MODEL to a FLUX.2 klein-base diffusers folder (Flux2KleinPipeline layout)}
DATA=${DATA:?set DATA to edit rows with "control" image(s) and a "prompt", or a .txt of prompts}
OUT=${OUT:-out/flux2_klein9b_dmd_4step}
TEXT_CACHE_DIR=${TEXT_CACHE_DIR:-$OUT/text_cache}
export NPROC=${NPROC:-8}
exec bash run_fsdp.sh train_dmd.py --model_path="$MODEL" --data_path="$DATA" --output_dir="$OUT" \
    --text_cache_dir="$TEXT_CACHE_DIR" --generator_lr=2e-6 --guidance_lr=2e-6 --batch_size=1 --resolution=1024 \
    --real_guidance_scale=4.0 --real_guidance_norm=token --dfake_gen_update_ratio=5 --conditioning_timestep=999 \
    --denoising_steps=999,749,499,249 --precision=bf16-mixed --fake_score_fp32=0 --activation_checkpointing=1 \
    --export_dtype=bf16 --max_steps=4000 --save_every=250 --sample_every=250 --log_every=10 --resume=auto "$@"
