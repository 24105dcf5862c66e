"""The Wan room (families/wan/) and train_dmd.py's DMD2 of a Wan 2.1 text-to-video teacher, on the tiny WanPipeline
folder (9 frames of 32 x 32 px: 3 x 4 x 4 latents, 12 tokens), and of the tiny Wan 2.2 TI2V-5B (per-token
timesteps, the 2.2 VAE; 64 px) and T2V-A14B (two experts: each sample on the expert its timestep picks; 2 ranks
against one process, two LoRA files and the merged export sampled in WanPipeline), and of the tiny Wan 2.1 I2V
(WanImageToVideoPipeline: its first-frame condition channels, CLIP image tokens and sampling loop equal the
pipeline's; its DMD2 export samples from a first image).

Conditioning equals WanPipeline's own tensors: the cached UMT5 text is encode_prompt's (prompt_clean, cut to the
real length, zero-padded to MAX_SEQUENCE_LENGTH), the latents' normalisation is WanImageToVideoPipeline's, the
tokens are the transformer's (1, 2, 2) patches in its own order, the teacher's CFG pair is uncond + g (cond -
uncond), and the room's sampling loop (its velocity with the pipeline's scheduler, timestep sigma * 1000) is the
pipeline's output. TEACHER_LORA reads Wan LoRAs in Wan's own key forms (LightX2V, ComfyUI, musubi-tuner) as
WanPipeline.load_lora_weights + fuse_lora does. The student's sigma list is the one the export's scheduler makes
itself at the trained step count. The runs: DMD2 on 2 ranks equals one process (GRAD_ACCUM=2), resume is
bit-exact, LoRA and full students export, both load in WanPipeline (the LoRA with load_lora_weights) and sample
in 4 steps at the trained sigmas.

    python -m pytest tests/test_wan.py -q
"""
from __future__ import annotations

import copy
import functools
import json
import os
import re

import numpy as np
import pytest
import torch

from algorithms import dmd2_flow as flow_dm
from core.errors import ConfigError
from families import wan
from tests.conftest import (VALIDATE, assert_two_ranks_equal_one_and_resumed, assert_validated, launch_all_resuming,
                            launch_env, load_export, read_checkpoint, read_metrics, run_ranks, tiny_default)

SIZE, FRAMES = 32, 9
SETTINGS = {"RESOLUTION": SIZE, "BUCKET_ASPECTS": [1.0], "NUM_FRAMES": FRAMES, "MAX_SEQUENCE_LENGTH": 512,
            "USE_GAN": False, "CONDITIONING_TIMESTEP": 999, "DENOISING_STEPS": [999, 749, 499, 249],
            "FLUX_GUIDANCE": 0.0, "REFERENCE_AREA": 0, "CONDITION_AREA": 0}
PROMPTS = ["a red circle on a blue background", "  a green   square &amp; a yellow background "]


TI2V_SIZE = 64  # TI2V-5B's sides: multiples of its VAE's 16 x the patch's 2


@pytest.fixture(scope="module")
def tiny():
    model, data = tiny_default("wan_t2v")
    return {"model": model, "data": data, "settings": {**SETTINGS, "MODEL_PATH": model}}


@pytest.fixture(scope="module")
def a14b():
    model, data = tiny_default("wan_a14b")
    return {"model": model, "data": data, "settings": {**SETTINGS, "MODEL_PATH": model}}


def i2v_folder(kind, size=SIZE):
    model, data = tiny_default(kind)
    rows = [{**r, "control": os.path.join(data, r["control"])} for r in map(json.loads, open(f"{data}/data.jsonl"))]
    return {"model": model, "data": data, "rows": rows,
            "settings": {**SETTINGS, "RESOLUTION": size, "MODEL_PATH": model}}


@pytest.fixture(scope="module")
def i2v():
    return i2v_folder("wan_i2v")


@pytest.fixture(scope="module")
def i2v_a14b():
    return i2v_folder("wan_i2v_a14b")


@pytest.fixture(scope="module")
def ti2v_i2v():
    return i2v_folder("wan_ti2v_i2v", TI2V_SIZE)


@pytest.fixture(scope="module")
def ti2v():
    model, data = tiny_default("wan_ti2v")
    return {"model": model, "data": data, "settings": {**SETTINGS, "RESOLUTION": TI2V_SIZE, "MODEL_PATH": model}}


@functools.lru_cache(maxsize=4)
def pipeline(model):
    from diffusers import WanImageToVideoPipeline, WanPipeline
    image = json.load(open(os.path.join(model, "model_index.json")))["_class_name"] == "WanImageToVideoPipeline"
    pipe = (WanImageToVideoPipeline if image else WanPipeline).from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def i2v_prompt_embeds(pipe, prompt) -> dict:
    """The I2V pipeline's prompt_embeds and negative_prompt_embeds for `prompt` and "", by WanPipeline's
    encode_prompt on its encoder (the same code: diffusers 0.42.1's I2V prompt_clean calls ftfy unguarded, which
    this venv lacks)."""
    from diffusers import WanPipeline
    text = WanPipeline(tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder, vae=pipe.vae, scheduler=pipe.scheduler)
    with torch.no_grad():
        embeds, negative = text.encode_prompt(prompt, negative_prompt="", max_sequence_length=512)
    return {"prompt_embeds": embeds, "negative_prompt_embeds": negative}


def i2v_cond(i2v, tmp_path, rows, negative=True):
    """The room's WanCond of `rows` (their prompts, cached text and CLIP tokens, first images read as
    train_dmd.py reads them) at the tiny clip's grid; with `negative`, the teacher's "" beside them."""
    from data.buckets import load_pairs
    settings = i2v["settings"]
    pairs = [(r["prompt"], r) for r in rows] + [("", r) for r in rows]
    identity = wan.prepare_edit_text(pairs, i2v["model"], str(tmp_path / "tc"), settings, torch.float32,
                                     torch.device("cpu"))
    text, neg = (wan.load_text(p, str(tmp_path / "tc"), identity, torch.device("cpu"))
                 for p in (pairs[:len(rows)], pairs[len(rows):]))
    size = wan.video_size(settings)
    shape = (size, wan.reference_sizes(size, rows[0], settings))
    refs, _ = load_pairs(rows, shape, [False] * len(rows), target=False, loader=wan.image_loader(settings))
    grid = wan.latent_grid(size, settings)
    return wan.dmd_cond(text, neg if negative else None, pipeline(i2v["model"]).vae, refs, grid), refs


def cached_text(tiny, tmp_path, prompts, length=512):
    settings = {**tiny["settings"], "MAX_SEQUENCE_LENGTH": length}
    pairs = [(p, {}) for p in prompts]
    identity = wan.prepare_edit_text(pairs, tiny["model"], str(tmp_path / "tc"), settings, torch.float32,
                                     torch.device("cpu"))
    return wan.load_text(pairs, str(tmp_path / "tc"), identity, torch.device("cpu"))


@pytest.mark.parametrize("length", [512, 8])
def test_text_is_encode_prompts(tiny, tmp_path, length):
    """The cache keeps each prompt cut to its real length; loaded, it is encode_prompt's tensor at the trained
    length, prompt_clean'ed, zero-padded (8: cut as the tokenizer truncates), the negative "" too."""
    pipe = pipeline(tiny["model"])
    ours = cached_text(tiny, tmp_path, PROMPTS + [wan.NEGATIVE_PROMPT], length)
    with torch.no_grad():  # the fill's batch: the prompts with the negative one
        theirs, _ = pipe.encode_prompt(PROMPTS + [""], do_classifier_free_guidance=False, max_sequence_length=length)
    assert torch.equal(ours, theirs)
    assert ours.shape == (3, length, 16) and (ours[0, 8:] == 0).all() and (ours[0, :8] != 0).all()


