#!/usr/bin/env bash
# Qwen-Image-Edit-2509 / 2511 full fine-tune at 1024^2 with up to three reference images per sample on
# 8 x 80 GB: the 20 B transformer sharded per block over 8 GPUs, fp32 master weights and AdamW states,
# bf16 compute, AC. `python tools/memory_plan.py --model=qwen-image-edit --world_size=8 --resolution=1024
# --activation_checkpointing=1 --gpu_memory_gb=80` plans 48.4 GiB per GPU (docs/planner.md); without
# AC it does not fit.
#
#   MODEL=/models/Qwen-Image-Edit-2509 DATA=/data/edits.jsonl bash recipes/qwen_edit_full_8x80gb.sh
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:?set MODEL to a Qwen-Image-Edit-2509/2511 diffusers folder (QwenImageEditPlusPipeline layout)}
DATA=${DATA:?set DATA to the samples: a .jsonl with "control" lists, or a folder layout}
OUT=${OUT:-out/qwen_edit_full}
CONTROL=${CONTROL_PATH:+--control_path=$CONTROL_PATH}
export NPROC=${NPROC:-8}
exec bash run_fsdp.sh train_flux_kontext.py --model_path="$MODEL" --data_path="$DATA" ${CONTROL} --output_dir="$OUT" \
    --lr=1e-5 --weight_decay=1e-4 --warmup_steps=50 --resolution=1024 --precision=bf16-mixed \
    --activation_checkpointing=1 --batch_size=1 --ema_decay=0.999 --export_dtype=bf16 \
    --sample_guidance=4.0 --max_steps=2000 --sample_every=250 --save_every=250 --log_every=10 --resume=auto "$@"
