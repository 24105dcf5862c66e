#!/usr/bin/env bash
# A Qwen-Image-Edit-Lightning-style 4-step editor: DMD2 of Qwen-Image-Edit-2509 / 2511 with the settings
# of the published 2511 Lightning recipe (Qwen-Image-Lightning issue 86): 1024^2, a LoRA generator of
# rank 64, alpha 8, LR 5e-5; a full-parameter fake score ("critic") at LR 4e-7; CFG 1 for the generator
# (backward simulation included) and the fake score; the teacher's real score with true CFG 4 (the
# pipeline's default) against the negative prompt, rescaled per token as the pipeline does (REAL_GUIDANCE_NORM,
# docs/demos.md's measurement). bf16 teacher and bases, AC, bf16 fake score.
# `python tools/memory_plan.py --model=qwen-image-edit-dmd --world_size=8 --resolution=1024
# --activation_checkpointing=1 --fake_score_fp32=0 --lora_rank=64 --lora_alpha=8 --gpu_memory_gb=80`
# plans 58.1 GiB per GPU on 8 x 80 GB. NF4=1: the 8 x 24 GB row instead, a LoRA fake score too and every
# base and the teacher in NF4 (plans 11.6 GiB). Rows are read as train_flux_kontext.py reads them (1-3
# references each, at the pipeline's sizes; one shape per global batch).
#
# TEACHER_LORA: a LoRA fine-tune of MODEL (recipes/qwen_edit_lora.sh's export/) is the teacher and where both
# students start, merged as the weights load (an NF4-trained LoRA too); the export's LoRA file then holds the
# fine-tune's adapters and the student's, and loads on MODEL alone. A full fine-tune: its export/ as MODEL.
# The teacher's real score is sampled as the pipeline samples it (true CFG 4 against " "); a fine-tune you
# sample without CFG wants REAL_GUIDANCE_SCALE=1 (add --real_guidance_scale=1).
#
#   MODEL=/models/Qwen-Image-Edit-2509 DATA=/data/edits.jsonl bash recipes/dmd_qwen_edit_4step_lora.sh
#   MODEL=/models/Qwen-Image-Edit-2509 DATA=/data/edits.jsonl TEACHER_LORA=out/qwen_edit_lora/export \
#       bash recipes/dmd_qwen_edit_4step_lora.sh
# NF4 (BASE_DTYPE=nf4) needs torchao: pip install torchao (requirements-dev.txt pins the tested version).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:?set MODEL to a Qwen-Image-Edit-2509/2511 diffusers folder (QwenImageEditPlusPipeline layout)}
DATA=${DATA:?set DATA to edit rows with "control" image(s) and a "prompt": a .jsonl, a folder layout or datasets}
NF4=${NF4:-0}
TEACHER_LORA=${TEACHER_LORA:-}
OUT=${OUT:-out/qwen_edit_dmd_4step_lora}
TEXT_CACHE_DIR=${TEXT_CACHE_DIR:-$OUT/text_cache}  # share it between runs on the same rows
export NPROC=${NPROC:-8}
if [ "$NF4" = 1 ]; then
    FAKE=(--fake_lora=1 --base_dtype=nf4 --guidance_lr=5e-5)
else
    FAKE=(--fake_lora=0 --guidance_lr=4e-7)
fi
exec bash run_fsdp.sh train_dmd.py --model_path="$MODEL" --teacher_lora="$TEACHER_LORA" --data_path="$DATA" \
    --output_dir="$OUT" \
    --text_cache_dir="$TEXT_CACHE_DIR" "${FAKE[@]}" \
    --lora_rank=64 --lora_alpha=8 --lora_init=default --generator_lr=5e-5 --batch_size=1 \
    --resolution=1024 --real_guidance_scale=4.0 --real_guidance_norm=token --dfake_gen_update_ratio=5 \
    --conditioning_timestep=999 --denoising_steps=999,749,499,249 \
    --precision=bf16-mixed --fake_score_fp32=0 --activation_checkpointing=1 \
    --export_dtype=bf16 --max_steps=4000 --save_every=250 --sample_every=250 --log_every=10 --resume=auto "$@"
