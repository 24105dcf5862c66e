#!/usr/bin/env bash
# DMD2 stage 1 on SD-1.5, the published run (FID 9.28 at 39k iterations), on FSDP2.
# Settings as in tianweiy/DMD2 experiments/sdv1.5/
#   laion6.25_sd_baseline_8node_guidance1.75_lr1e-5_seed10_dfake10_from_scratch.sh (lines 9-31):
#   generator and guidance LR 1e-5, batch 32 per GPU on 8 nodes x 8 GPUs (global 2048), 512 px,
#   real guidance 1.75, dfake_gen_update_ratio 10, grad-norm clip 10, seed 10, mixed precision,
#   gradient checkpointing; stage 1 = no GAN. The text encoder in fp32, as the official code keeps
#   CLIP (main/sd_unified_model.py:85-88).
# On fewer GPUs the same global batch is kept by gradient accumulation: GRAD_ACCUM below is
# 2048 / (32 x GPUs), e.g. 8 on one 8-GPU node (so 8x slower per step than the published 64 GPUs).
#
#   MODEL=/models/stable-diffusion-v1-5 DATA=/data/prompts.txt bash recipes/dmd_sd15_stage1.sh
#   NNODES=8 NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash recipes/dmd_sd15_stage1.sh   # on each node
# Extra --name=value arguments override these (e.g. --max_steps=100 for a trial).
# Warmup: the official --warmup_step 500, advanced once per GPU on 64 GPUs = 7.8125 iterations
# (train_dmd.make_optimizer), the same for any world size here.
# The fake score in fp32, as published (main/sd_guidance.py:191 runs the DM loss's fake prediction at full
# precision); train_dmd.py's default computes it in bf16, which scored within the seed spread on the
# shapes demo (docs/dmd2.md), evidence too small to change a published recipe.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:?set MODEL to an SD-1.5 diffusers folder (unet/ vae/ text_encoder/ tokenizer/ scheduler/)}
DATA=${DATA:?set DATA to a prompts file (.txt, one a line, or .jsonl with "prompt")}
OUT=${OUT:-out/sd15_stage1}
. recipes/lib/common.sh
PER_GPU=$(per_gpu 32 "$@")  # a --batch_size=N override keeps the global batch (GRAD_ACCUM follows)
ACCUM=$(grad_accum 2048 $PER_GPU)
exec bash run_fsdp.sh train_dmd.py --model_path="$MODEL" --data_path="$DATA" --output_dir="$OUT" \
    --generator_lr=1e-5 --guidance_lr=1e-5 --batch_size=$PER_GPU --grad_accum=$ACCUM \
    --resolution=512 --real_guidance_scale=1.75 --dfake_gen_update_ratio=10 --max_grad_norm=10 --seed=10 \
    --precision=bf16-mixed --fake_score_fp32=1 --text_encoder_dtype=fp32 --activation_checkpointing=1 --use_gan=0 \
    --max_steps=40000 --save_every=1000 --sample_every=500 --log_every=50 --warmup_steps=7.8125 --resume=auto "$@"
