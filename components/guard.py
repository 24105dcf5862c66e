"""The non-finite-step guard: skip an update whose loss or grad norm is non-finite on any rank, and
stop after too many in a row.

    python -m pytest tests/test_fault_tolerance.py -q
"""
from __future__ import annotations

import math

import torch

from core.errors import RunError

def is_finite(*values):
    """Whether every value (floats, or 0-d tensors such as losses and grad norms) is finite: a 0-d
    bool tensor where tensors are given, computed where they live, so no host sync (agree reads it
    together with the other flags of the step)."""
    tensors = [v.detach().to(torch.float64).reshape(()) for v in values if torch.is_tensor(v)]
    plain = all(math.isfinite(float(v)) for v in values if not torch.is_tensor(v))
    if not tensors:
        return plain
    device = tensors[0].device
    return torch.stack([t.to(device) for t in tensors]).isfinite().all() & plain


class NonFiniteGuard:
    """Skips optimizer steps whose loss or gradient norm is non-finite on any rank: every rank records
    the same agreed outcome (agree(is_finite(...)), one collective), so no rank steps alone.
    Counts skipped steps (`skipped_steps` in metrics and checkpoints); `exhausted` after
    `max_in_a_row` bad steps in a row, when the script saves and stops with RunError."""

    def __init__(self, max_in_a_row: int):
        self.max_in_a_row, self.skipped, self.in_a_row = max_in_a_row, 0, 0

    def record(self, good: bool) -> bool:
        """Count a step whose finiteness all ranks agreed on (agree); returns `good`."""
        if good:
            self.in_a_row = 0
        else:
            self.skipped += 1
            self.in_a_row += 1
        return good

    @property
    def exhausted(self) -> bool:
        return self.in_a_row >= self.max_in_a_row

    def state(self) -> dict:
        return {"skipped_steps": self.skipped, "bad_steps_in_a_row": self.in_a_row}

    def load(self, meta: dict) -> None:
        self.skipped, self.in_a_row = int(meta.get("skipped_steps", 0)), int(meta.get("bad_steps_in_a_row", 0))

    def error(self, step: int) -> RunError:
        return RunError(f"{self.in_a_row} non-finite steps in a row (MAX_BAD_STEPS={self.max_in_a_row}) at step "
                        f"{step}; checkpoint saved. Lower the LR or check the data, then --resume=auto")
