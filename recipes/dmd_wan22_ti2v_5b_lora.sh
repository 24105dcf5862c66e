#!/usr/bin/env bash
# Wan 2.2 TI2V-5B to a 4-step Wan by DMD2 on one 80 GB GPU, as a text-to-video teacher: a LoRA generator and a
# LoRA fake score of rank 64 on the bf16 teacher, AC, 81 frames at 480p (480 x 832), the 48-channel 2.2 VAE at
# 16x, per-token timesteps (WanPipeline's expand_timesteps), the teacher's CFG 5 (uncond + 5 (cond - uncond)), the
# 4 student steps at the σ list the export's scheduler makes at 4 steps with the teacher's flow_shift 5.
# `python tools/memory_plan.py --model=wan2.2-ti2v-5b --world_size=1 --lora_rank=64 --fake_lora=1
# --activation_checkpointing=1 --gpu_memory_gb=80` plans 48.1 GiB for training and 16.0 for the text-cache fill;
# at 720p (--resolution=720: 704 x 1280; here --resolution=704) 63.5 (docs/families/wan.md; planned, not measured).
# The export is a WanPipeline LoRA: from_pretrained(MODEL), load_lora_weights(export), the export's scheduler,
# num_inference_steps=4 (docs/families/wan.md).
#
#   MODEL=/models/Wan2.2-TI2V-5B-Diffusers DATA=/data/prompts.txt bash recipes/dmd_wan22_ti2v_5b_lora.sh
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:?set MODEL to a Wan 2.2 TI2V-5B diffusers folder (WanPipeline, expand_timesteps)}
DATA=${DATA:?set DATA to a .txt of prompts, or a .jsonl with "prompt"}
TEACHER_LORA=${TEACHER_LORA:-}
OUT=${OUT:-out/wan22_ti2v_5b_dmd_4step_lora}
TEXT_CACHE_DIR=${TEXT_CACHE_DIR:-$OUT/text_cache}  # share it between runs on the same prompts
export NPROC=${NPROC:-1}
exec bash run_fsdp.sh train_dmd.py --model_path="$MODEL" --teacher_lora="$TEACHER_LORA" --data_path="$DATA" \
    --output_dir="$OUT" --text_cache_dir="$TEXT_CACHE_DIR" --lora_rank=64 --lora_alpha=64 --fake_lora=1 \
    --generator_lr=5e-5 --guidance_lr=5e-5 --batch_size=1 --real_guidance_scale=5.0 \
    --dfake_gen_update_ratio=5 --conditioning_timestep=999 --denoising_steps=999,749,499,249 \
    --precision=bf16-mixed --fake_score_fp32=0 --activation_checkpointing=1 --export_dtype=bf16 --max_steps=4000 \
    --save_every=250 --sample_every=250 --log_every=10 --resume=auto "$@"
