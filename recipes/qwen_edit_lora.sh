#!/usr/bin/env bash
# Qwen-Image-Edit-2509 / 2511 LoRA at 1024^2 with up to three reference images per sample, on one GPU:
#   NF4=1 (default), 1 x 24 GB: rank 16 on a 4-bit NF4 base, AC, 8-bit AdamW
#   NF4=0, 1 x 80 GB: rank 64 on a bf16 base, AC
# `python tools/memory_plan.py --model=qwen-image-edit --world_size=1 --resolution=1024
# --activation_checkpointing=1 --lora_rank=16 --base_dtype=nf4 --gpu_memory_gb=24` plans 17.9 GiB;
# rank 64 on a bf16 base 47.8 GiB of 80 (docs/planner.md); neither fits without AC. Targets: diffusers'
# Qwen-Image LoRA example's (families/qwen_image/parallelism.py). More GPUs: NPROC=N shards the base over them.
#
#   MODEL=/models/Qwen-Image-Edit-2509 DATA=/data/edits.jsonl bash recipes/qwen_edit_lora.sh
# DATA: rows {"control": ["a.png", "b.png"], "target", "prompt"}, or musubi-tuner's / ai-toolkit's folder
# layouts (docs/data.md, "Several reference images").
# NF4 (BASE_DTYPE=nf4) needs torchao: pip install torchao (requirements-dev.txt pins the tested version).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:?set MODEL to a Qwen-Image-Edit-2509/2511 diffusers folder (QwenImageEditPlusPipeline layout)}
DATA=${DATA:?set DATA to the samples: a .jsonl with "control" lists, or a folder layout}
NF4=${NF4:-1}
OUT=${OUT:-out/qwen_edit_lora}
CONTROL=${CONTROL_PATH:+--control_path=$CONTROL_PATH}
export NPROC=${NPROC:-1}
if [ "$NF4" = 1 ]; then
    MODE=(--lora_rank=16 --lora_alpha=16 --base_dtype=nf4 --optimizer=adamw8bit)
else
    MODE=(--lora_rank=64 --lora_alpha=64)
fi
exec bash run_fsdp.sh train_flux_kontext.py --model_path="$MODEL" --data_path="$DATA" ${CONTROL} --output_dir="$OUT" \
    "${MODE[@]}" --lora_init=gaussian --lr=1e-4 --weight_decay=1e-4 --warmup_steps=10 \
    --resolution=1024 --precision=bf16-mixed --activation_checkpointing=1 --batch_size=1 \
    --sample_guidance=4.0 --max_steps=3000 --sample_every=250 --save_every=250 --log_every=10 --resume=auto "$@"
