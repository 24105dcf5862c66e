"""ZImageOmniPipeline in train_dmd.py (families/z_image/omni.py), on the tiny Omni folder (64 px references, a 32 px
target: 4 x 4 latents) and its two-reference edits.

Conditioning equals ZImageOmniPipeline's own tensors: the cached text is _encode_prompt's segments at the row's
reference count (the negative "" too), each reference is read, cut and VAE-encoded as prepare_image_latents does
(bf16 into the VAE), the SigLIP features are prepare_siglip_embeds' of the uncut image, the transformer gets the
pipeline's omni-mode inputs (a forward pre-hook's capture) and the room's teacher velocity in the pipeline's scheduler
loop gives its latents, with 0 (a prompt alone), 1 and 2 references. The run: DMD2 (1 process, 2 steps, LoRA)
exports a LoRA that ZImageOmniPipeline loads with load_lora_weights and samples with. Refusals are one line. The
two-reference demo's task through ZImageOmniPipeline on the shipped base (demos/z_image_edit_eval.py), whose VAE stage
rebuilds the shipped VAE (demos/make_z_image_edit_base.py).

    python -m pytest tests/test_z_image_omni.py -q
"""
from __future__ import annotations

import functools
import inspect
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import families
from algorithms import flux_kontext as km
from core.errors import ConfigError
from data.images import load_pil
from families import z_image
from families.z_image import omni
from tests.conftest import (assert_kontext_resumed_bit_exact, assert_metrics_match, launch, launch_all_resuming,
                            launch_env, read_metrics, tiny_default)

SIZE = 32
SETTINGS = {"RESOLUTION": SIZE, "MAX_SEQUENCE_LENGTH": 512, "USE_GAN": False, "FLUX_GUIDANCE": 0.0,
            "REAL_GUIDANCE_SCALE": 0.0, "REAL_GUIDANCE_NORM": "", "BUCKET_ASPECTS": [1.0], "VAE_DTYPE": "bf16",
            "PRECISION": "fp32", "PIPELINE": omni.PIPELINE}