def test_tokens_are_the_transformers_patches_and_latents_normalise_as_the_pipeline(tiny):
    """pack_latents is the patch embedding's own order (the Conv3d is a Linear on our tokens, its output tokens in
    our order), unpack_latents its inverse; encode_latents is the I2V pipeline's argmax posterior, (mu - mean) *
    (1 / std)."""
    from diffusers.pipelines.wan.pipeline_wan_i2v import retrieve_latents
    pipe = pipeline(tiny["model"])
    x = torch.randn(2, 4, 3, 4, 6)
    tokens = wan.pack_latents(x)
    assert tokens.shape == (2, 3 * 2 * 3, 16) and torch.equal(wan.unpack_latents(tokens, (3, 4, 6)), x)
    conv = pipe.transformer.patch_embedding
    with torch.no_grad():
        theirs = conv(x).flatten(2).transpose(1, 2)
        ours = torch.nn.functional.linear(tokens, conv.weight.flatten(1), conv.bias)
    torch.testing.assert_close(ours, theirs)
    video = torch.rand(1, 3, FRAMES, SIZE, SIZE) * 2 - 1
    with torch.no_grad():
        mu = retrieve_latents(pipe.vae.encode(video), sample_mode="argmax")
    mean = torch.tensor(pipe.vae.config.latents_mean).view(1, 4, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(pipe.vae.config.latents_std).view(1, 4, 1, 1, 1)
    assert torch.equal(wan.encode_latents(pipe.vae, video), (mu - mean) * inv_std)
    assert wan.latent_grid((SIZE, SIZE), tiny["settings"]) == (3, 4, 4) == tuple(mu.shape[2:])


def test_teacher_cfg_pair_and_guidance_are_the_pipelines(tiny):
    """The teacher's pair in one batch is the pipeline's two calls, uncond + 5 (cond - uncond) at timestep sigma *
    1000 (a float); diffusers' negative "" and guidance 5; the export samples at guidance_scale=1 (no pair)."""
    pipe = pipeline(tiny["model"])
    g = wan.dmd_guidance({"REAL_GUIDANCE_SCALE": 0.0, "REAL_GUIDANCE_NORM": ""})
    assert (g.scale, g.norm, g.negative, g.embedded, g.export_call) == (5.0, "none", "", None, "guidance_scale=1.0")
    assert wan.dmd_guidance({"REAL_GUIDANCE_SCALE": 1.0, "REAL_GUIDANCE_NORM": ""}).negative is None
    grid = (3, 4, 4)
    text, negative = torch.randn(1, 512, 16), torch.randn(1, 512, 16)
    x, sigma = torch.randn(1, 4, *grid), torch.tensor([0.8])
    seen = []
    hook = pipe.transformer.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["timestep"]), with_kwargs=True)
    with torch.no_grad():
        ours = wan.dmd_cond(text, negative, None, [], grid).velocity(pipe.transformer, 5.0)(wan.pack_latents(x), sigma)
        hook.remove()
        cond, uncond = (pipe.transformer(hidden_states=x, timestep=sigma * 1000, encoder_hidden_states=e,
                                         return_dict=False)[0] for e in (text, negative))
    torch.testing.assert_close(wan.unpack_latents(ours, grid), uncond + 5.0 * (cond - uncond))
    assert seen[0].dtype == torch.float32 and seen[0].tolist() == pytest.approx([800.0] * 2)


@pytest.mark.parametrize("steps", [[999], [999, 499], [999, 749, 499, 249]])
def test_the_exports_scheduler_makes_the_trained_sigmas(tiny, steps):
    """WanPipeline calls set_timesteps(N) without sigmas: the export's scheduler (stochastic FlowMatchEuler, the
    teacher's flow_shift 3, stretched to the last step's shifted sigma) makes the student's list itself, bit for
    bit, from 1 to shift(sigma_last)."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    sigmas = wan.generator_sigmas(tiny["model"], [(t + 1) / 1000 for t in steps])
    config = wan.distilled_scheduler(tiny["model"], sigmas)
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
    scheduler.set_timesteps(len(steps))
    assert scheduler.sigmas[:-1].tolist() == sigmas and config["stochastic_sampling"] and config["shift"] == 3.0
    last = 3 * (steps[-1] + 1) / 1000 / (1 + 2 * (steps[-1] + 1) / 1000)
    assert sigmas[0] == 1.0 and sigmas[-1] == pytest.approx(last, abs=1e-6)
    assert sigmas == sorted(sigmas, reverse=True)


def test_refusals_are_one_line(tiny, monkeypatch):
    """What WanPipeline would round (frames, sides), what Wan lacks (a guidance embedding),
    a sigma list its export could not sample, several sizes: refused in one line before any work; no context
    parallelism (the spec says none); NUM_FRAMES with an image teacher."""
    settings = tiny["settings"]
    cases = [({"NUM_FRAMES": 8}, set(), "NUM_FRAMES=8: Wan takes 4k + 1 frames"),
             ({"RESOLUTION": 40}, set(), "a 40x40 px clip"),
             ({"BUCKET_ASPECTS": [1.25]}, set(), "a 32x40 px clip"),
             ({"FLUX_GUIDANCE": 3.5}, {"FLUX_GUIDANCE"}, "FLUX_GUIDANCE=3.5 with a WanPipeline teacher"),
             ({"BUCKET_ASPECTS": [1.0, 2.0]}, {"BUCKET_ASPECTS"}, "one clip size"),
             ({"DENOISING_STEPS": [999, 500, 100]}, set(), "evenly spaced from 999"),
             ({"REAL_GUIDANCE_SCALE_2": 3.0}, set(), "the low-noise expert's CFG of a two-expert teacher"),
             ({"TEACHER_LORA_2": "low.safetensors"}, set(), "TEACHER_LORA_2=low.safetensors with a WanPipeline "
              "teacher: it adapts a two-expert teacher's low-noise transformer_2")]
    for change, changed, words in cases:
        with pytest.raises(ConfigError, match=re.escape(words)) as e:
            wan.check_dmd_settings("WanPipeline", {**settings, **change}, changed, "txt")
        assert "\n" not in str(e.value)
    wan.check_dmd_settings("WanPipeline", settings, set(), "txt")
    assert wan.video_size({"RESOLUTION": 0}) == (480, 832) and wan.video_size({"RESOLUTION": 720}) == (720, 1280)
    cp = functools.partial(wan.check_context_parallel, tiny["model"], settings=settings)
    cp(2, shapes=[((32, 32), ())])  # 2 heads, 12 tokens
    for degree, shape, words in ((4, (32, 32), "the transformer's 2 attention heads"),
                                 (2, (48, 48), "a 9-frame clip at 48x48 makes 27 video tokens (3 x 3 x 3)")):
        with pytest.raises(ConfigError, match=re.escape(f"CONTEXT_PARALLEL={degree}: {words}")) as e:
            cp(degree, shapes=[(shape, ())])
        assert "\n" not in str(e.value)
    import train_dmd
    monkeypatch.setattr(train_dmd, "NUM_FRAMES", 9)
    with pytest.raises(ConfigError, match="NUM_FRAMES=9 with a SD-1.5 teacher: it makes images"):
        train_dmd.validate_config()
    with monkeypatch.context() as m, pytest.raises(ConfigError, match=re.escape(
            "REAL_GUIDANCE_SCALE_2=3 with a SD-1.5 teacher: it is the low-noise expert's CFG")):
        m.setattr(train_dmd, "NUM_FRAMES", 0)
        m.setattr(train_dmd, "REAL_GUIDANCE_SCALE_2", 3)
        train_dmd.validate_config()
    for name, value in (("MODEL_PATH", tiny["model"]), ("DATA_PATH", f"{tiny['data']}/prompts.txt"),
                        ("NUM_FRAMES", 13), ("RESOLUTION", 24)):
        monkeypatch.setattr(train_dmd, name, value)
    with pytest.raises(ConfigError, match="a 24x48 px clip"):  # 24 px high, 16:9
        train_dmd.validate_config()
    monkeypatch.setenv("WORLD_SIZE", "2")
    for change, words in (({"MODEL_PATH": ""}, "a SD-1.5 teacher: a UNet's convolutions"),
                          ({"FP8": "tensorwise"}, "FP8=tensorwise: float8 training"),
                          ({"RESOLUTION": 0, "CONTEXT_PARALLEL": 3}, "CONTEXT_PARALLEL=3 x DP_REPLICATE=1 does not "
                                                                     "divide")):
        with monkeypatch.context() as m:
            for name, value in {"NUM_FRAMES": 0, "CONTEXT_PARALLEL": 2, **change}.items():
                m.setattr(train_dmd, name, value)
            with pytest.raises(ConfigError, match=re.escape(words)):
                train_dmd.validate_config()


def write_clip(path, colours, size=SIZE):
    """An animated GIF of solid frames, one per (r, g, b) colour: a real clip as a user's data holds one."""
    from PIL import Image
    frames = [Image.new("RGB", (size, size), c) for c in colours]
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=100, loop=0)
    return str(path)


