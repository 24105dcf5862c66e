#!/usr/bin/env bash
# DMD2 on SDXL, the published 1-step generator (FID 19.01), on FSDP2. Settings as in
# tianweiy/DMD2 experiments/sdxl/sdxl_cond399_8node_lr5e-7_1step_diffusion1000_gan5e-3_guidance8_noinit_noode.sh
# (lines 9-42): as the 4-step recipe (LR 5e-7, batch 2 x 64 GPUs = 128, 1024 px, guidance 8,
# ratio 5, GAN 5e-3 / 1e-2, diffusion GAN 1000) but one step at conditioning timestep 399 (pure
# noise in, treated as z_399). AC=1: activation checkpointing (off, as published; see the 4-step recipe).
# The published run started its generator from a 10k-iteration ODE-regression pre-training
# (experiments/sdxl/sdxl_lr1e-5_8node_ode_pretraining_10k_cond399.sh), which this suite does not
# implement: pass such a checkpoint as INIT_FROM (a checkpoint of this script), or leave it unset
# to start from the teacher, as the 4-step recipe does.
#
#   MODEL=/models/stable-diffusion-xl-base-1.0 DATA=/data/laion.jsonl bash recipes/dmd_sdxl_1step.sh
# Warmup: the official --warmup_step 500, advanced once per GPU on 64 GPUs = 7.8125 iterations
# (train_dmd.make_optimizer), the same for any world size here.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:?set MODEL to an SDXL diffusers folder (StableDiffusionXLPipeline layout)}
DATA=${DATA:?set DATA to a .jsonl of prompt + image rows}
OUT=${OUT:-out/sdxl_1step}
. recipes/lib/common.sh
PER_GPU=2
ACCUM=$(grad_accum 128 $PER_GPU)
exec bash run_fsdp.sh train_dmd.py --model_path="$MODEL" --data_path="$DATA" --output_dir="$OUT" \
    ${INIT_FROM:+--init_from="$INIT_FROM"} \
    --generator_lr=5e-7 --guidance_lr=5e-7 --batch_size=$PER_GPU --grad_accum=$ACCUM \
    --resolution=1024 --seed=10 --real_guidance_scale=8 --dfake_gen_update_ratio=5 --max_grad_norm=10 \
    --max_step_percent=0.98 --use_gan=1 --gen_cls_loss_weight=5e-3 --guidance_cls_loss_weight=1e-2 \
    --diffusion_gan=1 --diffusion_gan_max_timestep=1000 --conditioning_timestep=399 \
    --precision=bf16-mixed --activation_checkpointing=${AC:-0} \
    --max_steps=20000 --save_every=500 --sample_every=250 --log_every=50 --warmup_steps=7.8125 --resume=auto "$@"
