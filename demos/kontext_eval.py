"""The "make it blue" editing task and its evaluation through diffusers' FluxKontextPipeline.

Task: a shape (circle / square / triangle / diamond of tools/shapes.py, in any of its COLOURS
but blue) on a plain background (never blue); the edit recolours the shape blue and keeps its
shape, position, size and the background. Prompt: "make it blue". Splits are drawn
deterministically from a seed:

    train      512 pairs, seed 1  (what train_flux_kontext.py fine-tunes on)
    heldout     64 pairs, seed 2  (scenes not in train; the evaluation set)
    retention   64 pairs, seed 3  (other recolours the base model was pre-trained on, e.g.
                                   "make it red": does the fine-tune forget them?)

Each split is a folder with context/*.png, target/*.png and data.jsonl rows {"image", "target",
"prompt"} (paths relative to the file) plus the scene ("shape", "colour", "background",
"target_colour", "box"). They are generated on demand into a cache folder. The train split alone
is also shipped, byte for byte as generated, as assets/kontext_blue/ (train.jsonl + context/ +
target/): the default data of train_flux_kontext.py (`write_train_split`, --make_train;
tests/test_kontext_eval.py checks that it is still what this code writes).

Metrics, from pixels (the background colour is known, the shapes are flat colours):
  colour acc   the output's foreground (pixels far from the background colour) has, as its median
               colour, the named colour nearest to the target colour's RGB
  IoU          output foreground mask vs the target's foreground mask (shape, position, size kept)
  bg kept      the median colour outside the (dilated) target shape is nearest to the background
  success      all three: colour right, IoU >= 0.7, background kept
  PSNR         against the true target (dB)

    python -m demos.kontext_eval --model=assets/kontext_base
    python -m demos.kontext_eval --compare base=assets/kontext_base tuned=/tmp/kontext_ft/export
    # a LoRA fine-tune: the base pipeline + pipe.load_lora_weights(the LoRA export folder or file)
    python -m demos.kontext_eval --compare base=assets/kontext_base lora=assets/kontext_base \
        --lora lora=/tmp/kontext_lora/export
    # one model at several step counts, and a distilled student at its own steps and guidance
    python -m demos.kontext_eval --compare t28=T t4=T student=S --steps 28 --steps_for t4=4 student=4 \
        --guidance_for student=1.0
    python -m demos.kontext_eval --make_data=out/kontext_task    # write the splits, print the paths
    python -m demos.kontext_eval --make_train=assets/kontext_blue  # rewrite the shipped train split

The grid (--grid, default out/kontext_eval/grid.png) has one row per held-out pair: context | each
model's output | target.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

from tools import shapes
from tools.build_once import build_once
from tools.shapes import COLOURS, nearest_colour  # noqa: F401 - nearest_colour: part of this API
from tools import tiny_models

TASK_COLOUR = "blue"
TASK_PROMPT = f"make it {TASK_COLOUR}"
IMAGE_SIZE = 32  # pixels per side (the base model's VAE is 4x down: 8x8 latents, 16 tokens)
TASK_VERSION = 1  # part of the cache folder name; bump when a split's recipe changes
SPLITS = {"train": (512, 1), "heldout": (64, 2), "retention": (64, 3)}  # name: (pairs, seed)
SHIPPED_TRAIN = Path(__file__).resolve().parent.parent / "assets" / "kontext_blue" / "train.jsonl"

FG_THRESHOLD = 35.0  # RGB distance from the background above which a pixel is foreground
MIN_FG_PIXELS = 16  # fewer foreground pixels than this = no shape found (colour counts as wrong)
IOU_OK = 0.7  # IoU needed for a "success"

# ----------------------------------------------------------------------------------------------
# the task data


def random_scene(rng, size=IMAGE_SIZE, exclude=()):
    """(shape, colour, background, box) as shapes.random_scene draws them, redrawn until neither
    the colour nor the background is in `exclude`."""
    while True:
        shape, colour, background, box = shapes.random_scene(rng, size)
        if colour not in exclude and background not in exclude:
            return shape, colour, background, box


def draw(scene, colour=None, shape=None, size=IMAGE_SIZE):
    """PIL image of `scene`, optionally with another colour or shape."""
    s, c, b, box = scene
    return shapes.draw_shape(size, shape or s, COLOURS[colour or c], COLOURS[b], box)


def task_scenes(split, n=None, seed=None):
    """Deterministic scenes of a split: list of dicts with shape, colour, background, box,
    target_colour, prompt. held-out / retention scenes never repeat a train scene."""
    n_default, seed_default = SPLITS[split]
    n, seed = n or n_default, seed_default if seed is None else seed
    avoid = set()
    if split != "train":
        avoid = {(d["shape"], d["colour"], d["background"], tuple(d["box"])) for d in task_scenes("train")}
    rng = np.random.default_rng(seed)
    retention_colours = [c for c in COLOURS if c != TASK_COLOUR]
    out = []
    while len(out) < n:
        scene = random_scene(rng, exclude=(TASK_COLOUR,))
        if (scene[0], scene[1], scene[2], tuple(scene[3])) in avoid:
            continue
        if split == "retention":
            choices = [c for c in retention_colours if c not in (scene[1], scene[2])]
            new = str(choices[rng.integers(len(choices))])
        else:
            new = TASK_COLOUR
        out.append({"shape": scene[0], "colour": scene[1], "background": scene[2], "box": list(scene[3]),
                    "target_colour": new, "prompt": f"make it {new}"})
    return out


def write_pairs(folder, scenes, size=IMAGE_SIZE, jsonl_name="data.jsonl"):
    """Write context/target PNGs and the jsonl (`jsonl_name`) for `scenes` (dicts as task_scenes
    makes, or with a "target_shape" for shape edits) into `folder`. Returns the jsonl path."""
    folder = Path(folder)
    for sub in ("context", "target"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    with open(folder / jsonl_name, "w") as f:
        for i, d in enumerate(scenes):
            scene = (d["shape"], d["colour"], d["background"], tuple(d["box"]))
            draw(scene, size=size).save(folder / "context" / f"{i:05d}.png")
            draw(scene, colour=d["target_colour"], shape=d.get("target_shape"), size=size).save(
                folder / "target" / f"{i:05d}.png")
            f.write(json.dumps({"image": f"context/{i:05d}.png", "target": f"target/{i:05d}.png", **d}) + "\n")
    return folder / jsonl_name


def write_train_split(folder, jsonl_name=SHIPPED_TRAIN.name):
    """The train split as --make_data writes it (same PNGs, same rows), with the jsonl named
    `jsonl_name`: what assets/kontext_blue/ ships. Returns the jsonl path."""
    return write_pairs(folder, task_scenes("train"), jsonl_name=jsonl_name)


def default_task_dir():
    return tiny_models.default_cache_dir() / f"kontext_task_v{TASK_VERSION}"


def ensure_task_data(root=None) -> dict:
    """Write every split once under `root` (default: <tiny_models cache>/kontext_task_v1) and
    return {split: data.jsonl path as str}. Safe for many processes at once (tools.build_once.build_once:
    lock + atomic rename)."""
    root = Path(root) if root is not None else default_task_dir()

    def write_splits(tmp):
        for split in SPLITS:
            write_pairs(tmp / split, task_scenes(split))

    build_once(root, write_splits, 600.0, ready_text=f"kontext task v{TASK_VERSION}\n")
    return {s: str(root / s / "data.jsonl") for s in SPLITS}


def load_rows(jsonl):
    """Rows of a task jsonl with absolute image paths; the scene fields are filled in from the
    images and the prompt when missing (background = most common context colour, target colour =
    last word of the prompt)."""
    base = os.path.dirname(os.path.abspath(jsonl))
    rows = []
    with open(jsonl) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                row["image"], row["target"] = (os.path.join(base, row[k]) for k in ("image", "target"))
                if "background" not in row:
                    row["background"] = nearest_colour(mode_colour(load_rgb(row["image"])))
                if "target_colour" not in row:
                    row["target_colour"] = row["prompt"].split()[-1]
                rows.append(row)
    return rows


# ----------------------------------------------------------------------------------------------
# metrics (numpy, HxWx3 uint8 images); colour names are read with shapes.nearest_colour


def load_rgb(path, size=None) -> np.ndarray:
    from PIL import Image
    with Image.open(path) as im:
        im = im.convert("RGB")
        if size is not None and im.size != (size[1], size[0]):
            im = im.resize((size[1], size[0]), Image.Resampling.LANCZOS)
        return np.asarray(im, dtype=np.uint8).copy()


def mode_colour(img) -> tuple:
    """Most frequent RGB value of an image (the background of a rendered scene)."""
    flat = img.reshape(-1, 3)
    values, counts = np.unique(flat, axis=0, return_counts=True)
    return tuple(int(v) for v in values[counts.argmax()])


def foreground_mask(img, background, threshold=FG_THRESHOLD) -> np.ndarray:
    """Foreground pixels (HxW bool) of a shape on a known plain background.

    Candidates are pixels farther than `threshold` (RGB) from the background; their median is the
    foreground colour; a pixel is foreground when it is closer to that colour than to the
    background (and a candidate). Splitting at the midpoint between the two colours keeps the
    mask of a blurred edge where the sharp edge was, whatever the two colours are."""
    bg = np.asarray(COLOURS[background] if isinstance(background, str) else background, dtype=np.float64)
    x = img.astype(np.float64)
    d_bg = np.sqrt(((x - bg) ** 2).sum(axis=-1))
    candidates = d_bg > threshold
    if candidates.sum() < MIN_FG_PIXELS:
        return candidates
    fg = np.median(x[candidates], axis=0)
    return candidates & (np.sqrt(((x - fg) ** 2).sum(axis=-1)) < d_bg)


def dilate(mask, r) -> np.ndarray:
    """Binary dilation with a (2r+1)^2 square."""
    out = mask.copy()
    h, w = mask.shape
    padded = np.pad(mask, r)
    for dy in range(2 * r + 1):
        for dx in range(2 * r + 1):
            out |= padded[dy:dy + h, dx:dx + w]
    return out


def iou(a, b) -> float:
    union = (a | b).sum()
    return float((a & b).sum() / union) if union else 1.0


def score_edit(output, target, background, target_colour) -> dict:
    """Metrics of one output image against the true target (both HxWx3 uint8).

    colour: named colour of the median foreground pixel of the output (None when there is no
    foreground); colour_ok: it is `target_colour`; iou: output vs target foreground masks;
    background: named colour of the median pixel outside the target shape dilated by 2 px;
    bg_ok: it is `background`; psnr: against the target; success: colour_ok, bg_ok and
    iou >= IOU_OK."""
    out_mask = foreground_mask(output, background)
    tgt_mask = foreground_mask(target, background)
    colour = None
    if out_mask.sum() >= MIN_FG_PIXELS:
        colour = nearest_colour(np.median(output[out_mask].astype(np.float64), axis=0))
    outside = ~dilate(tgt_mask, 2)
    bg_colour = nearest_colour(np.median(output[outside].astype(np.float64), axis=0)) if outside.any() else None
    mse = float(((output.astype(np.float64) - target.astype(np.float64)) ** 2).mean())
    result = {
        "colour": colour, "colour_ok": colour == target_colour,
        "iou": iou(out_mask, tgt_mask),
        "background": bg_colour, "bg_ok": bg_colour == background,
        "psnr": 10 * math.log10(255.0**2 / mse) if mse > 0 else 100.0,
    }
    result["success"] = result["colour_ok"] and result["bg_ok"] and result["iou"] >= IOU_OK
    return result


def summarize(scores) -> dict:
    """Means over pairs: colour_acc, bg_kept and success in %, iou and psnr as means."""
    n = len(scores)
    return {"n": n,
            "colour_acc": 100.0 * sum(s["colour_ok"] for s in scores) / n,
            "iou": sum(s["iou"] for s in scores) / n,
            "bg_kept": 100.0 * sum(s["bg_ok"] for s in scores) / n,
            "success": 100.0 * sum(s["success"] for s in scores) / n,
            "psnr": sum(s["psnr"] for s in scores) / n}


def score_images(outputs, rows) -> dict:
    """summarize() of score_edit over (output, row) pairs, plus the per-pair scores."""
    scores = [score_edit(out, load_rgb(row["target"], out.shape[:2]), row["background"], row["target_colour"])
              for out, row in zip(outputs, rows)]
    return {**summarize(scores), "pairs": scores}


# ----------------------------------------------------------------------------------------------
# generation through FluxKontextPipeline


def load_pipeline(folder, dtype=None, lora=None):
    """FluxKontextPipeline.from_pretrained(folder), every component in `dtype` (fp32 default);
    with `lora` (a folder holding pytorch_lora_weights.safetensors, or the .safetensors file), plus
    pipe.load_lora_weights(lora), as a user loads a LoRA (adapters kept as peft layers, unfused)."""
    import torch
    from diffusers import FluxKontextPipeline
    pipe = FluxKontextPipeline.from_pretrained(folder, torch_dtype=dtype or torch.float32, low_cpu_mem_usage=False)
    if lora:
        pipe.load_lora_weights(lora)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def t5_max_length(pipe) -> int:
    """max_sequence_length for the pipeline: the T5 tokenizer's model_max_length, at most 512."""
    return int(min(512, pipe.tokenizer_2.model_max_length))


