"""Memory planner at real scale on the meta device with a fake process group (no GPU, no weights).

    python -m pytest tests/test_memory_plan.py -q
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT

sys.path.insert(0, ROOT)
from tools import memory_plan  # noqa: E402
from tools.memory_plan import Settings  # noqa: E402


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


SMALL = dict(world_size=2, batch_size=1, resolution=64)


def _unit_params(model, classes):
    """Independent count: {module name: own params} of each unit of `classes`, plus the root's rest."""
    blocks = [(n, m) for n, m in model.named_modules() if m is not model and type(m).__name__ in classes]
    owned, out = set(), {}
    for n, m in reversed(blocks):
        ps = [p for p in m.parameters() if id(p) not in owned]
        owned.update(id(p) for p in ps)
        out[n] = sum(p.numel() for p in ps)
    out["<root>"] = sum(p.numel() for p in model.parameters() if id(p) not in owned)
    return out


def test_planner_follows_the_recipes_and_the_table(monkeypatch):
    fsdp_utils = memory_plan.fsdp_utils
    src = open(memory_plan.__file__).read()
    for classes in fsdp_utils.MODEL_BLOCKS.values():  # no wrapping decision repeated in the planner
        assert not any(f'"{c}"' in src for c in classes)
    unet = memory_plan.meta_model(f"{ROOT}/tools/real_size_configs/sd15-dmd/unet")
    base = memory_plan.plan("sd15-dmd", Settings(**SMALL))
    default = _unit_params(unet, fsdp_utils.MODEL_BLOCKS["UNet2DConditionModel"])
    assert dict(base["units"]["generator"]) == default
    assert base["largest_unit"] == max(default.values()) * 2  # bf16 compute dtype
    # another unit choice in the UNet recipe: the planner's units, largest unit and gathered bytes follow
    monkeypatch.setitem(fsdp_utils.MODEL_BLOCKS, "UNet2DConditionModel", ("ResnetBlock2D",))
    coarse = memory_plan.plan("sd15-dmd", Settings(**SMALL))
    want = _unit_params(unet, ("ResnetBlock2D",))
    for name in ("generator", "fake_score", "teacher"):
        assert dict(coarse["units"][name]) == want
    assert coarse["largest_unit"] == max(want.values()) * 2 > base["largest_unit"]
    # the two largest units in flight (generator, fake score and teacher all have this root) in bf16,
    # plus the largest trainable unit's fp32 reduce-scatter buffer
    assert coarse["gathered"] == 2 * max(want.values()) * 2 + max(want.values()) * 4 > base["gathered"]
    # the table decides the roles: a replicated teacher is a full copy, and its units gather nothing
    dmd = fsdp_utils.SCRIPT_COMPONENTS["train_dmd.py"]
    monkeypatch.setitem(fsdp_utils.SCRIPT_COMPONENTS, "train_dmd.py", tuple(
        fsdp_utils.Component(c.name, c.subfolder, "replicated") if c.name == "teacher" else c for c in dmd))
    replicated = memory_plan.plan("sd15-dmd", Settings(**SMALL))
    row = replicated["rows"]["teacher"]
    assert row["note"] == "replicated" and row["local_count"] == row["count"] and "teacher" not in replicated["units"]


@pytest.mark.parametrize("name", ["sd15-dmd", "flux-kontext-dev"])
def test_unit_parameter_counts_sum_to_the_model(name):
    p = memory_plan.plan(name, Settings(**SMALL))
    assert p["units"]
    for comp, units in p["units"].items():
        spec = next(c for c in memory_plan.fsdp_utils.SCRIPT_COMPONENTS[p["script"]] if c.name == comp)
        model = memory_plan.meta_model(f"{ROOT}/tools/real_size_configs/{name}/{spec.subfolder}")
        total = sum(q.numel() for q in model.parameters())
        assert sum(n for _, n in units) == total == p["rows"][comp]["count"]
        assert len({n for n, _ in units}) == len(units) and units[-1][0] == "<root>"


