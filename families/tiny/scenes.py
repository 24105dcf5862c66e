"""The coloured-shapes world: one filled shape of a named colour on a plain background of another, drawn
with PIL (no anti-aliasing) and captioned "a red circle on an orange background". The tiny test folders'
synthetic datasets (families/tiny/data.py) and the demos' tasks (tools/shapes.py exposes it with their
helpers) draw from it; the tiny tokenizers learn its words whole. Pure numpy / PIL.

    python -m pytest tests/test_shapes_eval.py -q -k world
"""
from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw

# Named colours (RGB 0..255), in a fixed order: the order breaks ties in `nearest_colour` and is
# the population `random_scene` draws from.
COLOURS = {
    "red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220), "yellow": (240, 220, 40),
    "purple": (140, 50, 170), "orange": (250, 140, 30), "white": (245, 245, 245),
    "black": (15, 15, 15), "pink": (250, 150, 190), "cyan": (40, 210, 220),
}
SHAPES = ("circle", "square", "triangle", "diamond")

_NAMES = tuple(COLOURS)
_RGB = np.array([COLOURS[name] for name in _NAMES], dtype=np.float64)


# ----------------------------------------------------------------------------------------------
# scenes

def draw_shape(size, shape, colour, background, box) -> Image.Image:
    """A size x size RGB PIL image: `shape` filled with `colour` (RGB) inside `box` (x0, y0, x1,
    y1, inclusive) on `background` (RGB). The triangle's apex is up."""
    image = Image.new("RGB", (size, size), background)
    draw = ImageDraw.Draw(image)
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=colour)
    elif shape == "square":
        draw.rectangle(box, fill=colour)
    elif shape == "triangle":
        draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=colour)
    else:  # diamond
        cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
        draw.polygon([(cx, y0), (x1, cy), (cx, y1), (x0, cy)], fill=colour)
    return image


def random_box(rng: np.random.Generator, size: int) -> tuple[int, int, int, int]:
    """A square box of side size*3//8 .. size*5//8 px at a random position inside the image."""
    side = int(rng.integers(size * 3 // 8, size * 5 // 8 + 1))
    x0, y0 = (int(v) for v in rng.integers(0, size - side + 1, size=2))
    return x0, y0, x0 + side - 1, y0 + side - 1


def random_scene(rng: np.random.Generator, size: int):
    """(shape, colour name, background name, box): any of SHAPES, two different COLOURS."""
    shape = SHAPES[rng.integers(len(SHAPES))]
    colour, background = rng.choice(list(COLOURS), size=2, replace=False)
    return shape, str(colour), str(background), random_box(rng, size)


def describe(shape: str, colour: str, background: str) -> str:
    """'a red circle on an orange background'."""
    def article(word):
        return "an" if word[0] in "aeiou" else "a"
    return f"{article(colour)} {colour} {shape} on {article(background)} {background} background"


def nearest_colour(rgb) -> str:
    """Name of the COLOURS entry nearest (Euclidean RGB) to `rgb` (the first one on a tie)."""
    d = ((_RGB - np.asarray(rgb, dtype=np.float64)) ** 2).sum(axis=1)
    return _NAMES[int(np.argmin(d))]
