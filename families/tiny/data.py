"""The tiny test folders' synthetic datasets, drawn from the coloured-shapes world (families/tiny/scenes.py):
prompts, prompt + image rows, one-reference edits (FLUX.1 Kontext), two-reference edits (Qwen-Image-Edit,
FLUX.2).

    python -m pytest tests/test_tiny_models.py -q
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image

from families.tiny.models import IMAGE_SIZE
from families.tiny.scenes import COLOURS, describe, draw_shape, random_scene


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def make_prompts_file(path, n, seed=0):
    """Write `n` prompts like "a red circle on a blue background", one per line. Returns path."""
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n):
        shape, colour, background, _ = random_scene(rng, IMAGE_SIZE)
        lines.append(describe(shape, colour, background))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n".join(lines) + "\n")
    return Path(path)


def make_prompt_data(folder, n, seed=0):
    """folder/prompts.txt (make_prompts_file) and folder/data.jsonl of the same prompts as {"prompt"} rows: a
    text-to-image or text-to-video teacher's data, in both forms DATA_PATH reads."""
    path = make_prompts_file(Path(folder) / "prompts.txt", n, seed)
    write_jsonl(Path(folder) / "data.jsonl", [{"prompt": p} for p in path.read_text().splitlines()])


def make_image_prompt_dataset(folder, n, size=IMAGE_SIZE, seed=0):
    """Write `n` PNGs of coloured shapes under folder/images and folder/data.jsonl with rows
    {"prompt", "image"} (image path relative to folder). Returns the data.jsonl path."""
    folder = Path(folder)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        shape, colour, background, box = random_scene(rng, size)
        image = draw_shape(size, shape, COLOURS[colour], COLOURS[background], box)
        image.save(folder / "images" / f"{i:05d}.png")
        rows.append({"prompt": describe(shape, colour, background),
                     "image": f"images/{i:05d}.png"})
    write_jsonl(folder / "data.jsonl", rows)
    return folder / "data.jsonl"


def make_edit_dataset(folder, n, size=IMAGE_SIZE, seed=0):
    """Write `n` image-editing pairs: folder/context/i.png (a shape on a plain background),
    folder/target/i.png (the same shape and place, recoloured), and folder/data.jsonl with rows
    {"image": context path, "target": target path, "prompt": "make the circle blue"} (paths
    relative to folder). Returns the data.jsonl path."""
    folder = Path(folder)
    for sub in ("context", "target"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        shape, colour, background, box = random_scene(rng, size)
        new_colour = str(rng.choice([c for c in COLOURS if c not in (colour, background)]))
        draw_shape(size, shape, COLOURS[colour], COLOURS[background], box).save(
            folder / "context" / f"{i:05d}.png")
        draw_shape(size, shape, COLOURS[new_colour], COLOURS[background], box).save(
            folder / "target" / f"{i:05d}.png")
        rows.append({"image": f"context/{i:05d}.png", "target": f"target/{i:05d}.png",
                     "prompt": f"make the {shape} {new_colour}"})
    write_jsonl(folder / "data.jsonl", rows)
    return folder / "data.jsonl"


def make_two_reference_edit_dataset(folder, n, size=IMAGE_SIZE, seed=0, swatch=0):
    """Write `n` edits with two reference images (Qwen-Image-Edit-2509's multi-image input):
    folder/control/i.png (a shape on a plain background, size px), folder/swatch/i.png (a plain
    `swatch` px (0: size/2) square of a new colour), folder/target/i.png (the first with the shape in the swatch's
    colour), and folder/data.jsonl with rows {"control": [control path, swatch path], "target":
    target path, "prompt": "make the circle the colour of picture 2"} (paths relative to folder).
    Returns the data.jsonl path."""
    folder = Path(folder)
    for sub in ("control", "swatch", "target"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        shape, colour, background, box = random_scene(rng, size)
        new_colour = str(rng.choice([c for c in COLOURS if c not in (colour, background)]))
        draw_shape(size, shape, COLOURS[colour], COLOURS[background], box).save(folder / "control" / f"{i:05d}.png")
        side = swatch or size // 2
        Image.new("RGB", (side, side), COLOURS[new_colour]).save(folder / "swatch" / f"{i:05d}.png")
        draw_shape(size, shape, COLOURS[new_colour], COLOURS[background], box).save(
            folder / "target" / f"{i:05d}.png")
        rows.append({"control": [f"control/{i:05d}.png", f"swatch/{i:05d}.png"], "target": f"target/{i:05d}.png",
                     "prompt": f"make the {shape} the colour of picture 2"})
    write_jsonl(folder / "data.jsonl", rows)
    return folder / "data.jsonl"
