"""The Z-Image room (families/z_image/) and train_dmd.py's DMD2 of a Z-Image base teacher, on the tiny ZImagePipeline
folder (32 x 32 px: 4 x 4 latents, 4 tokens of 2x2 patches).

Conditioning equals ZImagePipeline's own tensors: the cached Qwen3 text is encode_prompt's list (the chat template
with enable_thinking=True, hidden_states[-2], the unmasked tokens only), the latents are (mode - shift) * scale and
decode as the pipeline decodes, the transformer gets a list of (C, 1, h, w) and the timestep 1 - σ, the velocity
is the negated output, the teacher's CFG is the pipeline's pos + g (pos - neg) (g = w - 1) with its
cfg_normalization as REAL_GUIDANCE_NORM=scalar, and the room's velocity in the pipeline's scheduler loop gives its
output. The runs: DMD2 on 2 ranks equals one process (GRAD_ACCUM=2), resume is bit-exact, LoRA and full students
export, both load in ZImagePipeline (the LoRA with load_lora_weights) and sample in 4 steps at the trained σ with
guidance_scale=0.

    python -m pytest tests/test_z_image.py -q
"""
from __future__ import annotations

import functools
import inspect
import json
import re

import numpy as np
import pytest
import torch

import families
from algorithms import flux_kontext as km
from core.errors import ConfigError
from families import z_image
from tests.conftest import (VALIDATE, assert_metrics_match, assert_two_ranks_equal_one_and_resumed, assert_validated,
                            chain, launch_all_resuming, launch_env, read_metrics, tiny_default)

SIZE = 32
SETTINGS = {"RESOLUTION": SIZE, "MAX_SEQUENCE_LENGTH": 512, "USE_GAN": False, "FLUX_GUIDANCE": 0.0,
            "REAL_GUIDANCE_SCALE": 0.0, "REAL_GUIDANCE_NORM": "", "BUCKET_ASPECTS": [1.0]}
PROMPTS = ["a red circle on a blue background", "a green square"]


@pytest.fixture(scope="module")
def tiny():
    model, data = tiny_default("z_image")
    return {"model": model, "data": data, "settings": {**SETTINGS, "MODEL_PATH": model}}


@functools.lru_cache(maxsize=1)
def pipeline(model):
    from diffusers import ZImagePipeline
    pipe = ZImagePipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def cached_text(tiny, tmp_path, prompts, length=512):
    settings = {**tiny["settings"], "MAX_SEQUENCE_LENGTH": length}
    pairs = [(p, {}) for p in prompts]
    identity = z_image.prepare_edit_text(pairs, tiny["model"], str(tmp_path / "tc"), settings, torch.float32,
                                         torch.device("cpu"))
    return z_image.load_text(pairs, str(tmp_path / "tc"), identity, torch.device("cpu"))


@pytest.mark.parametrize("length", [512, 12])
def test_text_is_encode_prompts(tiny, tmp_path, length):
    """The cache holds encode_prompt's list: each prompt under the chat template (enable_thinking=True: no empty
    think block), hidden_states[-2] of its unmasked tokens, of its own length (12: cut as the tokenizer truncates,
    the template counted); the negative "" too."""
    pipe = pipeline(tiny["model"])
    ours = cached_text(tiny, tmp_path, PROMPTS + [z_image.NEGATIVE_PROMPT], length)
    with torch.no_grad():
        theirs, _ = pipe.encode_prompt(PROMPTS + [""], do_classifier_free_guidance=False, max_sequence_length=length)
        ids = [pipe.tokenizer(pipe.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                                 add_generation_prompt=True,
                                                                 enable_thinking=True)).input_ids
               for p in PROMPTS + [""]]
        hidden = pipe.text_encoder(input_ids=torch.tensor(ids[:1]), output_hidden_states=True).hidden_states
    assert len(ours) == 3 and all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert "<think>" not in pipe.tokenizer.decode(ids[0]) and pipe.tokenizer.pad_token_id not in ids[0]
    assert [len(e) for e in ours] == [min(len(i), length) for i in ids] and len(ids[1]) < len(ids[0])
    if length == 512:
        torch.testing.assert_close(ours[0], hidden[-2][0])


def test_latents_and_decode_are_the_pipelines(tiny):
    """encode_latents is (mode - shift_factor) * scaling_factor; decode_tokens unpacks the 2x2 tokens and decodes as
    the pipeline does (/ scaling_factor + shift_factor); tokens and latents are each other's reshape."""
    pipe = pipeline(tiny["model"])
    vae = pipe.vae
    image = torch.rand(1, 3, SIZE, SIZE) * 2 - 1
    with torch.no_grad():
        mode = vae.encode(image).latent_dist.mode()
        pixels = vae.decode(mode, return_dict=False)[0]
    latents = z_image.encode_latents(vae, image)
    assert torch.equal(latents, (mode - vae.config.shift_factor) * vae.config.scaling_factor)
    tokens = z_image.image_tokens(vae, image)
    assert tokens.shape == (1, 4, 16) and torch.equal(km.unpack_latents(tokens, 4, 4), latents)
    torch.testing.assert_close(z_image.decode_tokens(vae, tokens, (4, 4)), pixels, rtol=1e-5, atol=1e-5)
    assert z_image.vae_factor(tiny["model"]) == 8 and z_image.latent_channels(vae) == 4


