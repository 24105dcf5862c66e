#!/usr/bin/env bash
# Wan 2.2 T2V-A14B to a 4-step Wan by DMD2 with both experts, as the 4-step Lightning LoRAs: each student step, the
# teacher's and the fake score's calls use the expert the pipeline would use at their σ (transformer at σ·1000 >=
# boundary_ratio·1000 = 875, transformer_2 below); a LoRA of rank 64 per expert for the generator and for the fake
# score, the bf16 teachers, AC, 81 frames at 480p, the teacher's CFG per expert as Wan 2.2 samples T2V-A14B: 4 on
# the high-noise expert, 3 on the low-noise one (Wan-Video/Wan2.2 wan/configs/wan_t2v_A14B.py, sample_guide_scale =
# (3.0, 4.0), low noise first; WanPipeline's guidance_scale=4.0, guidance_scale_2=3.0).
# `python tools/memory_plan.py --model=wan2.2-t2v-a14b --world_size=8 --lora_rank=64 --fake_lora=1
# --activation_checkpointing=1 --gpu_memory_gb=80` plans 47.1 GiB per GPU for the six transformers (the
# text-cache fill 9.4; planned, not measured);
# on 2 nodes (HSDP, one replica per node: --world_size=16 --dp_replicate=2) the same 47.1 per GPU.
# The export is two LoRA files: load_lora_weights(export) and load_lora_weights(export/transformer_2,
# load_into_transformer_2=True) (docs/families/wan.md).
#
#   MODEL=/models/Wan2.2-T2V-A14B-Diffusers DATA=/data/prompts.txt bash recipes/dmd_wan22_a14b_lora_8x80gb.sh
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 MODEL=... DATA=... bash recipes/dmd_wan22_a14b_lora_8x80gb.sh
set -euo pipefail
cd "$(dirname "$0")/.."
. recipes/lib/common.sh  # NNODES / SLURM: HSDP with one replica per node
MODEL=${MODEL:?set MODEL to a Wan 2.2 T2V-A14B diffusers folder (transformer and transformer_2)}
DATA=${DATA:?set DATA to a .txt of prompts, or a .jsonl with "prompt"}
OUT=${OUT:-out/wan22_a14b_dmd_4step_lora}
TEXT_CACHE_DIR=${TEXT_CACHE_DIR:-$OUT/text_cache}  # share it between runs on the same prompts
exec bash run_fsdp.sh train_dmd.py --model_path="$MODEL" --data_path="$DATA" \
    --output_dir="$OUT" --text_cache_dir="$TEXT_CACHE_DIR" --lora_rank=64 --lora_alpha=64 --fake_lora=1 \
    --generator_lr=5e-5 --guidance_lr=5e-5 --batch_size=1 --real_guidance_scale=4.0 --real_guidance_scale_2=3.0 \
    --dfake_gen_update_ratio=5 --conditioning_timestep=999 --denoising_steps=999,749,499,249 \
    --precision=bf16-mixed --fake_score_fp32=0 --activation_checkpointing=1 --export_dtype=bf16 --max_steps=4000 \
    --save_every=250 --sample_every=250 --log_every=10 --resume=auto "$@"
