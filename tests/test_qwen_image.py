"""The Qwen-Image-Edit room (families/qwen_image/) and train_flux_kontext.py on it.

Conditioning equals QwenImageEditPlusPipeline's own tensors (text with its reference images, the
references' packed latents, img_shapes), the room's sampling loop equals the pipeline's output, and
the script trains with several references per sample: 2 ranks equal 1, resume is bit-exact, samples
with different numbers of references share a run, both exports load and sample with the pipeline,
and the family's refusals stop in one line.

The pipeline sizes references to module constants (1024^2 for the VAE, 384^2 for the text encoder);
the tests set both to 64^2, and the script's REFERENCE_AREA / CONDITION_AREA to the same, so the
tiny model runs in seconds. Reference images are made at exactly their calculate_dimensions size,
where the pipeline's stretch and the script's resize-and-crop give the same pixels.

    python -m pytest tests/test_qwen_image.py -q
"""
from __future__ import annotations

import functools
import json
import os
import re

import numpy as np
import pytest
import torch
from PIL import Image

from algorithms import dmd2 as dm
from families import qwen_image as qi
from tests.numerics import gamma
from tests.conftest import (VALIDATE, assert_validated, chain, launch, launch_all, launch_all_resuming, launch_env,
                            read_checkpoint, read_metrics, tiny_default)

AREA = 64 * 64
STEPS = 4


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """The tiny Qwen-Image-Edit-2509 folder, a dataset mixing one and two references of two sizes."""
    root = tmp_path_factory.mktemp("qwen")
    model_path, data_dir = tiny_default("qwen_image_edit")
    rows = [json.loads(line) for line in open(os.path.join(data_dir, "data.jsonl"))]
    for row in rows:  # paths absolute: the mixed dataset lives elsewhere
        row["control"] = [os.path.join(data_dir, c) for c in row["control"]]
        row["target"] = os.path.join(data_dir, row["target"])
    wide = root / "wide"
    wide.mkdir()
    for i, row in enumerate(rows[:8]):
        if i % 2:  # one reference: the shape alone (the prompt still names picture 2: the run does not care)
            row["control"] = row["control"][:1]
        elif i % 4 == 0:  # the swatch as a 32 x 128 strip: a reference of its own size
            strip = Image.open(row["control"][1]).convert("RGB").resize((128, 32))
            strip.save(wide / f"{i}.png")
            row["control"][1] = str(wide / f"{i}.png")
    data = root / "mixed.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = launch_env()
    common = [f"--model_path={model_path}", f"--data_path={data}", f"--text_cache_dir={root / 'text_cache'}",
              "--precision=fp32", f"--max_steps={STEPS}", "--log_every=1", "--num_sample_pairs=2", "--resolution=64",
              f"--reference_area={AREA}", f"--condition_area={AREA}", "--lr=1e-3", "--warmup_steps=0",
              "--export_dtype=fp32", "--sample_steps=2", "--batch_size=1", "--seed=1"]
    return {"root": root, "model": model_path, "rows": rows, "env": env, "common": common, "mixed": data}


def edit_2511(model_path, folder):
    """The tiny folder as Qwen-Image-Edit-2511's: the same weights, its transformer config with zero_cond_t
    (the references modulated at t = 0; no parameter of its own). Returns the folder as str."""
    import shutil
    shutil.copytree(model_path, folder)
    config = folder / "transformer" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "zero_cond_t": True}, indent=2))
    return str(folder)


@pytest.fixture(scope="module")
def qwen_2511(qwen):
    """The 2511 folder, fine-tuned (full, 2 ranks) and distilled (4-step LoRA generator on every Linear of the
    blocks, full fake score, 2 ranks) for 2 steps each."""
    root = qwen["root"]
    model = edit_2511(qwen["model"], root / "edit_2511")
    data = os.path.join(os.path.dirname(qwen["model"]), "data", "data.jsonl")
    tuned = [f"--model_path={model}", f"--text_cache_dir={root / 'tc_2511'}", "--max_steps=2", "--save_every=0",
             "--sample_every=0"]
    out = {k: root / f"out_2511_{k}" for k in ("tuned", "dmd")}
    launch_all({
        "tuned": dict(script="train_flux_kontext.py", args=qwen["common"] + tuned + [f"--output_dir={out['tuned']}",
                                                                                     "--val_every=0"],
                      ranks=2, env=qwen["env"]),
        "dmd": dict(script="train_dmd.py", args=tuned + [
            f"--data_path={data}", "--precision=fp32", "--resolution=64", f"--condition_area={AREA}",
            f"--reference_area={AREA}", "--batch_size=1", "--denoising_steps=999,749,499,249", "--lora_rank=4",
            "--lora_target_modules=blocks",
            "--dfake_gen_update_ratio=1", "--export_dtype=fp32", f"--output_dir={out['dmd']}"],
                    ranks=2, env=qwen["env"])})
    return {"model": model, "out": out}


