"""Tests of demos/palette_eval.py: the "paint it" task data and the validity / variety scores on
known images (no model).

    python -m pytest tests/test_palette_eval.py -q
"""
import math
from pathlib import Path

import numpy as np
import pytest

from demos import kontext_eval as ke
from demos import palette_eval as pe
from tests.conftest import ROOT
from tools.shapes import COLOURS


def scene_images(d, colour=None, background=None):
    """(context, an edit painted `colour`, optionally on another background) as HxWx3 arrays."""
    scene = (d["shape"], d["colour"], d["background"], tuple(d["box"]))
    context = np.asarray(ke.draw(scene))
    edit = ke.shapes.draw_shape(ke.IMAGE_SIZE, d["shape"], COLOURS[colour or d["target_colour"]],
                                COLOURS[background or d["background"]], tuple(d["box"]))
    return context, np.asarray(edit)


def test_splits_deterministic_disjoint_and_outside_the_palette():
    train, heldout = pe.task_scenes("train"), pe.task_scenes("heldout")
    assert train == pe.task_scenes("train") and len(train) == pe.SPLITS["train"][0]
    key = lambda d: (d["shape"], d["colour"], d["background"], tuple(d["box"]))  # noqa: E731
    assert not {key(d) for d in train} & {key(d) for d in heldout}
    for d in train + heldout:
        assert d["prompt"] == pe.PROMPT and d["target_colour"] in pe.PALETTE
        assert d["colour"] not in pe.PALETTE and d["background"] not in pe.PALETTE
    assert {d["target_colour"] for d in train} == set(pe.PALETTE)  # every valid edit is taught


def test_every_palette_edit_is_valid_and_the_context_is_not():
    for d in pe.task_scenes("heldout")[:8]:
        for colour in pe.PALETTE:
            context, edit = scene_images(d, colour)
            s = pe.score_paint(edit, context, d["background"])
            assert s["valid"] and s["colour"] == colour and s["iou"] == 1.0, (d, colour, s)
        context, _ = scene_images(d)
        assert not pe.score_paint(context, context, d["background"])["valid"]  # unedited: no palette colour