def test_gan_reads_real_clips_and_the_last_blocks_tokens(tiny, a14b, tmp_path):
    """USE_GAN on Wan: a row's real clip (an animated image) is read as its first NUM_FRAMES frames, each stretched
    to the clip's size, in [-1, 1] and frame order; a shorter clip is refused in one line naming it, before any
    work, as is a two-expert teacher. The head's input is the last block's hidden states under the conditioning,
    (B, D, T, h/2, w/2): proj_out does not move it, the last block does, and the head's loss reaches the first
    block; the head gives a video one logit, its latent frames' mean."""
    from diffusers import WanTransformer3DModel

    from algorithms import dmd2_flow as flow_dm
    settings = tiny["settings"]
    colours = [(255 - 20 * i, 10 * i, 0) for i in range(FRAMES + 2)]
    clip = wan.load_clip(write_clip(tmp_path / "long.gif", colours, size=16), (SIZE, SIZE), FRAMES)
    want = torch.tensor(colours[:FRAMES], dtype=torch.float32).T / 127.5 - 1  # (3, F): solid frames stay solid
    assert clip.shape == (3, FRAMES, SIZE, SIZE)
    torch.testing.assert_close(clip.mean(dim=(2, 3)), want, rtol=0, atol=1e-6)
    short = write_clip(tmp_path / "short.gif", colours[:5])
    with pytest.raises(ConfigError, match=re.escape(f"clip {short} has 5 frames; NUM_FRAMES=9 reads the first 9")) as e:
        wan.check_targets([{"prompt": "a", "target": short}], {**settings, "DATA_PATH": "rows.jsonl"})
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="USE_GAN=True with a WanPipeline teacher: the GAN head reads one "):
        wan.check_dmd_settings("WanPipeline", {**a14b["settings"], "USE_GAN": True}, set(), "jsonl")
    wan.check_dmd_settings("WanPipeline", {**settings, "USE_GAN": True}, set(), "jsonl")

    model = WanTransformer3DModel.from_pretrained(os.path.join(tiny["model"], "transformer"))
    grid = wan.latent_grid((SIZE, SIZE), settings)
    text = torch.randn(2, 8, model.config.text_dim, generator=torch.Generator().manual_seed(0))
    cond = wan.WanCond(text, None, grid)
    x = torch.randn(2, grid[0] * grid[1] * grid[2] // 4, 4 * model.config.in_channels,
                    generator=torch.Generator().manual_seed(1))
    sigma = torch.tensor([0.9, 0.4])
    features = cond.head_features(model, x, sigma, 1.0)
    width = model.config.num_attention_heads * model.config.attention_head_dim
    assert features.shape == (2, width, grid[0], grid[1] // 2, grid[2] // 2) and features.dtype == torch.float32
    with torch.no_grad():
        model.proj_out.weight.mul_(3)
        torch.testing.assert_close(cond.head_features(model, x, sigma, 1.0), features, rtol=0, atol=0)
        model.blocks[-1].ffn.net[2].weight.mul_(1.5)
        assert not torch.allclose(cond.head_features(model, x, sigma, 1.0), features)
    head = flow_dm.TransformerHead(width, flow_dm.head_grid(grid[1]))
    logits = flow_dm.cls_logits(model, head, x, {"cond": cond}, "gan_real", False, 1.0)  # clean: sigma 0
    with torch.no_grad():
        frames = cond.head_features(model, x, torch.zeros(2), 1.0).transpose(1, 2).flatten(0, 1)  # (B T, D, h, w)
        torch.testing.assert_close(logits, head(frames).view(2, grid[0]).mean(dim=1, keepdim=True))
    logits.sum().backward()
    assert model.blocks[0].attn1.to_q.weight.grad.abs().sum() > 0 and model.proj_out.weight.grad is None


def _check_targets_on_ranks(rank, world, rows, settings):
    """Each rank reads its rows rank::world, and both refuse the one bad row (rank 1's) with the same line."""
    from families.wan import room
    read, real = [], room.check_clip
    room.check_clip = lambda source, frames: (read.append(source), real(source, frames))
    try:
        with pytest.raises(ConfigError) as e:
            room.check_targets(rows, settings)
    finally:
        room.check_clip = real
    assert read == [r["target"] for r in rows[rank::world]], read
    assert f"clip {rows[3]['target']} has 5 frames" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
def test_the_ranks_share_the_clips_check_and_all_refuse(tiny, tmp_path):
    colours = [(200, 10 * i, 0) for i in range(FRAMES)]
    rows = [{"prompt": "a", "target": str(write_clip(tmp_path / f"{i}.gif", colours[:5] if i == 3 else colours))}
            for i in range(4)]
    run_ranks(_check_targets_on_ranks, 2, rows, {**tiny["settings"], "DATA_PATH": "rows.jsonl"})


def test_teachers_not_built_yet_are_one_line(tiny, ti2v, tmp_path):
    """Image to video on a transformer of other input channels (2.1 I2V: 2 x z + 4; TI2V-5B's: z), a second expert
    without its boundary_ratio, and per-token timesteps (expand_timesteps) without TI2V's 2.2 VAE or that VAE
    without them: one line each, from the folder's model_index.json and VAE config; Wan 2.1 text to video
    (transformer_2 null), TI2V-5B and T2V-A14B pass; A14B takes a LoRA file per expert."""
    index = json.load(open(os.path.join(tiny["model"], "model_index.json")))
    assert index.get("transformer_2") in (None, [None, None])
    (tmp_path / "vae").mkdir()
    cases = [("WanPipeline", {"transformer_2": ["diffusers", "WanTransformer3DModel"]}, tiny,
              "transformer_2 and boundary_ratio come together"),
             ("WanImageToVideoPipeline", {}, tiny, "the transformer takes 4 input channels, not 2 x 4 + 4"),
             ("WanImageToVideoPipeline", {"expand_timesteps": True}, ti2v,
              "takes 4 input channels, not TI2V-5B's 8"),
             ("WanPipeline", {"expand_timesteps": True}, tiny, "expand_timesteps=True with a 2.1 VAE"),
             ("WanPipeline", {"expand_timesteps": False}, ti2v, "expand_timesteps=False with the 2.2 VAE")]
    (tmp_path / "transformer").symlink_to(os.path.join(tiny["model"], "transformer"))
    for pipeline, change, folder, words in cases:
        (tmp_path / "model_index.json").write_text(json.dumps({**index, **change}))
        (tmp_path / "vae" / "config.json").write_text(open(os.path.join(folder["model"], "vae", "config.json")).read())
        with pytest.raises(ConfigError, match=re.escape(words)) as e:
            wan.check_model(pipeline, str(tmp_path))
        assert "\n" not in str(e.value)
        assert "TI2V-5B (text and image to video), T2V-A14B and I2V-A14B distil today" in str(e.value)
    for folder in (tiny, ti2v):
        wan.check_model("WanPipeline", folder["model"])
    a14b = tmp_path / "a14b"  # the tiny Wan's parts with A14B's model_index.json (its second expert's entry)
    a14b.mkdir()
    for part in ("transformer", "vae", "scheduler"):
        (a14b / part).symlink_to(os.path.join(tiny["model"], part))
    (a14b / "model_index.json").write_text(json.dumps(
        {**index, "transformer_2": ["diffusers", "WanTransformer3DModel"], "boundary_ratio": 0.875}))
    wan.check_model("WanPipeline", str(a14b))
    for name in ("TEACHER_LORA", "GENERATOR_LORA", "TEACHER_LORA_2", "GENERATOR_LORA_2"):  # a pair, one per expert
        wan.check_dmd_settings("WanPipeline", {**tiny["settings"], "MODEL_PATH": str(a14b), name: "x.safetensors"},
                               set(), "txt")
    assert wan.expert_boundary(str(a14b)) == 875.0 and wan.expert_boundary(tiny["model"]) is None


def test_i2v_refusals_are_one_line(tiny, tmp_path):
    """Wan 2.1 I2V (a folder of the tiny Wan's VAE with a 2 x 4 + 4-channel transformer reading image tokens)
    passes; without its image_encoder, a .txt of prompts alone (no first image) and a text length other than the
    512 its attention splits the image tokens at are refused in one line; its rows are a first image and a
    prompt, the first image at the clip's size, and a row without one is refused naming its file and line."""
    from data.sources import read_rows
    index = json.load(open(os.path.join(tiny["model"], "model_index.json")))
    config = json.load(open(os.path.join(tiny["model"], "transformer", "config.json")))
    for part in ("vae", "scheduler"):
        (tmp_path / part).symlink_to(os.path.join(tiny["model"], part))
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text(json.dumps({**config, "in_channels": 12, "image_dim": 16}))
    i2v = {**index, "_class_name": "WanImageToVideoPipeline", "image_encoder": ["transformers", "CLIPVisionModel"]}
    (tmp_path / "model_index.json").write_text(json.dumps(i2v))
    settings = {**tiny["settings"], "MODEL_PATH": str(tmp_path), "DATA_PATH": "prompts.txt"}
    wan.check_dmd_settings("WanImageToVideoPipeline", settings, set(), "jsonl")
    assert wan.edits("WanImageToVideoPipeline") and not wan.edits("WanPipeline") and wan.MAX_REFERENCES == 1
    assert wan.reference_sizes((8, 8), {"control": "a.png", "prompt": "p"}, settings) == ((SIZE, SIZE),)
    assert wan.reference_sizes((8, 8), {"prompt": "p"}, settings) == ()
    cases = [({}, "txt", "DATA_PATH=prompts.txt with a WanImageToVideoPipeline teacher: a .txt holds prompts alone"),
             ({"MAX_SEQUENCE_LENGTH": 226}, "jsonl", "MAX_SEQUENCE_LENGTH=226 with a WanImageToVideoPipeline"),
             ({"REFERENCE_AREA": 1}, "jsonl", "REFERENCE_AREA=1 with a WanImageToVideoPipeline teacher: its first")]
    for change, kind, words in cases:
        with pytest.raises(ConfigError, match=re.escape(words)) as e:
            wan.check_dmd_settings("WanImageToVideoPipeline", {**settings, **change}, set(change), kind)
        assert "\n" not in str(e.value)
    (tmp_path / "model_index.json").write_text(json.dumps({**i2v, "image_encoder": [None, None]}))
    with pytest.raises(ConfigError, match=re.escape("image_dim and the image_encoder come together")) as e:
        wan.check_model("WanImageToVideoPipeline", str(tmp_path))
    assert "\n" not in str(e.value)
    from PIL import Image
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    data = tmp_path / "data.jsonl"  # what train_dmd.py reads for an editing teacher
    data.write_text(json.dumps({"control": "a.png", "prompt": "p"}) + "\n" + json.dumps({"prompt": "q"}) + "\n")
    with pytest.raises(ConfigError, match=re.escape(f"{data}:2")) as e:
        read_rows(str(data), roles=("control", "target", "prompt"), required=("control", "prompt"), skip_bad=False)
    assert "\n" not in str(e.value)


def test_ti2v_velocity_latents_and_sizes_are_the_pipelines(tiny, ti2v):
    """TI2V-5B: the room's velocity passes the pipeline's per-token timestep (B, tokens), (mask[0][0][:, ::2, ::2]
    * t).flatten() at every token, and equals the transformer called with it (the teacher's CFG pair too); its 2.2
    VAE (16x, 48 channels in the real one, 8 here) normalises as the pipeline does; sides are multiples of 32 and
    the flow shift is 5."""
    pipe = pipeline(ti2v["model"])
    settings = ti2v["settings"]
    grid = wan.latent_grid((TI2V_SIZE, TI2V_SIZE), settings)
    assert grid == (3, 4, 4) and wan.side_multiple(ti2v["model"]) == 32 and wan.flow_shift(ti2v["model"]) == 5.0
    x, t = torch.randn(2, 8, *grid), torch.tensor(700.0)
    text, negative = torch.randn(2, 512, 16), torch.randn(2, 512, 16)
    cond = wan.dmd_cond(text, negative, pipe.vae, [], grid)
    assert cond.per_token and not wan.dmd_cond(text, negative, pipeline(tiny["model"]).vae, [], grid).per_token
    mask = torch.ones(x.shape)
    timestep = (mask[0][0][:, ::2, ::2] * t).flatten().unsqueeze(0).expand(2, -1)  # pipeline_wan.py's
    seen = []
    hook = pipe.transformer.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["timestep"]), with_kwargs=True)
    with torch.no_grad():
        ours = cond.velocity(pipe.transformer, 1.0)(wan.pack_latents(x), t / 1000)
        pair = cond.velocity(pipe.transformer, 5.0)(wan.pack_latents(x), t / 1000)
        hook.remove()
        c, u = (pipe.transformer(hidden_states=x, timestep=timestep, encoder_hidden_states=e, return_dict=False)[0]
                for e in (text, negative))
    assert torch.equal(seen[0], timestep) and torch.equal(seen[1], torch.cat([timestep, timestep]))
    torch.testing.assert_close(wan.unpack_latents(ours, grid), c)
    torch.testing.assert_close(wan.unpack_latents(pair, grid), u + 5.0 * (c - u))
    video = torch.rand(1, 3, FRAMES, TI2V_SIZE, TI2V_SIZE) * 2 - 1
    with torch.no_grad():
        mu = pipe.vae.encode(video).latent_dist.mode()
    mean = torch.tensor(pipe.vae.config.latents_mean).view(1, 8, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(pipe.vae.config.latents_std).view(1, 8, 1, 1, 1)
    assert torch.equal(wan.encode_latents(pipe.vae, video), (mu - mean) * inv_std) and mu.shape[2:] == grid
    for change, words in (({"RESOLUTION": 48}, "a 48x48 px clip"), ({"BUCKET_ASPECTS": [1.25]}, "a 64x80 px")):
        with pytest.raises(ConfigError, match=re.escape(words) + ".+multiples of 32") as e:
            wan.check_dmd_settings("WanPipeline", {**settings, **change}, set(), "txt")
        assert "\n" not in str(e.value)
    wan.check_dmd_settings("WanPipeline", settings, set(), "txt")
    assert wan.video_size({"RESOLUTION": 704, "MODEL_PATH": ti2v["model"]}) == (704, 1280)  # Wan's 1280*704
    assert wan.video_size({"RESOLUTION": 544, "MODEL_PATH": ti2v["model"]}) == (544, 960)  # 16:9 in 32s


# Wan's original module names (the LightX2V / ComfyUI / musubi-tuner files) of diffusers' (its converter's map)
ORIGINAL_NAMES = {"attn1.to_q": "self_attn.q", "attn1.to_k": "self_attn.k", "attn1.to_v": "self_attn.v",
                  "attn1.to_out.0": "self_attn.o", "attn2.to_q": "cross_attn.q", "attn2.to_k": "cross_attn.k",
                  "attn2.to_v": "cross_attn.v", "attn2.to_out.0": "cross_attn.o", "ffn.net.0.proj": "ffn.0",
                  "ffn.net.2": "ffn.2"}


def test_teacher_lora_in_wans_own_key_forms_merges_as_the_pipeline_loads_it(tiny, tmp_path):
    """TEACHER_LORA of a Wan LoRA in Wan's original names, made from a diffusers-form adapter of every block's
    attention and FFN (scale 1.5 as alpha = 1.5 r): LightX2V (`diffusion_model.` + lora_down / lora_up / .alpha),
    ComfyUI (`diffusion_model.` + lora_A / lora_B / .alpha) and musubi-tuner (`lora_unet_`, names flattened with
    `_`) read through WanPipeline's lora_state_dict give the adapter's deltas, and the base merged as it loads
    equals diffusers' load_lora_weights + fuse of the same file."""
    from diffusers import WanTransformer3DModel

    from parallel import lora_merge
    from tests.test_lora_merge import assert_same_adapters, diffusers_adapter, write
    folder = os.path.join(tiny["model"], "transformer")

    def build():
        return WanTransformer3DModel.from_pretrained(folder)
    pairs, reference = diffusers_adapter(
        build(), 1.5, 5, r"blocks\.\d+\.(attn[12]\.(to_q|to_k|to_v|to_out\.0)|ffn\.net\.(0\.proj|2))")
    assert len(pairs) == 2 * 10
    forms = {"lightx2v": ("diffusion_model.{m}", "lora_down", "lora_up"),
             "comfyui": ("diffusion_model.{m}", "lora_A", "lora_B"),
             "musubi": ("lora_unet_{flat}", "lora_down", "lora_up")}
    for form, (name, down, up) in forms.items():
        tensors = {}
        for m, (a, b) in pairs.items():
            block, rest = re.fullmatch(r"(blocks\.\d+)\.(.+)", m).groups()
            original = f"{block}.{ORIGINAL_NAMES[rest]}"
            stem = name.format(m=original, flat=original.replace(".", "_"))
            tensors.update({f"{stem}.{down}.weight": a, f"{stem}.{up}.weight": b,
                            f"{stem}.alpha": torch.tensor(1.5 * a.shape[0])})
        file = write(tmp_path, f"{form}.safetensors", tensors)
        assert set(lora_merge.read_lora(file, pipeline="WanPipeline").layers) == set(pairs), form
        assert_same_adapters(file, "WanPipeline", reference, build, folder)


@pytest.mark.slow  # the A14B folder's build; the fast loop's budget
def test_a14b_experts_pick_each_samples_expert_by_its_timestep(a14b):
    """A14B: each sample goes to the expert WanPipeline would use at its timestep (transformer at t >= 875, the
    boundary itself included, transformer_2 below), the teacher's CFG pair too: the student's, the teacher's and
    the fake score's calls all go through this; an expert none of the samples needs is not called."""
    from families.wan.experts import Experts
    pipe = pipeline(a14b["model"])
    experts = Experts(pipe.transformer, pipe.transformer_2, wan.expert_boundary(a14b["model"]))
    grid = (3, 4, 4)
    x, text, negative = torch.randn(4, 4, *grid), torch.randn(4, 512, 16), torch.randn(4, 512, 16)
    sigma = torch.tensor([0.95, 0.875, 0.8749, 0.3])
    with torch.no_grad():
        ours = wan.dmd_cond(text, negative, None, [], grid).velocity(experts, 5.0)(wan.pack_latents(x), sigma)
        for i, expert in enumerate([pipe.transformer] * 2 + [pipe.transformer_2] * 2):
            c, u = (expert(hidden_states=x[i:i + 1], timestep=sigma[i:i + 1] * 1000, encoder_hidden_states=e[i:i + 1],
                           return_dict=False)[0] for e in (text, negative))
            torch.testing.assert_close(wan.unpack_latents(ours[i:i + 1], grid), u + 5.0 * (c - u))
        calls = []
        hooks = [m.register_forward_pre_hook(lambda m, a, kw, n=n: calls.append(n), with_kwargs=True)
                 for n, m in (("high", pipe.transformer), ("low", pipe.transformer_2))]
        experts(hidden_states=x[:2], timestep=torch.tensor([1000.0, 875.0]), encoder_hidden_states=text[:2])
        experts(hidden_states=x[:1], timestep=torch.tensor([874.9]), encoder_hidden_states=text[:1])
        for h in hooks:
            h.remove()
    assert calls == ["high", "low"]
    assert list(experts.pipeline_parts()) == ["transformer", "transformer_2"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tiny", "ti2v", "a14b"])
def test_sampling_loop_is_the_pipelines(kind, request, tmp_path):
    """The room's teacher velocity (cached text and "", CFG 5, timestep sigma * 1000, per token for TI2V-5B, the
    tokens unpacked) in the pipeline's own scheduler loop, from the noise the pipeline draws, gives its latents,
    and decode_latents its frames: Wan 2.1 T2V, TI2V-5B (its 2.2 VAE, flow_shift 5) and T2V-A14B (its steps at
    t 999 on transformer at CFG 5, 857 and 600 on transformer_2 at its guidance_scale_2, 2)."""
    from families.wan.experts import Experts
    from diffusers import UniPCMultistepScheduler
    from diffusers.utils.torch_utils import randn_tensor
    tiny = request.getfixturevalue(kind)
    size = tiny["settings"]["RESOLUTION"]
    pipe = pipeline(tiny["model"])
    captured = {}

    def keep(p, i, t, kw):
        captured["latents"] = kw["latents"]
        return kw
    low = {"guidance_scale_2": 2.0} if kind == "a14b" else {}  # A14B: the low-noise expert's own CFG
    frames = pipe(PROMPTS[0], height=size, width=size, num_frames=FRAMES, num_inference_steps=3,
                  generator=torch.Generator().manual_seed(0), output_type="np", callback_on_step_end=keep,
                  **low).frames
    text = cached_text(tiny, tmp_path, [PROMPTS[0], ""])
    grid = wan.latent_grid((size, size), tiny["settings"])
    channels = pipe.transformer.config.in_channels
    x = randn_tensor((1, channels, *grid), generator=torch.Generator().manual_seed(0), dtype=torch.float32)
    scheduler = UniPCMultistepScheduler.from_config(pipe.scheduler.config)
    scheduler.set_timesteps(3)
    scheduler.set_begin_index(0)
    cond = wan.dmd_cond(text[:1], text[1:], pipe.vae, [], grid)
    assert cond.per_token == (kind == "ti2v") and scheduler.config.flow_shift == (5.0 if kind == "ti2v" else 3.0)
    model = pipe.transformer
    if kind == "a14b":
        model = Experts(pipe.transformer, pipe.transformer_2, wan.expert_boundary(tiny["model"]))
        assert [float(t) for t in scheduler.timesteps] == [999.0, 857.0, 600.0]  # both experts
    v = cond.velocity(model, 5.0, guidance_2=low.get("guidance_scale_2"))
    with torch.no_grad():
        for t in scheduler.timesteps:
            pred = wan.unpack_latents(v(wan.pack_latents(x), t.float().reshape(1) / 1000), grid)
            x = scheduler.step(pred, t, x, return_dict=False)[0]
    torch.testing.assert_close(x, captured["latents"], rtol=1e-4, atol=1e-5)
    video = wan.decode_latents(pipe.vae, captured["latents"])
    ours = (video / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 4, 1).numpy()
    np.testing.assert_allclose(ours, frames, atol=1e-6)
    strip = wan.decode_tokens(pipe.vae, wan.pack_latents(captured["latents"]), grid)
    assert strip.shape == (1, 3, size, 3 * size) and torch.equal(strip[..., :size], video[:, :, 0])


@pytest.mark.slow  # the I2V folder's build; the fast loop's budget
def test_i2v_conditioning_is_the_pipelines(i2v, tmp_path):
    """Wan 2.1 I2V: the cached CLIP image tokens are encode_image's of the row's image (hidden_states[-2]), the
    first image read at the clip's size is video_processor.preprocess's, the condition channels are
    prepare_latents' (the mask 1 on the first latent frame, [image, zeros] encoded and normalised), and the room's
    velocity is the transformer on cat([x, condition]) with the image tokens, the CFG pair both with the same."""
    from data.images import load_pil
    pipe = pipeline(i2v["model"])
    rows = i2v["rows"][:1]
    cond, refs = i2v_cond(i2v, tmp_path, rows)
    image = load_pil(rows[0]["control"])
    with torch.no_grad():
        embeds = pipe.encode_image(image)
        pixels = pipe.video_processor.preprocess(image, height=SIZE, width=SIZE)
        x, condition = pipe.prepare_latents(pixels, 1, 4, SIZE, SIZE, FRAMES, torch.float32, torch.device("cpu"))
    assert embeds.shape == (1, 17, 16) and torch.equal(cond.image, embeds)
    assert torch.equal(refs[0], pixels) and refs[0].shape == (1, 3, SIZE, SIZE)
    assert condition.shape == (1, 8, 3, 4, 4) and torch.equal(cond.condition, condition)
    assert (condition[:, :4, 0] == 1).all() and (condition[:, :4, 1:] == 0).all()
    sigma = torch.tensor([0.8])
    with torch.no_grad():
        ours = cond.velocity(pipe.transformer, 5.0)(wan.pack_latents(x), sigma)
        c, u = (pipe.transformer(hidden_states=torch.cat([x, condition], dim=1), timestep=sigma * 1000,
                                 encoder_hidden_states=e, encoder_hidden_states_image=embeds, return_dict=False)[0]
                for e in (cond.text, cond.negative))
    torch.testing.assert_close(wan.unpack_latents(ours, cond.size), u + 5.0 * (c - u))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["i2v", "i2v_a14b", "ti2v_i2v"])
def test_i2v_sampling_loop_is_the_pipelines(kind, request, tmp_path):
    """The room's I2V teacher velocity (cached text and "", the cached image tokens, the first frame's condition
    channels, CFG 5) in the pipeline's own scheduler loop, from the noise the pipeline draws, gives
    WanImageToVideoPipeline's latents at 3 steps: Wan 2.1 I2V, Wan 2.2 I2V-A14B (no CLIP; boundary 0.9: its step
    at t 999 on transformer, 857 and 600 on transformer_2) and TI2V-5B's image mode (the image's latents as the
    first latent frame, its tokens at t = 0; its velocity there the one whose x0 is the image's, so the first
    frame comes out the image's as the pipeline's final (1 - mask) * condition + mask * latents)."""
    from diffusers import UniPCMultistepScheduler
    from diffusers.utils.torch_utils import randn_tensor

    from data.images import load_pil
    from families.wan.experts import Experts
    i2v = request.getfixturevalue(kind)
    pipe = pipeline(i2v["model"])
    row, size, channels = i2v["rows"][1], i2v["settings"]["RESOLUTION"], pipe.vae.config.z_dim
    seen = []
    hook = pipe.transformer.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["timestep"]), with_kwargs=True)
    theirs = pipe(image=load_pil(row["control"]), height=size, width=size, num_frames=FRAMES, num_inference_steps=3,
                  generator=torch.Generator().manual_seed(0), output_type="latent",
                  **i2v_prompt_embeds(pipe, row["prompt"])).frames
    hook.remove()
    cond, refs = i2v_cond(i2v, tmp_path, [row])
    x = randn_tensor((1, channels, *cond.size), generator=torch.Generator().manual_seed(0), dtype=torch.float32)
    with torch.no_grad():
        condition = pipe.prepare_latents(refs[0], 1, channels, size, size, FRAMES, torch.float32,
                                         torch.device("cpu"))[1]
    assert torch.equal(cond.condition, condition) and cond.per_token == (kind == "ti2v_i2v")
    scheduler = UniPCMultistepScheduler.from_config(pipe.scheduler.config)
    scheduler.set_timesteps(3)
    model = pipe.transformer
    assert (cond.image is None) == (kind != "i2v")  # 2.1 I2V alone has CLIP
    if kind == "i2v_a14b":
        model = Experts(pipe.transformer, pipe.transformer_2, wan.expert_boundary(i2v["model"]))
        assert model.boundary == 900.0 and [float(t) for t in scheduler.timesteps] == [999.0, 857.0, 600.0]
    v = cond.velocity(model, 5.0)
    hook = pipe.transformer.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["timestep"]), with_kwargs=True)
    with torch.no_grad():
        for t in scheduler.timesteps:
            pred = wan.unpack_latents(v(wan.pack_latents(x), t.float().reshape(1) / 1000), cond.size)
            x = scheduler.step(pred, t, x, return_dict=False)[0]
    hook.remove()
    if kind == "ti2v_i2v":  # every x0 keeps the image's first latent frame: x - sigma (x - first) / sigma
        z, s = wan.pack_latents(x), torch.tensor([0.7])
        with torch.no_grad():
            x0 = wan.unpack_latents(z - s * v(z, s), cond.size)
        torch.testing.assert_close(x0[:, :, :1], condition, rtol=0, atol=1e-6)
        x = torch.cat([condition, x[:, :, 1:]], dim=2)  # the pipeline's last (1 - mask) * condition + mask * x
        # the first latent frame's 2 x 2 tokens at t = 0, the others at t: the pipeline's first call, then ours
        assert (seen[0][0, :4] == 0).all() and (seen[0][0, 4:] == 999).all()
        for i in range(3):  # the pipeline's calls (cond, uncond) per step, then ours (the pair in one)
            assert torch.equal(seen[6 + i], torch.cat([seen[2 * i], seen[2 * i + 1]]).float())
    torch.testing.assert_close(x, theirs, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def dmd_runs(tiny, ti2v, a14b, i2v, ti2v_i2v, tmp_path_factory):
    """DMD2 of the tiny Wan teacher to a 4-step generator: full generator and fake score with EMA on 2 ranks, the
    same on one process (GRAD_ACCUM=2), the same resumed from its step-2 checkpoint; a LoRA generator and fake
    score on 2 ranks with validation; the tiny TI2V-5B's full generator, 2 steps on one process; the tiny
    T2V-A14B's LoRA experts on 2 ranks (with the merged export) and on one process (GRAD_ACCUM=2); the tiny
    I2V's full generator, 2 steps on one process from its first images, and the tiny TI2V-5B's in its image mode;
    the full run with CONTEXT_PARALLEL=2 on 2 ranks (one CP group: one process's samples) and the A14B run with it
    on 4 (two CP groups)."""
    root = tmp_path_factory.mktemp("wan")
    common = [f"--model_path={tiny['model']}", f"--data_path={tiny['data']}/prompts.txt",
              f"--text_cache_dir={root / 'text_cache'}", "--precision=fp32", f"--resolution={SIZE}",
              "--bucket_aspects=1.0", f"--num_frames={FRAMES}", "--max_steps=4", "--log_every=1",
              "--denoising_steps=999,749,499,249", "--batch_size=1", "--sample_count=2", "--dfake_gen_update_ratio=2",
              "--save_every=2", "--sample_every=4", "--export_dtype=fp32", "--generator_lr=1e-3", "--guidance_lr=1e-3"]
    out = {k: root / k for k in ("full", "one", "stopped", "lora", "ti2v", "a14b", "a14b_one", "i2v", "ti2v_i2v",
                                 "cp", "a14b_cp", "a14b_loras", "diversity", "gan", "i2v_gan")}
    clips = root / "clips"  # the GAN's real clips: each prompt with an animated GIF of 9 frames (I2V: and its image)
    clips.mkdir()
    prompts = [p for p in open(f"{tiny['data']}/prompts.txt").read().split("\n") if p.strip()]
    for i in range(len(prompts)):
        write_clip(clips / f"{i}.gif", [(40 * i % 255, 20 * k, 200) for k in range(FRAMES)])
    (clips / "rows.jsonl").write_text("".join(json.dumps({"prompt": p, "target": f"{i}.gif"}) + "\n"
                                              for i, p in enumerate(prompts)))
    (clips / "i2v_rows.jsonl").write_text("".join(json.dumps({**r, "target": f"{i % len(prompts)}.gif"}) + "\n"
                                                  for i, r in enumerate(i2v["rows"])))
    files = expert_lora_files(a14b["model"], root / "expert_loras")
    ti2v_args = [f"--model_path={ti2v['model']}", f"--data_path={ti2v['data']}/prompts.txt",
                 f"--text_cache_dir={root / 'ti2v_text_cache'}", f"--resolution={TI2V_SIZE}"]
    a14b_args = [f"--model_path={a14b['model']}", f"--data_path={a14b['data']}/prompts.txt",
                 f"--text_cache_dir={root / 'a14b_text_cache'}", "--lora_rank=4", "--fake_lora=1", "--max_steps=3",
                 "--save_every=3", "--sample_every=0", "--ema_decay=0.9", "--real_guidance_scale_2=3"]
    i2v_args = [f"--model_path={i2v['model']}", f"--data_path={i2v['data']}/data.jsonl",
                f"--text_cache_dir={root / 'i2v_text_cache'}", f"--output_dir={out['i2v']}", "--max_steps=2",
                "--save_every=0", "--sample_every=2"]
    job = functools.partial(dict, script="train_dmd.py", ranks=2, env=launch_env())
    done = launch_all_resuming({
        "full": job(args=common + [f"--output_dir={out['full']}", "--ema_decay=0.9"]),
        "one": job(args=common + [f"--output_dir={out['one']}", "--ema_decay=0.9", "--grad_accum=2",
                                  "--save_every=0", "--sample_every=0"], ranks=1),
        "lora": job(args=common + [f"--output_dir={out['lora']}", "--lora_rank=4", "--fake_lora=1", "--save_every=0",
                                   "--max_steps=2", "--sample_every=2", *VALIDATE]),
        "ti2v": job(args=common + ti2v_args + [f"--output_dir={out['ti2v']}", "--max_steps=2", "--save_every=0",
                                               "--sample_every=2", "--sample_count=1"], ranks=1),
        "a14b": job(args=common + a14b_args + [f"--output_dir={out['a14b']}", "--lora_export_merged=1"]),
        "a14b_one": job(args=common + a14b_args + [f"--output_dir={out['a14b_one']}", "--grad_accum=2"], ranks=1),
        "cp": job(args=common + [f"--output_dir={out['cp']}", "--ema_decay=0.9", "--grad_accum=2", "--save_every=0",
                                 "--context_parallel=2"]),
        "a14b_cp": job(args=common + a14b_args + [f"--output_dir={out['a14b_cp']}", "--context_parallel=2"], ranks=4),
        "a14b_loras": job(args=common + a14b_args + [
            f"--output_dir={out['a14b_loras']}", "--lora_rank=2", "--lora_alpha=2", "--generator_lr=0",
            "--max_steps=1", "--save_every=0", "--ema_decay=0"] + [f"--{k}={v}" for k, v in files["args"].items()],
            ranks=1),
        "i2v": job(args=common + i2v_args, ranks=1),
        # SEED 1 draws the step indices 0 then 1 (dm.choose_step_index); the generator steps every step, the
        # second from its first step's Euler step (STUDENT_SAMPLE_TYPE=ode)
        "diversity": job(args=common + [f"--output_dir={out['diversity']}", "--seed=1", "--max_steps=2",
                                        "--dfake_gen_update_ratio=1", "--diversity_weight=0.5", "--save_every=0",
                                        "--sample_every=0", "--student_sample_type=ode"], ranks=1),
        "gan": job(args=common + [f"--output_dir={out['gan']}", f"--data_path={clips / 'rows.jsonl'}", "--use_gan=1",
                                  "--max_steps=2", "--dfake_gen_update_ratio=1", "--save_every=0", "--sample_every=0"],
                   ranks=1),
        "i2v_gan": job(args=common + i2v_args + [
            f"--output_dir={out['i2v_gan']}", "--use_gan=1", f"--data_path={clips / 'i2v_rows.jsonl'}",
            f"--text_cache_dir={root / 'i2v_gan_text_cache'}",  # not i2v's: the jobs run at once
            "--dfake_gen_update_ratio=1"], ranks=1),
        "ti2v_i2v": job(args=common + i2v_args + [f"--model_path={ti2v_i2v['model']}", f"--resolution={TI2V_SIZE}",
                                                  f"--text_cache_dir={root / 'ti2v_i2v_text_cache'}",
                                                  f"--output_dir={out['ti2v_i2v']}"], ranks=1)},
        "full", job(args=common + [f"--output_dir={out['stopped']}", "--ema_decay=0.9", "--resume=auto"]))
    return {"out": out, "logs": {k: v.stdout for k, v in done.items()}, "expert_loras": files}


def expert_lora_files(model, folder) -> dict:
    """A14B LoRA pairs as the Lightning / LightX2V ones come (one file per expert, `diffusion_model.` keys,
    lora_down / lora_up / .alpha): a rank-2 teacher pair (scale 1.5) and a rank-2 generator pair (scale 2) of
    every block's attention and FFN. {"args": the four settings, "deltas": {(role, expert): {module: B @ A x s}}}."""
    from diffusers import WanTransformer3DModel

    from tests.test_lora_merge import diffusers_adapter, write
    args, deltas = {}, {}
    for i, (setting, role, expert, scale) in enumerate((
            ("teacher_lora", "teacher", "transformer", 1.5), ("teacher_lora_2", "teacher", "transformer_2", 1.5),
            ("generator_lora", "generator", "transformer", 2.0),
            ("generator_lora_2", "generator", "transformer_2", 2.0))):
        pairs, _ = diffusers_adapter(WanTransformer3DModel.from_pretrained(os.path.join(model, expert)), scale, 20 + i,
                                     r"blocks\.\d+\.(attn[12]\.(to_q|to_k|to_v|to_out\.0)|ffn\.net\.(0\.proj|2))")
        tensors = {}
        for m, (a, b) in pairs.items():
            block, rest = re.fullmatch(r"(blocks\.\d+)\.(.+)", m).groups()
            stem = f"diffusion_model.{block}.{ORIGINAL_NAMES[rest]}"
            tensors.update({f"{stem}.lora_down.weight": a, f"{stem}.lora_up.weight": b,
                            f"{stem}.alpha": torch.tensor(scale * a.shape[0])})
        args[setting] = write(str(folder), f"{setting}.safetensors", tensors)
        deltas[role, expert] = {m: (b.float() @ a.float()) * scale for m, (a, b) in pairs.items()}
    return {"args": args, "deltas": deltas}


@pytest.mark.slow
def test_dmd_two_ranks_equal_one_and_resume_is_bit_exact(dmd_runs):
    """2 ranks give one process's losses (GRAD_ACCUM=2), the run resumed at step 2 ends bit for bit as the straight
    one, the log names the clip, its tokens, the teacher's CFG and the export's call; validation on the LoRA run."""
    out, logs = dmd_runs["out"], dmd_runs["logs"]
    assert_two_ranks_equal_one_and_resumed(out["full"], out["one"], out["stopped"])
    assert "32x32 px x 3 latent frames (1 shape(s)), 12 target tokens" in logs["full"]
    assert "teacher true CFG 5 (none rescale)" in logs["full"]
    assert "pipe(..., num_inference_steps=4, guidance_scale=1.0)" in logs["full"]
    assert (out["full"] / "samples" / "step_000004.png").exists()
    assert_validated(out["lora"], [2], logs["lora"])


@pytest.mark.slow
def test_diversity_weight_trains_the_first_step_on_the_teachers_ode(dmd_runs):
    """DIVERSITY_WEIGHT: the generator step at the first σ logs loss_div and no DM loss; the next, at σ index 1,
    loss_dm and no loss_div (the loss itself: tests/test_diversity_dmd.py)."""
    records = [json.loads(line) for line in open(dmd_runs["out"]["diversity"] / "metrics.jsonl")]
    steps = {r["step"]: r for r in records if "step_index" in r}
    assert steps[1]["step_index"] == 0 and "loss_dm" not in steps[1] and 0 < steps[1]["loss_div"] < 1e6, steps
    assert steps[2]["step_index"] == 1 and "loss_div" not in steps[2] and 0 <= steps[2]["loss_dm"] < 1e6, steps


@pytest.mark.slow
def test_an_ode_student_samples_in_the_pipeline_as_it_trained(tiny, dmd_runs, tmp_path):
    """STUDENT_SAMPLE_TYPE=ode (the diversity run): the export's scheduler takes Euler steps (no fresh noise), and
    WanPipeline's latents from given noise at the default call with 4 steps are the room's sampler's over the
    trained σ (sample_tokens with ode: the backward simulation's steps, then x̂0): the same transformer calls
    in fp32, the timesteps within an ulp of each other."""
    from diffusers import WanPipeline
    pipe = WanPipeline.from_pretrained(str(dmd_runs["out"]["diversity"] / "export"))
    assert type(pipe.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"
    assert not pipe.scheduler.config.stochastic_sampling
    grid = wan.latent_grid((SIZE, SIZE), tiny["settings"])
    noise = torch.randn((1, pipe.transformer.config.in_channels, *grid), generator=torch.Generator().manual_seed(0))
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        latents = pipe(PROMPTS[0], height=SIZE, width=SIZE, num_frames=FRAMES, num_inference_steps=4,
                       guidance_scale=1.0, latents=noise.clone(), output_type="latent").frames
        cond = wan.dmd_cond(cached_text(tiny, tmp_path, PROMPTS[:1]), None, pipe.vae, [], grid)
        sigmas = wan.generator_sigmas(tiny["model"], [1.0, 0.75, 0.5, 0.25])
        ours = flow_dm.sample_tokens(pipe.transformer, cond, wan.pack_latents(noise), None, sigmas, 1.0, ode=True)
    torch.testing.assert_close(wan.unpack_latents(ours, grid), latents, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_gan_trains_on_real_clips(dmd_runs):
    """USE_GAN with rows of prompts and real clips (text to video; image to video with its first images): every
    step logs the head's loss on the fake score's side, and the generator's steps its own, both finite (what the
    head reads: test_gan_reads_real_clips_and_the_last_...); the image-to-video grid shows each row's first image,
    sample and real clip, the clips as their first, middle and last frames (3 tiles of 3 frames, a row a sample)."""
    from PIL import Image
    for run in ("gan", "i2v_gan"):
        records = [r for r in read_metrics(dmd_runs["out"][run], timing=False) if "loss_guidance_cls" in r]
        assert len(records) == 2 and all(0 < r["loss_guidance_cls"] < 1e3 for r in records), (run, records)
        assert all(0 < r["loss_gen_cls"] < 1e3 for r in records if "loss_dm" in r) and any(
            "loss_gen_cls" in r for r in records), (run, records)
    grid = Image.open(dmd_runs["out"]["i2v_gan"] / "samples" / "step_000002.png")
    assert grid.size[0] >= 3 * 3 * SIZE and grid.size[1] >= 2 * SIZE, grid.size


@pytest.mark.slow
def test_dmd_context_parallel_trains_as_one_process(dmd_runs):
    """CONTEXT_PARALLEL=2 (each clip's 12 tokens split over the 2 ranks of a CP group, Ulysses self-attention) logs
    one process's losses and grad norms (a grad scale off by the CP degree would show in the norms; Adam would hide
    it in the weights), exports its weights, and samples its grid; A14B's experts on two CP groups of 2 (a group
    with no sample for a needed expert calling it on 2 tokens, one per rank) log one process's losses."""
    out, logs = dmd_runs["out"], dmd_runs["logs"]
    assert "context parallel: 1 data-parallel group(s) of 2 ranks" in logs["cp"]
    assert "context parallel: 2 data-parallel group(s) of 2 ranks" in logs["a14b_cp"]
    for cp, one in (("cp", "one"), ("a14b_cp", "a14b_one")):
        a, b = read_metrics(out[cp], timing=False), read_metrics(out[one], timing=False)
        for key in ("loss_fake", "loss_dm", "grad_norm_generator", "grad_norm_guidance"):
            assert [r.get(key) is None for r in a] == [r.get(key) is None for r in b], key
            # fp32 sums in another order (attention over heads split, grads summed over ranks): measured 1e-6
            assert [r[key] for r in a if key in r] == pytest.approx([r[key] for r in b if key in r], rel=1e-4), key
    # 4 AdamW steps at LR 1e-3: a wrong split moves elements by ~1e-3; rounding, measured, by < 1e-6
    w_cp, w_one = load_export(out["cp"]), load_export(out["one"])
    assert w_cp.keys() == w_one.keys()
    for k in w_one:
        torch.testing.assert_close(w_cp[k], w_one[k], rtol=1e-5, atol=2e-5, msg=k)
    from PIL import Image
    a, b = (np.asarray(Image.open(out[k] / "samples" / "step_000004.png"), dtype=np.int16) for k in ("cp", "full"))
    assert a.shape == b.shape and np.abs(a - b).max() <= 2


@pytest.mark.slow
def test_dmd_exports_load_in_the_pipeline_and_sample_the_trained_sigmas(tiny, dmd_runs):
    """The full export (its scheduler named in model_index.json) and the LoRA export on the base (load_lora_weights,
    the export's scheduler) sample at the pipeline's default call with 4 steps at the trained sigma list; the video
    demo's scorer samples the stochastic export the same whatever the global RNG's state."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline
    trained = wan.generator_sigmas(tiny["model"], [1.0, 0.75, 0.5, 0.25])
    full = WanPipeline.from_pretrained(str(dmd_runs["out"]["full"] / "export"))
    lora = WanPipeline.from_pretrained(tiny["model"])
    base = lora.transformer.blocks[0].attn1.to_q.weight.clone()
    lora.load_lora_weights(str(dmd_runs["out"]["lora"] / "export"))
    lora.scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(str(dmd_runs["out"]["lora"] / "export"),
                                                                     subfolder="scheduler")
    assert "lora" in type(lora.transformer.blocks[0].attn1.to_q).__module__ or \
        not torch.equal(lora.transformer.blocks[0].attn1.to_q.weight, base)
    for pipe in (full, lora):
        assert type(pipe.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"
        pipe.set_progress_bar_config(disable=True)
        seen = []
        pipe.transformer.register_forward_pre_hook(lambda m, a, kw: seen.append(float(kw["timestep"][0])),
                                                   with_kwargs=True)
        video = pipe(PROMPTS[0], height=SIZE, width=SIZE, num_frames=FRAMES, num_inference_steps=4,
                     guidance_scale=1.0, generator=torch.Generator().manual_seed(0), output_type="np").frames
        assert np.isfinite(video).all() and video.shape == (1, FRAMES, SIZE, SIZE, 3)
        assert seen == pytest.approx([s * 1000 for s in trained], rel=1e-6)
    # the video demo's rows of a stochastic export do not depend on the global RNG's state before them
    from demos import video_eval
    clips = []
    for state in (1, 2):
        torch.manual_seed(state)
        clips.append(video_eval.generate(full, PROMPTS[:1], seeds=2, steps=4)[0])
    assert np.array_equal(*clips)


@pytest.mark.slow
def test_ti2v_dmd_export_loads_in_the_pipeline_and_samples_per_token(ti2v, dmd_runs):
    """DMD2 of the tiny TI2V-5B: its export (model_index.json's expand_timesteps, the 2.2 VAE, the stochastic
    FlowMatchEuler at shift 5) samples 4 steps in WanPipeline with per-token timesteps at the trained sigmas."""
    from diffusers import WanPipeline
    out, log = dmd_runs["out"]["ti2v"], dmd_runs["logs"]["ti2v"]
    assert "64x64 px x 3 latent frames (1 shape(s)), 12 target tokens" in log
    assert (out / "samples" / "step_000002.png").exists()
    trained = wan.generator_sigmas(ti2v["model"], [1.0, 0.75, 0.5, 0.25])
    assert trained == pytest.approx([1.0, 0.965293, 0.891341, 0.625], abs=1e-6)  # shift 5, to 5 * 0.25 / 2
    pipe = WanPipeline.from_pretrained(str(out / "export"))
    assert pipe.config.expand_timesteps and pipe.scheduler.config.shift == 5.0 and pipe.vae.config.is_residual
    pipe.set_progress_bar_config(disable=True)
    seen = []
    pipe.transformer.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["timestep"]), with_kwargs=True)
    video = pipe(PROMPTS[0], height=TI2V_SIZE, width=TI2V_SIZE, num_frames=FRAMES, num_inference_steps=4,
                 guidance_scale=1.0, generator=torch.Generator().manual_seed(0), output_type="np").frames
    assert np.isfinite(video).all() and video.shape == (1, FRAMES, TI2V_SIZE, TI2V_SIZE, 3)
    assert all(t.shape == (1, 12) and (t == t[0, 0]).all() for t in seen)
    assert [float(t[0, 0]) for t in seen] == pytest.approx([s * 1000 for s in trained], rel=1e-6)


@pytest.mark.slow
def test_a14b_dmd_two_ranks_equal_one_and_exports_both_experts(a14b, dmd_runs):
    """A14B's LoRA experts: 2 ranks (each sample to its expert, a rank with no sample for a needed expert calling
    it on one token) give one process's losses (GRAD_ACCUM=2); the export is two LoRA files (the second loaded
    with load_into_transformer_2=True) and the merged pipeline holds both experts; both sample 4 steps in
    WanPipeline at the trained sigmas, transformer at t >= 875 (1000, 928), transformer_2 below (799, 500)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline
    out, logs = dmd_runs["out"], dmd_runs["logs"]
    two, one = read_metrics(out["a14b"], timing=False), read_metrics(out["a14b_one"], timing=False)
    for key in ("loss_fake", "loss_dm"):
        assert [r[key] for r in two if key in r] == pytest.approx([r[key] for r in one if key in r], rel=1e-4), key
    assert "load_lora_weights(export/transformer_2, load_into_transformer_2=True)" in logs["a14b"]
    assert "teacher true CFG 5, 3 on the low-noise expert (none rescale)" in logs["a14b"]
    state = read_checkpoint(out["a14b"], 3, flat=True)  # both experts of every trained role, the adapters' EMA
    for part in ("model.generator.transformer.", "model.generator.transformer_2.", "model.fake.transformer_2.",
                 "model.ema.shadow.", "optim.generator."):
        assert any(k.startswith("." + part) for k in state), part
    trained = wan.generator_sigmas(a14b["model"], [1.0, 0.75, 0.5, 0.25])
    lora = WanPipeline.from_pretrained(a14b["model"])
    lora.load_lora_weights(str(out["a14b"] / "export"))
    lora.load_lora_weights(str(out["a14b"] / "export" / "transformer_2"), load_into_transformer_2=True)
    lora.scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(str(out["a14b"] / "export"), subfolder="scheduler")
    merged = WanPipeline.from_pretrained(str(out["a14b"] / "export_merged"))
    plain = WanPipeline.from_pretrained(a14b["model"])
    used = {trained[int(r["step_index"])] * 1000 >= 875 for r in two if "loss_dm" in r}  # the generator steps' experts
    for name, high in (("transformer", True), ("transformer_2", False)):  # each file adapts its own expert
        fused = copy.deepcopy(getattr(lora, name))
        fused.fuse_lora()
        fused = {k.replace(".base_layer.", "."): v for k, v in fused.named_parameters() if ".lora_" not in k}
        ours, before = dict(getattr(merged, name).named_parameters()), dict(getattr(plain, name).named_parameters())
        assert fused.keys() == ours.keys()
        for k, v in ours.items():
            torch.testing.assert_close(fused[k], v, msg=k)
        key = "blocks.0.attn1.to_q.weight"  # an expert moves only where a generator step used it
        assert (not torch.equal(ours[key], before[key])) == (high in used), (name, used)
    for pipe in (lora, merged):
        pipe.set_progress_bar_config(disable=True)
        seen = []
        for name, m in (("high", pipe.transformer), ("low", pipe.transformer_2)):
            m.register_forward_pre_hook(lambda m, a, kw, n=name: seen.append((n, float(kw["timestep"][0]))),
                                        with_kwargs=True)
        video = pipe(PROMPTS[0], height=SIZE, width=SIZE, num_frames=FRAMES, num_inference_steps=4,
                     guidance_scale=1.0, generator=torch.Generator().manual_seed(0), output_type="np").frames
        assert np.isfinite(video).all() and video.shape == (1, FRAMES, SIZE, SIZE, 3)
        assert [n for n, _ in seen] == ["high", "high", "low", "low"]
        assert [t for _, t in seen] == pytest.approx([s * 1000 for s in trained], rel=1e-6)


@pytest.mark.slow
def test_a14b_lora_pairs_start_each_expert_and_the_export_carries_both(a14b, dmd_runs):
    """A14B with a LoRA pair for the teacher (TEACHER_LORA, TEACHER_LORA_2) and one for the generator
    (GENERATOR_LORA, GENERATOR_LORA_2), all in LightX2V's form, generator LR 0: each expert's teacher is the base
    + its own file, the generator starts from its own, and the export's two files (the second loaded with
    load_into_transformer_2=True) fuse on the plain base to base + teacher's + generator's deltas, expert by
    expert."""
    from diffusers import WanPipeline
    out, files = dmd_runs["out"]["a14b_loras"], dmd_runs["expert_loras"]
    assert "generator: its adapters from GENERATOR_LORA=" in dmd_runs["logs"]["a14b_loras"]
    pipe = WanPipeline.from_pretrained(a14b["model"])
    plain = WanPipeline.from_pretrained(a14b["model"])
    pipe.load_lora_weights(str(out / "export"))
    pipe.load_lora_weights(str(out / "export" / "transformer_2"), load_into_transformer_2=True)
    for expert in ("transformer", "transformer_2"):
        model = getattr(pipe, expert)
        model.fuse_lora()
        fused = {k.replace(".base_layer.", "."): v for k, v in model.named_parameters() if ".lora_" not in k}
        base = dict(getattr(plain, expert).named_parameters())
        moved = files["deltas"]["teacher", expert]
        for m, d in moved.items():
            want = base[f"{m}.weight"] + d + files["deltas"]["generator", expert][m]
            torch.testing.assert_close(fused[f"{m}.weight"], want, rtol=1e-5, atol=1e-6, msg=(expert, m))
        assert all(torch.equal(fused[k], v) for k, v in base.items() if k[:-len(".weight")] not in moved
                   and k.endswith(".weight"))
    # the teacher as the run builds it (the room's build, the pair read as train_dmd.py reads it): each expert
    # merged with its own file
    import fsdp_utils
    from parallel import lora_merge
    from precision import get_precision
    merge = {expert: lora_merge.read_lora(files["args"][setting], pipeline="WanPipeline")
             for setting, expert in (("teacher_lora", "transformer"), ("teacher_lora_2", "transformer_2"))}
    teacher = wan.build_transformer(os.path.join(a14b["model"], "transformer"), None, get_precision("fp32"),
                                    torch.device("cpu"), load=True, sharding=fsdp_utils.Sharding(), block_classes=[],
                                    trainable=False, frozen_dtype=torch.float32, merge=merge)
    for expert in ("transformer", "transformer_2"):
        ours, base = (dict(getattr(m, expert).named_parameters()) for m in (teacher, plain))
        for m, d in files["deltas"]["teacher", expert].items():
            torch.testing.assert_close(ours[f"{m}.weight"], base[f"{m}.weight"] + d, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_i2v_dmd_export_loads_in_the_pipeline_and_samples_from_the_first_image(i2v, dmd_runs):
    """DMD2 of the tiny Wan 2.1 I2V from its rows' first images (their CLIP tokens cached beside the text): the full
    export (the image encoder and processor beside the trained transformer) samples 4 steps in
    WanImageToVideoPipeline at the trained sigmas, its first frame the image's."""
    from diffusers import WanImageToVideoPipeline

    from data.images import load_pil
    out, log = dmd_runs["out"]["i2v"], dmd_runs["logs"]["i2v"]
    assert "data: 16 rows" in log and "image cache: 16 first images' CLIP tokens, computed 16" in log
    assert "12 target tokens + the first frame as the pipeline conditions on it, σ" in log  # no reference tokens
    assert "32x32 px x 3 latent frames (1 shape(s))" in log and (out / "samples" / "step_000002.png").exists()
    trained = wan.generator_sigmas(i2v["model"], [1.0, 0.75, 0.5, 0.25])
    pipe = WanImageToVideoPipeline.from_pretrained(str(out / "export"))
    assert pipe.image_encoder is not None and pipe.transformer.config.in_channels == 12
    assert type(pipe.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"
    pipe.set_progress_bar_config(disable=True)
    seen = []
    pipe.transformer.register_forward_pre_hook(lambda m, a, kw: seen.append(float(kw["timestep"][0])),
                                               with_kwargs=True)
    row = i2v["rows"][0]
    video = pipe(image=load_pil(row["control"]), height=SIZE, width=SIZE, num_frames=FRAMES, num_inference_steps=4,
                 guidance_scale=1.0, generator=torch.Generator().manual_seed(0), output_type="np",
                 **i2v_prompt_embeds(pipe, row["prompt"])).frames
    assert np.isfinite(video).all() and video.shape == (1, FRAMES, SIZE, SIZE, 3)
    assert seen == pytest.approx([s * 1000 for s in trained], rel=1e-6)


@pytest.mark.slow
def test_ti2v_image_mode_dmd_export_samples_from_the_first_image(ti2v_i2v, dmd_runs):
    """DMD2 of the tiny TI2V-5B in its image mode: the full export loads in WanImageToVideoPipeline
    (expand_timesteps) and samples 4 steps at the trained sigmas, the first latent frame's tokens at t = 0."""
    from diffusers import WanImageToVideoPipeline

    from data.images import load_pil
    out, log = dmd_runs["out"]["ti2v_i2v"], dmd_runs["logs"]["ti2v_i2v"]
    assert "data: 16 rows" in log and "64x64 px x 3 latent frames" in log and "image cache" not in log
    trained = wan.generator_sigmas(ti2v_i2v["model"], [1.0, 0.75, 0.5, 0.25])
    pipe = WanImageToVideoPipeline.from_pretrained(str(out / "export"))
    assert pipe.config.expand_timesteps and pipe.image_encoder is None
    pipe.set_progress_bar_config(disable=True)
    seen = []
    pipe.transformer.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["timestep"]), with_kwargs=True)
    row = ti2v_i2v["rows"][0]
    video = pipe(image=load_pil(row["control"]), height=TI2V_SIZE, width=TI2V_SIZE, num_frames=FRAMES,
                 num_inference_steps=4, guidance_scale=1.0, generator=torch.Generator().manual_seed(0),
                 output_type="np", **i2v_prompt_embeds(pipe, row["prompt"])).frames
    assert np.isfinite(video).all() and video.shape == (1, FRAMES, TI2V_SIZE, TI2V_SIZE, 3)
    assert all(t.shape == (1, 12) and (t[0, :4] == 0).all() for t in seen)
    assert [float(t[0, 4]) for t in seen] == pytest.approx([s * 1000 for s in trained], rel=1e-6)
