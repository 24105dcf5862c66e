#!/usr/bin/env bash
# DMD2 on SDXL, the published 4-step LoRA generator (FID 19.68 at 16k iterations,
# experiments/sdxl/README.md), on FSDP2. Settings as in tianweiy/DMD2 experiments/sdxl/
#   sdxl_cond999_8node_lr5e-5_denoising4step_diffusion1000_gan5e-3_guidance8_noinit_noode_backsim_scratch_lora.sh
#   (lines 9-45): the 4-step recipe (dmd_sdxl_4step.sh) with --generator_lora and generator and
#   guidance LR 5e-5 (100x the full run's 5e-7).
# LoRA as the official --generator_lora path builds it (main/sd_unified_model.py:44-69, defaults
# main/train_sd.py:680-682): peft adapters of rank 64, alpha 8 (scaling 0.125), dropout 0, peft's
# default init (LoraConfig without init_lora_weights: kaiming-uniform lora_A, zero lora_B) on 14
# module types (families/sd_unet.DMD2_LORA_TARGETS: attention, proj_in/out, feed-forward, the
# resnets' conv1/conv2/conv_shortcut and time_emb_proj, the down/up samplers' convs). The
# generator only: the fake score trains all its weights (main/sd_guidance.py:53-58), as FAKE_LORA=0.
# Text encoders in fp32 (main/sdxl/sdxl_text_encoder.py:8-14). AC=1: activation checkpointing.
# Export: OUT/export/pytorch_lora_weights.safetensors, loaded onto the ORIGINAL SDXL pipeline with
# pipe.load_lora_weights (docs/lora_lowbit.md, "LoRA"); --lora_export_merged=1 also writes a merged pipeline.
#
#   MODEL=/models/stable-diffusion-xl-base-1.0 DATA=/data/laion.jsonl bash recipes/dmd_sdxl_4step_lora.sh
# Warmup: the official --warmup_step 500, advanced once per GPU on 64 GPUs = 7.8125 iterations
# (train_dmd.make_optimizer), the same for any world size here.
# The fake score in fp32, as published (main/sd_guidance.py:191 runs the DM loss's fake prediction at full
# precision); train_dmd.py's default computes it in bf16, which scored within the seed spread on the
# shapes demo (docs/dmd2.md), evidence too small to change a published recipe.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:?set MODEL to an SDXL diffusers folder (StableDiffusionXLPipeline layout)}
DATA=${DATA:?set DATA to a .jsonl of prompt + image rows}
OUT=${OUT:-out/sdxl_4step_lora}
. recipes/lib/common.sh
PER_GPU=$(per_gpu 2 "$@")  # a --batch_size=N override keeps the global batch (GRAD_ACCUM follows)
ACCUM=$(grad_accum 128 $PER_GPU)
exec bash run_fsdp.sh train_dmd.py --model_path="$MODEL" --data_path="$DATA" --output_dir="$OUT" \
    --lora_rank=64 --lora_alpha=8 --lora_dropout=0 --lora_init=default --fake_lora=0 \
    --lora_target_modules=to_q,to_k,to_v,to_out.0,proj_in,proj_out,ff.net.0.proj,ff.net.2,conv1,conv2,conv_shortcut,downsamplers.0.conv,upsamplers.0.conv,time_emb_proj \
    --generator_lr=5e-5 --guidance_lr=5e-5 --batch_size=$PER_GPU --grad_accum=$ACCUM \
    --resolution=1024 --seed=10 --real_guidance_scale=8 --dfake_gen_update_ratio=5 --max_grad_norm=10 \
    --max_step_percent=0.98 --use_gan=1 --gen_cls_loss_weight=5e-3 --guidance_cls_loss_weight=1e-2 \
    --diffusion_gan=1 --diffusion_gan_max_timestep=1000 \
    --conditioning_timestep=999 --denoising_steps=999,749,499,249 \
    --precision=bf16-mixed --fake_score_fp32=1 --text_encoder_dtype=fp32 --activation_checkpointing=${AC:-0} \
    --max_steps=20000 --save_every=500 --sample_every=250 --log_every=50 --warmup_steps=7.8125 --resume=auto "$@"
