"""Tests of tools/tiny_models.py and the families' tiny builders it gathers (families/<name>/tiny.py,
families/tiny/): the embedded default model folders and datasets, all offline, CPU.

    python -m pytest tests/test_tiny_models.py -q

Each model folder is built once per module (a second or so) and reloaded through the same
`from_pretrained` path the training scripts use.
"""
import json
import os
import threading
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # never touch the hub; everything here is built locally

import numpy as np
import pytest
import torch
from PIL import Image

from tools import tiny_models

PROMPT = "a red circle on a blue background"


@pytest.fixture(scope="module")
def sd15_folder(tmp_path_factory):
    return tiny_models.make_tiny_sd15(tmp_path_factory.mktemp("sd15") / "model", seed=0)


@pytest.fixture(scope="module")
def flux_folder(tmp_path_factory):
    return tiny_models.make_tiny_flux_kontext(tmp_path_factory.mktemp("flux") / "model", seed=0)


@pytest.fixture(scope="module")
def qwen_pipe(tmp_path_factory):
    """The tiny Qwen-Image-Edit-2509 folder, loaded (its processor through load_qwen_processor: the
    plain Qwen2VLProcessor needs torchvision for its video processor in transformers 5)."""
    from diffusers import QwenImageEditPlusPipeline

    folder = tiny_models.make_tiny_qwen_image_edit(tmp_path_factory.mktemp("qwen") / "model", seed=0)
    pipe = QwenImageEditPlusPipeline.from_pretrained(
        folder, processor=tiny_models.load_qwen_processor(folder / "processor"))
    pipe.set_progress_bar_config(disable=True)
    return pipe


# ----------------------------------------------------------------------------------------------
# tokenizers

def test_clip_tokenizer_reloads_and_encodes(tmp_path):
    from transformers import CLIPTokenizer

    tiny_models.write_clip_tokenizer(tmp_path)
    tok = CLIPTokenizer.from_pretrained(tmp_path)
    assert tok.model_max_length == tiny_models.TEXT_MAX_LENGTH
    tokens = tok.convert_ids_to_tokens(tok(PROMPT).input_ids)
    assert tokens == ["<|startoftext|>", "a</w>", "red</w>", "circle</w>", "on</w>", "a</w>",
                      "blue</w>", "background</w>", "<|endoftext|>"]
    # Text outside the prompt words still encodes (character pieces), and pads to max length.
    ids = tok("zebra 42, quickly!").input_ids
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    assert tok.unk_token_id not in ids[1:-1]
    padded = tok(PROMPT, padding="max_length", truncation=True).input_ids
    assert len(padded) == tok.model_max_length
    assert tok.pad_token_id == tok.eos_token_id == len(tok) - 1


def test_t5_tokenizer_reloads_and_encodes(tmp_path):
    from transformers import T5TokenizerFast

    tiny_models.write_t5_tokenizer(tmp_path)
    tok = T5TokenizerFast.from_pretrained(tmp_path)
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    ids = tok("make the circle blue").input_ids
    assert tok.convert_ids_to_tokens(ids) == ["▁make", "▁the", "▁circle", "▁blue", "</s>"]
    assert tok.decode(tok("Zebra 42, go!").input_ids, skip_special_tokens=True) == "Zebra 42, go!"
    padded = tok(PROMPT, padding="max_length", max_length=16, truncation=True).input_ids
    assert len(padded) == 16 and padded[-1] == tok.pad_token_id


