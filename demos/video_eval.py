"""The few-step video task and its scorer: "a red or blue square moving left", a shape of either named colour moving
in a named direction from a random start, 9 frames at 32 px on white. Two kinds of right answers per prompt: the
colour (two, far apart in RGB: their mean is neither, so a sampler that averages them paints a third colour) and
the start (every position that keeps the path inside the frame). A flow model's first steps predict the mean of
the right answers; a teacher needs its steps to commit to one.

The world: PAIRS (the 6 pairs of the palette demos' 4 colours; every pair's mean lies at least 90 RGB from both) x
3 shapes x 4 directions = 72 prompts; the 24 with (pair + shape + direction) % 3 == 0 are held out (every pair,
shape and direction is still trained) and scored. A clip: a SIDE-px shape of one of the two colours (equally
likely) whose box starts at a random position (uniform over the positions that keep the whole path inside a
MARGIN) and moves DISTANCE px in the named direction, evenly over the frames (positions rounded to the pixel).

The scorer reads each frame as demos/shapes_eval.analyse_image reads an image (background, the largest foreground
component's colour, its shape by fill ratio and upper-half fraction, its box) and scores a clip:
- valid: every frame shows the named shape on white in one of the two colours, within SATURATION of its RGB (a
  mix of the two is not), and the same colour in every frame;
- motion: the centroid moves the named way by at least half of DISTANCE from the first to the last frame, never
  back by more than BACKSTEP px between frames, and drifts at most DRIFT px across;
- consistent: every frame has a shape, all read the same colour and shape, the area stays within AREA_RATIO (max /
  min) and the centroid never jumps more than JUMP px between frames;
- variety: per prompt, the mean distance (px) between the first-frame centroids of its clips over the seeds,
  averaged over prompts;
- colour entropy: per prompt, the entropy (bits; 1 at an even split) of the colours of its valid clips over the
  seeds, averaged over the prompts with two or more valid clips.

    python -m demos.video_eval --compare teacher_28=assets/wan_video_base student_4=out/video_dmd/4step/export \\
        --steps_for student_4=4 --seeds=4 --json=out/eval.json --strip=docs/wan_video_strip.png
    python -m pytest tests/test_video_eval.py -q
"""
from __future__ import annotations

import argparse
import itertools
import json
import time

import numpy as np

from tools import shapes

SIZE, FRAMES = 32, 9
COLOURS = ("red", "green", "blue", "yellow")  # the palette demos' four: every pair's mean lies >= 90 RGB from both
PAIRS = tuple(itertools.combinations(COLOURS, 2))
SATURATION = 60.0  # RGB distance: a frame's colour within this of the named colour's (the palette demos' rule)
SHAPES = ("circle", "square", "triangle")
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}  # (dx, dy), y down
BACKGROUND = "white"
SIDE, DISTANCE, MARGIN = 14, 10, 2  # px: the shape's box, its path, the border it never enters
BACKSTEP, DRIFT, AREA_RATIO, JUMP = 0.75, 3.0, 1.6, 4.5  # px, px, ratio, px (DISTANCE / 8: 1.25 px a frame)
# The shapes as they come back through the task's VAE (assets/wan_video_base/vae; --calibrate=FOLDER measures them):
# (fill ratio, upper-half fraction), medians over reconstructions of every prompt's clips. Every model here draws
# through that VAE, which rounds a 14 px square's corners (fill 0.92 against 1) and shapes_eval's ideal prototypes
# read a third of its squares as circles; the renderer's own shapes read right with these too (the tests check).
SHAPE_PROTOTYPES = {"circle": (0.8, 0.476), "square": (0.922, 0.496), "triangle": (0.667, 0.34)}
NEGATIVE = ""  # the pipelines' default negative prompt, and the unconditional prompt of pre-training
# UMT5 tokens the transformer reads (the prompts are 5 words), zero-padded as the pipeline pads to its 512: the base
# is trained, distilled (MAX_SEQUENCE_LENGTH) and sampled (max_sequence_length) at 32, 4x less CPU than at 512
TEXT_LENGTH = 32


