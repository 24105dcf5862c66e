#!/usr/bin/env bash
# The teacher's CFG in DMD2, measured on CPU (demos/palette_eval.py's CFG split): a teacher that needs its
# true CFG, then students distilled at its CFG with each REAL_GUIDANCE_NORM (and DMD_LOSS), scored against the
# teacher sampled as its pipeline samples. FAMILY=qwen (the default: Qwen-Image-Edit-2509 at 32 px, CFG 4, the
# pipeline's default), flux2 (FLUX.2 [klein]-base at 64 px, CFG 4, its pipeline's default) or z_image (Z-Image
# Omni at 64 px, CFG 6: its pipeline's default guidance_scale 5 in the standard form); the context as their one
# reference.
#   1. the teacher: the family's shipped base fine-tuned on `train_cfg` ("paint it": the four palette colours
#      of each training context; "make it white": as many white edits) with CAPTION_DROPOUT 0.2, so that
#      its unconditional edit (the pipeline's negative) mixes palette colours and white and its true
#      CFG steers "paint it" away from white (skipped when TEACHER is given)
#   2. per REAL_GUIDANCE_NORM (NORMS; Qwen: none, token, scalar) and training seed (SEEDS_TRAIN): a 1-step
#      student (2400 steps, ratio 10) and a 4-step one from its final checkpoint (600 steps, ratio 5), the
#      teacher's real score at CFG (demos/dmd_students.sh)
#   3. the rows, over SEEDS noise seeds per held-out context: the teacher at 28 steps with CFG (its pipeline's
#      own CFG: the reference) and with CFG 1, at 4 steps with CFG, and every student (CFG 1): validity,
#      variety and the saturation error against the 28-step teacher
#
#   bash demos/demo_dmd_cfg.sh                       # 2 ranks; extra arguments go to every train_dmd.py run
#   NORMS="none token" SEEDS_TRAIN=0 bash demos/demo_dmd_cfg.sh
#   RUNS="none:1:0 none:auto:0" bash demos/demo_dmd_cfg.sh   # NORM:SHIFT:SEED students (SHIFT=auto: the σ shift)
#   RUNS="token:1:0:dmd2 token:1:0:decoupled" bash demos/demo_dmd_cfg.sh  # a 4th field: DMD_LOSS
#   FAMILY=z_image RUNS="none:1:0:dmd2 none:1:0:decoupled" bash demos/demo_dmd_cfg.sh
#   EVAL=0 bash demos/demo_dmd_cfg.sh                # train only
#   # another CFG scale (standard form) for the students and the rows, beside the same teacher:
#   FAMILY=z_image CFG=4 OUT=out/cfg_dmd_z_image_cfg4 TEACHER=out/cfg_dmd_z_image/teacher/export \
#       bash demos/demo_dmd_cfg.sh
#
# A student whose export exists is not trained again (an interrupted demo goes on where it stopped).
# Ends with each run's training wall time; the table's s / image column is the evaluation's.
set -euo pipefail
cd "$(dirname "$0")/.."  # the repository root
FAMILY=${FAMILY:-qwen}
SAMPLE_GUIDANCE=1.0
case "$FAMILY" in
    qwen)    BASE=assets/qwen_edit_base; DEFAULT_OUT=out/cfg_dmd_demo; SIZE=32; DEFAULT_CFG=4.0
             DEFAULT_NORMS="none token scalar"; FAMILY_ARGS=(--reference_area=1024 --condition_area=1024) ;;
    # demo_dmd_palette.sh's FLUX.2 and Z-Image settings; Z-Image's norms are its pipeline's (no per-token one)
    flux2)   BASE=assets/flux2_edit_base; DEFAULT_OUT=out/cfg_dmd_flux2; SIZE=64; DEFAULT_CFG=4.0
             DEFAULT_NORMS="none token"; FAMILY_ARGS=(--reference_area=4096 --max_sequence_length=32) ;;
    z_image) BASE=assets/z_image_edit_base; DEFAULT_OUT=out/cfg_dmd_z_image; SIZE=64; DEFAULT_CFG=6.0
             DEFAULT_NORMS="none scalar"; SAMPLE_GUIDANCE=0; FAMILY_ARGS=(--vae_dtype=bf16 --max_sequence_length=32) ;;
    *) echo "FAMILY=$FAMILY: qwen, flux2 or z_image" >&2; exit 1 ;;
