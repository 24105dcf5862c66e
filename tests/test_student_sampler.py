"""STUDENT_SAMPLE_TYPE: how a few-step flow generator goes from one of its steps to the next, in training
(backward simulation), in its sample grids and in its export's scheduler: "sde" re-noises x̂0 with fresh noise
(DMD2), "ode" takes the Euler step along its velocity (FastGen's student_sample_type="ode"). The pipeline end of
it on the tiny Wan run: tests/test_wan.py's test_an_ode_student_samples_in_the_pipeline_as_it_trained.

    python -m pytest tests/test_student_sampler.py -q
"""
from __future__ import annotations

import pytest
import torch

import train_dmd
from algorithms import dmd2 as dm
from components import dmd_settings
from core.errors import ConfigError
from families import dit
from tests.test_diversity_dmd import Settings

U32 = 2.0 ** -24  # fp32's unit roundoff


def test_ode_steps_are_the_deterministic_schedulers():
    """With a generator of any velocity, each ODE step of the backward simulation is the export's scheduler step
    (the teacher's FlowMatchEulerDiscreteScheduler made neutral, student_sampler "ode": x + (σ' − σ)·v in fp32)
    over the trained σ; the fresh noise is not read. "sde" keeps stochastic_sampling, which steps as
    x̂0 re-noised (test_dmd2.py's test_fm_backward_simulation_renoises_each_prediction)."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    teacher = {"_class_name": "FlowMatchEulerDiscreteScheduler", "use_dynamic_shifting": True, "shift": 3.0}
    config = dit.student_sampler(dit.distilled_scheduler_config(teacher), "ode")
    assert config["stochastic_sampling"] is False
    assert dit.student_sampler(dit.distilled_scheduler_config(teacher), "sde")["stochastic_sampling"] is True
    with pytest.raises(ValueError, match="UniPCMultistepScheduler"):
        dit.student_sampler({"_class_name": "UniPCMultistepScheduler"}, "ode")
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
    sigmas = [1.0, 0.8, 0.55, 0.3]  # not exact in fp32: the scheduler's σ and ours are the same fp32 numbers
    scheduler.set_timesteps(sigmas=sigmas)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 4, generator=g)

    def gen(x, sigma):  # any velocity: nonlinear in x, depending on σ
        return torch.tanh(x @ w) * sigma.view(-1, 1, 1) + 0.3 * x
    noise = torch.randn(2, 6, 4, generator=g)
    x = noise.clone()
    for i, t in enumerate(scheduler.timesteps[:3]):
        x = scheduler.step(gen(x, torch.full((2,), float(scheduler.sigmas[i]))), t, x).prev_sample
        ours, forwards = dm.fm_backward_simulation(gen, noise, [float(s) for s in scheduler.sigmas[:-1]], i + 1,
                                                   [], ode=True)
        assert forwards == i + 1
        # the same fp32 ops but dt: the scheduler's σ' − σ in fp32, ours in float64 then rounded (one rounding
        # of dt, u·|dt·v|, a step); 2x for their carry into later steps
        assert torch.allclose(ours, x, rtol=0, atol=2 * (i + 1) * U32 * float(x.abs().max() + 1)), i


@pytest.mark.parametrize("given, culprit", [
    ({"STUDENT_SAMPLE_TYPE": "ddim"}, "STUDENT_SAMPLE_TYPE in (sde, ode)"),
    ({"STUDENT_SAMPLE_TYPE": "ode"}, "STUDENT_SAMPLE_TYPE=ode without DENOISING_STEPS"),
    ({"STUDENT_SAMPLE_TYPE": "ode", "DENOISING_STEPS": [999, 499]}, "STUDENT_SAMPLE_TYPE=ode with a UNet teacher"),
])
def test_refusals_are_one_line(given, culprit):
    with pytest.raises(ConfigError) as e:
        dmd_settings.validate(Settings(**given), set(given), train_dmd.default_paths()[0])
    assert culprit in str(e.value) and "\n" not in str(e.value)