def prompt_for(pair, shape, direction) -> str:
    return f"a {pair[0]} or {pair[1]} {shape} moving {direction}"


def parse_prompt(prompt: str):
    """'a red or blue square moving left' -> (('red', 'blue'), 'square', 'left')."""
    words = prompt.split()
    return (words[1], words[3]), words[4], words[6]


def splits():
    """(train prompts, held-out prompts): the 72 prompts, held out where (pair + shape + direction) % 3 == 0."""
    train, held_out = [], []
    for (pi, p), (si, s), (di, d) in itertools.product(enumerate(PAIRS), enumerate(SHAPES), enumerate(DIRECTIONS)):
        (held_out if (pi + si + di) % 3 == 0 else train).append(prompt_for(p, s, d))
    return train, held_out


def random_start(rng: np.random.Generator, direction: str):
    """The box's top-left corner (x, y) at frame 0: uniform over the starts whose whole path stays in the margin."""
    dx, dy = DIRECTIONS[direction]
    hi = SIZE - MARGIN - SIDE  # the largest top-left coordinate
    lo_x, hi_x = MARGIN + max(0, -dx) * DISTANCE, hi - max(0, dx) * DISTANCE
    lo_y, hi_y = MARGIN + max(0, -dy) * DISTANCE, hi - max(0, dy) * DISTANCE
    return float(rng.uniform(lo_x, hi_x)), float(rng.uniform(lo_y, hi_y))


def render(prompt: str, start, colour: str, frames: int = FRAMES) -> np.ndarray:
    """(frames, SIZE, SIZE, 3) uint8: the prompt's shape in `colour` from `start` (x, y) moving DISTANCE px its way."""
    _, shape, direction = parse_prompt(prompt)
    dx, dy = DIRECTIONS[direction]
    out = []
    for f in range(frames):
        step = DISTANCE * f / (frames - 1)
        x, y = int(round(start[0] + dx * step)), int(round(start[1] + dy * step))
        box = (x, y, x + SIDE - 1, y + SIDE - 1)
        out.append(np.asarray(shapes.draw_shape(SIZE, shape, shapes.COLOURS[colour], shapes.COLOURS[BACKGROUND], box)))
    return np.stack(out)


def render_batch(prompts, rng: np.random.Generator) -> np.ndarray:
    """(N, frames, SIZE, SIZE, 3) uint8: each prompt in one of its colours (equally likely) from a random start."""
    clips = []
    for p in prompts:
        pair, _, direction = parse_prompt(p)
        colour = pair[int(rng.integers(0, 2))]
        clips.append(render(p, random_start(rng, direction), colour))
    return np.stack(clips)


# ---------------------------------------------------------------------------------------------
# scoring


def classify(fill: float, top: float) -> str:
    """The nearest of SHAPE_PROTOTYPES, by shapes_eval's distance."""
    from demos.shapes_eval import TOP_WEIGHT
    return min(SHAPE_PROTOTYPES, key=lambda s: (fill - SHAPE_PROTOTYPES[s][0]) ** 2
               + (TOP_WEIGHT * (top - SHAPE_PROTOTYPES[s][1])) ** 2)


def analyse_clip(clip: np.ndarray) -> list[dict]:
    """Each frame as shapes_eval.analyse_image reads it, its shape by SHAPE_PROTOTYPES."""
    from demos.shapes_eval import analyse_image
    frames = [analyse_image(frame) for frame in clip]
    return [{**a, "shape": classify(a["fill"], a["top"]) if a["area"] > 0 else "none"} for a in frames]


