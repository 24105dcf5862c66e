"""The FLUX.2 room (families/flux2/) and train_flux_kontext.py on it.

Conditioning equals Flux2KleinPipeline's own tensors (the text through its encode_prompt and the cache, each
reference by its resize-and-cut rule, the latents' patchify and BatchNorm statistics, the 4-D ids with a time
offset per reference, the text ids), the room's sampling loop equals the pipeline's output with true CFG and
two references, and the script trains with several references per sample: resume is bit-exact, the full
export loads with from_pretrained and the LoRA export (NF4 base, AC, cached latents, 8-bit AdamW) with
load_lora_weights, both sampling through the pipeline. FLUX.2 [dev] (Flux2Pipeline, a tiny Mistral-3 text encoder):
its cached text is encode_prompt's, its sampling loop the pipeline's, and DMD2 distils it through its guidance
embedding.

    python -m pytest tests/test_flux2.py -q
"""
from __future__ import annotations

import functools
import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

import checkpoint
from core.errors import ConfigError
from families import flux2
from tests.conftest import (VALIDATE, assert_metrics_match, assert_trains_as_eager, assert_validated, chain,
                            launch_all_resuming, launch_env, read_checkpoint, read_metrics, run_ranks, start_all,
                            tiny_default)

STEPS = 4
LR = 1e-3
SETTINGS = {"RESOLUTION": 64, "REFERENCE_AREA": 0, "MAX_SEQUENCE_LENGTH": 32, "CONTEXT_PARALLEL": 1, "SHIFT": "1",
            "GUIDANCE": 1.0, "BUCKET_ASPECTS": [1.0], "CONDITION_AREA": 0}


