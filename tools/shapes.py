"""The coloured-shapes world shared by the demos and by the tiny test folders' datasets.

One filled shape of a named colour on a plain background of another, drawn with PIL (no
anti-aliasing) and captioned "a red circle on an orange background". Both demo tasks are subsets
of it: the DMD2 task of `demos/shapes_eval.py` (3 shapes, 4 colours on 3 backgrounds, 32 px) and
the Kontext "make it blue" edit of `demos/kontext_eval.py`; the tiny default models' synthetic
datasets (`families/tiny/data.py`) are drawn from it too.

Here: the world itself from `families/tiny/scenes.py` (the colour table and shape names, drawing and
random scenes, captions, reading a colour back: `nearest_colour`), and the small helpers the demo
scripts share (image <-> tensor conversion, markdown tables, PNG grids, log lines).
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from families.tiny.scenes import (COLOURS, SHAPES, describe, draw_shape, nearest_colour,  # noqa: F401 - the world
                                  random_box, random_scene)


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
