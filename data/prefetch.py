"""The next step's data, prepared on a background thread while this step runs.

    python -m pytest tests/test_data.py -q
"""
from __future__ import annotations

import time

import torch

class Prefetcher:
    """`load(step)` (host work: decoding and resizing images, reading cached embeddings) run on a
    background thread one step ahead: `get(step)` returns step's data, moved to `device` with
    non-blocking copies (from pinned memory on CUDA), and starts loading step + 1 (up to
    `last_step`), so the host prepares step N + 1 while the device runs step N. Also returns the
    seconds `get` waited for the data (the step's data wait). `load` is a pure function of the
    step, so what a step sees does not depend on timing. An exception in `load` is raised by the
    `get` of its step."""

    def __init__(self, load, last_step: int, device: torch.device):
        from concurrent.futures import ThreadPoolExecutor
        self.load, self.last_step, self.device = load, last_step, device
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch")
        self.pending: dict = {}

    def _host(self, step: int):
        data = self.load(step)
        return _map_tensors(data, torch.Tensor.pin_memory) if self.device.type == "cuda" else data

    def _start(self, step: int) -> None:
        if step <= self.last_step and step not in self.pending:
            self.pending[step] = self.pool.submit(self._host, step)

    def get(self, step: int):
        self._start(step)
        t0 = time.perf_counter()
        data = self.pending.pop(step).result()
        waited = time.perf_counter() - t0
        self._start(step + 1)
        return _map_tensors(data, lambda t: t.to(self.device, non_blocking=True)), waited

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def _map_tensors(obj, fn):
    """fn applied to every tensor in nested lists, tuples and dicts (other leaves kept)."""
    if torch.is_tensor(obj):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    return obj


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` (a host tensor) on `device`: on CUDA through pinned memory without blocking the host,
    so the step's small copies (token ids, time ids) queue behind the GPU's work instead of waiting."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