@pytest.fixture(scope="module")
def klein(tmp_path_factory):
    """The tiny FLUX.2 [klein] base folder and its two-reference rows (a 64 px scene, a 64 px swatch: the pipelines'
    smallest side), mixed: every other row with the scene alone, every fourth with the swatch as a 64 x 256 strip
    (three id layouts)."""
    root = tmp_path_factory.mktemp("flux2")
    model_path, data_dir = tiny_default("flux2_klein")
    rows = [json.loads(line) for line in open(os.path.join(data_dir, "data.jsonl"))]
    for i, row in enumerate(rows):
        row["control"] = [os.path.join(data_dir, c) for c in row["control"]]
        row["target"] = os.path.join(data_dir, row["target"])
        if i % 2:
            row["control"] = row["control"][:1]
        elif i % 4 == 0:
            Image.open(row["control"][1]).convert("RGB").resize((256, 64)).save(root / f"strip{i}.png")
            row["control"][1] = str(root / f"strip{i}.png")
    (root / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = launch_env()
    common = [f"--model_path={model_path}", f"--data_path={root / 'mixed.jsonl'}",
              f"--text_cache_dir={root / 'text_cache'}", "--precision=fp32", f"--max_steps={STEPS}", "--log_every=1",
              "--num_sample_pairs=2", "--resolution=64", "--max_sequence_length=32", f"--lr={LR}", "--warmup_steps=0",
              "--export_dtype=fp32", "--sample_steps=2", "--batch_size=1", "--seed=1"]
    return {"root": root, "model": model_path, "data": data_dir, "env": env, "common": common}


@pytest.fixture(scope="module")
def dev(klein):
    """The tiny FLUX.2 [dev] folder (Flux2Pipeline: Mistral3ForConditionalGeneration and its PixtralProcessor, the
    transformer with the guidance embedding)."""
    return tiny_default("flux2_dev")[0]


# [dev]'s chat template around a prompt (<s>, the system message, [INST] [/INST]) is 32 of the tiny tokenizer's
# tokens and truncation cuts from the right: at 32 every prompt would encode as "", 64 holds the longest here (41)
DEV_LENGTH = 64


def pipeline(folder):
    pipe = flux2.pipeline_class(folder).from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def images(tmp_path, sizes, seed=0):
    g = np.random.default_rng(seed)
    paths = []
    for i, (h, w) in enumerate(sizes):
        Image.fromarray(g.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(tmp_path / f"{i}.png")
        paths.append(str(tmp_path / f"{i}.png"))
    return paths


def text(folder, tmp_path, prompts, length=512):
    settings = {**SETTINGS, "MAX_SEQUENCE_LENGTH": length}
    pairs = [(p, {}) for p in prompts]
    identity = flux2.prepare_edit_text(pairs, folder, str(tmp_path / "tc"), settings, torch.float32,
                                       torch.device("cpu"))
    return flux2.load_text(pairs, str(tmp_path / "tc"), identity, torch.device("cpu"))


def test_conditioning_is_the_pipelines(klein, tmp_path):
    """What the pipeline hands its transformer for two references at sizes it cuts (70 x 90, 64 x 100): the text
    (through the cache), the references' tokens and the ids ([target T=0 ; reference i T=10(i+1)], text
    (0,0,0,l)); the timestep σ; and the pipeline's downsizing of a reference over the area."""
    from data import buckets
    pipe = pipeline(klein["model"])
    paths = images(tmp_path, [(70, 90), (64, 100)])
    seen = []
    pipe.transformer.register_forward_pre_hook(lambda m, a, kw: seen.append(kw) if not seen else None,
                                               with_kwargs=True)
    pipe(image=[Image.open(p) for p in paths], prompt="make it blue", num_inference_steps=1, guidance_scale=1.0,
         generator=torch.Generator().manual_seed(0), output_type="latent")
    call = seen[0]
    assert torch.equal(text(klein["model"], tmp_path, ["make it blue"]), call["encoder_hidden_states"])

    row = {"controls": paths, "control": paths[0], "target": paths[0]}
    sizes = flux2.reference_sizes(None, row, SETTINGS)
    assert sizes == ((64, 80), (64, 96))  # cut to multiples of 16, never upsized
    assert flux2.target_size(None, row, {**SETTINGS, "RESOLUTION": 1024}) == (64, 80)  # the pipeline's default output
    pixels, _ = buckets.load_pairs([row], ((64, 80), sizes), [False], target=False,
                                   loader=flux2.image_loader(SETTINGS))
    refs = [flux2.encode_latents(pipe.vae, p) for p in pixels]
    target = torch.zeros(1, 4, 8, 10)
    inputs = flux2.model_inputs(target, refs, torch.zeros_like(target), torch.ones(1))
    n = inputs["n_target_tokens"]
    assert n == 20 and torch.equal(inputs["hidden_states"][:, n:], call["hidden_states"][:, n:])
    assert torch.equal(inputs["img_ids"], call["img_ids"])
    assert torch.equal(flux2.text_ids(call["encoder_hidden_states"]), call["txt_ids"])
    assert call["guidance"] is None and torch.equal(call["timestep"], torch.ones(1))  # σ = t / 1000 at t = 1000

    big = images(tmp_path / "..", [(700, 1000)], seed=1)[0]
    small = pipe.image_processor._resize_to_target_area(Image.open(big).convert("RGB"), 300 * 300)
    w, h = small.size
    theirs = pipe.image_processor.preprocess(small, height=h // 16 * 16, width=w // 16 * 16, resize_mode="crop")
    ours = flux2.load_image(big, 300 * 300)
    assert torch.equal(ours[None], theirs) and flux2.pipeline_size(700, 1000, 300 * 300)[1] == tuple(ours.shape[1:])
    with torch.no_grad():  # the room's latents are the pipeline's, un-patchified
        assert torch.equal(flux2._patchify(flux2.encode_latents(pipe.vae, ours[None])),
                           pipe._encode_vae_image(theirs, None))


def test_packing_is_the_pipelines_patchify_then_pack():
    from algorithms import flux_kontext as km
    from diffusers import Flux2KleinPipeline
    z = torch.randn(2, 4, 6, 8)
    assert torch.equal(km.pack_latents(z), Flux2KleinPipeline._pack_latents(Flux2KleinPipeline._patchify_latents(z)))


@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_sampling_loop_is_the_pipelines(klein, tmp_path, guidance):
    """The room's sample equals the pipeline's output image for the same seed, two references, with and
    without klein-base's true CFG against ""."""
    pipe = pipeline(klein["model"])
    paths = images(tmp_path, [(64, 80), (64, 64)])
    theirs = pipe(image=[Image.open(p) for p in paths], prompt="make it red", num_inference_steps=3,
                  guidance_scale=guidance, generator=torch.Generator().manual_seed(3), output_type="pt").images[0]
    embeds = text(klein["model"], tmp_path, ["make it red", flux2.NEGATIVE_PROMPT])
    refs = [flux2.load_image(p, flux2.REFERENCE_AREA)[None] for p in paths]
    ours = flux2.sample((pipe.scheduler, pipe.transformer), pipe.vae, refs, flux2.text_row(embeds, 0), (64, 80), 3,
                        guidance, torch.Generator().manual_seed(3), negative=flux2.text_row(embeds, 1))
    assert torch.equal((ours * 0.5 + 0.5).clamp(0, 1), theirs)


def test_text_to_image_inputs_and_sampling_are_the_pipelines(klein, tmp_path):
    """A prompt alone (a text-to-image row, 64 x 80): what Flux2KleinPipeline hands its transformer (the target's
    tokens alone, their ids T = 0, the text and its ids, σ, no guidance) is what fine-tuning builds, and the room's
    sample without references is the pipeline's image, with true CFG against ""."""
    pipe = pipeline(klein["model"])
    seen = []
    pipe.transformer.register_forward_pre_hook(lambda m, a, kw: seen.append(kw) if not seen else None,
                                               with_kwargs=True)
    theirs = pipe(prompt="a red circle", height=64, width=80, num_inference_steps=1, guidance_scale=4.0,
                  max_sequence_length=32, generator=torch.Generator().manual_seed(3), output_type="pt").images[0]
    with torch.no_grad():  # the cache's text is the pipeline's: test_conditioning_is_the_pipelines
        embeds = pipe.encode_prompt(["a red circle", flux2.NEGATIVE_PROMPT], max_sequence_length=32)[0]
    call, noise = seen[0], torch.randn(1, 4, 8, 10, generator=torch.Generator().manual_seed(3))
    inputs = flux2.model_inputs(torch.zeros_like(noise), [], noise, torch.ones(1))
    assert torch.equal(inputs["hidden_states"], flux2.km.pack_latents(noise))
    assert inputs["n_target_tokens"] == call["hidden_states"].shape[1] == 20
    assert torch.equal(inputs["img_ids"], call["img_ids"]) and torch.equal(embeds[:1], call["encoder_hidden_states"])
    assert torch.equal(flux2.text_ids(embeds[:1]), call["txt_ids"])
    assert call["guidance"] is None and torch.equal(call["timestep"], torch.ones(1))
    ours = flux2.sample((pipe.scheduler, pipe.transformer), pipe.vae, [], flux2.text_row(embeds, 0), (64, 80), 1, 4.0,
                        torch.Generator().manual_seed(3), negative=flux2.text_row(embeds, 1))
    assert torch.equal((ours * 0.5 + 0.5).clamp(0, 1), theirs)


PROMPTS = ["make it red", "make the circle the colour of picture 2", "", "a blue square", "turn it green"]


def test_dev_text_is_the_pipelines(dev, tmp_path):
    """[dev]'s cached text is Flux2Pipeline.encode_prompt's (Mistral-3 under the system message and chat template,
    hidden states 10 / 20 / 30 stacked, pipeline_flux2.py:304-350), and so are its text ids."""
    pipe = pipeline(dev)
    with torch.no_grad():
        theirs, ids = pipe.encode_prompt(PROMPTS, max_sequence_length=DEV_LENGTH)
    ours = text(dev, tmp_path, PROMPTS, length=DEV_LENGTH)
    assert torch.equal(ours, theirs) and torch.equal(flux2.text_ids(ours), ids)
    assert not torch.equal(ours[0], ours[1])  # the prompts fit: not cut off after the system message


@pytest.mark.parametrize("variant", ["klein", "dev"])
def test_the_fill_counts_prompts_the_template_cuts(klein, dev, tmp_path, capsys, variant):
    """template_tokens is the number of tokens the pipeline's encode_prompt hands its text encoder unpadded (its
    attention mask's sum at 512), and a fill at a MAX_SEQUENCE_LENGTH under a prompt's count names it."""
    folder = klein["model"] if variant == "klein" else dev
    pipe = pipeline(folder)
    masks = []
    pipe.text_encoder.register_forward_pre_hook(lambda m, a, kw: masks.append(int(kw["attention_mask"].sum())),
                                                with_kwargs=True)
    with torch.no_grad():
        for p in PROMPTS:
            pipe.encode_prompt([p], max_sequence_length=512)
    counts = [flux2.template_tokens(pipe, p) for p in PROMPTS]
    assert counts == masks and len(set(counts)) > 1, (counts, masks)
    length = sorted(counts)[-2]  # the longest prompt (or prompts) cut, the others whole
    capsys.readouterr()
    text(folder, tmp_path, PROMPTS, length=length)
    longest = sorted(p for p, n in zip(PROMPTS, counts) if n > length)
    line = [ln for ln in capsys.readouterr().out.splitlines() if "run past MAX_SEQUENCE_LENGTH" in ln]
    assert len(line) == 1 and f"{len(longest)} prompts encoded here" in line[0] and repr(longest[0][:80]) in line[0]
    capsys.readouterr()
    text(folder, tmp_path / "whole", PROMPTS, length=max(counts))
    assert "run past" not in capsys.readouterr().out


def test_dev_sampling_loop_is_the_pipelines(dev, tmp_path):
    """FLUX.2 [dev]'s path (Flux2Pipeline: the Mistral-3 text, the guidance embedding, no CFG) equals the pipeline's
    output for the same prompt, and the training forward embeds GUIDANCE as the pipeline does."""
    pipe = pipeline(dev)
    paths = images(tmp_path, [(64, 64)])
    theirs = pipe(image=[Image.open(p) for p in paths], prompt="make it red", num_inference_steps=3,
                  guidance_scale=4.0, generator=torch.Generator().manual_seed(5), output_type="pt",
                  max_sequence_length=DEV_LENGTH).images[0]
    embeds = text(dev, tmp_path, ["make it red"], length=DEV_LENGTH)
    refs = [flux2.load_image(paths[0], flux2.REFERENCE_AREA)[None]]
    transformer = pipe.transformer
    ours = flux2.sample((pipe.scheduler, transformer), pipe.vae, refs, embeds, (64, 64), 3, 4.0,
                        torch.Generator().manual_seed(5))
    assert torch.equal((ours * 0.5 + 0.5).clamp(0, 1), theirs)
    inputs = flux2.model_inputs(torch.zeros(1, 4, 8, 8), [], torch.zeros(1, 4, 8, 8), torch.ones(1))
    seen = []
    transformer.register_forward_pre_hook(lambda m, a, kw: seen.append(kw), with_kwargs=True)
    flux2.forward(transformer, inputs, torch.ones(1), 3.5, embeds)
    assert torch.equal(seen[0]["guidance"], torch.full((1,), 3.5))  # GUIDANCE, as [dev]'s pipeline passes it


def test_references_the_pipelines_refuse_are_refused_in_one_line(klein, tmp_path):
    """A reference with a side under 64 px or an aspect ratio over 8 is refused naming the image, exactly where
    Flux2ImageProcessor.check_image_input refuses it; REFERENCE_AREA above the pipelines' hard-coded 1024^2 is
    refused for both scripts."""
    from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor
    for size in [(64, 64), (63, 64), (64, 512), (64, 513), (640, 80), (648, 80), (2048, 1024)]:
        path = tmp_path / f"{size[0]}x{size[1]}.png"
        Image.new("RGB", size).save(path)
        try:
            Flux2ImageProcessor.check_image_input(Image.open(path))
            refused = False
        except ValueError:
            refused = True
        row = {"control": str(path), "prompt": "p"}
        if refused:
            with pytest.raises(ConfigError, match=rf"{path.name}: a {size[0]}x{size[1]} px reference") as e:
                flux2.reference_sizes((64, 64), row, SETTINGS)
            assert "\n" not in str(e.value)
        else:
            flux2.reference_sizes((64, 64), row, SETTINGS)
        assert refused == (min(size) < 64 or max(size) / min(size) > 8), size
    big = {**SETTINGS, "REFERENCE_AREA": 1024 * 1024 + 1}
    with pytest.raises(ConfigError, match="REFERENCE_AREA=1048577: FLUX.2's pipelines downsize every reference"):
        flux2.check_edit_settings(klein["model"], big, {"REFERENCE_AREA"})
    with pytest.raises(ConfigError, match="REFERENCE_AREA=1048577"):
        flux2.check_dmd_settings("Flux2KleinPipeline", {**big, "MODEL_PATH": klein["model"]}, set(), "jsonl")


def test_refusals_are_one_line(klein):
    changed = {"GUIDANCE": 2.0, "SHIFT": "auto", "BUCKET_ASPECTS": [1.0, 2.0], "CONDITION_AREA": 4096}
    for name, value in changed.items():
        with pytest.raises(ConfigError, match=name) as e:
            flux2.check_edit_settings(klein["model"], {**SETTINGS, name: value}, {name})
        assert "\n" not in str(e.value)


def t2i_rows(klein) -> str:
    """The tiny data's targets as text-to-image rows ("image" and a prompt naming the shape), a .jsonl."""
    path = klein["root"] / "t2i.jsonl"
    if not path.exists():
        rows = [json.loads(line) for line in open(os.path.join(klein["data"], "data.jsonl"))]
        path.write_text("".join(json.dumps({"image": os.path.join(klein["data"], r["target"]),
                                            "prompt": "a " + r["prompt"].split()[2]}) + "\n" for r in rows))
    return str(path)


def test_text_to_image_rows_are_read_for_flux2_and_refused_where_a_family_trains_edits_only(klein):
    import families
    import train_flux_kontext as tfk
    train, held_out, _, _ = tfk.load_data(t2i_rows(klein), 2, 64, [1.0], 16, False, room=flux2, max_references=4)
    assert len(train) == 30 and all(set(r) == {"target", "prompt", "size"} for r in train + held_out)
    assert train[0]["prompt"] == "a diamond"
    kontext = families.FAMILIES["FluxKontextPipeline"]
    with pytest.raises(ConfigError, match="rows without a reference image .* on edits only") as e:
        tfk.load_data(t2i_rows(klein), 2, 64, [1.0], 16, False, room=kontext)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="VAL_DATA_PATH=.*: its rows have reference images") as e:
        tfk.load_data(t2i_rows(klein), 2, 64, [1.0], 16, False, room=flux2, max_references=4,
                      val_path=str(klein["root"] / "mixed.jsonl"))
    assert "\n" not in str(e.value)


def distilled_klein(klein, root):
    """The tiny klein-base with model_index.json's is_distilled set, as the step-wise distilled klein ships."""
    folder = root / "distilled"
    folder.mkdir()
    for name in os.listdir(klein["model"]):
        if name != "model_index.json":
            os.symlink(os.path.join(klein["model"], name), folder / name)
    index = json.load(open(os.path.join(klein["model"], "model_index.json")))
    (folder / "model_index.json").write_text(json.dumps({**index, "is_distilled": True}))
    return str(folder)


def test_a_distilled_klein_is_sampled_without_cfg_refused_as_a_teacher_and_stays_distilled(klein, tmp_path,
                                                                                          monkeypatch, capsys):
    """A step-wise distilled klein (is_distilled): fine-tuning's samples take no negative prompt whatever
    SAMPLE_GUIDANCE (its pipeline skips CFG); as a DMD2 teacher it is refused in one line naming klein-base; its
    export's model_index.json keeps is_distilled. klein-base samples with its CFG pair."""
    import train_flux_kontext
    from components.export import portable_json
    distilled = distilled_klein(klein, tmp_path)
    assert flux2.is_distilled(distilled) and not flux2.is_distilled(klein["model"])
    rows = [{"prompt": "make it blue", "control": ["a.png"]}]
    monkeypatch.setattr(train_flux_kontext, "SAMPLE_GUIDANCE", 4.0)
    for folder, negative in ((klein["model"], flux2.NEGATIVE_PROMPT), (distilled, None)):
        monkeypatch.setattr(train_flux_kontext, "MODEL_PATH", folder)
        texts, got = train_flux_kontext.cached_texts(flux2, "Flux2KleinPipeline", rows, [], rows)
        assert got == negative and len(texts) == 2 + (negative is not None)
    assert "is step-wise distilled (model_index.json is_distilled): sampled without CFG" in capsys.readouterr().out
    settings = {"MODEL_PATH": distilled, "REAL_GUIDANCE_SCALE": 0.0, "REAL_GUIDANCE_NORM": "", "FLUX_GUIDANCE": 3.5}
    with pytest.raises(ConfigError, match="step-wise distilled klein .* distil klein-base") as e:
        flux2.check_dmd_settings("Flux2KleinPipeline", settings, set(), "jsonl")
    assert "\n" not in str(e.value)
    export = tmp_path / "model_index.json"
    export.write_text(open(os.path.join(distilled, "model_index.json")).read())
    portable_json(str(export))  # the export's rewrite of the source's model_index.json
    assert json.loads(export.read_text())["is_distilled"] is True


def test_context_parallel_shapes_are_checked_before_any_work(klein):
    flux2.check_context_parallel(klein["model"], 2, SETTINGS, [((64, 64), ((64, 64), (32, 32)))])
    for c, settings, shapes in ((2, {**SETTINGS, "MAX_SEQUENCE_LENGTH": 31}, [((64, 64), ())]),
                                (2, SETTINGS, [((64, 64), ((48, 16),))]),  # 16 + 3 tokens
                                (4, SETTINGS, [((64, 64), ())])):  # 2 heads
        with pytest.raises(ConfigError, match=f"CONTEXT_PARALLEL={c}"):
            flux2.check_context_parallel(klein["model"], c, settings, shapes)


def test_default_lora_targets_are_diffusers(klein):
    """diffusers' FLUX.2 LoRA examples' targets: the double blocks' attention, the single blocks' fused input and
    their output Linear, not the double blocks' to_out ModuleList."""
    from parallel import lora as lora_lib
    names = lora_lib.check_lora_targets("Flux2Transformer2DModel", os.path.join(klein["model"], "transformer"),
                                        lora_lib.Lora(rank=4))
    assert "single_transformer_blocks.1.attn.to_out" in names and "to_qkv_mlp_proj" in names
    assert "to_out" not in names


def full_args(klein) -> list:
    """Full fine-tuning's arguments: EMA, validation, samples with true CFG, RANDOM_FLIP, caption dropout."""
    return klein["common"] + ["--ema_decay=0.9", "--save_every=2", "--sample_every=4", "--val_every=2",
                              "--random_flip=1", "--caption_dropout=0.3", "--sample_guidance=4"]


@pytest.fixture(scope="module")
def compiled_run(klein):
    """Full fine-tuning compiled (COMPILE=1), started with the file's first launch and waited for by the last
    test, which reads it (returns the wait): it spends most of its time in g++, one process at a time while
    its other rank waits, and the file's other launches and tests fill the spare core."""
    out = klein["root"] / "compiled"
    wait, kill = start_all({"compiled": dict(script="train_flux_kontext.py", env=klein["env"],
                                             args=full_args(klein) + [f"--output_dir={out}", "--compile=1"])},
                           timeout=1800)
    yield lambda: (out, wait()["compiled"].stdout)
    kill()


@pytest.fixture(scope="module")
def runs(klein, compiled_run):
    """Full fine-tuning (full_args), the same with CONTEXT_PARALLEL=2 (the 2 ranks one DP group: the same
    samples), the same resumed from its step-2 checkpoint, and a LoRA run on an NF4 base with AC, cached latents
    and 8-bit AdamW; the compiled run (compiled_run) starts first."""
    root = klein["root"]
    common = full_args(klein)
    out = {k: root / k for k in ("full", "stopped", "lora", "cp")}
    jobs = {
        "full": dict(script="train_flux_kontext.py", args=common + [f"--output_dir={out['full']}"], env=klein["env"]),
        "cp": dict(script="train_flux_kontext.py", args=common + [f"--output_dir={out['cp']}", "--context_parallel=2",
                                                                   "--batch_size=2"], env=klein["env"]),
        "lora": dict(script="train_flux_kontext.py", args=klein["common"] + [
            f"--output_dir={out['lora']}", "--lora_rank=4", "--sample_every=0", "--val_every=0", "--save_every=0",
            "--base_dtype=nf4", "--activation_checkpointing=1", "--cache_latents=1", "--optimizer=adamw8bit"],
            env=klein["env"]),
    }
    resumed = dict(script="train_flux_kontext.py", args=common + [f"--output_dir={out['stopped']}", "--resume=auto"],
                   env=klein["env"])
    done = launch_all_resuming(jobs, "full", resumed, timeout=900)  # beside the compiled run: slower than alone
    return {"out": out, "logs": {k: v.stdout for k, v in done.items()}, "resumed": done["resumed"].stdout}


@pytest.mark.slow
def test_resume_is_bit_exact(runs):
    a, b = read_checkpoint(runs["out"]["full"], STEPS), read_checkpoint(runs["out"]["stopped"], STEPS)
    for name in ("model.transformer", "model.ema"):
        assert all(torch.equal(a[name][k], b[name][k]) for k in a[name]), name
    assert read_metrics(runs["out"]["full"])[-1]["loss"] == read_metrics(runs["out"]["stopped"])[-1]["loss"]
    assert any("val_loss" in r for r in read_metrics(runs["out"]["full"]))
    assert os.path.exists(runs["out"]["full"] / "samples" / f"step_{STEPS:06d}.png")
    assert "(step 2)" in runs["resumed"]
    # trained at MAX_SEQUENCE_LENGTH 32, not the pipeline's 512: the loading line passes it (no text mask)
    assert "sampling the export: pipe(..., max_sequence_length=32)" in runs["logs"]["full"]


@pytest.mark.slow
def test_exports_load_and_sample_with_the_pipeline(klein, runs, tmp_path):
    """The full export loads with from_pretrained and holds the EMA weights; the LoRA export (trained on the NF4
    base) loads on the base with load_lora_weights and changes its edits."""
    paths = images(tmp_path, [(64, 64), (64, 64)])
    call = dict(image=[Image.open(p) for p in paths], prompt="make it blue", num_inference_steps=2,
                guidance_scale=4.0, output_type="np", max_sequence_length=32)
    full = pipeline(str(runs["out"]["full"] / "export"))
    ema = read_checkpoint(runs["out"]["full"], STEPS)["model.ema"]
    exported = full.transformer.state_dict()
    assert all(torch.equal(exported[k], v) for k, v in ema.items() if k in exported)
    assert np.isfinite(full(**call, generator=torch.Generator().manual_seed(0)).images).all()
    base = pipeline(klein["model"])
    before = base(**call, generator=torch.Generator().manual_seed(0)).images
    base.load_lora_weights(str(runs["out"]["lora"] / "export"))
    after = base(**call, generator=torch.Generator().manual_seed(0)).images
    assert np.isfinite(after).all() and not np.array_equal(before, after)
    with open(os.path.join(runs["out"]["full"], "export", "model_index.json")) as f:
        assert json.load(f)["_class_name"] == "Flux2KleinPipeline"


@pytest.mark.slow
def test_context_parallel_trains_as_data_parallel(runs):
    """CONTEXT_PARALLEL=2 (Ulysses, the transformer's _cp_plan splitting text and [target ; references] tokens)
    gives the losses, validation losses and grad norms of the 2-rank data-parallel run on the same samples, and
    its weights within a small fraction of one step's LR (the same sums in another order)."""
    assert "context parallel: 1 data-parallel group(s) of 2 ranks" in runs["logs"]["cp"]
    assert_metrics_match(runs["out"]["full"], runs["out"]["cp"])
    from safetensors.torch import load_file
    file = "transformer/diffusion_pytorch_model.safetensors"
    wa, wb = (load_file(str(runs["out"][k] / "export" / file)) for k in ("full", "cp"))
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-5, atol=2e-5, msg=k)


@pytest.fixture(scope="module")
def t2i_runs(klein):
    """Text-to-image fine-tuning (rows without references): LoRA on 2 ranks (validation, samples with true CFG), the
    same in one process at twice the batch, the 2-rank run resumed from its step-2 checkpoint, and a full fine-tune
    of a caption folder (no control/) sampled from a .txt of prompts (SAMPLE_PROMPTS)."""
    root, data = klein["root"], t2i_rows(klein)
    folder = root / "t2i_folder"
    folder.mkdir(exist_ok=True)
    for i, line in enumerate(open(data)):
        row = json.loads(line)
        if not (folder / f"{i:03d}.png").exists():
            os.link(row["image"], folder / f"{i:03d}.png")
        (folder / f"{i:03d}.txt").write_text(row["prompt"])
    (root / "t2i_prompts.txt").write_text("a circle\na square\n")
    lora = [a for a in klein["common"] if not a.startswith("--data_path=")] + [
        f"--data_path={data}", "--lora_rank=4", "--save_every=2", "--val_every=2", "--sample_every=4",
        "--sample_guidance=4"]
    out = {k: root / k for k in ("t2i_lora", "t2i_one", "t2i_stopped", "t2i_full")}
    jobs = {
        "t2i_lora": dict(script="train_flux_kontext.py", args=lora + [f"--output_dir={out['t2i_lora']}"],
                         env=klein["env"]),
        "t2i_one": dict(script="train_flux_kontext.py", ranks=1, env=klein["env"],
                        args=lora + [f"--output_dir={out['t2i_one']}", "--batch_size=2"]),
        "t2i_full": dict(script="train_flux_kontext.py", env=klein["env"], args=[
            a for a in klein["common"] if not a.startswith("--data_path=")] + [
            f"--data_path={folder}", f"--output_dir={out['t2i_full']}", "--save_every=0", "--val_every=0",
            "--sample_every=4", f"--sample_prompts={root / 't2i_prompts.txt'}"]),
    }
    resumed = dict(script="train_flux_kontext.py", args=lora + [f"--output_dir={out['t2i_stopped']}", "--resume=auto"],
                   env=klein["env"])
    done = launch_all_resuming(jobs, "t2i_lora", resumed)
    return {"out": out, "logs": {k: v.stdout for k, v in done.items()}}


@pytest.mark.slow
def test_text_to_image_lora_resumes_bit_exact_and_trains_on_two_ranks_as_in_one_process(t2i_runs):
    from tests.conftest import assert_kontext_resumed_bit_exact
    out = t2i_runs["out"]
    assert "data: 30 training pairs" in t2i_runs["logs"]["t2i_lora"]
    assert_kontext_resumed_bit_exact(out["t2i_lora"], out["t2i_stopped"], STEPS, models=("model.transformer",))
    assert [r["step"] for r in read_metrics(out["t2i_lora"]) if "val_loss" in r] == [2, 4]
    assert_metrics_match(out["t2i_lora"], out["t2i_one"])
    for run in ("t2i_lora", "t2i_full"):
        assert os.path.exists(out[run] / "samples" / f"step_{STEPS:06d}.png")


@pytest.mark.slow
def test_text_to_image_exports_load_and_sample_a_prompt(klein, t2i_runs):
    """The LoRA export loads on the base with Flux2KleinPipeline + load_lora_weights and changes what a prompt alone
    samples; the full export loads with from_pretrained and samples it."""
    call = dict(prompt="a circle", height=64, width=64, num_inference_steps=2, guidance_scale=4.0, output_type="np",
                max_sequence_length=32)
    base = pipeline(klein["model"])
    before = base(**call, generator=torch.Generator().manual_seed(0)).images
    base.load_lora_weights(str(t2i_runs["out"]["t2i_lora"] / "export"))
    after = base(**call, generator=torch.Generator().manual_seed(0)).images
    assert np.isfinite(after).all() and not np.array_equal(before, after)
    full = pipeline(str(t2i_runs["out"]["t2i_full"] / "export"))
    assert np.isfinite(full(**call, generator=torch.Generator().manual_seed(0)).images).all()


def _sharded_fill(rank, world, model_path, cache_dir, length):
    """Every rank takes part in each forward of the sharded encoder, though the shares are 3 and 2 prompts."""
    settings = {**SETTINGS, "SHARD_TEXT_ENCODER": "1", "MAX_SEQUENCE_LENGTH": length}
    assert flux2.shard_text_encoder(model_path, settings, torch.float32, torch.device("cpu"))
    encoder = flux2.load_sharded_text_encoder(model_path, torch.float32, torch.device("cpu")).text_encoder
    from torch.distributed.tensor import DTensor
    weight = encoder.get_decoder().layers[0].mlp.up_proj.weight
    assert isinstance(weight, DTensor) and weight.to_local().shape[0] == weight.shape[0] // world
    del encoder
    identity = flux2.prepare_edit_text([(p, {}) for p in PROMPTS], model_path, cache_dir, settings, torch.float32,
                                       torch.device("cpu"))
    assert len(os.listdir(cache_dir)) > 0 and identity


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["klein", "dev"])
def test_a_sharded_encoder_fills_the_cache_as_one_process_does(klein, dev, tmp_path, variant):
    """SHARD_TEXT_ENCODER=1 on 2 ranks (klein's Qwen3 or [dev]'s Mistral-3 built on meta, one FSDP unit per decoder
    layer, each rank loading its slices, its RoPE tables remade on the host) caches the embeddings one unsharded
    process computes."""
    folder, length = (klein["model"], 32) if variant == "klein" else (dev, DEV_LENGTH)
    run_ranks(_sharded_fill, 2, folder, str(tmp_path / "sharded"), length)
    pairs = [(p, {}) for p in PROMPTS]
    ours = flux2.load_text(pairs, str(tmp_path / "sharded"), flux2.folder_identity(
        folder, flux2.TEXT_PARTS, length, "fp32"), torch.device("cpu"))
    theirs = text(folder, tmp_path, PROMPTS, length=length)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------
