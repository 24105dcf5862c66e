#!/usr/bin/env bash
# DMD2 where the teacher needs its steps, on CPU: "paint it" (demos/palette_eval.py), an edit with four
# right answers (any of red, green, blue, yellow; the prompt names none), for either flow-matching
# editing family (FAMILY=kontext, the default: FLUX.1 Kontext; FAMILY=qwen: Qwen-Image-Edit-2509; FAMILY=flux2:
# FLUX.2 [klein]-base at 64 px, its pipeline's smallest reference; FAMILY=z_image: Z-Image Omni at 64 px; the
# last three with the context as their one reference, true CFG off everywhere).
#   1. the teacher: the family's shipped base (assets/kontext_base, qwen_edit_base, flux2_edit_base or
#      z_image_edit_base) fine-tuned on the 512 training contexts, each with all four palette colours as
#      targets (2048 pairs; train_flux_kontext.py; skipped when TEACHER is given)
#   2. a 1-step and a 4-step student distilled from it with train_dmd.py (demos/demo_dmd_kontext.sh's
#      settings): the 1-step one first, with twice the fake-score updates (on Kontext 2400 steps after a
#      first 2400-step stage with DMD's regression loss on the teacher's ODE, weight 0.25; on Qwen 4800
#      steps), then the 4-step one from its final checkpoint (300 steps; on Qwen 600)
#   3. five rows scored over SEEDS noise seeds per held-out context: the teacher at 28, 4 and 1 step (its
#      own scheduler), the 4-step and the 1-step student (their exports' distilled scheduler): validity
#      (one saturated palette colour, shape and background kept) and variety (colour entropy over seeds,
#      in % of the 28-step teacher's)
#
#   bash demos/demo_dmd_palette.sh              # 2 ranks; extra arguments go to both train_dmd.py runs
#   FAMILY=qwen bash demos/demo_dmd_palette.sh  # the same with Qwen-Image-Edit (out/palette_dmd_qwen)
#   FAMILY=flux2 bash demos/demo_dmd_palette.sh # the same with FLUX.2 [klein] (out/palette_dmd_flux2)
#   FAMILY=z_image bash demos/demo_dmd_palette.sh  # the same with Z-Image Omni (out/palette_dmd_z_image)
#   TEACHER=out/my_palette_teacher/export bash demos/demo_dmd_palette.sh
#   # a second training seed beside the same teacher, whose rows are read from the first run's scores:
#   FAMILY=flux2 TEACHER=out/palette_dmd_flux2/teacher/export SCORED=out/palette_dmd_flux2/eval.json \
#       OUT=out/palette_dmd_flux2_seed1 bash demos/demo_dmd_palette.sh --seed=1
#
# Ends with each run's training wall time; the table's s / image column is the evaluation's.
set -euo pipefail
cd "$(dirname "$0")/.."  # the repository root
FAMILY=${FAMILY:-kontext}
SIZE=32
SAMPLE_GUIDANCE=1.0  # the teacher fine-tune's sample grids: guidance 1 (Z-Image: 0, its pipeline's CFG off)
case "$FAMILY" in
    # the family's base and what its runs add: Kontext's guidance value (the teacher is fine-tuned at
    # 1.0); Qwen's 32^2 reference areas (the base's) and teacher CFG off (the teacher has no negative)
    # Kontext's 1-step student first trains with DMD's regression loss (docs/demos.md: its variety)
    kontext) BASE=assets/kontext_base; DEFAULT_OUT=out/palette_dmd_demo; TEACHER_STEPS=2000
             TUNE_ARGS=(); DMD_ARGS=(--flux_guidance=1.0); EVAL_ARGS=(); ONE_STEP_STEPS=2400
             ONE_STEP_STAGE1_ARGS=(--regression_weight=0.25) ;;
    # the 1-step teacher row samples x - v at σ 1 with the scheduler's shift off: Qwen-Image's terminal
    # stretch (shift_terminal 0.02) divides by zero at 1 step, so its own 1-step σ list is NaN
    # the Qwen base learns edits slower (demos/demo_qwen_edit.sh): its teacher trains 3x longer, and its
    # 1-step student one stage of 4800 steps (DMD's regression loss costs it validity: docs/demos.md)
    qwen)    BASE=assets/qwen_edit_base; DEFAULT_OUT=out/palette_dmd_qwen; TEACHER_STEPS=6000; ONE_STEP_STEPS=4800
             FOUR_STEP_ARGS=(--max_steps=600)
             TUNE_ARGS=(--reference_area=1024 --condition_area=1024 --cache_latents=True)
             DMD_ARGS=(--reference_area=1024 --condition_area=1024 --real_guidance_scale=1.0)
             EVAL_ARGS=(--neutral_sigmas teacher_1) ;;
    # FLUX.2 [klein]: 64 px (Flux2ImageProcessor refuses a smaller reference), prompts to 32 tokens, the
    # Qwen settings otherwise (its base was pre-trained as the Qwen base was)
    flux2)   BASE=assets/flux2_edit_base; DEFAULT_OUT=out/palette_dmd_flux2; TEACHER_STEPS=6000; ONE_STEP_STEPS=4800
             SIZE=64; FOUR_STEP_ARGS=(--max_steps=600)
             TUNE_ARGS=(--reference_area=4096 --max_sequence_length=32 --cache_latents=True)
             DMD_ARGS=(--reference_area=4096 --max_sequence_length=32 --real_guidance_scale=1.0)
             EVAL_ARGS=() ;;
    # Z-Image Omni: FLUX.2's settings but its pipeline's reference rule (no REFERENCE_AREA), its VAE in bf16
    # (ZImageOmniPipeline encodes references in bf16), samples with CFG off (its guidance_scale 0)
    z_image) BASE=assets/z_image_edit_base; DEFAULT_OUT=out/palette_dmd_z_image; TEACHER_STEPS=6000
             ONE_STEP_STEPS=4800; SIZE=64; FOUR_STEP_ARGS=(--max_steps=600); SAMPLE_GUIDANCE=0
             TUNE_ARGS=(--vae_dtype=bf16 --max_sequence_length=32 --cache_latents=True)
             DMD_ARGS=(--vae_dtype=bf16 --max_sequence_length=32 --real_guidance_scale=1.0)
             EVAL_ARGS=() ;;
    *) echo "FAMILY=$FAMILY: kontext, qwen, flux2 or z_image" >&2; exit 1 ;;