def generate(pipe, rows, steps=20, guidance=1.0, seed=0, batch_size=16) -> list[np.ndarray]:
    """Edited images (HxWx3 uint8) for `rows`: FluxKontextPipeline at the context's size
    (max_area = h*w, _auto_resize=False), the T5 length of the tiny tokenizer, one generator per
    batch seeded with seed + first index (the global RNG too, for a stochastic scheduler)."""
    import torch
    from PIL import Image
    outputs = []
    for i in range(0, len(rows), batch_size):
        chunk = rows[i:i + batch_size]
        images = [Image.open(r["image"]).convert("RGB") for r in chunk]
        w, h = images[0].size
        # a stochastic scheduler (a distilled export's) re-noises from the global RNG: the pipeline
        # does not pass `generator` to scheduler.step, so seed that too
        torch.manual_seed(seed + i)
        with torch.no_grad():
            result = pipe(image=images, prompt=[r["prompt"] for r in chunk], height=h, width=w,
                          max_area=h * w, _auto_resize=False, num_inference_steps=steps,
                          guidance_scale=guidance, max_sequence_length=t5_max_length(pipe),
                          generator=torch.Generator().manual_seed(seed + i), output_type="np").images
        outputs += [np.clip(np.round(im * 255.0), 0, 255).astype(np.uint8) for im in result]
    return outputs


