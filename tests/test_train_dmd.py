"""End-to-end tests of train_dmd.py, run as users run it (torchrun with 2 CPU ranks, or python),
on the embedded default (the shipped shapes teacher, assets/shapes_teacher). The DM-loss math
itself is checked in tests/test_dmd2.py.

    HF_HUB_OFFLINE=1 python -m pytest tests/test_train_dmd.py -q

Launches are few and shared through module-scoped fixtures (a one-process run beside a 2-rank one):
  run_a      2 ranks, 4 steps, fp32, 1-step generator, GAN + EMA, generator every 2nd step,
             samples (from the EMA) at steps 2 and 4, checkpoints at 2 and 4
  run_b      1 process, same global batch as run_a (2 micro-batches of 1: FSDP and grad accumulation),
             steps 2-3 profiled (PROFILE_STEPS)
  run_resumed  RESUME=auto from a copy of run_a's step-2 checkpoint, to step 4
  run_few    2 ranks, few-step generator (backward simulation), a data file with bad rows skipped,
             weights from run_a's last checkpoint (INIT_FROM) and LR 0, so they must stay exactly those
  init       2 ranks, 1 step, LR 0, the generator from a GENERATOR_INIT file (its EMA too, the fake
             score from the teacher)
  own        1 process, 1 step, a caption folder, REAL_DATA_PATH, SAMPLE_PROMPTS (beside init)
"""
from __future__ import annotations

import json
import os
import re
import sys

import pytest
import torch

from tests.conftest import (VALIDATE, DmdRuns, assert_dmd_resumed_bit_exact, assert_loads_with_automodel,
                            assert_validated, launch, load_export, read_checkpoint, read_metrics, without_validation)

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the pipeline test loads a local folder; never the hub

import fsdp_utils
import train_dmd
from families import flux
from components.config import script_constants
from components import dmd_settings
from core.errors import ConfigError
from components.trainer import check_shared_settings
from data.batches import global_batch_indices
from data.images import load_image
from families import sd_unet

PROMPT = "a red circle on a blue background"
# run_a's settings (after the module's fp32, LOG_EVERY 1); BATCH_SIZE 1 per rank on 2 ranks = a global batch of 2
COMMON = ["--max_steps=4", "--dfake_gen_update_ratio=2", "--use_gan=1", "--ema_decay=0.9", "--sample_every=2",
          "--batch_size=1", "--seed=3", "--save_every=2"]


@pytest.fixture(scope="module")
def dmd(tmp_path_factory):
    return DmdRuns(tmp_path_factory.mktemp("dmd"), ["--precision=fp32", "--log_every=1"])


@pytest.fixture(scope="module")
def first_runs(dmd):
    """run_a and run_b, side by side."""
    done = dmd.launch_all({"a": (COMMON + VALIDATE,), "b": (COMMON + ["--grad_accum=2", "--profile_steps=[2,3]"], 1)})
    return done["a"][0], done["b"][0], done["b"][1]


@pytest.fixture(scope="module")
def run_a(first_runs):
    return first_runs[0]


@pytest.fixture(scope="module")
def run_b(first_runs):
    return first_runs[1]


@pytest.fixture(scope="module")
def run_resumed(dmd, run_a):
    """Stopped after step 2 (run_a's own step-2 checkpoint, so one launch fewer), resumed to 4 without run_a's
    validation (VAL_EVERY 0): the same numbers show that validation changes none."""
    return dmd.resumed("resumed", run_a, 2, COMMON)[0]


@pytest.fixture(scope="module")
def run_few(dmd, run_a):
    """Few-step mode on 2 ranks, with a data file holding 2 bad rows and SKIP_BAD_SAMPLES on."""
    (dmd.root / "few").mkdir()
    data = dmd.root / "few" / "prompts.jsonl"
    rows = [json.dumps({"prompt": f"a {c} square on a white background"}) for c in ("red", "blue", "green", "pink")]
    data.write_text("\n".join(rows[:2] + ["{not json", json.dumps({"image": "x.png"})] + rows[2:]) + "\n")
    out, log = dmd.launch_all({"few": (["--max_steps=2", "--dfake_gen_update_ratio=1",
                                        "--denoising_steps=[999,749,499,249]", "--batch_size=1", "--sample_every=2",
                                        "--skip_bad_samples=1", f"--data_path={data}", "--generator_lr=0",
                                        "--guidance_lr=0", f"--init_from={run_a / 'checkpoints' / 'step_000004'}"],
                                       2)})["few"]
    return out, log


@pytest.fixture(scope="module")
def init_and_own_runs(dmd):
    """Side by side: 2 ranks, 1 step, LR 0, the generator from a GENERATOR_INIT file; one process,
    1 step, prompts from a caption folder, GAN real images from REAL_DATA_PATH, sample prompts."""
    root = dmd.root / "init_and_own"
    root.mkdir()
    init = _generator_init_file(root)
    prompts = root / "prompts"
    prompts.mkdir()
    for i, c in enumerate(("red", "blue", "green")):
        (prompts / f"{i}.txt").write_text(f"a {c} circle on a white background")
    real = _real_folder(root / "real")
    (root / "samples.txt").write_text("a pink square\na yellow circle\n")
    done = dmd.launch_all({
        "init": (["--max_steps=1", "--save_every=1", "--sample_every=0", "--batch_size=1", "--ema_decay=0.5",
                  "--generator_lr=0", "--guidance_lr=0", f"--generator_init={init}"], 2),
        "own": (["--max_steps=1", "--batch_size=2", "--use_gan=1", f"--data_path={prompts}",
                 f"--real_data_path={real}", f"--sample_prompts={root / 'samples.txt'}", "--sample_count=2",
                 "--caption_dropout=0.5", "--save_every=0",
                 "--gan_head_features=up"], 1)})  # (and the head on the up path's output)
    return {"init": (init, *done["init"]), "own": (prompts, real, *done["own"])}