def test_velocity_sign_timestep_and_cfg_are_the_pipelines(tiny):
    """The transformer gets a list of (C, 1, h, w) and the timestep 1 - σ; the velocity is its output negated; the
    teacher's pair in one call is the pipeline's pos + g (pos - neg) at g = w - 1, capped per sample at pos's norm
    with norm "scalar" (cfg_normalization=True); diffusers' negative "" and guidance_scale 5 (w = 6); the export
    samples at guidance_scale=0."""
    pipe = pipeline(tiny["model"])
    model = pipe.transformer
    g = z_image.dmd_guidance({"REAL_GUIDANCE_SCALE": 0.0, "REAL_GUIDANCE_NORM": ""})
    assert (g.scale, g.norm, g.negative, g.embedded, g.export_call) == (6.0, "none", "", None, "guidance_scale=0.0")
    assert z_image.dmd_guidance({"REAL_GUIDANCE_SCALE": 1.0, "REAL_GUIDANCE_NORM": ""}).negative is None
    gen = torch.Generator().manual_seed(0)
    text = [torch.randn(9, 16, generator=gen), torch.randn(14, 16, generator=gen)]
    negative = [torch.randn(5, 16, generator=gen)] * 2
    x, sigma = torch.randn(2, 4, 4, 4, generator=gen), torch.tensor([0.8, 0.3])
    seen = []
    hook = model.register_forward_pre_hook(lambda m, a, kw: seen.append(a), with_kwargs=True)
    with torch.no_grad():
        cond = z_image.dmd_cond(text, negative, None, [], (4, 4))
        plain = km.unpack_latents(cond.velocity(model, 1.0)(km.pack_latents(x), sigma), 4, 4)
        paired = {n: km.unpack_latents(cond.velocity(model, 6.0, n)(km.pack_latents(x), sigma), 4, 4)
                  for n in ("none", "scalar")}
        hook.remove()
        t = (1000 - sigma * 1000) / 1000
        pos = torch.stack([o.squeeze(1) for o in model(list(x.unsqueeze(2).unbind(0)), t, text, return_dict=False)[0]])
        neg = torch.stack([o.squeeze(1) for o in model(list(x.unsqueeze(2).unbind(0)), t, negative,
                                                       return_dict=False)[0]])
    latents, timestep, caps = seen[0]
    assert [tuple(a.shape) for a in latents] == [(4, 1, 4, 4)] * 2 and caps == text
    assert torch.equal(timestep, t) and timestep.tolist() == pytest.approx([0.2, 0.7])
    torch.testing.assert_close(plain, -pos)
    assert len(seen[1][0]) == 4 and seen[1][2] == text + negative  # the pair as the pipeline batches it
    pred = pos + 5.0 * (pos - neg)
    torch.testing.assert_close(paired["none"], -pred, rtol=1e-4, atol=1e-5)
    cap = torch.stack([p * min(1.0, float(q.norm() / p.norm())) for p, q in zip(pred, pos)])
    torch.testing.assert_close(paired["scalar"], -cap, rtol=1e-4, atol=1e-5)


