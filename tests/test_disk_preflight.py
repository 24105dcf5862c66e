"""The disk preflight: one checkpoint's estimate against what DCP writes, the export's against what
export_pipeline writes, the verdict, and the preflight stopping or warning on a patched free space.

    python -m pytest tests/test_disk_preflight.py -q
"""
from __future__ import annotations

import json
import os
from collections import namedtuple

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from tests.conftest import tiny_unet

import checkpoint
from core.errors import ConfigError
from components.export import export_bytes, export_pipeline

Usage = namedtuple("Usage", "total used free")


def folder_bytes(folder) -> int:
    """Bytes of the files under `folder` that a write made: neither symlinks nor hard links (a linked frozen part
    costs nothing)."""
    paths = [os.path.join(r, f) for r, _, names in os.walk(folder) for f in names]
    return sum(os.path.getsize(p) for p in paths if not os.path.islink(p) and os.stat(p).st_nlink == 1)


def small_model(frozen: bool) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64), nn.BatchNorm1d(64))
    if frozen:  # a LoRA-like mix: checkpoints hold the trainable params only (a large frozen base left out)
        m.append(nn.Linear(64, 512).requires_grad_(False))
    return m


def saved_bytes(model, opt, folder) -> int:
    """Take one step, then write the checkpoint's DCP part as Checkpointer.write does (no process group)."""
    model(torch.randn(8, 64)).sum().backward()
    opt.step()
    dcp.save(checkpoint._dcp_state({"m": model}, {"m": (model, opt)}), checkpoint_id=str(folder))
    return folder_bytes(folder)


@pytest.mark.parametrize("frozen", [False, True], ids=["full", "partly-frozen"])
def test_checkpoint_estimate_before_first_step_matches_dcp(tmp_path, frozen):
    model = small_model(frozen)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    estimate = checkpoint.checkpoint_bytes({"m": model}, {"m": opt})
    assert not opt.state  # the estimate made no states
    written = saved_bytes(model, opt, tmp_path / "ckpt")
    print(f"checkpoint estimate / written ({'partly frozen' if frozen else 'full'}): "
          f"{estimate} / {written} = {estimate / written:.4f}")
    assert 0.97 < estimate / written < 1.03
    assert checkpoint.checkpoint_bytes({"m": model}, {"m": (model, opt)}) == pytest.approx(estimate, rel=1e-3)


def test_lowbit_optimizer_estimate_matches_dcp(tmp_path):
    pytest.importorskip("torchao")
    from components.optim import make_optimizer
    model = small_model(False)
    opt = make_optimizer("adamw8bit", model.parameters(), lr=1e-3, betas=(0.9, 0.99))
    estimate = checkpoint.checkpoint_bytes({"m": model}, {"m": opt})
    written = saved_bytes(model, opt, tmp_path / "ckpt")
    print(f"checkpoint estimate / written (adamw8bit): {estimate} / {written} = {estimate / written:.4f}")
    assert 0.97 < estimate / written < 1.03


def test_export_estimate_matches_export_pipeline(tmp_path):
    from safetensors.torch import save_file
    src, out = tmp_path / "src", tmp_path / "export"
    unet = tiny_unet()
    unet.save_pretrained(src / "unet")
    (src / "vae").mkdir()  # fp16 weights: the fp32 export writes a converted copy
    save_file({"w": torch.randn(256, 256, dtype=torch.float16), "n": torch.arange(10)}, src / "vae" / "m.safetensors")
    (src / "vae" / "config.json").write_text("{}")
    (src / "other").mkdir()  # fp32 weights: hard-linked (tmp_path: one filesystem), costs nothing
    save_file({"w": torch.randn(512, 512)}, src / "other" / "m.safetensors")
    index = {"_class_name": "X", "unet": ["diffusers", "UNet2DConditionModel"]}
    (src / "model_index.json").write_text(json.dumps(index))
    estimate = export_bytes(str(src), "unet", unet, torch.float32)
    export_pipeline(str(src), str(out), {"unet": unet}, torch.float32)
    written = folder_bytes(out)
    print(f"export estimate / written: {estimate} / {written} = {estimate / written:.4f}")
    assert os.path.samefile(out / "other" / "m.safetensors", src / "other" / "m.safetensors")
    assert not os.path.islink(out / "other") and not os.path.islink(out / "vae")
    assert 0.97 < estimate / written < 1.03
    # on another filesystem the frozen parts are copies, and the estimate counts them
    other_fs = export_bytes(str(src), "unet", unet, torch.float32, out_dir="/proc/x")
    assert other_fs == estimate + os.path.getsize(src / "other" / "m.safetensors")


