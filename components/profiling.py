"""PROFILE_STEPS: torch.profiler over a window of training steps (torchtitan's profiling.enable_profiling),
for finding where a GPU step goes: each rank writes a Chrome/Perfetto trace, rank 0 a table of the ops
and the step's labelled phases by their device time (CPU time on a CPU run).

    python -m pytest tests/test_profiling.py -q
"""
from __future__ import annotations

import os

import torch

from components.dist import print0, rank
from components.errors import ConfigError

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

    def after_step(self, step: int) -> None:
        """Called when step `step` has ended; starts the window before step `first`."""
        if step == self.first - 1 and self.prof is None:
            from torch.profiler import ProfilerActivity, profile
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self.prof = profile(activities=activities, record_shapes=True)
            self.prof.__enter__()

    def updates_done(self, step: int) -> str | None:
        """Called after step `step`'s updates; at `last` stops and writes. Returns the trace's path."""
        if self.prof is None or step != self.last:
            return None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the window's kernels end inside it
        self.prof.__exit__(None, None, None)
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
        """The step's phases (the `phase` labels: their time with everything inside), then the ops by
        their own time: device time on a GPU (the kernels'), else CPU time."""
        events = self.prof.key_averages()
        gpu = self.device.type == "cuda"
        steps = self.last - self.first + 1
        lines = [f"phase (per step, mean of {steps})" + ("  device ms" if gpu else "") + "  CPU ms  calls"]
        for e in sorted((e for e in events if e.key.startswith(PHASE)), key=lambda e: -e.cpu_time_total):
            device = f"  {e.device_time_total / 1e3 / steps:9.1f}" if gpu else ""
            lines.append(f"{e.key:<36}{device}  {e.cpu_time_total / 1e3 / steps:6.1f}  {e.count / steps:5.1f}")
        key = "self_device_time_total" if gpu else "self_cpu_time_total"
        return "\n".join(lines) + "\n" + events.table(sort_by=key, row_limit=TOP_OPS, max_name_column_width=60)


PHASE = "step/"  # the record_function labels of a step's phases


def phase(name: str):
    """A labelled phase of the step (record_function; free when no profiler runs)."""
    return torch.profiler.record_function(PHASE + name)