def evaluate(folder, rows, steps=20, guidance=1.0, seed=0, lora=None) -> tuple[dict, list[np.ndarray]]:
    """(metrics, outputs) of the model in `folder` (plus the LoRA `lora`, see load_pipeline) on `rows`;
    the metrics include s_per_image, the generation wall time (loading excluded) per image."""
    pipe = load_pipeline(folder, lora=lora)
    t0 = time.perf_counter()
    outputs = generate(pipe, rows, steps=steps, guidance=guidance, seed=seed)
    return {**score_images(outputs, rows), "s_per_image": (time.perf_counter() - t0) / len(rows)}, outputs


def save_grid(columns, path, rows=None, scale=1):
    """A PNG grid: one row per pair, one column per image list in `columns` (lists of HxWx3),
    every tile enlarged `scale` times (nearest neighbour), 2 px gaps between columns."""
    n = len(columns[0]) if rows is None else min(rows, len(columns[0]))
    h, w = columns[0][0].shape[0] * scale, columns[0][0].shape[1] * scale
    gap = 2 if scale > 1 else 0
    tiles = [(c * (w + gap), r * h, col[r]) for r in range(n) for c, col in enumerate(columns)]
    return shapes.save_png(shapes.tile_canvas(len(columns) * (w + gap) - gap, n * h, (255, 255, 255),
                                              tiles, scale), path)


