"""Rank-aware printing and the small collectives by which all ranks agree (stop, skip, fail
together). Every collective of the project goes through these helpers (tests/test_components.py
checks that no other module calls torch.distributed's collectives).

    python -m pytest tests/test_components.py -q
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def print0(*args, **kwargs) -> None:
    if rank() == 0:
        print(*args, **kwargs, flush=True)


# Every collective of the project goes through these helpers (tests/test_components.py checks that
# no other module calls torch.distributed's collectives): NCCL takes CUDA tensors only, gloo takes any,
# so a CPU tensor handed to a collective passes every CPU test and fails on the first GPU run. The
# helpers put each tensor on the group's communication device and hand the result back where the
# caller's tensor was.

def comm_device() -> torch.device:
    """Where the default group's collectives take their tensors: this rank's GPU under NCCL
    (init_distributed made it the current device), the CPU under gloo."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _distributed() -> bool:
    return dist.is_initialized() and world_size() > 1


def all_reduce(t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """A new tensor: `t` reduced over all ranks (sum by default), on t's device."""
    if not _distributed():
        return t.clone()
    x = t.to(comm_device(), copy=True)
    dist.all_reduce(x, op=op)
    return x.to(t.device)


def all_gather_objects(obj) -> list:
    """[obj of rank 0, obj of rank 1, ...] on every rank (picklable objects: small metadata only)."""
    if not _distributed():
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)  # pickles through a tensor on the current device (CUDA under NCCL)
    return out


def map_shared(fn, items: list) -> list:
    """[fn(item) for item in items] on every rank, each rank computing items rank::world (checks that read
    files: each file read once) and one all_gather of the results (picklable: small metadata only)."""
    me, world = (rank(), world_size()) if _distributed() else (0, 1)
    merged = {}
    for part in all_gather_objects({k: fn(items[k]) for k in range(me, len(items), world)}):
        merged.update(part)
    return [merged[k] for k in range(len(items))]


def broadcast_from_rank0(obj):
    """Rank 0's `obj` on every rank (e.g. a path only rank 0 looked up)."""
    if not _distributed():
        return obj
    box = [obj if rank() == 0 else None]
    dist.broadcast_object_list(box, src=0, device=comm_device())
    return box[0]


def barrier() -> None:
    if _distributed():
        dist.barrier()


def agree(*flags) -> tuple[bool, ...]:
    """For each flag (a bool, or a 0-d tensor on any device), True only if it is True on every rank:
    one MIN all-reduce and one host sync for all of them, so that all ranks take the same branch
    (skip a step whose loss was non-finite on one rank, stop when one rank was signalled)."""
    device = next((f.device for f in flags if torch.is_tensor(f)), torch.device("cpu"))
    vector = torch.stack([(f.detach() if torch.is_tensor(f) else torch.tensor(f)).to(device, torch.float64).reshape(())
                          for f in flags])
    return tuple(v > 0.5 for v in all_reduce(vector, op=dist.ReduceOp.MIN).tolist())


def mean_across_ranks(values: dict[str, float]) -> dict[str, float]:
    """Average scalar metrics over ranks (for logging), one all-reduce."""
    if not values:
        return {}
    keys = sorted(values)
    t = all_reduce(torch.tensor([float(values[k]) for k in keys], dtype=torch.float64))
    return {k: v / world_size() for k, v in zip(keys, t.tolist())}


def gather_before_init(store, rank_: int, world: int, key: str, value: str) -> list[str]:
    """[value of rank 0, rank 1, ...] on every rank through the rendezvous store, before the process
    group exists: for the checks that must come before NCCL connects (fsdp_utils.init_distributed's
    one rank per GPU). A few short strings per rank, not a data path."""
    store.set(f"{key}/{rank_}", value)
    return [v.decode() for v in store.multi_get([f"{key}/{r}" for r in range(world)])]


def first_error(error: str | None) -> str | None:
    """Collective: the first failing rank's message (None when every rank succeeded), on every
    rank, so all ranks stop together after a local failure (e.g. one rank's disk is full)."""
    return next((e for e in all_gather_objects(error) if e), None)
