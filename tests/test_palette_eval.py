"""Tests of demos/palette_eval.py: the "paint it" task data and the validity / variety scores on
known images (no model).

    python -m pytest tests/test_palette_eval.py -q
"""
import math

import numpy as np

from demos import kontext_eval as ke
from demos import palette_eval as pe
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
