#!/usr/bin/env bash
# DMD2 on SDXL, the published 4-step generator (FID 19.32), on FSDP2. Settings as in
# tianweiy/DMD2 experiments/sdxl/
#   sdxl_cond999_8node_lr5e-7_denoising4step_diffusion1000_gan5e-3_guidance8_noinit_noode_backsim_scratch.sh
#   (lines 9-45): generator and guidance LR 5e-7, batch 2 per GPU on 8 nodes x 8 GPUs (global 128),
#   1024 px, seed 10, real guidance 8, dfake_gen_update_ratio 5, grad-norm clip 10,
#   max_step_percent 0.98, GAN on the fake UNet's bottleneck from the start (gen_cls_loss_weight
#   5e-3, guidance_cls_loss_weight 1e-2, diffusion GAN up to t = 1000), 4 denoising steps
#   (999, 749, 499, 249) with backward simulation, bf16 mixed precision, SDXL's VAE in fp32, the
#   text encoders in fp32 as the official code keeps CLIP (main/sdxl/sdxl_text_encoder.py:8-14).
# Activation checkpointing is off, as in the official script (64 GPUs); AC=1 turns it on where
# `python tools/memory_plan.py --fit_table --model=sdxl-dmd` (README) says it is needed.
# On fewer GPUs the global batch 128 is kept by GRAD_ACCUM = 128 / (2 x GPUs).
# DATA: a .jsonl of {"prompt", "image"} rows (the paper used SDXL-VAE latents of 500k LAION images).
#
#   MODEL=/models/stable-diffusion-xl-base-1.0 DATA=/data/laion.jsonl bash recipes/dmd_sdxl_4step.sh
# Warmup: the official --warmup_step 500, advanced once per GPU on 64 GPUs = 7.8125 iterations
# (train_dmd.make_optimizer), the same for any world size here.
# The fake score in fp32, as published (main/sd_guidance.py:191 runs the DM loss's fake prediction at full
# precision); train_dmd.py's default computes it in bf16, which scored within the seed spread on the
# shapes demo (docs/dmd2.md), evidence too small to change a published recipe.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:?set MODEL to an SDXL diffusers folder (StableDiffusionXLPipeline layout)}
DATA=${DATA:?set DATA to a .jsonl of prompt + image rows}
OUT=${OUT:-out/sdxl_4step}
. recipes/lib/common.sh
PER_GPU=$(per_gpu 2 "$@")  # a --batch_size=N override keeps the global batch (GRAD_ACCUM follows)
ACCUM=$(grad_accum 128 $PER_GPU)
exec bash run_fsdp.sh train_dmd.py --model_path="$MODEL" --data_path="$DATA" --output_dir="$OUT" \
    --generator_lr=5e-7 --guidance_lr=5e-7 --batch_size=$PER_GPU --grad_accum=$ACCUM \
    --resolution=1024 --seed=10 --real_guidance_scale=8 --dfake_gen_update_ratio=5 --max_grad_norm=10 \
    --max_step_percent=0.98 --use_gan=1 --gen_cls_loss_weight=5e-3 --guidance_cls_loss_weight=1e-2 \
    --diffusion_gan=1 --diffusion_gan_max_timestep=1000 \
    --conditioning_timestep=999 --denoising_steps=999,749,499,249 \
    --precision=bf16-mixed --fake_score_fp32=1 --text_encoder_dtype=fp32 --activation_checkpointing=${AC:-0} \
    --max_steps=20000 --save_every=500 --sample_every=250 --log_every=50 --warmup_steps=7.8125 --resume=auto "$@"
