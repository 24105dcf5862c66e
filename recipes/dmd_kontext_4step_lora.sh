#!/usr/bin/env bash
# DMD2 with a FLUX.1 Kontext [dev] teacher, LoRA variant for 8 x 24 GB GPUs (e.g. RTX 4090), on
# FSDP2: recipes/dmd_kontext_4step.sh (4 steps, guidance 2.5, ratio 5, 1024 px, AC, bf16 fake
# score; read its header) with LoRA adapters on the generator and the fake score (FAKE_LORA=1) and
# every 12 B base in 4-bit NF4 (BASE_DTYPE=nf4: the two LoRA bases and the frozen teacher).
# `python tools/memory_plan.py --model=flux-kontext-dmd --world_size=8 --resolution=1024
# --activation_checkpointing=1 --fake_score_fp32=0 --lora_rank=64 --lora_alpha=8 --fake_lora=1
# --base_dtype=nf4 --gpu_memory_gb=24` plans 8.6 GiB per GPU (docs/planner.md); with bf16 bases
# (--base_dtype=) it plans 15.5 GiB, also within 24 GB and faster per step, with less headroom.
# LoRA as the published DMD2 LoRA run (recipes/dmd_sdxl_4step_lora.sh): rank 64, alpha 8, peft's
# default init, generator and guidance LR 5e-5, on FLUX's default targets (families/flux/parallelism.py);
# the published run trains its fake score fully, which does not fit 24 GB here.
# NF4 takes no HSDP (lowbit.check_lowbit): on several nodes this recipe shards over all GPUs.
#
#   MODEL=/models/FLUX.1-Kontext-dev DATA=/data/edits.jsonl bash recipes/dmd_kontext_4step_lora.sh
# NF4 (BASE_DTYPE=nf4) needs torchao: pip install torchao (requirements-dev.txt pins the tested version).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:?set MODEL to a FLUX.1-Kontext diffusers folder (FluxKontextPipeline layout)}
DATA=${DATA:?set DATA to a .jsonl of Kontext pairs: control (or image) + prompt, optional target}
OUT=${OUT:-out/kontext_dmd_4step_lora}
TEXT_CACHE_DIR=${TEXT_CACHE_DIR:-$OUT/text_cache}  # share it between runs on the same prompts
HSDP_PER_NODE=${HSDP_PER_NODE:-0}
. recipes/lib/common.sh
PER_GPU=$(per_gpu 1 "$@")  # a --batch_size=N override keeps the global batch (GRAD_ACCUM follows)
ACCUM=$(grad_accum 64 $PER_GPU)
exec bash run_fsdp.sh train_dmd.py --model_path="$MODEL" --data_path="$DATA" --output_dir="$OUT" \
    --text_cache_dir="$TEXT_CACHE_DIR" --max_sequence_length=512 \
    --lora_rank=64 --lora_alpha=8 --lora_init=default --fake_lora=1 --base_dtype=nf4 \
    --generator_lr=5e-5 --guidance_lr=5e-5 --batch_size=$PER_GPU --grad_accum=$ACCUM \
    --resolution=1024 --flux_guidance=2.5 --dfake_gen_update_ratio=5 \
    --conditioning_timestep=999 --denoising_steps=999,749,499,249 \
    --precision=bf16-mixed --fake_score_fp32=0 --activation_checkpointing=1 \
    --export_dtype=bf16 --max_steps=4000 --save_every=250 --sample_every=250 --log_every=10 --resume=auto "$@"
