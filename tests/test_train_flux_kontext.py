"""train_flux_kontext.py end to end on the tiny Kontext model (CPU, gloo), plus its data, bucket
and text-cache helpers.

    python -m pytest tests/test_train_flux_kontext.py -q

The script is launched as users launch it (`torchrun --nproc_per_node=2` and plain `python`), on a
small edit dataset with two aspect ratios (so steps switch between 64x64 and 48x96 buckets). The
runs are module-scoped fixtures shared by several tests:

    hsdp    torchrun 2, BATCH_SIZE=2, DP_REPLICATE=2, no reshard after forward
    ref     python, BATCH_SIZE=4                                   (the 1-process reference)
    combo   torchrun 2, BATCH_SIZE=1, GRAD_ACCUM=2, activation checkpointing, CPU offload, EMA,
            samples every 2 steps                                  (3 steps straight)
    resumed the combo settings, RESUME=auto from a copy of combo's step-2 checkpoint to step 3
            (a fresh process; must equal combo's step 3 bit for bit)

All runs share one text-embedding cache: the first run (hsdp) fills it, the others must reuse it;
ref and combo then train side by side (a one-process run fills the core a 2-rank run leaves idle).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys

import pytest
import torch

from tests.conftest import (KONTEXT_STEPS, assert_kontext_resumed_bit_exact, assert_loads_with_automodel, free_port,
                            kontext_run, launch_all, launch_kontext, load_export, read_metrics, tensorboard_scalars)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import fsdp_utils
from components.config import script_constants
from core.errors import ConfigError
from components.warnings import quiet_known_warnings
from parallel import lora
import train_flux_kontext as tfk
from data import buckets as db
from families import flux



# ----------------------------------------------------------------------------------------------
# data and launching


def computed_reused(stdout):
    m = re.search(r"text cache: (\d+) unique prompts, computed (\d+), reused (\d+)", stdout)
    return int(m.group(2)), int(m.group(3))


COMBO = ["--batch_size=1", "--grad_accum=2", "--activation_checkpointing=1", "--cpu_offload=1",
         "--ema_decay=0.5", "--sample_every=2", "--save_every=2", "--val_every=2", "--report_to=tensorboard"]


@pytest.fixture(scope="module")
def runs(kontext_setup):
    root = kontext_setup["root"]
    hsdp = ["--batch_size=2", "--dp_replicate=2", "--reshard_after_forward=0", "--sample_every=0"]
    out = {"hsdp": (str(root / "hsdp"), launch_kontext(kontext_setup, root / "hsdp", hsdp).stdout)}
    ref = ["--batch_size=4", "--sample_every=0"]
    side_by_side = launch_all({"ref": kontext_run(kontext_setup, root / "ref", ref, 1),
                               "combo": kontext_run(kontext_setup, root / "combo", COMBO)})
    out.update({name: (str(root / name), done.stdout) for name, done in side_by_side.items()})
    # resume: a new run whose OUTPUT_DIR holds the straight run's step-2 checkpoint continues to step 3
    os.makedirs(root / "resumed" / "checkpoints")
    shutil.copytree(root / "combo" / "checkpoints" / "step_000002", root / "resumed" / "checkpoints" / "step_000002")
    out["resumed"] = (
        str(root / "resumed"),
        launch_kontext(kontext_setup, root / "resumed", COMBO + ["--resume=auto"]).stdout,
    )
    return out


# ----------------------------------------------------------------------------------------------
# end to end


@pytest.mark.slow
def test_two_ranks_match_one_process_with_memory_options(runs, kontext_setup):
    train, _, buckets, bucket_of = tfk.load_data(kontext_setup["data"], 2, 64, tfk.BUCKET_ASPECTS, 16, False)
    sizes = {buckets[b] for b, _ in db.bucket_schedule(bucket_of, KONTEXT_STEPS, seed=0)[1]}
    assert sizes == {(64, 64), (48, 96)}  # the compared steps switch between the two buckets
    ref = read_metrics(runs["ref"][0])
    assert [r["step"] for r in ref] == list(range(1, KONTEXT_STEPS + 1))
    for name in ("hsdp", "combo"):
        other = read_metrics(runs[name][0])
        for a, b in zip(ref, other, strict=True):
            assert abs(a["loss"] - b["loss"]) < 1e-4, (name, a, b)
            assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-4 * max(1.0, a["grad_norm"]), (name, a, b)
    # final weights too (combo exports its EMA, so compare the raw ones of ref and hsdp)
    from safetensors.torch import load_file
    initial = load_file(os.path.join(kontext_setup["model_path"], "transformer", "diffusion_pytorch_model.safetensors"))
    trained_1, trained_2 = load_export(runs["ref"][0]), load_export(runs["hsdp"][0])
    assert any(not torch.equal(initial[k], trained_1[k]) for k in initial)  # lr 1e-3: it did train
    for k in initial:
        torch.testing.assert_close(trained_2[k], trained_1[k], rtol=1e-4, atol=1e-5, msg=k)


@pytest.mark.slow
def test_resume_is_bit_exact(runs):
    assert "resumed from" in runs["resumed"][1] and "(step 2)" in runs["resumed"][1]
    straight, resumed = load_export(runs["combo"][0]), load_export(runs["resumed"][0])
    assert straight.keys() == resumed.keys()
    for k in straight:
        assert torch.equal(straight[k], resumed[k]), k
    # model, EMA and AdamW state at step 3, bit for bit
    assert_kontext_resumed_bit_exact(runs["combo"][0], runs["resumed"][0], KONTEXT_STEPS)


@pytest.mark.slow
def test_text_cache_filled_once_then_reused(runs, kontext_setup):
    unique = len({r["prompt"] for r in kontext_setup["rows"]})
    counts = [computed_reused(stdout) for _, stdout in (runs[k] for k in ("hsdp", "ref", "combo"))]
    assert counts[0] == (unique, 0)  # the first run fills the shared cache
    assert all(c == (0, unique) for c in counts[1:])
    assert computed_reused(runs["resumed"][1]) == (0, unique)
    files = [f for _, _, fs in os.walk(kontext_setup["root"] / "text_cache") for f in fs]
    assert len(files) == unique and all(f.endswith(".pt") for f in files)


@pytest.mark.slow
def test_checkpoint_holds_ema_and_samples_are_grids(runs):
    import torch.distributed.checkpoint as dcp
    from PIL import Image
    out = runs["combo"][0]
    keys = dcp.FileSystemReader(os.path.join(out, "checkpoints", "step_000003")).read_metadata().state_dict_metadata
    assert any(k.startswith("model.ema.") for k in keys) and any(k.startswith("model.transformer.") for k in keys)
    for step in (2, 3):
        with Image.open(os.path.join(out, "samples", f"step_{step:06d}.png")) as im:
            # 2 held-out pairs (64x64 and 48x96) -> rows of 3 tiles padded to 64x96
            assert im.size == (3 * 96, 2 * 64)
    assert not os.path.exists(os.path.join(runs["ref"][0], "samples"))  # SAMPLE_EVERY=0: none


@pytest.mark.slow
def test_export_runs_in_flux_kontext_pipeline(runs):
    from diffusers import FluxKontextPipeline
    from PIL import Image
    pipe = FluxKontextPipeline.from_pretrained(os.path.join(runs["combo"][0], "export"), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    image = Image.new("RGB", (64, 64), (200, 50, 50))
    out = pipe(image=image, prompt="make the square blue", height=64, width=64, max_area=64 * 64,
               _auto_resize=False, num_inference_steps=2, max_sequence_length=32, output_type="pt",
               generator=torch.Generator().manual_seed(0)).images
    assert out.shape == (1, 3, 64, 64) and torch.isfinite(out).all()
    trained = load_export(runs["combo"][0])
    assert all(torch.equal(v, trained[k]) for k, v in pipe.transformer.state_dict().items())


@pytest.mark.slow
def test_export_names_the_diffusers_class_and_loads_with_automodel(runs):
    assert_loads_with_automodel(os.path.join(runs["combo"][0], "export", "transformer"))


@pytest.mark.slow
def test_bad_row_stops_all_ranks_with_file_and_line(kontext_setup, tmp_path):
    lines = open(kontext_setup["data"]).read().splitlines()
    lines[2] = '{"image": "context/002.png", "target": '  # truncated JSON on line 3
    bad = os.path.join(os.path.dirname(kontext_setup["data"]), "bad.jsonl")  # beside the images it names
    with open(bad, "w") as f:
        f.write("\n".join(lines) + "\n")
    proc = launch_kontext(kontext_setup, tmp_path / "out", [f"--data_path={bad}"], ranks=2, check=False)
    assert proc.returncode != 0
    errors = [line for line in proc.stdout.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {bad}:3: not valid JSON (Expecting value)"], proc.stdout[-2000:]


# ----------------------------------------------------------------------------------------------
# helpers, in process


def test_missing_target_image_is_named_or_skipped(kontext_setup, tmp_path):
    rows = [dict(r) for r in kontext_setup["rows"]]
    rows[4]["target"] = "target/nope.png"
    base = os.path.dirname(kontext_setup["data"])
    for r in rows:
        r["image"], r["target"] = os.path.join(base, r["image"]), os.path.join(base, r["target"])
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ConfigError, match=rf"{re.escape(str(path))}:5: image .*nope.png not found"):
        tfk.load_data(str(path), 2, 64, [1.0, 2.0], 16, skip_bad=False)
    train, held_out, _, _ = tfk.load_data(str(path), 2, 64, [1.0, 2.0], 16, skip_bad=True)
    assert len(train) == 13 and len(held_out) == 2


def test_buckets_keep_each_global_batch_on_one_size():
    buckets = db.make_buckets(64, [0.5, 0.75, 1.0, 1.333, 2.0], 16)
    assert buckets[2] == (64, 64) and (48, 96) in buckets and all(h % 16 == 0 == w % 16 for h, w in buckets)
    assert buckets[db.nearest_bucket(48, 96, buckets)] == (48, 96)
    assert buckets[db.nearest_bucket(480, 640, buckets)] == (48, 80)
    bucket_of = [0, 1, 1, 0, 2, 1, 0, 0, 1, 2, 2, 1, 0]
    members, schedule = db.bucket_schedule(bucket_of, 60, seed=3)
    seen = set()
    for step in range(60):
        idx = db.step_indices(step, members, schedule, 4, seed=3)
        assert len(idx) == 4 and len({bucket_of[i] for i in idx}) == 1
        seen |= set(idx)
    assert seen == set(range(len(bucket_of)))  # every pair gets trained on
    # a pure function of (seed, step): a shorter schedule is a prefix (resume), another seed differs
    assert db.bucket_schedule(bucket_of, 20, seed=3)[1] == schedule[:20]
    assert db.bucket_schedule(bucket_of, 60, seed=4)[1] != schedule


def test_pair_gets_one_resize_and_flip(kontext_setup):
    raw = kontext_setup["rows"][5]  # this project's older naming: "image" is the input (control)
    row = {
        k: os.path.join(os.path.dirname(kontext_setup["data"]), raw[j])
        for k, j in (("control", "image"), ("target", "target"))
    }
    [context], target = db.load_pairs([row, row], ((64, 64), ((64, 64),)), [False, True])
    assert context.shape == target.shape == (2, 3, 64, 64)
    assert torch.equal(context[1], context[0].flip(-1)) and torch.equal(target[1], target[0].flip(-1))
    # the 96x48 rectangle is centred: the same resize keeps it centred in both images
    assert torch.equal((context[0] != context[0, :, :1, :1]).any(0), (target[0] != target[0, :, :1, :1]).any(0))


def test_text_cache_key_depends_on_encoder_settings(kontext_setup):
    ids = {
        tfk.encoder_identity(kontext_setup["model_path"], n, dt)
        for n in (32, 16)
        for dt in (torch.float32, torch.bfloat16)
    }
    assert len(ids) == 4
    a = tfk.cache_file("/c", ids.pop(), "make it red")
    assert a != tfk.cache_file("/c", ids.pop(), "make it red")


def test_config_errors_before_any_work(monkeypatch):
    saved = script_constants(vars(tfk))
    try:
        for argv, message in ((["--dp_replicate=2"], "does not divide"),
                              (["--weighting_scheme=cosine"], "WEIGHTING_SCHEME in"),
                              (["--precision=fp16-mixed"], "not a precision mode"),
                              (["--max_stepz=3"], "did you mean --max_steps")):
            monkeypatch.setattr(sys, "argv", ["train_flux_kontext.py"] + argv)
            with pytest.raises(ConfigError, match=message):
                tfk.main()
            vars(tfk).update(saved)
    finally:
        vars(tfk).update(saved)


def test_fsdp_transformer_matches_plain_model(kontext_setup, tmp_path):
    """FSDP2 with activation checkpointing (world of one) gives the plain model's loss and grads:
    FLUX blocks returning views (FSDP2 warns about it) do not lose gradient hooks."""
    import torch.distributed as dist
    from diffusers import FluxTransformer2DModel
    from precision import get_precision
    from algorithms import flux_kontext as km
    folder = os.path.join(kontext_setup["model_path"], "transformer")
    g = torch.Generator().manual_seed(0)
    x0, ctx, noise = (torch.randn(2, 4, 8, 8, generator=g) for _ in range(3))
    sigmas = torch.rand(2, generator=g)
    text = torch.randn(2, 32, 32, generator=g), torch.randn(2, 32, generator=g)
    inputs = km.build_model_inputs(x0, ctx, noise, sigmas)

    def loss_and_grads(model, named):
        loss = km.flow_matching_loss(km.transformer_forward(model, inputs, sigmas, 1.0, *text),
                                     inputs["target"], inputs["n_target_tokens"])
        loss.backward()
        return loss.item(), {k: getattr(p.grad, "full_tensor", lambda: p.grad)() for k, p in named}

    plain = FluxTransformer2DModel.from_pretrained(folder)
    ref_loss, ref_grads = loss_and_grads(plain, plain.named_parameters())
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        quiet_known_warnings()
        mesh = fsdp_utils.build_meshes(torch.device("cpu"), 1)[0]
        sharding = fsdp_utils.Sharding(reshard_after_forward=True, activation_checkpointing=True, prefetch=1)
        sharded = flux.build_transformer(folder, mesh, get_precision("fp32"), torch.device("cpu"), load=True,
                                        sharding=sharding, block_classes=[], lora=lora.Lora(), seed=0)
        loss, grads = loss_and_grads(sharded, sharded.named_parameters())
    finally:
        dist.destroy_process_group()
    assert abs(loss - ref_loss) < 1e-6
    assert grads.keys() == ref_grads.keys()
    for k in grads:
        torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.slow
def test_tensorboard_equals_metrics_and_validation_loss_is_logged(runs):
    pytest.importorskip("tensorboard")
    for name, steps in (("combo", [1, 2, 3]), ("resumed", [3])):  # the resumed run continues at step 3
        rows = read_metrics(runs[name][0])
        files = os.listdir(os.path.join(runs[name][0], "tensorboard"))
        assert len(files) == 1, files  # one event file per run
        scalars = tensorboard_scalars(runs[name][0])
        assert [s for s, _ in scalars["loss"]] == steps
        for r in rows:
            for k, v in r.items():
                if k != "step":
                    assert (r["step"], pytest.approx(v, rel=1e-6)) in scalars[k], (name, k, r)
    val = [r for r in read_metrics(runs["combo"][0]) if "val_loss" in r]
    assert [r["step"] for r in val] == [2] and 0 < val[0]["val_loss"] < 10


@pytest.mark.slow
def test_no_third_party_nag_lines(runs):
    for _, stdout in runs.values():
        for nag in ("torchvision", "accelerate", "Loading weights", "low_cpu_mem_usage"):
            assert nag not in stdout, nag


# ----------------------------------------------------------------------------------------------
# your own data: the folder layout, VAL_DATA_PATH, SAMPLE_PROMPTS, CAPTION_DROPOUT


def _as_toolkit_folder(kontext_setup, root):
    """The mixed dataset re-laid out as ai-toolkit reads it: targets with .txt captions, controls apart."""
    base = os.path.dirname(kontext_setup["data"])
    for i, r in enumerate(kontext_setup["rows"]):
        os.makedirs(root / "targets", exist_ok=True)
        os.makedirs(root / "controls", exist_ok=True)
        shutil.copy(os.path.join(base, r["target"]), root / "targets" / f"{i:03d}.png")
        shutil.copy(os.path.join(base, r["image"]), root / "controls" / f"{i:03d}.png")
        (root / "targets" / f"{i:03d}.txt").write_text(r["prompt"])
    return root / "targets", root / "controls"


def test_folder_layout_reads_the_same_pairs_as_the_jsonl(kontext_setup, tmp_path):
    targets, controls = _as_toolkit_folder(kontext_setup, tmp_path)
    a = tfk.load_data(kontext_setup["data"], 2, 64, tfk.BUCKET_ASPECTS, 16, False)
    b = tfk.load_data(str(targets), 2, 64, tfk.BUCKET_ASPECTS, 16, False, control_path=str(controls))
    assert [r["prompt"] for r in a[0]] == [r["prompt"] for r in b[0]] and a[2:] == b[2:]  # same buckets
    for ra, rb in zip(a[0] + a[1], b[0] + b[1]):
        assert open(ra["target"], "rb").read() == open(rb["target"], "rb").read()
        assert open(ra["control"], "rb").read() == open(rb["control"], "rb").read()
    val = tmp_path / "val.jsonl"
    val.write_text(
        "".join(
            json.dumps(
                {"control": str(controls / f"{i:03d}.png"), "target": str(targets / f"{i:03d}.png"), "prompt": "held"}
            )
            + "\n"
            for i in range(3)
        )
    )
    train, held_out, _, _ = tfk.load_data(str(targets), 2, 64, tfk.BUCKET_ASPECTS, 16, False,
                                          control_path=str(controls), val_path=str(val))
    assert len(train) == 16 and [r["prompt"] for r in held_out] == ["held", "held"]  # VAL_DATA_PATH's first 2


@pytest.mark.slow
def test_own_data_run_with_val_data_sample_prompts_and_caption_dropout(kontext_setup, tmp_path):
    """One process, 2 steps: a folder of targets, VAL_DATA_PATH, SAMPLE_PROMPTS without targets and
    CAPTION_DROPOUT (the empty prompt's embedding must be in the text cache, or the step fails)."""
    targets, controls = _as_toolkit_folder(kontext_setup, tmp_path)
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps({"source": f"controls/{i:03d}.png", "edited": f"targets/{i:03d}.png",
                                       "prompt": "make it so"}) + "\n" for i in range(2)))
    samples = tmp_path / "samples.jsonl"
    samples.write_text("".join(json.dumps({"control": f"controls/{i:03d}.png", "prompt": p}) + "\n"
                               for i, p in enumerate(["make the square red", "make the square blue", ""])))
    dropped = [captions_dropped(s) for s in (1, 2)]
    assert any("" in d for d in dropped)  # these settings do drop a caption in the run
    out = tmp_path / "out"
    proc = launch_kontext(
        kontext_setup,
        out,
        [
            f"--data_path={targets}",
            f"--control_path={controls}",
            f"--val_data_path={val}",
            f"--sample_prompts={samples}",
            "--caption_dropout=0.5",
            "--max_steps=2",
            "--sample_every=2",
            "--val_every=2",
            "--batch_size=2",
            f"--text_cache_dir={tmp_path / 'tc'}",
        ],
        ranks=1,
    )
    log = proc.stdout
    assert "held out for samples and validation (the first of VAL_DATA_PATH=" in log, log[-3000:]
    assert f"samples: 3 prompts from SAMPLE_PROMPTS={samples}" in log
    assert "text cache: 20 unique prompts" in log  # 16 training + "make it so" + 2 sample prompts + ""
    from PIL import Image
    with Image.open(out / "samples" / "step_000002.png") as grid:
        assert grid.size == (3 * 96, 3 * 64)  # 3 rows of control | output | (grey: no target), tiles padded to 64 x 96
    assert [r["step"] for r in read_metrics(out) if "val_loss" in r] == [2]


