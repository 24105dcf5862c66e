#!/usr/bin/env bash
# FLUX.2 [dev] (32 B) to a 4-step [dev] by DMD2, editing with references: a LoRA generator and a LoRA fake score
# of rank 64, every base and the teacher in NF4, AC, 1024^2, a bf16 fake score; all three transformers take the
# guidance embedding's FLUX_GUIDANCE (4: Flux2Pipeline's default), no CFG pair.
# `python tools/memory_plan.py --model=flux2-dev-dmd --world_size=1 --resolution=1024
# --activation_checkpointing=1 --fake_score_fp32=0 --lora_rank=64 --fake_lora=1 --base_dtype=nf4
# --gpu_memory_gb=80` plans 71.1 GiB on one 80 GB GPU (the fill of the 24 B Mistral-Small, whole: 52.9);
# NPROC=2: 43.2 (fill sharded, 35.2); NPROC=8: 22.4 (18.4). Planned, not measured; docs/planner.md.
#
#   MODEL=/models/FLUX.2-dev DATA=/data/edits.jsonl NPROC=2 bash recipes/dmd_flux2_dev_4step_lora.sh
# NF4 (BASE_DTYPE=nf4) needs torchao: pip install torchao (requirements-dev.txt pins the tested version).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:?set MODEL to a FLUX.2 [dev] diffusers folder (Flux2Pipeline layout)}
DATA=${DATA:?set DATA to edit rows with "control" image(s) and a "prompt", or a .txt of prompts}
OUT=${OUT:-out/flux2_dev_dmd_4step_lora}
TEXT_CACHE_DIR=${TEXT_CACHE_DIR:-$OUT/text_cache}
export NPROC=${NPROC:-1}
exec bash run_fsdp.sh train_dmd.py --model_path="$MODEL" --data_path="$DATA" --output_dir="$OUT" \
    --text_cache_dir="$TEXT_CACHE_DIR" --lora_rank=64 --lora_alpha=64 --fake_lora=1 --base_dtype=nf4 \
    --generator_lr=5e-5 --guidance_lr=5e-5 --batch_size=1 --resolution=1024 --flux_guidance=4.0 \
    --dfake_gen_update_ratio=5 --conditioning_timestep=999 --denoising_steps=999,749,499,249 \
    --precision=bf16-mixed --fake_score_fp32=0 --activation_checkpointing=1 \
    --export_dtype=bf16 --max_steps=4000 --save_every=250 --sample_every=250 --log_every=10 --resume=auto "$@"
