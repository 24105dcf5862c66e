"""components/validation.py: DMD2's validation figures on known samples, the teacher's cache, the collapse warning
and COLLAPSE_STOP; the teacher references' samplers (algorithms/dmd2.ddim_teacher, fm_teacher_ode's shift, FLUX.2's
sampling_shift) against the schedulers they stand for. The runs with VAL_EVERY are in test_train_dmd.py (UNet),
test_train_dmd_kontext.py, test_qwen_image.py and test_flux2.py.

    python -m pytest tests/test_validation.py -q
"""
from __future__ import annotations

import math

import pytest
import torch

from algorithms import dmd2 as dm
from components import validation as val
from core.errors import RunError


def test_variety_is_the_mean_rms_distance_over_pairs_of_seeds():
    x = torch.zeros(2, 3, 4)  # prompt 0: seeds at 0, 1, 3 (per element); prompt 1: all alike
    x[0, 1], x[0, 2] = 1.0, 3.0
    assert val.pairwise_variety(x).tolist() == pytest.approx([(1 + 3 + 2) / 3, 0.0])
    with pytest.raises(ValueError, match="2 or more seeds"):
        val.pairwise_variety(x[:, :1])


def test_figures_of_a_collapsed_an_identical_and_a_washed_out_student():
    g = torch.Generator().manual_seed(0)
    teacher = [torch.rand(4, 3, 8, 8, generator=g) * 2 - 1 for _ in range(2)]
    latents = [torch.randn(4, 4, 2, 2, generator=g) for _ in range(2)]
    same = val.figures(teacher, teacher, latents, latents)
    assert same == {"val_variety_ratio": 1.0, "val_variety_ratio_latent": 1.0, "val_teacher_distance": 0.0,
                    "val_saturation_drift": 0.0, "val_colour_drift": 0.0}
    collapsed = [t[:1].expand_as(t) for t in teacher]  # every seed gives seed 0's image
    f = val.figures(collapsed, teacher, [x[:1].expand_as(x) for x in latents], latents)
    assert f["val_variety_ratio"] == 0.0 and f["val_variety_ratio_latent"] == 0.0 and f["val_teacher_distance"] > 0
    grey = [t.mean(1, keepdim=True).expand_as(t) for t in teacher]  # no saturation at all
    f = val.figures(grey, teacher, latents, latents)
    assert f["val_saturation_drift"] == pytest.approx(-torch.cat([val.saturation(t) for t in teacher]).mean().item())
    assert f["val_saturation_drift"] < -0.3
    shifted = [(t + 0.2).clamp(-1, 1) for t in teacher]  # a colour cast
    assert val.figures(shifted, teacher, latents, latents)["val_colour_drift"] > 0.05
    with pytest.raises(ValueError, match="student samples"):
        val.figures([teacher[0][:, :, :4]], teacher[:1], latents[:1], latents[:1])


def test_saturation_is_hsv_s():
    red, grey = torch.tensor([1.0, -1.0, -1.0]), torch.tensor([0.2, 0.2, 0.2])
    images = torch.stack([red, grey]).reshape(2, 3, 1, 1)
    assert val.saturation(images).tolist() == pytest.approx([1.0, 0.0])


