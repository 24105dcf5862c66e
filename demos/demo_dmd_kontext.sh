#!/usr/bin/env bash
# DMD2 on FLUX.1 Kontext in miniature, on CPU: distil the "make it blue" editor that
# demos/demo_kontext.sh fine-tunes (TEACHER, a FluxKontextPipeline export; built by that demo when
# the default is missing) into a 4-step and a 1-step student with train_dmd.py, then score five
# rows on the held-out pairs and the retention split (demos/kontext_eval.py): the teacher at 28, 4
# and 1 step (its own scheduler), the 4-step and the 1-step student (their exports' distilled
# scheduler), each at the guidance value it was trained with.
#
#   bash demos/demo_dmd_kontext.sh              # 2 ranks; extra arguments go to both train_dmd.py runs
#   TEACHER=out/my_kontext/export bash demos/demo_dmd_kontext.sh
#
# Ends with each run's training wall time; the table's s / image column is the evaluation's.
set -euo pipefail
cd "$(dirname "$0")/.."  # the repository root
TEACHER=${TEACHER:-out/kontext_demo/export}
OUT=${OUT:-out/kontext_dmd_demo}
NPROC=${NPROC:-2}
# the guidance-embedding value the teacher was fine-tuned and is evaluated at (train_flux_kontext.py's
# GUIDANCE): all three transformers get it, and the students are sampled at it
FLUX_GUIDANCE=${FLUX_GUIDANCE:-1.0}
GRID=${GRID:-$OUT/grid.png}
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
if [ ! -f "$TEACHER/model_index.json" ]; then
    if [ "$TEACHER" != out/kontext_demo/export ]; then
        echo "TEACHER=$TEACHER: no model_index.json, not a FluxKontextPipeline folder" >&2
        exit 1
    fi
    OUT=out/kontext_demo bash demos/demo_kontext.sh  # the teacher: the base fine-tuned on "make it blue"
fi
# students start from the teacher's weights; sized for a 1.8 M-parameter transformer on 2 CPU cores:
# batch 8 per rank, generator and fake-score LR 1e-4, the generator every 5th step (FastGen's
# FLUX ratio), 300 steps (60 generator updates), no EMA; the DM loss's σ range is the default 2-98 %
COMMON=(--model_path="$TEACHER" --data_path=assets/kontext_blue/train.jsonl --text_cache_dir="$OUT/text_cache"
        --resolution=32 --precision=fp32 --fake_score_fp32=1 --flux_guidance="$FLUX_GUIDANCE"
        --generator_lr=1e-4 --guidance_lr=1e-4 --dfake_gen_update_ratio=5 --batch_size=8 --max_steps=300
        --export_dtype=bf16 --save_every=0 --sample_every=100 --log_every=50)
times=()
source demos/dmd_students.sh
train_students "$OUT" "$NPROC" "$@"
trained=$(date +%s)
python -m demos.kontext_eval --task_dir="$OUT/task" --grid="$GRID" --json="$OUT/eval.json" \
    --compare teacher_28=$TEACHER teacher_4=$TEACHER teacher_1=$TEACHER \
    student_4="$OUT/4step/export" student_1="$OUT/1step/export" \
    --steps=28 --steps_for teacher_4=4 teacher_1=1 student_4=4 student_1=1 \
    --guidance="$FLUX_GUIDANCE"
# s / image of each row (generation only, the held-out split)
python - "$OUT/eval.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for name, by_split in r["results"].items():
    print(f"{name}: {r['model_steps'][name]} steps, guidance {r['model_guidance'][name]:g}, "
          f"{by_split['heldout']['s_per_image']:.4f} s / image")
PY
echo "demo: training ${times[*]}; evaluation $(( $(date +%s) - trained )) s; grid $GRID"
