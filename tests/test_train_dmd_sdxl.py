"""train_dmd.py on an SDXL-layout folder (tools/tiny_models.make_tiny_sdxl: two CLIP text encoders,
a UNet with SDXL's "text_time" added conditions), run as users run it (torchrun on 2 CPU ranks, or
python), through the same loading path as real SDXL weights.

    HF_HUB_OFFLINE=1 python -m pytest tests/test_train_dmd_sdxl.py -q

  run_a        2 ranks, 4 steps, fp32, 4-step generator (backward simulation), GAN on, CFG 8
  run_b        1 process, the same global batch (2 micro-batches of 1): FSDP vs one process (beside run_a)
  run_resumed  RESUME=auto from a copy of run_a's step-2 checkpoint
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.conftest import DmdRuns, assert_loads_with_automodel, load_export, read_metrics, tiny_default

from algorithms import dmd2 as dm
from families import sd_unet

PROMPT = "a red circle on a white background"
COMMON = ["--max_steps=4", "--log_every=1", "--dfake_gen_update_ratio=2", "--precision=fp32", "--use_gan=1",
          "--batch_size=1", "--seed=3", "--save_every=2", "--sample_every=0", "--real_guidance_scale=8",
          "--denoising_steps=[999,749,499,249]"]


@pytest.fixture(scope="module")
def dmd(tmp_path_factory):
    model, data = tiny_default("sdxl")
    return DmdRuns(tmp_path_factory.mktemp("sdxl"),
                   COMMON + [f"--model_path={model}", f"--data_path={os.path.join(data, 'data.jsonl')}"])


@pytest.fixture(scope="module")
def first_runs(dmd):
    """run_a and run_b, side by side."""
    done = dmd.launch_all({"a": (), "b": (["--grad_accum=2"], 1)})
    return done["a"], done["b"][0]


@pytest.fixture(scope="module")
def run_a(first_runs):
    return first_runs[0]


@pytest.fixture(scope="module")
def run_b(first_runs):
    return first_runs[1]


@pytest.fixture(scope="module")
def run_resumed(dmd, run_a):
    return dmd.resumed("resumed", run_a[0], 2)[0]


@pytest.mark.slow
def test_sdxl_is_detected_and_its_parts_are_used(run_a):
    out, log = run_a
    assert "(StableDiffusionXLPipeline)" in log
    audit = log.split("components (64 px")[1].split("memory at start")[0]
    assert "text_encoder_2" in audit
    vae_row = next(line for line in audit.splitlines() if line.startswith("vae "))
    assert " fp32 " in vae_row  # SDXL's VAE stays fp32 by default
    rows = read_metrics(out, timing=False)
    assert [r["step"] for r in rows if "loss_dm" in r] == [1, 3]
    assert all("loss_guidance_cls" in r and "step_index" in r for r in rows)


@pytest.mark.slow
def test_two_ranks_match_one_process(run_a, run_b):
    a, b = read_metrics(run_a[0], timing=False), read_metrics(run_b, timing=False)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        for k in sorted(k for k in ra if k.startswith(("loss", "grad_norm"))):
            rel = 1e-4 if k.startswith("loss") else 1e-3
            assert ra[k] == pytest.approx(rb[k], rel=rel, abs=1e-7), (ra["step"], k)
    ua, ub = load_export(run_a[0], "unet"), load_export(run_b, "unet")
    assert ua.keys() == ub.keys()
    for k in ua:
        torch.testing.assert_close(ua[k], ub[k], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_export_loads_with_automodel(run_a):
    assert_loads_with_automodel(run_a[0] / "export" / "unet")


@pytest.mark.slow
def test_resume_is_bit_exact(run_a, run_resumed):
    ua, ur = load_export(run_a[0], "unet"), load_export(run_resumed, "unet")
    assert ua.keys() == ur.keys() and all(torch.equal(ua[k], ur[k]) for k in ua)
    assert read_metrics(run_a[0], timing=False)[2:] == read_metrics(run_resumed, timing=False)


@pytest.mark.slow
def test_export_is_an_sdxl_pipeline_with_one_and_four_step_sampling(run_a):
    """The README snippets on the export: StableDiffusionXLPipeline + LCMScheduler at [999] and at
    [999, 749, 499, 249]; the pipeline's own SDXL conditioning equals the script's, so its 1-step
    latents are exactly the generator's x0."""
    from diffusers import LCMScheduler, StableDiffusionXLPipeline
    out = run_a[0]
    pipe = StableDiffusionXLPipeline.from_pretrained(str(out / "export"), torch_dtype=torch.float32)
    pipe.scheduler = LCMScheduler.from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    z = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    latents = pipe(PROMPT, num_inference_steps=1, guidance_scale=0, timesteps=[999], latents=z.clone(),
                   output_type="latent").images
    cond = sd_unet.encode_prompts_sdxl([pipe.tokenizer, pipe.tokenizer_2], [pipe.text_encoder, pipe.text_encoder_2],
                                       [PROMPT], 64, torch.device("cpu"))
    with torch.no_grad():
        x0 = dm.generator_forward(pipe.unet, z, 999, cond, pipe.scheduler.alphas_cumprod)
    torch.testing.assert_close(latents, x0, rtol=1e-5, atol=1e-5 * x0.abs().max().item())
    for steps in ([999], [999, 749, 499, 249]):
        image = pipe(PROMPT, num_inference_steps=len(steps), guidance_scale=0, timesteps=steps, output_type="np").images
        assert image.shape == (1, 64, 64, 3) and torch.isfinite(torch.from_numpy(image)).all()