esac
OUT=${OUT:-$DEFAULT_OUT}
TEACHER=${TEACHER:-$OUT/teacher/export}
NPROC=${NPROC:-2}
SEEDS=${SEEDS:-32}
GRID=${GRID:-$OUT/grid.png}
SCORED=${SCORED:-}  # an earlier run's eval.json: its rows of the same models and settings are read, not sampled
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
SPLITS=$(python -m demos.palette_eval --make_data="$OUT/task" --size="$SIZE")
TRAIN=$(awk '$1 == "train" {print $2}' <<< "$SPLITS")
# the teacher sees every right edit of each context: trained on one random colour per context it learns
# that colour (a per-context key: Qwen's text encoder sees the context image) and keeps less variety
TEACHER_TRAIN=$(awk '$1 == "train_all_colours" {print $2}' <<< "$SPLITS")
times=()
if [ ! -f "$TEACHER/model_index.json" ]; then
    if [ "$TEACHER" != "$OUT/teacher/export" ]; then
        echo "TEACHER=$TEACHER: no model_index.json, not a pipeline folder" >&2
        exit 1
    fi
    # demos/demo_kontext.sh's fine-tune, longer (a distribution of four edits takes longer to learn than
    # one): batch 8 per rank, LR 5e-4, EMA 0.995, TEACHER_STEPS steps
    start=$(date +%s)
    python -m torch.distributed.run --standalone --nproc_per_node="$NPROC" train_flux_kontext.py \
        --model_path="$BASE" --data_path="$TEACHER_TRAIN" --output_dir="$OUT/teacher" "${TUNE_ARGS[@]}" \
        --precision=fp32 --resolution="$SIZE" --batch_size=8 --lr=5e-4 --warmup_steps=50 --weight_decay=0 \
        --max_grad_norm=1.0 --ema_decay=0.995 --export_dtype=bf16 --num_sample_pairs=4 --sample_steps=28 \
        --sample_guidance="$SAMPLE_GUIDANCE" --save_every=1000 --log_every=100 --sample_every=1000 \
        --max_steps="$TEACHER_STEPS"
    times+=("teacher $(( $(date +%s) - start )) s")
fi
# demos/demo_dmd_kontext.sh's students: from the teacher's weights, batch 8 per rank, generator and
# fake-score LR 1e-4, the generator every 5th step, 300 steps, no EMA
COMMON=(--model_path="$TEACHER" --data_path="$TRAIN" --text_cache_dir="$OUT/text_cache"
        --resolution="$SIZE" --precision=fp32 --fake_score_fp32=1 "${DMD_ARGS[@]}"
        --generator_lr=1e-4 --guidance_lr=1e-4 --dfake_gen_update_ratio=5 --batch_size=8 --max_steps=300
        --export_dtype=bf16 --save_every=0 --sample_every=100 --log_every=50)
# the 1-step student gets twice the fake-score updates per generator update (ratio 10, the published
# SD-1.5 value) and 240 or 480 generator updates (per stage); the 4-step one the Kontext demo's 60 at ratio 5
# (Qwen: 120), starting from the 1-step student: it keeps more of the teacher's colours than one started
# from the teacher (docs/demos.md)
ONE_STEP_ARGS=(--dfake_gen_update_ratio=10 --max_steps="$ONE_STEP_STEPS" --sample_every=1200 --log_every=100)
FOUR_STEP_FROM_ONE_STEP=1
source demos/dmd_students.sh
train_students "$OUT" "$NPROC" "$@"
trained=$(date +%s)
python -m demos.palette_eval --task_dir="$OUT/task" --size="$SIZE" --grid="$GRID" --json="$OUT/eval.json" --seeds="$SEEDS" \
    --compare teacher_28="$TEACHER" teacher_4="$TEACHER" teacher_1="$TEACHER" \
    student_4="$OUT/4step/export" student_1="$OUT/1step/export" \
    --steps=28 --steps_for teacher_4=4 teacher_1=1 student_4=4 student_1=1 "${EVAL_ARGS[@]}" \
    ${SCORED:+--scored="$SCORED"}
echo "demo: training ${times[*]}; evaluation $(( $(date +%s) - trained )) s; grid $GRID"
