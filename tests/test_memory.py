"""parallel/memory.py: the bytes a rank holds (params, grads, optimizer state) and the table the
scripts print. The sharded numbers are checked in test_fsdp_utils.py (half per rank on 2 ranks).

    python -m pytest tests/test_memory.py -q
"""
from __future__ import annotations

import json

import torch

from parallel import memory


def test_state_bytes_count_params_grads_and_optimizer_state():
    model = torch.nn.Linear(10, 4)  # 44 fp32 params
    opt = torch.optim.AdamW(model.parameters())
    assert memory.local_state_bytes({"m": model}, {"m": opt}) == {"params": 176, "grads": 0, "optim": 0}
    model(torch.randn(2, 10)).sum().backward()
    opt.step()
    got = memory.local_state_bytes({"m": model}, {"m": opt})
    assert got["grads"] == 176 and got["optim"] == 2 * 176 + 2 * 4  # exp_avg, exp_avg_sq, 2 step counters


def test_report_is_a_table_and_a_machine_readable_line():
    model = torch.nn.Linear(10, 4).to(torch.bfloat16)
    lines = memory.memory_report({"m": model}, {}).splitlines()
    assert lines[0].split() == ["rank", "params", "grads", "optim", "rss_peak", "cuda_peak"]
    row = json.loads(lines[-1].split(" ", 1)[1])[0]
    assert row["params"] == 88 and 0 < row["rss_peak"] <= memory.peak_host_rss_bytes()
