"""components/profiling.py: PROFILE_STEPS checked before any work, and the window it profiles.

    python -m pytest tests/test_profiling.py -q
"""
from __future__ import annotations

import json

import pytest
import torch

from components import profiling
from core.errors import ConfigError


def test_profile_steps_are_a_window_after_the_first_step():
    assert profiling.profile_steps([], 10) == []
    assert profiling.profile_steps(["4", "5"], 10) == [4, 5]  # --profile_steps=4,5 arrives as strings
    for bad in ([1, 2], [5, 4], [4, 11], [3], ["x", 4]):
        with pytest.raises(ConfigError, match=r"PROFILE_STEPS=.*2 <= first <= last <= MAX_STEPS \(10\)"):
            profiling.profile_steps(bad, 10)


def test_the_window_holds_its_steps_phases_only(tmp_path):
    """Steps 2-3 of 4: started after step 1 ended, stopped after step 3's updates; the table has the
    labelled phases and the ops; ops of steps 1 and 4 are not in the trace."""
    prof = profiling.StepProfiler([2, 3], str(tmp_path), torch.device("cpu"))
    a = torch.randn(8, 8)
    for step in range(1, 5):
        with profiling.phase("forward_backward"):
            (a @ a).sum()
        if step in (1, 4):
            torch.cumsum(a, 0)  # outside the window
        with profiling.phase("updates"):
            a.add_(1e-3)
        assert (prof.updates_done(step) is not None) == (step == 3)
        prof.after_step(step)
    table = (tmp_path / "profile" / "ops_rank0.txt").read_text()
    assert "mean of 2" in table and "step/forward_backward" in table and "step/updates" in table
    assert set(prof.phase_s) == {"step/forward_backward", "step/updates"} and min(prof.phase_s.values()) > 0
    assert profiling._WINDOW[0] is None  # closed: phases after the window are not timed
    assert [line.split()[-1] for line in table.splitlines()[1:3]] == ["1.0", "1.0"]  # calls per step
    assert "aten::mm" in table and "aten::cumsum" not in table
    names = [e.get("name") for e in json.loads((tmp_path / "profile" / "trace_rank0.json").read_text())["traceEvents"]]
    assert names.count("step/updates") == 2 and "aten::cumsum" not in names
