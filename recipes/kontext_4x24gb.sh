#!/usr/bin/env bash
# FLUX.1 Kontext [dev] full fine-tune on 4 x 24 GB GPUs (e.g. RTX 4090), on FSDP2: the settings
#   python tools/memory_plan.py --model=flux-kontext-dev --world_size=4 --gpu_memory_gb=24
# finds to fit: bf16 compute with fp32 master weights, activation checkpointing, and CPU offload of
# the sharded fp32 params, grads and AdamW state (~190 GB in all for 12 B parameters: host RAM must
# hold it, ~48 GB per rank). Weight decay 1e-4 as diffusers' Kontext example (--adam_weight_decay); LR
# 1e-5, the usual full fine-tune LR for FLUX: diffusers' example defaults to --learning_rate 1e-4, which
# is for its LoRA (recipes/kontext_lora.sh uses it), too high for all 12 B weights.
#
#   MODEL=/models/FLUX.1-Kontext-dev DATA=/data/edits.jsonl bash recipes/kontext_4x24gb.sh
# DATA: a .jsonl of {"control": input, "target": edited, "prompt": instruction} (paths relative to it), a
# folder of targets with same-stem .txt captions and a control/ folder, or a datasets table (docs/data.md, "Your data").
# As a LoRA instead (--lora_rank=16 --lr=1e-4, diffusers' image-to-image command): alpha defaults to
# the rank here (scaling 1), where that command keeps diffusers' fixed alpha 4 (scaling 0.25,
# train_dreambooth_lora_flux_kontext.py:406-411); add --lora_alpha=4 to match it (docs/lora_lowbit.md, "LoRA").
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:?set MODEL to a FLUX.1-Kontext diffusers folder}
DATA=${DATA:?set DATA to the pairs: a .jsonl, a folder of targets + control/, or a datasets table}
OUT=${OUT:-out/kontext_ft}
export NPROC=${NPROC:-4}
exec bash run_fsdp.sh train_flux_kontext.py --model_path="$MODEL" --data_path="$DATA" --output_dir="$OUT" \
    --resolution=512 --precision=bf16-mixed --activation_checkpointing=1 --cpu_offload=1 \
    --batch_size=1 --lr=1e-5 --weight_decay=1e-4 --warmup_steps=10 \
    --max_steps=2000 --sample_every=250 --save_every=250 --log_every=10 --resume=auto "$@"
