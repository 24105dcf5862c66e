"""The metric code of demos/shapes_eval.py on known inputs (no model, no training; a few seconds).

    python -m pytest tests/test_shapes_eval.py -q
"""
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from demos import shapes_eval as se

ROOT = Path(__file__).resolve().parents[1]

SEEDS = 4  # real images per prompt in the sets below


@pytest.fixture(scope="module")
def reference():
    return se.Reference(se.all_prompts(), per_prompt=8, seed=1)


@pytest.fixture(scope="module")
def real():
    return se.real_set(se.all_prompts(), SEEDS, seed=2)


def test_prompts_round_trip():
    prompts = se.all_prompts()
    assert len(prompts) == len(set(prompts)) == 36
    assert prompts[0] == "a red circle on a white background"
    for p, c in zip(prompts, se.combos()):
        assert se.parse_prompt(p) == c
    with pytest.raises(ValueError):
        se.parse_prompt("a photo of a cat")


@pytest.mark.parametrize("shape", se.SHAPES)
def test_shape_classifier_on_every_size(shape):
    """Every side the dataset draws (12..20 px), at a corner and in the middle, on every background."""
    for side in range(se.MIN_SIDE, se.MAX_SIDE + 1):
        for x0, y0 in ((0, 0), (32 - side, 32 - side), ((32 - side) // 2, 5)):
            for colour, bg in (("red", "white"), ("blue", "black"), ("yellow", "cyan")):
                a = se.analyse_image(se.render(shape, colour, bg, (x0, y0, x0 + side - 1, y0 + side - 1)))
                assert (a["shape"], a["colour"], a["background"]) == (shape, colour, bg), (side, x0, y0, a)


def test_perfect_images_score_perfectly(real, reference):
    images, prompts = real
    m = se.score_images(images, prompts, reference)
    for key in ("colour_acc", "shape_acc", "background_acc", "all_acc"):
        assert m[key] == 100.0, (key, m)
    # another draw of real data: small distance, diversity like the reference's
    assert m["fd"] < 2.0, m
    assert 0.8 < m["diversity"] / m["real_diversity"] < 1.25, m


def test_frechet_distance_of_a_set_with_itself_is_zero(reference):
    assert se.frechet_distance(reference.feats, reference.feats) == pytest.approx(0.0, abs=1e-6)
    shifted = reference.feats + 1.0  # mean shift by 1 in each of D dims -> D
    assert se.frechet_distance(shifted, reference.feats) == pytest.approx(reference.feats.shape[1], rel=1e-6)


def test_blur_keeps_adherence(real, reference):
    """A mild blur (what a VAE decoder does to edges) still reads as the right prompt."""
    images, prompts = real
    x = torch.from_numpy(images).permute(0, 3, 1, 2).double()
    blurred = torch.nn.functional.avg_pool2d(torch.nn.functional.pad(x, (1,) * 4, mode="replicate"), 3, 1)
    blurred = blurred.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
    m = se.score_images(blurred, prompts, reference)
    assert m["all_acc"] >= 95.0, m


def test_noise_scores_badly(real, reference):
    images, prompts = real
    noise = np.random.default_rng(0).integers(0, 256, images.shape, dtype=np.uint8)
    m = se.score_images(noise, prompts, reference)
    assert m["all_acc"] == 0.0 and m["background_acc"] < 20 and m["colour_acc"] < 30, m
    assert m["fd"] > 50, m
    blank = np.full_like(images, 128)  # no foreground at all: "none" is always wrong
    m = se.score_images(blank, prompts, reference)
    assert m["colour_acc"] == m["shape_acc"] == 0.0, m


def test_wrong_prompts_score_badly(real, reference):
    """Real images of the wrong prompts: adherence fails although the distribution is right."""
    images, prompts = real
    # recolour each prompt's shape with the next foreground colour, keep shape and background
    wrong = []
    for p in prompts:
        shape, colour, bg = se.parse_prompt(p)
        wrong.append(se.prompt_for(shape, se.FG_COLOURS[(se.FG_COLOURS.index(colour) + 1) % 4], bg))
    m = se.score_images(images, wrong, reference)
    assert m["colour_acc"] == 0.0 and m["shape_acc"] == 100.0 and m["background_acc"] == 100.0, m
    # wrong shape
    wrong = [se.prompt_for(se.SHAPES[(se.SHAPES.index(s) + 1) % 3], c, b)
             for s, c, b in map(se.parse_prompt, prompts)]
    m = se.score_images(images, wrong, reference)
    assert m["shape_acc"] == 0.0 and m["colour_acc"] == 100.0, m


def test_recoloured_distribution_has_large_distance(reference):
    """Every shape painted one colour (on the right backgrounds): far from the real distribution."""
    rng = np.random.default_rng(3)
    images, prompts = [], []
    for p in se.all_prompts():
        shape, colour, bg = se.parse_prompt(p)
        for _ in range(SEEDS):
            images.append(se.render(shape, "red" if bg != "red" else "blue", bg, se.random_box(rng)))
            prompts.append(p)
    m = se.score_images(np.stack(images), prompts, reference)
    assert m["colour_acc"] == 25.0, m
    assert m["fd"] > 10, m


def test_diversity(real, reference):
    images, prompts = real
    collapsed = np.repeat(images[::SEEDS], SEEDS, axis=0)  # one image per prompt, repeated
    m = se.score_images(collapsed, prompts, reference)
    assert m["diversity"] == 0.0 and m["all_acc"] == 100.0, m
    assert m["fd"] > se.score_images(images, prompts, reference)["fd"], m


def test_generate_with_a_tiny_random_model():
    """The sampling path (DDIM + CFG, 1-step, few-step) on random tiny components: shapes only."""
    from diffusers import AutoencoderKL, DDIMScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from tools.tiny_models import write_clip_tokenizer

    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        tok = write_clip_tokenizer(Path(tmp) / "tok")
    torch.manual_seed(0)
    te = CLIPTextModel(CLIPTextConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      max_position_embeddings=tok.model_max_length)).eval()
    unet = UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, block_out_channels=(8, 16),
                                down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), layers_per_block=1,
                                norm_num_groups=4, cross_attention_dim=16, attention_head_dim=2).eval()
    vae = AutoencoderKL(block_out_channels=(4, 8, 8), down_block_types=("DownEncoderBlock2D",) * 3,
                        up_block_types=("UpDecoderBlock2D",) * 3, norm_num_groups=4, latent_channels=4,
                        sample_size=32).eval()
    sched = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                          clip_sample=False, set_alpha_to_one=False, steps_offset=1)
    prompts = se.all_prompts()[:2]
    for sampler, steps, cfg in (("ddim", 3, 4.0), ("onestep", 1, 1.0), ("fewstep", 2, 1.0)):
        images, image_prompts, sec = se.generate(unet, vae, te, tok, sched, prompts, 2, sampler, steps, cfg)
        assert images.shape == (4, 32, 32, 3) and images.dtype == np.uint8
        assert image_prompts == [prompts[0]] * 2 + [prompts[1]] * 2 and sec > 0
    # same noise -> same images (the comparison relies on it)
    again, _, _ = se.generate(unet, vae, te, tok, sched, prompts, 2, "onestep", 1, 1.0)
    first, _, _ = se.generate(unet, vae, te, tok, sched, prompts, 2, "onestep", 1, 1.0)
    assert np.array_equal(again, first)


