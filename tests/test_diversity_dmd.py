"""DIVERSITY_WEIGHT (DP-DMD's first-step loss, algorithms/dmd2.diversity_loss): the loss against a hand computation
on a linear teacher, the teacher ODE's stop and σ grid, the later steps' loss unchanged, and the refusals in one
line. The tiny Wan run that logs it is tests/test_wan.py's.

    python -m pytest tests/test_diversity_dmd.py -q
"""
from dataclasses import dataclass

import pytest
import torch

from algorithms import dmd2 as dm
from algorithms import dmd2_flow as flow_dm
from components import dmd_settings
from core.errors import ConfigError
from families import sd_unet
import train_dmd

B, N, D = 2, 6, 4  # samples, tokens, channels per token


def teacher(x, s):
    """A toy velocity v(x, σ) = 0.6·x − 0.9·σ (σ per sample), in float64."""
    return 0.6 * x - 0.9 * s.double().reshape(-1, 1, 1)


def fake(x, s):
    return -0.3 * x + 0.2 * s.double().reshape(-1, 1, 1)


@dataclass
class ToyCond:
    def velocity(self, model, guidance: float, norm: str = "none"):
        return teacher if model == "teacher" else fake


def batch(index: int, seed=0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"cond": ToyCond(), "step_index": index, "ode_shift": 3.0,
            "noise": torch.randn(B, N, D, generator=g, dtype=torch.float64),
            "dm_sigma": torch.tensor([0.8, 0.3], dtype=torch.float64),
            "dm_noise": torch.randn(B, N, D, generator=g, dtype=torch.float64),
            "x": torch.randn(B, N, D, generator=g, dtype=torch.float64)}


def shifted(t: float, s: float) -> float:
    return s * t / (1 + (s - 1) * t)


def test_the_first_steps_loss_is_the_hand_computation():
    """At the first step: weight · mean((v − v̄)²), v = noise − x (G's x̂0 at σ 1), v̄ = (noise − z_k) /
    (1 − σ_k) with z_k the teacher's Euler ODE after k of its n steps on the shifted grid; no DM term; the
    gradient on x is −2·weight·(v − v̄) / numel."""
    mb, weight, k, n = batch(0), 0.05, 3, 10
    x = mb["x"].clone().requires_grad_(True)
    losses = dm.Losses(diversity_weight=weight, diversity_anchor=k, regression_steps=n)
    loss, logs = flow_dm.generator_loss(x, mb, "teacher", "fake", 1.0, losses)
    loss.backward()
    grid = [shifted(1 - i / n, 3.0) for i in range(n + 1)]
    z = mb["noise"].clone()
    for i in range(k):
        z = z + (grid[i + 1] - grid[i]) * teacher(z, torch.full((B,), grid[i], dtype=torch.float64))
    v_bar = (mb["noise"] - z) / (1 - grid[k])
    v = mb["noise"] - mb["x"]
    expected = weight * ((v - v_bar) ** 2).mean()
    # fp32 inside the loss (x.float()): each term's rounding is ~1e-7 relative
    assert set(logs) == {"loss_div"}
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=0)
    torch.testing.assert_close(x.grad, -2 * weight * (v - v_bar) / v.numel(), rtol=1e-5, atol=1e-9)


def test_the_ode_stops_on_its_grid_and_runs_whole_without_stop():
    """ode_sigmas is the shifted uniform grid; stop=n is the whole ODE, stop=k the state after k Euler steps."""
    n, s = 6, 2.5
    assert dm.ode_sigmas(n, s) == pytest.approx([shifted(1 - i / n, s) for i in range(n + 1)], abs=1e-12)
    noise = batch(0)["noise"]
    torch.testing.assert_close(dm.fm_teacher_ode(teacher, noise, n, s, stop=n), dm.fm_teacher_ode(teacher, noise, n, s))
    two = dm.fm_teacher_ode(teacher, noise, n, s, stop=2)
    one = dm.fm_teacher_ode(teacher, noise, n, s, stop=1)
    grid = dm.ode_sigmas(n, s)
    step = one + (grid[2] - grid[1]) * teacher(one, torch.full((B,), grid[1])).float()
    torch.testing.assert_close(two, step)


@pytest.mark.parametrize("index", [1, 3])
def test_later_steps_keep_the_dm_loss(index):
    """Past the first step the loss and its logs are dmd2's, with or without the weight."""
    mb = batch(index)
    plain, plain_logs = flow_dm.generator_loss(mb["x"], mb, "teacher", "fake", 1.0, dm.Losses())
    div, div_logs = flow_dm.generator_loss(mb["x"], mb, "teacher", "fake", 1.0, dm.Losses(diversity_weight=0.5))
    assert set(div_logs) == set(plain_logs) == {"loss_dm"}
    assert torch.equal(plain, div)


class Settings:
    """The settings the refusals read, at train_dmd.py's defaults, with `given` on top."""

    def __init__(self, **given):
        self.__dict__.update(train_dmd.current_settings().__dict__, **given)


@pytest.mark.parametrize("given, culprit", [
    ({"DIVERSITY_WEIGHT": 1.0}, "without DENOISING_STEPS"),
    ({"DIVERSITY_WEIGHT": 1.0, "DENOISING_STEPS": [899, 499], "CONDITIONING_TIMESTEP": 899},
     "CONDITIONING_TIMESTEP=899"),
    ({"DIVERSITY_WEIGHT": -1.0}, "DIVERSITY_WEIGHT >= 0"),
    ({"DIVERSITY_WEIGHT": 1.0, "DENOISING_STEPS": [999, 499], "DIVERSITY_ANCHOR": 28},
     "1 <= DIVERSITY_ANCHOR < REGRESSION_STEPS"),
])
def test_refusals_are_one_line(given, culprit):
    with pytest.raises(ConfigError) as e:
        dmd_settings.validate(Settings(**given), set(given), train_dmd.default_paths()[0])
    assert culprit in str(e.value) and "\n" not in str(e.value)


def test_the_anchor_is_read_only_with_the_weight():
    """DIVERSITY_WEIGHT 0 leaves REGRESSION_STEPS free (a regression target of 2 steps, under the default anchor)."""
    given = {"REGRESSION_STEPS": 2}
    dmd_settings.validate(Settings(**given), set(given), train_dmd.default_paths()[0])


def test_a_unet_teacher_refuses_it():
    with pytest.raises(ConfigError) as e:
        sd_unet.check_dmd_settings({**vars(Settings(DIVERSITY_WEIGHT=1.0, DENOISING_STEPS=[999, 499]))},
                                   {"DIVERSITY_WEIGHT"})
    assert "DIVERSITY_WEIGHT=1.0 with a UNet teacher" in str(e.value)