# ----------------------------------------------------------------------------------------------
# parity, schedule, GAN, resume

@pytest.mark.slow
def test_one_process_is_reshard_free_and_profiles_its_steps(run_b, first_runs):
    """World size 1: RESHARD_AFTER_FORWARD=auto keeps each trained UNet's gathered copy (small against
    the host's memory) and says so; PROFILE_STEPS=[2,3] leaves a trace and the phases' table."""
    log = first_runs[2]
    assert log.count("UNet2DConditionModel: reshard-free (one rank per shard group") == 2, log[-3000:]
    table = (run_b / "profile" / "ops_rank0.txt").read_text()
    assert "profile of steps 2-3" in log
    for phase in ("step/generator_turn", "step/generator_images", "step/guidance_turn", "step/updates"):
        assert phase in table, (phase, table[:2000])
    trace = json.loads((run_b / "profile" / "trace_rank0.json").read_text())
    assert any(e.get("name") == "step/guidance_turn" for e in trace["traceEvents"])


@pytest.mark.slow
def test_two_ranks_match_one_process(run_a, run_b):
    a, b = read_metrics(run_a), read_metrics(run_b)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        keys = sorted(k for k in ra if k.startswith(("loss", "grad_norm")))
        assert keys == sorted(k for k in rb if k.startswith(("loss", "grad_norm")))
        for k in keys:  # grad norms: looser, Adam turns fp noise in ~0 grads into ±lr steps
            rel = 1e-4 if k.startswith("loss") else 1e-3
            assert ra[k] == pytest.approx(rb[k], rel=rel, abs=1e-7), (ra["step"], k)


@pytest.mark.slow
def test_generator_every_ratio_steps_and_gan_losses_logged(run_a):
    rows = read_metrics(run_a)
    # DFAKE_GEN_UPDATE_RATIO=2: the generator steps at iterations 0 and 2 (= logged steps 1 and 3)
    assert [r["step"] for r in rows if "loss_dm" in r] == [1, 3]
    assert [r["step"] for r in rows if "grad_norm_generator" in r] == [1, 3]
    assert [r["step"] for r in rows if "loss_gen_cls" in r] == [1, 3]
    for r in rows:  # the fake score (and GAN head) step every step
        for k in ("loss_fake", "loss_guidance_cls", "grad_norm_guidance", "lr_generator", "lr_guidance"):
            assert k in r and torch.isfinite(torch.tensor(r[k])), (r["step"], k)


@pytest.mark.slow
def test_outputs_written(run_a):
    # a sample between EMA updates (step 2, then the generator steps at 3) must not break the EMA
    assert sorted(os.listdir(run_a / "samples")) == ["step_000002.png", "step_000004.png"]
    with open(os.path.join(run_a, "checkpoints", "step_000004", "trainer_state.json")) as f:
        state = json.load(f)
    assert state["step"] == 4 and state["samples_seen"] == 8 and state["world_size"] == 2
    assert os.path.isdir(os.path.join(run_a, "export", "unet"))


@pytest.mark.slow
def test_resume_is_bit_exact(run_a, run_resumed):
    assert_dmd_resumed_bit_exact(run_a, run_resumed)
    ua, ur = load_export(run_a, "unet"), load_export(run_resumed, "unet")
    assert ua.keys() == ur.keys() and all(torch.equal(ua[k], ur[k]) for k in ua)
    la = [without_validation(r) for r in read_metrics(run_a, timing=False)]
    lr = read_metrics(run_resumed, timing=False)
    assert la[2:] == lr and [r["step"] for r in lr] == [3, 4]


@pytest.mark.slow
def test_validation_scores_the_student_against_the_teacher(run_a):
    """VAL_EVERY=2 on 2 FSDP ranks: the figures at steps 2 and 4 with their grids, the teacher's reference
    drawn once (test_resume_is_bit_exact: a run without validation trains to the same numbers)."""
    assert_validated(run_a, [2, 4])


@pytest.mark.slow
def test_export_names_the_diffusers_class_and_loads_with_automodel(run_a):
    assert_loads_with_automodel(run_a / "export" / "unet")
    index = json.load(open(run_a / "export" / "model_index.json"))
    assert index["unet"] == ["diffusers", "UNet2DConditionModel"] and "_name_or_path" not in index


