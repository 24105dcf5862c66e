#!/usr/bin/env bash
# DMD2's full recipe in miniature, on CPU, after demos/demo_dmd.sh's stage 1:
#   stage 2   the GAN stage: generator and fake score start from stage 1's checkpoint (INIT_FROM),
#             the teacher stays the original model, USE_GAN=1 on the teacher's shipped real images
#             (assets/shapes_teacher/data.jsonl), the published GAN weights (1e-3 generator, 1e-2 head)
#             and diffusion GAN over the whole range;
#   4-step    the few-step generator (DENOISING_STEPS 999/749/499/249, backward simulation), also
#             from stage 1's checkpoint;
# then one evaluation (demos/shapes_eval.py) of the teacher (25-step DDIM, CFG 2; and 1 step),
# stage 1, stage 2 (1 step) and the 4-step generator, on the same prompts and noise.
#
#   bash demos/demo_dmd_full.sh                      # runs stage 1 too (demo_dmd.sh) unless STAGE1 is set
#   STAGE1=out/dmd_demo bash demos/demo_dmd_full.sh  # reuse a finished stage-1 demo run
#   STAGE2_STEPS=400 FOUR_STEP_STEPS=400 NPROC=2 bash demos/demo_dmd_full.sh
set -euo pipefail
cd "$(dirname "$0")/.."  # the repository root
OUT=${OUT:-out/dmd_full}
NPROC=${NPROC:-2}
STAGE2_STEPS=${STAGE2_STEPS:-400}
FOUR_STEP_STEPS=${FOUR_STEP_STEPS:-400}
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
start=$(date +%s)
if [ -z "${STAGE1:-}" ]; then
  STAGE1=$OUT/stage1
  OUT=$STAGE1 GRID=$STAGE1/shapes_grid.png NPROC=$NPROC bash demos/demo_dmd.sh
fi
# the last complete checkpoint of stage 1 (checkpoints/step_XXXXXX, zero-padded: sorts by step)
ckpt=$(ls -d "$STAGE1"/checkpoints/step_* | sort | tail -n 1)
stage1=$(date +%s)
# the stage-1 demo's schedule (batch 16 per rank, LR 2e-4, ratio 5, EMA 0.98), continued from its weights;
# a sample grid at the end of each run only (SAMPLE_EVERY >= the run's length)
common=(--batch_size=16 --generator_lr=2e-4 --guidance_lr=2e-4 --dfake_gen_update_ratio=5 --ema_decay=0.98
        --precision=fp32 --log_every=50 --sample_every=100000 --init_from="$ckpt")
run() { python -m torch.distributed.run --standalone --nproc_per_node="$NPROC" train_dmd.py "$@"; }
run --output_dir="$OUT/stage2" --max_steps="$STAGE2_STEPS" --save_every="$STAGE2_STEPS" "${common[@]}" \
    --use_gan=1 --gen_cls_loss_weight=1e-3 --guidance_cls_loss_weight=1e-2 --diffusion_gan_max_timestep=1000
stage2=$(date +%s)
run --output_dir="$OUT/four_step" --max_steps="$FOUR_STEP_STEPS" --save_every="$FOUR_STEP_STEPS" "${common[@]}" \
    --denoising_steps=[999,749,499,249]
four=$(date +%s)
python -m demos.shapes_eval --compare teacher=assets/shapes_teacher stage1="$STAGE1/export" \
    stage2="$OUT/stage2/export" four_step="$OUT/four_step/export@4" --cfg=2 \
    --grid="$OUT/shapes_grid.png" --grid_every=5 --json_out="$OUT/compare.json"
echo "demo: stage 1 $((stage1 - start)) s, stage 2 $((stage2 - stage1)) s, 4-step $((four - stage2)) s," \
     "evaluation $(( $(date +%s) - four )) s; grid $OUT/shapes_grid.png"
