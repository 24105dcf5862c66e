#!/usr/bin/env bash
# FLUX.2 [dev] (32 B) full fine-tune at 1024^2 with up to two reference images per sample on 8 x 80 GB: the
# transformer sharded per block over 8 GPUs with bf16 weights and AdamW states (fp32 master weights and states
# do not fit), AC. `python tools/memory_plan.py --model=flux2-dev --world_size=8 --resolution=1024 --precision=bf16
# --activation_checkpointing=1 --gpu_memory_gb=80` plans 50.2 GiB per GPU for training and 18.4 for the
# text-cache fill before it (docs/planner.md, "FLUX.2"; planned, not measured).
#
#   MODEL=/models/FLUX.2-dev DATA=/data/edits.jsonl bash recipes/flux2_dev_full_8x80gb.sh
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:?set MODEL to a FLUX.2 [dev] diffusers folder (Flux2Pipeline layout)}
DATA=${DATA:?set DATA to the samples: a .jsonl with "control" lists, or a folder layout}
OUT=${OUT:-out/flux2_dev_full}
CONTROL=${CONTROL_PATH:+--control_path=$CONTROL_PATH}
export NPROC=${NPROC:-8}
exec bash run_fsdp.sh train_flux_kontext.py --model_path="$MODEL" --data_path="$DATA" ${CONTROL} --output_dir="$OUT" \
    --lr=1e-5 --weight_decay=1e-4 --warmup_steps=50 --resolution=1024 --max_references=2 --max_sequence_length=512 \
    --precision=bf16 --activation_checkpointing=1 --batch_size=1 --export_dtype=bf16 --sample_guidance=4.0 \
    --max_steps=2000 --sample_every=250 --save_every=250 --log_every=10 --resume=auto "$@"