# DMD2 with a FLUX.2 klein-base teacher (train_dmd.py's one flow setup)


class _OneByOne(torch.nn.Module):
    """The transformer run on each sample of a batch alone, as the pipeline runs its prompt and its "" (a batch of
    2 sums its matrix products in another order: equal only to rounding)."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config = model, model.config

    def forward(self, hidden_states, encoder_hidden_states, timestep, img_ids, txt_ids, guidance, return_dict):
        outs = [self.model(hidden_states=hidden_states[i:i + 1], encoder_hidden_states=encoder_hidden_states[i:i + 1],
                           timestep=timestep[i:i + 1], img_ids=img_ids[i:i + 1], txt_ids=txt_ids[i:i + 1],
                           guidance=guidance, return_dict=False)[0] for i in range(hidden_states.shape[0])]
        return (torch.cat(outs),)


def test_teacher_cfg_pair_is_the_pipelines(klein, tmp_path):
    """The teacher's real score with REAL_GUIDANCE_NORM=none is the pipeline's true-CFG prediction at the same
    latents, σ and references (the prompt's half of the pair and the negative's, combined as it combines them),
    and token rescales that pair. Target 64 x 96 and a reference 64 x 80 (h x w): not square, so their ids are
    told from their transposes'."""
    from algorithms import dmd2 as dm
    pipe = pipeline(klein["model"])
    paths = images(tmp_path, [(64, 80), (64, 64)])
    seen = []
    step = pipe.scheduler.step
    pipe.scheduler.step = lambda out, t, x, **kw: (seen.append((out.clone(), x.clone(), t)), step(out, t, x, **kw))[1]
    pipe(image=[Image.open(p) for p in paths], prompt="make it red", num_inference_steps=2, guidance_scale=4.0,
         height=64, width=96, generator=torch.Generator().manual_seed(1), output_type="latent",
         max_sequence_length=32)
    theirs, x, t = seen[1]  # the second step: σ below 1
    embeds = text(klein["model"], tmp_path, ["make it red", ""], length=32)
    refs = [flux2.load_image(p, flux2.REFERENCE_AREA)[None] for p in paths]
    cond = flux2.dmd_cond(embeds[:1], embeds[1:], pipe.vae, refs, (8, 12))
    teacher, sigma = _OneByOne(pipe.transformer), t.expand(1) / 1000
    assert torch.equal(cond.velocity(teacher, 4.0, "none")(x, sigma), theirs.float())
    plain = cond.velocity(teacher, 1.0)(x, sigma)
    neg = flux2.dmd_cond(embeds[1:], None, pipe.vae, refs, (8, 12)).velocity(teacher, 1.0)(x, sigma)
    assert torch.equal(cond.velocity(teacher, 4.0, "token")(x, sigma), dm.cfg_combine(plain, neg, 4.0, "token"))


