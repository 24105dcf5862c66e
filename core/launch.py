"""What a rank learns from how it was launched: its rank and world from torchrun's variables or, under
`srun` without torchrun, from SLURM's (slurm_rank_env); its GPU among the visible ones (gpu_index);
its CPU threads (cpu_threads); and, from every rank's (host, GPU UUID), whether two ranks share a GPU
(shared_gpus). fsdp_utils.init_distributed puts them together.

    python -m pytest tests/test_slurm.py tests/test_fsdp_utils.py -q
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess

import torch

from core.errors import ConfigError


def slurm_first_host(nodelist: str) -> str:
    """The first host of a SLURM node list without scontrol (run_fsdp.sh's parser): node[01-04,07]
    -> node01, gpu-a1,gpu-a2 -> gpu-a1, rack[2-3]-gpu[09-12],login1 -> rack2-gpu09."""
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            end = i
            break
    return re.sub(r"\[(\d+)[^\]]*\]", r"\1", nodelist[:end])


def _first_host(nodelist: str) -> str:
    if shutil.which("scontrol"):  # the cluster's own parser knows every form of the list
        r = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True)
        if r.returncode == 0 and r.stdout.split():
            return r.stdout.split()[0]
    return slurm_first_host(nodelist)


def tasks_on_node(tasks_per_node: str, node: int) -> int:
    """A node's count in SLURM_TASKS_PER_NODE's form: "2(x3),1" is 2 tasks on nodes 0-2, 1 on node 3."""
    first = 0  # the first node of each part
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            break
        first += int(m[2] or 1)
        if node < first:
            return int(m[1])
    raise ConfigError(f"SLURM_TASKS_PER_NODE={tasks_per_node!r}: no task count for node {node} in it")


def slurm_rank_env(env) -> dict[str, str]:
    """torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
    for a process srun started itself (`srun --ntasks-per-node=8 --gpus-per-task=1 python
    train_dmd.py`), from SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, the node's tasks and the first
    host of the node list. {} when a launcher set RANK, outside an srun step, or in a step of one
    task (`python script.py` there stays a world of one). MASTER_ADDR and MASTER_PORT set by hand win."""
    if "RANK" in env or "SLURM_PROCID" not in env or "SLURM_STEP_ID" not in env:
        return {}
    world = int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or 1)
    if world <= 1:
        return {}
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if per_node:
        local_world = tasks_on_node(per_node, int(env.get("SLURM_NODEID", 0)))
    else:  # --ntasks-per-node's value, else the tasks spread evenly over the step's nodes
        nodes = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or 1)
        local_world = int(env.get("SLURM_NTASKS_PER_NODE") or -(-world // nodes))
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
    master = env.get("MASTER_ADDR") or (_first_host(nodelist) if nodelist else "127.0.0.1")
    return dict(RANK=env["SLURM_PROCID"], WORLD_SIZE=str(world), LOCAL_RANK=env.get("SLURM_LOCALID", "0"),
                LOCAL_WORLD_SIZE=str(local_world), MASTER_ADDR=master, MASTER_PORT=env.get("MASTER_PORT", "29500"))


def host_and_gpu(device: torch.device) -> str:
    uuid = str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else ""
    return f"{socket.gethostname()}\t{uuid}"


def shared_gpus(devices: list[tuple[str, str]]) -> str | None:
    """One line naming the ranks that share a GPU, from every rank's (host, GPU UUID) in rank
    order; None when each GPU has one rank (CPU ranks, UUID "", share nothing)."""
    ranks = {}
    for r, (host, uuid) in enumerate(devices):
        if uuid:
            ranks.setdefault((host, uuid), []).append(r)
    shared = [(host, uuid, rs) for (host, uuid), rs in ranks.items() if len(rs) > 1]
    if not shared:
        return None
    host, uuid, rs = shared[0]
    more = f" (and {len(shared) - 1} more GPU(s) shared)" if len(shared) > 1 else ""
    return (f"ranks {', '.join(map(str, rs))} share one GPU on {host} ({uuid}){more}: give every rank its own "
            "GPU (torchrun: NPROC <= the node's GPUs; srun: --gpus-per-task=1 or all the node's GPUs to each task)")


def cpu_threads(local_world: int, per_task: bool = False) -> int:
    """Threads for this rank's CPU work: the CPUs this process may run on (its affinity: a SLURM
    task's or a container's share, not the host's count) shared by the node's ranks (oversubscribed
    CPU runs crawl; on GPUs the CPU side, CPU-offloaded AdamW and clipping above all, would
    otherwise run on torchrun's default of one thread). per_task: srun started each rank itself,
    and an affinity of at most SLURM_CPUS_PER_TASK CPUs is this rank's own (srun bound it). An
    OMP_NUM_THREADS above 1 is the user's and wins; 1 is torchrun's default when unset."""
    requested = int(os.environ.get("OMP_NUM_THREADS", "1") or 1)
    if requested > 1:
        return requested
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    own = per_task and cpus <= int(os.environ.get("SLURM_CPUS_PER_TASK") or 0)
    return max(1, cpus if own else cpus // local_world)


def gpu_index(local_rank: int, local_world: int, visible: int, same_devices: bool = False) -> int:
    """This rank's GPU among the `visible` ones. Each rank sees all of its node's GPUs (torchrun
    on a node): its LOCAL_RANK. A scheduler gives each rank only its own GPU (SLURM's
    --gpus-per-task=1, CUDA_VISIBLE_DEVICES of one): device 0. same_devices: every rank of the node
    sees the same GPUs (torchrun's workers inherit them), so one GPU for several ranks is refused
    here, before any work. Anything else that would put two ranks on one GPU, which NCCL refuses:
    an error naming the numbers."""
    if visible == 1 and local_world > 1 and same_devices:
        raise ConfigError(f"LOCAL_WORLD_SIZE={local_world} ranks on this node but 1 GPU: every rank would run on "
                          f"it; start one process per GPU (NPROC=1, or a job with {local_world} GPUs)")
    if visible == 1:
        return 0
    if local_world <= visible:
        return local_rank
    raise ConfigError(f"LOCAL_RANK={local_rank} of LOCAL_WORLD_SIZE={local_world} ranks on this node, but {visible} "
                      "GPUs are visible to it: give every rank its own GPU (all of the node's GPUs to each rank, "
                      "or exactly one)")