esac
OUT=${OUT:-$DEFAULT_OUT}
CFG=${CFG:-$DEFAULT_CFG}  # the teacher's true CFG scale (standard form) for the students and the rows
TEACHER=${TEACHER:-$OUT/teacher/export}
NPROC=${NPROC:-2}
SEEDS=${SEEDS:-32}
NORMS=${NORMS:-$DEFAULT_NORMS}
SEEDS_TRAIN=${SEEDS_TRAIN:-0 1}
if [ -z "${RUNS:-}" ]; then
    RUNS=$(for norm in $NORMS; do for seed in $SEEDS_TRAIN; do echo -n "$norm:1:$seed "; done; done)
fi
EVAL=${EVAL:-1}
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
SPLITS=$(python -m demos.palette_eval --make_data="$OUT/task" --size="$SIZE" --cfg_split=1)
TRAIN=$(awk '$1 == "train" {print $2}' <<< "$SPLITS")
TEACHER_TRAIN=$(awk '$1 == "train_cfg" {print $2}' <<< "$SPLITS")
times=()
if [ ! -f "$TEACHER/model_index.json" ]; then
    if [ "$TEACHER" != "$OUT/teacher/export" ]; then
        echo "TEACHER=$TEACHER: no model_index.json, not a pipeline folder" >&2
        exit 1
    fi
    # demos/demo_dmd_palette.sh's teacher of the family, with caption dropout
    start=$(date +%s)
    python -m torch.distributed.run --standalone --nproc_per_node="$NPROC" train_flux_kontext.py \
        --model_path="$BASE" --data_path="$TEACHER_TRAIN" --output_dir="$OUT/teacher" \
        "${FAMILY_ARGS[@]}" --cache_latents=True --caption_dropout=0.2 \
        --precision=fp32 --resolution="$SIZE" --batch_size=8 --lr=5e-4 --warmup_steps=50 --weight_decay=0 \
        --max_grad_norm=1.0 --ema_decay=0.995 --export_dtype=bf16 --num_sample_pairs=4 --sample_steps=28 \
        --sample_guidance="$SAMPLE_GUIDANCE" --save_every=1000 --log_every=100 --sample_every=1000 --max_steps=6000
    times+=("teacher $(( $(date +%s) - start )) s")
fi
# demos/demo_dmd_palette.sh's Qwen students, the teacher's real score at CFG with the norm under test
source demos/dmd_students.sh
ONE_STEP_ARGS=(--dfake_gen_update_ratio=10 --max_steps=2400 --sample_every=1200 --log_every=100)
FOUR_STEP_ARGS=(--max_steps=600)
FOUR_STEP_FROM_ONE_STEP=1
compare=(teacher_28="$TEACHER" teacher_28_cfg1="$TEACHER" teacher_4="$TEACHER")
steps=(teacher_4=4)
for run in $RUNS; do
    IFS=: read -r norm shift seed loss <<< "$run"
    name=$norm; if [ "$shift" != 1 ]; then name=${norm}_shift_$shift; fi
    loss=${loss:-dmd2}; if [ "$loss" != dmd2 ]; then name=${name}_$loss; fi
    COMMON=(--model_path="$TEACHER" --data_path="$TRAIN" --text_cache_dir="$OUT/text_cache"
            --resolution="$SIZE" "${FAMILY_ARGS[@]}" --precision=fp32 --fake_score_fp32=1 --dmd_loss="$loss"
            --real_guidance_scale="$CFG" --real_guidance_norm="$norm" --shift="$shift" --seed="$seed"
            --generator_lr=1e-4 --guidance_lr=1e-4 --dfake_gen_update_ratio=5 --batch_size=8 --max_steps=300
            --export_dtype=bf16 --save_every=0 --sample_every=100 --log_every=50)
    train_students "$OUT/${name}_seed$seed" "$NPROC" "$@"
    compare+=("${name}_4_s$seed=$OUT/${name}_seed$seed/4step/export"
              "${name}_1_s$seed=$OUT/${name}_seed$seed/1step/export")
    steps+=("${name}_4_s$seed=4" "${name}_1_s$seed=1")
done
if [ "$EVAL" = 0 ]; then echo "demo: training ${times[*]}"; exit 0; fi
trained=$(date +%s)
python -m demos.palette_eval --task_dir="$OUT/task" --size="$SIZE" --grid="$OUT/grid.png" --json="$OUT/eval.json" \
    --seeds="$SEEDS" --compare "${compare[@]}" --steps=28 --steps_for "${steps[@]}" \
    --true_cfg teacher_28="$CFG" teacher_4="$CFG" --reference=teacher_28
echo "demo: training ${times[*]}; evaluation $(( $(date +%s) - trained )) s; grid $OUT/grid.png"