@pytest.fixture(scope="module")
def dmd_runs(klein, dev):
    """DMD2 of the tiny klein-base teacher to a 4-step generator on the mixed rows: full generator and fake score
    with the GAN head and EMA on 2 ranks, the same resumed from its step-2 checkpoint; a LoRA generator and fake score
    on an NF4 teacher and bases; text to image on the rows' prompts alone (a .txt); a LoRA generator and fake score
    of the tiny [dev] teacher at FLUX_GUIDANCE 3.5."""
    root = klein["root"]
    prompts = root / "prompts.txt"
    prompts.write_text("".join(json.loads(line)["prompt"] + "\n" for line in open(root / "mixed.jsonl")))
    common = [f"--model_path={klein['model']}", f"--data_path={root / 'mixed.jsonl'}",
              f"--text_cache_dir={root / 'dmd_text_cache'}", "--precision=fp32", "--resolution=64",
              "--max_sequence_length=32", "--max_steps=4", "--log_every=1", "--denoising_steps=999,749,499,249",
              "--batch_size=1", "--sample_count=2", "--dfake_gen_update_ratio=2", "--ema_decay=0.9", "--save_every=2",
              "--sample_every=4", "--export_dtype=fp32"]
    gan = ["--use_gan=1", "--gen_cls_loss_weight=0.1", "--guidance_cls_loss_weight=0.1"]
    out = {k: root / ("dmd_" + k) for k in ("full", "stopped", "lora", "t2i", "dev")}
    job = functools.partial(dict, script="train_dmd.py", env=klein["env"])
    done = launch_all_resuming({
        "full": job(args=common + gan + [f"--output_dir={out['full']}", *VALIDATE]),
        "lora": job(args=common + [f"--output_dir={out['lora']}", "--lora_rank=4", "--fake_lora=1",
                                   "--base_dtype=nf4", "--save_every=0", *VALIDATE]),
        "t2i": job(args=common + [f"--output_dir={out['t2i']}", f"--data_path={prompts}", "--max_steps=2",
                                  "--save_every=0", "--sample_every=2"]),
        "dev": job(args=common + [f"--output_dir={out['dev']}", f"--model_path={dev}", "--flux_guidance=3.5",
                                  f"--max_sequence_length={DEV_LENGTH}", "--lora_rank=4", "--fake_lora=1",
                                  "--save_every=0"])},
        "full", job(args=common + gan + [f"--output_dir={out['stopped']}", "--resume=auto", *VALIDATE]), timeout=600)
    return {"out": out, "logs": {k: v.stdout for k, v in done.items()}, "resumed": done["resumed"].stdout}