def test_sampling_loop_is_the_pipelines(tiny, tmp_path):
    """The room's teacher velocity (cached text and "", w = 6, the tokens unpacked) in the pipeline's own scheduler
    loop (σ linspace(1, 1/3, 3) under the static shift 6), from the noise the pipeline draws, gives its latents,
    and decode_tokens its image."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.z_image.pipeline_z_image import get_default_z_image_sigmas
    from diffusers.utils.torch_utils import randn_tensor
    pipe = pipeline(tiny["model"])
    captured = {}

    def keep(p, i, t, kw):
        captured["latents"] = kw["latents"]
        return kw
    image = pipe(PROMPTS[0], height=SIZE, width=SIZE, num_inference_steps=3, generator=torch.Generator().manual_seed(0),
                 output_type="pt", callback_on_step_end=keep).images
    text = cached_text(tiny, tmp_path, [PROMPTS[0], ""])
    x = randn_tensor((1, 4, 4, 4), generator=torch.Generator().manual_seed(0), dtype=torch.float32)
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config)
    scheduler.set_timesteps(sigmas=get_default_z_image_sigmas(3))
    scheduler.set_begin_index(0)
    shifted = [6 * s / (1 + 5 * s) for s in np.linspace(1.0, 1 / 3, 3)]
    assert scheduler.sigmas[:-1].tolist() == pytest.approx(shifted, rel=1e-6)
    v = z_image.dmd_cond(text[:1], text[1:], None, [], (4, 4)).velocity(pipe.transformer, 6.0)
    with torch.no_grad():
        for sigma, t in zip(scheduler.sigmas, scheduler.timesteps):
            x = scheduler.step(km.unpack_latents(v(km.pack_latents(x), sigma.reshape(1)), 4, 4), t, x,
                               return_dict=False)[0]
    torch.testing.assert_close(x, captured["latents"], rtol=1e-5, atol=1e-6)
    ours = (z_image.decode_tokens(pipe.vae, km.pack_latents(captured["latents"]), (4, 4)) / 2 + 0.5).clamp(0, 1)
    torch.testing.assert_close(ours, image, rtol=0, atol=1e-6)


def test_fine_tuning_inputs_and_samples_are_the_pipelines(tiny):
    """Text-to-image fine-tuning (train_flux_kontext.py): what ZImagePipeline hands its transformer for a prompt at
    32 x 48 px (the latents as a list of (C, 1, h, w), the timestep 1 - σ, the caption list) is what the room's forward
    hands it for the same noise at σ = 1, its output negated as the velocity n - x0; and the room's sample with CFG
    against "" at guidance_scale 4 is the pipeline's image."""
    from diffusers.utils.torch_utils import randn_tensor
    pipe, seen = pipeline(tiny["model"]), []
    hook = pipe.transformer.register_forward_pre_hook(lambda m, a, kw: seen.append(a), with_kwargs=True)
    theirs = pipe(PROMPTS[0], height=32, width=48, num_inference_steps=1, guidance_scale=4.0, output_type="pt",
                  generator=torch.Generator().manual_seed(0)).images[0]
    with torch.no_grad():
        text = pipe.encode_prompt([PROMPTS[0], ""], do_classifier_free_guidance=False)[0]
        noise = randn_tensor((1, 4, 4, 6), generator=torch.Generator().manual_seed(0), dtype=torch.float32)
        inputs = z_image.model_inputs(torch.zeros_like(noise), [], noise, torch.ones(1))
        pred = z_image.forward(pipe.transformer, inputs, torch.ones(1), 1.0, text[:1])
        ours = z_image.sample((pipe.scheduler, pipe.transformer), pipe.vae, [], text[:1], (32, 48), 1, 4.0,
                              torch.Generator().manual_seed(0), negative=text[1:])
    hook.remove()
    (latents, timestep, caps), (mine, my_timestep, my_caps) = seen[0], seen[1]
    assert torch.equal(mine[0], latents[0]) and torch.equal(my_timestep, timestep[:1])
    assert torch.equal(my_caps[0], caps[0]) and torch.equal(caps[1], text[1]) and len(caps) == 2
    out = pipe.transformer(mine, my_timestep, my_caps, return_dict=False)[0][0]
    assert torch.equal(pred, km.pack_latents(-out.squeeze(1)[None].float()))
    assert torch.equal((ours * 0.5 + 0.5).clamp(0, 1), theirs)


def test_example_inputs_feed_the_model_as_the_velocity_does(tiny):
    """The spec's example_inputs are the velocity's call (a list of (C, 1, h, w), the timestep (B,), a caption list),
    on CPU and on a meta build, with the latents' shapes out; SHIFT=auto is the scheduler's static shift."""
    from algorithms import dmd2_flow as flux_dm
    from families.dit import scheduler_config
    from parallel.loading import build_on_meta
    spec, model = families.spec_of("ZImagePipeline"), pipeline(tiny["model"]).transformer
    inputs = spec.example_inputs(model.config, 2, ((4, 6),), 7, torch.device("cpu"), torch.float32)
    seen = []
    hook = model.register_forward_pre_hook(
        lambda m, a, kw: seen.append(list(inspect.signature(m.forward).bind(*a, **kw).arguments.values())),
        with_kwargs=True)
    with torch.no_grad():
        out = model(**inputs)[0]
        cond = z_image.dmd_cond(inputs["cap_feats"], None, None, [], (4, 6))
        cond.velocity(model, 1.0)(torch.randn(2, flux_dm.token_count((4, 6)), 16), torch.rand(2))
    hook.remove()
    assert [tuple(o.shape) for o in out] == [(4, 1, 4, 6)] * 2
    assert [[tuple(x.shape) for x in a[0]] for a in seen] == [[(4, 1, 4, 6)] * 2] * 2
    assert [tuple(a[1].shape) for a in seen] == [(2,)] * 2 and [len(a[2]) for a in seen] == [2, 2]
    meta = build_on_meta(type(model), f"{tiny['model']}/transformer")
    meta_inputs = spec.example_inputs(meta.config, 2, ((4, 6),), 7, torch.device("meta"), torch.float32)
    assert [tuple(o.shape) for o in meta(**meta_inputs)[0]] == [(4, 1, 4, 6)] * 2
    assert km.pipeline_shift(scheduler_config(tiny["model"]), 6) == 6.0