def test_qwen_tokenizer_special_tokens_and_template(qwen_pipe):
    tok, config = qwen_pipe.tokenizer, qwen_pipe.text_encoder.config
    added = [token for token, _ in tiny_models.QWEN_ADDED_TOKENS]
    first = len(tok) - len(added)
    for i, token in enumerate(added):  # one id each, in Qwen2.5-VL's order, after the BPE vocabulary
        assert tok(token).input_ids == [first + i] and tok.decode([first + i]) == token
    ids = tok.convert_tokens_to_ids
    assert (config.image_token_id, config.video_token_id, config.vision_start_token_id,
            config.vision_end_token_id) == tuple(ids(["<|image_pad|>", "<|video_pad|>", "<|vision_start|>",
                                                      "<|vision_end|>"]))
    assert config.text_config.eos_token_id == tok.eos_token_id == ids("<|im_end|>")
    assert config.text_config.bos_token_id == tok.pad_token_id == ids("<|endoftext|>")
    assert tok.bos_token is None and tok.unk_token is None and config.text_config.vocab_size >= len(tok)
    assert qwen_pipe.processor.tokenizer.get_vocab() == tok.get_vocab()
    # The pipeline drops the first prompt_template_encode_start_idx (64) tokens: exactly the system
    # turn and "<|im_start|>user\n", as with the real tokenizer; the image and prompt tokens stay.
    template, drop = qwen_pipe.prompt_template_encode, qwen_pipe.prompt_template_encode_start_idx
    user = "Picture 1: <|vision_start|><|image_pad|><|vision_end|>make the circle the colour of picture 2"
    encoded = tok(template.format(user)).input_ids
    assert tok.decode(encoded[:drop]) == template.split("{}")[0]
    assert tok.decode(encoded[drop:]) == user + "<|im_end|>\n<|im_start|>assistant\n"
    assert len(tok(" make the circle the colour of picture 2").input_ids) == 9  # whole words
    text = "Zebra 42, ünïcode & tabs\t!"  # anything else still encodes, byte by byte
    assert tok.decode(tok(text).input_ids) == text


# ----------------------------------------------------------------------------------------------
# model folders

def test_sd15_folder_loads_and_generates(sd15_folder):
    from diffusers import DDIMScheduler, StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(sd15_folder)
    assert isinstance(pipe.scheduler, DDIMScheduler)
    cfg = pipe.scheduler.config
    assert (cfg.beta_schedule, cfg.beta_start, cfg.beta_end, cfg.num_train_timesteps) == (
        "scaled_linear", 0.00085, 0.012, 1000)
    assert cfg.prediction_type == "epsilon" and cfg.steps_offset == 1 and not cfg.set_alpha_to_one
    # alpha-bar at t = 999 of SD-1.5's scaled-linear schedule (DMD2's 1-step generator input).
    assert pipe.scheduler.alphas_cumprod[999].item() == pytest.approx(0.004660, abs=2e-6)
    assert pipe.text_encoder.config.vocab_size == len(pipe.tokenizer)
    assert pipe.text_encoder.config.max_position_embeddings == pipe.tokenizer.model_max_length
    classes = {type(m).__name__ for m in pipe.unet.modules()}
    assert {"BasicTransformerBlock", "ResnetBlock2D"} <= classes
    images = pipe(PROMPT, num_inference_steps=2, output_type="np",
                  generator=torch.Generator().manual_seed(0)).images
    assert images.shape == (1, 64, 64, 3) and np.isfinite(images).all()


def test_sd15_mid_block_fits_sd_gan_head(sd15_folder):
    """The mid block is 8x8 at the default resolution, as SD-1.5's is at 512 px (DMD2's head)."""
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(sd15_folder, subfolder="unet")
    captured = {}
    unet.mid_block.register_forward_hook(lambda m, i, o: captured.setdefault("mid", o))
    side = unet.config.sample_size
    with torch.no_grad():
        unet(torch.randn(2, 4, side, side), torch.tensor([999, 10]),
             encoder_hidden_states=torch.randn(2, 5, unet.config.cross_attention_dim))
    assert captured["mid"].shape == (2, 64, 8, 8)


