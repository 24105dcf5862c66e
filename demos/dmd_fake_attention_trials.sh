#!/usr/bin/env bash
# The fake score's dtype on the shapes demo (docs/dmd2.md, "The fake score's attention"): demo_dmd.sh's
# schedule under PRECISION=bf16-mixed (the published mode; the demo itself runs fp32, where the setting
# changes nothing), per mode: fp32 = the fp32 fake score with its attention in fp32 (published), bf16 = the
# fp32 fake score with bf16 attention (FAKE_SCORE_ATTENTION_DTYPE's default), bf16_fake = the whole fake
# score in bf16 (FAKE_SCORE_FP32=0); each with SEEDS, then each student scored with demos/shapes_eval.py
# (1 step, or DENOISING_STEPS' sampler) into OUT/<mode>_seed<seed>/eval.json.
#
#   bash demos/dmd_fake_attention_trials.sh                          # 1-step, seeds 0 1, 1000 steps
#   STEPS=1000 DENOISING='[999,749,499,249]' OUT=out/fake_attn_4step bash demos/dmd_fake_attention_trials.sh
#   MODES="fp32 bf16_fake" OUT=out/fake_dtype_1step bash demos/dmd_fake_attention_trials.sh
# A stopped trial continues from its newest checkpoint when run again (SAVE_EVERY steps apart; exact resume).
set -euo pipefail
cd "$(dirname "$0")/.."  # the repository root
OUT=${OUT:-out/fake_attention_trials}
NPROC=${NPROC:-2}
STEPS=${STEPS:-1000}
SEEDS=${SEEDS:-0 1}
MODES=${MODES:-fp32 bf16}
DENOISING=${DENOISING:-}
SAVE_EVERY=${SAVE_EVERY:-$STEPS}
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
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
    case $mode in
      bf16_fake) dtype=(--fake_score_fp32=0) ;;
      *) dtype=(--fake_score_attention_dtype="$mode") ;;
    esac
    python -m torch.distributed.run --standalone --nproc_per_node="$NPROC" train_dmd.py --output_dir="$run" \
        --max_steps="$STEPS" --batch_size=16 --generator_lr=2e-4 --guidance_lr=2e-4 --dfake_gen_update_ratio=5 \
        --ema_decay=0.98 --precision=bf16-mixed "${dtype[@]}" --seed="$seed" \
        --log_every=50 --sample_every=0 --save_every="$SAVE_EVERY" --keep_last=1 --resume=auto "${few[@]}"
    python -m demos.shapes_eval --model="$run/export" "${sampler[@]}" --json_out="$run/eval.json"
    echo "$mode seed $seed: $(( $(date +%s) - start )) s"
  done
done
# the table: every run's score, and per mode the mean and the spread between seeds
python - "$OUT" <<'PY'
import glob, json, os, statistics, sys
runs = {}
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*_seed*", "eval.json"))):
    mode, seed = os.path.basename(os.path.dirname(path)).rsplit("_seed", 1)
    runs.setdefault(mode, []).append((int(seed), json.load(open(path))))
print("| fake score (attention) | seed | colour % | shape % | all 3 % | Fréchet dist | diversity |")
print("|---|---:|---:|---:|---:|---:|---:|")
for mode, scores in runs.items():
    for seed, m in scores:
        print(f"| {mode} | {seed} | {m['colour_acc']:.1f} | {m['shape_acc']:.1f} | {m['all_acc']:.1f} "
              f"| {m['fd']:.2f} | {m['diversity']:.2f} |")
    a, d = [m["all_acc"] for _, m in scores], [m["fd"] for _, m in scores]
    print(f"| {mode}: mean (spread between seeds) | | | | {statistics.mean(a):.1f} ({max(a) - min(a):.1f}) "
          f"| {statistics.mean(d):.2f} ({max(d) - min(d):.2f}) | |")
PY
