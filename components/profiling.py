"""PROFILE_STEPS: torch.profiler over a window of training steps (torchtitan's profiling.enable_profiling),
for finding where a GPU step goes: each rank writes a Chrome/Perfetto trace, rank 0 a table of the ops
and the step's labelled phases by their device time (CPU time on a CPU run).

    python -m pytest tests/test_profiling.py -q
"""
from __future__ import annotations

import collections
import contextlib
import os
import time

import torch

from core.dist import print0, rank
from core.errors import ConfigError

TOP_OPS = 30  # rows of the table rank 0 writes and prints


def profile_steps(steps: list, max_steps: int) -> list[int]:
    """PROFILE_STEPS checked: [] (off) or [first, last] with 2 <= first <= last <= MAX_STEPS (step 1
    holds the allocator's growth, compile and first-call work, not a step's: never profiled)."""
    try:
        out = [int(v) for v in steps]
    except (TypeError, ValueError):
        out = None
    if out == [] or (out and len(out) == 2 and 2 <= out[0] <= out[1] <= max_steps):
        return out
    raise ConfigError(f"PROFILE_STEPS={steps}: give [first, last] with 2 <= first <= last <= MAX_STEPS "
                      f"({max_steps}), or [] for none")


class StepProfiler:
    """Profiles steps first..last: started after step first-1 has ended (its samples and checkpoint
    done), stopped when step `last` has run its updates, before its log line, samples and checkpoint;
    so the window holds the steps' data wait, forwards, backwards and optimizer updates only."""

    def __init__(self, steps: list, out_dir: str, device: torch.device):
        self.first, self.last = (steps[0], steps[1]) if steps else (0, -1)
        self.out_dir, self.device = os.path.join(out_dir, "profile"), device
        self.prof = None
        self.phase_s = collections.Counter()  # wall seconds per phase inside the window

    def after_step(self, step: int) -> None:
        """Called when step `step` has ended; starts the window before step `first`."""
        if step == self.first - 1 and self.prof is None:
            from torch.profiler import ProfilerActivity, profile
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self.prof = profile(activities=activities, record_shapes=True)
            self.prof.__enter__()
            _WINDOW[0] = self

    def updates_done(self, step: int) -> str | None:
        """Called after step `step`'s updates; at `last` stops and writes. Returns the trace's path."""
        if self.prof is None or step != self.last:
            return None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the window's kernels end inside it
        self.prof.__exit__(None, None, None)
        _WINDOW[0] = None
        os.makedirs(self.out_dir, exist_ok=True)
        trace = os.path.join(self.out_dir, f"trace_rank{rank()}.json")
        self.prof.export_chrome_trace(trace)
        if rank() == 0:
            table = self.table()
            with open(os.path.join(self.out_dir, "ops_rank0.txt"), "w", encoding="utf-8") as f:
                f.write(table + "\n")
            print0(f"profile of steps {self.first}-{self.last} (rank 0; every rank's trace in {self.out_dir}):\n"
                   + table)
        self.prof = None
        return trace

    def table(self) -> str:
        """The step's phases (the `phase` labels), then the ops by their own time: device time on a
        GPU (the kernels'), else CPU time. A phase's time is its wall time with the device synchronised
        at both ends: on a GPU the backward's kernels come from autograd's own thread, so the profiler
        would not count them under the phase that ran the backward."""
        events = self.prof.key_averages()
        steps = self.last - self.first + 1
        calls = {e.key: e.count for e in events if e.key.startswith(PHASE)}
        lines = [f"phase (per step, mean of {steps})          wall ms  calls"]
        for name, sec in self.phase_s.most_common():
            lines.append(f"{name:<36}{sec * 1e3 / steps:9.1f}  {calls.get(name, 0) / steps:5.1f}")
        key = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        return "\n".join(lines) + "\n" + events.table(sort_by=key, row_limit=TOP_OPS, max_name_column_width=60)


PHASE = "step/"  # the record_function labels of a step's phases
_WINDOW: list[StepProfiler | None] = [None]  # the profiler whose window is open, if any


@contextlib.contextmanager
def phase(name: str):
    """A labelled phase of the step (record_function); inside a PROFILE_STEPS window also timed, the
    device synchronised at both ends. Outside a window it costs one record_function."""
    window, label = _WINDOW[0], PHASE + name
    with torch.profiler.record_function(label):
        if window is None:
            yield
            return
        sync = torch.cuda.synchronize if window.device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            sync()
            window.phase_s[label] += time.perf_counter() - t0