def test_mixes_two_colour_shapes_and_lost_backgrounds_are_invalid():
    d = pe.task_scenes("heldout")[0]
    context, red = scene_images(d, "red")
    _, green = scene_images(d, "green")
    mix = ((red.astype(np.float64) + green) / 2).round().astype(np.uint8)  # the few-step average
    s = pe.score_paint(mix, context, d["background"])
    assert not s["saturated"] and not s["valid"]
    mask = ke.foreground_mask(red, d["background"])
    half = red.copy()
    rows = np.nonzero(mask.any(axis=1))[0]
    lower = np.zeros_like(mask)
    lower[rows[len(rows) // 2]:] = True
    half[mask & lower] = COLOURS["blue"]  # half red, half blue: no single colour dominates enough
    assert not pe.score_paint(half, context, d["background"])["valid"]
    other = next(c for c in pe.NON_PALETTE if c not in (d["background"], d["colour"]))
    _, moved_bg = scene_images(d, "red", background=other)
    s = pe.score_paint(moved_bg, context, d["background"])
    assert not s["bg_ok"] and not s["valid"]


def test_entropy_and_summary():
    assert pe.entropy_bits([]) == 0.0 and pe.entropy_bits(["red"] * 5) == 0.0
    assert math.isclose(pe.entropy_bits(list(pe.PALETTE) * 2), 2.0)
    assert math.isclose(pe.entropy_bits(["red", "red", "blue", "blue"]), 1.0)
    valid = {"palette": True, "saturated": True, "one_colour": True, "bg_ok": True, "iou": 1.0, "valid": True}
    invalid = {**valid, "colour": "purple", "palette": False, "saturated": False, "one_colour": False,
               "valid": False}
    scores = [[{**valid, "colour": "red"}, {**valid, "colour": "blue"}],  # 1 bit
              [{**valid, "colour": "red"}, invalid]]  # the invalid output counts for nothing: 0 bits
    m = pe.summarize(scores)
    assert m["n"] == 4 and m["valid"] == 75.0 and m["entropy"] == 0.5
    assert m["colour_share"] == {"red": 50.0, "green": 0.0, "blue": 25.0, "yellow": 0.0}
    assert m["valid_colours"] == [["red", "blue"], ["red"]]


def test_rarefied_entropy_is_exact():
    assert pe.rarefied_entropy(["red", "blue"], 1) == 0.0 and pe.rarefied_entropy([], 0) == 0.0
    assert math.isclose(pe.rarefied_entropy(["red", "blue", "red"], 3), pe.entropy_bits(["red", "blue", "red"]))
    # 2 of (red, red, blue, blue): 4 of the 6 pairs differ (1 bit), 2 match (0 bits)
    assert math.isclose(pe.rarefied_entropy(["red", "red", "blue", "blue"], 2), 4 / 6)
    assert pe.rarefied_entropy(["red"] * 5, 3) == 0.0
    # 3 of (r r r b g): C(5,3) = 10 subsets; r r r (1): 0 bits; r r b, r r g (3 each): H(1/3); r b g (3): log2 3
    h = -(1 / 3) * math.log2(1 / 3) - (2 / 3) * math.log2(2 / 3)
    assert math.isclose(pe.rarefied_entropy(["red"] * 3 + ["blue", "green"], 3), (6 * h + 3 * math.log2(3)) / 10)
    with pytest.raises(ValueError, match="cannot draw 3 of 2"):
        pe.rarefied_entropy(["red", "blue"], 3)
    # against the mean over many random subsets (standard error < 0.004 bits)
    rng = np.random.default_rng(0)
    pool = list(pe.PALETTE) * 3 + ["red"] * 4
    mc = np.mean([pe.entropy_bits(list(rng.permutation(pool)[:5])) for _ in range(20_000)])
    assert abs(pe.rarefied_entropy(pool, 5) - mc) < 0.02


def test_variety_at_counts_separates_variety_from_validity():
    rng = np.random.default_rng(1)
    p = [np.full(4, 0.25), np.array([0.5, 0.0, 0.5, 0.0]), np.array([0.7, 0.1, 0.1, 0.1])]
    reference = [list(rng.choice(pe.PALETTE, size=12, p=q)) for q in p]
    assert pe.variety_at_counts(reference, reference) == 100.0
    # a model that samples the reference's distributions but is valid a quarter as often, over many draws of
    # both: the plain ratio falls, this one stays at 100 % (a random subset of i.i.d. draws is i.i.d.)
    refs = [list(rng.choice(pe.PALETTE, size=12, p=q)) for _ in range(1000) for q in p]
    fewer = [list(rng.choice(pe.PALETTE, size=3, p=q)) for _ in range(1000) for q in p]
    plain = sum(map(pe.entropy_bits, fewer)) / sum(map(pe.entropy_bits, refs))
    at_counts = pe.variety_at_counts(fewer, refs)
    assert plain < 0.75 and abs(at_counts - 100.0) < 3.0, (plain, at_counts)
    # one colour per context has no variety at any count
    assert pe.variety_at_counts([["red"] * 3, ["blue"] * 12, ["red"]], reference) == 0.0
    # a context without a valid reference output counts for nothing on either side
    assert pe.variety_at_counts([["red", "blue"], []], [[], ["red", "blue"]]) != pe.variety_at_counts([[]], [[]])


def test_the_64_px_task_for_flux2(tmp_path):
    """FLUX.2's splits (--size=64; its pipeline refuses smaller references): the same draw on the bigger canvas,
    written at 64 px, no CFG split; with the shipped base, one context through Flux2KleinPipeline."""
    paths = pe.ensure_task_data(tmp_path / "task", size=64)
    assert pe.CFG_SPLIT not in paths
    rows = ke.load_rows(paths["heldout"])
    assert len(rows) == pe.SPLITS["heldout"][0] and ke.load_rgb(rows[0]["image"]).shape == (64, 64, 3)
    assert max(max(d["box"]) for d in pe.task_scenes("heldout", 64)) > ke.IMAGE_SIZE  # drawn on the 64 px canvas
    summary, outputs = pe.evaluate(str(Path(ROOT) / "assets" / "flux2_edit_base"), rows[:1], steps=2, guidance=1.0,
                                   seeds=1)
    assert outputs[0][0].shape == (64, 64, 3) and summary["n"] == 1


@pytest.mark.slow  # writes every split at 64 px, on 8 training contexts
def test_the_cfg_split_at_64_px(tmp_path, monkeypatch):
    """demo_dmd_cfg.sh's FLUX.2 and Z-Image teachers: the CFG split on request at 64 px, the 32 px split's rows
    (each training context once per palette colour, "make it white" as often where it is not white already) drawn
    on the bigger canvas."""
    monkeypatch.setattr(pe, "SPLITS", {"train": (8, 11), "heldout": (2, 12)})
    assert pe.CFG_SPLIT not in pe.ensure_task_data(tmp_path / "a", size=64)
    rows = ke.load_rows(pe.ensure_task_data(tmp_path / "b", size=64, cfg=True)[pe.CFG_SPLIT])
    train = pe.task_scenes("train", 64)
    plain = [d for d in train if pe.CFG_COLOUR not in (d["colour"], d["background"])]
    assert len(rows) == len(pe.PALETTE) * (len(train) + len(plain))
    assert sum(r["prompt"] == pe.CFG_PROMPT for r in rows) == len(pe.PALETTE) * len(plain)
    assert {ke.load_rgb(r["image"]).shape for r in rows} == {(64, 64, 3)}


def test_each_shipped_edit_base_is_evaluated_through_its_pipeline():
    """The evaluation picks the pipeline a folder's model_index.json names: Kontext's own path (None), or the
    Qwen-Image-Edit, FLUX.2 [klein] and Z-Image Omni evaluation families."""
    from demos import flux2_edit_eval as fe
    from demos import qwen_edit_eval as qe
    from demos import z_image_edit_eval as ze
    bases = {"kontext_base": None, "qwen_edit_base": qe.QWEN, "flux2_edit_base": fe.FLUX2,
             "z_image_edit_base": ze.Z_IMAGE}
    for name, family in bases.items():
        assert pe.edit_family(str(Path(ROOT) / "assets" / name)) is family, name


def test_scored_rows_are_read_not_sampled_again(tmp_path, monkeypatch, capsys):
    """--scored: a row of an earlier --json with the same folder, steps and settings is read from it (a second
    training seed's students beside the same teacher); a row at other steps is sampled; other seeds refuse."""
    task, base = str(tmp_path / "task"), str(Path(ROOT) / "assets" / "flux2_edit_base")
    common = ["--task_dir", task, "--size=64", "--n=1", "--seeds=1", "--steps=2"]
    assert pe.main(common + ["--compare", f"a={base}", "--json", str(tmp_path / "first.json")]) == 0
    first = capsys.readouterr().out
    sampled = []
    real = pe.evaluate
    monkeypatch.setattr(pe, "evaluate", lambda folder, rows, steps, *a, **k: sampled.append(steps) or
                        real(folder, rows, steps, *a, **k))
    assert pe.main(common + ["--scored", str(tmp_path / "first.json"), "--compare", f"a={base}", f"b={base}",
                             "--steps_for", "b=1"]) == 0
    assert sampled == [1]  # a read, b sampled
    row_a = [ln for ln in first.splitlines() if ln.startswith("| a ")]
    assert row_a and row_a[0] in capsys.readouterr().out
    with pytest.raises(SystemExit):
        pe.main(common[:-2] + ["--seeds=2", "--steps=2", "--scored", str(tmp_path / "first.json"),
                               "--compare", f"a={base}"])
    assert "scored with seeds 1, this run has 2" in capsys.readouterr().err