def test_flux_kontext_folder_loads_and_generates(flux_folder):
    from diffusers import FluxKontextPipeline

    pipe = FluxKontextPipeline.from_pretrained(flux_folder)
    assert pipe.scheduler.config.use_dynamic_shifting
    assert pipe.vae.config.shift_factor == 0.1159 and pipe.vae.config.scaling_factor == 0.3611
    assert pipe.transformer.config.in_channels == 4 * pipe.vae.config.latent_channels
    assert pipe.transformer.config.guidance_embeds
    context = Image.new("RGB", (64, 64), (40, 70, 220))
    # max_area: the pipeline rescales height/width to max_area (default 1024**2);
    # _auto_resize=False: otherwise the context is resized to a preferred Kontext resolution.
    images = pipe(image=context, prompt="make the square red", height=64, width=64,
                  max_area=64 * 64, _auto_resize=False, num_inference_steps=2,
                  max_sequence_length=32, output_type="np",
                  generator=torch.Generator().manual_seed(0)).images
    assert images.shape == (1, 64, 64, 3) and np.isfinite(images).all()


def test_qwen_image_edit_folder_loads_and_generates(qwen_pipe, monkeypatch):
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as edit_plus

    pipe = qwen_pipe
    assert pipe.transformer.config.in_channels == 4 * pipe.vae.config.z_dim == 64
    assert pipe.transformer.config.joint_attention_dim == pipe.text_encoder.config.text_config.hidden_size
    assert pipe.vae_scale_factor == 8 and len(pipe.vae.config.latents_mean) == pipe.vae.config.z_dim
    cfg = pipe.scheduler.config
    assert cfg.use_dynamic_shifting and cfg.shift_terminal == 0.02 and cfg.time_shift_type == "exponential"
    # Every reference is resized to a 1024^2 area for the VAE and 384^2 for the VL encoder: over 10 s
    # a call on 2 CPU cores. Smaller areas keep this test fast; the code path is the same.
    monkeypatch.setattr(edit_plus, "VAE_IMAGE_SIZE", 96 * 96)
    monkeypatch.setattr(edit_plus, "CONDITION_IMAGE_SIZE", 96 * 96)
    calls = []
    pipe.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append({k: kwargs[k] for k in (
            "hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "img_shapes")}),
        with_kwargs=True)
    refs = [Image.new("RGB", (32, 48), (220, 40, 40)), Image.new("RGB", (40, 40), (40, 70, 220))]
    prompt = "make the circle the colour of picture 2"

    def run(output_type, **kwargs):
        calls.clear()
        return pipe(image=refs, prompt=prompt, height=32, width=32, num_inference_steps=2,
                    output_type=output_type, generator=torch.Generator().manual_seed(0), **kwargs).images

    latents = run("latent", true_cfg_scale=1.0)
    assert latents.shape == (1, 4, 64)  # 32 px / 8 / 2: 2x2 tokens of 16 channels x 2x2
    # VAE sizes: 32x48 -> 64x128 px (8x4 tokens), 40x40 -> 96x96 px (6x6); target tokens first
    assert len(calls) == 2 and calls[0]["img_shapes"] == [[(1, 2, 2), (1, 8, 4), (1, 6, 6)]]
    assert calls[0]["hidden_states"].shape == (1, 4 + 32 + 36, 64)
    # VL sizes: 64x128 -> 56x140 px (4x10 patches of 28: 10 image tokens), 96x96 -> 84x84 (9)
    pads = ["<|vision_start|>" + "<|image_pad|>" * n + "<|vision_end|>" for n in (10, 9)]
    text = pipe.prompt_template_encode.format(f"Picture 1: {pads[0]}Picture 2: {pads[1]}{prompt}")
    length = len(pipe.tokenizer(text).input_ids) - pipe.prompt_template_encode_start_idx
    assert calls[0]["encoder_hidden_states"].shape == (1, length, 32)
    assert calls[0]["encoder_hidden_states_mask"] is None  # one prompt: no padding, no mask
    image = run("pil", true_cfg_scale=1.0)[0]
    assert image.size == (32, 32) and image.mode == "RGB"
    images = run("np", true_cfg_scale=4.0, negative_prompt="a photo")
    assert len(calls) == 4 and images.shape == (1, 32, 32, 3) and np.isfinite(images).all()
    assert calls[1]["encoder_hidden_states"].shape[1] < length  # the negative prompt, shorter


def test_weights_are_deterministic_from_seed(flux_folder, tmp_path):
    from safetensors.torch import load_file

    tiny_models.make_tiny_flux_kontext(tmp_path / "same", seed=0)
    tiny_models.make_tiny_flux_kontext(tmp_path / "other", seed=1)
    name = "transformer/diffusion_pytorch_model.safetensors"
    ref, same, other = (load_file(p / name) for p in (flux_folder, tmp_path / "same",
                                                      tmp_path / "other"))
    assert all(torch.equal(ref[k], same[k]) for k in ref)
    assert not all(torch.equal(ref[k], other[k]) for k in ref)


# ----------------------------------------------------------------------------------------------
# datasets

def _rows(jsonl):
    return [json.loads(line) for line in Path(jsonl).read_text().splitlines()]


def test_prompts_file(tmp_path):
    lines = tiny_models.make_prompts_file(tmp_path / "prompts.txt", 7).read_text().splitlines()
    assert len(lines) == 7
    assert all(line.split()[0] in ("a", "an") and line.endswith(" background") for line in lines)


def test_image_prompt_dataset(tmp_path):
    rows = _rows(tiny_models.make_image_prompt_dataset(tmp_path, 5, size=32))
    assert len(rows) == 5 and all(set(r) == {"prompt", "image"} for r in rows)
    for row in rows:
        with Image.open(tmp_path / row["image"]) as image:
            assert image.size == (32, 32) and image.mode == "RGB"


def test_edit_dataset(tmp_path):
    rows = _rows(tiny_models.make_edit_dataset(tmp_path, 6, size=64))
    assert len(rows) == 6 and all(set(r) == {"image", "target", "prompt"} for r in rows)
    for row in rows:
        context = np.asarray(Image.open(tmp_path / row["image"]))
        target = np.asarray(Image.open(tmp_path / row["target"]))
        assert context.shape == target.shape == (64, 64, 3)
        changed = (context != target).any(-1)
        assert 0 < changed.mean() < 0.5  # only the shape was recoloured; background kept
        assert row["prompt"].startswith("make the ")


def test_two_reference_edit_dataset(tmp_path):
    rows = _rows(tiny_models.make_two_reference_edit_dataset(tmp_path, 5, size=64))
    assert len(rows) == 5 and all(set(r) == {"control", "target", "prompt"} for r in rows)
    for row in rows:
        context, swatch = (np.asarray(Image.open(tmp_path / path)) for path in row["control"])
        target = np.asarray(Image.open(tmp_path / row["target"]))
        assert context.shape == target.shape == (64, 64, 3) and swatch.shape == (32, 32, 3)
        changed = (context != target).any(-1)
        assert 0 < changed.mean() < 0.5  # only the shape was recoloured, background kept
        assert (target[changed] == swatch[0, 0]).all()  # in the swatch's colour
        assert row["prompt"].startswith("make the ") and row["prompt"].endswith(" the colour of picture 2")


# ----------------------------------------------------------------------------------------------
# cached defaults

def test_ensure_default_builds_once_and_reuses(tmp_path, monkeypatch):
    model, data = tiny_models.ensure_default("flux_kontext", tmp_path)
    assert Path(model, "model_index.json").is_file() and Path(data, "data.jsonl").is_file()
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []
    marker = Path(model).parent / tiny_models.READY
    mtime = marker.stat().st_mtime_ns

    def must_not_build(root):
        raise AssertionError("rebuilt an existing default")

    monkeypatch.setitem(tiny_models.BUILDERS, "flux_kontext", must_not_build)
    assert tiny_models.ensure_default("flux_kontext", tmp_path) == (model, data)
    assert marker.stat().st_mtime_ns == mtime


def _module_file(name: str) -> str:
    import importlib
    return os.path.realpath(importlib.import_module(name).__file__)


def test_the_builders_are_the_families_and_key_the_test_cache(tmp_path, monkeypatch):
    """BUILDERS is what the family specs name (families/<name>/spec.py's `tiny`, the same kinds), and the test
    run's cache key (tests/conftest._tiny_cache) reads every file a builder comes from: its module, the spec
    naming it, each families/ module those import, the cache's own tools; a changed builder never reuses a
    stale folder."""
    import ast
    import builtins
    import inspect

    import families
    from tests import conftest
    assert list(tiny_models.BUILDERS) == ["sd15", "sdxl", "flux_kontext", "qwen_image_edit", "flux2_klein",
                                          "flux2_dev", "wan_t2v", "wan_ti2v", "wan_a14b", "wan_i2v", "wan_i2v_a14b",
                                          "wan_ti2v_i2v", "z_image", "z_image_omni"]
    assert tiny_models.BUILDERS == {kind: b for spec in families.SPECS for kind, b in spec.tiny.items()}
    sources = {os.path.realpath(inspect.getsourcefile(b)) for b in tiny_models.BUILDERS.values()}
    sources |= {_module_file(f"families.{spec.name}.spec") for spec in families.SPECS}
    for path in list(sources):
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.ImportFrom) and node.module.startswith("families.tiny"):
                sources.add(_module_file(node.module))
    sources |= {_module_file("tools.tiny_models"), _module_file("tools.build_once")}
    read, real_open = [], builtins.open

    def reading(path, *args, **kwargs):
        read.append(os.path.realpath(path))
        return real_open(path, *args, **kwargs)
    monkeypatch.setenv("FSDP_DIFFUSION_CACHE", str(tmp_path))
    monkeypatch.setattr(builtins, "open", reading)
    key = conftest._tiny_cache()
    monkeypatch.undo()
    assert os.path.dirname(key) == str(tmp_path)
    assert sorted(sources - set(read)) == []


@pytest.mark.slow
def test_ensure_default_concurrent_callers_build_once(tmp_path, monkeypatch):
    """Four callers at once (as ranks would) get the same folder, built exactly once."""
    calls = []

    def slow_builder(root):
        calls.append(root)
        (root / "model").mkdir(parents=True)
        threading.Event().wait(0.3)
        (root / "data").mkdir()

    monkeypatch.setitem(tiny_models.BUILDERS, "sd15", slow_builder)
    results = []
    threads = [threading.Thread(target=lambda: results.append(
        tiny_models.ensure_default("sd15", tmp_path))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(results) == 4 and len(set(results)) == 1
    assert results[0][0].endswith(f"tiny_sd15_v{tiny_models.DEFAULTS_VERSION}/model")


def test_ensure_default_qwen_image_edit(tmp_path):
    model, data = tiny_models.ensure_default("qwen_image_edit", tmp_path)
    index = json.loads(Path(model, "model_index.json").read_text())
    assert index["_class_name"] == "QwenImageEditPlusPipeline"
    assert index["processor"] == ["transformers", "Qwen2VLProcessor"]
    assert {"preprocessor_config.json", "tokenizer.json"} <= {p.name for p in Path(model, "processor").iterdir()}
    rows = _rows(Path(data, "data.jsonl"))
    assert len(rows) == 32 and all(Path(data, path).is_file() for row in rows for path in row["control"])


def test_ensure_default_cache_dir_env(tmp_path, monkeypatch):
    monkeypatch.setenv("FSDP_DIFFUSION_CACHE", str(tmp_path / "cache"))
    assert tiny_models.default_cache_dir() == tmp_path / "cache"
    with pytest.raises(ValueError, match="unknown tiny default"):
        tiny_models.ensure_default("sd3")
