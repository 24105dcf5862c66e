#!/usr/bin/env bash
# Wan 2.1 T2V-14B to a 4-step Wan by DMD2 on 8 x 80 GB: a LoRA generator and a LoRA fake score of rank 64 on the
# bf16 teacher, AC, 81 frames at 480p (32,760 video tokens), the teacher's CFG 5 (WanPipeline's guidance_scale),
# without context parallelism, which the planner does not need here (its --cp_table: CP 8 fits without AC, 58.8):
# `python tools/memory_plan.py --model=wan2.1-t2v-14b --world_size=8 --lora_rank=64 --fake_lora=1
# --activation_checkpointing=1 --gpu_memory_gb=80` plans 36.0 GiB per GPU (the text-cache fill 9.4; planned,
# not measured); at 720p (--resolution=720) 64.8.
# The export is a WanPipeline LoRA: load_lora_weights(export) on MODEL, 4 steps (docs/families/wan.md).
#
#   MODEL=/models/Wan2.1-T2V-14B-Diffusers DATA=/data/prompts.txt bash recipes/dmd_wan21_t2v_14b_lora_8x80gb.sh
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:?set MODEL to a Wan 2.1 T2V-14B diffusers folder (WanPipeline layout)}
DATA=${DATA:?set DATA to a .txt of prompts, or a .jsonl with "prompt"}
TEACHER_LORA=${TEACHER_LORA:-}
OUT=${OUT:-out/wan21_t2v_14b_dmd_4step_lora}
TEXT_CACHE_DIR=${TEXT_CACHE_DIR:-$OUT/text_cache}
export NPROC=${NPROC:-8}
exec bash run_fsdp.sh train_dmd.py --model_path="$MODEL" --teacher_lora="$TEACHER_LORA" --data_path="$DATA" \
    --output_dir="$OUT" --text_cache_dir="$TEXT_CACHE_DIR" --lora_rank=64 --lora_alpha=64 --fake_lora=1 \
    --generator_lr=5e-5 --guidance_lr=5e-5 --batch_size=1 --real_guidance_scale=5.0 \
    --dfake_gen_update_ratio=5 --conditioning_timestep=999 --denoising_steps=999,749,499,249 \
    --precision=bf16-mixed --fake_score_fp32=0 --activation_checkpointing=1 --export_dtype=bf16 --max_steps=4000 \
    --save_every=250 --sample_every=250 --log_every=10 --resume=auto "$@"
