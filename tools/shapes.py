"""The coloured-shapes world shared by the demos and by `tools/tiny_models.py`.

One filled shape of a named colour on a plain background of another, drawn with PIL (no
anti-aliasing) and captioned "a red circle on an orange background". Both demo tasks are subsets
of it: the DMD2 task of `demos/shapes_eval.py` (3 shapes, 4 colours on 3 backgrounds, 32 px) and
the Kontext "make it blue" edit of `demos/kontext_eval.py`; `tools/tiny_models.py` draws the
synthetic datasets of the tiny default models from it.

Here: the colour table and shape names, drawing and random scenes, captions, reading a colour
back (`nearest_colour`), and the small helpers the demo scripts share (image <-> tensor
conversion, markdown tables, PNG grids, log lines). Pure numpy / PIL; torch is imported only by
the tensor helpers.
"""
from __future__ import annotations

import time
from pathlib import Path

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


# ----------------------------------------------------------------------------------------------
# images <-> tensors (the demos' VAE training and decoding)

def to_tensor(images):
    """(N, H, W, 3) uint8 array -> (N, 3, H, W) float32 tensor in [-1, 1]."""
    import torch
    return torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1.0


def to_uint8(x) -> np.ndarray:
    """(N, 3, H, W) tensor in [-1, 1] (clamped) -> (N, H, W, 3) uint8 array, rounded."""
    import torch
    return ((x.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()


# ----------------------------------------------------------------------------------------------
# reports: markdown tables, PNG grids, log lines

def md_table(header, rows, align=None) -> str:
    """A markdown table: `header` cells, the rule (`align`: one of "---", "---:", ... per column;
    default "---" for all), then `rows` (lists of cell strings)."""
    rule = align or ["---"] * len(header)
    lines = ["| " + " | ".join(header) + " |", "|" + "".join(f"{a}|" for a in rule)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def tile_canvas(width, height, fill, tiles, scale=1, labels=()) -> Image.Image:
    """An RGB canvas of `fill` with `labels` ((x, y, text), black) drawn first, then `tiles`
    ((x, y, HxWx3 uint8 array)) pasted at (x, y), each enlarged `scale` times (nearest neighbour)."""
    canvas = Image.new("RGB", (width, height), fill)
    draw = ImageDraw.Draw(canvas)
    for x, y, text in labels:
        draw.text((x, y), text, fill=(0, 0, 0))
    for x, y, tile in tiles:
        tile = np.repeat(np.repeat(np.asarray(tile, dtype=np.uint8), scale, axis=0), scale, axis=1)
        canvas.paste(Image.fromarray(tile), (x, y))
    return canvas


def save_png(image: Image.Image, path):
    """Save `image` at `path` (parent folders created); returns `path` unchanged."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path


def log(msg: str, tag: str = "") -> None:
    """Print '[tag HH:MM:SS] msg' ('[HH:MM:SS] msg' without a tag), flushed."""
    stamp = time.strftime("%H:%M:%S")
    print(f"[{tag + ' ' if tag else ''}{stamp}] {msg}", flush=True)
