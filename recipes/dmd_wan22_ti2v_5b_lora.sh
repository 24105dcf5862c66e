#!/usr/bin/env bash
# Wan 2.2 TI2V-5B to a 4-step Wan by DMD2 on one 80 GB GPU: a LoRA generator and a LoRA fake score of rank 64 on
# the bf16 teacher, AC, 81 frames, the 48-channel 2.2 VAE at 16x, per-token timesteps (the first frame's at 0
# with an image), the teacher's CFG 5.
# `python tools/memory_plan.py --model=wan2.2-ti2v-5b --world_size=1 --lora_rank=64 --fake_lora=1
# --activation_checkpointing=1 --gpu_memory_gb=80` plans 45.8 GiB at 480p (text-cache fill 16.0)
# and 60.9 at 720p (704 x 1280, --resolution=720; planned, not measured).
# The export is a WanPipeline LoRA: load_lora_weights(export) on MODEL, 4 steps (docs/families/wan.md).
#
#   MODEL=/models/Wan2.2-TI2V-5B-Diffusers DATA=/data/prompts.txt bash recipes/dmd_wan22_ti2v_5b_lora.sh
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:?set MODEL to a Wan 2.2 TI2V-5B diffusers folder (WanPipeline, expand_timesteps)}
DATA=${DATA:?set DATA to a .txt of prompts, or a .jsonl with "prompt" (and "image" for image to video)}
TEACHER_LORA=${TEACHER_LORA:-}
OUT=${OUT:-out/wan22_ti2v_5b_dmd_4step_lora}
TEXT_CACHE_DIR=${TEXT_CACHE_DIR:-$OUT/text_cache}
export NPROC=${NPROC:-1}
exec bash run_fsdp.sh train_dmd.py --model_path="$MODEL" --teacher_lora="$TEACHER_LORA" --data_path="$DATA" \
    --output_dir="$OUT" --text_cache_dir="$TEXT_CACHE_DIR" --lora_rank=64 --lora_alpha=64 --fake_lora=1 \
    --generator_lr=5e-5 --guidance_lr=5e-5 --batch_size=1 --real_guidance_scale=5.0 \
    --dfake_gen_update_ratio=5 --conditioning_timestep=999 --denoising_steps=999,749,499,249 \
    --precision=bf16-mixed --fake_score_fp32=0 --activation_checkpointing=1 --export_dtype=bf16 --max_steps=4000 \
    --save_every=250 --sample_every=250 --log_every=10 --resume=auto "$@"
