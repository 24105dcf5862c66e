#!/usr/bin/env bash
# Z-Image (base) text-to-image LoRA r64 at 1024^2 on one 24 GB GPU, AC: rows of an image and its prompt, no reference
# (a .jsonl of "image" + "prompt", a caption folder without control/, or a datasets table); the LoRA on diffusers'
# default Z-Image targets (the attention projections); samples as ZImagePipeline samples the base, guidance_scale 4
# (the model card's). `python tools/memory_plan.py --model=z-image --world_size=1 --lora_rank=64 --resolution=1024
# --activation_checkpointing=1 --gpu_memory_gb=24` plans 16.54 GiB for training (the text-cache fill before it 14.57;
# planned, not measured).
# Then its 8-step student: TEACHER_LORA=OUT/export bash recipes/dmd_z_image_8step_lora.sh (docs/families/z_image.md).
#
#   MODEL=/models/Z-Image DATA=/data/captioned/ bash recipes/z_image_t2i_lora.sh
# The export: ZImagePipeline.from_pretrained(MODEL) + load_lora_weights(OUT/export); pipe(prompt, guidance_scale=4).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:?set MODEL to a Z-Image base diffusers folder (ZImagePipeline layout)}
DATA=${DATA:?set DATA to the images and prompts: a .jsonl with "image" and "prompt", or a caption folder}
OUT=${OUT:-out/z_image_t2i_lora}
export NPROC=${NPROC:-1}
exec bash run_fsdp.sh train_flux_kontext.py --model_path="$MODEL" --data_path="$DATA" --output_dir="$OUT" \
    --lora_rank=64 --lora_alpha=64 --lora_init=gaussian --lr=1e-4 --weight_decay=1e-4 --warmup_steps=10 \
    --resolution=1024 --precision=bf16-mixed --activation_checkpointing=1 --batch_size=1 \
    --sample_guidance=4.0 --max_steps=3000 --sample_every=250 --save_every=250 --log_every=10 --resume=auto "$@"
