"""DMD2 with a FLUX.1 Kontext teacher (train_dmd.py's FLUX path, algorithms/dmd2_flow.py), run as
users run it on the shipped tiny Kontext base (assets/kontext_base) and "make it blue" pairs.

    HF_HUB_OFFLINE=1 python -m pytest tests/test_train_dmd_kontext.py -q

Launches, shared through module-scoped fixtures (the first three side by side):
  run_a      2 ranks, 4 steps, fp32, 4-step generator (backward simulation), GAN head, EMA, generator
             every 2nd step, samples at steps 2 and 4, checkpoints at 2 and 4
  run_b      1 process, the same global batch (2 micro-batches of 1)
  run_resumed  RESUME=auto from a copy of run_a's step-2 checkpoint, to step 4
  run_lora   1 process, 2 steps, LoRA generator and fake score on NF4 bases, NF4 teacher, validation at step 2
  run_merged 1 process, 1 step, LoRA generator with LORA_EXPORT_MERGED (an NF4 base refuses the merged export)
  run_started 2 ranks, 1 step at generator LR 0, the LoRA generator started from a file in another tool's form
  cp, cp_one  3 steps without the GAN head, validation at step 2, CONTEXT_PARALLEL=2 on 2 ranks (one CP group) and
             1 process (GRAD_ACCUM=2)
(the 1-step generator's draws and step: test_dm_gradient_is_zero_when_generator_teacher_and_fake_agree)
Settings a FLUX teacher refuses (prompt-only data, USE_GAN) are checked in tests/test_fault_tolerance.py,
REAL_GUIDANCE_SCALE here.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from tests.conftest import (VAL_FIGURES, VALIDATE, DmdRuns, assert_dmd_resumed_bit_exact, assert_validated,
                            read_metrics, tiny_flux)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = os.path.join(ROOT, "assets", "kontext_base")
SIGMAS = [1.0, 0.75, 0.5, 0.25]
COMMON = [f"--model_path={BASE}", "--resolution=32", "--max_steps=4", "--log_every=1", "--dfake_gen_update_ratio=2",
          "--precision=fp32", "--ema_decay=0.9", "--sample_every=2", "--batch_size=1", "--seed=3", "--save_every=2",
          "--denoising_steps=999,749,499,249", "--sample_count=2", "--generator_lr=1e-4", "--guidance_lr=1e-4",
          "--use_gan=1"]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """The first 12 shipped pairs, image paths made absolute."""
    src = os.path.join(ROOT, "assets", "kontext_blue")
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    with open(os.path.join(src, "train.jsonl")) as f, open(path, "w") as out:
        for line in list(f)[:12]:
            row = json.loads(line)
            paths = {"control": os.path.join(src, row["image"]), "target": os.path.join(src, row["target"])}
            out.write(json.dumps({**paths, "prompt": row["prompt"]}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def dmd(pairs, tmp_path_factory):
    return DmdRuns(tmp_path_factory.mktemp("dmd"), COMMON + [f"--data_path={pairs}"])


@pytest.fixture(scope="module")
def started_lora(tmp_path_factory):
    """A rank-4 LoRA of the base's double blocks' to_q / to_k in the form with `.alpha` keys (diffusers names,
    lora_A / lora_B; FluxKontextPipeline.lora_state_dict reads it), alpha 12 (scale 3), random B."""
    from safetensors.torch import load_file, save_file
    g = torch.Generator().manual_seed(5)
    base = load_file(os.path.join(BASE, "transformer", "diffusion_pytorch_model.safetensors"))
    tensors = {}
    for key, w in base.items():
        if key.startswith("transformer_blocks.") and key.endswith(("attn.to_q.weight", "attn.to_k.weight")):
            m = key[:-len(".weight")]
            tensors[f"transformer.{m}.lora_A.weight"] = torch.randn(4, w.shape[1], generator=g) / 4
            tensors[f"transformer.{m}.lora_B.weight"] = torch.randn(w.shape[0], 4, generator=g) * 0.1
            tensors[f"transformer.{m}.alpha"] = torch.tensor(12.0)
    path = tmp_path_factory.mktemp("started") / "alpha_form.safetensors"
    save_file(tensors, str(path))
    return str(path)


@pytest.fixture(scope="module")
def first_runs(dmd, started_lora):
    """run_a, run_b, run_lora, run_merged and run_started, side by side (and a 1-step step with the regression
    loss)."""
    done = dmd.launch_all({
        "a": (), "b": (["--grad_accum=2"], 1),
        "lora": (["--max_steps=2", "--ema_decay=0", "--use_gan=0", "--lora_rank=4", "--fake_lora=1",
                  "--base_dtype=nf4", *VALIDATE], 1),
        "merged": (["--max_steps=1", "--ema_decay=0", "--use_gan=0", "--sample_every=0", "--lora_rank=4",
                    "--lora_export_merged=1"], 1),
        "reg": (["--max_steps=1", "--ema_decay=0", "--use_gan=0", "--sample_every=0", "--denoising_steps=",
                 "--regression_weight=0.5", "--regression_steps=2"], 1),
        "started": (["--max_steps=1", "--ema_decay=0", "--use_gan=0", "--sample_every=0", "--lora_rank=4",
                     "--lora_alpha=8", "--generator_lr=0", f"--generator_lora={started_lora}", "--export_dtype=fp32",
                     "--save_every=0"], 2),
        "cp": ([*CP_ARGS, "--context_parallel=2"], 2), "cp_one": (CP_ARGS, 1)})
    assert "FluxKontextPipeline" in done["a"][1] and "num_inference_steps=4, guidance_scale=2.5" in done["a"][1]
    # the regression loss reaches the generator's step (its math: tests/test_dmd2.py, test_dm_gradient_is_zero...)
    assert read_metrics(done["reg"][0])[0]["loss_reg"] > 0, done["reg"][1][-2000:]
    return done["a"][0], done["b"][0], done["lora"], done["merged"], done["started"], done["cp"], done["cp_one"]


CP_ARGS = ["--max_steps=3", "--use_gan=0", "--grad_accum=2", "--save_every=0", "--sample_every=3", *VALIDATE]


@pytest.fixture(scope="module")
def run_a(first_runs):
    return first_runs[0]


@pytest.fixture(scope="module")
def run_b(first_runs):
    return first_runs[1]


@pytest.fixture(scope="module")
def run_lora(first_runs):
    return first_runs[2]


@pytest.fixture(scope="module")
def run_merged(first_runs):
    return first_runs[3]


@pytest.fixture(scope="module")
def run_resumed(dmd, run_a):
    return dmd.resumed("resumed", run_a, 2)[0]


@pytest.mark.slow
def test_two_ranks_train_the_distilled_generator(run_a):
    rows = read_metrics(run_a)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["step"] for r in rows if "loss_dm" in r] == [1, 3]  # DFAKE_GEN_UPDATE_RATIO=2
    assert [r["step"] for r in rows if "loss_gen_cls" in r] == [1, 3]
    assert all(torch.isfinite(torch.tensor(r["loss_guidance_cls"])) for r in rows)  # the head steps every step
    # step 1: generator = teacher = fake at the same guidance value, so the DM gradient is exactly 0;
    # at step 3 the fake score has moved off the teacher, so the generator gets a signal
    assert rows[0]["loss_dm"] == 0 and rows[2]["loss_dm"] > 0
    assert all(r["loss_fake"] > 0 and torch.isfinite(torch.tensor(r["loss_fake"])) for r in rows)
    assert sorted(os.listdir(run_a / "samples")) == ["step_000002.png", "step_000004.png"]
    from PIL import Image
    with Image.open(run_a / "samples" / "step_000004.png") as im:
        assert im.size == (3 * 32, 2 * 32)  # context | output | target, two sample rows


@pytest.mark.slow
def test_world_size_one_matches_two(run_a, run_b):
    a, b = read_metrics(run_a), read_metrics(run_b)
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        keys = sorted(k for k in ra if k.startswith(("loss", "grad_norm")))
        assert keys == sorted(k for k in rb if k.startswith(("loss", "grad_norm")))
        for k in keys:
            assert ra[k] == pytest.approx(rb[k], rel=1e-4, abs=1e-7), (ra["step"], k)


@pytest.mark.slow
def test_resume_is_bit_exact(run_a, run_resumed):
    assert_dmd_resumed_bit_exact(run_a, run_resumed)
    assert [r["step"] for r in read_metrics(run_resumed)] == [3, 4]


def _edit(pipe, pairs):
    """The export's pipeline on the first pair's context, in 4 steps at the trained guidance value."""
    from data.images import load_image
    with open(pairs) as f:
        row = json.loads(f.readline())
    image = (load_image(row["control"], 32, 32)[None] + 1) / 2
    out = pipe(image=image, prompt=row["prompt"], height=32, width=32, max_area=32 * 32, _auto_resize=False,
               num_inference_steps=4, guidance_scale=2.5, generator=torch.Generator().manual_seed(0),
               output_type="pt").images
    return out


@pytest.mark.slow
def test_export_samples_in_the_distilled_steps(run_a, pairs):
    from diffusers import FluxKontextPipeline
    pipe = FluxKontextPipeline.from_pretrained(run_a / "export")
    pipe.set_progress_bar_config(disable=True)
    assert pipe.scheduler.config.stochastic_sampling and not pipe.scheduler.config.use_dynamic_shifting
    assert not os.path.islink(run_a / "export" / "scheduler")  # the export's own, not a link into OUTPUT_DIR
    out = _edit(pipe, pairs)
    assert out.shape == (1, 3, 32, 32) and torch.isfinite(out).all()
    # the scheduler walked exactly the σ list the generator was trained on
    assert pipe.scheduler.sigmas.tolist() == pytest.approx(SIGMAS + [0.0])
    # the export is the EMA's weights (what the samples showed), not the teacher's
    from safetensors.torch import load_file
    exported = load_file(os.path.join(run_a, "export", "transformer", "diffusion_pytorch_model.safetensors"))
    teacher = load_file(os.path.join(BASE, "transformer", "diffusion_pytorch_model.safetensors"))
    assert exported.keys() == teacher.keys()
    assert any(not torch.equal(exported[k].float(), teacher[k].float()) for k in teacher)


@pytest.mark.slow
def test_lora_nf4_run_exports_adapters_the_base_pipeline_loads(run_lora, pairs):
    out, log = run_lora
    assert "nf4" in log  # the dtype table shows the NF4 bases and teacher
    assert_validated(out, [2], log)  # one process, NF4 teacher, LoRA students, the guidance-embedded teacher
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2] and all(torch.isfinite(torch.tensor(r["loss_fake"])) for r in rows)
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxKontextPipeline
    pipe = FluxKontextPipeline.from_pretrained(BASE, torch_dtype=torch.float32)
    pipe.load_lora_weights(out / "export")
    pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(out / "export", subfolder="scheduler")
    pipe.set_progress_bar_config(disable=True)
    assert "num_inference_steps=4, guidance_scale=2.5" in log
    assert torch.isfinite(_edit(pipe, pairs)).all()
    assert pipe.scheduler.sigmas.tolist() == pytest.approx(SIGMAS + [0.0])


@pytest.mark.slow
def test_generator_lora_starts_the_adapters_from_a_file_in_another_form(first_runs, started_lora):
    """GENERATOR_LORA on 2 ranks: after a step at generator LR 0 the exported adapters make the file's deltas
    (read through the pipeline's converter, its scale 3 against the run's 2: B rescaled), and every other targeted
    module none (its lora_B still 0)."""
    from parallel import lora_merge
    out, log = first_runs[4]
    assert f"generator: its adapters from GENERATOR_LORA={started_lora}" in log, log[-3000:]
    file = lora_merge.read_lora(started_lora, pipeline="FluxKontextPipeline")
    exported = lora_merge.read_lora(str(out / "export"))
    assert set(file.layers) < set(exported.layers)
    for m, (a, b, s) in exported.layers.items():
        if m in file.layers:
            fa, fb, fs = file.layers[m]
            torch.testing.assert_close((b @ a) * s, (fb @ fa) * fs, msg=m)
        else:
            assert not b.any(), m


@pytest.mark.slow
def test_lora_merged_export_and_adapters_sample_the_trained_sigmas(run_merged, pairs):
    """Both exports that carry a LoRA generator, export/ (beside the adapters) and export_merged/, hold
    the distilled scheduler: the trained σ list at the run's token count and at FLUX.1's at 1024 px."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxKontextPipeline
    out, log = run_merged
    assert "FluxKontextPipeline.from_pretrained(export_merged); pipe(..., num_inference_steps=4" in log
    for folder in ("export", "export_merged"):
        assert os.path.isfile(out / folder / "scheduler" / "scheduler_config.json")
        assert not os.path.islink(out / folder / "scheduler")  # its own, not the teacher's
        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(out / folder, subfolder="scheduler")
        for tokens in (TOKENS_32, TOKENS_1024):
            assert _pipeline_sigmas(scheduler, tokens) == SIGMAS, (folder, tokens)
    pipe = FluxKontextPipeline.from_pretrained(out / "export_merged")
    pipe.set_progress_bar_config(disable=True)
    assert torch.isfinite(_edit(pipe, pairs)).all()
    assert pipe.scheduler.sigmas.tolist() == SIGMAS + [0.0]


