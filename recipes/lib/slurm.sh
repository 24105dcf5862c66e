# Sourced by run_fsdp.sh and recipes/lib/common.sh (not a script itself): the one place where a
# SLURM job's allocation becomes the launch settings, so a recipe's global batch (GRAD_ACCUM) and
# the torchrun command it starts count the same nodes.
#   slurm_first_host LIST   the first host of a SLURM node list
#   slurm_settings          inside a SLURM job (SLURM_JOB_ID set), where not set by hand:
#                           NNODES=$SLURM_NNODES, NODE_RANK=$SLURM_NODEID, MASTER_ADDR = the first host
#                           of $SLURM_JOB_NODELIST, NPROC = the node's GPUs ($SLURM_GPUS_ON_NODE, else
#                           the count in $SLURM_GPUS_PER_NODE); all exported. Settings that contradict
#                           the allocation stop in one line (exit 2). NNODES=1 by hand runs this node
#                           alone (--standalone). Outside SLURM it does nothing.

# node[01-04,07] -> node01, gpu-a1,gpu-a2 -> gpu-a1, node7 -> node7 (core.launch.slurm_first_host in Python)
slurm_first_host() {
  local list=$1 first="" bracket='^([^[]*)\[([0-9]+)[^]]*\](.*)$'
  if command -v scontrol >/dev/null 2>&1; then
    first=$(scontrol show hostnames "$list" 2>/dev/null | head -n1 || true)
    if [ -n "$first" ]; then
      echo "$first"
      return
    fi
  fi
  while [[ $list =~ $bracket ]]; do  # each [ranges] group -> its first number
    list="${BASH_REMATCH[1]}${BASH_REMATCH[2]}${BASH_REMATCH[3]}"
  done
  echo "${list%%,*}"
}

slurm_settings() {
  [ -n "${SLURM_JOB_ID:-}" ] || return 0
  local who=${0##*/} nodes=${SLURM_NNODES:-${SLURM_JOB_NUM_NODES:-1}}
  if [ "${SLURM_LOCALID:-0}" != 0 ]; then
    echo "$who: several SLURM tasks on one node (SLURM_LOCALID=$SLURM_LOCALID): run one task per node" \
         "(srun --ntasks-per-node=1); torchrun starts one process per GPU itself" >&2
    exit 2
  fi
  NNODES=${NNODES:-$nodes}
  if [ "$NNODES" -gt 1 ] && [ "$NNODES" != "$nodes" ]; then
    echo "$who: NNODES=$NNODES but this SLURM job has $nodes node(s) (SLURM_NNODES): leave NNODES unset" >&2
    exit 2
  fi
  if [ "$NNODES" -gt 1 ]; then
    if [ -z "${SLURM_NODEID:-}" ]; then
      echo "$who: a $NNODES-node SLURM job without SLURM_NODEID: start this on every node with" \
           "srun --ntasks-per-node=1" >&2
      exit 2
    fi
    if [ "${NODE_RANK:-$SLURM_NODEID}" != "$SLURM_NODEID" ]; then
      echo "$who: NODE_RANK=$NODE_RANK but this is node $SLURM_NODEID of the SLURM job (SLURM_NODEID):" \
           "leave NODE_RANK unset" >&2
      exit 2
    fi
    NODE_RANK=$SLURM_NODEID
    MASTER_ADDR=${MASTER_ADDR:-$(slurm_first_host "${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}}")}
    export NODE_RANK MASTER_ADDR
  fi
  if [ -z "${NPROC:-}" ]; then
    if [[ ${SLURM_GPUS_ON_NODE:-} =~ ^[0-9]+$ ]] && [ "$SLURM_GPUS_ON_NODE" -gt 0 ]; then
      NPROC=$SLURM_GPUS_ON_NODE
    elif [[ ${SLURM_GPUS_PER_NODE:-} =~ ([0-9]+)$ ]] && [ "${BASH_REMATCH[1]}" -gt 0 ]; then
      NPROC=${BASH_REMATCH[1]}  # "8" or "a100:8"
    fi
  fi
  export NNODES ${NPROC:+NPROC}
}
