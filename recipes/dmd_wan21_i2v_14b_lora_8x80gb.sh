#!/usr/bin/env bash
# Wan 2.1 I2V-14B to a 4-step image-to-video Wan by DMD2 on 8 x 80 GB: a LoRA generator and a LoRA fake score of
# rank 64 on the bf16 teacher, AC, 81 frames at 480p from each row's first image (the 36-channel input: the noisy
# latents, the first-frame mask and the first frame's latents; CLIP image tokens cached beside the text), the
# teacher's CFG 5 (WanImageToVideoPipeline's guidance_scale), without context parallelism (the planner fits it
# without): `python tools/memory_plan.py --model=wan2.1-i2v-14b --world_size=8 --lora_rank=64 --fake_lora=1
# --activation_checkpointing=1 --gpu_memory_gb=80` plans 38.1 GiB per GPU (planned, not measured).
# DATA: a .jsonl of {"control": first image, "prompt": ...} rows, or the folder layout (docs/data.md).
# The export is a WanImageToVideoPipeline LoRA: load_lora_weights(export) on MODEL, the export's scheduler,
# 4 steps (docs/families/wan.md).
#
#   MODEL=/models/Wan2.1-I2V-14B-480P-Diffusers DATA=/data/i2v.jsonl bash recipes/dmd_wan21_i2v_14b_lora_8x80gb.sh
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:?set MODEL to a Wan 2.1 I2V-14B diffusers folder (WanImageToVideoPipeline layout)}
DATA=${DATA:?set DATA to a .jsonl with "control" (the first image) and "prompt", or the folder layout}
TEACHER_LORA=${TEACHER_LORA:-}
OUT=${OUT:-out/wan21_i2v_14b_dmd_4step_lora}
TEXT_CACHE_DIR=${TEXT_CACHE_DIR:-$OUT/text_cache}
export NPROC=${NPROC:-8}
exec bash run_fsdp.sh train_dmd.py --model_path="$MODEL" --teacher_lora="$TEACHER_LORA" --data_path="$DATA" \
    --output_dir="$OUT" --text_cache_dir="$TEXT_CACHE_DIR" --lora_rank=64 --lora_alpha=64 --fake_lora=1 \
    --generator_lr=5e-5 --guidance_lr=5e-5 --batch_size=1 --real_guidance_scale=5.0 \
    --dfake_gen_update_ratio=5 --conditioning_timestep=999 --denoising_steps=999,749,499,249 \
    --precision=bf16-mixed --fake_score_fp32=0 --activation_checkpointing=1 --export_dtype=bf16 --max_steps=4000 \
    --save_every=250 --sample_every=250 --log_every=10 --resume=auto "$@"