@pytest.mark.slow  # ~3 s of sampling: the fast loop keeps within its 90 s
def test_shipped_teacher_follows_prompts_and_one_step_does_not():
    """The shipped DMD2 teacher (assets/shapes_teacher): a short multi-step run with CFG follows the
    prompts; its 1-step prediction from pure noise does not (the gap DMD2 closes)."""
    folder = os.path.join(ROOT, "assets", "shapes_teacher")
    reference = se.Reference(se.all_prompts())
    multi, _, _ = se.evaluate_folder(folder, "ddim", steps=10, cfg=2.0, seeds=2, reference=reference)
    one, _, _ = se.evaluate_folder(folder, "onestep", seeds=2, reference=reference)
    assert multi["colour_acc"] >= 95 and multi["all_acc"] >= 70, multi
    assert one["all_acc"] <= 50 and one["fd"] > 2 * multi["fd"], one


def test_shapes_world():
    """tools/shapes.py, which shapes_eval, kontext_eval and tools/tiny_models all draw from."""
    from tools import shapes

    for name, rgb in shapes.COLOURS.items():
        assert shapes.nearest_colour(rgb) == name == se.nearest_colour(rgb)
    assert shapes.describe("circle", "orange", "white") == "an orange circle on a white background"
    rng = np.random.default_rng(0)
    for _ in range(50):
        shape, colour, background, (x0, y0, x1, y1) = shapes.random_scene(rng, 32)
        assert shape in shapes.SHAPES and colour != background and {colour, background} <= set(shapes.COLOURS)
        assert 0 <= x0 < x1 < 32 and 0 <= y0 < y1 < 32 and x1 - x0 == y1 - y0 and 11 <= x1 - x0 <= 19
    image = np.asarray(shapes.draw_shape(32, "square", (1, 2, 3), (4, 5, 6), (2, 3, 5, 9)))
    assert (image[3:10, 2:6] == (1, 2, 3)).all() and (image == (1, 2, 3)).all(-1).sum() == 7 * 4
    table = shapes.md_table(["a", "b"], [["1", "2"]], align=["---", "---:"])
    assert table == "| a | b |\n|---|---:|\n| 1 | 2 |"


def test_compare_takes_named_one_and_four_step_generators():
    runs = se.generator_runs({"stage1": "out/a/export", "four_step": "out/b/export@4"})
    assert runs == [("stage1, 1 step (t=999, no CFG)", "out/a/export", "onestep", 1),
                    ("four_step, 4 steps (999/749/499/249, no CFG)", "out/b/export", "fewstep", 4)]


@pytest.mark.slow  # a Python process that imports diffusers
def test_the_evaluators_first_screen_has_no_import_noise():
    """The demos' evaluation step (the Quickstart's last output) silences what importing diffusers
    prints when torchao is installed, as the training scripts do."""
    import subprocess
    import sys
    pytest.importorskip("torchao")
    code = "import demos.shapes_eval as se; se.quiet(); from diffusers import StableDiffusionPipeline"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "Failed to load" not in r.stderr and "_pytree" not in r.stderr, r.stderr[-2000:]
