#!/usr/bin/env bash
# Z-Image (base) text-to-image full fine-tune at 1024^2 on 8 GPUs, AC, FSDP2 over all 8 (fp32 master weights and
# AdamW states sharded): `python tools/memory_plan.py --model=z-image --world_size=8 --resolution=1024
# --activation_checkpointing=1` plans 16.71 GiB per GPU (the text-cache fill 14.57; planned, not measured), so
# 8 x 24 GB fit as 8 x 80 GB do; samples at guidance_scale 4 (the model card's).
#
#   MODEL=/models/Z-Image DATA=/data/captioned/ bash recipes/z_image_t2i_full.sh
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 MODEL=... DATA=... bash recipes/z_image_t2i_full.sh
# The export: ZImagePipeline.from_pretrained(OUT/export).
set -euo pipefail
cd "$(dirname "$0")/.."
. recipes/lib/common.sh  # NNODES / SLURM: HSDP with one replica per node
MODEL=${MODEL:?set MODEL to a Z-Image base diffusers folder (ZImagePipeline layout)}
DATA=${DATA:?set DATA to the images and prompts: a .jsonl with "image" and "prompt", or a caption folder}
OUT=${OUT:-out/z_image_t2i_full}
exec bash run_fsdp.sh train_flux_kontext.py --model_path="$MODEL" --data_path="$DATA" --output_dir="$OUT" \
    --lr=1e-5 --weight_decay=1e-4 --warmup_steps=100 --resolution=1024 --precision=bf16-mixed \
    --activation_checkpointing=1 --batch_size=1 --export_dtype=bf16 \
    --sample_guidance=4.0 --max_steps=3000 --sample_every=250 --save_every=250 --log_every=10 --resume=auto "$@"