def test_refusals_are_one_line(tiny, monkeypatch):
    """What Z-Image lacks (the GAN's real images, a guidance embedding, a per-token CFG rescale, editing rows'
    settings, several aspects): refused in one line before any work; no context parallelism (the spec says none;
    the planner refuses it in one line)."""
    settings = tiny["settings"]
    cases = [({"USE_GAN": True}, set(), "USE_GAN=True with a ZImagePipeline teacher"),
             ({"FLUX_GUIDANCE": 3.5}, {"FLUX_GUIDANCE"}, "FLUX_GUIDANCE=3.5 with a ZImagePipeline teacher"),
             ({"REAL_GUIDANCE_NORM": "token"}, set(), "no per-token rescale"),
             ({"BUCKET_ASPECTS": [1.0, 2.0]}, {"BUCKET_ASPECTS"}, "a prompt alone has no aspect"),
             ({"REFERENCE_AREA": 4096}, {"REFERENCE_AREA"}, "a text-to-image teacher reads prompts")]
    for change, changed, words in cases:
        with pytest.raises(ConfigError, match=re.escape(words)) as e:
            z_image.check_dmd_settings("ZImagePipeline", {**settings, **change}, changed, "txt")
        assert "\n" not in str(e.value)
    z_image.check_dmd_settings("ZImagePipeline", {**settings, "REAL_GUIDANCE_NORM": "scalar"}, set(), "txt")
    spec = families.spec_of("ZImagePipeline")
    assert spec.check_context_parallel is z_image.check_context_parallel
    assert families.FAMILIES["ZImagePipeline"] is z_image
    import train_dmd  # the room's refusal, before any work and before the diffusers-version check
    monkeypatch.setenv("WORLD_SIZE", "2")
    for name, value in (("MODEL_PATH", tiny["model"]), ("DATA_PATH", f"{tiny['data']}/prompts.txt"),
                        ("CONTEXT_PARALLEL", 2)):
        monkeypatch.setattr(train_dmd, name, value)
    with pytest.raises(ConfigError, match=r"^CONTEXT_PARALLEL=2: not for Z-Image here \(ZImageTransformer2DModel "
                                          r"has no _cp_plan\); use CONTEXT_PARALLEL=1$"):
        train_dmd.validate_config()