@pytest.mark.slow
def test_edit_2511_trains_distils_and_exports(qwen_2511, tmp_path, small_areas):
    """Qwen-Image-Edit-2511 (zero_cond_t) fine-tunes and distils like 2509; the full export loads with
    QwenImageEditPlusPipeline as a zero_cond_t model, the LoRA export on the 2511 base, and both sample."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    paths = references(tmp_path)
    call = dict(image=[Image.open(p) for p in paths], prompt="make it blue", height=64, width=64,
                true_cfg_scale=1.0, output_type="np", generator=torch.Generator().manual_seed(0))
    tuned = pipeline(str(qwen_2511["out"]["tuned"] / "export"))
    assert tuned.transformer.config.zero_cond_t
    assert np.isfinite(tuned(**call, num_inference_steps=2).images).all()
    student = pipeline(qwen_2511["model"])
    student.load_lora_weights(str(qwen_2511["out"]["dmd"] / "export"))
    student.scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(str(qwen_2511["out"]["dmd"] / "export"),
                                                                        subfolder="scheduler")
    assert student.transformer.config.zero_cond_t
    assert np.isfinite(student(**call, num_inference_steps=4).images).all()


@pytest.fixture()
def small_areas(monkeypatch):
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as plus
    monkeypatch.setattr(plus, "VAE_IMAGE_SIZE", AREA)
    monkeypatch.setattr(plus, "CONDITION_IMAGE_SIZE", AREA)


def pipeline(folder):
    from diffusers import QwenImageEditPlusPipeline
    pipe = QwenImageEditPlusPipeline.from_pretrained(folder, processor=qi.load_processor(os.path.join(folder,
                                                                                                      "processor")))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def capture_calls(module):
    """The keyword arguments of each of `module`'s forwards, in order."""
    seen = []
    module.register_forward_pre_hook(lambda m, args, kwargs: seen.append(kwargs), with_kwargs=True)
    return seen


