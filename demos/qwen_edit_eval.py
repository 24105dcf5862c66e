"""The two-reference "make the <shape> the colour of picture 2" task and its evaluation through
diffusers' QwenImageEditPlusPipeline (Qwen-Image-Edit-2509's multi-image input).

Task: picture 1 is a shape (tools/shapes.py) of one colour on a plain background of another;
picture 2 is a plain 32 px swatch of a third colour. The edit recolours the shape in the swatch's
colour and keeps its shape, position, size and the background. Prompt: "make the <shape> the
colour of picture 2": the colour is in picture 2 alone, so one reference cannot solve it (the
"picture 2 removed" row). Splits are drawn deterministically from a seed:

    train     4096 edits, seed 1  (what the demo fine-tunes on)
    heldout     64 edits, seed 2  (scenes and swatches not in train; the evaluation set)
    retention   64 edits, seed 3  (one reference, "make it <colour>": an edit the base model was
                                   pre-trained on; does the fine-tune forget it?)

Each split is a folder with control/, swatch/, target/ PNGs and data.jsonl rows {"control":
[picture 1, picture 2], "target", "prompt"} (paths relative to the file; retention rows have one
control) plus the scene ("shape", "colour", "background", "box", "target_colour", "swatch").
Scored as demos/kontext_eval.py scores Kontext (its score_edit: colour acc, IoU, bg kept, success,
PSNR against the true target).

Generation is the pipeline's own call (QwenImageEditPlusPipeline.__call__, true CFG off), with the
module's VAE_IMAGE_SIZE and CONDITION_IMAGE_SIZE set to AREA (32^2) for the call, the areas the
demo trains at (REFERENCE_AREA, CONDITION_AREA): the pipeline hard-codes 1024^2 and 384^2.

    python -m demos.qwen_edit_eval --compare base=assets/qwen_edit_base tuned=out/qwen_edit_demo/export
    python -m demos.qwen_edit_eval --make_data=out/qwen_edit_task    # write the splits, print the paths

The grid (--grid) has one row per held-out edit: picture 1 | picture 2 | each model's output
(then the one-reference outputs) | target.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from PIL import Image

from demos import kontext_eval as ke
from tools import shapes
from tools.build_once import build_once
from tools.shapes import COLOURS
from tools import tiny_models

IMAGE_SIZE = 32  # pixels per side of picture 1, picture 2 and the target
AREA = IMAGE_SIZE * IMAGE_SIZE  # the pipeline's reference areas for the demo (VAE and text encoder)
TASK_VERSION = 2  # part of the cache folder name; bump when a split's recipe changes
SPLITS = {"train": (4096, 1), "heldout": (64, 2), "retention": (64, 3)}  # name: (edits, seed)
ONE_REFERENCE = "heldout, picture 2 removed"  # the split name of the one-reference rows


# ----------------------------------------------------------------------------------------------
# the task data


def scene_key(d) -> tuple:
    return d["shape"], d["colour"], d["background"], tuple(d["box"]), d.get("swatch")


def task_scenes(split, n=None, seed=None, size=IMAGE_SIZE):
    """Deterministic edits of a split at `size` px: dicts with shape, colour, background, box, target_colour,
    swatch (two-reference splits), prompt. held-out / retention edits never repeat a train edit."""
    n_default, seed_default = SPLITS[split]
    n, seed = n or n_default, seed_default if seed is None else seed
    avoid = {scene_key(d) for d in task_scenes("train", size=size)} if split != "train" else set()
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n:
        shape, colour, background, box = shapes.random_scene(rng, size)
        others = [c for c in COLOURS if c not in (colour, background)]
        new = str(others[rng.integers(len(others))])
        d = {"shape": shape, "colour": colour, "background": background, "box": list(box), "target_colour": new}
        if split == "retention":
            d["prompt"] = f"make it {new}"
        else:
            d.update(swatch=new, prompt=f"make the {shape} the colour of picture 2")
        if scene_key(d) not in avoid:
            out.append(d)
    return out


def write_edits(folder, scenes, size=IMAGE_SIZE):
    """Write control/ (picture 1), swatch/ (picture 2, for scenes with a "swatch"), target/ PNGs and
    data.jsonl for `scenes` (dicts as task_scenes makes them; "target_shape" / "target_background"
    for other edits) into `folder`. Returns the jsonl path."""
    folder = Path(folder)
    for sub in ("control", "swatch", "target"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    with open(folder / "data.jsonl", "w") as f:
        for i, d in enumerate(scenes):
            name = f"{i:05d}.png"
            shapes.draw_shape(size, d["shape"], COLOURS[d["colour"]], COLOURS[d["background"]], d["box"]).save(
                folder / "control" / name)
            shapes.draw_shape(size, d.get("target_shape", d["shape"]), COLOURS[d["target_colour"]],
                              COLOURS[d.get("target_background", d["background"])], d["box"]).save(
                folder / "target" / name)
            control = [f"control/{name}"]
            if d.get("swatch"):
                Image.new("RGB", (size, size), COLOURS[d["swatch"]]).save(folder / "swatch" / name)
                control.append(f"swatch/{name}")
            f.write(json.dumps({"control": control, "target": f"target/{name}", **d}) + "\n")
    return folder / "data.jsonl"


def default_task_dir(size=IMAGE_SIZE):
    suffix = "" if size == IMAGE_SIZE else f"_{size}px"
    return tiny_models.default_cache_dir() / f"qwen_edit_task_v{TASK_VERSION}{suffix}"


def ensure_task_data(root=None, size=IMAGE_SIZE) -> dict:
    """Write every split at `size` px once under `root` (default: <tiny_models cache>/qwen_edit_task_v<TASK_VERSION>,
    with a _<size>px suffix but at 32 px) and return {split: data.jsonl path as str} (tools.build_once: safe for
    many processes)."""
    root = Path(root) if root is not None else default_task_dir(size)

    def write_splits(tmp):
        for split in SPLITS:
            write_edits(tmp / split, task_scenes(split, size=size), size=size)

    build_once(root, write_splits, 600.0, ready_text=f"qwen edit task v{TASK_VERSION} {size}px\n")
    return {s: str(root / s / "data.jsonl") for s in SPLITS}


def load_rows(jsonl, references=None):
    """Rows of a task jsonl with absolute paths; `references` keeps only the first N controls."""
    base = os.path.dirname(os.path.abspath(jsonl))
    rows = []
    with open(jsonl) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                row["control"] = [os.path.join(base, c) for c in row["control"]][:references]
                row["target"] = os.path.join(base, row["target"])
                rows.append(row)
    return rows


# ----------------------------------------------------------------------------------------------
# generation through QwenImageEditPlusPipeline


@contextlib.contextmanager
def pipeline_areas(area=AREA):
    """The pipeline module's reference areas (VAE_IMAGE_SIZE, CONDITION_IMAGE_SIZE) set to `area`
    for the block: the demo trains with both at 32^2 (the module constants are 1024^2 and 384^2)."""
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as plus
    saved = plus.VAE_IMAGE_SIZE, plus.CONDITION_IMAGE_SIZE
    plus.VAE_IMAGE_SIZE = plus.CONDITION_IMAGE_SIZE = area
    try:
        yield
    finally:
        plus.VAE_IMAGE_SIZE, plus.CONDITION_IMAGE_SIZE = saved


def load_pipeline(folder, lora=None):
    """QwenImageEditPlusPipeline.from_pretrained(folder) in fp32, its processor loaded by
    families.qwen_image.load_processor; with `lora`, plus pipe.load_lora_weights(lora)."""
    import torch
    from diffusers import QwenImageEditPlusPipeline
    from families.qwen_image import load_processor
    processor = load_processor(os.path.join(folder, "processor"))
    pipe = QwenImageEditPlusPipeline.from_pretrained(folder, processor=processor, torch_dtype=torch.float32)
    if lora:
        pipe.load_lora_weights(lora)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe, rows, steps=20, seed=0, true_cfg=1.0) -> list[np.ndarray]:
    """Edited images (HxWx3 uint8) for `rows`, one pipeline call per row (its references are one
    prompt's images): at the target's size, true CFG off (or at `true_cfg` > 1 against the negative
    prompt " ", the model card's, with the pipeline's own per-token rescale), generator seeded with
    seed + index (the global RNG too: the pipeline gives a stochastic scheduler, as a distilled export
    has, no generator)."""
    from families.qwen_image import NEGATIVE_PROMPT
    cfg = {"true_cfg_scale": true_cfg, "negative_prompt": NEGATIVE_PROMPT} if true_cfg > 1 else {"true_cfg_scale": 1.0}
    with pipeline_areas():
        return pipeline_outputs(pipe, rows, seed, height=IMAGE_SIZE, width=IMAGE_SIZE, num_inference_steps=steps,
                                **cfg)


def pipeline_outputs(pipe, rows, seed, **call) -> list[np.ndarray]:
    """HxWx3 uint8 outputs of one pipeline call per row: its references (`control`) as `image`, its prompt, the
    generator seeded with seed + index (the global RNG too: a stochastic scheduler draws from it), `call`'s
    arguments."""
    import torch
    from PIL import Image
    outputs = []
    with torch.no_grad():
        for i, row in enumerate(rows):
            images = [Image.open(c).convert("RGB") for c in row["control"]]
            torch.manual_seed(seed + i)
            out = pipe(image=images, prompt=row["prompt"], generator=torch.Generator().manual_seed(seed + i),
                       output_type="np", **call).images[0]
            outputs.append(np.clip(np.round(out * 255.0), 0, 255).astype(np.uint8))
    return outputs


def evaluate(folder, rows, steps=20, seed=0, lora=None, pipe=None, family=None) -> tuple[dict, list[np.ndarray]]:
    """(metrics, outputs) of the model in `folder` on `rows`: kontext_eval.score_images (its
    score_edit per edit) plus s_per_image (generation wall time per image, loading excluded).
    `family` (default QWEN) holds the pipeline's load_pipeline and generate."""
    family = family or QWEN
    pipe = pipe or family.load_pipeline(folder, lora=lora)
    t0 = time.perf_counter()
    outputs = family.generate(pipe, rows, steps=steps, seed=seed)
    return {**ke.score_images(outputs, rows), "s_per_image": (time.perf_counter() - t0) / len(rows)}, outputs


@dataclass(frozen=True)
class EditFamily:
    """What the task's evaluation needs of a multi-reference editing pipeline."""
    name: str  # for the default grid path: out/<name>_eval/grid.png
    doc: str  # the module docstring: --help's description
    size: int  # pixels per side of the task's images
    load_pipeline: Callable  # (folder, lora=None) -> the pipeline, fp32, progress bar off
    generate: Callable  # (pipe, rows, steps, seed, true_cfg=1.0) -> HxWx3 uint8 outputs

    def ensure_task_data(self, root=None) -> dict:
        """The task's splits at this family's size: {split: data.jsonl path}."""
        return ensure_task_data(root, size=self.size)

    def evaluate(self, folder, rows, steps=20, seed=0, lora=None, pipe=None):
        """evaluate() through this family's pipeline."""
        return evaluate(folder, rows, steps, seed, lora=lora, pipe=pipe, family=self)

    def main(self, argv=None):
        return main(argv, family=self)


QWEN = EditFamily("qwen_edit", __doc__, IMAGE_SIZE, load_pipeline, generate)


def main(argv=None, family=None):
    from components.warnings import quiet_known_warnings
    quiet_known_warnings()
    family = family or QWEN
    p = argparse.ArgumentParser(description=family.doc.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compare", nargs="+", default=[], metavar="NAME=PATH", help="models, e.g. base=A tuned=B")
    p.add_argument("--lora", nargs="+", default=[], metavar="NAME=PATH", help="a LoRA export loaded onto model NAME")
    p.add_argument("--one_reference", nargs="+", default=None, metavar="NAME",
                   help=f"models also scored with picture 2 removed ('{ONE_REFERENCE}'); default: the last")
    p.add_argument("--task_dir", default="", help="where the splits are generated (default: the cache)")
    p.add_argument("--make_data", default="", help="only write the splits into this folder, print the paths, exit")
    p.add_argument("--n", type=int, default=0, help="use the first N edits of each split (0 = all)")
    p.add_argument("--steps", type=int, default=20, help="inference steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--grid", default=f"out/{family.name}_eval/grid.png", help="PNG grid path ('' = none)")
    p.add_argument("--grid_rows", type=int, default=12)
    p.add_argument("--grid_scale", type=int, default=3, help="tile enlargement (nearest neighbour)")
    p.add_argument("--json", default="", help="write the metrics (and per-edit scores) here")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = p.parse_args(argv)

    if args.make_data:
        for split, path in ensure_task_data(args.make_data, size=family.size).items():
            print(split, path)
        return 0
    models = ke.named_paths(p, args.compare)
    if not models:
        p.error("give --compare NAME=PATH ...")
    loras = dict(item.partition("=")[::2] for item in args.lora)
    one_ref = args.one_reference if args.one_reference is not None else [list(models)[-1]]
    for name in [*loras, *one_ref]:
        if name not in models:
            p.error(f"{name!r} is not one of the --compare models {sorted(models)}")

    import torch
    torch.set_num_threads(args.threads)
    paths = ensure_task_data(args.task_dir or None, size=family.size)
    data = {"heldout": load_rows(paths["heldout"]), ONE_REFERENCE: load_rows(paths["heldout"], references=1),
            "retention": load_rows(paths["retention"])}
    if args.n:
        data = {split: rows[:args.n] for split, rows in data.items()}

    results, outputs = {}, {}
    for name, folder in models.items():
        t0 = time.time()
        pipe = family.load_pipeline(folder, lora=loras.get(name))
        results[name] = {}
        for split, rows in data.items():
            if split == ONE_REFERENCE and name not in one_ref:
                continue
            results[name][split], images = evaluate(folder, rows, args.steps, args.seed, pipe=pipe, family=family)
            if split != "retention":
                outputs[name if split == "heldout" else f"{name}, 1 ref"] = images
        print(f"{name}: {folder} ({args.steps} steps) evaluated in {time.time() - t0:.1f}s", file=sys.stderr)
    print(ke.markdown_table({m: {s: {k: v for k, v in r.items() if k != "pairs"} for s, r in by.items()}
                             for m, by in results.items()}))
    if args.grid:
        rows = data["heldout"]
        columns = [[ke.load_rgb(r["control"][0]) for r in rows], [ke.load_rgb(r["control"][1]) for r in rows],
                   *outputs.values(), [ke.load_rgb(r["target"]) for r in rows]]
        ke.save_grid(columns, args.grid, args.grid_rows, args.grid_scale)
        print(f"\ngrid: {args.grid} (columns: picture 1 | picture 2 | {' | '.join(outputs)} | target)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"models": models, "lora": loras, "data": paths, "steps": args.steps,
                                               "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
