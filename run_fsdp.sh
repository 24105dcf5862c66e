#!/usr/bin/env bash
# Launch a training script with torchrun on this machine, or on one node of several.
#
#   bash run_fsdp.sh train_dmd.py --max_steps=100
#   NPROC=8 bash run_fsdp.sh train_flux_kontext.py --cpu_offload=1
#   NPROC=8 bash run_fsdp.sh train_flux_kontext.py --context_parallel=4   # 2 DP groups x 4 CP ranks
#   # two nodes (run on each, NODE_RANK=0 on the one at MASTER_ADDR):
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 bash run_fsdp.sh train_dmd.py
#
# NPROC       processes on this node (default: number of GPUs, else 2)
# NNODES      nodes in the job (default 1: --standalone rendezvous)
# NODE_RANK   this node's index (0 on the node at MASTER_ADDR; required on several nodes)
# MASTER_ADDR / MASTER_PORT   rendezvous host and port of node 0 (multi-node only)
# DRY_RUN=1   print the torchrun command and exit (check a recipe or a launcher's settings)
# SOCKET_IFNAME  the network interface for the rendezvous and collectives (e.g. ib0, eth1): sets
#             NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME where they are not set (multi-node nodes
#             often have several interfaces; the wrong one hangs the first collective)
# HSDP_PER_NODE=1   on several nodes, add --dp_replicate=NNODES (HSDP: shard inside a node, replicate
#             across nodes) unless the arguments set it; the recipes in recipes/ turn this on
# SHUTDOWN_TIMEOUT  seconds torchrun waits, after it got SIGTERM / SIGINT and passed it on to the
#             ranks, for them to finish the step, save and exit, before it SIGKILLs them (default
#             270; torchrun's own is 30, shorter than many saves). Keep it below the lead time of
#             the scheduler's warning signal (sbatch --signal=TERM@300) so the save ends before the limit
#
# Under SLURM (SLURM_JOB_ID set) the job's allocation decides what is not set by hand
# (recipes/lib/slurm.sh, shared with the recipes' global batch): NNODES=$SLURM_NNODES,
# NODE_RANK=$SLURM_NODEID, MASTER_ADDR = the first host of $SLURM_JOB_NODELIST, MASTER_PORT 29500,
# NPROC = the node's GPUs ($SLURM_GPUS_ON_NODE, else the count in $SLURM_GPUS_PER_NODE, else as
# above). An NNODES or NODE_RANK that contradicts the allocation stops in one line; NNODES=1 runs
# this node alone. Run it as ONE task per node (torchrun starts the per-GPU processes):
# srun --ntasks-per-node=1, see recipes/slurm_example.sbatch. A one-node job keeps --standalone.
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

. "$(dirname "$0")/recipes/lib/slurm.sh"
slurm_settings  # under SLURM: NNODES, NODE_RANK, MASTER_ADDR, NPROC from the allocation where not set
if [ -n "${SLURM_JOB_ID:-}" ]; then
  where=${MASTER_ADDR:+, master $MASTER_ADDR}
  echo "run_fsdp.sh: SLURM job $SLURM_JOB_ID: $NNODES node(s), this is node_rank ${NODE_RANK:-0}$where" >&2
fi

if [ -z "${NPROC:-}" ]; then
  NPROC=$(python3 -c "import torch; print(torch.cuda.device_count() or 2)" 2>/dev/null \
          || nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  [[ $NPROC =~ ^[1-9][0-9]*$ ]] || NPROC=2  # no torch for python3 here and no nvidia-smi: 2 CPU ranks
fi
NNODES=${NNODES:-1}

if [ "$NNODES" -gt 1 ]; then
  : "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0 for a multi-node run}"
  if [ -z "${NODE_RANK:-}" ]; then  # 0 on every node would make every node the first
    echo "run_fsdp.sh: NNODES=$NNODES: set NODE_RANK on each node (0 on the one at MASTER_ADDR)" >&2
    exit 2
  fi
  MASTER_PORT=${MASTER_PORT:-29500}
  RDZV=(--nnodes="$NNODES" --node_rank="$NODE_RANK" --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT")
else
  RDZV=(--standalone --nnodes=1)
fi

# context parallelism (train_flux_kontext.py --context_parallel=C): a CP group is C consecutive
# ranks and all-to-alls inside every attention, so it should sit inside one node
for arg in "$@"; do
  if [[ $arg =~ ^--context_parallel=([0-9]+)$ ]] && [ "${BASH_REMATCH[1]}" -gt 1 ] \
      && [ $((NPROC % BASH_REMATCH[1])) -ne 0 ]; then
    echo "run_fsdp.sh: warning: --context_parallel=${BASH_REMATCH[1]} does not divide NPROC=$NPROC: CP groups" \
         "would span nodes (correct, but every attention's all-to-all crosses the network)" >&2
  fi
done

if [ -n "${SOCKET_IFNAME:-}" ]; then
  export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$SOCKET_IFNAME} GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$SOCKET_IFNAME}
fi
if [ "$NNODES" -gt 1 ]; then
  echo "run_fsdp.sh: network interface: NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-(auto)}" \
       "GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-(auto)}" >&2
fi
EXTRA=()
if [ "${HSDP_PER_NODE:-0}" = 1 ] && [ "$NNODES" -gt 1 ] && [[ " $* " != *" --dp_replicate="* ]]; then
  EXTRA=(--dp_replicate="$NNODES")  # all-gathers stay inside a node; only gradients cross nodes
fi

SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-270}
if ! [[ $SHUTDOWN_TIMEOUT =~ ^[0-9]+$ ]]; then
  echo "run_fsdp.sh: SHUTDOWN_TIMEOUT=$SHUTDOWN_TIMEOUT: expected whole seconds" >&2
  exit 2
fi
CMD=(torchrun "${RDZV[@]}" --nproc_per_node="$NPROC" --shutdown_timeout="$SHUTDOWN_TIMEOUT" "$SCRIPT" "${EXTRA[@]}" "$@")
echo "+ ${CMD[*]}"
if [ "${DRY_RUN:-0}" = 1 ]; then
  exit 0
fi
exec "${CMD[@]}"
