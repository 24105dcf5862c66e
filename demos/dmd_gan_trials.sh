#!/usr/bin/env bash
# The GAN-stage trials of the trials table of docs/dmd2_gan_trials.md, "Research note", on CPU: each continues the stage-1 demo
# checkpoint (demos/demo_dmd.sh) for STEPS steps with stage 1's schedule, then scores it (1 step,
# demos/shapes_eval.py). Trials:
#   control   no GAN (stage 1 continued: what the extra steps alone give)
#   published144  demo_dmd_full.sh's stage 2: the published GAN weights (1e-3 / 1e-2, head noise
#             t < 1000) on the teacher's 144 shipped real images
#   real2304  the published GAN weights (1e-3 / 1e-2, head noise t < 1000) on 2304 real images
#             (64 per prompt, rendered by demos/make_teacher.write_data with another seed than the
#             144 shipped ones) instead of 144
#   x10_t250  GAN weights x10 (1e-2 / 1e-1) and head noise t < 250, on the 2304 images
#   scaled_t250  the generator's GAN weight matched to SDXL's balance against the DM loss (see
#             below): 8e-2, head 1e-1, head noise t < 250, 2304 images
#   strong_t250  a generator GAN weight past that balance: 3e-1, head 1e-1, t < 250, 2304 images
#   up_x10_t250     as x10_t250, the head on the fake UNet's up-path output (GAN_HEAD_FEATURES=up:
#                   32 channels at 8x8) instead of its 4x4 bottleneck
#   up_scaled_t250  as scaled_t250, with that head
#
# Why "scaled": loss_dm is a mean over latent elements (official sd_guidance.py compute_distribution_
# matching_loss, reduction="mean"), so its gradient per image shrinks as 1/sqrt(elements) while the
# head's does not; the published weights were set for 64x64 (SD-1.5, 1e-3) and 128x128 (SDXL,
# 5e-3) latents. Holding SDXL's ratio at this demo's 8x8 latents: 5e-3 * sqrt(128*128/(8*8)) = 8e-2.
#
#   STAGE1=out/dmd_demo bash demos/dmd_gan_trials.sh          # control, real2304 and x10_t250
#   STAGE1=out/dmd_demo TRIALS="control scaled_t250" STEPS=1200 bash demos/dmd_gan_trials.sh
# Each trial writes OUT/<trial>/ and its 1-step score OUT/<trial>/eval.json (demos/shapes_eval.py,
# the same prompts and noise as demo_dmd_full.sh's table, whose teacher rows it does not recompute),
# so calls for different trials can run at once.
set -euo pipefail
cd "$(dirname "$0")/.."  # the repository root
STAGE1=${STAGE1:?set STAGE1 to a finished demos/demo_dmd.sh output folder (its checkpoints/)}
OUT=${OUT:-out/dmd_gan_trials}
NPROC=${NPROC:-2}
STEPS=${STEPS:-400}
TRIALS=${TRIALS:-control real2304 x10_t250}
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
ckpt=$(ls -d "$STAGE1"/checkpoints/step_* | sort | tail -n 1)
real="$OUT/real64"
if [ ! -f "$real/data.jsonl" ]; then
  mkdir -p "$real"
  python -c "import sys; from pathlib import Path; from demos import make_teacher as mt; mt.write_data(Path(sys.argv[1]), 64, seed=12345)" "$real"
fi
common=(--batch_size=16 --generator_lr=2e-4 --guidance_lr=2e-4 --dfake_gen_update_ratio=5 --ema_decay=0.98
        --precision=fp32 --log_every=50 --sample_every=100000 --init_from="$ckpt" --max_steps="$STEPS"
        --save_every="$STEPS")
for trial in $TRIALS; do
  case $trial in
    control)  extra=() ;;
    published144) extra=(--use_gan=1 --gen_cls_loss_weight=1e-3 --guidance_cls_loss_weight=1e-2
                         --diffusion_gan_max_timestep=1000) ;;
    real2304) extra=(--use_gan=1 --data_path="$real/data.jsonl" --gen_cls_loss_weight=1e-3 --guidance_cls_loss_weight=1e-2
                     --diffusion_gan_max_timestep=1000) ;;
    x10_t250) extra=(--use_gan=1 --data_path="$real/data.jsonl" --gen_cls_loss_weight=1e-2 --guidance_cls_loss_weight=1e-1
                     --diffusion_gan_max_timestep=250) ;;
    scaled_t250) extra=(--use_gan=1 --data_path="$real/data.jsonl" --gen_cls_loss_weight=8e-2 --guidance_cls_loss_weight=1e-1
                        --diffusion_gan_max_timestep=250) ;;
    strong_t250) extra=(--use_gan=1 --data_path="$real/data.jsonl" --gen_cls_loss_weight=3e-1 --guidance_cls_loss_weight=1e-1
                        --diffusion_gan_max_timestep=250) ;;
    up_x10_t250) extra=(--use_gan=1 --data_path="$real/data.jsonl" --gen_cls_loss_weight=1e-2 --guidance_cls_loss_weight=1e-1
                        --diffusion_gan_max_timestep=250 --gan_head_features=up) ;;
    up_scaled_t250) extra=(--use_gan=1 --data_path="$real/data.jsonl" --gen_cls_loss_weight=8e-2 --guidance_cls_loss_weight=1e-1
                           --diffusion_gan_max_timestep=250 --gan_head_features=up) ;;
    *) echo "unknown trial $trial" >&2; exit 2 ;;
  esac
  python -m torch.distributed.run --standalone --nproc_per_node="$NPROC" train_dmd.py --output_dir="$OUT/$trial" \
      "${common[@]}" "${extra[@]}"
  python -m demos.shapes_eval --model="$OUT/$trial/export" --sampler=onestep --json_out="$OUT/$trial/eval.json"
done
