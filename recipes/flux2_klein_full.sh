#!/usr/bin/env bash
# FLUX.2 [klein] base full fine-tune at 1024^2 with up to two reference images per sample on one 80 GB GPU, AC:
#   SIZE=4b (default): fp32 master weights and AdamW states, bf16 compute: 71.5 GiB planned
#   SIZE=9b: bf16 weights and states (fp32 ones do not fit one card): 77.9 GiB planned, tight on an 80 GB card
# `python tools/memory_plan.py --model=flux2-klein-4b --world_size=1 --resolution=1024 --activation_checkpointing=1
# --gpu_memory_gb=80`; the text-cache fill before training plans 14.6 (4B) / 23.2 GiB (9B) (docs/planner.md,
# "FLUX.2"; planned, not measured).
#
#   MODEL=/models/FLUX.2-klein-base-4B DATA=/data/edits.jsonl bash recipes/flux2_klein_full.sh
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:?set MODEL to a FLUX.2 [klein] diffusers folder (Flux2KleinPipeline layout)}
DATA=${DATA:?set DATA to the samples: a .jsonl with "control" lists, or a folder layout}
SIZE=${SIZE:-4b}
OUT=${OUT:-out/flux2_klein_full}
CONTROL=${CONTROL_PATH:+--control_path=$CONTROL_PATH}
export NPROC=${NPROC:-1}
case "$SIZE" in
    4b) PRECISION=bf16-mixed ;;
    9b) PRECISION=bf16 ;;
    *) echo "SIZE=$SIZE: 4b or 9b" >&2; exit 2 ;;
esac
exec bash run_fsdp.sh train_flux_kontext.py --model_path="$MODEL" --data_path="$DATA" ${CONTROL} --output_dir="$OUT" \
    --lr=1e-5 --weight_decay=1e-4 --warmup_steps=50 --resolution=1024 --max_references=2 --max_sequence_length=512 \
    --precision="$PRECISION" --activation_checkpointing=1 --batch_size=1 --export_dtype=bf16 --sample_guidance=4.0 \
    --max_steps=2000 --sample_every=250 --save_every=250 --log_every=10 --resume=auto "$@"
