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
#   LORA=1 bash demos/demo_kontext.sh     # the same as a LoRA fine-tune (rank LORA_RANK=16, LR
#                                         # LORA_LR=3e-3, 10x the full fine-tune's; all else equal)
#                                         # into out/kontext_demo_lora, evaluated the way a user
#                                         # loads it: the base + load_lora_weights(OUT/export)
#
# Both end with the run's costs: trainable parameters, one checkpoint folder's size (du), the mean
# step_ms of metrics.jsonl and the fine-tuning wall time.
set -euo pipefail
cd "$(dirname "$0")/.."  # the repository root
LORA=${LORA:-0}
if [ "$LORA" = 0 ]; then
    OUT=${OUT:-out/kontext_demo}
    LORA_ARGS=()
else  # appended after the shared settings (the last --name=value wins) and before "$@"
    OUT=${OUT:-out/kontext_demo_lora}
    LORA_ARGS=(--lora_rank="${LORA_RANK:-16}" --lr="${LORA_LR:-3e-3}")
fi
NPROC=${NPROC:-2}
GRID=${GRID:-$OUT/blue_grid.png}
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
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
    --sample_guidance=1.0 --save_every=0 --log_every=50 --sample_every=300 --max_steps=600 \
    ${LORA_ARGS[@]+"${LORA_ARGS[@]}"} "$@"
trained=$(date +%s)
if [ "$LORA" = 0 ]; then
    python -m demos.kontext_eval --compare base=assets/kontext_base tuned="$OUT/export" --task_dir="$OUT/task" \
        --grid="$GRID" --json="$OUT/eval.json"
else  # the base pipeline + pipe.load_lora_weights(OUT/export), as users load a LoRA
    python -m demos.kontext_eval --compare base=assets/kontext_base lora=assets/kontext_base \
        --lora lora="$OUT/export" --task_dir="$OUT/task" --grid="$GRID" --json="$OUT/eval.json"
fi
evaluated=$(date +%s)
# the run's costs: trainable parameters (the LoRA file's tensors, or the whole base transformer),
# the last checkpoint folder on disk, the mean step_ms of the logged steps
python - "$OUT" "$LORA" <<'PY'
import glob, json, math, os, subprocess, sys
from safetensors import safe_open
out, lora = sys.argv[1], sys.argv[2] != "0"
files = ([os.path.join(out, "export", "pytorch_lora_weights.safetensors")] if lora
         else glob.glob("assets/kontext_base/transformer/*.safetensors"))
params = 0
for path in files:
    with safe_open(path, "pt") as f:
        params += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
ckpts = sorted(glob.glob(os.path.join(out, "checkpoints", "step_*")))
size = subprocess.run(["du", "-sh", ckpts[-1]], capture_output=True, text=True).stdout.split()[0] if ckpts else "-"
ms, last = [], 0
with open(os.path.join(out, "metrics.jsonl")) as f:  # append-only: keep the last run's lines
    for rec in (json.loads(line) for line in f if line.strip()):
        ms, last = (ms if rec["step"] > last else []) + [rec["step_ms"]], rec["step"]
print(f"run: {'LoRA' if lora else 'full fine-tune'}: trainable params {params:,}; checkpoint "
      f"{ckpts[-1] if ckpts else '-'}: {size}; mean step_ms {sum(ms) / max(len(ms), 1):.1f} "
      f"({len(ms)} logged steps)")
PY
echo "demo: fine-tuning $((trained - start)) s, evaluation $((evaluated - trained)) s; grid $GRID"
