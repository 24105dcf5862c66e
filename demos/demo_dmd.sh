#!/usr/bin/env bash
# DMD2 in miniature, on CPU: distil the shipped shapes teacher (assets/shapes_teacher, rebuilt by
# `python -m demos.make_teacher`) into a 1-step generator with train_dmd.py, then score three ways
# on the shapes task (demos/shapes_eval.py): the teacher with 25 DDIM steps and CFG 2, the teacher
# with 1 step, the student with 1 step. Prints the table; writes the side-by-side grid.
#
#   bash demos/demo_dmd.sh                 # 2 ranks; extra arguments go to train_dmd.py
#   NPROC=1 bash demos/demo_dmd.sh --batch_size=16
set -euo pipefail
cd "$(dirname "$0")/.."  # the repository root
OUT=${OUT:-out/dmd_demo}
NPROC=${NPROC:-2}
GRID=${GRID:-$OUT/shapes_grid.png}
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
start=$(date +%s)
# the published method (DM loss, teacher CFG 1.75, t in [2 %, 98 %], fake score every step, two
# time scales); the schedule is sized for a 1 M-parameter UNet on 2 CPU cores: a larger batch and
# LR than SD-1.5's, the generator every 5th step (DMD2's SDXL / ImageNet ratio), an EMA
python -m torch.distributed.run --standalone --nproc_per_node="$NPROC" train_dmd.py --output_dir="$OUT" \
    --max_steps=1000 --batch_size=16 --generator_lr=2e-4 --guidance_lr=2e-4 --dfake_gen_update_ratio=5 \
    --ema_decay=0.98 --precision=fp32 --log_every=50 --sample_every=200 --save_every=400 "$@"
trained=$(date +%s)
python -m demos.shapes_eval --compare teacher=assets/shapes_teacher student="$OUT/export" --cfg=2 \
    --grid="$GRID" --grid_every=5 --json_out="$OUT/compare.json"
echo "demo: training $((trained - start)) s, evaluation $(( $(date +%s) - trained )) s; grid $GRID"
