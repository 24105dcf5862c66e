"""What a rank holds: bytes of parameters, gradients and optimizer state (its shards), peak
host RSS and peak CUDA memory, as the table the scripts print at start and after training.

    python -m pytest tests/test_memory.py -q
"""
from __future__ import annotations

import json
import os
import resource

import torch
import torch.nn as nn

from core.dist import all_gather_objects
from parallel.lowbit import state_bytes


def _local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank holds of `t`: a quantised subclass (NF4 weights, low-bit optimizer states)
    counted by its codes and scales (parallel/lowbit.state_bytes), not by its nominal dtype."""
    return state_bytes(t)


def local_state_bytes(models: dict[str, nn.Module], optimizers: dict[str, torch.optim.Optimizer]) -> dict:
    """Bytes this rank holds of parameters, gradients and optimizer state."""
    params = sum(_local_bytes(p) for m in models.values() for p in m.parameters())
    grads = sum(_local_bytes(p.grad) for m in models.values() for p in m.parameters() if p.grad is not None)
    optim = sum(_local_bytes(v) for o in optimizers.values() for s in o.state.values()
                for v in s.values() if torch.is_tensor(v))
    return {"params": params, "grads": grads, "optim": optim}


def peak_host_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def host_rss_bytes() -> int:
    """Resident set size now (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


_RSS_BASELINE: list[int] = []


def mark_rss_baseline() -> None:
    """Remember the host RSS before the first model is built (build_on_meta calls this): imports,
    data and text cache are in it, models are not. memory_report prints it as rss_base."""
    if not _RSS_BASELINE:
        _RSS_BASELINE.append(host_rss_bytes())


def memory_report(models: dict[str, nn.Module], optimizers: dict[str, torch.optim.Optimizer]) -> str:
    """Per-rank table (collective): local params / grads / optimizer bytes, peak host RSS, peak CUDA."""
    row = local_state_bytes(models, optimizers)
    row["rss_peak"] = peak_host_rss_bytes()
    row["cuda_peak"] = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    row["cuda_reserved"] = torch.cuda.max_memory_reserved() if torch.cuda.is_available() else 0  # what OOMs
    # grads as held during a step (the table's grads are 0 between steps, after zero_grad)
    row["grads_held"] = sum(_local_bytes(p) for m in models.values() for p in m.parameters() if p.requires_grad)
    row["rss_base"] = _RSS_BASELINE[0] if _RSS_BASELINE else 0
    rows = all_gather_objects(row)
    cols = ["params", "grads", "optim", "rss_peak", "cuda_peak"]
    lines = ["rank  " + "  ".join(c.rjust(10) for c in cols)]
    for r, vals in enumerate(rows):
        lines.append(f"{r:<4}  " + "  ".join(_mib(vals[c]).rjust(10) for c in cols))
    lines.append("memory_bytes " + json.dumps(rows))  # machine-readable (benchmarks.py)
    return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}MiB" if n < 2**30 else f"{n / 2**30:.2f}GiB"