def test_export_estimate_of_lora(tmp_path):
    """LoRA: the adapters in fp32; with a merged export also the base layout in EXPORT_DTYPE."""
    model = nn.Module()
    model.layer = nn.Module()  # peft's names: layer.base_layer.weight, layer.lora_A.default.weight
    model.layer.base_layer = nn.Linear(32, 32)
    model.layer.lora_A = nn.ModuleDict({"default": nn.Linear(32, 4, bias=False)})
    model.layer.lora_B = nn.ModuleDict({"default": nn.Linear(4, 32, bias=False)})
    (tmp_path / "unet").mkdir()
    (tmp_path / "model_index.json").write_text("{}")
    adapters, base = (32 * 4 + 4 * 32) * 4, (32 * 32 + 32) * 2
    assert export_bytes(str(tmp_path), "unet", model, torch.bfloat16, lora=True) == adapters
    merged = export_bytes(str(tmp_path), "unet", model, torch.bfloat16, lora=True, merged=True)
    assert merged == adapters + base + len("{}")


def test_disk_verdict_outcomes():
    gb = 10**9
    assert checkpoint.disk_verdict(10 * gb, 30 * gb, 40 * gb) == ("ok", "")
    verdict, message = checkpoint.disk_verdict(10 * gb, 30 * gb, 20 * gb, where="OUTPUT_DIR=/o: ")
    assert verdict == "warn" and "30.0 GB" in message and "20.0 GB" in message and "/o" in message
    verdict, message = checkpoint.disk_verdict(10 * gb, 30 * gb, 5 * gb)
    assert verdict == "stop" and "10.0 GB" in message and "5.0 GB" in message


@pytest.fixture
def setup(tmp_path, monkeypatch):
    """A model and optimizer, their one-checkpoint estimate, and a setter of the free space seen."""
    model = small_model(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    one = checkpoint.checkpoint_bytes({"m": model}, {"m": opt})

    def free(n):
        monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: Usage(10**12, 10**12 - n, n))
    return {"models": {"m": model}, "optimizers": {"m": opt}}, one, free, tmp_path / "out" / "run"


def test_preflight_stops_when_one_checkpoint_cannot_fit(setup, capsys):
    state, one, free, out = setup
    free(one // 2)
    with pytest.raises(ConfigError) as e:
        checkpoint.disk_preflight(str(out), **state, keep_last=2, export=0)
    message = str(e.value)
    assert str(out) in message and checkpoint._gb(one) in message and checkpoint._gb(one // 2) in message
    assert "\n" not in message and capsys.readouterr().out == ""


def test_preflight_warns_when_keep_last_plus_one_cannot_fit(setup, capsys):
    state, one, free, out = setup
    export = one // 2
    free(3 * one)  # KEEP_LAST=2: three checkpoints and the export do not fit, one does
    line = checkpoint.disk_preflight(str(out), **state, keep_last=2, export=export)
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == line and line.startswith("disk: one checkpoint") and "KEEP_LAST=2" in line
    assert len(printed) == 2 and printed[1].startswith("warning:")
    assert checkpoint._gb(3 * one + export) in printed[1] and checkpoint._gb(3 * one) in printed[1]

    free(3 * one + export)  # exactly enough: no warning
    checkpoint.disk_preflight(str(out), **state, keep_last=2, export=export)
    assert "warning" not in capsys.readouterr().out


def test_preflight_counts_checkpoints_on_disk(setup, capsys):
    """A checkpoint of the resumed run already in OUTPUT_DIR is pruned as new ones come: the need
    shrinks by its size; another run's (a fresh run's neighbour) is not."""
    state, one, free, out = setup
    old = out / "checkpoints" / "step_000004"
    old.mkdir(parents=True)
    (old / "trainer_state.json").write_text("{}")
    (old / ".metadata").write_bytes(b"\0" * one)
    free(5 * one // 2)  # fits 2 more checkpoints (one already on disk), not 3
    line = checkpoint.disk_preflight(str(out), **state, keep_last=2, export=0, resume=str(old))
    assert "warning" not in capsys.readouterr().out and "(less 1 on disk)" in line
    checkpoint.disk_preflight(str(out), **state, keep_last=2, export=0)  # a fresh run beside it prunes none
    assert "warning" in capsys.readouterr().out
