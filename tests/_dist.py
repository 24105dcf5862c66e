"""Run a function on N CPU ranks (gloo) in spawned processes, the way torchrun would.

    from tests._dist import run_ranks
    run_ranks(fn, 2, arg1, ...)   # fn(rank, world, *args) runs with the process group up
"""
from __future__ import annotations

import os
import socket
import sys
import traceback

import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch_env(**extra: str) -> dict:
    """os.environ without a parent launcher's rank variables, offline, one thread per rank, the
    project importable: what a test passes to a torchrun / python launch of a script."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=ROOT, **extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(local_rank, world, port, fn, args, errq):
    os.environ.update(RANK=str(local_rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local_rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      HF_HUB_OFFLINE="1")
    sys.path.insert(0, ROOT)
    import torch.distributed as dist
    import fsdp_utils
    try:
        fsdp_utils.init_distributed(timeout_s=120)
        fn(local_rank, world, *args)
        dist.barrier()
    except BaseException:
        errq.put(f"rank {local_rank}:\n{traceback.format_exc()}")
        os._exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world: int, *args) -> None:
    """Spawn `world` ranks running fn(rank, world, *args); re-raise the first failure here."""
    ctx = mp.get_context("spawn")
    errq = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, errq)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
    for p in procs:
        if p.is_alive():
            p.kill()
    if not errq.empty():
        raise AssertionError(errq.get())
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    assert not bad, f"rank exit codes {[p.exitcode for p in procs]}"