def captions_dropped(step):
    from data.randomness import drop_captions
    return drop_captions(["x", "y"], 0, step, [0, 1], 0.5)


# ----------------------------------------------------------------------------------------------
# CACHE_LATENTS: the pairs encoded once, then read back instead of running the VAE in the step


def _latent_counts(stdout):
    m = re.search(r"latent cache: (\d+) pairs, computed (\d+), reused (\d+)", stdout)
    return tuple(int(g) for g in m.groups()) if m else None


def test_latent_cache_key_holds_every_images_size(tmp_path):
    """A pair's cache file changes with its target size and with any reference's size (REFERENCE_AREA), so a
    second run at another reference area encodes again instead of reading latents of the wrong shape."""
    from PIL import Image
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    row = {"control": str(tmp_path / "a.png"), "target": str(tmp_path / "a.png"), "prompt": "p"}
    files = {shape: tfk.latent_file(str(tmp_path), "id", row, shape)
             for shape in [((64, 64), ((64, 64),)), ((64, 64), ((32, 32),)), ((32, 32), ((64, 64),))]}
    assert len(set(files.values())) == 3
    assert tfk.latent_file(str(tmp_path), "id", row, ((64, 64), ((64, 64),))) == files[((64, 64), ((64, 64),))]


@pytest.mark.slow
def test_cached_latents_train_exactly_as_the_vae_in_the_step(kontext_setup, tmp_path):
    """At one pair per micro-batch the cache's one-image encodes are the step's own: the losses
    and grad norms are bit-identical. The second run (2 ranks, the same cache) encodes nothing.
    It trains beside the plain run, once the cached run has filled both caches."""
    cache = [f"--text_cache_dir={tmp_path / 'tc'}", "--batch_size=1", "--sample_every=0", "--val_every=0"]
    cached = launch_kontext(kontext_setup, tmp_path / "cached", cache + ["--cache_latents=1"], ranks=1)
    side_by_side = launch_all({"plain": kontext_run(kontext_setup, tmp_path / "plain", cache, 1),
                               "again": kontext_run(kontext_setup, tmp_path / "again", cache + ["--cache_latents=1"])})
    plain, again = side_by_side["plain"], side_by_side["again"]
    n = len(kontext_setup["rows"]) - 2  # the last NUM_SAMPLE_PAIRS rows are held out
    assert _latent_counts(cached.stdout) == (n, n, 0), cached.stdout[-3000:]
    assert _latent_counts(plain.stdout) is None
    a, b = read_metrics(tmp_path / "plain", timing=False), read_metrics(tmp_path / "cached", timing=False)
    assert [(r["loss"], r["grad_norm"]) for r in a] == [(r["loss"], r["grad_norm"]) for r in b]
    assert _latent_counts(again.stdout) == (n, 0, n), again.stdout[-3000:]
    assert len(read_metrics(tmp_path / "again")) == KONTEXT_STEPS


@pytest.mark.slow
def test_cached_latents_refuse_random_flips_in_one_line(kontext_setup, tmp_path):
    proc = launch_kontext(kontext_setup, tmp_path / "o", ["--cache_latents=1", "--random_flip=1"], ranks=1,
                          check=False)
    errors = [line for line in proc.stdout.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "CACHE_LATENTS with RANDOM_FLIP" in errors[0], proc.stdout