def test_dm_gradient_is_zero_when_generator_teacher_and_fake_agree():
    """The property the UNet path's bar checks: with G = teacher = fake at guidance 1, loss_dm and its
    gradient are exactly 0; a fake score that differs gives a non-zero gradient."""
    from algorithms import dmd2_flow as fd
    from algorithms import flux_kontext as km

    model = tiny_flux(guidance_embeds=True).eval()
    g = torch.Generator().manual_seed(0)
    b, side = 2, 4
    cond = fd.FluxCond(torch.randn(b, 3, 32, generator=g), torch.randn(b, 32, generator=g),
                       km.pack_latents(torch.randn(b, 1, side, side, generator=g)), (side, side))
    draws = fd.pack_draws({"noise": torch.randn(b, 1, side, side, generator=g),
                           "dm_noise": torch.randn(b, 1, side, side, generator=g),
                           "fake_noise": torch.randn(b, 1, side, side, generator=g),
                           "sim_noise": torch.randn(b, 0, 1, side, side, generator=g),
                           "dm_sigma": torch.tensor([0.3, 0.8]), "fake_sigma": torch.tensor([0.5, 0.5])})
    mb = {**draws, "cond": cond}
    x = fd.generator_images(model, mb, [1.0], 0, guidance=1.0)
    assert x.requires_grad
    loss, logs = fd.generator_loss(x, mb, model, model, guidance=1.0)
    loss.backward()
    assert loss.item() == 0 and all(p.grad is None or not p.grad.any() for p in model.parameters())
    other = tiny_flux(seed=1, guidance_embeds=True).eval()
    model.zero_grad(set_to_none=True)
    x = fd.generator_images(model, mb, [1.0], 0, guidance=1.0)
    loss, _ = fd.generator_loss(x, mb, model, other, guidance=1.0)
    loss.backward()
    assert loss.item() > 0 and any(p.grad is not None and p.grad.any() for p in model.parameters())
    # the fake score's loss space reaches the loss (its math: tests/test_dmd2.py)
    from algorithms.dmd2 import Losses
    flow, _ = fd.guidance_loss(x, mb, other, 1.0)
    x0, _ = fd.guidance_loss(x, mb, other, 1.0, Losses(fake_target="x0"))
    assert float(flow) > 0 and float(x0) > 0 and float(x0) != float(flow)
    # DMD's regression loss: G = teacher = fake leaves loss_dm at 0, but the 1-step teacher's x̂0 is not its
    # ODE's output, so loss_reg pulls G towards it
    model.zero_grad(set_to_none=True)
    x = fd.generator_images(model, mb, [1.0], 0, guidance=1.0)
    loss, logs = fd.generator_loss(x, mb, model, model, 1.0, Losses(regression_weight=2.0, regression_steps=4))
    loss.backward()
    assert float(logs["loss_dm"]) == 0 and float(logs["loss_reg"]) > 0
    assert float(loss.detach()) == 2 * float(logs["loss_reg"])
    assert any(p.grad is not None and p.grad.any() for p in model.parameters())


