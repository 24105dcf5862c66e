#!/usr/bin/env bash
# The fake score's attention dtype on the shapes demo (docs/dmd2.md, "The fake score's attention"):
# demo_dmd.sh's schedule under PRECISION=bf16-mixed (the published mode; the demo itself runs fp32,
# where the setting changes nothing), the fp32 fake score with its attention in fp32 (published) and
# in bf16 (FAKE_SCORE_ATTENTION_DTYPE's default), each with SEEDS, then each student scored with
# demos/shapes_eval.py (1 step, or DENOISING_STEPS' sampler) into OUT/<mode>_seed<seed>/eval.json.
#
#   bash demos/dmd_fake_attention_trials.sh                          # 1-step, seeds 0 1, 1000 steps
#   STEPS=1000 DENOISING='[999,749,499,249]' OUT=out/fake_attn_4step bash demos/dmd_fake_attention_trials.sh
set -euo pipefail
cd "$(dirname "$0")/.."  # the repository root
OUT=${OUT:-out/fake_attention_trials}
NPROC=${NPROC:-2}
STEPS=${STEPS:-1000}
SEEDS=${SEEDS:-0 1}
MODES=${MODES:-fp32 bf16}
DENOISING=${DENOISING:-}
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
few=()
sampler=(--sampler=onestep)
if [ -n "$DENOISING" ]; then
  few=(--denoising_steps="$DENOISING")
  n=$(tr -cd , <<< "$DENOISING" | wc -c)
  sampler=(--sampler=fewstep --steps=$((n + 1)))
fi
for seed in $SEEDS; do
  for mode in $MODES; do
    run="$OUT/${mode}_seed$seed"
    [ -f "$run/eval.json" ] && continue
    start=$(date +%s)
    python -m torch.distributed.run --standalone --nproc_per_node="$NPROC" train_dmd.py --output_dir="$run" \
        --max_steps="$STEPS" --batch_size=16 --generator_lr=2e-4 --guidance_lr=2e-4 --dfake_gen_update_ratio=5 \
        --ema_decay=0.98 --precision=bf16-mixed --fake_score_attention_dtype="$mode" --seed="$seed" \
        --log_every=50 --sample_every=0 --save_every="$STEPS" --keep_last=1 "${few[@]}"
    python -m demos.shapes_eval --model="$run/export" "${sampler[@]}" --json_out="$run/eval.json"
    echo "$mode seed $seed: $(( $(date +%s) - start )) s"
  done
done
