#!/usr/bin/env bash
# Z-Image Omni LoRA r64 at 1024^2 on edit rows of one or two references (up to four), one 40 GB GPU, AC: a .jsonl of
# "control" (one image or a list) + "target" + "prompt", or a folder layout with CONTROL_PATH; each reference as
# ZImageOmniPipeline prepares it (downsized to 1024^2, its SigLIP features cached), the VAE in bf16 as the pipeline
# encodes references. `python tools/memory_plan.py --model=z-image-omni --world_size=1 --lora_rank=64
# --resolution=1024 --activation_checkpointing=1 --gpu_memory_gb=40` plans 22.01 GiB for training and 33.62 for the
# text-cache fill before it (two references: each prompt is 4 caption segments of up to 512 tokens through Qwen3-4B,
# 16 prompts a batch; then the SigLIP); a 24 GB card holds the training, not that fill (planned, not measured).
#
#   MODEL=/models/Z-Image-Omni DATA=/data/edits.jsonl bash recipes/z_image_omni_edit_lora.sh
# The export: ZImageOmniPipeline.from_pretrained(MODEL) + load_lora_weights(OUT/export), the VAE in bf16;
# pipe(image=[...], prompt, height, width, guidance_scale=4) (docs/families/z_image.md).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:?set MODEL to a Z-Image Omni diffusers folder (ZImageOmniPipeline layout)}
DATA=${DATA:?set DATA to the edits: a .jsonl with "control" (an image or a list), "target", "prompt"; or a folder}
OUT=${OUT:-out/z_image_omni_edit_lora}
CONTROL=${CONTROL_PATH:+--control_path=$CONTROL_PATH}
export NPROC=${NPROC:-1}
exec bash run_fsdp.sh train_flux_kontext.py --model_path="$MODEL" --data_path="$DATA" ${CONTROL} --output_dir="$OUT" \
    --lora_rank=64 --lora_alpha=64 --lora_init=gaussian --lr=1e-4 --weight_decay=1e-4 --warmup_steps=10 \
    --resolution=1024 --max_references=2 --precision=bf16-mixed --activation_checkpointing=1 --batch_size=1 \
    --sample_guidance=4.0 --max_steps=3000 --sample_every=250 --save_every=250 --log_every=10 --resume=auto "$@"