@pytest.mark.slow
def test_dmd_resumes_bit_exact_with_the_teachers_cfg(dmd_runs):
    a, b = read_checkpoint(dmd_runs["out"]["full"], 4), read_checkpoint(dmd_runs["out"]["stopped"], 4)
    for name in ("model.generator", "model.fake", "model.ema", "model.head"):
        assert all(torch.equal(a[name][k], b[name][k]) for k in a[name]), name
    # the last record holds step 4's validation too: the resumed run's curve continues the first one's, and
    # the collapse warning's best so far came back with the checkpoint
    assert read_metrics(dmd_runs["out"]["full"], timing=False)[-1] == \
        read_metrics(dmd_runs["out"]["stopped"], timing=False)[-1]
    assert_validated(dmd_runs["out"]["full"], [2, 4])
    best = [checkpoint.read_meta(dict(checkpoint.list_checkpoints(str(dmd_runs["out"][k])))[4])["val_best"]
            for k in ("full", "stopped")]
    assert best[0] == best[1] > 0
    assert "teacher true CFG 4 (token rescale)" in dmd_runs["logs"]["full"]
    assert "pipe(..., num_inference_steps=4, max_sequence_length=32)" in dmd_runs["logs"]["full"]
    assert "(step 2)" in dmd_runs["resumed"]
    for k in ("full", "t2i"):
        assert any(name.endswith(".png") for name in os.listdir(dmd_runs["out"][k] / "samples")), k
    assert "data: 32 prompts from" in dmd_runs["logs"]["t2i"]
    # validation on 2 ranks, NF4: the teacher's reference on the pipelines' shift (sampling_shift), true CFG
    assert_validated(dmd_runs["out"]["lora"], [2, 4], dmd_runs["logs"]["lora"])


