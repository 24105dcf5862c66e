#!/usr/bin/env bash
# FLUX.2 [klein] base 4B / 9B text-to-image LoRA r16 at 1024^2 on one 24 GB GPU, AC: rows of an image and its prompt,
# no reference (a .jsonl of "image" + "prompt", a caption folder without control/, or a datasets table):
#   NF4=0 (default): a bf16 base, 4B
#   NF4=1: a 4-bit NF4 base (9B: its bf16 base plans 22.0 GiB, too tight on a 24 GB card)
# `python tools/memory_plan.py --model=flux2-klein-4b --world_size=1 --lora_rank=16 --resolution=1024
# --activation_checkpointing=1 --gpu_memory_gb=24 --references=0` plans 10.80 GiB for training and 14.57 for the
# text-cache fill before it; 9B with --base_dtype=nf4: 9.20 and 23.21 GiB (Qwen3-8B whole in bf16: tight)
# (planned, not measured).
#
#   MODEL=/models/FLUX.2-klein-base-4B DATA=/data/captioned/ bash recipes/flux2_klein_t2i_lora.sh
# The export: Flux2KleinPipeline.from_pretrained(MODEL) + load_lora_weights(OUT/export); pipe(prompt, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:?set MODEL to a FLUX.2 [klein] base diffusers folder (Flux2KleinPipeline layout)}
DATA=${DATA:?set DATA to the images and prompts: a .jsonl with "image" and "prompt", or a caption folder}
NF4=${NF4:-0}
OUT=${OUT:-out/flux2_klein_t2i_lora}
export NPROC=${NPROC:-1}
if [ "$NF4" = 1 ]; then BASE=(--base_dtype=nf4); else BASE=(); fi
exec bash run_fsdp.sh train_flux_kontext.py --model_path="$MODEL" --data_path="$DATA" --output_dir="$OUT" \
    --lora_rank=16 --lora_alpha=16 "${BASE[@]}" --lora_init=gaussian --lr=1e-4 --weight_decay=1e-4 --warmup_steps=10 \
    --resolution=1024 --max_sequence_length=512 --precision=bf16-mixed --activation_checkpointing=1 --batch_size=1 \
    --sample_guidance=4.0 --max_steps=3000 --sample_every=250 --save_every=250 --log_every=10 --resume=auto "$@"
