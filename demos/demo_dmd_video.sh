#!/usr/bin/env bash
# DMD2 of a Wan video teacher on CPU: "a red or blue square moving left" (demos/video_eval.py), 9 frames at 32 px, a
# shape of either named colour moving a named way from any start (two colours and many starts right per prompt).
#   1. the teacher: assets/wan_video_base (demos/make_wan_video_base.py builds it), a WanPipeline folder
#   2. a 1-step and a 4-step student distilled from it with train_dmd.py on the 48 training prompts (full
#      fine-tuning, the teacher's CFG off as the base samples, 32 text tokens as it was trained): the 1-step one
#      first (4800 steps at ratio 10), then the 4-step one from its final checkpoint (600 steps at ratio 5;
#      demos/dmd_students.sh); REGRESSION=W adds a first 1-step stage with DMD's regression loss at weight W;
#      GAN=1 adds DMD2's GAN stage on the task's real clips (the 1-step student's second stage, the 4-step one's)
#   3. five rows scored over SEEDS noise seeds per held-out prompt (24): the teacher at 28, 4 and 1 step (its UniPC
#      scheduler), the 4-step and the 1-step student (their exports' distilled scheduler): validity (every frame
#      the named shape in one of the two colours), motion (the named way, monotonic), consistency, variety (the
#      spread of the start positions over seeds, px and % of the 28-step teacher's), colour entropy
# The runs go one after another: two train_dmd.py runs side by side on 2 cores each ran ~100 x slower (each took
# both cores, its OpenMP threads spinning; OMP_WAIT_POLICY=PASSIVE, set below, lets a run share the cores).
#
#   bash demos/demo_dmd_video.sh                # extra arguments go to both train_dmd.py runs
#   # a second training seed beside the same teacher, whose rows are read from the first run's scores:
#   SCORED=out/video_dmd/eval.json OUT=out/video_dmd_seed1 bash demos/demo_dmd_video.sh --seed=1
#   # with DMD2's GAN stage on the task's real clips (16 per training prompt, 9-frame GIFs):
#   GAN=1 OUT=out/video_dmd_gan SCORED=out/video_dmd/eval.json bash demos/demo_dmd_video.sh
#
# Ends with each run's training wall time; the table's s / clip column is the evaluation's.
set -euo pipefail
cd "$(dirname "$0")/.."  # the repository root
OUT=${OUT:-out/video_dmd}
TEACHER=${TEACHER:-assets/wan_video_base}
NPROC=${NPROC:-1}
SEEDS=${SEEDS:-16}
STRIP=${STRIP:-$OUT/strip.png}
SCORED=${SCORED:-}  # an earlier run's eval.json: its rows of the same models and steps are read, not sampled
ONE_STEP_STEPS=${ONE_STEP_STEPS:-4800}
FOUR_STEP_STEPS=${FOUR_STEP_STEPS:-600}
REGRESSION=${REGRESSION:-0}  # > 0: the 1-step student's first stage adds DMD's regression loss at this weight
GAN=${GAN:-0}  # 1: DMD2's GAN stage on the task's real clips (REAL_CLIPS per training prompt), below
REAL_CLIPS=${REAL_CLIPS:-16}
GAN_STEPS=${GAN_STEPS:-1200}  # the 1-step student's GAN stage
GAN_WEIGHTS=${GAN_WEIGHTS:-"1e-1 1"}  # generator / head loss weights (100 x published: docs/demos.md's trials)
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
if [ ! -f "$TEACHER/model_index.json" ]; then
    echo "TEACHER=$TEACHER: no model_index.json (python -m demos.make_wan_video_base builds assets/wan_video_base)" >&2
    exit 1
fi
if [ "$GAN" = 1 ]; then clips=$REAL_CLIPS; else clips=0; fi
SPLITS=$(python -m demos.video_eval --make_data="$OUT/task" --real_clips="$clips")
TRAIN=$(awk '$1 == "train" {print $2}' <<< "$SPLITS")
TRAIN_REAL=$(awk '$1 == "train_real" {print $2}' <<< "$SPLITS")
times=()
# the palette demos' students: from the teacher's weights, batch 8 per rank, generator and fake-score LR 1e-4,
# the generator every 5th step (the 1-step one every 10th), no EMA; the video: 9 frames at 32 x 32
COMMON=(--model_path="$TEACHER" --data_path="$TRAIN" --text_cache_dir="$OUT/text_cache"
        --resolution=32 --bucket_aspects=1.0 --num_frames=9 --max_sequence_length=32
        --precision=fp32 --real_guidance_scale=1.0
        --generator_lr=1e-4 --guidance_lr=1e-4 --dfake_gen_update_ratio=5 --batch_size=8
        --max_steps="$FOUR_STEP_STEPS" --export_dtype=fp32 --save_every=0 --sample_every=0 --log_every=50)
ONE_STEP_ARGS=(--dfake_gen_update_ratio=10 --max_steps="$ONE_STEP_STEPS")
FOUR_STEP_ARGS=()
if [ "$GAN" = 1 ] && [ "$REGRESSION" != 0 ]; then
    echo "GAN=1 with REGRESSION=$REGRESSION: each adds a 1-step stage; give one" >&2
    exit 1
fi
if [ "$GAN" = 1 ]; then
    # DMD2's two stages: the 1-step student without the GAN (1step_stage1, the demo's 1-step student), then
    # GAN_STEPS more with it; the 4-step one from the first stage, with it. The same prompts, each row with one of
    # its real clips
    read -r gen_w head_w <<< "$GAN_WEIGHTS"
    gan=(--use_gan=1 --data_path="$TRAIN_REAL" --gen_cls_loss_weight="$gen_w" --guidance_cls_loss_weight="$head_w")
    ONE_STEP_ARGS=(--dfake_gen_update_ratio=10 --max_steps="$GAN_STEPS" "${gan[@]}")
    ONE_STEP_STAGE1_ARGS=(--use_gan=0 --data_path="$TRAIN" --max_steps="$ONE_STEP_STEPS")
    FOUR_STEP_ARGS=("${gan[@]}")
    FOUR_STEP_FROM=1step_stage1
elif [ "$REGRESSION" != 0 ]; then
    ONE_STEP_STAGE1_ARGS=(--regression_weight="$REGRESSION")
fi
FOUR_STEP_FROM_ONE_STEP=1
source demos/dmd_students.sh
train_students "$OUT" "$NPROC" "$@"
trained=$(date +%s)
python -m demos.video_eval --seeds="$SEEDS" --json="$OUT/eval.json" --strip="$STRIP" \
    --compare teacher_28="$TEACHER" teacher_4="$TEACHER" teacher_1="$TEACHER" student_4="$OUT/4step/export" \
    student_1="$OUT/1step/export" --steps=28 --steps_for teacher_4=4 teacher_1=1 student_4=4 student_1=1 \
    ${SCORED:+--scored="$SCORED"}
echo "demo: training ${times[*]}; evaluation $(( $(date +%s) - trained )) s; strip $STRIP"
