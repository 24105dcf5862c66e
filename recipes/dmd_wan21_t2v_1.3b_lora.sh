#!/usr/bin/env bash
# Wan 2.1 T2V-1.3B to a 4-step Wan by DMD2: a LoRA generator and a LoRA fake score of rank 64 on the bf16
# teacher, AC, 81 frames at 480p (the family's defaults), the teacher's CFG 5 (WanPipeline's guidance_scale:
# uncond + 5 (cond - uncond)), the generator and the fake score without guidance, the 4 student steps at the
# σ list the export's scheduler makes at 4 steps (docs/families/wan.md).
# `python tools/memory_plan.py --model=wan2.1-t2v-1.3b --world_size=1 --lora_rank=64 --fake_lora=1
# --activation_checkpointing=1 --gpu_memory_gb=24` plans 18.3 GiB for training and 16.0 for the text-cache
# fill before it on one 24 GB GPU;
# NPROC=8 (8 x 24 GB): 9.1 and 9.4 (docs/families/wan.md, "What fits"; planned, not measured).
# The export is a WanPipeline LoRA: from_pretrained(MODEL), load_lora_weights(export), the export's scheduler,
# num_inference_steps=4 (docs/families/wan.md).
#
#   MODEL=/models/Wan2.1-T2V-1.3B-Diffusers DATA=/data/prompts.txt bash recipes/dmd_wan21_t2v_1.3b_lora.sh
#   NPROC=8 MODEL=/models/Wan2.1-T2V-1.3B-Diffusers DATA=/data/prompts.txt bash recipes/dmd_wan21_t2v_1.3b_lora.sh
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:?set MODEL to a Wan 2.1 T2V-1.3B diffusers folder (WanPipeline layout)}
DATA=${DATA:?set DATA to a .txt of prompts, or a .jsonl with "prompt"}
TEACHER_LORA=${TEACHER_LORA:-}
OUT=${OUT:-out/wan21_t2v_1.3b_dmd_4step_lora}
TEXT_CACHE_DIR=${TEXT_CACHE_DIR:-$OUT/text_cache}  # share it between runs on the same prompts
export NPROC=${NPROC:-1}
exec bash run_fsdp.sh train_dmd.py --model_path="$MODEL" --teacher_lora="$TEACHER_LORA" --data_path="$DATA" \
    --output_dir="$OUT" --text_cache_dir="$TEXT_CACHE_DIR" --lora_rank=64 --lora_alpha=64 --fake_lora=1 \
    --generator_lr=5e-5 --guidance_lr=5e-5 --batch_size=1 --real_guidance_scale=5.0 \
    --dfake_gen_update_ratio=5 --conditioning_timestep=999 --denoising_steps=999,749,499,249 \
    --precision=bf16-mixed --fake_score_fp32=0 --activation_checkpointing=1 --export_dtype=bf16 --max_steps=4000 \
    --save_every=250 --sample_every=250 --log_every=10 --resume=auto "$@"
