#!/usr/bin/env bash
# FLUX.1 Kontext [dev] LoRA, with the settings of diffusers' Kontext LoRA example
# (examples/dreambooth/train_dreambooth_lora_flux_kontext.py): --learning_rate 1e-4, --adam_weight_decay
# 1e-4, constant LR after warmup, the image-to-image command's rank 16, and its fixed alpha 4 (scaling
# 0.25; this project's default alpha would be the rank, scaling 1: docs/lora_lowbit.md, "LoRA").
# The targets are the example's attention + MLP projections (families/flux/parallelism.py), lora_A drawn gaussian as diffusers does.
# The frozen 12 B base is sharded in bf16 (6 GB per rank on 4 GPUs) with the fp32 adapters in the
# same FSDP units; activation checkpointing on, no CPU offload needed.
#
#   MODEL=/models/FLUX.1-Kontext-dev DATA=/data/pairs bash recipes/kontext_lora.sh
# DATA: a .jsonl of {"control", "target", "prompt"}, a folder of targets with same-stem .txt captions and
# a control/ folder (or CONTROL_PATH=...), or a datasets table (docs/data.md, "Your data").
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:?set MODEL to a FLUX.1-Kontext diffusers folder}
DATA=${DATA:?set DATA to the pairs: a .jsonl, a folder of targets + control/, or a datasets table}
OUT=${OUT:-out/kontext_lora}
CONTROL=${CONTROL_PATH:+--control_path=$CONTROL_PATH}
export NPROC=${NPROC:-4}
exec bash run_fsdp.sh train_flux_kontext.py --model_path="$MODEL" --data_path="$DATA" ${CONTROL} --output_dir="$OUT" \
    --lora_rank=16 --lora_alpha=4 --lora_init=gaussian --lr=1e-4 --weight_decay=1e-4 --warmup_steps=10 \
    --resolution=512 --precision=bf16-mixed --activation_checkpointing=1 --batch_size=1 \
    --max_steps=2000 --sample_every=250 --save_every=250 --log_every=10 --resume=auto "$@"
