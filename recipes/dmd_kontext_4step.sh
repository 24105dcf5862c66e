#!/usr/bin/env bash
# DMD2 with a FLUX.1 Kontext [dev] teacher: a 4-step image-editing generator, full fine-tune of the
# generator and the fake score on 8 x 80 GB GPUs, on FSDP2. train_dmd.py builds three 12 B FLUX
# transformers from MODEL (generator and fake score trained with AdamW, the teacher frozen in bf16);
# `python tools/memory_plan.py --model=flux-kontext-dmd --world_size=8 --resolution=1024
# --activation_checkpointing=1 --fake_score_fp32=0 --gpu_memory_gb=80` plans 55.2 GiB per GPU
# (docs/planner.md). recipes/dmd_kontext_4step_lora.sh is the LoRA + NF4 variant for 8 x 24 GB.
# There is no published DMD2 run on FLUX.1 Kontext. The settings follow NVlabs/FastGen's FLUX.1-dev
# DMD2 config (fastgen/configs/experiments/Flux/config_dmd2.py) where it speaks and DMD2's SDXL
# 4-step run otherwise:
#   4 steps at timesteps 999, 749, 499, 249 (the FLUX path reads t as sigma = (t + 1) / 1000:
#   sigmas 1, .75, .5, .25, what the export's scheduler gives for num_inference_steps=4) with
#   backward simulation, a generator step every 5 fake-score steps (FastGen's student_update_freq
#   5), generator and guidance LR 1e-5 (FastGen, :16-18), a global batch of 64 (GRAD_ACCUM = 64 /
#   GPUs at 1 sample per GPU), no GAN;
#   guidance 2.5 for teacher, fake score and generator (FLUX_GUIDANCE): Kontext [dev] is
#   guidance-distilled, the value goes into its guidance embedding (no CFG pair), and the export is
#   sampled at it (algorithms/dmd2_flow.py says why all three get the same value);
#   1024 px, bf16-mixed, activation checkpointing (without it: 126 GiB per GPU), the fake score in
#   bf16 (FAKE_SCORE_FP32=0: fp32 costs 5.3 GiB more per GPU, and its matmuls in TF32);
#   T5 embeddings of 512 tokens, computed once into TEXT_CACHE_DIR before training (the text
#   encoders are freed then; they run in the compute dtype, as FluxKontextPipeline runs them).
# MAX_STEPS is a starting point, not a published schedule: watch the samples.
# DATA: a .jsonl of Kontext pairs: "control" (or "image") the context image, "prompt" the edit
# instruction, optionally "target" (paths relative to the file).
#
#   MODEL=/models/FLUX.1-Kontext-dev DATA=/data/edits.jsonl bash recipes/dmd_kontext_4step.sh
# NF4 (BASE_DTYPE=nf4) needs torchao: pip install torchao (requirements-dev.txt pins the tested version).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:?set MODEL to a FLUX.1-Kontext diffusers folder (FluxKontextPipeline layout)}
DATA=${DATA:?set DATA to a .jsonl of Kontext pairs: control (or image) + prompt, optional target}
OUT=${OUT:-out/kontext_dmd_4step}
TEXT_CACHE_DIR=${TEXT_CACHE_DIR:-$OUT/text_cache}  # share it between runs on the same prompts
. recipes/lib/common.sh
PER_GPU=$(per_gpu 1 "$@")  # a --batch_size=N override keeps the global batch (GRAD_ACCUM follows)
ACCUM=$(grad_accum 64 $PER_GPU)
exec bash run_fsdp.sh train_dmd.py --model_path="$MODEL" --data_path="$DATA" --output_dir="$OUT" \
    --text_cache_dir="$TEXT_CACHE_DIR" --max_sequence_length=512 \
    --generator_lr=1e-5 --guidance_lr=1e-5 --batch_size=$PER_GPU --grad_accum=$ACCUM \
    --resolution=1024 --flux_guidance=2.5 --dfake_gen_update_ratio=5 \
    --conditioning_timestep=999 --denoising_steps=999,749,499,249 \
    --precision=bf16-mixed --fake_score_fp32=0 --activation_checkpointing=1 \
    --export_dtype=bf16 --max_steps=4000 --save_every=250 --sample_every=250 --log_every=10 --resume=auto "$@"
