"""Tests of tools/tiny_models.py: the embedded default model folders and datasets, all offline, CPU.

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


def test_ensure_default_cache_dir_env(tmp_path, monkeypatch):
    monkeypatch.setenv("FSDP_DIFFUSION_CACHE", str(tmp_path / "cache"))
    assert tiny_models.default_cache_dir() == tmp_path / "cache"
    with pytest.raises(ValueError, match="unknown tiny default"):
        tiny_models.ensure_default("sd3")