@pytest.mark.slow
def test_export_is_a_one_step_pipeline(run_a):
    """The README snippet: LCMScheduler's single step at t=999 returns the x0 of the generator."""
    from algorithms import dmd2 as dm
    from diffusers import LCMScheduler, StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(os.path.join(run_a, "export"), torch_dtype=torch.float32)
    pipe.scheduler = LCMScheduler.from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    z = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    latents = pipe(PROMPT, num_inference_steps=1, guidance_scale=0, timesteps=[999], latents=z.clone(),
                   output_type="latent").images
    with torch.no_grad():
        emb = pipe.encode_prompt(PROMPT, "cpu", 1, False)[0]
        x0 = dm.generator_forward(pipe.unet, z, 999, emb, pipe.scheduler.alphas_cumprod)
    torch.testing.assert_close(latents, x0, rtol=1e-5, atol=1e-5 * x0.abs().max().item())
    image = pipe(PROMPT, num_inference_steps=1, guidance_scale=0, timesteps=[999], output_type="np").images
    assert image.shape == (1, 32, 32, 3) and torch.isfinite(torch.from_numpy(image)).all()


@pytest.mark.slow
def test_export_runs_without_a_torch_dtype(run_a):
    """The shipped teacher's text encoder and VAE are fp16, the exported UNet fp32: the export holds
    them converted to fp32 and its text encoder config says float32 (what transformers loads in
    without a dtype), so a plain from_pretrained (no torch_dtype) runs a 1-step call."""
    from diffusers import LCMScheduler, StableDiffusionPipeline
    from safetensors import safe_open
    export = os.path.join(run_a, "export")
    pipe = StableDiffusionPipeline.from_pretrained(export)
    assert {pipe.unet.dtype, pipe.text_encoder.dtype, pipe.vae.dtype} == {torch.float32}
    pipe.scheduler = LCMScheduler.from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    image = pipe(PROMPT, num_inference_steps=1, guidance_scale=0, timesteps=[999], output_type="pt").images
    assert image.shape == (1, 3, 32, 32) and torch.isfinite(image).all()
    assert not os.path.islink(os.path.join(export, "tokenizer"))  # self-contained: hard links or copies
    with safe_open(os.path.join(export, "vae", "diffusion_pytorch_model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}


# ----------------------------------------------------------------------------------------------
# few-step mode, data errors, config errors

@pytest.mark.slow
def test_few_step_backward_simulation_and_skipped_rows(run_few):
    out, log = run_few
    assert "2 bad rows skipped" in log
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert all("loss_dm" in r and "loss_fake" in r for r in rows)
    # the step index (same on every rank) picks how many generator forwards backward simulation
    # runs: 3 (from pure noise through 999, 749, 499 to the input of 249), then 0 (1 step at 999)
    assert [r["step_index"] for r in rows] == [train_dmd.dm.choose_step_index(s, 0, 4) for s in range(2)] == [3, 0]
    assert os.listdir(out / "samples") == ["step_000002.png"]
    # the demo's evaluator (not the training script) scores the export with its own 4-step sampler
    from demos import shapes_eval as se
    scores, _, _ = se.evaluate_folder(str(out / "export"), "fewstep", steps=4, seeds=2,
                                      prompts=sorted({json.loads(r)["prompt"] for r in
                                                      open(out / "prompts.jsonl") if r.startswith('{"prompt"')}))
    assert scores["sampler"] == "fewstep" and scores["steps"] == 4 and scores["n"] == 4 * 2


@pytest.mark.slow
def test_init_from_loads_generator_and_fake(run_few, run_a):
    out, log = run_few
    assert "initialised from" in log
    source, ours = read_checkpoint(run_a, 4, flat=True), read_checkpoint(out, 2, flat=True)
    keys = [k for k in ours if k.startswith((".model.generator.", ".model.fake."))]
    assert keys and all(torch.equal(ours[k], source[k]) for k in keys)


@pytest.mark.slow
@pytest.mark.parametrize("case,ranks", [("malformed_json", 2), ("missing_image", 1)])
def test_bad_data_is_one_line_error_naming_file_and_line(case, ranks, dmd, tmp_path):
    """Every rank reads and checks the whole file before any collective: all stop together."""
    data = tmp_path / "data.jsonl"
    good = json.dumps({"prompt": PROMPT, "image": "ok.png"})
    from PIL import Image
    Image.new("RGB", (64, 64)).save(tmp_path / "ok.png")
    bad = "{\"prompt\": \"a red" if case == "malformed_json" else json.dumps({"prompt": PROMPT, "image": "gone.png"})
    data.write_text("\n".join([good, good, bad, good]) + "\n")
    result = launch("train_dmd.py", [f"--data_path={data}", "--use_gan=1", f"--output_dir={tmp_path / 'out'}"],
                    ranks=ranks, env=dmd.env, check=False)
    assert result.returncode != 0
    hits = [line for line in result.stdout.splitlines() if f"{data}:3:" in line]
    assert len(hits) == 1 and hits[0].startswith("error: "), result.stdout[-3000:]


def test_every_room_resolves_its_teachers_guidance():
    """dmd_guidance: REAL_GUIDANCE_SCALE 0 and REAL_GUIDANCE_NORM "" resolve per family (UNets 1.75, plain, as
    published; FLUX.1 no pair, FLUX_GUIDANCE embedded; Qwen-Image-Edit its pipeline's true CFG 4 against
    its negative prompt, per-token rescale); a Qwen teacher at scale 1 runs no pair, so caches no negative."""
    from algorithms.dmd2 import Guidance
    from families import qwen_image
    unset = {"REAL_GUIDANCE_SCALE": 0.0, "REAL_GUIDANCE_NORM": "", "FLUX_GUIDANCE": 2.5}
    assert sd_unet.dmd_guidance(unset) == Guidance(1.75, "none")
    assert flux.dmd_guidance(unset) == Guidance(1.0, "none", embedded=2.5, export_call="guidance_scale=2.5")
    assert qwen_image.dmd_guidance(unset) == Guidance(4.0, "token", negative=" ", export_call="true_cfg_scale=1")
    assert [r.dmd_guidance(unset).words() for r in (flux, qwen_image)] == [
        "guidance 2.5", "teacher true CFG 4 (token rescale)"]
    assert flux.dmd_guidance({**unset, "FLUX_GUIDANCE": 0.0}).embedded == 2.5  # 0: BFL's Kontext value
    plain = qwen_image.dmd_guidance({**unset, "REAL_GUIDANCE_SCALE": 1.0, "REAL_GUIDANCE_NORM": "none"})
    assert plain.negative is None and plain.words() == "teacher without CFG"


def test_validation_reference_samples_the_teacher_at_its_own_guidance():
    """VAL_EVERY's teacher reference takes the family's own guidance whatever the run trains with: a run at CFG 8
    (or without CFG, or another FLUX_GUIDANCE) is compared with the teacher as its pipeline samples it."""
    from components.dmd_validation import reference_guidance
    from families import qwen_image
    run = {"REAL_GUIDANCE_SCALE": 8.0, "REAL_GUIDANCE_NORM": "none", "FLUX_GUIDANCE": 3.5, "MODEL_PATH": ""}
    unet = reference_guidance(sd_unet, run)
    assert (unet.scale, unet.norm) == (1.75, "none")
    q = reference_guidance(qwen_image, run)
    assert (q.scale, q.norm, q.negative) == (4.0, "token", " ")
    assert reference_guidance(flux, run).embedded == 2.5


def test_contradictory_settings_rejected_before_any_work(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(train_dmd, "DENOISING_STEPS", [999, 500])
    assert train_dmd.validate_config() == [999, 500]
    monkeypatch.setattr(train_dmd, "CONDITIONING_TIMESTEP", 900)
    with pytest.raises(ConfigError, match="CONDITIONING_TIMESTEP"):
        train_dmd.validate_config()
    monkeypatch.setattr(train_dmd, "DENOISING_STEPS", [500, 999])
    with pytest.raises(ConfigError, match="strictly decreasing"):
        train_dmd.validate_config()
    monkeypatch.setattr(train_dmd, "DENOISING_STEPS", [])
    monkeypatch.setattr(train_dmd, "FAKE_SCORE_TARGET", "eps")
    with pytest.raises(ConfigError, match=r"FAKE_SCORE_TARGET in \(flow, x0\)"):
        train_dmd.validate_config()
    monkeypatch.setattr(train_dmd, "FAKE_SCORE_TARGET", "x0")  # the default teacher is a UNet
    with pytest.raises(ConfigError, match="FAKE_SCORE_TARGET=x0 with a UNet teacher"):
        train_dmd.validate_config()
    monkeypatch.setattr(train_dmd, "FAKE_SCORE_TARGET", "flow")
    monkeypatch.setattr(train_dmd, "REGRESSION_WEIGHT", 0.25)
    with pytest.raises(ConfigError, match="REGRESSION_WEIGHT=0.25 with a UNet teacher"):
        train_dmd.validate_config()
    monkeypatch.setattr(train_dmd, "DENOISING_STEPS", [999, 500])
    with pytest.raises(ConfigError, match="REGRESSION_WEIGHT=0.25 with DENOISING_STEPS"):
        train_dmd.validate_config()
    monkeypatch.setattr(train_dmd, "REGRESSION_WEIGHT", 0.0)
    monkeypatch.setattr(train_dmd, "DENOISING_STEPS", [])
    monkeypatch.setattr(train_dmd, "DP_REPLICATE", 3)  # a shared setting: components.trainer checks it for both
    with pytest.raises(ConfigError, match="DP_REPLICATE"):
        check_shared_settings(script_constants(vars(train_dmd)))


def _fake_score_compute_dtypes(rank, world, fake_fp32, attention):
    """Under bf16-mixed, the weights a fake-score block computes with (read inside its forward,
    where FSDP2 has all-gathered them in the policy's dtype) vs the generator's, and the dtype of
    q, k, v at each of their SDPA calls (`attention`: FAKE_SCORE_ATTENTION_DTYPE, "" = bf16)."""
    import fsdp_utils
    import precision as prec
    from tests.test_attention import SdpaDtypes
    folder = os.path.join(train_dmd.default_paths()[0], "unet")
    mesh = fsdp_utils.build_meshes(torch.device("cpu"))[0]
    p = prec.get_precision("bf16-mixed")
    models = sd_unet.build_dmd_models(folder, mesh, p, torch.device("cpu"), sharding=fsdp_utils.Sharding(),
                                      block_classes=[], ema_decay=0.0, seed=0,
                                      fake_compute=torch.float32 if fake_fp32 else None,
                                      fake_attention=prec.parse_dtype(attention) if attention else p.compute_dtype)
    seen, sdpa = {}, {}
    for name in ("generator", "fake"):
        block = next(m for m in models[name].modules() if type(m).__name__.endswith("ResnetBlock2D"))
        def look(m, args, n=name):
            seen.setdefault(n, (m.conv1.weight.dtype, args[0].dtype))
        block.register_forward_pre_hook(look)
        cfg = models[name].config
        x = torch.randn(1, cfg.in_channels, cfg.sample_size, cfg.sample_size)
        with torch.no_grad(), SdpaDtypes() as mode:
            models[name](x, torch.tensor([500]), torch.randn(1, 4, cfg.cross_attention_dim))
        sdpa[name] = set(mode.seen)
        fsdp_utils.reshard_all(models[name])  # the root unit keeps its gathered params after forward
        assert all(p.dtype == torch.float32 for p in models[name].parameters())  # storage: fp32 master weights
    want = torch.float32 if fake_fp32 else torch.bfloat16
    assert seen == {"generator": (torch.bfloat16, torch.bfloat16), "fake": (want, want)}, seen
    fake_sdpa = torch.float32 if fake_fp32 and attention == "fp32" else torch.bfloat16
    assert sdpa == {"generator": {(torch.bfloat16,) * 3}, "fake": {(fake_sdpa,) * 3}}, sdpa


@pytest.mark.slow
@pytest.mark.parametrize("fake_fp32,attention", [(True, "fp32"), (True, ""), (False, "")])
def test_fake_score_computes_in_fp32_as_published(fake_fp32, attention):
    """FAKE_SCORE_FP32 (default off; on as published): the fake score's units gather and compute in fp32 under
    bf16-mixed, as the official DM loss runs it, its attention in FAKE_SCORE_ATTENTION_DTYPE
    (default: the compute dtype, bf16; fp32: as published); off: all in the mode's bf16, like the
    generator."""
    from tests.conftest import run_ranks
    run_ranks(_fake_score_compute_dtypes, 2, fake_fp32, attention)


def test_fake_score_attention_dtype_reaches_sdpa_and_the_audit():
    """FAKE_SCORE_ATTENTION_DTYPE under bf16-mixed with the fp32 fake score (whole replicas, as
    PARALLELISM=ddp builds them): by default ("" = the compute dtype) the fake score's SDPA sees bf16
    q, k, v while its weights and output are fp32, and the dtype table says so; "fp32" is the
    published all-fp32 pass; the generator has no cast processor."""
    import precision as prec
    from tests.test_attention import SdpaDtypes
    folder = os.path.join(train_dmd.default_paths()[0], "unet")
    p = prec.get_precision("bf16-mixed")
    for attention, want in ((p.compute_dtype, torch.bfloat16), (torch.float32, torch.float32)):
        models = sd_unet.build_dmd_models(folder, None, p, torch.device("cpu"), sharding=fsdp_utils.Sharding(),
                                          block_classes=[], ema_decay=0.0, seed=0, fake_compute=torch.float32,
                                          fake_attention=attention)
        fake, cfg = models["fake"], models["fake"].config
        with SdpaDtypes() as mode, torch.no_grad():
            out = fake(torch.randn(1, cfg.in_channels, cfg.sample_size, cfg.sample_size), torch.tensor([500]),
                       torch.randn(1, 4, cfg.cross_attention_dim)).sample
        assert mode.seen and set(mode.seen) == {(want,) * 3}, mode.seen
        assert out.dtype == torch.float32 and all(q.dtype == torch.float32 for q in fake.parameters())
        compute = prec.component_row("fake", fake, torch.float32)["compute"]
        assert compute == ("fp32, attention bf16" if want == torch.bfloat16 else "fp32"), compute
        assert not any(hasattr(m, "processor") and hasattr(m.processor, "sdpa_dtype")
                       for m in models["generator"].modules())


def test_fake_score_attention_dtype_checked_before_any_work(monkeypatch):
    monkeypatch.setattr(train_dmd, "FAKE_SCORE_ATTENTION_DTYPE", "bf61")
    with pytest.raises(ConfigError, match="FAKE_SCORE_ATTENTION_DTYPE: unknown dtype 'bf61'"):
        train_dmd.validate_config()
    monkeypatch.setattr(train_dmd, "FAKE_SCORE_ATTENTION_DTYPE", "fp32")
    with pytest.raises(ConfigError, match="FAKE_SCORE_ATTENTION_DTYPE=fp32 without FAKE_SCORE_FP32=1"):
        train_dmd.validate_config()  # it sets the fp32 fake score's attention; the default fake score is bf16
    monkeypatch.setattr(train_dmd, "FAKE_SCORE_FP32", True)
    train_dmd.validate_config()
    # the UNets' settings, not FLUX's
    with pytest.raises(ConfigError, match="FAKE_SCORE_ATTENTION_DTYPE=fp32 with a FluxPipeline teacher"):
        dmd_settings.check_flow_settings(train_dmd.current_settings(), train_dmd.changed_settings(), flux,
                                         "FluxPipeline")
    monkeypatch.setattr(train_dmd, "FAKE_SCORE_ATTENTION_DTYPE", "")
    monkeypatch.setattr(train_dmd, "CHANNELS_LAST", True)
    with pytest.raises(ConfigError, match="CHANNELS_LAST=1 with a FluxPipeline teacher: .* no convolutions"):
        dmd_settings.check_flow_settings(train_dmd.current_settings(), train_dmd.changed_settings(), flux,
                                         "FluxPipeline")


def test_channels_last_unet_matches_nchw_to_fp32_rounding():
    """CHANNELS_LAST (sd_unet.to_channels_last) on a tiny UNet, fp32 forward + backward on CPU: every
    convolution reads NHWC and the output comes back NHWC. Not bit-identical to NCHW here: oneDNN
    runs another kernel for NHWC, which sums in another order (measured: 3.5e-6 relative on the
    output and grads, mkldnn on or off). So both layouts are held to the fp64 result: channels_last
    is as accurate as NCHW, within a factor 4 of NCHW's own fp32 rounding (measured: at most 1.8)."""
    import copy
    from tests.conftest import tiny_unet

    def fwd_bwd(unet, dtype=torch.float32):
        unet = unet.to(dtype)
        g = torch.Generator().manual_seed(0)
        x, text = torch.randn(2, 4, 8, 8, generator=g).to(dtype), torch.randn(2, 6, 32, generator=g).to(dtype)
        out = unet(x, torch.tensor([10, 500]), text).sample
        out.square().mean().backward()
        return [out.detach()] + [p.grad for p in unet.parameters()]

    base = tiny_unet()
    nhwc = sd_unet.to_channels_last(copy.deepcopy(base))
    layouts = []  # what each conv reads, seen after to_channels_last's hook (hooks run in order)
    for m in nhwc.modules():
        if isinstance(m, torch.nn.Conv2d):
            m.register_forward_pre_hook(lambda m, a: layouts.append(a[0].is_contiguous(
                memory_format=torch.channels_last)))
    got, want, exact = fwd_bwd(nhwc), fwd_bwd(copy.deepcopy(base)), fwd_bwd(copy.deepcopy(base), torch.float64)
    assert layouts and all(layouts) and got[0].is_contiguous(memory_format=torch.channels_last)

    def rel(a, b):
        return max(float((x.double() - y).norm() / y.norm()) for x, y in zip(a, b))
    assert rel(got, exact) <= 4 * rel(want, exact), (rel(got, exact), rel(want, exact))


# ----------------------------------------------------------------------------------------------
# GENERATOR_INIT (the official --generator_ckpt_path) and the GAN head's fp32


def _generator_init_file(folder) -> str:
    """A .safetensors state dict of the shapes teacher's UNet layout with other (random) weights."""
    from diffusers import UNet2DConditionModel
    from safetensors.torch import save_file
    config = UNet2DConditionModel.load_config(os.path.join(train_dmd.default_paths()[0], "unet"))
    torch.manual_seed(11)
    state = {k: v.contiguous() for k, v in UNet2DConditionModel.from_config(config).state_dict().items()}
    path = os.path.join(folder, "generator.safetensors")
    save_file(state, path)
    return path


@pytest.mark.slow
def test_generator_init_starts_the_generator_and_its_ema_only(init_and_own_runs):
    """GENERATOR_INIT: generator and EMA start from the file, the fake score from the teacher (LR 0,
    so the step-1 checkpoint holds the starting weights), on 2 ranks, each reading its slices."""
    from safetensors.torch import load_file
    init, out, log = init_and_own_runs["init"]
    assert f"generator initialised from {init}" in log
    ckpt = read_checkpoint(out, 1, flat=True)
    wanted = load_file(init)
    teacher = load_file(os.path.join(train_dmd.default_paths()[0], "unet", "diffusion_pytorch_model.safetensors"))
    for part, source in (("generator", wanted), ("ema", wanted), ("fake", teacher)):
        keys = {k[len(f".model.{part}."):]: k for k in ckpt if k.startswith(f".model.{part}.")}
        assert set(keys) == set(source), part
        assert all(torch.equal(ckpt[keys[n]], source[n].float()) for n in source), part
    assert not torch.equal(wanted["conv_in.weight"], teacher["conv_in.weight"])


def test_generator_init_checked_before_any_work(monkeypatch, tmp_path):
    """A bad GENERATOR_INIT is a one-line ConfigError from validate_config (no process group yet)."""
    from diffusers import UNet2DConditionModel
    from tests.conftest import tiny_unet
    monkeypatch.setattr(train_dmd, "GENERATOR_INIT", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="neither a .safetensors file nor a diffusers UNet folder"):
        train_dmd.validate_config()
    monkeypatch.setattr(train_dmd, "GENERATOR_INIT", str(tmp_path / "pytorch_model.bin"))
    with pytest.raises(ConfigError, match="pickled state dict .* convert it once"):
        train_dmd.validate_config()
    monkeypatch.setattr(train_dmd, "GENERATOR_INIT", _generator_init_file(tmp_path))
    assert train_dmd.validate_config() == [999]  # the shapes teacher's tensors: accepted
    monkeypatch.setattr(train_dmd, "LORA_RANK", 4)
    with pytest.raises(ConfigError, match="GENERATOR_INIT with LORA_RANK > 0"):
        train_dmd.validate_config()
    monkeypatch.setattr(train_dmd, "LORA_RANK", 0)
    monkeypatch.setattr(train_dmd, "INIT_FROM", str(tmp_path))
    monkeypatch.setattr(train_dmd.checkpoint, "is_complete", lambda path: True)
    with pytest.raises(ConfigError, match="GENERATOR_INIT and INIT_FROM both set"):
        train_dmd.validate_config()
    monkeypatch.setattr(train_dmd, "INIT_FROM", "")
    tiny_unet().save_pretrained(tmp_path / "other_unet")  # another UNet layout
    assert UNet2DConditionModel.load_config(tmp_path / "other_unet")
    monkeypatch.setattr(train_dmd, "GENERATOR_INIT", str(tmp_path / "other_unet"))
    with pytest.raises(ConfigError, match="other_unet: not the model of|has shape") as e:
        train_dmd.validate_config()
    assert "\n" not in str(e.value)


def test_gan_head_computes_in_fp32_under_bf16_mixed():
    """The head's FSDP unit gathers its weights and casts its inputs to fp32 (bf16 features in),
    as the official head runs outside autocast (main/sd_guidance.py:155-164); grads in fp32."""
    import torch.distributed as dist
    import fsdp_utils
    from precision import get_precision
    from tests.conftest import free_port
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        mesh = fsdp_utils.build_meshes(torch.device("cpu"), 1)[0]
        head = train_dmd.build_gan_head(64, 8, mesh, get_precision("bf16-mixed"), torch.device("cpu"), 0, False)
        seen = []
        head[0].register_forward_pre_hook(lambda m, args: seen.append((m.weight.dtype, args[0].dtype)))
        out = head(torch.randn(2, 64, 8, 8, dtype=torch.bfloat16))
        out.sum().backward()
        assert seen == [(torch.float32, torch.float32)] and out.dtype == torch.float32
        assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in head.parameters())
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# your own data: prompts from a folder of captions, GAN real images from REAL_DATA_PATH


def _real_folder(root, n=5):
    """A folder of real images, two with captions (the rest: no caption, read as "")."""
    from PIL import Image
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        Image.new("RGB", (64, 64), (40 * i, 0, 0)).save(root / f"r{i}.png")
    (root / "r1.txt").write_text("a red square")
    (root / "r3.txt").write_text("a blue circle")
    return root


def test_real_images_come_from_real_data_path_in_their_own_order(tmp_path):
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    for i in range(3):
        (prompts / f"p{i}.txt").write_text(f"prompt {i}")
    real = _real_folder(tmp_path / "real")
    rows, skipped, real_rows = sd_unet.load_dmd_rows(str(prompts), True, False, real_path=str(real))
    assert [r["prompt"] for r in rows] == ["prompt 0", "prompt 1", "prompt 2"] and skipped == 0
    assert [r.get("prompt", "") for r in real_rows] == ["", "a red square", "", "a blue circle", ""]
    d = fsdp_utils.Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    mb = sd_unet.load_dmd_step(0, rows, 4, 1, 0, d, 8, real_rows=real_rows)[0]
    order = global_batch_indices(0, 4, 5, 0 + sd_unet._REAL_ORDER_SALT)
    assert mb["real_prompts"] == [real_rows[i].get("prompt", "") for i in order]
    for k, i in enumerate(order):
        assert torch.equal(mb["pixels"][k], load_image(real_rows[i]["image"], 8, 8))
    # without REAL_DATA_PATH: the prompt rows' own images, no captions of their own (as before)
    mb = sd_unet.load_dmd_step(0, [{"prompt": "p", "image": real_rows[0]["image"]}], 2, 1, 0, d, 8)[0]
    assert "real_prompts" not in mb and mb["pixels"].shape == (2, 3, 8, 8)


def test_dmd_data_inputs_checked_before_any_work(tmp_path, monkeypatch):
    (tmp_path / "p.txt").write_text("a prompt\n")
    with pytest.raises(ConfigError, match="USE_GAN needs real images: DATA_PATH=.*holds prompts only"):
        sd_unet.load_dmd_rows(str(tmp_path / "p.txt"), True, False)
    folder = tmp_path / "captions"
    folder.mkdir()
    (folder / "a.txt").write_text("a prompt")
    with pytest.raises(ConfigError, match=re.escape(str(folder)) + ": no images"):
        sd_unet.load_dmd_rows(str(folder), True, False)  # the GAN needs the caption's image beside it
    saved = script_constants(vars(train_dmd))
    try:
        for argv, message in (([f"--real_data_path={folder}"], "without USE_GAN"),
                              (["--caption_dropout=1"], "0 <= CAPTION_DROPOUT < 1"),
                              (["--shift=auto"], "SHIFT=auto with a UNet teacher: its timesteps are drawn uniformly"),
                              (["--real_guidance_norm=layer"], "REAL_GUIDANCE_NORM in \\(none, token, scalar\\)"),
                              (["--real_guidance_norm=token", "--real_guidance_scale=1"],
                               "REAL_GUIDANCE_NORM=token: the teacher runs no CFG pair to combine at REAL_GUIDANCE")):
            monkeypatch.setattr(sys, "argv", ["train_dmd.py", *argv])
            with pytest.raises(ConfigError, match=message):
                train_dmd.main()
            vars(train_dmd).update(saved)
    finally:
        vars(train_dmd).update(saved)


@pytest.mark.slow
def test_own_data_run_with_real_data_path_sample_prompts_and_caption_dropout(init_and_own_runs):
    prompts, real, out, log = init_and_own_runs["own"]
    assert f"data: 3 rows from {prompts}; GAN real images: 5 from REAL_DATA_PATH={real}" in log, log[-3000:]
    assert re.search(r"GAN_HEAD_FEATURES +=  *'up'", log)
    assert "loss_guidance_cls" in read_metrics(out)[0] and os.path.exists(out / "samples" / "step_000001.png")


def test_prompt_cache_encodes_each_distinct_prompt_once_and_alone():
    from algorithms import dmd2 as dm
    calls = []

    def encode(prompts):  # a stand-in encoder whose output shows which batch each row came from
        calls.append(list(prompts))
        n = torch.tensor([[float(len(prompts))]]).expand(len(prompts), 1)
        text = torch.stack([torch.tensor([float(ord(p[0]))]) for p in prompts]) + 1000 * n
        return dm.Cond(text, {"text_embeds": text * 2})

    cached = sd_unet.PromptCache(encode, size=2)
    out = cached(["a", "b", "a", "c"])
    assert calls == [["a"], ["b"], ["c"]]  # each distinct prompt once, alone; "c" over the size is not kept
    alone = torch.cat([encode([p]).text for p in "abac"])
    assert torch.equal(out.text, alone) and torch.equal(out.added["text_embeds"], 2 * alone)
    calls.clear()
    again = cached(["c", "a"])
    assert calls == [["c"]] and torch.equal(again.text, torch.cat([alone[3:], alone[:1]]))


@pytest.mark.parametrize("family", ["kontext", "qwen"])
def test_flow_teachers_read_rows_as_their_pipelines(family, tmp_path, monkeypatch):
    """DMD2 reads an editing row as its pipeline reads it, to the pixel, for a 2:1 and a 1:2 row at
    RESOLUTION 1024: FLUX.1 Kontext's context at its bucket, the size FluxKontextPipeline picks from its
    preferred resolutions, resized (no crop) as its image processor does; Qwen-Image-Edit's reference
    whole, at calculate_dimensions(1024^2) as the pipeline's VAE view (the Qwen2.5-VL view is the whole
    image too), its target at the pipeline's output size; one shape per step, the target beside it."""
    import numpy as np
    from diffusers.image_processor import VaeImageProcessor
    from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import VAE_IMAGE_SIZE, calculate_dimensions
    from PIL import Image

    from families import qwen_image
    from tests.test_data import pixels
    g = np.random.default_rng(0)
    rows = []
    for i, (h, w) in enumerate(((300, 600), (600, 300))):  # 2:1 wide, 1:2 tall
        for name in ("control", "target"):
            Image.fromarray(g.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(tmp_path / f"{name}{i}.png")
        rows.append({"control": f"control{i}.png", "target": f"target{i}.png", "prompt": "p"})
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    module = flux if family == "kontext" else qwen_image
    room = type("Room", (), {k: staticmethod(v) if callable(v) else v for k, v in vars(module).items()
                             if not k.startswith("__")})
    room.vae_factor = staticmethod(lambda path: 8)
    room.load_text = staticmethod(lambda *a: None)
    for name, value in (("DATA_PATH", str(tmp_path / "rows.jsonl")), ("MAX_STEPS", 8), ("BATCH_SIZE", 1),
                        ("GRAD_ACCUM", 1), ("USE_GAN", True)):
        monkeypatch.setattr(train_dmd, name, value)
    pipeline = "FluxKontextPipeline" if family == "kontext" else "QwenImageEditPlusPipeline"
    settings = {**script_constants(vars(train_dmd)), "RESOLUTION": 1024, "PIPELINE": pipeline}
    data = train_dmd.flow_data(room, settings)
    processor = VaeImageProcessor(vae_scale_factor=16)
    seen = set()
    for it in range(8):
        step = train_dmd.load_flow_step(it, room=room, data=data, cache_dir="", identity="", negative=None, dp=(0, 1))
        (h, w), refs = step["shape"]
        mb = step["batches"][0]
        i = train_dmd.step_indices(it, data.members, data.schedule, 1, 0)[0]  # rows in the file's order
        control = Image.open(tmp_path / f"control{i}.png")
        if family == "kontext":  # the pipeline's preferred resolution nearest the image's ratio
            _, pw, ph = min((abs(control.width / control.height - a / b), a, b)
                            for a, b in PREFERRED_KONTEXT_RESOLUTIONS)
            assert (h, w) == (ph, pw) and refs == ((h, w),)
        else:  # calculate_dimensions at the pipeline's VAE area; the target at its output's
            pw, ph = calculate_dimensions(VAE_IMAGE_SIZE, control.width / control.height)
            assert refs == ((ph, pw),) and (h, w) == (ph, pw)
        view = processor.preprocess(processor.resize(control.convert("RGB"), refs[0][0], refs[0][1]), *refs[0])[0]
        assert torch.equal(pixels(mb["references"][0][0]), pixels(view))
        target = Image.open(tmp_path / f"target{i}.png").convert("RGB")
        assert torch.equal(pixels(mb["target"][0]), pixels(processor.preprocess(target, h, w)[0]))
        seen.add(i)
    assert seen == {0, 1}  # both shapes trained