SDXL_UNET_PARAMS = 2_567_463_684  # REFERENCE: stabilityai/stable-diffusion-xl-base-1.0 unet (≈ 2.567 B)


def test_sdxl_unet_shards_to_an_eighth_at_world_size_8():
    p = memory_plan.plan("sdxl-dmd", Settings(world_size=8, batch_size=1, resolution=64))
    assert p["kind"] == "sdxl" and p["script"] == "train_dmd.py"
    rows = p["rows"]
    for name in ("generator", "fake_score", "teacher"):
        assert rows[name]["count"] == SDXL_UNET_PARAMS
        assert abs(rows[name]["local_count"] - SDXL_UNET_PARAMS / 8) < 5000  # dim-0 padding only
        assert sum(n for _, n in p["units"][name]) == SDXL_UNET_PARAMS
    local = rows["generator"]["local_count"]
    assert rows["generator"]["params"] == local * 4 and rows["generator"]["optim"] == 2 * local * 4  # fp32 master
    assert rows["teacher"]["params"] == local * 2                                                    # bf16 frozen
    # the second text encoder (OpenCLIP bigG with projection), replicated in the compute dtype
    te2 = rows["text_encoder_2"]
    assert te2["local_count"] == te2["count"] and abs(te2["count"] - 694.66e6) < 0.01e6
    assert te2["params"] == te2["count"] * 2
    # SDXL's VAE stays fp32 whatever the precision (train_dmd.py's default); SD-1.5's is in the compute dtype
    assert rows["vae"]["params"] == rows["vae"]["count"] * 4 and "fp32" in rows["vae"]["note"]
    sd15 = memory_plan.plan("sd15-dmd", Settings(**SMALL))
    assert "text_encoder_2" not in sd15["rows"] and sd15["kind"] == "sd15"
    assert sd15["rows"]["vae"]["params"] == sd15["rows"]["vae"]["count"] * 2


def test_native_resolution_is_the_default():
    folder = memory_plan.model_folder
    assert memory_plan.native_resolution(folder("sd15-dmd"), "sd15") == 512
    assert memory_plan.native_resolution(folder("sdxl-dmd"), "sdxl") == 1024
    assert memory_plan.native_resolution(folder("flux-kontext-dev"), "flux_kontext") == 512
    assert Settings(world_size=2).resolution is None  # plan() fills in the native one


def test_sdxl_meta_inputs_carry_the_added_conditioning():
    unet = memory_plan.meta_model(f"{ROOT}/tools/real_size_configs/sdxl-dmd/unet")
    pooled = memory_plan._pooled_dim(memory_plan.model_folder("sdxl-dmd"), unet.config)
    x = memory_plan._meta_inputs("sdxl", unet, 2, 1024, torch.bfloat16, 8, 77, pooled)
    assert x["sample"].shape == (2, 4, 128, 128) and x["encoder_hidden_states"].shape == (2, 77, 2048)
    assert x["added_cond_kwargs"]["text_embeds"].shape == (2, 1280)
    assert x["added_cond_kwargs"]["time_ids"].shape == (2, 6)


def test_cli_plans_sdxl():
    r = subprocess.run([sys.executable, "fsdp_utils.py", "plan", "--model=sdxl-dmd", "--world_size=8",
                        "--gpu_memory_gb=80"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-1000:]
    assert "sdxl-dmd (sdxl)" in r.stdout and "at 1024px" in r.stdout and "TOTAL per GPU" in r.stdout
    assert "text_encoder_2" in r.stdout


def test_fit_table_is_markdown():
    table = memory_plan.fit_table("sd15-dmd", world_sizes=(2,), gpu_memory_gbs=(1, 80), resolution=64)
    lines = table.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("| GPUs"))
    assert lines[head].count("|") == lines[head + 1].count("|") == lines[head + 2].count("|") == 10  # 9 columns
    row = lines[head + 2]
    assert row.startswith("| 2 |") and "does not fit" in row and "as is (" in row
