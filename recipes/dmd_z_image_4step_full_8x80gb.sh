#!/usr/bin/env bash
# Z-Image (the base) to a 4-step Z-Image by DMD2 with a full generator and a full fake score (bf16 compute), a
# bf16 teacher, AC, 1024^2 prompts, on 8 x 80 GB; the teacher's CFG as the model card samples it
# (guidance_scale 4: REAL_GUIDANCE_SCALE 5 in the suite's standard form, against "", cfg_normalization off);
# the 4 student steps at ZImagePipeline's σ 1, .75, .5, .25.
# `python tools/memory_plan.py --model=z-image-dmd --world_size=8 --resolution=1024 --activation_checkpointing=1
# --fake_score_fp32=0 --gpu_memory_gb=80` plans 29.6 GiB per GPU (the text-cache fill before it 9.1; planned,
# not measured). The export is a ZImagePipeline folder: from_pretrained(export)(prompt, num_inference_steps=4,
# guidance_scale=0) (docs/families/z_image.md).
#
#   MODEL=/models/Z-Image DATA=/data/prompts.txt bash recipes/dmd_z_image_4step_full_8x80gb.sh
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:?set MODEL to a Z-Image base diffusers folder (ZImagePipeline layout)}
DATA=${DATA:?set DATA to a .txt of prompts, or a .jsonl with "prompt"}
OUT=${OUT:-out/z_image_dmd_4step}
TEXT_CACHE_DIR=${TEXT_CACHE_DIR:-$OUT/text_cache}
export NPROC=${NPROC:-8}
exec bash run_fsdp.sh train_dmd.py --model_path="$MODEL" --data_path="$DATA" --output_dir="$OUT" \
    --text_cache_dir="$TEXT_CACHE_DIR" --generator_lr=2e-6 --guidance_lr=2e-6 --batch_size=1 \
    --resolution=1024 --real_guidance_scale=5.0 --dfake_gen_update_ratio=5 --conditioning_timestep=999 \
    --denoising_steps=999,749,499,249 --precision=bf16-mixed --fake_score_fp32=0 --activation_checkpointing=1 \
    --export_dtype=bf16 --max_steps=4000 --save_every=250 --sample_every=250 --log_every=10 --resume=auto "$@"
