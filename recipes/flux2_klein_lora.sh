#!/usr/bin/env bash
# FLUX.2 [klein] base 4B / 9B LoRA r16 at 1024^2 with up to two reference images per sample on one 24 GB GPU, AC:
#   NF4=1 (default): a 4-bit NF4 base, 4B or 9B
#   NF4=0: a bf16 base, 4B only (9B then needs CPU offload, or NPROC=2)
# `python tools/memory_plan.py --model=flux2-klein-9b --world_size=1 --lora_rank=16 --base_dtype=nf4
# --resolution=1024 --activation_checkpointing=1 --gpu_memory_gb=24` plans 12.8 GiB for training and 23.2 for the
# text-cache fill before it (Qwen3-8B whole in bf16: tight on a 24 GB card); 4B: 7.7 and 14.6 GiB
# (docs/planner.md, "FLUX.2"; planned, not measured).
#
#   MODEL=/models/FLUX.2-klein-base-4B DATA=/data/edits.jsonl bash recipes/flux2_klein_lora.sh
# NF4 (BASE_DTYPE=nf4) needs torchao: pip install torchao (requirements-dev.txt pins the tested version).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:?set MODEL to a FLUX.2 [klein] diffusers folder (Flux2KleinPipeline layout)}
DATA=${DATA:?set DATA to the samples: a .jsonl with "control" lists, or a folder layout}
NF4=${NF4:-1}
OUT=${OUT:-out/flux2_klein_lora}
CONTROL=${CONTROL_PATH:+--control_path=$CONTROL_PATH}
export NPROC=${NPROC:-1}
if [ "$NF4" = 1 ]; then BASE=(--base_dtype=nf4); else BASE=(); fi
exec bash run_fsdp.sh train_flux_kontext.py --model_path="$MODEL" --data_path="$DATA" ${CONTROL} --output_dir="$OUT" \
    --lora_rank=16 --lora_alpha=16 "${BASE[@]}" --lora_init=gaussian --lr=1e-4 --weight_decay=1e-4 --warmup_steps=10 \
    --resolution=1024 --max_references=2 --max_sequence_length=512 --precision=bf16-mixed \
    --activation_checkpointing=1 --batch_size=1 --sample_guidance=4.0 --max_steps=3000 --sample_every=250 \
    --save_every=250 --log_every=10 --resume=auto "$@"
