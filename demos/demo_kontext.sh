#!/usr/bin/env bash
# FLUX.1 Kontext in miniature, on CPU: fine-tune the shipped base model (assets/kontext_base,
# rebuilt by `python -m demos.make_kontext_base`; it never saw "blue" as a target) on the shipped
# "make it blue" pairs (assets/kontext_blue/train.jsonl: the train split of demos/kontext_eval.py,
# byte for byte) with train_flux_kontext.py, then evaluate base and fine-tuned model through
# diffusers' FluxKontextPipeline on held-out pairs (demos/kontext_eval.py): edit accuracy,
# shape/position kept (foreground IoU), background kept, and the other recolours the base knew
# (retention).
#
#   bash demos/demo_kontext.sh            # 2 ranks; extra arguments go to train_flux_kontext.py
set -euo pipefail
cd "$(dirname "$0")/.."  # the repository root
OUT=${OUT:-out/kontext_demo}
NPROC=${NPROC:-2}
GRID=${GRID:-$OUT/blue_grid.png}
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
TRAIN=assets/kontext_blue/train.jsonl
# the held-out and retention splits (and the train split, to check the shipped copy against)
GENERATED=$(python -m demos.kontext_eval --make_data="$OUT/task" | awk '$1 == "train" {print $2}')
if ! cmp -s "$TRAIN" "$GENERATED" || ! diff -rq -x '*.jsonl' "$(dirname "$TRAIN")" "$(dirname "$GENERATED")" >/dev/null; then
    echo "$TRAIN is not the generated train split; rebuild it: python -m demos.kontext_eval --make_train=assets/kontext_blue" >&2
    exit 1
fi
start=$(date +%s)
python -m torch.distributed.run --standalone --nproc_per_node="$NPROC" train_flux_kontext.py \
    --model_path=assets/kontext_base --data_path="$TRAIN" --output_dir="$OUT" \
    --precision=fp32 --resolution=32 --batch_size=8 --lr=3e-4 --warmup_steps=20 --weight_decay=0 \
    --max_grad_norm=1.0 --ema_decay=0.99 --export_dtype=bf16 --num_sample_pairs=4 --sample_steps=20 \
    --sample_guidance=1.0 --save_every=0 --log_every=50 --sample_every=300 --max_steps=600 "$@"
trained=$(date +%s)
python -m demos.kontext_eval --compare base=assets/kontext_base tuned="$OUT/export" --task_dir="$OUT/task" \
    --grid="$GRID" --json="$OUT/eval.json"
echo "demo: fine-tuning $((trained - start)) s, evaluation $(( $(date +%s) - trained )) s; grid $GRID"
