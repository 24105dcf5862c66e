#!/usr/bin/env bash
# DMD2 on SDXL, the published 1-step generator, on FSDP2. Settings as in tianweiy/DMD2
# experiments/sdxl/sdxl_cond399_8node_lr5e-7_1step_diffusion1000_gan5e-3_guidance8_noinit_noode.sh
# (lines 9-41): as the 4-step recipe (LR 5e-7, batch 2 x 64 GPUs = 128, 1024 px, guidance 8,
# ratio 5, GAN 5e-3 / 1e-2, diffusion GAN 1000) but one step at conditioning timestep 399 (pure
# noise in, treated as z_399). AC=1: activation checkpointing (off, as published; see the 4-step recipe).
# Text encoders in fp32, as the official code keeps CLIP (main/sdxl/sdxl_text_encoder.py:8-14).
#
# What it needs: the published run (FID 19.01 at 24k iterations, experiments/sdxl/README.md) does
# NOT start its generator from the teacher: it loads an ODE-regression pre-trained generator
# (line 41, --generator_ckpt_path; the fake score still starts from the teacher). Set GENERATOR_INIT
# to that generator: a diffusers UNet folder or one .safetensors state dict with SDXL's UNet tensors.
# The official one (scripts/download_sdxl_1step_ode_pairs_ckpt.sh:
# sdxl_lr1e-5_8node_ode_pretraining_10k_cond399_checkpoint_model_002000.bin, 2k iterations of
# experiments/sdxl/sdxl_lr1e-5_8node_ode_pretraining_10k_cond399.sh) is a pickled .bin: convert it
# once to .safetensors (train_dmd.py prints the one-line command if given the .bin). This suite
# does not implement the ODE pre-training itself (docs/families/sd_unet.md, "SDXL in 1 step"). GENERATOR_INIT=
# (set but empty) starts the generator from the teacher instead: that is not the published run, and
# no published number applies to it.
#
#   MODEL=/models/stable-diffusion-xl-base-1.0 DATA=/data/laion.jsonl \
#   GENERATOR_INIT=/models/sdxl_ode_pretrained_cond399.safetensors bash recipes/dmd_sdxl_1step.sh
# Warmup: the official --warmup_step 500, advanced once per GPU on 64 GPUs = 7.8125 iterations
# (train_dmd.make_optimizer), the same for any world size here.
# The fake score in fp32, as published (main/sd_guidance.py:191 runs the DM loss's fake prediction at full
# precision); train_dmd.py's default computes it in bf16, which scored within the seed spread on the
# shapes demo (docs/dmd2.md), evidence too small to change a published recipe.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:?set MODEL to an SDXL diffusers folder (StableDiffusionXLPipeline layout)}
DATA=${DATA:?set DATA to a .jsonl of prompt + image rows}
GENERATOR_INIT=${GENERATOR_INIT?set GENERATOR_INIT to the ODE-pretrained SDXL generator, a .safetensors file or UNet folder, as the header of this recipe says; GENERATOR_INIT= starts from the teacher instead, which is not the published run}
OUT=${OUT:-out/sdxl_1step}
. recipes/lib/common.sh
PER_GPU=$(per_gpu 2 "$@")  # a --batch_size=N override keeps the global batch (GRAD_ACCUM follows)
ACCUM=$(grad_accum 128 $PER_GPU)
exec bash run_fsdp.sh train_dmd.py --model_path="$MODEL" --data_path="$DATA" --output_dir="$OUT" \
    --generator_init="$GENERATOR_INIT" \
    --generator_lr=5e-7 --guidance_lr=5e-7 --batch_size=$PER_GPU --grad_accum=$ACCUM \
    --resolution=1024 --seed=10 --real_guidance_scale=8 --dfake_gen_update_ratio=5 --max_grad_norm=10 \
    --max_step_percent=0.98 --use_gan=1 --gen_cls_loss_weight=5e-3 --guidance_cls_loss_weight=1e-2 \
    --diffusion_gan=1 --diffusion_gan_max_timestep=1000 --conditioning_timestep=399 \
    --precision=bf16-mixed --fake_score_fp32=1 --text_encoder_dtype=fp32 --activation_checkpointing=${AC:-0} \
    --max_steps=20000 --save_every=500 --sample_every=250 --log_every=50 --warmup_steps=7.8125 --resume=auto "$@"
