#!/usr/bin/env bash
# FLUX.2 klein-base (4B, or 9B) to a 4-step klein by DMD2, as BFL ships its distilled klein: 1024^2, rows with
# references (or a .txt of prompts: text to image), a LoRA generator and a LoRA fake score of rank 64, every
# base and the teacher in NF4, AC, a bf16 fake score; the teacher's real score with true CFG 4 (the pipeline's
# default) against "", rescaled per token (REAL_GUIDANCE_NORM, the measured choice; none = the pipeline's
# plain CFG); the generator and the fake score without guidance.
# `python tools/memory_plan.py --model=flux2-klein-4b-dmd --world_size=1 --resolution=1024
# --activation_checkpointing=1 --fake_score_fp32=0 --lora_rank=64 --fake_lora=1 --base_dtype=nf4
# --gpu_memory_gb=24` plans 13.0 GiB for training and 14.6 for the text-cache fill before it on one 24 GB GPU;
# NPROC=8 (8 x 24 GB): 6.4 and 9.1 (docs/planner.md, "FLUX.2"; planned, not measured). The export is a
# Flux2KleinPipeline LoRA: from_pretrained(MODEL, is_distilled=True), load_lora_weights(export), the export's
# scheduler, num_inference_steps=4 (docs/families/flux2.md). NF4 needs torchao (pip install torchao).
#
# TEACHER_LORA: a LoRA fine-tune of MODEL (recipes/flux2_klein_lora.sh's export/, or another tool's klein LoRA)
# is the teacher and where both students start, merged as the weights load (an NF4-trained LoRA too); the
# export's LoRA file then holds the fine-tune's adapters and the student's, and loads on MODEL alone. A full
# fine-tune: its export/ as MODEL. MODEL is klein-base: a distilled klein (is_distilled) is refused.
#
#   MODEL=/models/FLUX.2-klein-base-4B DATA=/data/edits.jsonl bash recipes/dmd_flux2_klein_4step_lora.sh
#   NPROC=8 MODEL=/models/FLUX.2-klein-base-4B DATA=/data/prompts.txt bash recipes/dmd_flux2_klein_4step_lora.sh
#   MODEL=/models/FLUX.2-klein-base-4B DATA=/data/edits.jsonl TEACHER_LORA=out/flux2_klein_lora/export \
#       bash recipes/dmd_flux2_klein_4step_lora.sh
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:?set MODEL to a FLUX.2 klein-base diffusers folder (Flux2KleinPipeline layout)}
DATA=${DATA:?set DATA to edit rows with "control" image(s) and a "prompt", or a .txt of prompts}
TEACHER_LORA=${TEACHER_LORA:-}
OUT=${OUT:-out/flux2_klein_dmd_4step_lora}
TEXT_CACHE_DIR=${TEXT_CACHE_DIR:-$OUT/text_cache}  # share it between runs on the same rows
export NPROC=${NPROC:-1}
exec bash run_fsdp.sh train_dmd.py --model_path="$MODEL" --teacher_lora="$TEACHER_LORA" --data_path="$DATA" \
    --output_dir="$OUT" \
    --text_cache_dir="$TEXT_CACHE_DIR" --lora_rank=64 --lora_alpha=64 --fake_lora=1 --base_dtype=nf4 \
    --generator_lr=5e-5 --guidance_lr=5e-5 --batch_size=1 --resolution=1024 --real_guidance_scale=4.0 \
    --real_guidance_norm=token --dfake_gen_update_ratio=5 --conditioning_timestep=999 \
    --denoising_steps=999,749,499,249 --precision=bf16-mixed --fake_score_fp32=0 --activation_checkpointing=1 \
    --export_dtype=bf16 --max_steps=4000 --save_every=250 --sample_every=250 --log_every=10 --resume=auto "$@"