def samples(seed: int, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    pixels = [(torch.rand(3, 3, 4, 4, generator=g) * 2 - 1) * scale for _ in range(2)]
    return val.Samples(pixels, [p[:, :1] for p in pixels])


def test_teacher_reference_is_drawn_once_per_identity_and_read_back(tmp_path):
    calls = []

    def teacher():
        calls.append(1)
        return samples(0)
    first = val.Validator(teacher, lambda: samples(0), str(tmp_path), {"model": "a"}, warn=0.5, stop=False)
    assert first(2)["val_variety_ratio"] == 1.0 and first(4)["val_teacher_distance"] == 0.0
    assert len(calls) == 1 and (tmp_path / "step_000002.png").is_file() and (tmp_path / "step_000004.png").is_file()
    again = val.Validator(teacher, lambda: samples(0), str(tmp_path), {"model": "a"}, warn=0.5, stop=False)
    assert again(6) == first(4) and len(calls) == 1  # a resumed run: the cache, the same figures
    other = val.Validator(teacher, lambda: samples(0), str(tmp_path), {"model": "b"}, warn=0.5, stop=False)
    other(2)
    assert len(calls) == 2 and len(list(tmp_path.glob("teacher_*.pt"))) == 2


def test_collapse_warns_in_one_line_and_stops_after_the_saves_in_flight(tmp_path, capsys):
    """The warning fires when the variety ratio falls under COLLAPSE_WARN times its best so far in the run (not on a
    low first value: a healthy student starts low too), or under COLLAPSE_FLOOR at any validation, names the step and
    the figures; COLLAPSE_STOP raises the run's one-line stop after the saves in flight."""
    def collapsed():
        s = samples(0)
        return val.Samples([p[:1].expand_as(p) * 0.9 for p in s.pixels], s.latents)

    def students(*sides):  # the student over successive validations
        it = iter(sides)
        return lambda: next(it)()
    warn = val.Validator(lambda: samples(0), students(lambda: samples(1), collapsed, collapsed), str(tmp_path), {},
                         warn=0.75, stop=False)
    first = warn(5)["val_variety_ratio"]
    assert first > 0 and "collapse warning" not in capsys.readouterr().out
    assert warn(7)["val_variety_ratio"] == 0.0
    out = capsys.readouterr().out
    assert f"collapse warning at step 7: the student's variety across seeds is 0.000 of the teacher's, down from " \
           f"{first:.3f} (COLLAPSE_WARN=0.75: below 0.75 of its best)" in out
    assert "colour drift" in out and "step_000007.png" in out
    low_from_the_start = val.Validator(lambda: samples(0), collapsed, str(tmp_path), {}, warn=0.75, stop=False)
    low_from_the_start(3)
    assert "collapse warning" not in capsys.readouterr().out
    floor = val.Validator(lambda: samples(0), collapsed, str(tmp_path), {}, warn=0.75, stop=False, floor=0.4)
    floor(4)  # COLLAPSE_FLOOR: a ratio under it warns at the first validation too
    assert "collapse warning at step 4: the student's variety across seeds is 0.000 of the teacher's, under " \
           "COLLAPSE_FLOOR=0.4" in capsys.readouterr().out
    waited = []
    stop = val.Validator(lambda: samples(0), students(lambda: samples(1), collapsed), str(tmp_path), {}, warn=0.75,
                         stop=True, before_stop=lambda: waited.append(True))
    stop(8)
    assert waited == []
    with pytest.raises(RunError, match="collapse warning at step 9.*COLLAPSE_STOP=1: stopped before this step's"):
        stop(9)
    assert waited == [True]
    off = val.Validator(lambda: samples(0), students(lambda: samples(1), collapsed), str(tmp_path), {}, warn=0.0,
                        stop=False)
    off(10), off(11)
    assert "collapse warning" not in capsys.readouterr().out


def test_ddim_teacher_is_diffusers_ddim_under_cfg():
    """ddim_teacher with a CFG pair equals diffusers' DDIMScheduler (SD-1.5's config: scaled_linear betas,
    leading spacing, steps_offset 1, set_alpha_to_one False) stepping the combined ε, to the sample's x0."""
    from diffusers import DDIMScheduler
    sched = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
                          set_alpha_to_one=False, steps_offset=1, timestep_spacing="leading")
    alphas = sched.alphas_cumprod.clone()
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 4, generator=g) * 0.1

    class Unet(torch.nn.Module):  # ε depends on z, t and the text: a linear map per condition
        def forward(self, z, t, encoder_hidden_states, return_dict=False):
            eps = torch.einsum("bchw,cd->bdhw", z, w) * (t.float()[:, None, None, None] / 1000)
            return (eps + encoder_hidden_states[:, :, None, None],)
    text, uncond = torch.randn(2, 4, generator=g), torch.zeros(1, 4)
    noise = torch.randn(2, 4, 3, 3, generator=g, dtype=torch.float64).float()
    ours = dm.ddim_teacher(Unet(), noise, text, uncond, 1.75, alphas, steps=5)
    sched.set_timesteps(5)
    z = noise.double()
    for t in sched.timesteps:
        tt = torch.full((2,), int(t))
        c, u = Unet()(z.float(), tt, text)[0].double(), Unet()(z.float(), tt, uncond.expand(2, -1))[0].double()
        out = sched.step(u + 1.75 * (c - u), t, z)
        z, x0 = out.prev_sample, out.pred_original_sample
    assert sched.timesteps.tolist() == [801, 601, 401, 201, 1]
    torch.testing.assert_close(ours, x0.float(), rtol=1e-5, atol=1e-5)


def test_fm_teacher_ode_shift_is_the_schedulers_and_flux2s_is_its_empirical_mu():
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

    from families import flux2
    seen = []

    def velocity(x, s):
        seen.append(float(s[0]))
        return torch.zeros_like(x)
    dm.fm_teacher_ode(velocity, torch.zeros(1, 2), steps=4, shift=3.0)
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)  # the pipelines pass σ = linspace(1, 1/steps)
    sched.set_timesteps(sigmas=[1.0, 0.75, 0.5, 0.25])
    assert seen == pytest.approx(sched.sigmas[:-1].tolist(), rel=1e-6)
    seen.clear()
    dm.fm_teacher_ode(velocity, torch.zeros(1, 2), steps=4)
    assert seen == [1.0, 0.75, 0.5, 0.25]
    mu = compute_empirical_mu(image_seq_len=256, num_steps=4)
    dynamic = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, time_shift_type="exponential")
    dynamic.set_timesteps(sigmas=[1.0, 0.75, 0.5, 0.25], mu=mu)
    s = flux2.sampling_shift("", 256, 4)
    assert s == pytest.approx(math.exp(mu))
    seen.clear()
    dm.fm_teacher_ode(velocity, torch.zeros(1, 2), steps=4, shift=s)
    assert seen == pytest.approx(dynamic.sigmas[:-1].tolist(), rel=1e-6)
