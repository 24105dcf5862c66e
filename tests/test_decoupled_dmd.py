"""DMD_LOSS=decoupled (algorithms/dmd2_flow.decoupled_loss): its two terms against a hand computation on linear
velocity models, the CA term's σ range, dmd2's draws and loss unchanged, the refusals in one line, and (slow) a
tiny 2-step run of train_dmd.py on the tiny FLUX.2 klein-base teacher logging both terms.

    python -m pytest tests/test_decoupled_dmd.py -q              # the fast checks
    python -m pytest tests/test_decoupled_dmd.py -q -m slow      # the run
"""
import json
from dataclasses import dataclass

import pytest
import torch

from algorithms import dmd2 as dm
from algorithms import dmd2_flow as flow_dm
import families
import train_dmd
from algorithms import flux_kontext as km
from core.errors import ConfigError
from components import dmd_settings
from families import sd_unet
from tests.conftest import launch, launch_env, tiny_default

B, N, D = 2, 6, 4  # samples, tokens, channels per token
W = 3.5  # the teacher's CFG scale (standard form)


def linear(a: float, b: float):
    """A toy velocity model v(x, σ) = a·x + b·σ (σ per sample)."""
    return lambda x, s: a * x + b * s.double().reshape(-1, 1, 1)


COND, UNCOND, FAKE = linear(0.7, 0.3), linear(-0.4, 1.1), linear(0.2, -0.5)


@dataclass
class ToyCond:
    """A family's cond as the flow step sees it: guidance > 1 is the teacher's CFG pair u + w (c − u), else the
    conditional prediction; the fake score is always conditional."""

    def velocity(self, model, guidance: float, norm: str = "none"):
        if model == "fake":
            return FAKE
        if guidance > 1:
            return lambda x, s: dm.cfg_combine(COND(x, s), UNCOND(x, s), guidance, norm).double()
        return COND


def batch(seed=0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"cond": ToyCond(), "ca_sigma": torch.tensor([0.15, 0.4], dtype=torch.float64),
            "dm_sigma": torch.tensor([0.8, 0.3], dtype=torch.float64),
            "ca_noise": torch.randn(B, N, D, generator=g, dtype=torch.float64),
            "dm_noise": torch.randn(B, N, D, generator=g, dtype=torch.float64),
            "x": torch.randn(B, N, D, generator=g, dtype=torch.float64)}


def by_hand(x, sigma, noise, first, second):
    """((x − x̂0_first) − (x − x̂0_second)) / mean_sample |x − x̂0_first|, x̂0 = x_σ − σ v(x_σ), in
    float64."""
    s = sigma.reshape(-1, 1, 1)
    x_s = (1 - s) * x + s * noise
    p1, p2 = x - (x_s - s * first(x_s, sigma)), x - (x_s - s * second(x_s, sigma))
    return (p1 - p2) / p1.abs().mean(dim=(1, 2), keepdim=True)


