"""FSDP2 core: config overrides, block detection, 2-rank FSDP/HSDP parity with one process,
meta-device loading from a diffusers folder.

    python -m pytest tests/test_fsdp_utils.py -q
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from tests.conftest import ROOT, run_ranks

sys.path.insert(0, ROOT)
import fsdp_utils  # noqa: E402
from parallel import loading, memory  # noqa: E402
from parallel.parallelize import parallelize  # noqa: E402
import data_utils  # noqa: E402
import run_utils  # noqa: E402
from run_utils import ConfigError  # noqa: E402


# ----------------------------------------------------------------------------------------------
# a tiny model with a repeated block class

class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class TinyNet(nn.Module):
    def __init__(self, d=16, n=3):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.out = nn.Linear(d, 1)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def make_data(steps, global_batch):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(global_batch, 8, generator=g), torch.randn(global_batch, 1, generator=g))
            for _ in range(steps)]


def train_reference(steps=5, global_batch=8, clip=0.5):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    losses, norms = [], []
    for x, y in make_data(steps, global_batch):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _parity(rank, world, dp_replicate, ac, prefetch, mode="fp32", offload=False, tol=1e-5):
    from precision import get_precision
    ref_losses, ref_norms, ref_params = train_reference()
    torch.manual_seed(0)
    model = TinyNet()
    mesh = fsdp_utils.build_meshes(torch.device("cpu"), dp_replicate)[0]
    sharding = fsdp_utils.Sharding(activation_checkpointing=ac, prefetch=prefetch, cpu_offload=offload)
    blocks = parallelize(model, mesh, get_precision(mode).mp_policy(), sharding, block_classes=["Block"], verbose=False)
    assert len(blocks) == 3
    fsdp_utils.assert_sharded(model, mesh)
    # the scripts' optimizer: fused AdamW over the DTensor shards, against torch's default on one process
    opt = fsdp_utils.adamw(model.parameters(), lr=1e-2, weight_decay=0.01)
    assert opt.defaults["fused"]
    for i, (x, y) in enumerate(make_data(5, 8)):
        x, y = data_utils.rank_slice(x, rank, world), data_utils.rank_slice(y, rank, world)
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        norm = fsdp_utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        mean_loss = run_utils.mean_across_ranks({"loss": float(loss)})["loss"]
        assert abs(mean_loss - ref_losses[i]) < tol * max(1, abs(ref_losses[i])), (i, mean_loss, ref_losses[i])
        assert abs(float(norm) - ref_norms[i]) < tol * max(1, ref_norms[i]), (i, float(norm), ref_norms[i])
    for k, v in model.state_dict().items():
        assert v.dtype == torch.float32  # master weights stay fp32 in every mode tested here
        # Adam moves each weight by at most ~lr per step, so bf16 noise can flip a few of 5 updates
        atol = tol / 10 if mode == "fp32" else 5 * 1e-2
        torch.testing.assert_close(v.full_tensor(), ref_params[k], rtol=tol, atol=atol)
    report = memory.memory_report({"m": model}, {"m": opt})
    assert "rss_peak" in report


@pytest.mark.parametrize("dp_replicate,ac,prefetch", [(1, False, 0), (2, False, 0), (1, True, 1)],
                         ids=["fsdp", "hsdp", "fsdp-ac-prefetch"])
def test_two_rank_parity_with_one_process(dp_replicate, ac, prefetch):
    run_ranks(_parity, 2, dp_replicate, ac, prefetch)


def test_bf16_mixed_with_offload_and_checkpointing_tracks_fp32():
    # bf16 compute against an fp32 reference: agreement to bf16 precision, fp32 master weights
    run_ranks(_parity, 2, 1, True, 0, "bf16-mixed", True, 3e-2)


def _sharded_bytes(rank, world):
    from precision import get_precision
    model = TinyNet(d=32)
    full = sum(p.numel() for p in model.parameters())
    mesh = fsdp_utils.build_meshes(torch.device("cpu"))[0]
    parallelize(model, mesh, get_precision("bf16-mixed").mp_policy(), verbose=False)
    local = memory.local_state_bytes({"m": model}, {})["params"]
    # the largest repeated class was detected, and each rank stores about half, in fp32
    assert abs(local - full * 4 / 2) <= full * 4 * 0.02, (local, full)


def test_detected_blocks_shard_half_per_rank():
    run_ranks(_sharded_bytes, 2)


# ----------------------------------------------------------------------------------------------
# block detection, settings

def test_find_block_classes():
    m = TinyNet()
    assert fsdp_utils.find_block_classes(m, ["Block"])[0] == ["Block"]
    names, why = fsdp_utils.find_block_classes(m)
    assert names == ["Block"] and "largest repeated" in why
    m._no_split_modules = ["Block", "Missing"]
    assert fsdp_utils.find_block_classes(m) == (["Block"], "TinyNet._no_split_modules")
    with pytest.raises(ConfigError, match="not found"):
        fsdp_utils.find_block_classes(m, ["BasicTransformerBlock"])


def test_overrides_type_checked_and_case_insensitive():
    ns = {"MAX_STEPS": 10, "LR": 1e-4, "NAME": "x", "FLAG": False, "STEPS": [999, 749], "lower": 1}
    cfg = run_utils.apply_overrides(ns, ["--max_steps=20", "--LR=3e-5", "--flag=true", "--steps=[999,500]",
                                          "--Name=y"])
    assert cfg == {"MAX_STEPS": 20, "LR": 3e-5, "NAME": "y", "FLAG": True, "STEPS": [999, 500]}
    assert run_utils.apply_overrides(ns, ["--steps=999,1"])["STEPS"] == [999, 1]
    with pytest.raises(ConfigError, match="did you mean --max_steps"):
        run_utils.apply_overrides(ns, ["--max_step=3"])
    with pytest.raises(ConfigError, match="expected int"):
        run_utils.apply_overrides(ns, ["--max_steps=ten"])
    with pytest.raises(ConfigError, match="expected bool"):
        run_utils.apply_overrides(ns, ["--flag=maybe"])
    with pytest.raises(ConfigError, match="--name=value"):
        run_utils.apply_overrides(ns, ["max_steps=3"])


def test_dp_replicate_must_divide_world():
    fsdp_utils.check_dp_replicate(2, 4)
    with pytest.raises(ConfigError, match="DP_REPLICATE=3 does not divide the world size 2"):
        fsdp_utils.check_dp_replicate(3, 2)


def test_run_main_config_error_is_one_line_exit_2():
    code = ("import sys; sys.path.insert(0, %r); import run_utils\n"
            "def main():\n    raise run_utils.ConfigError('bad thing')\n"
            "run_utils.run_main(main)\n") % ROOT
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == "error: bad thing"


def test_global_batch_indices_cover_epochs():
    seen = [i for s in range(5) for i in data_utils.global_batch_indices(s, 4, 10, seed=3)]
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:20]) == list(range(10))
    assert data_utils.global_batch_indices(3, 4, 10, 3) == seen[12:16]


# ----------------------------------------------------------------------------------------------
# meta-device loading from a diffusers folder

def tiny_unet():
    from diffusers import UNet2DConditionModel
    torch.manual_seed(0)
    return UNet2DConditionModel(
        block_out_channels=(32, 64), layers_per_block=1, sample_size=8, in_channels=4, out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, norm_num_groups=8, attention_head_dim=4)


def _meta_load(rank, world, folder, dtype_name):
    from diffusers import UNet2DConditionModel
    from precision import get_precision, parse_dtype
    ref = UNet2DConditionModel.from_pretrained(folder).state_dict()
    mesh = fsdp_utils.build_meshes(torch.device("cpu"))[0]
    model = loading.build_on_meta(UNet2DConditionModel, folder).to(parse_dtype(dtype_name))
    parallelize(model, mesh, get_precision("fp32").mp_policy(), block_classes=["BasicTransformerBlock", "ResnetBlock2D"],
                verbose=False)
    loading.materialize_and_load(model, folder, torch.device("cpu"))
    for k, v in model.state_dict().items():
        full = v.full_tensor() if hasattr(v, "full_tensor") else v
        assert full.dtype == parse_dtype(dtype_name)
        torch.testing.assert_close(full, ref[k].to(full.dtype), rtol=0, atol=0)


@pytest.mark.parametrize("sharded_files", [False, True], ids=["single-file", "sharded-index"])
def test_meta_device_load_equals_original(tmp_path, sharded_files):
    unet = tiny_unet()
    unet.save_pretrained(tmp_path / "unet", max_shard_size="200KB" if sharded_files else "10GB")
    if sharded_files:
        assert (tmp_path / "unet" / "diffusion_pytorch_model.safetensors.index.json").exists()
    run_ranks(_meta_load, 2, str(tmp_path / "unet"), "bf16" if sharded_files else "fp32")


def test_meta_load_rejects_wrong_folder(tmp_path):
    from diffusers import UNet2DConditionModel
    with pytest.raises(ConfigError, match="no config.json"):
        loading.build_on_meta(UNet2DConditionModel, str(tmp_path))
