#!/usr/bin/env bash
# Qwen-Image-Edit-2509 in miniature, on CPU: fine-tune the shipped base model (assets/qwen_edit_base,
# rebuilt by `python -m demos.make_qwen_edit_base`; it never saw the task) on "make the <shape> the
# colour of picture 2" edits with two references (picture 1 the scene, picture 2 a colour swatch;
# the 4096-edit train split of demos/qwen_edit_eval.py) with train_flux_kontext.py, then evaluate base and
# fine-tuned model through diffusers' QwenImageEditPlusPipeline on held-out edits
# (demos/qwen_edit_eval.py): colour, shape and position kept (IoU), background kept, PSNR; the
# fine-tuned model again with picture 2 removed (one reference cannot know the colour); and the
# named-colour recolours the base knew (retention).
#
#   bash demos/demo_qwen_edit.sh          # 2 ranks; extra arguments go to train_flux_kontext.py
#
# Both reference areas are 32^2 (REFERENCE_AREA, CONDITION_AREA; the evaluation sets the
# pipeline's VAE_IMAGE_SIZE / CONDITION_IMAGE_SIZE to the same).
set -euo pipefail
cd "$(dirname "$0")/.."  # the repository root
OUT=${OUT:-out/qwen_edit_demo}
NPROC=${NPROC:-2}
GRID=${GRID:-$OUT/grid.png}
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
TRAIN=$(python -m demos.qwen_edit_eval --make_data="$OUT/task" | awk '$1 == "train" {print $2}')
start=$(date +%s)
python -m torch.distributed.run --standalone --nproc_per_node="$NPROC" train_flux_kontext.py \
    --model_path=assets/qwen_edit_base --data_path="$TRAIN" --output_dir="$OUT" \
    --precision=fp32 --resolution=32 --reference_area=1024 --condition_area=1024 --max_references=2 \
    --cache_latents=True --batch_size=8 --lr=5e-4 --warmup_steps=20 --weight_decay=0 --max_grad_norm=1.0 \
    --ema_decay=0.99 --export_dtype=bf16 --num_sample_pairs=4 --sample_steps=20 --sample_guidance=1.0 \
    --save_every=0 --log_every=100 --val_every=0 --sample_every=2000 --max_steps=8000 "$@"
trained=$(date +%s)
python -m demos.qwen_edit_eval --compare base=assets/qwen_edit_base tuned="$OUT/export" --one_reference tuned \
    --task_dir="$OUT/task" --grid="$GRID" --json="$OUT/eval.json"
evaluated=$(date +%s)
echo "demo: fine-tuning $((trained - start)) s, evaluation $((evaluated - trained)) s; grid $GRID"