def test_the_two_terms_are_the_hand_computation():
    """loss_ca: the CFG'd teacher against the conditional one at the CA σ, i.e. G moved along (w − 1)(x̂0_cond −
    x̂0_uncond) over its normaliser; loss_dm: the conditional teacher against the fake score at the DM σ; each
    0.5·mean(grad²), G's loss their weighted sum, its gradient the weighted directions / numel."""
    mb = batch()
    x = mb["x"].clone().requires_grad_(True)
    losses = dm.Losses(real_guidance_scale=W, dmd_loss="decoupled", ca_weight=0.7, dm_weight=1.3)
    loss, logs = flow_dm.generator_loss(x, mb, "teacher", "fake", 1.0, losses)
    loss.backward()
    cfg = lambda y, s: UNCOND(y, s) + W * (COND(y, s) - UNCOND(y, s))  # noqa: E731
    ca = by_hand(mb["x"], mb["ca_sigma"], mb["ca_noise"], cfg, COND)
    dm_ = by_hand(mb["x"], mb["dm_sigma"], mb["dm_noise"], COND, FAKE)
    # the CA direction is −(w − 1)(x̂0_cond − x̂0_uncond) over the CFG'd normaliser
    s = mb["ca_sigma"].reshape(-1, 1, 1)
    x_s = (1 - s) * mb["x"] + s * mb["ca_noise"]
    x0 = {k: x_s - s * v(x_s, mb["ca_sigma"]) for k, v in (("c", COND), ("u", UNCOND), ("cfg", cfg))}
    norm = (mb["x"] - x0["cfg"]).abs().mean(dim=(1, 2), keepdim=True)
    torch.testing.assert_close(ca, -(W - 1) * (x0["c"] - x0["u"]) / norm)
    # fp32 inside (dm_loss, the grads' .float()): compared at fp32's tolerance
    torch.testing.assert_close(logs["loss_ca"].double(), 0.5 * ca.square().mean(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(logs["loss_dm"].double(), 0.5 * dm_.square().mean(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(loss.double(), 0.7 * 0.5 * ca.square().mean() + 1.3 * 0.5 * dm_.square().mean(),
                               rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(x.grad, (0.7 * ca + 1.3 * dm_) / x.numel(), rtol=1e-5, atol=1e-8)
    assert set(logs) == {"loss_ca", "loss_dm"}


def test_at_one_sigma_the_unnormalised_terms_add_up_to_dmd2():
    """With norm "none", at the same σ and noise: (CFG'd − conditional) + (conditional − fake) = DMD2's CFG'd −
    fake, before each term's normaliser."""
    mb = batch(1)
    cfg = ToyCond().velocity("teacher", W)
    x, s, n = mb["x"], mb["dm_sigma"], mb["dm_noise"]
    parts = []
    for first, second in ((cfg, COND), (COND, FAKE), (cfg, FAKE)):
        grad, diag = dm.fm_dm_grad(x, s, n, first, second)
        parts.append(grad.double() * diag["p_real_abs_mean"].double().reshape(-1, 1, 1))
    torch.testing.assert_close(parts[0] + parts[1], parts[2], rtol=1e-5, atol=1e-6)


def test_the_ca_sigma_lies_between_the_students_and_clean_then_shifted():
    """u ~ U[0, 1) scaled to [0, σ_student] before the shift, then shifted: at shift 3 and σ_student 0.25 every
    σ lies in [0, shift(0.25)] = [0, 0.5] and unshifts to a uniform draw on [0, 0.25]."""
    shape, shift, student = (4, 2, 2), 3.0, 0.25
    draws = [flow_dm.draw_sample_noise(torch.Generator().manual_seed(i), shape, 3, (0.02, 0.98), None, shift,
                                       ca_max_sigma=student)["ca_sigma"] for i in range(400)]
    sigma = torch.stack(draws).double()
    assert 0 <= float(sigma.min()) and float(sigma.max()) <= 0.5 + 1e-7
    pre = sigma / (shift - (shift - 1) * sigma)  # the shift's inverse
    assert float(pre.max()) <= student + 1e-6 and float(pre.max()) > 0.9 * student
    assert abs(float(pre.mean()) - student / 2) < 0.02  # uniform: mean σ_student / 2 (400 draws: sd 0.0036)
    unshifted = flow_dm.draw_sample_noise(torch.Generator().manual_seed(7), shape, 3, (0.02, 0.98), None, 1.0,
                                          ca_max_sigma=student)["ca_sigma"]
    assert 0 <= float(unshifted) <= student
    torch.testing.assert_close(flow_dm.ca_sigma(torch.tensor(1.0), student, shift),
                               km.shift_sigmas(torch.tensor(student), shift))


@pytest.mark.parametrize("gan", [None, 1.0])
def test_dmd2_draws_and_loss_are_unchanged(gan):
    """The CA draws come last from each sample's generator: every other draw is the one dmd2 makes (so a dmd2 run's
    numbers do not move), and dmd2's loss is the CFG'd teacher against the fake score whatever else mb holds."""
    shape = (4, 2, 2)
    plain = flow_dm.draw_sample_noise(torch.Generator().manual_seed(3), shape, 2, (0.02, 0.98), gan, 2.0)
    g = torch.Generator().manual_seed(3)
    both = flow_dm.draw_sample_noise(g, shape, 2, (0.02, 0.98), gan, 2.0, ca_max_sigma=0.5)
    assert list(both)[:len(plain)] == list(plain) and list(both)[len(plain):] == ["ca_sigma", "ca_noise"]
    for k, v in plain.items():
        assert torch.equal(v, both[k]), k
    replay = torch.Generator().manual_seed(3)
    flow_dm.draw_sample_noise(replay, shape, 2, (0.02, 0.98), gan, 2.0)
    torch.testing.assert_close(both["ca_sigma"], flow_dm.ca_sigma(torch.rand((), generator=replay), 0.5, 2.0))
    packed = flow_dm.pack_draws({k: torch.stack([v]) for k, v in both.items()})
    assert packed["ca_noise"].shape == packed["dm_noise"].shape == (1, 1, 16)

    mb = batch(2)
    x = mb["x"]
    losses = dm.Losses(real_guidance_scale=W)
    loss, logs = flow_dm.generator_loss(x, mb, "teacher", "fake", 1.0, losses)
    without = {k: v for k, v in mb.items() if not k.startswith("ca_")}
    again, _ = flow_dm.generator_loss(x, without, "teacher", "fake", 1.0, losses)
    grad, _ = dm.fm_dm_grad(x, mb["dm_sigma"], mb["dm_noise"], ToyCond().velocity("teacher", W), FAKE)
    assert torch.equal(loss, again) and torch.equal(loss, dm.dm_loss(x, grad)) and set(logs) == {"loss_dm"}


@pytest.fixture
def script(monkeypatch):
    monkeypatch.setattr(train_dmd, "DMD_LOSS", "decoupled")
    return train_dmd


def flux2_folder(root, guidance_embeds: bool) -> str:
    """What the FLUX.2 room reads to tell [dev] from klein: the transformer's config."""
    (root / "transformer").mkdir(parents=True)
    (root / "transformer" / "config.json").write_text(json.dumps({"guidance_embeds": guidance_embeds}))
    return str(root)


def check_dmd_loss(script, room, pipeline: str) -> None:
    dmd_settings.check_dmd_loss(script.current_settings(), script.changed_settings(), room, pipeline)


def refusal(script, monkeypatch, pipeline: str, model_path: str = "") -> str:
    monkeypatch.setattr(script, "MODEL_PATH", model_path)
    with pytest.raises(ConfigError) as e:
        check_dmd_loss(script, families.FAMILIES.get(pipeline, sd_unet), pipeline)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_refusals_are_one_line(script, monkeypatch, tmp_path):
    """decoupled needs a flow teacher's CFG pair: refused for a UNet, FLUX.1's and FLUX.2 [dev]'s embedded guidance,
    and REAL_GUIDANCE_SCALE 1; its weights alone are refused under dmd2; a klein-base teacher and Qwen pass."""
    assert "a UNet teacher" in refusal(script, monkeypatch, "StableDiffusionPipeline")
    assert "embedded value (FLUX_GUIDANCE 2.5)" in refusal(script, monkeypatch, "FluxKontextPipeline")
    dev, klein = flux2_folder(tmp_path / "dev", True), flux2_folder(tmp_path / "klein", False)
    assert "embedded value (FLUX_GUIDANCE 4)" in refusal(script, monkeypatch, "Flux2Pipeline", dev)
    monkeypatch.setattr(script, "REAL_GUIDANCE_SCALE", 1.0)
    assert "REAL_GUIDANCE_SCALE=1: no CFG pair" in refusal(script, monkeypatch, "QwenImageEditPlusPipeline")
    monkeypatch.setattr(script, "REAL_GUIDANCE_SCALE", 0.0)
    monkeypatch.setattr(script, "MODEL_PATH", klein)
    check_dmd_loss(script, families.FAMILIES["Flux2KleinPipeline"], "Flux2KleinPipeline")
    check_dmd_loss(script, families.FAMILIES["QwenImageEditPlusPipeline"], "QwenImageEditPlusPipeline")
    monkeypatch.setattr(script, "DMD_LOSS", "dmd2")
    monkeypatch.setattr(script, "DMD_CA_WEIGHT", 2.0)
    assert "DMD_CA_WEIGHT=2.0 with DMD_LOSS=dmd2" in refusal(script, monkeypatch, "Flux2KleinPipeline", klein)



def test_default_loss_is_the_familys(monkeypatch):
    """DMD_LOSS "": a Z-Image teacher with its CFG pair takes its spec's decoupled, without the pair
    (REAL_GUIDANCE_SCALE 1) dmd2; Qwen's and a UNet's take dmd2; a given loss is taken as given."""
    monkeypatch.setattr(train_dmd, "DMD_LOSS", "")

    def resolved(pipeline: str) -> str:
        room = families.FAMILIES.get(pipeline, sd_unet)
        return dmd_settings.dmd_loss(train_dmd.current_settings(), room, pipeline)
    assert resolved("ZImagePipeline") == resolved("ZImageOmniPipeline") == "decoupled"
    assert resolved("QwenImageEditPlusPipeline") == resolved("StableDiffusionPipeline") == "dmd2"
    monkeypatch.setattr(train_dmd, "REAL_GUIDANCE_SCALE", 1.0)
    assert resolved("ZImagePipeline") == "dmd2"
    monkeypatch.setattr(train_dmd, "REAL_GUIDANCE_SCALE", 0.0)
    monkeypatch.setattr(train_dmd, "DMD_LOSS", "dmd2")
    assert resolved("ZImagePipeline") == "dmd2"

@pytest.mark.slow
def test_a_decoupled_klein_run_logs_both_terms(tmp_path):
    """Two steps of train_dmd.py with DMD_LOSS=decoupled on the tiny klein-base teacher (its true CFG at 4, a
    4-step student, the generator stepping every step): both terms logged and finite; at step 1 the fake score is
    the teacher, so the DM term is 0 and the CA term alone moves G; at step 2 the fake score has stepped."""
    model, data = tiny_default("flux2_klein")
    out = tmp_path / "run"
    launch("train_dmd.py", [f"--model_path={model}", f"--data_path={data}/data.jsonl",
                            f"--text_cache_dir={tmp_path / 'text_cache'}", "--precision=fp32", "--resolution=64",
                            "--max_sequence_length=32", "--max_steps=2", "--log_every=1", "--batch_size=1",
                            "--denoising_steps=999,749,499,249", "--dfake_gen_update_ratio=1", "--save_every=0",
                            "--sample_every=0", "--export_dtype=fp32", "--dmd_loss=decoupled",
                            "--dmd_ca_weight=1.0", "--dmd_dm_weight=0.5", f"--output_dir={out}"],
           ranks=1, env=launch_env())
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    steps = [r for r in records if "loss_ca" in r]
    assert len(steps) == 2, records
    assert all(0 < r["loss_ca"] < 1e6 for r in steps), steps
    assert steps[0]["loss_dm"] == 0 and 0 < steps[1]["loss_dm"] < 1e6, steps