@pytest.fixture(scope="module")
def tiny():
    model, data = tiny_default("z_image_omni")
    with open(os.path.join(data, "data.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    rows = [{**r, "controls": [os.path.join(data, c) for c in r["control"]]} for r in rows]
    return {"model": model, "data": data, "rows": rows, "settings": {**SETTINGS, "MODEL_PATH": model}}


@functools.lru_cache(maxsize=1)
def pipeline(model):
    from diffusers import ZImageOmniPipeline
    pipe = ZImageOmniPipeline.from_pretrained(model)
    pipe.vae.to(torch.bfloat16)  # the pipeline encodes references in bf16 whatever the VAE's dtype
    pipe.set_progress_bar_config(disable=True)
    return pipe


def cached(tiny, tmp_path, pairs):
    identity = z_image.prepare_edit_text(pairs, tiny["model"], str(tmp_path / "tc"), tiny["settings"], torch.float32,
                                         torch.device("cpu"))
    return z_image.load_text(pairs, str(tmp_path / "tc"), identity, torch.device("cpu"))


@pytest.mark.slow
def test_text_references_and_siglip_are_the_pipelines(tiny, tmp_path):
    """The cache holds _encode_prompt's segments at each row's reference count (n + 2 with n references, each
    masked on its own; the negative "" the same way); each reference is the pipeline's cut image, its latents
    prepare_image_latents' (bf16 into the VAE), its SigLIP features prepare_siglip_embeds' of the uncut image;
    a reference over 1024^2 px is downsized as _resize_to_target_area, then cut as preprocess(resize_mode="crop");
    the start-up attention check's shapes count the omni sequence's parts."""
    from PIL import Image
    pipe = pipeline(tiny["model"])
    one, two = {"controls": tiny["rows"][0]["controls"][:1]}, tiny["rows"][1]
    pairs = [(two["prompt"], one), (two["prompt"], two), ("", one), ("", two)]
    ours = cached(tiny, tmp_path, pairs)
    with torch.no_grad():
        for (prompt, row), segments, feats in zip(pairs, ours.segments, ours.siglip):
            n = len(row["controls"])
            theirs, _ = pipe.encode_prompt([prompt], do_classifier_free_guidance=False, num_condition_images=n)
            assert len(segments) == n + 2 and all(torch.equal(a, b) for a, b in zip(segments, theirs[0]))
            images = [load_pil(s) for s in row["controls"]]
            sig = pipe.prepare_siglip_embeds(images, 1, torch.device("cpu"), torch.float32)[0]
            assert len(feats) == n and all(torch.equal(a, b) for a, b in zip(feats, sig))
            cut = [pipe.image_processor.preprocess(im, height=64, width=64, resize_mode="crop") for im in images]
            latents = pipe.prepare_image_latents(cut, 1, torch.device("cpu"), torch.float32)[0]
            mine = [omni.encode_reference(pipe.vae, omni.load_image(s)) for s in row["controls"]]
            assert all(torch.equal(a, b) for a, b in zip(mine, latents)) and mine[0].shape == (4, 1, 8, 8)
    big = tmp_path / "big.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (1000, 1100, 3), dtype=np.uint8)).save(big)
    resized = pipe.image_processor._resize_to_target_area(Image.open(big), 1024 * 1024)
    assert np.array_equal(np.asarray(omni.resized_image(str(big))), np.asarray(resized))
    h, w = resized.height // 16 * 16, resized.width // 16 * 16
    want = pipe.image_processor.preprocess(resized, height=h, width=w, resize_mode="crop")[0]
    assert torch.equal(omni.load_image(str(big)), want)
    assert omni.reference_sizes((SIZE, SIZE), {"controls": [str(big)]}, tiny["settings"]) == ((h, w),)
    trained, vae = z_image.edit_attention_shapes(tiny["model"], tiny["settings"], [((SIZE, SIZE), ((64, 64),) * 2)],
                                                 1, 1)
    # the images' tokens (4 + 16 + 16, each padded to 32), 4 caption segments of at most 512, 2 x 16 SigLIP + 32
    assert [(s.what, s.q_len) for s in trained] == [("noise refiner at 32x32 + 2 references", 96),
                                                    ("context refiner", 2048), ("SigLIP refiner", 96),
                                                    ("main blocks at 32x32", 2240)]
    assert [(s.q_len, s.backward) for s in vae] == [(16, False)]


def captured_calls(model, run):
    """run() with a forward pre-hook on `model`: each call's arguments by name."""
    seen = []
    hook = model.register_forward_pre_hook(
        lambda m, a, kw: seen.append(dict(inspect.signature(m.forward).bind(*a, **kw).arguments)), with_kwargs=True)
    try:
        out = run()
    finally:
        hook.remove()
    return out, seen


def assert_same(a, b):
    if isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, torch.Tensor):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    else:
        assert a == b


@pytest.mark.slow
@pytest.mark.parametrize("count", [0, 1, 2])
def test_transformer_inputs_and_sampling_loop_are_the_pipelines(tiny, tmp_path, count):
    """The room's teacher velocity (w = 6, REAL_GUIDANCE_NORM=scalar: the pipeline's guidance_scale 5 with
    cfg_normalization) in the pipeline's scheduler loop, from its noise, gives its latents; at every step the
    transformer gets what the pipeline gives it (x = references + [target], the noise mask, the caption segments
    of the prompt and of "", the SigLIP lists + [None], the timestep 1 - σ), the CFG pair in one call. A prompt
    alone (a .txt's rows) is the pipeline without images: one segment, the target alone, no SigLIP."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.z_image.pipeline_z_image_omni import get_default_z_image_sigmas
    from diffusers.utils.torch_utils import randn_tensor
    pipe = pipeline(tiny["model"])
    row = {"prompt": tiny["rows"][2]["prompt"], "controls": tiny["rows"][2]["controls"][:count]}
    images = [load_pil(s) for s in row["controls"]]
    theirs, seen = captured_calls(pipe.transformer, lambda: pipe(
        image=images or None, prompt=row["prompt"], height=SIZE, width=SIZE, num_inference_steps=2,
        cfg_normalization=True, generator=torch.Generator().manual_seed(0), output_type="latent").images)
    text = cached(tiny, tmp_path, [(row["prompt"], row), ("", row)])
    refs = [omni.load_image(s)[None] for s in row["controls"]]
    cond = z_image.dmd_cond(text[:1], text[1:], pipe.vae, refs, (4, 4))
    v = cond.velocity(pipe.transformer, 6.0, "scalar")
    x = randn_tensor((1, 4, 4, 4), generator=torch.Generator().manual_seed(0), dtype=torch.float32)
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config)
    scheduler.set_timesteps(sigmas=get_default_z_image_sigmas(2))

    def loop(x):
        with torch.no_grad():
            for sigma, t in zip(scheduler.sigmas, scheduler.timesteps):
                x = scheduler.step(km.unpack_latents(v(km.pack_latents(x), sigma.reshape(1)), 4, 4), t, x,
                                   return_dict=False)[0]
        return x
    ours, mine = captured_calls(pipe.transformer, lambda: loop(x))
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert len(seen) == len(mine) == 2
    for a, b in zip(mine, seen):
        assert b["image_noise_mask"] == [[0] * count + [1]] * 2
        assert len(b["cap_feats"][0]) == (count + 2 if count else 1)
        assert (b["siglip_feats"] == [None] * 2 if count == 0 else
                b["siglip_feats"][0][-1] is None and len(b["siglip_feats"][0]) == count + 1)
        for key in ("x", "t", "cap_feats", "siglip_feats", "image_noise_mask"):
            assert_same(a[key], b[key])


def test_refusals_are_one_line():
    """What an Omni teacher does not take, refused in one line before any work: a VAE other than bf16 (the pipeline
    encodes references in bf16), the GAN, a guidance embedding, a per-token rescale, REFERENCE_AREA and
    CONDITION_AREA; a reference the pipeline refuses (a side under 64 px)."""
    settings = SETTINGS
    cases = [({"VAE_DTYPE": ""}, set(), "VAE_DTYPE= with a ZImageOmniPipeline teacher: a fp32 VAE"),
             ({"VAE_DTYPE": "fp32", "PRECISION": "bf16-mixed"}, set(), "use VAE_DTYPE=bf16"),
             ({"USE_GAN": True}, set(), "USE_GAN=True with a ZImageOmniPipeline teacher"),
             ({"FLUX_GUIDANCE": 3.5}, {"FLUX_GUIDANCE"}, "no guidance embedding"),
             ({"REAL_GUIDANCE_NORM": "token"}, set(), "no per-token rescale"),
             ({"REFERENCE_AREA": 4096}, {"REFERENCE_AREA"}, "downsizes references over 1024^2 px"),
             ({"CONDITION_AREA": 4096}, {"CONDITION_AREA"}, "reads no image")]
    for change, changed, words in cases:
        with pytest.raises(ConfigError, match=re.escape(words)) as e:
            z_image.check_dmd_settings(omni.PIPELINE, {**settings, **change}, changed, "jsonl")
        assert "\n" not in str(e.value)
    z_image.check_dmd_settings(omni.PIPELINE, {**settings, "VAE_DTYPE": "", "PRECISION": "bf16-mixed"}, set(), "")
    with pytest.raises(ConfigError, match="a 48x64 px reference, which ZImageOmniPipeline refuses") as e:
        z_image.reference_sizes((SIZE, SIZE), {"controls": ["a.png"], "control_sizes": [(64, 48)]}, settings)
    assert "\n" not in str(e.value)
    assert z_image.reference_sizes((SIZE, SIZE), {"controls": ["a", "b"], "control_sizes": [(64, 80), (2048, 1024)]},
                                   settings) == ((64, 80), (1440, 720))
    assert z_image.edits(omni.PIPELINE) and not z_image.edits("ZImagePipeline")
    assert families.FAMILIES[omni.PIPELINE] is z_image


@pytest.mark.slow
def test_dmd_lora_export_loads_in_the_omni_pipeline_and_samples(tiny, tmp_path):
    """DMD2 of the Omni teacher on two-reference edits (1 process, 2 steps, LoRA generator and fake score, a sample
    grid): finite losses, the log names the references' tokens; the LoRA export loads in ZImageOmniPipeline with
    load_lora_weights and samples from the two references at guidance_scale=0 at the trained σ."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImageOmniPipeline
    out = tmp_path / "lora"
    done = launch("train_dmd.py", [
        f"--model_path={tiny['model']}", f"--data_path={tiny['data']}/data.jsonl", f"--output_dir={out}",
        f"--text_cache_dir={tmp_path / 'text_cache'}", "--precision=fp32", "--vae_dtype=bf16", f"--resolution={SIZE}",
        "--max_steps=2", "--log_every=1", "--denoising_steps=999,499", "--batch_size=1", "--sample_count=1",
        "--dfake_gen_update_ratio=2", "--save_every=0", "--sample_every=2", "--export_dtype=fp32", "--lora_rank=4",
        "--fake_lora=1", "--generator_lr=1e-3", "--guidance_lr=1e-3"], ranks=1, env=launch_env())
    records = read_metrics(out, timing=False)
    assert len(records) == 2 and all(np.isfinite(r["loss_fake"]) for r in records)
    assert "32x32 px (1 shape(s)), 4 target + 16 reference + 16 reference tokens" in done.stdout
    assert (out / "samples" / "step_000002.png").exists()
    pipe = ZImageOmniPipeline.from_pretrained(tiny["model"])
    base = pipe.transformer.layers[0].attention.to_q.weight.clone()
    pipe.load_lora_weights(str(out / "export"))
    pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(str(out / "export"), subfolder="scheduler")
    pipe.vae.to(torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    assert "lora" in type(pipe.transformer.layers[0].attention.to_q).__module__ or \
        not torch.equal(pipe.transformer.layers[0].attention.to_q.weight, base)
    image, seen = captured_calls(pipe.transformer, lambda: pipe(
        image=[load_pil(s) for s in tiny["rows"][0]["controls"]], prompt=tiny["rows"][0]["prompt"], height=SIZE,
        width=SIZE, num_inference_steps=2, guidance_scale=0.0, generator=torch.Generator().manual_seed(0),
        output_type="np").images)
    assert np.isfinite(image).all() and image.shape == (1, SIZE, SIZE, 3)
    assert [float(c["t"][0]) for c in seen] == pytest.approx([0.0, 0.5], abs=1e-6)


# ----------------------------------------------------------------------------------------------
# fine-tuning on Omni edit rows (train_flux_kontext.py)

FT_SETTINGS = {**SETTINGS, "GUIDANCE": 1.0, "SAMPLE_GUIDANCE": 4.0, "REFERENCE_AREA": 0, "RANDOM_FLIP": False,
               "CONDITION_AREA": 0}


def assert_equal(a, b):
    """Nested lists of tensors (or None, ints) equal value for value, dtype and shape."""
    if isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_equal(x, y)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    else:
        assert a == b


@pytest.mark.slow
@pytest.mark.parametrize("count", [1, 2])
def test_fine_tuning_inputs_and_samples_are_the_pipelines(tiny, tmp_path, count):
    """An edit row with `count` references as train_flux_kontext.py reads it (the room's image loader at the row's
    shape, the references encoded as the script encodes them, the cached segments and SigLIP features): at σ = 1 the
    room's forward hands the transformer what ZImageOmniPipeline hands it for the same noise (x = the references +
    [the target], the noise mask, the caption segments, the SigLIP lists + [None], the timestep), and the velocity is
    its output negated; the room's sample with CFG against "" at guidance_scale 4 is the pipeline's image."""
    from diffusers.utils.torch_utils import randn_tensor
    pipe, settings = pipeline(tiny["model"]), {**tiny["settings"], **FT_SETTINGS, "MODEL_PATH": tiny["model"]}
    row = {"prompt": tiny["rows"][3]["prompt"], "controls": tiny["rows"][3]["controls"][:count]}
    theirs, seen = captured_calls(pipe.transformer, lambda: pipe(
        image=[load_pil(s) for s in row["controls"]], prompt=row["prompt"], height=SIZE, width=SIZE,
        num_inference_steps=1, guidance_scale=4.0, generator=torch.Generator().manual_seed(0), output_type="pt").images)
    text = cached(tiny, tmp_path, [(row["prompt"], row), ("", row)])
    read, sizes = z_image.image_loader(settings), z_image.reference_sizes((SIZE, SIZE), row, settings)
    pixels = [read(c, s, False, "reference")[None] for c, s in zip(row["controls"], sizes)]
    noise = randn_tensor((1, 4, 4, 4), generator=torch.Generator().manual_seed(0), dtype=torch.float32)
    with torch.no_grad():
        inputs = z_image.model_inputs(torch.zeros_like(noise), [z_image.encode_references(pipe.vae, p) for p in pixels],
                                      noise, torch.ones(1))
        pred, mine = captured_calls(pipe.transformer, lambda: z_image.forward(
            pipe.transformer, inputs, torch.ones(1), 1.0, z_image.text_row(text, 0)))
        ours, sampled = captured_calls(pipe.transformer, lambda: z_image.sample(
            (pipe.scheduler, pipe.transformer), pipe.vae, pixels, text[:1], (SIZE, SIZE), 1, 4.0,
            torch.Generator().manual_seed(0), negative=text[1:]))
        out = pipe.transformer(**{k: mine[0][k] for k in ("x", "t", "cap_feats", "siglip_feats", "image_noise_mask")},
                               return_dict=False)[0][0]
    (call,) = seen
    assert len(call["x"]) == 2 and call["image_noise_mask"] == [[0] * count + [1]] * 2
    for key in ("x", "t", "cap_feats", "siglip_feats", "image_noise_mask"):
        assert_equal(mine[0][key], [call[key][0]] if key != "t" else call[key][:1])
        assert_equal(sampled[0][key], call[key])
    assert len(call["cap_feats"][0]) == count + 2 and call["siglip_feats"][0][-1] is None
    assert torch.equal(pred, km.pack_latents(-out.float().squeeze(1)[None]))
    # the pipeline decodes in its bf16 VAE and post-processes in that dtype; decode_latents hands back fp32
    assert torch.equal(pipe.image_processor.postprocess(ours[None].to(theirs.dtype), output_type="pt"), theirs)


def edit_rows(tiny, root, count=None) -> str:
    """The tiny Omni edits as a .jsonl (absolute paths): every other row with its first reference alone (one and two
    references per row), or every row cut to `count`."""
    rows = []
    for i, row in enumerate(tiny["rows"]):
        controls = row["controls"][:count or (1 if i % 2 else 2)]
        rows.append({"control": controls, "target": os.path.join(tiny["data"], row["target"]), "prompt": row["prompt"]})
    path = root / f"edits{count or ''}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_fine_tuning_refusals_are_one_line(tmp_path):
    """What fine-tuning on Omni rows does not take, refused in one line before any work: a VAE other than bf16,
    REFERENCE_AREA, BUCKET_ASPECTS (each image keeps its ratio), RANDOM_FLIP (the SigLIP features are cached
    unflipped), a guidance embedding; a .jsonl mixing edit rows and rows without a reference. The Omni folder reads up
    to 4 references a row."""
    from PIL import Image

    import train_flux_kontext as tfk
    settings = {**FT_SETTINGS, "PIPELINE": omni.PIPELINE}
    cases = [({"VAE_DTYPE": "fp32"}, set(), "VAE_DTYPE=fp32: a fp32 VAE"),
             ({"REFERENCE_AREA": 4096}, {"REFERENCE_AREA"}, "REFERENCE_AREA=4096: ZImageOmniPipeline downsizes"),
             ({"BUCKET_ASPECTS": [1.0, 2.0]}, {"BUCKET_ASPECTS"}, "keeps the target's and each reference's own ratio"),
             ({"RANDOM_FLIP": True}, set(), "RANDOM_FLIP=True: the references' SigLIP features are cached"),
             ({"GUIDANCE": 3.5}, set(), "GUIDANCE=3.5: Z-Image has no guidance embedding")]
    for change, changed, words in cases:
        with pytest.raises(ConfigError, match=re.escape(words)) as e:
            z_image.check_edit_settings("", {**settings, **change}, changed)
        assert "\n" not in str(e.value)
    z_image.check_edit_settings("", settings, {"MAX_REFERENCES", "CONTROL_PATH"})
    assert tfk.reference_limit(z_image, omni.PIPELINE) == 4
    for name in ("a", "b", "t"):
        Image.new("RGB", (64, 64)).save(tmp_path / f"{name}.png")
    rows = [{"control": ["a.png", "b.png"], "target": "t.png", "prompt": "p"}] * 3 + [{"image": "t.png", "prompt": "p"}]
    (tmp_path / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ConfigError, match=r"mixed.jsonl:4: a row without a reference image among rows with one "
                                          r"\(line 1\): a run trains edits or text to image, not both") as e:
        tfk.load_data(str(tmp_path / "mixed.jsonl"), 0, SIZE, [1.0], 16, False, room=z_image, max_references=4)
    assert "\n" not in str(e.value)


@pytest.fixture(scope="module")
def ft_runs(tiny, tmp_path_factory):
    """Fine-tuning on the Omni edits (one and two references per row): LoRA (validation, samples with CFG at
    guidance_scale 4) on 2 ranks, the same in one process (GRAD_ACCUM=2: each sample in a call of its own, as on a
    rank; a batch of two pads the shorter caption, which moves fp32 sums), the 2-rank run resumed from its step-2
    checkpoint; a full fine-tune on 2 ranks from cached latents (CACHE_LATENTS)."""
    root = tmp_path_factory.mktemp("z_image_omni_ft")
    data = edit_rows(tiny, root)
    # every run reads one cache, filled here: the runs' own fills would race, each batching other prompts together
    rows = [{**r, "controls": r["control"]} for r in map(json.loads, open(data))]
    z_image.prepare_edit_text([(p, r) for r in rows for p in (r["prompt"], "")], tiny["model"],
                              str(root / "text_cache"), {**tiny["settings"], "PIPELINE": omni.PIPELINE}, torch.float32,
                              torch.device("cpu"))
    common = [f"--model_path={tiny['model']}", f"--data_path={data}",
              f"--text_cache_dir={root / 'text_cache'}", "--precision=fp32", "--vae_dtype=bf16", f"--resolution={SIZE}",
              "--max_steps=4", "--log_every=1", "--num_sample_pairs=2", "--lr=1e-3", "--warmup_steps=0",
              "--export_dtype=fp32", "--sample_steps=2", "--sample_guidance=4", "--seed=1", "--lora_rank=4",
              "--save_every=2", "--val_every=2", "--sample_every=4"]
    out = {k: root / k for k in ("lora", "one", "stopped", "full")}
    # each run at 2 threads: a bf16 convolution over the references' channels-last pixels (the pipeline's layout)
    # rounds by its thread count, which the scripts set per rank from the CPUs (core/launch.cpu_threads)
    env = {**launch_env(), "OMP_NUM_THREADS": "2"}
    job = functools.partial(dict, script="train_flux_kontext.py", env=env)
    full = [a for a in common if a != "--lora_rank=4"] + [f"--output_dir={out['full']}", "--cache_latents=1",
                                                          "--save_every=0", "--val_every=0", "--sample_every=0"]
    done = launch_all_resuming({"lora": job(args=common + [f"--output_dir={out['lora']}"]),
                                "one": job(args=common + [f"--output_dir={out['one']}", "--grad_accum=2"], ranks=1),
                                "full": job(args=full)},
                               "lora", job(args=common + [f"--output_dir={out['stopped']}", "--resume=auto"]))
    return {"out": out, "logs": {k: v.stdout for k, v in done.items()}}


@pytest.mark.slow
def test_fine_tuning_lora_resumes_bit_exact_and_trains_on_two_ranks_as_in_one_process(ft_runs):
    """The LoRA run on 2 ranks logs one process's losses, validation losses and grad norms (GRAD_ACCUM=2), the run
    resumed at step 2 ends bit for bit as the straight one, and a sample grid is written."""
    out = ft_runs["out"]
    assert "data: 30 training pairs" in ft_runs["logs"]["lora"]
    assert_kontext_resumed_bit_exact(out["lora"], out["stopped"], 4, models=("model.transformer",))
    a, b = read_metrics(out["lora"]), read_metrics(out["one"])
    assert [r["step"] for r in a if "val_loss" in r] == [2, 4] and len(a) == len(b) == 4
    assert_metrics_match(out["lora"], out["one"])
    assert (out["lora"] / "samples" / "step_000004.png").exists()


@pytest.mark.slow
def test_fine_tuning_exports_load_in_the_omni_pipeline_and_sample(tiny, ft_runs):
    """The LoRA export loads on the base with ZImageOmniPipeline.load_lora_weights and changes what two references
    and a prompt sample (guidance_scale 4, the VAE in bf16 as the pipeline needs); the full fine-tune, whose first
    step from cached latents had the LoRA run's loss (its adapters start at zero), exports a folder that
    ZImageOmniPipeline.from_pretrained loads and samples with."""
    from diffusers import ZImageOmniPipeline
    out = ft_runs["out"]
    assert read_metrics(out["full"])[0]["loss"] == pytest.approx(read_metrics(out["lora"])[0]["loss"], rel=1e-6)
    assert "latent cache: 30 pairs, computed" in ft_runs["logs"]["full"]
    call = dict(image=[load_pil(s) for s in tiny["rows"][0]["controls"]], prompt=tiny["rows"][0]["prompt"],
                height=SIZE, width=SIZE, num_inference_steps=2, guidance_scale=4.0, output_type="np")
    images = []
    runs = ((tiny["model"], None), (tiny["model"], out["lora"] / "export"), (out["full"] / "export", None))
    for folder, lora in runs:
        pipe = ZImageOmniPipeline.from_pretrained(str(folder))
        if lora is not None:
            pipe.load_lora_weights(str(lora))
        pipe.vae.to(torch.bfloat16)
        pipe.set_progress_bar_config(disable=True)
        images.append(pipe(**call, generator=torch.Generator().manual_seed(0)).images)
    base, tuned, full = images
    assert all(np.isfinite(i).all() and i.shape == (1, SIZE, SIZE, 3) for i in images)
    assert not np.array_equal(base, tuned) and not np.array_equal(base, full)


# ----------------------------------------------------------------------------------------------
# the two-reference demo's base and evaluation

Z_IMAGE_BASE = Path(__file__).resolve().parents[1] / "assets" / "z_image_edit_base"


@pytest.mark.slow  # three pipeline calls on the shipped base (~2 s)
@pytest.mark.skipif(not (Z_IMAGE_BASE / "model_index.json").exists(), reason="assets/z_image_edit_base not built")
def test_z_image_pipeline_generates_the_task(tmp_path, monkeypatch):
    """Two held-out edits through ZImageOmniPipeline (CFG off, its VAE in bf16 as the pipeline needs); the suite's
    w = 1 is the pipeline's guidance_scale 0, w = 4 its 3."""
    from demos import qwen_edit_eval as qe
    from demos import z_image_edit_eval as ze
    rows = qe.load_rows(qe.write_edits(tmp_path / "h", qe.task_scenes("heldout", size=64)[:2], size=64))
    pipe = ze.load_pipeline(str(Z_IMAGE_BASE))
    assert pipe.vae.dtype == torch.bfloat16 and pipe.transformer.dtype == torch.float32
    seen, call = [], type(pipe).__call__
    monkeypatch.setattr(type(pipe), "__call__", lambda self, **k: seen.append(k["guidance_scale"]) or call(self, **k))
    metrics, outputs = ze.evaluate(str(Z_IMAGE_BASE), rows, steps=2, pipe=pipe)
    ze.generate(pipe, rows[:1], steps=1, true_cfg=4.0)
    assert [o.shape for o in outputs] == [(64, 64, 3)] * 2 and metrics["n"] == 2
    assert seen == [0.0, 0.0, 3.0]


@pytest.mark.slow  # the FLUX.2 base's VAE encodes and decodes 256 images in fp32 and bf16 (~2 s)
@pytest.mark.skipif(not (Z_IMAGE_BASE / "model_index.json").exists(), reason="assets/z_image_edit_base not built")
def test_z_image_base_vae_is_the_flux2_bases_rebuilt():
    """make_z_image_edit_base's VAE stage (the FLUX.2 base's trained weights in FLUX.1's AutoencoderKL, shift and
    scale from its latents) gives the shipped VAE: the same factors and weights (the export stores it in bf16)."""
    from diffusers import AutoencoderKL
    from demos import make_z_image_edit_base as mz
    vae, report = mz.train_vae()
    shipped = AutoencoderKL.from_pretrained(Z_IMAGE_BASE / "vae")
    assert (shipped.config.shift_factor, shipped.config.scaling_factor) == (
        vae.config.shift_factor, vae.config.scaling_factor)
    rebuilt = vae.state_dict()
    assert all(torch.equal(w, rebuilt[k].to(w.dtype)) for k, w in shipped.state_dict().items())
    assert report["vae_recon_success"] >= 95.0
    with pytest.raises(ValueError, match="reuses the FLUX.2 base's trained VAE"):
        mz.train_vae(steps=100)