@pytest.mark.slow
def test_dmd_exports_sample_in_four_steps_at_the_trained_sigmas(klein, dmd_runs, tmp_path):
    """The full export is a distilled klein (is_distilled: one forward per step, guidance ignored) whose scheduler
    samples the trained σ list [1, .75, .5, .25] at the pipeline's default call; the LoRA export does the same on
    the base with its scheduler and is_distilled=True."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline
    paths = images(tmp_path, [(64, 64), (64, 64)])
    call = dict(image=[Image.open(p) for p in paths], prompt="make it blue", num_inference_steps=4,
                guidance_scale=4.0, output_type="np", max_sequence_length=32)
    full = pipeline(str(dmd_runs["out"]["full"] / "export"))
    lora = Flux2KleinPipeline.from_pretrained(klein["model"], is_distilled=True)
    lora.load_lora_weights(str(dmd_runs["out"]["lora"] / "export"))
    lora.scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(str(dmd_runs["out"]["lora"] / "export"),
                                                                     subfolder="scheduler")
    for pipe in (full, lora):
        assert pipe.config.is_distilled
        seen = []
        pipe.transformer.register_forward_pre_hook(lambda m, a, kw: seen.append(float(kw["timestep"][0])),
                                                   with_kwargs=True)
        assert np.isfinite(pipe(**call, generator=torch.Generator().manual_seed(0)).images).all()
        assert seen == pytest.approx([1.0, 0.75, 0.5, 0.25], abs=1e-6)
    assert "Flux2KleinPipeline.from_pretrained(MODEL_PATH, is_distilled=True)" in dmd_runs["logs"]["lora"]


@pytest.mark.slow
def test_a_klein_lora_fine_tune_is_the_teacher_and_its_4_step_student_loads_on_the_base(klein, runs, tmp_path):
    """klein-base from edits to a 4-step editor: the LoRA fine-tune on its NF4 base (runs' lora) -> DMD2 on base +
    that LoRA (TEACHER_LORA, recipes/dmd_flux2_klein_4step_lora.sh) equals the run on the folder
    tools/merge_lora.py writes step for step -> the 4-step LoRA export, holding the fine-tune's adapters and the
    student's, loads on the plain base with is_distilled and samples at the trained σ."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline

    from parallel import lora_merge
    args = [f"--text_cache_dir={klein['root'] / 'dmd_text_cache'}", "--precision=fp32", "--resolution=64",
            "--max_sequence_length=32", "--batch_size=1"]
    tuned = runs["out"]["lora"] / "export"
    done = chain(klein["model"], klein["root"] / "mixed.jsonl", tuned, klein["root"], klein["env"], args)
    a, b = (read_metrics(done["out"][k], timing=False) for k in ("lora", "merged"))
    assert [(r["loss_dm"], r["loss_fake"]) for r in a] == [(r["loss_dm"], r["loss_fake"]) for r in b]
    teacher, exported = lora_merge.read_lora(str(tuned)), lora_merge.read_lora(str(done["out"]["lora"] / "export"))
    assert set(teacher.layers) <= set(exported.layers)
    pipe = Flux2KleinPipeline.from_pretrained(klein["model"], is_distilled=True)
    pipe.load_lora_weights(str(done["out"]["lora"] / "export"))
    pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(str(done["out"]["lora"] / "export"),
                                                                     subfolder="scheduler")
    pipe.set_progress_bar_config(disable=True)
    seen = []
    pipe.transformer.register_forward_pre_hook(lambda m, a, kw: seen.append(float(kw["timestep"][0])),
                                               with_kwargs=True)
    paths = images(tmp_path, [(64, 64), (64, 64)])
    out = pipe(image=[Image.open(p) for p in paths], prompt="make it blue", num_inference_steps=4, output_type="np",
               max_sequence_length=32, generator=torch.Generator().manual_seed(0)).images
    assert np.isfinite(out).all() and seen == pytest.approx([1.0, 0.75, 0.5, 0.25], abs=1e-6)


def test_dmd_guidance_sides_and_refusals(klein, dev):
    """klein-base: the teacher's true CFG against "" at the pipeline's 4, rescaled per token, nothing embedded, a
    distilled export says is_distilled; [dev] (a transformer with the guidance embedding, Flux2Pipeline): every
    transformer takes FLUX_GUIDANCE, no pair, and a CFG scale is refused in one line, as klein refuses
    FLUX_GUIDANCE."""
    settings = {"MODEL_PATH": klein["model"], "REAL_GUIDANCE_SCALE": 0.0, "REAL_GUIDANCE_NORM": "",
                "FLUX_GUIDANCE": 3.5}
    g = flux2.dmd_guidance(settings)
    assert (g.scale, g.norm, g.negative, g.embedded) == (4.0, "token", "", None)
    assert flux2.distilled_index(klein["model"]) == {"is_distilled": True}
    with pytest.raises(ConfigError, match="FLUX_GUIDANCE=3.5 with a Flux2KleinPipeline teacher"):
        flux2.check_dmd_settings("Flux2KleinPipeline", settings, {"FLUX_GUIDANCE"}, "jsonl")
    settings["MODEL_PATH"] = dev
    g = flux2.dmd_guidance(settings)
    assert (g.scale, g.negative, g.embedded, g.export_call) == (1.0, None, 3.5, "guidance_scale=3.5")
    # FLUX_GUIDANCE and GUIDANCE 0: [dev]'s one value, Flux2Pipeline's default 4; klein has no embedding
    assert flux2.dmd_guidance({**settings, "FLUX_GUIDANCE": 0.0}).export_call == "guidance_scale=4.0"
    assert (flux2.default_guidance(dev), flux2.default_guidance(klein["model"])) == (4.0, 1.0)
    assert flux2.distilled_index(dev) == {}
    with pytest.raises(ConfigError, match="REAL_GUIDANCE_SCALE=4.0 with a Flux2Pipeline teacher") as e:
        flux2.check_dmd_settings("Flux2Pipeline", {**settings, "REAL_GUIDANCE_SCALE": 4.0}, set(), "jsonl")
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_dmd_of_dev_trains_through_its_guidance_embedding(dev, dmd_runs, tmp_path):
    """A [dev] teacher: no CFG pair, every transformer embeds FLUX_GUIDANCE; the LoRA generator trains, and its
    export loads on the base with load_lora_weights and samples the trained σ list in 4 steps at that guidance."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from safetensors.torch import load_file
    log, out = dmd_runs["logs"]["dev"], dmd_runs["out"]["dev"]
    assert "(Flux2Pipeline)" in log and "guidance 3.5):" in log and "guidance_scale=3.5" in log
    metrics = read_metrics(out, timing=False)
    assert [r["step"] for r in metrics] == [1, 2, 3, 4]
    assert all(np.isfinite(r["loss_fake"]) and r["grad_norm_guidance"] > 0 for r in metrics)
    lora = load_file(str(out / "export" / "pytorch_lora_weights.safetensors"))
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in lora.items())  # B starts at 0
    pipe = pipeline(dev)
    pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(str(out / "export"), subfolder="scheduler")
    paths = images(tmp_path, [(64, 64), (64, 64)])  # the pipeline refuses references under 64 px
    call = dict(image=[Image.open(p) for p in paths], prompt="make it blue", num_inference_steps=4,
                guidance_scale=3.5, output_type="np", max_sequence_length=DEV_LENGTH)
    before = pipe(**call, generator=torch.Generator().manual_seed(0)).images
    pipe.load_lora_weights(str(out / "export"))
    seen = []
    pipe.transformer.register_forward_pre_hook(
        lambda m, a, kw: seen.append((float(kw["timestep"][0]), float(kw["guidance"][0]))), with_kwargs=True)
    after = pipe(**call, generator=torch.Generator().manual_seed(0)).images
    assert np.isfinite(after).all() and not np.array_equal(before, after)
    assert [t for t, _ in seen] == pytest.approx([1.0, 0.75, 0.5, 0.25], abs=1e-6) and {g for _, g in seen} == {3.5}


@pytest.mark.slow
def test_compiled_trains_as_eager(runs, compiled_run):
    """COMPILE=1: each block kind compiles whole (Flux2TransformerBlock, Flux2SingleTransformerBlock: 2 graphs, no
    break), the same losses and grad norms per step (1e-5 relative: fused kernels reorder fp32 sums) and exported
    weights within LR / 20 of eager's. Last in the file: the compiled run overlaps everything before."""
    out, log = compiled_run()
    assert_trains_as_eager(runs["out"]["full"], out, lr=LR, steps=STEPS)
    line = next(line for line in log.splitlines() if line.startswith("compile: "))
    assert line.startswith("compile: 2 graphs, 0 graph breaks ("), line