def test_sigma_list_is_the_pipelines_for_the_step_count():
    from algorithms import dmd2_flow as fd
    from families import flux
    assert fd.timestep_sigmas([999, 749, 499, 249]) == SIGMAS
    assert fd.timestep_sigmas([999]) == [1.0]
    config = flux.distilled_scheduler_config({"_class_name": "FlowMatchEulerDiscreteScheduler",
                                              "_diffusers_version": "x", "use_dynamic_shifting": True, "shift": 3.0})
    assert config == {"_class_name": "FlowMatchEulerDiscreteScheduler", "use_dynamic_shifting": False, "shift": 1.0,
                      "shift_terminal": None, "use_karras_sigmas": False, "use_exponential_sigmas": False,
                      "use_beta_sigmas": False, "invert_sigmas": False, "stochastic_sampling": True}


# target tokens of a 32 px image with the tiny base's VAE (factor 4, 2x2 packing), and of 1024 px with FLUX.1's (8)
TOKENS_32, TOKENS_1024 = (32 // 4 // 2) ** 2, (1024 // 8 // 2) ** 2


def _pipeline_sigmas(scheduler, tokens: int, n: int = 4) -> list[float]:
    """The σ list FluxKontextPipeline (diffusers 0.42) walks for num_inference_steps=n at `tokens`
    target tokens: σ = linspace(1, 1/n, n) and mu = calculate_shift(tokens, the scheduler's settings),
    both passed to set_timesteps through retrieve_timesteps."""
    from diffusers.pipelines.flux.pipeline_flux_kontext import calculate_shift, retrieve_timesteps
    c = scheduler.config
    mu = calculate_shift(tokens, c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                         c.get("base_shift", 0.5), c.get("max_shift", 1.15))
    retrieve_timesteps(scheduler, n, "cpu", sigmas=np.linspace(1.0, 1 / n, n), mu=mu)
    return scheduler.sigmas[:-1].tolist()


@pytest.mark.parametrize("bend", [
    {}, {"shift": 3.0, "use_dynamic_shifting": False}, {"time_shift_type": "linear", "max_shift": 3.0},
    {"shift_terminal": 0.5}, {"use_karras_sigmas": True}, {"use_exponential_sigmas": True},
    {"use_beta_sigmas": True}, {"invert_sigmas": True}], ids=lambda b: ",".join(b) or "shipped")
def test_written_scheduler_samples_the_trained_sigmas_whatever_bends_the_teachers(bend, tmp_path):
    """Each FlowMatchEulerDiscreteScheduler setting that moves the σ list (on top of the shipped
    teacher's dynamic shift) bends the teacher's steps away from the trained ones; the scheduler the
    export writes walks exactly 1, .75, .5, .25 (shift 1 is the identity s / (1 + 0·s), and these are
    exact in fp32) at any resolution."""
    from components.export import write_scheduler
    from families import flux
    from diffusers import FlowMatchEulerDiscreteScheduler
    with open(os.path.join(BASE, "scheduler", "scheduler_config.json")) as f:
        teacher = {**json.load(f), **bend}
    if not bend.get("use_beta_sigmas"):  # beta σ need scipy to build; the written scheduler must not
        bent = _pipeline_sigmas(FlowMatchEulerDiscreteScheduler.from_config(teacher), TOKENS_1024)
        assert bent != pytest.approx(SIGMAS, abs=1e-3), bent
    write_scheduler(str(tmp_path), flux.distilled_scheduler_config(teacher))
    written = FlowMatchEulerDiscreteScheduler.from_pretrained(tmp_path, subfolder="scheduler")
    assert written.config.stochastic_sampling
    for tokens in (TOKENS_32, TOKENS_1024):
        assert _pipeline_sigmas(written, tokens) == SIGMAS, tokens


def test_flux_teacher_refuses_teacher_cfg_before_any_work(monkeypatch, pairs, tmp_path):
    """REAL_GUIDANCE_SCALE: 0 (the default) resolves per teacher, 1.75 for a UNet and 1 (no CFG) for
    FLUX; an explicit value other than 1 with a FLUX teacher stops main() in one line."""
    import train_dmd
    from components.config import script_constants
    from core.errors import ConfigError
    saved = script_constants(vars(train_dmd))
    try:
        for scale in ("1.75", "3"):
            monkeypatch.setattr("sys.argv", ["train_dmd.py", f"--model_path={BASE}", f"--data_path={pairs}",
                                             f"--output_dir={tmp_path}", f"--real_guidance_scale={scale}"])
            with pytest.raises(ConfigError, match=f"REAL_GUIDANCE_SCALE={scale} with a FluxKontextPipeline teacher: "
                                                  "FLUX.1 is guidance-distilled") as e:
                train_dmd.main()
            assert "\n" not in str(e.value) and not os.listdir(tmp_path)
            vars(train_dmd).update(saved)
        for model, scale, resolved in ((BASE, 0.0, 1.0), (BASE, 1.0, 1.0), ("", 0.0, 1.75), ("", 8.0, 8.0)):
            vars(train_dmd).update(saved, MODEL_PATH=model, REAL_GUIDANCE_SCALE=scale,
                                   DATA_PATH=pairs if model else "")
            train_dmd.validate_config()
            assert train_dmd.resolve_defaults()["REAL_GUIDANCE_SCALE"] == resolved, (model, scale)
    finally:
        vars(train_dmd).update(saved)


@pytest.mark.slow  # ~1.3 s: the file read through diffusers' converter five times
def test_generator_lora_it_cannot_start_is_one_line_before_any_work(started_lora, pairs):
    """GENERATOR_LORA without LORA_RANK, at another rank, beyond the targets, or with a UNet teacher: one line."""
    import train_dmd
    from components.config import script_constants
    from core.errors import ConfigError
    saved = script_constants(vars(train_dmd))
    cases = [({}, "without LORA_RANK"), ({"LORA_RANK": 8}, "has rank 4, LORA_RANK=8: set LORA_RANK=4"),
             ({"LORA_RANK": 4, "LORA_TARGET_MODULES": ["to_v"]}, "which LORA_TARGET_MODULES does not target"),
             ({"LORA_RANK": 4, "MODEL_PATH": "", "DATA_PATH": ""}, "with a UNet teacher")]
    try:
        for change, words in cases:
            vars(train_dmd).update(saved, **{"MODEL_PATH": BASE, "DATA_PATH": pairs, "GENERATOR_LORA": started_lora,
                                             **change})
            with pytest.raises(ConfigError, match=words) as e:
                train_dmd.validate_config()
            assert "\n" not in str(e.value)
        vars(train_dmd).update(saved, MODEL_PATH=BASE, DATA_PATH=pairs, GENERATOR_LORA=started_lora, LORA_RANK=4)
        train_dmd.validate_config()
    finally:
        vars(train_dmd).update(saved)


@pytest.mark.slow
def test_context_parallel_trains_as_one_process(first_runs):
    """CONTEXT_PARALLEL=2: each sample's target and reference tokens (and its text) split over a CP group of 2 by
    FluxTransformer2DModel's _cp_plan, generator, fake score, teacher and EMA alike: one process's losses and grad
    norms (a grad scale off by the CP degree shows in the norms), validation figures, export and samples."""
    from PIL import Image
    from tests.conftest import load_export
    (cp, log), (one, _) = first_runs[5], first_runs[6]
    assert "context parallel: 1 data-parallel group(s) of 2 ranks" in log
    a, b = read_metrics(cp), read_metrics(one)
    assert [r["step"] for r in a if "loss_dm" in r] == [1, 3]
    assert_validated(cp, [2], log)
    for key in ("loss_fake", "loss_dm", "grad_norm_generator", "grad_norm_guidance", *VAL_FIGURES):
        # fp32 sums in another order (attention over heads split, grads summed over ranks)
        assert [key in r for r in a] == [key in r for r in b], key
        assert [r[key] for r in a if key in r] == pytest.approx([r[key] for r in b if key in r], rel=1e-4,
                                                                abs=1e-7), key
    w_cp, w_one = load_export(cp), load_export(one)
    for k in w_one:  # 3 AdamW steps at LR 1e-4: a wrong split moves elements by ~1e-4
        torch.testing.assert_close(w_cp[k], w_one[k], rtol=1e-5, atol=2e-6, msg=k)
    x, y = (np.asarray(Image.open(os.path.join(d, "samples", "step_000003.png")), dtype=np.int16) for d in (cp, one))
    assert x.shape == y.shape and np.abs(x - y).max() <= 2
