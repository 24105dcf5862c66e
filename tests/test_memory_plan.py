"""Memory planner at real scale on the meta device with a fake process group (no GPU, no weights).

    python -m pytest tests/test_memory_plan.py -q
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests._dist import ROOT

sys.path.insert(0, ROOT)
from tools import memory_plan  # noqa: E402
from tools.memory_plan import GIB, Settings  # noqa: E402


def test_flux_kontext_shards_to_a_quarter_at_world_size_4():
    p = memory_plan.plan("flux-kontext-dev", Settings(world_size=4))
    row = p["rows"]["transformer"]
    assert abs(row["count"] - 11.90e9) < 0.01e9          # REFERENCE: ≈ 11.90 B parameters
    assert abs(row["local_count"] - 2.975e9) < 0.002e9    # 2.975 B per rank at world size 4
    # bf16-mixed: fp32 master + fp32 grads + 2 fp32 Adam states = 16 B/param -> 47.6 GB per rank
    states = row["params"] + row["grads"] + row["optim"]
    assert abs(states / 1e9 - 47.6) < 0.1
    assert p["largest_unit"] == pytest.approx(339.8e6 * 2, rel=0.01)   # one double block in bf16
    assert p["rows"]["text_encoder_2"]["params"] == 0     # T5 is not resident during training


def test_checkpointing_and_offload_shrink_the_gpu_total():
    base = memory_plan.plan("flux-kontext-dev", Settings(world_size=8, batch_size=1, resolution=256))
    ac = memory_plan.plan("flux-kontext-dev", Settings(world_size=8, batch_size=1, resolution=256,
                                                       activation_checkpointing=True))
    off = memory_plan.plan("flux-kontext-dev", Settings(world_size=8, batch_size=1, resolution=256,
                                                        activation_checkpointing=True, cpu_offload=True))
    assert ac["activations"] < base["activations"] / 4
    assert off["gpu_total"] < ac["gpu_total"] and off["host_total"] > 0


def test_activation_probe_matches_a_hand_count():
    # y = relu(x @ W): autograd saves x (for W's grad) and the relu output; W is a parameter (excluded)
    lin = torch.nn.Sequential(torch.nn.Linear(64, 128, bias=False), torch.nn.ReLU())
    x = torch.randn(10, 64, requires_grad=True)
    got = memory_plan.activation_bytes(lin, {"input": x}, [], False)
    assert got == (10 * 64 + 10 * 128) * 4


def test_cli_names_cheapest_fitting_settings():
    r = subprocess.run([sys.executable, "fsdp_utils.py", "plan", "--model=sd15-dmd", "--world_size=2",
                        "--gpu_memory_gb=12", "--batch_size=2", "--resolution=256"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-1000:]
    assert "generator" in r.stdout and "teacher" in r.stdout and "TOTAL per GPU" in r.stdout
    assert "fits in 12 GB" in r.stdout or "cheapest settings that fit" in r.stdout
