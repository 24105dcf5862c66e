# Sourced by the recipes (not a recipe itself).
#   SLURM            inside a SLURM job the allocation sets NNODES, NODE_RANK, MASTER_ADDR and NPROC
#                    here, before grad_accum counts the GPUs (recipes/lib/slurm.sh, as run_fsdp.sh)
#   NPROC            processes per node: default the GPU count, else 2 (exported for run_fsdp.sh)
#   HSDP_PER_NODE    1 (default here): one HSDP replica per node on multi-node runs
#   per_gpu P ARGS   the samples per GPU: P, or N when ARGS (the recipe's "$@") hold --batch_size=N,
#                    so that an override changes GRAD_ACCUM and keeps the published global batch
#   grad_accum G P   the GRAD_ACCUM that keeps a published global batch G at P samples per GPU on
#                    this job's NPROC x NNODES GPUs; exits 2 (naming the recipe) if it cannot
. "$(dirname "${BASH_SOURCE[0]}")/slurm.sh"
slurm_settings
NPROC=${NPROC:-$(python3 -c "import torch; print(torch.cuda.device_count() or 2)" 2>/dev/null \
                || nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)}
[[ $NPROC =~ ^[1-9][0-9]*$ ]] || NPROC=2
export NPROC
# on several nodes: HSDP with one replica per node (run_fsdp.sh adds --dp_replicate=NNODES): the
# per-block all-gathers stay on the node's fast links, only the gradients' all-reduce crosses nodes
export HSDP_PER_NODE=${HSDP_PER_NODE:-1}

grad_accum() {
  local global=$1 per_gpu=$2 gpus=$(( NPROC * ${NNODES:-1} ))
  if (( global % (per_gpu * gpus) )); then
    echo "$(basename "$0"): $gpus GPUs x $per_gpu does not divide the published global batch $global" >&2
    exit 2
  fi
  echo $(( global / (per_gpu * gpus) ))
}

per_gpu() {
  local p=$1 a
  shift
  for a in "$@"; do
    case $a in --batch_size=*|--batch-size=*|--BATCH_SIZE=*) p=${a#*=} ;; esac
  done
  [[ $p =~ ^[1-9][0-9]*$ ]] || { echo "$(basename "$0"): --batch_size=$p is not a positive integer" >&2; exit 2; }
  echo "$p"
}