def markdown_table(results) -> str:
    """results: {model name: {split name: summarize() dict}}."""
    header = ["model", "split", "pairs", "colour acc", "IoU", "bg kept", "success", "PSNR"]
    rows = [[name, split, str(m["n"]), f"{m['colour_acc']:.1f} %", f"{m['iou']:.3f}", f"{m['bg_kept']:.1f} %",
             f"{m['success']:.1f} %", f"{m['psnr']:.1f} dB"]
            for name, by_split in results.items() for split, m in by_split.items()]
    return shapes.md_table(header, rows, align=["---"] * 2 + ["---:"] * 6)


def named_paths(parser, items) -> dict:
    """--compare's NAME=PATH items as {name: path}; a malformed one is the parser's error."""
    out = {}
    for item in items:
        name, _, path = item.partition("=")
        if not path:
            parser.error(f"--compare wants NAME=PATH, got {item!r}")
        out[name] = path
    return out


def main(argv=None):
    from components.warnings import quiet_known_warnings
    quiet_known_warnings()  # before diffusers is imported: the import noise the training scripts silence too
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a FluxKontextPipeline folder to evaluate")
    p.add_argument("--compare", nargs="+", metavar="NAME=PATH", help="several models, e.g. base=A tuned=B")
    p.add_argument("--lora", nargs="+", default=[], metavar="NAME=PATH",
                   help="load a LoRA (a LoRA export folder, or its .safetensors) onto model NAME with "
                        "load_lora_weights; a bare PATH applies to the only model")
    p.add_argument("--data", default="", help="held-out jsonl (default: the generated heldout split)")
    p.add_argument("--retention", default="", help="retention jsonl ('' = the generated split, 'none' = skip)")
    p.add_argument("--task_dir", default="", help="where the splits are generated (default: the cache)")
    p.add_argument("--make_data", default="", help="only write the splits into this folder and exit")
    p.add_argument("--make_train", default="", metavar="DIR",
                   help="only write the train split into DIR, jsonl named train.jsonl (as assets/kontext_blue "
                        "ships it), and exit")
    p.add_argument("--n", type=int, default=0, help="use the first N held-out pairs (0 = all)")
    p.add_argument("--steps", type=int, default=20, help="inference steps")
    p.add_argument("--guidance", type=float, default=1.0, help="guidance embedding (training used 1.0)")
    p.add_argument("--steps_for", nargs="+", default=[], metavar="NAME=N",
                   help="inference steps of model NAME (default --steps), e.g. a distilled student's")
    p.add_argument("--guidance_for", nargs="+", default=[], metavar="NAME=G",
                   help="guidance embedding of model NAME (default --guidance)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--grid", default="out/kontext_eval/grid.png", help="PNG grid path ('' = none)")
    p.add_argument("--grid_rows", type=int, default=12)
    p.add_argument("--grid_scale", type=int, default=3, help="tile enlargement (nearest neighbour)")
    p.add_argument("--json", default="", help="write the metrics (and per-pair scores) here")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = p.parse_args(argv)

    if args.make_data:
        for split, path in ensure_task_data(args.make_data).items():
            print(split, path)
        return 0
    if args.make_train:
        print("train", write_train_split(args.make_train))
        return 0
    models = {}
    if args.model:
        models[Path(args.model).name or "model"] = args.model
    models.update(named_paths(p, args.compare or []))
    if not models:
        p.error("give --model=PATH or --compare NAME=PATH ...")
    loras = {}
    for item in args.lora:
        name, sep, path = item.partition("=")
        if not sep or name not in models:  # a bare path (which may itself hold a "=") = the only model's
            if len(models) != 1:
                p.error(f"--lora wants NAME=PATH with NAME one of {sorted(models)}, got {item!r}")
            name, path = next(iter(models)), item
        loras[name] = path
    per_model = {}
    for flag, items, cast in (("--steps_for", args.steps_for, int), ("--guidance_for", args.guidance_for, float)):
        for item in items:
            name, _, value = item.partition("=")
            if name not in models or not value:
                p.error(f"{flag} wants NAME=VALUE with NAME one of {sorted(models)}, got {item!r}")
            per_model.setdefault(name, {})[flag] = cast(value)
    steps = {name: per_model.get(name, {}).get("--steps_for", args.steps) for name in models}
    guidance = {name: per_model.get(name, {}).get("--guidance_for", args.guidance) for name in models}

    import torch
    torch.set_num_threads(args.threads)
    paths = ensure_task_data(args.task_dir or None) if not (args.data and args.retention) else {}
    splits = {"heldout": args.data or paths["heldout"]}
    if args.retention != "none":
        splits["retention"] = args.retention or paths["retention"]
    data = {name: load_rows(path) for name, path in splits.items()}
    if args.n:
        data = {name: rows[:args.n] for name, rows in data.items()}

    results, outputs = {}, {}
    for name, folder in models.items():
        t0 = time.time()
        results[name] = {}
        for split, rows in data.items():
            metrics, images = evaluate(folder, rows, steps[name], guidance[name], args.seed, loras.get(name))
            results[name][split] = metrics
            if split == "heldout":
                outputs[name] = images
        lora = f" + LoRA {loras[name]}" if name in loras else ""
        print(f"{name}: {folder}{lora} ({steps[name]} steps, guidance {guidance[name]:g}) evaluated in "
              f"{time.time() - t0:.1f}s", file=sys.stderr)
    print(markdown_table({m: {s: {k: v for k, v in r.items() if k != "pairs"} for s, r in by.items()}
                          for m, by in results.items()}))
    if args.grid:
        rows = data["heldout"]
        columns = [[load_rgb(r["image"]) for r in rows]] + list(outputs.values()) + \
                  [[load_rgb(r["target"]) for r in rows]]
        save_grid(columns, args.grid, args.grid_rows, args.grid_scale)
        print(f"\ngrid: {args.grid} (columns: context | {' | '.join(outputs)} | target)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"models": models, **({"lora": loras} if loras else {}),
                                               "data": splits, "steps": args.steps, "guidance": args.guidance,
                                               "model_steps": steps, "model_guidance": guidance,
                                               "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
