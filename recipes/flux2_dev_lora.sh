#!/usr/bin/env bash
# FLUX.2 [dev] (32 B) LoRA r16 at 1024^2 with up to two reference images per sample, AC, the planner's settings
# (docs/planner.md, "FLUX.2"; planned, not measured):
#   NF4=1 (default): a 4-bit NF4 base; 8 x 24 GB (NPROC=8, default), 2 x 48 GB (NPROC=2) or 1 x 80 GB (NPROC=1)
#   NF4=0: a bf16 base; 2 x 48 GB (NPROC=2) or 1 x 80 GB (NPROC=1)
# `python tools/memory_plan.py --model=flux2-dev --world_size=8 --lora_rank=16 --base_dtype=nf4 --resolution=1024
# --activation_checkpointing=1 --gpu_memory_gb=24` plans 18.0 GiB per GPU for training and 18.4 for the text-cache
# fill before it (Mistral-Small 3, 24 B, sharded over the 8 ranks); on fewer 24 GB cards the fill needs an NF4
# text encoder or the training CPU offload. Targets: diffusers' FLUX.2 LoRA example's (families/flux2/parallelism.py).
#
#   MODEL=/models/FLUX.2-dev DATA=/data/edits.jsonl bash recipes/flux2_dev_lora.sh
# DATA: rows {"control": ["a.png", "b.png"], "target", "prompt"}, or the folder layouts (docs/data.md).
# NF4 (BASE_DTYPE=nf4) needs torchao: pip install torchao (requirements-dev.txt pins the tested version).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:?set MODEL to a FLUX.2 [dev] diffusers folder (Flux2Pipeline layout)}
DATA=${DATA:?set DATA to the samples: a .jsonl with "control" lists, or a folder layout}
NF4=${NF4:-1}
OUT=${OUT:-out/flux2_dev_lora}
CONTROL=${CONTROL_PATH:+--control_path=$CONTROL_PATH}
export NPROC=${NPROC:-8}
if [ "$NF4" = 1 ]; then BASE=(--base_dtype=nf4); else BASE=(); fi
exec bash run_fsdp.sh train_flux_kontext.py --model_path="$MODEL" --data_path="$DATA" ${CONTROL} --output_dir="$OUT" \
    --lora_rank=16 --lora_alpha=16 "${BASE[@]}" --lora_init=gaussian --lr=1e-4 --weight_decay=1e-4 --warmup_steps=10 \
    --resolution=1024 --max_references=2 --max_sequence_length=512 --precision=bf16-mixed \
    --activation_checkpointing=1 --batch_size=1 --sample_guidance=4.0 --max_steps=3000 --sample_every=250 \
    --save_every=250 --log_every=10 --resume=auto "$@"