def references(tmp_path):
    """Two references at their own calculate_dimensions sizes for a 64^2 area: 64 x 64 and 32 x 128."""
    g = np.random.default_rng(0)
    paths = []
    for name, (h, w) in (("a", (64, 64)), ("b", (32, 128))):
        Image.fromarray(g.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(tmp_path / f"{name}.png")
        paths.append(str(tmp_path / f"{name}.png"))
    return paths


def odd_references(tmp_path):
    """A 1:2 and a 2:1 reference whose sizes are not calculate_dimensions': the pipeline stretches them."""
    g = np.random.default_rng(1)
    paths = []
    for name, (h, w) in (("tall", (100, 50)), ("wide", (45, 90))):
        Image.fromarray(g.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(tmp_path / f"{name}.png")
        paths.append(str(tmp_path / f"{name}.png"))
    return paths


@pytest.mark.parametrize("mirror", [False, True])
def test_conditioning_is_the_pipelines(qwen, tmp_path, small_areas, mirror):
    """Text embeddings (prompt + both images through Qwen2.5-VL), the references' packed latents and
    img_shapes as the room builds them equal what the pipeline hands its transformer, for a 1:2 and a
    2:1 reference at sizes the pipeline stretches, and (RANDOM_FLIP's flipped rows) for the mirror
    images: the text cache's mirrored entry and data.buckets.load_pairs' flipped views. The target is
    64 x 96 (h x w): a square one would not tell its img_shapes entry (1, h, w) from (1, w, h). DMD2's
    conditioning (dmd_cond) hands the transformer the same tokens, img_shapes and text."""
    from PIL import ImageOps

    from data import buckets
    pipe = pipeline(qwen["model"])
    paths = odd_references(tmp_path)
    row = {"controls": paths, "control": paths[0], **({"mirror": True} if mirror else {})}
    settings = {"CONDITION_AREA": AREA, "REFERENCE_AREA": AREA, "RESOLUTION": 64}
    seen = capture_calls(pipe.transformer)
    images = [ImageOps.mirror(Image.open(p).convert("RGB")) if mirror else Image.open(p) for p in paths]
    pipe(image=images, prompt="make it blue", height=64, width=96, num_inference_steps=1, true_cfg_scale=1.0,
         generator=torch.Generator().manual_seed(0), output_type="latent")
    call = seen[0]

    identity = qi.prepare_edit_text([("make it blue", row)], qwen["model"], str(tmp_path / "tc"), settings,
                                    torch.float32, torch.device("cpu"))
    embeds, mask = qi.load_text([("make it blue", row)], str(tmp_path / "tc"), identity, torch.device("cpu"))
    assert mask is None and call["encoder_hidden_states_mask"] is None  # one prompt: nothing padded
    assert torch.equal(embeds, call["encoder_hidden_states"])

    sizes = qi.reference_sizes(None, row, settings)
    assert sizes == ((96, 32), (32, 96))
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions
    width, height = calculate_dimensions(64 * 64, 90 / 45)  # the pipeline's output: the last image's ratio
    assert qi.target_size(None, row, settings) == (height, width) == (32, 96)
    pixels, _ = buckets.load_pairs([row], ((64, 64), sizes), [mirror], target=False)
    refs = [qi.encode_latents(pipe.vae, p) for p in pixels]
    target = torch.zeros(1, 16, 8, 12)
    inputs = qi.model_inputs(target, refs, torch.zeros_like(target), torch.ones(1))
    n = inputs["n_target_tokens"]
    assert n == 24 and torch.equal(inputs["hidden_states"][:, n:], call["hidden_states"][:, n:])
    assert inputs["img_shapes"] == call["img_shapes"] == [[(1, 4, 6), (1, 6, 2), (1, 2, 6)]]

    cond = qi.dmd_cond((embeds, mask), None, pipe.vae, pixels, (8, 12))
    cond.velocity(pipe.transformer, 1.0)(call["hidden_states"][:, :n], call["timestep"])
    ours = seen[-1]
    assert ours["img_shapes"] == call["img_shapes"] and torch.equal(ours["hidden_states"], call["hidden_states"])
    assert torch.equal(ours["encoder_hidden_states"], call["encoder_hidden_states"])


@pytest.mark.parametrize("true_cfg, model", [(1.0, "2509"), (4.0, "2509"), (4.0, "2511")])
def test_sampling_loop_is_the_pipelines(qwen, tmp_path, small_areas, true_cfg, model):
    """The room's sample (the grids' edits) equals the pipeline's output image for the same seed,
    with and without true CFG against the negative prompt, for 2509 and 2511 (zero_cond_t), at a
    64 x 96 (h x w) target (not square: the target's img_shapes and unpacking are told from their
    transposes)."""
    from data.images import load_image
    folder = qwen["model"] if model == "2509" else edit_2511(qwen["model"], tmp_path / "edit_2511")
    pipe = pipeline(folder)
    assert pipe.transformer.config.zero_cond_t == (model == "2511")
    paths = references(tmp_path)
    row = {"controls": paths, "control": paths[0]}
    negative = {"negative_prompt": qi.NEGATIVE_PROMPT} if true_cfg > 1 else {}
    theirs = pipe(image=[Image.open(p) for p in paths], prompt="make it blue", height=64, width=96,
                  num_inference_steps=2, true_cfg_scale=true_cfg, generator=torch.Generator().manual_seed(3),
                  output_type="pt", **negative).images[0]
    settings = {"CONDITION_AREA": AREA, "REFERENCE_AREA": AREA, "RESOLUTION": 64}
    texts = [("make it blue", row), (qi.NEGATIVE_PROMPT, row)]
    identity = qi.prepare_edit_text(texts, folder, str(tmp_path / "tc"), settings, torch.float32, torch.device("cpu"))
    text = qi.load_text(texts[:1], str(tmp_path / "tc"), identity, torch.device("cpu"))
    neg = qi.load_text(texts[1:], str(tmp_path / "tc"), identity, torch.device("cpu"))
    refs = [load_image(p, *s)[None] for p, s in zip(paths, qi.reference_sizes(None, row, settings))]
    ours = qi.sample((pipe.scheduler, pipe.transformer), pipe.vae, refs, qi.text_row(text, 0), (64, 96), 2, true_cfg,
                     torch.Generator().manual_seed(3), negative=qi.text_row(neg, 0))
    assert torch.equal((ours * 0.5 + 0.5).clamp(0, 1), theirs)


def test_text_batches_pad_with_a_mask(qwen, tmp_path):
    """Prompts of different lengths in one micro-batch: zeros after each one's end, and a mask that
    says so; a row alone comes back unpadded, as the pipeline's batch of one."""
    settings = {"CONDITION_AREA": AREA}
    row = {"controls": references(tmp_path)[:1], "control": None}
    texts = [("blue", row), ("make the large square in the middle a deep saturated blue", row)]
    identity = qi.prepare_edit_text(texts, qwen["model"], str(tmp_path / "tc"), settings, torch.float32,
                                    torch.device("cpu"))
    embeds, mask = qi.load_text(texts, str(tmp_path / "tc"), identity, torch.device("cpu"))
    short, long_ = int(mask[0].sum()), int(mask[1].sum())
    assert short < long_ == embeds.shape[1] and not embeds[0, short:].any()
    alone = qi.load_text(texts[:1], str(tmp_path / "tc"), identity, torch.device("cpu"))
    assert torch.equal(qi.text_row((embeds, mask), 0)[0], alone[0])


def test_text_cache_key_holds_the_images(tmp_path):
    paths = references(tmp_path)
    a, b = qi.text_key("p", {"controls": paths}), qi.text_key("p", {"controls": paths[::-1]})
    assert a != b and a != qi.text_key("p", {"controls": paths[:1]}) and a == qi.text_key("p", {"controls": paths})


@pytest.fixture(scope="module")
def runs(qwen):
    """Full fine-tuning on 2 ranks and on 1, the 2-rank run resumed from its step-2 checkpoint (these three with the
    pipeline's σ shift and RANDOM_FLIP), a LoRA run on an NF4 base with activation checkpointing, cached latents
    (references of two sizes) and 8-bit AdamW."""
    root = qwen["root"]
    common = qwen["common"] + ["--ema_decay=0.9", "--save_every=2", "--sample_every=4", "--val_every=2", "--shift=auto",
                               "--random_flip=1"]
    out = {k: root / k for k in ("two", "one", "stopped", "lora")}
    jobs = {
        "two": dict(script="train_flux_kontext.py", args=common + [f"--output_dir={out['two']}"], ranks=2,
                    env=qwen["env"]),
        "one": dict(script="train_flux_kontext.py", args=common + [f"--output_dir={out['one']}", "--grad_accum=2"],
                    ranks=1, env=qwen["env"]),
        "lora": dict(script="train_flux_kontext.py", args=qwen["common"] + [
            f"--output_dir={out['lora']}", "--lora_rank=4", "--sample_every=0", "--val_every=0", "--save_every=0",
            "--base_dtype=nf4", "--activation_checkpointing=1", "--cache_latents=1", "--optimizer=adamw8bit"],
            ranks=2, env=qwen["env"]),
    }
    resumed = dict(script="train_flux_kontext.py", args=common + [f"--output_dir={out['stopped']}", "--resume=auto"],
                   env=qwen["env"])
    done = launch_all_resuming(jobs, "two", resumed)
    return {"out": out, "logs": {k: v.stdout for k, v in done.items()}, "resumed": done["resumed"].stdout,
            "model": qwen["model"]}


@pytest.mark.slow
def test_two_ranks_equal_one_and_references_mix(runs):
    """Samples with one and two references (and two reference sizes) train in one run, one shape
    per global batch; 2 ranks give the numbers of 1 rank with GRAD_ACCUM=2."""
    two, one = read_metrics(runs["out"]["two"], timing=False), read_metrics(runs["out"]["one"], timing=False)
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-5, abs=0)
    a, b = read_checkpoint(runs["out"]["two"], STEPS), read_checkpoint(runs["out"]["one"], STEPS)
    for k, v in a["model.transformer"].items():
        torch.testing.assert_close(v, b["model.transformer"][k], rtol=1e-4, atol=1e-6)
    assert os.path.exists(runs["out"]["two"] / "samples" / f"step_{STEPS:06d}.png")
    assert any("val_loss" in r for r in two)
    from algorithms import flux_kontext as km  # SHIFT=auto: the pipeline's shift at 64 x 64 (16 target tokens)
    config = json.load(open(os.path.join(runs["model"], "scheduler", "scheduler_config.json")))
    assert f"64x64 {km.pipeline_shift(config, 16):.3f}" in runs["logs"]["two"]


@pytest.mark.slow
def test_resume_is_bit_exact(runs):
    a, b = read_checkpoint(runs["out"]["two"], STEPS), read_checkpoint(runs["out"]["stopped"], STEPS)
    for name in ("model.transformer", "model.ema"):
        assert all(torch.equal(a[name][k], b[name][k]) for k in a[name]), name
    assert read_metrics(runs["out"]["two"])[-1]["loss"] == read_metrics(runs["out"]["stopped"])[-1]["loss"]


@pytest.mark.slow
def test_exports_load_and_sample_with_the_pipeline(qwen, runs, tmp_path, small_areas):
    """The full export loads with from_pretrained and holds the trained (EMA) weights; the LoRA
    export (trained on the NF4 base) loads on the base with load_lora_weights and changes its edits."""
    paths = references(tmp_path)
    call = dict(image=[Image.open(p) for p in paths], prompt="make it blue", height=64, width=64,
                num_inference_steps=2, true_cfg_scale=1.0, output_type="np")
    full = pipeline(str(runs["out"]["two"] / "export"))
    ema = read_checkpoint(runs["out"]["two"], STEPS)["model.ema"]
    exported = full.transformer.state_dict()
    assert all(torch.equal(exported[k], v) for k, v in ema.items() if k in exported)
    assert np.isfinite(full(**call, generator=torch.Generator().manual_seed(0)).images).all()
    base = pipeline(qwen["model"])
    before = base(**call, generator=torch.Generator().manual_seed(0)).images
    base.load_lora_weights(str(runs["out"]["lora"] / "export"))
    after = base(**call, generator=torch.Generator().manual_seed(0)).images
    assert np.isfinite(after).all() and not np.array_equal(before, after)


@pytest.mark.slow
def test_any_checkpoint_exports_as_the_run_end_does(qwen, runs, tmp_path):
    """tools/export_checkpoint.py on the final checkpoints, one rank (they were saved on two): the full run's
    pipeline folder (its EMA) and the LoRA run's file equal what the runs exported, tensor for tensor."""
    from safetensors.torch import load_file
    cases = {"two": "transformer/diffusion_pytorch_model.safetensors", "lora": "pytorch_lora_weights.safetensors"}
    checkpoint = os.path.join("checkpoints", f"step_{STEPS:06d}")
    launch_all({name: dict(script="tools/export_checkpoint.py", ranks=1, env=qwen["env"],
                           args=[runs["out"][name] / checkpoint, f"--output_dir={tmp_path / name}"])
                for name in cases}, timeout=600)
    for name, file in cases.items():
        out = tmp_path / name
        a, b = load_file(str(out / "export" / file)), load_file(str(runs["out"][name] / "export" / file))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


@pytest.mark.slow
def test_an_export_loads_the_plain_way(runs):
    """README's load line as written, QwenImageEditPlusPipeline.from_pretrained(export) with nothing passed
    by hand, in the environment requirements.txt installs (torchvision: the processor's video part)."""
    from diffusers import QwenImageEditPlusPipeline
    pipe = QwenImageEditPlusPipeline.from_pretrained(str(runs["out"]["two"] / "export"))
    assert type(pipe.processor).__name__ == "Qwen2VLProcessor" and pipe.processor.video_processor is not None


@pytest.mark.slow
def test_family_refusals_are_one_line(qwen, tmp_path):
    jobs = {name: dict(script="train_flux_kontext.py", args=qwen["common"] + [f"--output_dir={tmp_path / name}",
                                                                              flag], ranks=1, env=qwen["env"])
            for name, flag in (("refs", "--max_references=4"), ("guidance", "--guidance=3.5"),
                               ("buckets", "--bucket_aspects=[1.0]"))}
    done = launch_all(jobs, check=False)
    expect = {"refs": "error: MAX_REFERENCES=4: QwenImageEditPlusPipeline takes at most 3",
              "guidance": "error: GUIDANCE=3.5: Qwen-Image-Edit has no guidance embedding",
              "buckets": "error: BUCKET_ASPECTS=[1.0]: not used by Qwen-Image-Edit"}
    for name, proc in done.items():
        assert proc.returncode != 0
        errors = [line for line in proc.stdout.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and errors[0].startswith(expect[name]), proc.stdout[-1500:]


def test_a_lora_target_without_a_gradient_is_refused_naming_it(qwen):
    """The last block's text stream after attention feeds nothing: a target that reaches it (to_add_out,
    txt_mlp's layers) stops before any work in one line naming the module; the same layers of the other
    blocks, named by longer suffixes, are taken; the modules nothing reads are frozen in every build."""
    from core.errors import ConfigError
    from parallel import lora as lora_lib
    folder = os.path.join(qwen["model"], "transformer")
    last = json.load(open(os.path.join(folder, "config.json")))["num_layers"] - 1
    for target in ("to_add_out", "txt_mlp.net.2", "net.0.proj"):
        with pytest.raises(ConfigError, match=rf"LORA_TARGET_MODULES: '{re.escape(target)}' adapts "
                                              rf"transformer_blocks\.{last}\.(attn\.to_add_out|txt_mlp)"):
            lora_lib.check_lora_targets("QwenImageTransformer2DModel", folder, lora_lib.Lora(rank=4, targets=(target,)))
    ok = ("transformer_blocks.0.attn.to_add_out", "img_mlp.net.2", "to_q")
    assert lora_lib.check_lora_targets("QwenImageTransformer2DModel", folder, lora_lib.Lora(rank=4, targets=ok)) == \
        list(ok)
    from diffusers import QwenImageTransformer2DModel
    with torch.device("meta"):
        model = QwenImageTransformer2DModel.from_config(QwenImageTransformer2DModel.load_config(folder))
    qi.freeze_unused(model)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all(n.startswith((f"transformer_blocks.{last}.attn.to_add_out",
                                        f"transformer_blocks.{last}.txt_mlp")) for n in frozen)


# ----------------------------------------------------------------------------------------------
# DMD2 with a Qwen-Image-Edit teacher (train_dmd.py's flow setup)


class _TextMean(torch.nn.Module):
    """A stand-in transformer whose velocity is the text's masked mean times σ, broadcast over the
    tokens: what the CFG pairing must keep apart per sample and per half."""
    def forward(self, hidden_states, timestep, guidance, encoder_hidden_states, encoder_hidden_states_mask,
                img_shapes, return_dict):
        e = encoder_hidden_states
        m = (torch.ones(e.shape[:2], dtype=torch.bool) if encoder_hidden_states_mask is None
             else encoder_hidden_states_mask).float()
        mean = (e * m[..., None]).sum(1) / m.sum(1, keepdim=True)
        out = (mean[:, None, :1] * timestep[:, None, None]).expand(-1, hidden_states.shape[1], hidden_states.shape[2])
        return (out.contiguous(),)


def test_teacher_cfg_pairs_text_and_negative_per_sample():
    """guidance > 1: v_neg + s (v - v_neg) per sample, the negative of another length padded and
    masked away; guidance 1: the text alone."""
    text = (torch.tensor([[[2.0], [4.0]], [[6.0], [0.0]]]), torch.tensor([[True, True], [True, False]]))
    negative = (torch.tensor([[[1.0], [1.0], [1.0]], [[3.0], [3.0], [3.0]]]), None)
    cond = qi.QwenCond(text, negative, [torch.zeros(2, 1, 4)], (2, 2), [(2, 2)])
    x, sigma = torch.zeros(2, 1, 4), torch.tensor([1.0, 0.5])
    v = cond.velocity(_TextMean(), 4.0)(x, sigma)
    mean, neg = torch.tensor([3.0, 6.0]) * sigma, torch.tensor([1.0, 3.0]) * sigma
    assert torch.equal(v[:, 0, 0], neg + 4.0 * (mean - neg))
    assert torch.equal(cond.velocity(_TextMean(), 1.0)(x, sigma)[:, 0, 0], mean)
    # the pair rescaled as asked: per token to the conditional prediction's norm, here each token's |mean|
    rescaled = cond.velocity(_TextMean(), 4.0, "token")(x, sigma)
    assert torch.equal(rescaled, dm.cfg_combine(mean[:, None, None].expand_as(v), neg[:, None, None].expand_as(v),
                                                4.0, "token"))
    # 4 equal channels: norm 2|mean|; the combination, two norms and the ratio: gamma(8) relative at most
    assert torch.allclose(rescaled.norm(dim=-1), (mean[:, None] * 2).expand(2, 1), rtol=gamma(8), atol=0)


def test_gan_head_reads_the_last_blocks_image_stream(qwen):
    """The GAN head's features: the image stream the last (double-stream) block hands on, target tokens
    only, as a (B, D, h/2, w/2) grid; norm_out and proj_out skipped for that pass and back after it."""
    from diffusers import QwenImageTransformer2DModel

    from algorithms import dmd2_flow as flow_dm
    model = QwenImageTransformer2DModel.from_pretrained(os.path.join(qwen["model"], "transformer")).eval()
    c, g = model.config, torch.Generator().manual_seed(0)
    text = (torch.randn(2, 5, c.joint_attention_dim, generator=g), None)
    cond = qi.QwenCond(text, None, [torch.randn(2, 4, c.in_channels, generator=g)], (8, 8), [(4, 4)])
    x, sigma = torch.randn(2, 16, c.in_channels, generator=g), torch.tensor([0.3, 0.9])
    seen = []
    model.transformer_blocks[-1].register_forward_hook(lambda m, a, out: seen.append(out[1]))
    before = cond.velocity(model, 1.0)(x, sigma)
    with torch.no_grad():
        feats = flow_dm.double_stream_features(model, x, sigma, cond, 1.0)
    width = c.num_attention_heads * c.attention_head_dim
    assert feats.shape == (2, width, 4, 4)
    assert torch.equal(feats.flatten(2).transpose(1, 2), seen[-1][:, :16].float())
    assert torch.equal(cond.velocity(model, 1.0)(x, sigma), before)  # the model whole again


def test_dmd_refusals_are_one_line_before_any_work(qwen, monkeypatch, tmp_path):
    """What a Qwen-Image-Edit teacher does not take: prompt-only data, the GAN without targets, and
    the settings of other paths, each named in one line before any model is built."""
    import train_dmd
    from tests.test_fault_tolerance import main_error
    rows = tmp_path / "no_targets.jsonl"
    rows.write_text("".join(json.dumps({"control": r["control"], "prompt": r["prompt"]}) + "\n"
                            for r in qwen["rows"][:2]))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\n")
    base = [f"--model_path={qwen['model']}", f"--output_dir={tmp_path / 'out'}", "--precision=fp32"]
    cases = [([f"--data_path={prompts}"], f"DATA_PATH={prompts} holds prompts only; a QwenImageEditPlusPipeline "
                                          "teacher edits images"),
             ([f"--data_path={rows}", "--parallelism=ddp"], "PARALLELISM=ddp with a QwenImageEditPlusPipeline"),
             ([f"--data_path={rows}", "--use_gan=1", "--gan_head_features=up"],
              "GAN_HEAD_FEATURES=up with a QwenImageEditPlusPipeline teacher"),
             ([f"--data_path={rows}", "--use_gan=1", f"--real_data_path={prompts}"],
              "REAL_DATA_PATH with a QwenImageEditPlusPipeline teacher: the GAN's real images are the rows' own")]
    for argv, message in cases:
        assert message in main_error(monkeypatch, train_dmd, base + argv), argv
        assert not torch.distributed.is_initialized()  # refused before the process group, let alone a model


@pytest.mark.slow
def test_dmd_gan_without_targets_is_one_line(qwen, tmp_path):
    """USE_GAN with rows that hold no target (read once the process group is up): one line naming the
    file and row, a non-zero exit."""
    rows = tmp_path / "no_targets.jsonl"
    rows.write_text("".join(json.dumps({"control": r["control"], "prompt": r["prompt"]}) + "\n"
                            for r in qwen["rows"][:2]))
    r = launch("train_dmd.py", [f"--model_path={qwen['model']}", f"--data_path={rows}", "--use_gan=1",
                                f"--output_dir={tmp_path / 'out'}", "--precision=fp32"], ranks=1, env=qwen["env"],
               check=False)
    errors = [line for line in r.stdout.splitlines() if line.startswith("error:")]
    assert r.returncode != 0 and len(errors) == 1, r.stdout[-2000:]
    assert errors[0].startswith(f"error: {rows}:1: missing or empty 'target'"), errors


@pytest.fixture(scope="module")
def dmd_runs(qwen):
    """DMD2 of the tiny Qwen-Image-Edit teacher, 4-step generator: on the mixed rows (one or two references,
    two reference sizes: three shapes) full with the GAN head on 2 ranks, the same on 1 rank with GRAD_ACCUM=2
    and on 2 ranks resumed from the full run's step-2 checkpoint; on two references per row a LoRA generator and
    fake score on an NF4 teacher."""
    root = qwen["root"]
    data = os.path.join(os.path.dirname(qwen["model"]), "data", "data.jsonl")
    common = [f"--model_path={qwen['model']}", f"--data_path={qwen['mixed']}",
              f"--text_cache_dir={root / 'dmd_text_cache'}", "--precision=fp32", "--resolution=64",
              f"--condition_area={AREA}", f"--reference_area={AREA}", "--max_steps=4", "--log_every=1",
              "--denoising_steps=999,749,499,249", "--batch_size=1", "--sample_count=2", "--dfake_gen_update_ratio=2",
              "--ema_decay=0.9", "--save_every=2", "--sample_every=4", "--export_dtype=fp32"]
    gan = ["--use_gan=1", "--gen_cls_loss_weight=0.1", "--guidance_cls_loss_weight=0.1"]  # weights that show
    out = {k: root / ("dmd_" + k) for k in ("full", "one", "stopped", "lora")}
    job = functools.partial(dict, script="train_dmd.py", ranks=2, env=qwen["env"])
    done = launch_all_resuming({
        "full": job(args=common + gan + [f"--output_dir={out['full']}"]),
        "one": job(args=common + gan + [f"--output_dir={out['one']}", "--grad_accum=2"], ranks=1),
        "lora": job(args=common + [f"--output_dir={out['lora']}", f"--data_path={data}", "--lora_rank=4",
                                   "--fake_lora=1", "--base_dtype=nf4", "--save_every=0", "--shift=auto",
                                   *VALIDATE])},
        "full", job(args=common + gan + [f"--output_dir={out['stopped']}", "--resume=auto"]))
    return {"out": out, "logs": {k: v.stdout for k, v in done.items()}}


@pytest.mark.slow
def test_a_fine_tune_is_the_teacher_and_the_student_loads_on_the_base(qwen, runs, tmp_path, small_areas):
    """Fine-tune (LoRA on NF4) -> DMD2 on base + that LoRA -> the 4-step LoRA export loads on the plain base
    with the pipeline: the run equals the one on the merged folder step for step, and the export's file
    carries the fine-tune's adapters with the student's (they load as one adapter set)."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from parallel import lora_merge
    data = os.path.join(os.path.dirname(qwen["model"]), "data", "data.jsonl")
    args = [f"--text_cache_dir={qwen['root'] / 'dmd_text_cache'}", "--precision=fp32", "--resolution=64",
            f"--condition_area={AREA}", f"--reference_area={AREA}", "--batch_size=1"]
    tuned = runs["out"]["lora"] / "export"
    done = chain(qwen["model"], data, tuned, qwen["root"], qwen["env"], args)
    a, b = (read_metrics(done["out"][k], timing=False) for k in ("lora", "merged"))
    assert [(r["loss_dm"], r["loss_fake"]) for r in a] == [(r["loss_dm"], r["loss_fake"]) for r in b]
    teacher, exported = lora_merge.read_lora(str(tuned)), lora_merge.read_lora(str(done["out"]["lora"] / "export"))
    assert set(teacher.layers) <= set(exported.layers)
    for module, (a_t, b_t, s_t) in teacher.layers.items():
        a_j, b_j, s_j = exported.layers[module]
        assert s_j == 1 and torch.equal(a_j[-a_t.shape[0]:], a_t) and torch.equal(b_j[:, -a_t.shape[0]:], b_t * s_t)
    paths = references(tmp_path)
    pipe = pipeline(qwen["model"])
    pipe.load_lora_weights(str(done["out"]["lora"] / "export"))
    pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(str(done["out"]["lora"] / "export"),
                                                                     subfolder="scheduler")
    images = pipe(image=[Image.open(p) for p in paths], prompt="make it blue", height=64, width=64,
                  num_inference_steps=4, true_cfg_scale=1.0, output_type="np",
                  generator=torch.Generator().manual_seed(0)).images
    assert np.isfinite(images).all()


@pytest.mark.slow
def test_dmd_runs_resume_bit_exact_and_log_the_teacher_cfg(dmd_runs):
    a, b = read_checkpoint(dmd_runs["out"]["full"], 4), read_checkpoint(dmd_runs["out"]["stopped"], 4)
    for name in ("model.generator", "model.fake", "model.ema", "model.head"):
        assert all(torch.equal(a[name][k], b[name][k]) for k in a[name]), name
    rows = read_metrics(dmd_runs["out"]["full"], timing=False)
    assert rows[-1] == read_metrics(dmd_runs["out"]["stopped"], timing=False)[-1]
    # the head steps every step (discriminator loss near 2 ln 2 at the start); G's GAN term on its steps
    assert all(0 < r["loss_guidance_cls"] < 3 for r in rows)
    assert sum("loss_gen_cls" in r for r in rows) == 2
    assert "teacher true CFG 4" in dmd_runs["logs"]["full"]
    assert "σ shift of the DM loss and the fake score at 64x64: " in dmd_runs["logs"]["lora"]  # SHIFT=auto
    # validation on 2 ranks, NF4 teacher, LoRA students; the teacher's reference under its true CFG
    assert_validated(dmd_runs["out"]["lora"], [2, 4], dmd_runs["logs"]["lora"])
    assert os.path.exists(dmd_runs["out"]["full"] / "samples" / "step_000004.png")


@pytest.mark.slow
def test_dmd_mixed_shapes_two_ranks_equal_one(dmd_runs):
    """Rows of three shapes (one or two references, two reference sizes) train one shape per global batch,
    each rank its exact share: 2 ranks give the numbers of 1 rank with GRAD_ACCUM=2."""
    data = next(line for line in dmd_runs["logs"]["full"].splitlines() if line.startswith("data: "))
    assert data.endswith("shapes 64x64 + 64x64 + 32x128: 2, 64x64 + 64x64: 4, 64x64 + 64x64 + 64x64: 26"), data
    two, one = read_metrics(dmd_runs["out"]["full"], timing=False), read_metrics(dmd_runs["out"]["one"], timing=False)
    for key in ("loss_fake", "loss_dm", "loss_guidance_cls"):
        assert [r.get(key) is None for r in two] == [r.get(key) is None for r in one], key
        assert [r[key] for r in two if key in r] == pytest.approx([r[key] for r in one if key in r], rel=1e-4), key


@pytest.mark.slow
def test_dmd_exports_sample_the_trained_sigmas(qwen, dmd_runs, tmp_path, small_areas):
    """Both exports (the full pipeline folder; the LoRA on the base with the scheduler beside it)
    sample in 4 steps at the trained σ list [1, .75, .5, .25] whatever the image size."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    paths = references(tmp_path)
    call = dict(image=[Image.open(p) for p in paths], prompt="make it blue", height=64, width=64,
                num_inference_steps=4, true_cfg_scale=1.0, output_type="np")
    full = pipeline(str(dmd_runs["out"]["full"] / "export"))
    lora = pipeline(qwen["model"])
    lora.load_lora_weights(str(dmd_runs["out"]["lora"] / "export"))
    lora.scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(str(dmd_runs["out"]["lora"] / "export"),
                                                                     subfolder="scheduler")
    for pipe in (full, lora):
        seen = []
        pipe.transformer.register_forward_pre_hook(lambda m, a, kw: seen.append(float(kw["timestep"][0])),
                                                   with_kwargs=True)
        images = pipe(**call, generator=torch.Generator().manual_seed(0)).images
        assert np.isfinite(images).all()
        assert seen == pytest.approx([1.0, 0.75, 0.5, 0.25], abs=1e-6)