def t2i_rows(root) -> str:
    """12 text-to-image rows (32 px images of a coloured square, "a <colour> square"): a .jsonl, "image" + "prompt"."""
    from PIL import Image
    rows = []
    for i, (name, colour) in enumerate([("red", (220, 30, 30)), ("green", (30, 200, 30)), ("blue", (30, 30, 220)),
                                        ("yellow", (230, 220, 20))] * 3):
        image = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
        image.paste(colour, (8, 8, 24, 24))
        image.save(root / f"{i:03d}.png")
        rows.append({"image": f"{i:03d}.png", "prompt": f"a {name} square"})
    (root / "t2i.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(root / "t2i.jsonl")


def test_fine_tuning_refuses_edit_rows_and_what_z_image_lacks_in_one_line(tiny, tmp_path):
    """ZImagePipeline, which takes no image, refuses edit rows and editing settings in one line (a ZImageOmniPipeline
    folder fine-tunes on them: tests/test_z_image_omni.py), and what Z-Image lacks: a guidance embedding, CFG at a
    guidance_scale in (0, 1]."""
    import train_flux_kontext as tfk
    settings = {"GUIDANCE": 1.0, "SAMPLE_GUIDANCE": 4.0, "REFERENCE_AREA": 4096}
    for change, changed, words in [({"GUIDANCE": 3.5}, set(), "GUIDANCE=3.5: Z-Image has no guidance embedding"),
                                   ({"SAMPLE_GUIDANCE": 1.0}, set(), "any guidance_scale > 0"),
                                   ({}, {"REFERENCE_AREA"}, "REFERENCE_AREA=4096: a setting of editing rows")]:
        with pytest.raises(ConfigError, match=re.escape(words)) as e:
            z_image.check_edit_settings(tiny["model"], {**settings, **change}, changed)
        assert "\n" not in str(e.value)
    z_image.check_edit_settings(tiny["model"], {**settings, "SAMPLE_GUIDANCE": 0.0}, set())
    t2i_rows(tmp_path)
    (tmp_path / "edits.jsonl").write_text(json.dumps({"control": "000.png", "target": "001.png", "prompt": "p"}))
    with pytest.raises(ConfigError, match="rows with reference images; this Z-Image pipeline takes none"):
        tfk.load_data(str(tmp_path / "edits.jsonl"), 0, SIZE, [1.0], 16, False, room=z_image,
                      max_references=tfk.reference_limit(z_image, "ZImagePipeline"))


@pytest.fixture(scope="module")
def dmd_runs(tiny, tmp_path_factory):
    """DMD2 of the tiny Z-Image teacher to a 4-step generator: full generator and fake score with EMA on 2 ranks, the
    same on one process (GRAD_ACCUM=2), the same resumed from its step-2 checkpoint; a LoRA generator and fake
    score on 2 ranks with validation. Beside them, text-to-image fine-tuning (train_flux_kontext.py): LoRA on 2
    ranks (validation, samples with CFG), the same in one process at twice the batch, and a full fine-tune; LoRA on an
    NF4 base with AC and cached latents on 2 ranks and in one process at twice the batch; a full fine-tune in
    bf16-mixed on 2 ranks without FP8 and with FP8=tensorwise."""
    root = tmp_path_factory.mktemp("z_image")
    common = [f"--model_path={tiny['model']}", f"--data_path={tiny['data']}/prompts.txt",
              f"--text_cache_dir={root / 'text_cache'}", "--precision=fp32", f"--resolution={SIZE}",
              "--max_steps=4", "--log_every=1", "--denoising_steps=999,749,499,249", "--batch_size=1",
              "--sample_count=2", "--dfake_gen_update_ratio=2", "--save_every=2", "--sample_every=4",
              "--export_dtype=fp32", "--generator_lr=1e-3", "--guidance_lr=1e-3"]
    out = {k: root / k for k in ("full", "one", "stopped", "lora", "ft_lora", "ft_one", "ft_full", "ft_nf4",
                                 "ft_nf4_one", "ft_bf16", "ft_fp8")}
    job = functools.partial(dict, script="train_dmd.py", ranks=2, env=launch_env())
    ft = functools.partial(dict, script="train_flux_kontext.py", ranks=2, env=launch_env())
    tuning = [f"--model_path={tiny['model']}", f"--data_path={t2i_rows(root)}", f"--text_cache_dir={root / 'ft_tc'}",
              "--precision=fp32", f"--resolution={SIZE}", "--max_steps=4", "--log_every=1", "--num_sample_pairs=2",
              "--lr=1e-3", "--warmup_steps=0", "--export_dtype=fp32", "--sample_steps=2", "--sample_guidance=4",
              "--seed=1", "--save_every=0", "--val_every=2", "--sample_every=4"]
    quiet = ["--sample_every=0", "--val_every=0"]
    nf4 = quiet + ["--lora_rank=4", "--base_dtype=nf4", "--activation_checkpointing=1", "--cache_latents=1"]
    bf16 = [a for a in tuning if not a.startswith("--precision=")] + quiet + ["--precision=bf16-mixed"]
    done = launch_all_resuming({
        "ft_lora": ft(args=tuning + [f"--output_dir={out['ft_lora']}", "--lora_rank=4"]),
        "ft_one": ft(args=tuning + [f"--output_dir={out['ft_one']}", "--lora_rank=4", "--batch_size=2"], ranks=1),
        "ft_full": ft(args=tuning + [f"--output_dir={out['ft_full']}", "--sample_every=0", "--val_every=0"]),
        "ft_nf4": ft(args=tuning + nf4 + [f"--output_dir={out['ft_nf4']}"]),
        "ft_nf4_one": ft(args=tuning + nf4 + [f"--output_dir={out['ft_nf4_one']}", "--batch_size=2"], ranks=1),
        "ft_bf16": ft(args=bf16 + [f"--output_dir={out['ft_bf16']}"]),
        "ft_fp8": ft(args=bf16 + [f"--output_dir={out['ft_fp8']}", "--fp8=tensorwise"]),
        "full": job(args=common + [f"--output_dir={out['full']}", "--ema_decay=0.9"]),
        "one": job(args=common + [f"--output_dir={out['one']}", "--ema_decay=0.9", "--grad_accum=2",
                                  "--save_every=0", "--sample_every=0"], ranks=1),
        "lora": job(args=common + [f"--output_dir={out['lora']}", "--lora_rank=4", "--fake_lora=1", "--save_every=0",
                                   "--max_steps=2", "--sample_every=2", *VALIDATE])},
        "full", job(args=common + [f"--output_dir={out['stopped']}", "--ema_decay=0.9", "--resume=auto"]))
    return {"out": out, "logs": {k: v.stdout for k, v in done.items()}}


@pytest.mark.slow
def test_dmd_two_ranks_equal_one_and_resume_is_bit_exact(dmd_runs):
    """2 ranks give one process's losses (GRAD_ACCUM=2), the run resumed at step 2 ends bit for bit as the straight
    one, the log names the image, its tokens, the teacher's CFG and the export's call; validation on the LoRA run."""
    out, logs = dmd_runs["out"], dmd_runs["logs"]
    assert_two_ranks_equal_one_and_resumed(out["full"], out["one"], out["stopped"])
    assert "32x32 px (1 shape(s)), 4 target tokens" in logs["full"]
    assert "teacher true CFG 6 (none rescale)" in logs["full"]
    assert "pipe(..., num_inference_steps=4, guidance_scale=0.0)" in logs["full"]
    assert (out["full"] / "samples" / "step_000004.png").exists()
    assert_validated(out["lora"], [2], logs["lora"])


T2I_CALL = dict(prompt="a red square", height=SIZE, width=SIZE, num_inference_steps=2, guidance_scale=4.0,
                output_type="np")


def assert_lora_changes_a_sample(model, export) -> None:
    """A fine-tune's LoRA export loads on the base with ZImagePipeline.load_lora_weights and changes what a prompt
    samples from the same noise."""
    from diffusers import ZImagePipeline
    base = ZImagePipeline.from_pretrained(model)
    base.set_progress_bar_config(disable=True)
    before = base(**T2I_CALL, generator=torch.Generator().manual_seed(0)).images
    base.load_lora_weights(str(export))
    after = base(**T2I_CALL, generator=torch.Generator().manual_seed(0)).images
    assert np.isfinite(after).all() and not np.array_equal(before, after)


@pytest.mark.slow
def test_fine_tuning_trains_on_two_ranks_as_in_one_process_and_its_exports_load_in_the_pipeline(tiny, dmd_runs):
    """Text-to-image LoRA on 2 ranks logs one process's losses, validation losses and grad norms (twice the batch);
    the LoRA export loads on the base with load_lora_weights and changes what a prompt samples, the full export
    loads with from_pretrained and samples it."""
    from diffusers import ZImagePipeline
    out = dmd_runs["out"]
    a, b = read_metrics(out["ft_lora"]), read_metrics(out["ft_one"])
    assert [r["step"] for r in a if "val_loss" in r] == [2, 4] and len(a) == len(b) == 4
    assert_metrics_match(out["ft_lora"], out["ft_one"])
    assert (out["ft_lora"] / "samples" / "step_000004.png").exists()
    assert_lora_changes_a_sample(tiny["model"], out["ft_lora"] / "export")
    full = ZImagePipeline.from_pretrained(str(out["ft_full"] / "export"))
    full.set_progress_bar_config(disable=True)
    assert np.isfinite(full(**T2I_CALL, generator=torch.Generator().manual_seed(0)).images).all()


@pytest.mark.slow
def test_nf4_lora_trains_on_two_ranks_as_in_one_process_and_loads_on_the_full_precision_base(tiny, dmd_runs):
    """Text-to-image LoRA on an NF4 base (BASE_DTYPE=nf4, with AC and cached latents): 2 ranks log one process's
    losses and grad norms at twice the batch, the audit shows the 4-bit storage, and the adapters exported load with
    load_lora_weights on the full-precision base and change what a prompt samples."""
    out, logs = dmd_runs["out"], dmd_runs["logs"]
    a, b = read_metrics(out["ft_nf4"]), read_metrics(out["ft_nf4_one"])
    assert len(a) == len(b) == 4 and all("loss" in r and "grad_norm" in r for r in a)
    assert_metrics_match(out["ft_nf4"], out["ft_nf4_one"], keys=("loss", "grad_norm"))
    assert "fp32/nf4" in logs["ft_nf4"]
    assert_lora_changes_a_sample(tiny["model"], out["ft_nf4"] / "export")


@pytest.mark.slow
def test_fp8_fine_tuning_tracks_bf16_and_exports_plain_weights(tiny, dmd_runs):
    """FP8=tensorwise on the full fine-tune (2 ranks, bf16-mixed): the attention projections of every block in float8
    (the FFN's 85-wide Linears are no multiple of 16, modulation stays), gathered in float8; its losses within 2^-3 of
    bf16's, relative (e4m3's rounding of both operands, tests/test_float8.py), and not equal to them; the export is
    plain bf16 Linears that ZImagePipeline loads and samples."""
    from diffusers import ZImagePipeline
    out, logs = dmd_runs["out"], dmd_runs["logs"]
    assert ("FP8 tensorwise: 16 of ZImageTransformer2DModel's 37 Linears in float8, trained weights all-gathered in "
            "float8") in logs["ft_fp8"]
    base = [r["loss"] for r in read_metrics(out["ft_bf16"], timing=False)]
    losses = [r["loss"] for r in read_metrics(out["ft_fp8"], timing=False)]
    assert len(base) == 4 and losses == pytest.approx(base, rel=2 ** -3) and losses != base
    pipe = ZImagePipeline.from_pretrained(str(out["ft_fp8"] / "export"))
    assert all(type(m) is torch.nn.Linear for m in pipe.transformer.modules() if isinstance(m, torch.nn.Linear))
    pipe.set_progress_bar_config(disable=True)
    image = pipe("a red square", height=SIZE, width=SIZE, num_inference_steps=2, guidance_scale=4.0,
                 generator=torch.Generator().manual_seed(0), output_type="np").images
    assert np.isfinite(image).all()


@pytest.mark.slow  # ~4 s alone: the real-size transformer on meta (its module's first import)
def test_fp8_converts_the_real_transformers_block_projections_and_ffn():
    """Z-Image's 6.15 B transformer on meta: FP8 converts each of its 34 blocks' (30 main, 2 noise- and 2
    context-refiner) attention projections and FFN (7 Linears; 3840 and 10240 wide), not their adaLN modulation,
    the embedders or the final layer; the state dict keeps its names."""
    from families.z_image.spec import SPEC
    from parallel import float8
    from tools.memory_plan import meta_model
    model = meta_model(f"{SPEC.builtin_folder('z-image')}/transformer")
    keys = set(model.state_dict())
    names = float8.fp8_linears(model)
    assert len(names) == 34 * 7 and {n.split(".")[0] for n in names} == {"layers", "noise_refiner", "context_refiner"}
    assert {n.split(".", 2)[2] for n in names} == {f"attention.{p}" for p in ("to_q", "to_k", "to_v", "to_out.0")} | {
        f"feed_forward.w{i}" for i in (1, 2, 3)}
    assert float8.convert(model, "tensorwise", float8_all_gather=True, emulate=True) == 238
    assert set(model.state_dict()) == keys


@pytest.mark.slow
def test_dmd_exports_load_in_the_pipeline_and_sample_the_trained_sigmas(tiny, dmd_runs):
    """The full export and the LoRA export on the base (load_lora_weights, the export's scheduler) sample at
    guidance_scale=0 in 4 steps at the trained σ list (the transformer gets 1 - σ); TEACHER_LORA's reader takes the
    LoRA export (through ZImagePipeline.lora_state_dict) as adapters of the base's attention projections."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline
    from parallel.loading import tensor_shapes
    from parallel.lora_merge import read_lora
    delta = read_lora(str(dmd_runs["out"]["lora"] / "export"), pipeline="ZImagePipeline")
    delta.check_base(tensor_shapes(f"{tiny['model']}/transformer"), "the base")
    assert {k.rsplit(".", 2)[-2] for k in delta.weight_keys()} == {"to_q", "to_k", "to_v", "0"}
    full = ZImagePipeline.from_pretrained(str(dmd_runs["out"]["full"] / "export"))
    lora = ZImagePipeline.from_pretrained(tiny["model"])
    base = lora.transformer.layers[0].attention.to_q.weight.clone()
    lora.load_lora_weights(str(dmd_runs["out"]["lora"] / "export"))
    lora.scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(str(dmd_runs["out"]["lora"] / "export"),
                                                                     subfolder="scheduler")
    assert "lora" in type(lora.transformer.layers[0].attention.to_q).__module__ or \
        not torch.equal(lora.transformer.layers[0].attention.to_q.weight, base)
    for pipe in (full, lora):
        assert pipe.scheduler.config.stochastic_sampling and pipe.scheduler.config.shift == 1.0
        pipe.set_progress_bar_config(disable=True)
        seen = []
        pipe.transformer.register_forward_pre_hook(lambda m, a, kw: seen.append(float(a[1][0])), with_kwargs=True)
        image = pipe(PROMPTS[0], height=SIZE, width=SIZE, num_inference_steps=4, guidance_scale=0.0,
                     generator=torch.Generator().manual_seed(0), output_type="np").images
        assert np.isfinite(image).all() and image.shape == (1, SIZE, SIZE, 3)
        assert seen == pytest.approx([1 - s for s in (1.0, 0.75, 0.5, 0.25)], abs=1e-6)


@pytest.mark.slow
def test_a_z_image_lora_is_the_teacher_and_its_4_step_student_loads_on_the_base(tiny, dmd_runs):
    """Fine-tune, then DMD2: a Z-Image LoRA export (dmd_runs' LoRA student) as TEACHER_LORA on the NF4 base
    (recipes/dmd_z_image_8step_lora.sh's settings, 4 steps) equals the run on the folder tools/merge_lora.py writes,
    step for step; its 4-step LoRA export, holding the teacher's adapters and the student's, loads on the plain base
    with load_lora_weights and samples at the trained σ without CFG."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline

    from parallel import lora_merge
    root, tuned = dmd_runs["out"]["lora"].parent, dmd_runs["out"]["lora"] / "export"
    args = [f"--text_cache_dir={root / 'text_cache'}", "--precision=fp32", f"--resolution={SIZE}", "--batch_size=1"]
    done = chain(tiny["model"], f"{tiny['data']}/prompts.txt", tuned, root, launch_env(), args)
    a, b = (read_metrics(done["out"][k], timing=False) for k in ("lora", "merged"))
    assert len(a) == 2 and [(r["loss_dm"], r["loss_fake"]) for r in a] == [(r["loss_dm"], r["loss_fake"]) for r in b]
    teacher, exported = lora_merge.read_lora(str(tuned)), lora_merge.read_lora(str(done["out"]["lora"] / "export"))
    assert set(teacher.layers) <= set(exported.layers)
    pipe = ZImagePipeline.from_pretrained(tiny["model"])
    pipe.load_lora_weights(str(done["out"]["lora"] / "export"))
    pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(str(done["out"]["lora"] / "export"),
                                                                     subfolder="scheduler")
    pipe.set_progress_bar_config(disable=True)
    seen = []
    pipe.transformer.register_forward_pre_hook(lambda m, a, kw: seen.append(float(a[1][0])), with_kwargs=True)
    image = pipe(PROMPTS[0], height=SIZE, width=SIZE, num_inference_steps=4, guidance_scale=0.0,
                 generator=torch.Generator().manual_seed(0), output_type="np").images
    assert np.isfinite(image).all() and seen == pytest.approx([1 - s for s in (1.0, 0.75, 0.5, 0.25)], abs=1e-6)


# ----------------------------------------------------------------------------------------------
# TEACHER_LORA in other tools' key forms, read through ZImagePipeline.lora_state_dict (diffusers' Z-Image converter)

def foreign_forms(tiny, tmp_path):
    """A diffusers-form LoRA of every Linear of the tiny Z-Image (rank 2; lora_alpha 4, the FFN's 1: scales 2 and
    0.5) and the same adapters in the forms diffusers' Z-Image converter reads: ai-toolkit's `diffusion_model.` +
    lora_A / lora_B / .alpha, kohya / musubi-tuner's `lora_unet_<module with _>` + lora_down / lora_up / .alpha,
    DiffSynth's peft adapter-named `<module>.lora_A.default.weight` (no alpha: the scale in A)."""
    import json

    from safetensors.torch import save_file

    from parallel.loading import tensor_shapes
    shapes = tensor_shapes(f"{tiny['model']}/transformer")
    g = torch.Generator().manual_seed(0)
    pairs = {k[:-len(".weight")]: (torch.randn(2, s[1], generator=g), torch.randn(s[0], 2, generator=g))
             for k, s in sorted(shapes.items()) if k.endswith(".weight") and len(s) == 2}
    scale = {m: 0.5 if ".feed_forward." in m else 2.0 for m in pairs}
    files = {}

    def write(form, tensors, meta=None):
        files[form] = str(tmp_path / f"{form}.safetensors")
        save_file({k: v.contiguous() for k, v in tensors.items()}, files[form], metadata=meta)
    config = {"transformer.r": 2, "transformer.lora_alpha": 4, "transformer.alpha_pattern": {"feed_forward.w1": 1,
              "feed_forward.w2": 1, "feed_forward.w3": 1}}
    write("diffusers", {f"transformer.{m}.lora_{n}.weight": t for m, ab in pairs.items() for n, t in zip("AB", ab)},
          {"lora_adapter_metadata": json.dumps(config)})
    write("ai_toolkit", {k: v for m, (a, b) in pairs.items() for k, v in (
        (f"diffusion_model.{m}.lora_A.weight", a), (f"diffusion_model.{m}.lora_B.weight", b),
        (f"diffusion_model.{m}.alpha", torch.tensor(2 * scale[m])))})
    write("kohya", {k: v for m, (a, b) in pairs.items() for stem in ["lora_unet_" + m.replace(".", "_")]
                    for k, v in ((f"{stem}.lora_down.weight", a), (f"{stem}.lora_up.weight", b),
                                 (f"{stem}.alpha", torch.tensor(2 * scale[m])))})
    write("diffsynth", {k: v for m, (a, b) in pairs.items() for k, v in (
        (f"{m}.lora_A.default.weight", a * scale[m]), (f"{m}.lora_B.default.weight", b))})
    return files, shapes


def assert_reads_as(file, want: dict, shapes: dict) -> None:
    """`file` read as TEACHER_LORA reads it (read_lora through ZImagePipeline's converter) passes train_dmd.py's
    check against the base and makes the deltas `want` ({module: scale · B @ A})."""
    from parallel.lora_merge import read_lora
    delta = read_lora(file, pipeline="ZImagePipeline")
    delta.check_base(shapes, "the base")
    got = {m: (b @ a) * s for m, (a, b, s) in delta.layers.items()}
    assert got.keys() == want.keys(), file
    for m, d in want.items():  # alpha / r folded into A by the converter: a rounding
        torch.testing.assert_close(got[m], d, msg=f"{file}: {m}")


def test_teacher_lora_reads_ai_toolkit_kohya_and_diffsynth_forms(tiny, tmp_path):
    """Each form reads back (read_lora with pipeline ZImagePipeline, as TEACHER_LORA reads it) to the deltas of the
    diffusers-form file, every Linear of the tiny Z-Image (the refiners', the blocks', the embedders', the final
    layer's), and passes train_dmd.py's check against the base; so does a kohya / ComfyUI file on Z-Image's
    original module tree (`attention.qkv` fused: one A, the three B stacked; `attention.out`), which the
    converter splits."""
    from safetensors.torch import save_file

    from parallel.lora_merge import read_lora
    files, shapes = foreign_forms(tiny, tmp_path)
    want = {m: (b @ a) * s for m, (a, b, s) in read_lora(files.pop("diffusers")).layers.items()}
    for file in files.values():
        assert_reads_as(file, want, shapes)
    g, fused, want = torch.Generator().manual_seed(1), {}, {}
    for block in sorted({m.rsplit(".attention.", 1)[0] for m in shapes if ".attention." in m}):
        out, d = shapes[f"{block}.attention.to_q.weight"]
        stem = "lora_unet_" + block.replace(".", "_") + "_attention_"
        for name, projections in (("qkv", ("to_q", "to_k", "to_v")), ("out", ("to_out.0",))):
            a, b = torch.randn(2, d, generator=g), torch.randn(len(projections) * out, 2, generator=g)
            fused.update({f"{stem}{name}.lora_down.weight": a, f"{stem}{name}.lora_up.weight": b,
                          f"{stem}{name}.alpha": torch.tensor(1.0)})  # alpha / r = 0.5
            want.update({f"{block}.attention.{p}": (up @ a) * 0.5 for p, up in zip(projections, b.chunk(len(
                projections)))})
    save_file(fused, str(tmp_path / "fused.safetensors"))
    assert_reads_as(str(tmp_path / "fused.safetensors"), want, shapes)
