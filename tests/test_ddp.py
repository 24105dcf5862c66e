"""PARALLELISM=ddp (plain DistributedDataParallel) trains like PARALLELISM=fsdp (FSDP2).

    python -m pytest tests/test_ddp.py -q

Each script on its embedded default, 2 CPU ranks, fp32, 2 steps: both launches run at once (they
are independent) and must log the same losses and grad norms to ~1e-4 (only the order of the
gradient reductions differs), and the DDP run must write a loadable export of the unwrapped model.
"""
from __future__ import annotations

import json
import os
import sys

import pytest

from tests.conftest import VALIDATE, assert_validated, finish, launch_env, start, tiny_default

import fsdp_utils
from components.config import script_constants
from core.errors import ConfigError


def run_both(script: str, common: list[str], tmp_path):
    """Launch the script at PARALLELISM=fsdp and =ddp at once (2 CPU ranks each); returns
    ({mode: log}, {mode: metrics records}) after checking that both succeeded."""
    env = launch_env()
    procs = {par: start(script, [f"--parallelism={par}", f"--output_dir={tmp_path / par}"] + common, env=env)
             for par in ("fsdp", "ddp")}
    logs = {}
    for par, p in procs.items():
        rc, logs[par] = finish(p)
        assert rc == 0, f"{par} run failed:\n{logs[par][-3000:]}"
    rec = {}
    for par in procs:
        with open(tmp_path / par / "metrics.jsonl") as f:
            rec[par] = [json.loads(line) for line in f]
    return logs, rec


def assert_exports_match(tmp_path, component: str) -> None:
    """The two runs' exported trained model is the same (to reduction-order noise)."""
    from safetensors.torch import load_file
    exported = {par: load_file(str(tmp_path / par / "export" / component / "diffusion_pytorch_model.safetensors"))
                for par in ("fsdp", "ddp")}
    assert exported["fsdp"].keys() == exported["ddp"].keys()
    for k, v in exported["fsdp"].items():
        assert (v - exported["ddp"][k]).abs().max() < 1e-4, k


@pytest.mark.slow
def test_ddp_matches_fsdp(tmp_path):
    model, data = tiny_default("flux_kontext")
    common = [
        f"--model_path={model}",
        f"--data_path={os.path.join(data, 'data.jsonl')}",
        "--precision=fp32",
        "--resolution=64",  # the pairs' own size, not the pipeline's 1024: parity needs no long sequences
        "--max_steps=2",
        "--log_every=1",
        "--sample_every=0",
        "--save_every=0",
        "--lr=1e-3",
        "--warmup_steps=0",
        "--export_dtype=fp32",
    ]
    # separate text caches (under each OUTPUT_DIR): the two runs fill theirs at the same time
    logs, rec = run_both("train_flux_kontext.py", common, tmp_path)
    assert "ddp: FluxTransformer2DModel: full replica per rank" in logs["ddp"]
    assert [r["step"] for r in rec["ddp"]] == [1, 2]
    for a, b in zip(rec["fsdp"], rec["ddp"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4, abs=1e-6)
    # the model state, checkpointed and exported, is the same too
    assert_exports_match(tmp_path, "transformer")
    assert os.path.exists(tmp_path / "ddp" / "checkpoints" / "step_000002" / ".metadata")


def test_ddp_refuses_fsdp_only_settings():
    with pytest.raises(ConfigError, match="CPU offload is an FSDP feature"):
        fsdp_utils.check_parallelism("ddp", True, 1)
    with pytest.raises(ConfigError, match="DP_REPLICATE"):
        fsdp_utils.check_parallelism("ddp", False, 2)
    with pytest.raises(ConfigError, match="choose one of"):
        fsdp_utils.check_parallelism("zero3", False, 1)
    fsdp_utils.check_parallelism("fsdp", True, 2)


@pytest.mark.slow
def test_dmd_ddp_matches_fsdp(tmp_path):
    """train_dmd.py on the shipped teacher: generator and fake score both update at steps 1 and 2."""
    common = ["--precision=fp32", "--max_steps=2", "--log_every=1", "--sample_every=0", "--save_every=0",
              "--dfake_gen_update_ratio=1", "--generator_lr=1e-3", "--guidance_lr=1e-3", "--batch_size=2"]
    logs, rec = run_both("train_dmd.py", common, tmp_path)
    assert "ddp: UNet2DConditionModel: full replica per rank" in logs["ddp"]
    assert [r["step"] for r in rec["ddp"]] == [1, 2]
    for a, b in zip(rec["fsdp"], rec["ddp"]):
        for key in ("loss_dm", "loss_fake", "grad_norm_generator", "grad_norm_guidance"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    assert_exports_match(tmp_path, "unet")


def test_dmd_ddp_refuses_the_gan_head(monkeypatch):
    import train_dmd
    saved = script_constants(vars(train_dmd))
    monkeypatch.setattr(sys, "argv", ["train_dmd.py", "--parallelism=ddp", "--use_gan=1"])
    try:
        with pytest.raises(ConfigError, match="PARALLELISM=ddp with USE_GAN=1"):
            train_dmd.main()
    finally:
        vars(train_dmd).update(saved)


@pytest.mark.slow
def test_bf16_replicas_run_samples_ema_and_validation(tmp_path):
    """Under DDP nothing all-gathers in a compute dtype or casts inputs as FSDP2's policy does: every
    replica (the trained models, their EMA, DMD's frozen bf16 teacher, a bf16 LoRA base) gets that
    contract on its own forward (fsdp_utils.apply_precision). Before, these runs all failed with
    "mat1 and mat2 must have the same dtype". DMD at PRECISION=bf16 with FAKE_SCORE_FP32=1 also stores
    its fp32 fake score in fp32 (a replica computes in its storage dtype)."""
    dmd = ["--parallelism=ddp", "--max_steps=2", "--dfake_gen_update_ratio=1", "--sample_every=1", "--ema_decay=0.9",
           "--save_every=0", "--log_every=1"]
    runs = {f"dmd_{p}": ("train_dmd.py", dmd + [f"--precision={p}", "--fake_score_fp32=1"])
            for p in ("bf16-mixed", "bf16")}
    runs["dmd_lora"] = ("train_dmd.py", dmd + ["--lora_rank=4", "--fake_lora=1", *VALIDATE])  # validation too
    runs["kontext_lora"] = (
        "train_flux_kontext.py",
        [
            "--parallelism=ddp",
            "--max_steps=2",
            "--lora_rank=4",
            "--val_every=1",
            "--sample_every=1",
            "--sample_steps=1",
            "--ema_decay=0.9",
            "--log_every=1",
        ],
    )
    procs = {name: start(script, args + [f"--output_dir={tmp_path / name}"]) for name, (script, args) in runs.items()}
    logs = {}
    for name, proc in procs.items():
        rc, logs[name] = finish(proc)
        assert rc == 0, f"{name}:\n{logs[name][-3000:]}"
        assert os.path.exists(tmp_path / name / "samples" / "step_000002.png"), name
    assert_validated(tmp_path / "dmd_lora", [2])  # DMD2's validation on DDP replicas
    records = [json.loads(line) for line in open(tmp_path / "kontext_lora" / "metrics.jsonl")]
    assert [r["step"] for r in records if "val_loss" in r] == [1, 2]
    fake = next(line.split() for line in logs["dmd_bf16"].splitlines() if line.startswith("fake "))
    # storage, compute: the published fp32 fake score, its attention in the run's bf16 (FAKE_SCORE_ATTENTION_DTYPE)
    assert fake[3:7] == ["fp32", "fp32,", "attention", "bf16"], fake
