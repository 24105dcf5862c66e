#!/usr/bin/env bash
# Z-Image (the base) to an 8-step Z-Image by DMD2, as Tongyi-MAI ships Z-Image-Turbo's 8 steps: 1024^2 prompts,
# a LoRA generator and a LoRA fake score of rank 64 (the attention projections), every base and the teacher in
# NF4, AC, a bf16 fake score; the teacher's CFG as the model card samples it (guidance_scale 4, the suite's
# standard form 5: uncond + 5 (cond - uncond), against "", cfg_normalization off); the generator and the fake
# score without guidance; the 8 student steps at ZImagePipeline's σ linspace(1, 1/8, 8).
# `python tools/memory_plan.py --model=z-image-dmd --world_size=1 --resolution=1024 --activation_checkpointing=1
# --fake_score_fp32=0 --lora_rank=64 --fake_lora=1 --base_dtype=nf4 --gpu_memory_gb=24` plans 14.6 GiB for
# training and 14.6 for the text-cache fill before it on one 24 GB GPU;
# NPROC=8 (8 x 24 GB): 5.1 and 9.1 (docs/families/z_image.md, "What fits"; planned, not measured).
# The export is a ZImagePipeline LoRA: from_pretrained(MODEL), load_lora_weights(export), the export's scheduler,
# num_inference_steps=8, guidance_scale=0 (docs/families/z_image.md). NF4 needs torchao (pip install torchao).
#
# TEACHER_LORA: a LoRA fine-tune of MODEL (ai-toolkit's, kohya / musubi-tuner's, DiffSynth's or a diffusers one)
# is the teacher and where both students start, merged as the weights load; the export's LoRA file then holds
# the fine-tune's adapters and the student's, and loads on MODEL alone. MODEL is the base: Z-Image-Turbo is
# already distilled (no CFG teacher).
#
#   MODEL=/models/Z-Image DATA=/data/prompts.txt bash recipes/dmd_z_image_8step_lora.sh
#   NPROC=8 MODEL=/models/Z-Image DATA=/data/prompts.txt bash recipes/dmd_z_image_8step_lora.sh
#   MODEL=/models/Z-Image DATA=/data/prompts.txt TEACHER_LORA=/loras/my_style.safetensors \
#       bash recipes/dmd_z_image_8step_lora.sh
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:?set MODEL to a Z-Image base diffusers folder (ZImagePipeline layout)}
DATA=${DATA:?set DATA to a .txt of prompts, or a .jsonl with "prompt"}
TEACHER_LORA=${TEACHER_LORA:-}
OUT=${OUT:-out/z_image_dmd_8step_lora}
TEXT_CACHE_DIR=${TEXT_CACHE_DIR:-$OUT/text_cache}  # share it between runs on the same prompts
export NPROC=${NPROC:-1}
exec bash run_fsdp.sh train_dmd.py --model_path="$MODEL" --teacher_lora="$TEACHER_LORA" --data_path="$DATA" \
    --output_dir="$OUT" --text_cache_dir="$TEXT_CACHE_DIR" --lora_rank=64 --lora_alpha=64 --fake_lora=1 \
    --base_dtype=nf4 --generator_lr=5e-5 --guidance_lr=5e-5 --batch_size=1 --resolution=1024 \
    --real_guidance_scale=5.0 --dfake_gen_update_ratio=5 --conditioning_timestep=999 \
    --denoising_steps=999,874,749,624,499,374,249,124 --precision=bf16-mixed --fake_score_fp32=0 \
    --activation_checkpointing=1 --export_dtype=bf16 --max_steps=4000 --save_every=250 --sample_every=250 \
    --log_every=10 --resume=auto "$@"