def calibrate(folder, seeds: int = 4) -> dict:
    """SHAPE_PROTOTYPES measured: the median (fill, top) per shape of FOLDER/vae's reconstructions of every prompt's
    clips (seeds each)."""
    import torch
    from diffusers import AutoencoderKLWan

    from demos.shapes_eval import analyse_image
    vae = AutoencoderKLWan.from_pretrained(f"{folder}/vae", torch_dtype=torch.float32).eval()
    prompts = [p for p in sum(splits(), []) for _ in range(seeds)]
    clips = render_batch(prompts, np.random.default_rng(11))
    feats = {}
    with torch.no_grad():
        for i in range(0, len(clips), 32):
            x = torch.from_numpy(clips[i:i + 32]).permute(0, 4, 1, 2, 3).float() / 127.5 - 1.0
            rec = vae.decode(vae.encode(x).latent_dist.mode()).sample.clamp(-1, 1)
            rec = ((rec + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 4, 1).numpy()
            for clip, prompt in zip(rec, prompts[i:i + 32]):
                for frame in clip:
                    a = analyse_image(frame)
                    feats.setdefault(parse_prompt(prompt)[1], []).append((a["fill"], a["top"]))
    return {s: tuple(round(float(v), 3) for v in np.median(np.array(feats[s]), axis=0)) for s in SHAPES}


def score_clip(clip: np.ndarray, prompt: str) -> dict:
    """One clip's verdicts (valid, motion, consistent), its per-frame validity, its colour (None unless valid) and
    its first-frame centroid."""
    pair, shape, direction = parse_prompt(prompt)
    frames = analyse_clip(clip)
    ok = [a["colour"] in pair and a["shape"] == shape and a["background"] == BACKGROUND
          and float(np.sqrt(((a["fg_rgb"] - np.array(shapes.COLOURS[a["colour"]])) ** 2).sum())) <= SATURATION
          for a in frames]
    valid = all(ok) and len({a["colour"] for a in frames}) == 1
    seen = all(a["area"] > 0 for a in frames)
    h, w = clip.shape[1:3]
    centres = np.array([(a["box"][0] * w, a["box"][1] * h) for a in frames])
    motion = consistent = False
    if seen:
        dx, dy = DIRECTIONS[direction]
        along = centres @ np.array([dx, dy], dtype=float)
        across = centres @ np.array([dy, dx], dtype=float)
        steps = np.diff(along)
        motion = bool(along[-1] - along[0] >= DISTANCE / 2 and steps.min() >= -BACKSTEP
                      and np.ptp(across) <= DRIFT)
        areas = np.array([a["area"] for a in frames])
        jumps = np.sqrt((np.diff(centres, axis=0) ** 2).sum(axis=1))
        consistent = bool(len({(a["colour"], a["shape"]) for a in frames}) == 1
                          and areas.max() <= AREA_RATIO * areas.min() and jumps.max() <= JUMP)
    return {"valid": valid, "frame_valid": float(np.mean(ok)), "motion": motion, "consistent": consistent,
            "colour": frames[0]["colour"] if valid else None, "start": centres[0] if seen else None}


def variety(starts_by_prompt: dict) -> float:
    """The mean over prompts of the mean pairwise distance (px) between their clips' first-frame centroids."""
    spreads = []
    for starts in starts_by_prompt.values():
        starts = [s for s in starts if s is not None]
        if len(starts) >= 2:
            pts = np.array(starts)
            d = np.sqrt(((pts[:, None] - pts[None]) ** 2).sum(axis=-1))
            spreads.append(d.sum() / (len(pts) * (len(pts) - 1)))
    return float(np.mean(spreads)) if spreads else 0.0


def colour_entropy(colours_by_prompt: dict) -> float:
    """The mean over prompts with two or more valid clips of the entropy (bits) of their colours."""
    from demos.palette_eval import entropy_bits
    valid = [[c for c in colours if c is not None] for colours in colours_by_prompt.values()]
    bits = [entropy_bits(colours) for colours in valid if len(colours) >= 2]
    return float(np.mean(bits)) if bits else 0.0


def score_clips(clips: np.ndarray, prompts: list[str]) -> dict:
    """Percentages of valid / moving / consistent clips, the mean per-frame validity, the variety (px) and the
    colour entropy (bits)."""
    scores = [score_clip(c, p) for c, p in zip(clips, prompts)]
    starts, colours = {}, {}
    for s, p in zip(scores, prompts):
        starts.setdefault(p, []).append(s["start"])
        colours.setdefault(p, []).append(s["colour"])
    out = {k: 100.0 * float(np.mean([s[k] for s in scores])) for k in ("valid", "frame_valid", "motion", "consistent")}
    out["variety"] = variety(starts)
    out["colour_entropy"] = colour_entropy(colours)
    out["n"] = len(scores)
    return out


# ---------------------------------------------------------------------------------------------
# sampling a WanPipeline folder


def load(path):
    import torch
    from diffusers import WanPipeline
    pipe = WanPipeline.from_pretrained(path, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe, prompts: list[str], seeds: int, steps: int, guidance: float = 1.0, batch: int = 32):
    """(len(prompts) x seeds, frames, H, W, 3) uint8 clips, prompt-major; clip (p, s) from noise seed s. The global
    RNG is seeded per batch too: a distilled export's stochastic scheduler re-noises from it (WanPipeline passes no
    generator to scheduler.step), so without it a student's row would depend on what was sampled before it."""
    import torch
    jobs = [(p, s) for p in prompts for s in range(seeds)]
    out = []
    for i in range(0, len(jobs), batch):
        part = jobs[i:i + batch]
        gens = [torch.Generator().manual_seed(1000 + s) for _, s in part]
        torch.manual_seed(1000 + i)
        with torch.no_grad():
            video = pipe(prompt=[p for p, _ in part], negative_prompt=[NEGATIVE] * len(part), height=SIZE, width=SIZE,
                         num_frames=FRAMES, num_inference_steps=steps, guidance_scale=guidance, generator=gens,
                         max_sequence_length=TEXT_LENGTH, output_type="np").frames
        out.append((np.clip(np.asarray(video), 0, 1) * 255).round().astype(np.uint8))
    return np.concatenate(out), [p for p, _ in jobs]


def strip(rows: list[tuple[str, np.ndarray]], path, scale=2):
    """A PNG: one row per model (its label, then its clip's frames)."""
    label_w, size = 80, SIZE * scale
    tiles, labels = [], []
    for r, (name, clip) in enumerate(rows):
        labels.append((2, r * (size + 2) + size // 2 - 5, name))
        tiles += [(label_w + f * (size + 2), r * (size + 2), frame) for f, frame in enumerate(clip)]
    width = label_w + len(rows[0][1]) * (size + 2)
    canvas = shapes.tile_canvas(width, len(rows) * (size + 2), (255, 255, 255), tiles, scale=scale, labels=labels)
    return shapes.save_png(canvas, path)


COLUMNS = [("valid", "valid %"), ("frame_valid", "frames valid %"), ("motion", "motion %"),
           ("consistent", "consistent %"), ("variety", "variety px"), ("colour_entropy", "colour entropy bits")]


def markdown(results: dict) -> str:
    """The table; the variety and the colour entropy also in % of the 28-step teacher's."""
    ratios = ("variety", "colour_entropy")
    header = (["model", "steps"] + [title for _, title in COLUMNS] + [f"{k} % of teacher_28" for k in ratios]
              + ["s / clip"])
    refs = {k: results.get("teacher_28", {}).get(k) or None for k in ratios}
    rows = [[name, r["steps"]] + [f"{r[k]:.2f}" if k == "colour_entropy" else f"{r[k]:.1f}" for k, _ in COLUMNS]
            + [f"{100 * r[k] / refs[k]:.0f}" if refs[k] else "-" for k in ratios] + [f"{r['s_per_clip']:.3f}"]
            for name, r in results.items()]
    return shapes.md_table(header, rows)


def make_data(folder, real_clips: int = 0, seed: int = 11):
    """FOLDER/train.txt and FOLDER/held_out.txt, one prompt a line; prints "train PATH" and "held_out PATH". With
    real_clips K: FOLDER/real/ holds K rendered clips of each training prompt as 9-frame GIFs (either colour, random
    starts: the task's own answers) and FOLDER/train_real.jsonl rows {"prompt", "target"}, the GAN's real clips;
    prints "train_real PATH"."""
    from pathlib import Path

    from PIL import Image
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    train, held_out = splits()
    for name, prompts in (("train", train), ("held_out", held_out)):
        (folder / f"{name}.txt").write_text("\n".join(prompts) + "\n")
        print(name, folder / f"{name}.txt")
    if real_clips:
        (folder / "real").mkdir(exist_ok=True)
        rows, rng = [], np.random.default_rng(seed)
        for i, p in enumerate(train):
            for k, clip in enumerate(render_batch([p] * real_clips, rng)):
                frames = [Image.fromarray(f) for f in clip]
                name = f"real/{i:02d}_{k:02d}.gif"  # GIF's palette holds the renderer's colours exactly
                frames[0].save(folder / name, save_all=True, append_images=frames[1:], duration=125, loop=0)
                rows.append(json.dumps({"prompt": p, "target": name}))
        (folder / "train_real.jsonl").write_text("\n".join(rows) + "\n")
        print("train_real", folder / "train_real.jsonl")
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compare", nargs="+", default=[], help="name=pipeline folder ...")
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--steps_for", nargs="*", default=[], help="name=steps ...")
    ap.add_argument("--guidance", type=float, default=1.0)
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=24, help="the first N held-out prompts (all 24)")
    ap.add_argument("--json", default="")
    ap.add_argument("--strip", default="")
    ap.add_argument("--real", type=int, default=1, help="also score the renderer's own clips")
    ap.add_argument("--scored", default="", help="an earlier --json: its rows of one name, model and steps are kept")
    ap.add_argument("--make_data", default="", help="write FOLDER/train.txt and held_out.txt, print their paths")
    ap.add_argument("--real_clips", type=int, default=0, help="with --make_data: K real clips per training prompt")
    ap.add_argument("--calibrate", default="", help="print SHAPE_PROTOTYPES as a pipeline folder's VAE gives them")
    args = ap.parse_args(argv)
    if args.make_data:
        return make_data(args.make_data, args.real_clips)
    if args.calibrate:
        print(calibrate(args.calibrate))
        return 0
    prompts = splits()[1][:args.prompts]
    steps_for = {k: int(v) for k, v in (s.split("=", 1) for s in args.steps_for)}
    results, first = {}, []
    if args.real:
        clips = render_batch([p for p in prompts for _ in range(args.seeds)], np.random.default_rng(7))
        results["renderer"] = {**score_clips(clips, [p for p in prompts for _ in range(args.seeds)]),
                               "steps": "-", "s_per_clip": 0.0}
        first.append(("renderer", clips[0]))
    pipes, earlier = {}, {}
    if args.scored:
        with open(args.scored) as f:
            earlier = json.load(f)["results"]
    for item in args.compare:
        name, path = item.split("=", 1)
        steps = steps_for.get(name, args.steps)
        if (earlier.get(name, {}).get("steps"), earlier.get(name, {}).get("model")) == (steps, path):
            results[name] = earlier[name]
            continue
        pipe = pipes.setdefault(path, None) or load(path)
        pipes[path] = pipe
        t0 = time.time()
        clips, clip_prompts = generate(pipe, prompts, args.seeds, steps, args.guidance)
        seconds = (time.time() - t0) / len(clips)
        results[name] = {**score_clips(clips, clip_prompts), "steps": steps, "s_per_clip": seconds, "model": path}
        first.append((name, clips[0]))
        shapes.log(f"{name} ({steps} steps): " + ", ".join(f"{k} {v:.1f}" for k, v in results[name].items()
                                                            if isinstance(v, float)), tag="video_eval")
    print(markdown(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"prompts": len(prompts), "seeds": args.seeds, "guidance": args.guidance, "results": results},
                      f, indent=2)
    if args.strip and first:
        strip(first, args.strip)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
