#!/usr/bin/env bash
# Launch a training script with torchrun on this machine, or on one node of several.
#
#   bash run_fsdp.sh train_dmd.py --max_steps=100
#   NPROC=8 bash run_fsdp.sh train_flux_kontext.py --cpu_offload=1
#   # two nodes (run on each, NODE_RANK=0 on the one at MASTER_ADDR):
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 bash run_fsdp.sh train_dmd.py
#
# NPROC       processes on this node (default: number of GPUs, else 2)
# NNODES      nodes in the job (default 1: --standalone rendezvous)
# NODE_RANK   this node's index (default 0)
# MASTER_ADDR / MASTER_PORT   rendezvous host and port of node 0 (multi-node only)
# DRY_RUN=1   print the torchrun command and exit (check a recipe or a launcher's settings)
# Everything after the script name is passed to it (--name=value settings). The recipes in
# recipes/ call this script with the published settings.
set -euo pipefail

if [ $# -lt 1 ]; then
  echo "usage: bash run_fsdp.sh SCRIPT.py [--name=value ...]" >&2
  exit 2
fi
SCRIPT=$1
shift
if [ ! -f "$SCRIPT" ]; then
  echo "run_fsdp.sh: no such script: $SCRIPT" >&2
  exit 2
fi

if [ -z "${NPROC:-}" ]; then
  NPROC=$(python3 -c "import torch; print(torch.cuda.device_count() or 2)" 2>/dev/null || echo 2)
fi
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}

if [ "$NNODES" -gt 1 ]; then
  : "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0 for a multi-node run}"
  MASTER_PORT=${MASTER_PORT:-29500}
  RDZV=(--nnodes="$NNODES" --node_rank="$NODE_RANK" --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT")
else
  RDZV=(--standalone --nnodes=1)
fi

CMD=(torchrun "${RDZV[@]}" --nproc_per_node="$NPROC" "$SCRIPT" "$@")
echo "+ ${CMD[*]}"
if [ "${DRY_RUN:-0}" = 1 ]; then
  exit 0
fi
exec "${CMD[@]}"
