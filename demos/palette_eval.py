"""The "paint it" editing task (many valid edits) and its evaluation through FluxKontextPipeline,
QwenImageEditPlusPipeline, Flux2KleinPipeline or ZImageOmniPipeline.

Task: a shape of tools/shapes.py's world, in a colour outside the palette, on a plain background
outside the palette; the instruction "paint it" never names a colour, and any of PALETTE is right.
Each training pair's target is one palette colour drawn at random, so the right answer is a
distribution over four edits per context: a few-step sampler that averages them paints a muddy
mix, which is no palette colour. Splits, drawn deterministically from a seed (scenes of heldout
never repeat a train scene):

    train    512 pairs, seed 11  (what the teacher is fine-tuned on, and the students' prompts)
    heldout   32 contexts, seed 12  (each edited with SEEDS noise seeds per model)
    train_all_colours  the 512 train contexts, each once per palette colour (2048 pairs): every
                       right edit of a context in the data, for a teacher that would otherwise learn
                       one colour per context
    train_cfg  train_all_colours plus a second instruction, "make it white", on the train contexts
               that are not white already (nor on white), each written 4 times: as many white edits as
               palette ones, so that a teacher fine-tuned with CAPTION_DROPOUT learns an unconditional
               edit half white, which its true CFG ("paint it" against " ") steers away from
               (demos/demo_dmd_cfg.sh). With one white edit per context (12 % of the rows) its
               unconditional edit paints as "paint it" does, and CFG 4 scores within 3.5 points of CFG 1

Each split is written as demos/kontext_eval.py writes its own (context/*.png, target/*.png,
data.jsonl rows {"image", "target", "prompt", scene fields}).

Scores, from pixels, per output (demos/kontext_eval.py's foreground mask, IoU and background
reading; `score_paint`):
  palette     the median foreground colour is nearest (of all named colours) to a palette colour
  saturated   ... and within SATURATED_DIST (RGB) of it: a mix of two palette colours is not
  one colour  at least ONE_COLOUR_FRAC of the foreground pixels are within ONE_COLOUR_DIST of it
  valid       all three, the background kept, and IoU >= 0.7 with the context's shape
  saturation  the HSV saturation (max - min) / max of the median foreground colour, in %, averaged
              over the outputs with a foreground; CFG's extrapolation moves it, and the error of a
              model is its distance from the 28-step teacher's
  entropy     per context, the entropy (bits; 2 = all four colours equally) of the palette colours
              of its valid outputs over the seeds; averaged over contexts. The uniform target
              distribution would give 2 bits at infinite seeds, about 1.9 at 32 seeds.
  variety at equal counts  per context, the model's and the reference's valid outputs rarefied to
              the smaller count, then entropy against entropy (`variety_at_counts`): the plain
              variety ratio also falls with validity, since fewer valid outputs per context show
              fewer colours; this one separates the two

    python -m demos.palette_eval --compare t28=T t4=T s4=S --steps 28 --steps_for t4=4 s4=4
    python -m demos.palette_eval --make_data=out/palette_task   # write the splits, print the paths
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from demos import kontext_eval as ke
from tools import shapes
from tools.build_once import build_once
from tools.shapes import COLOURS, nearest_colour

PALETTE = ("red", "green", "blue", "yellow")
PROMPT = "paint it"  # 8 T5 tokens with </s>: the tiny tokenizer's whole length, never a colour name
SPLITS = {"train": (512, 11), "heldout": (32, 12)}  # name: (pairs, seed)
# the train scenes, each written once per palette colour: the four right edits of a context side by side
ALL_COLOURS = "train_all_colours"
CFG_SPLIT = "train_cfg"  # ALL_COLOURS + "make it white": an unconditional edit for true CFG to steer away from
CFG_PROMPT, CFG_COLOUR = "make it white", "white"
# noise seeds per held-out context: a context has ~15 valid outputs at 32 (~4 at 8, where the entropy
# of so few colours reads low and swings by 10 points of variety from one seed set to the next)
SEEDS = 32
SATURATED_DIST = 60.0  # RGB distance of the median foreground colour from its palette colour
ONE_COLOUR_DIST = 80.0
ONE_COLOUR_FRAC = 0.6
NON_PALETTE = tuple(c for c in COLOURS if c not in PALETTE)


def task_scenes(split, size=ke.IMAGE_SIZE):
    """Deterministic scenes of a split at `size` px (dicts as kontext_eval.task_scenes makes them): shape and
    background colours outside PALETTE, target colour a random palette colour."""
    n, seed = SPLITS[split]
    avoid = set()
    if split != "train":
        avoid = {(d["shape"], d["colour"], d["background"], tuple(d["box"])) for d in task_scenes("train", size)}
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n:
        scene = ke.random_scene(rng, size=size, exclude=PALETTE)
        if (scene[0], scene[1], scene[2], tuple(scene[3])) in avoid:
            continue
        new = PALETTE[int(rng.integers(len(PALETTE)))]
        out.append({"shape": scene[0], "colour": scene[1], "background": scene[2], "box": list(scene[3]),
                    "target_colour": new, "prompt": PROMPT})
    return out


def ensure_task_data(root, size=ke.IMAGE_SIZE, cfg=None) -> dict:
    """Write every split (and ALL_COLOURS) at `size` px once under `root`; {split: data.jsonl path as str}.
    The CFG split too where `cfg` (default: at 32 px; demos/demo_dmd_cfg.sh asks for it at any size)."""
    root = Path(root)

    def write_splits(tmp):
        for split in SPLITS:
            ke.write_pairs(tmp / split, task_scenes(split, size), size=size)
        ke.write_pairs(tmp / ALL_COLOURS, [{**d, "target_colour": c} for d in task_scenes("train", size)
                                           for c in PALETTE], size=size)

    build_once(root, write_splits, 600.0, ready_text="palette task v2\n")
    paths = {s: str(root / s / "data.jsonl") for s in (*SPLITS, ALL_COLOURS)}
    if not (size == ke.IMAGE_SIZE if cfg is None else cfg):
        return paths

    def write_cfg(tmp):
        scenes = [{**d, "target_colour": c} for d in task_scenes("train", size) for c in PALETTE]
        scenes += [{**d, "target_colour": CFG_COLOUR, "prompt": CFG_PROMPT} for d in task_scenes("train", size)
                   if CFG_COLOUR not in (d["colour"], d["background"]) for _ in PALETTE]
        ke.write_pairs(tmp, scenes, size=size)

    build_once(root / CFG_SPLIT, write_cfg, 600.0, ready_text="palette cfg split v2\n")
    return {**paths, CFG_SPLIT: str(root / CFG_SPLIT / "data.jsonl")}


def score_paint(output, context, background) -> dict:
    """Scores of one output (HxWx3 uint8) for the context it edited (see the module docstring)."""
    out_mask = ke.foreground_mask(output, background)
    ctx_mask = ke.foreground_mask(context, background)
    colour, dist, frac = None, math.inf, 0.0
    if out_mask.sum() >= ke.MIN_FG_PIXELS:
        fg = output[out_mask].astype(np.float64)
        colour = nearest_colour(np.median(fg, axis=0))
        rgb = np.asarray(COLOURS[colour], dtype=np.float64)
        dist = float(np.sqrt(((np.median(fg, axis=0) - rgb) ** 2).sum()))
        frac = float((np.sqrt(((fg - rgb) ** 2).sum(axis=-1)) < ONE_COLOUR_DIST).mean())
    outside = ~ke.dilate(ctx_mask, 2)
    bg_colour = nearest_colour(np.median(output[outside].astype(np.float64), axis=0)) if outside.any() else None
    r = {"colour": colour, "palette": colour in PALETTE, "dist": dist, "one_colour_frac": frac,
         "iou": ke.iou(out_mask, ctx_mask), "bg_ok": bg_colour == background, "sat": saturation(output[out_mask])}
    r["saturated"] = r["palette"] and dist <= SATURATED_DIST
    r["one_colour"] = r["saturated"] and frac >= ONE_COLOUR_FRAC
    r["valid"] = r["one_colour"] and r["bg_ok"] and r["iou"] >= ke.IOU_OK
    return r


def saturation(fg) -> float | None:
    """HSV saturation (max - min) / max of the median colour of foreground pixels (N, 3) uint8; None
    without enough of them."""
    if len(fg) < ke.MIN_FG_PIXELS:
        return None
    rgb = np.median(fg.astype(np.float64), axis=0)
    return float((rgb.max() - rgb.min()) / rgb.max()) if rgb.max() > 0 else 0.0


def entropy_bits(colours) -> float:
    """Entropy (bits) of the empirical distribution of `colours` (0 for none)."""
    if not colours:
        return 0.0
    return _count_bits(np.unique(np.asarray(colours), return_counts=True)[1])


def _count_bits(counts) -> float:
    """Entropy (bits) of the distribution with these counts (zeros allowed)."""
    p = np.asarray([c for c in counts if c], dtype=np.float64)
    p /= p.sum()
    return float(-(p * np.log2(p)).sum())


def rarefied_entropy(colours, k: int) -> float:
    """The mean entropy_bits of a random k of `colours` (drawn without replacement): rarefaction, the
    ecologists' way to compare diversity at equal sample sizes. Exact, over every count vector of
    the k drawn (a multivariate hypergeometric; a few seeds' outputs: small)."""
    if k <= 1 or not colours:
        return 0.0
    _, counts = np.unique(np.asarray(colours), return_counts=True)
    counts, m = [int(c) for c in counts], len(colours)
    if k > m:
        raise ValueError(f"cannot draw {k} of {m} colours without replacement")
    total = 0.0

    def walk(i, left, log_ways, drawn):
        nonlocal total
        if i == len(counts) - 1:
            if left > counts[i]:
                return
            ways = log_ways + _log_choose(counts[i], left) - _log_choose(m, k)
            total += math.exp(ways) * _count_bits(drawn + [left])
            return
        for c in range(min(left, counts[i]) + 1):
            walk(i + 1, left - c, log_ways + _log_choose(counts[i], c), drawn + [c])

    walk(0, k, 0.0, [])
    return total


def _log_choose(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def variety_at_counts(colours, reference) -> float:
    """A model's variety at equal counts: in each context both the model's and the reference's valid
    outputs rarefied to the smaller of their counts (rarefied_entropy), then the model's summed
    entropy in % of the reference's. colours[c] / reference[c]: the valid outputs' colours of
    context c over the same seeds. The plain ratio of entropies also falls with validity (fewer
    valid outputs show fewer colours); this one does not. The reference against itself: 100 %."""
    mine = ref = 0.0
    for own, theirs in zip(colours, reference, strict=True):
        k = min(len(own), len(theirs))
        mine += rarefied_entropy(own, k)
        ref += rarefied_entropy(theirs, k)
    return 100.0 * mine / ref if ref else float("nan")


def summarize(scores) -> dict:
    """scores[c][s]: score_paint of context c, seed s. Rates in %, entropy in bits."""
    flat = [s for per in scores for s in per]
    n = len(flat)
    counts = {c: sum(s["valid"] and s["colour"] == c for s in flat) for c in PALETTE}
    sats = [s["sat"] for s in flat if s.get("sat") is not None]
    return {"n": n, "contexts": len(scores),
            "palette": 100.0 * sum(s["palette"] for s in flat) / n,
            "saturated": 100.0 * sum(s["saturated"] for s in flat) / n,
            "one_colour": 100.0 * sum(s["one_colour"] for s in flat) / n,
            "bg_kept": 100.0 * sum(s["bg_ok"] for s in flat) / n,
            "iou": sum(s["iou"] for s in flat) / n,
            "saturation": 100.0 * sum(sats) / len(sats) if sats else float("nan"),
            "valid": 100.0 * sum(s["valid"] for s in flat) / n,
            "entropy": sum(entropy_bits([s["colour"] for s in per if s["valid"]]) for per in scores) / len(scores),
            "colour_share": {c: 100.0 * k / n for c, k in counts.items()},
            "valid_colours": [[s["colour"] for s in per if s["valid"]] for per in scores]}


def pipeline_class(folder) -> str:
    """The pipeline class `folder`'s model_index.json names."""
    return json.loads((Path(folder) / "model_index.json").read_text())["_class_name"]


def edit_family(folder):
    """The multi-reference pipeline's evaluation family (qwen_edit_eval.EditFamily) of `folder`, by its
    model_index.json: Qwen-Image-Edit, FLUX.2 [klein] or Z-Image Omni; None for FLUX.1 Kontext."""
    name = pipeline_class(folder)
    if "QwenImageEdit" in name:
        from demos import qwen_edit_eval as qe
        return qe.QWEN
    if name == "Flux2KleinPipeline":
        from demos import flux2_edit_eval as fe
        return fe.FLUX2
    if name == "ZImageOmniPipeline":
        from demos import z_image_edit_eval as ze
        return ze.Z_IMAGE
    return None


def evaluate(folder, rows, steps, guidance, seeds, seed0=0, neutral=False, true_cfg=1.0):
    """(summary, outputs[seed][context]) of the model in `folder` over `seeds` noise seeds, through
    FluxKontextPipeline (at `guidance`), or QwenImageEditPlusPipeline, Flux2KleinPipeline or ZImageOmniPipeline
    (the context as their one reference, true CFG at `true_cfg`: off at 1), as model_index.json says. `neutral`:
    its scheduler's σ-bending settings neutral (families/dit.py's NEUTRAL_SIGMAS, as a distilled export samples)."""
    family = edit_family(folder)
    if family is not None:
        pipe, refs = family.load_pipeline(folder), [{**r, "control": [r["image"]]} for r in rows]

        def generate(seed):
            return family.generate(pipe, refs, steps=steps, seed=seed, true_cfg=true_cfg)
    elif true_cfg > 1:
        raise ValueError(f"{folder}: true CFG is for Qwen-Image-Edit, FLUX.2 and Z-Image models (FLUX.1 Kontext takes "
                         "--guidance)")
    else:
        pipe = ke.load_pipeline(folder)

        def generate(seed):
            return ke.generate(pipe, rows, steps=steps, guidance=guidance, seed=seed)
    if neutral:
        from families.dit import NEUTRAL_SIGMAS
        pipe.scheduler = type(pipe.scheduler).from_config({**pipe.scheduler.config, **NEUTRAL_SIGMAS})
    t0 = time.perf_counter()
    outputs = [generate(seed0 + 1000 * s) for s in range(seeds)]
    elapsed = time.perf_counter() - t0
    contexts = [ke.load_rgb(r["image"]) for r in rows]
    scores = [[score_paint(outputs[s][c], contexts[c], rows[c]["background"]) for s in range(seeds)]
              for c in range(len(rows))]
    return {**summarize(scores), "s_per_image": elapsed / (seeds * len(rows))}, outputs


def markdown_table(results, steps, reference) -> str:
    """results: {name: summarize() dict}; variety = entropy in % of `reference`'s."""
    ref = results[reference]["entropy"] if reference in results else 0.0
    header = ["model", "steps", "valid", "palette", "saturated", "one colour", "bg kept", "IoU", "saturation",
              "entropy", "variety", "red / green / blue / yellow", "s / image"]
    rows = []
    for name, m in results.items():
        share = " / ".join(f"{m['colour_share'][c]:.0f}" for c in PALETTE)
        variety = f"{100.0 * m['entropy'] / ref:.0f} %" if ref else "-"
        rows.append([name, str(steps[name]), f"{m['valid']:.1f} %", f"{m['palette']:.1f} %", f"{m['saturated']:.1f} %",
                     f"{m['one_colour']:.1f} %", f"{m['bg_kept']:.1f} %", f"{m['iou']:.3f}",
                     f"{m.get('saturation', float('nan')):.1f} %",
                     f"{m['entropy']:.2f} bits", variety, share, f"{m['s_per_image']:.4f}"])
    return shapes.md_table(header, rows, align=["---"] + ["---:"] * (len(header) - 1))


def save_grid(contexts, outputs, path, n_contexts=6, n_seeds=4, scale=3):
    """One row per context: the context, then per model (a labelled block) its first n_seeds outputs."""
    h, w = contexts[0].shape[0] * scale, contexts[0].shape[1] * scale
    gap, block_gap, top = 2, 10, 14
    x, tiles, labels = 0, [], [(0, 1, "context")]
    for r in range(n_contexts):
        tiles.append((0, top + r * (h + gap), contexts[r]))
    x = w + block_gap
    for name, per_seed in outputs.items():
        labels.append((x, 1, name))
        for s in range(n_seeds):
            for r in range(n_contexts):
                tiles.append((x + s * (w + gap), top + r * (h + gap), per_seed[s][r]))
        x += n_seeds * (w + gap) - gap + block_gap
    height = top + n_contexts * (h + gap) - gap
    canvas = shapes.tile_canvas(x - block_gap, height, (255, 255, 255), tiles, scale, labels)
    return shapes.save_png(canvas, path)


def read_scored(parser, path, settings, seeds, seed, contexts) -> dict:
    """The rows of an earlier --json that this run would sample again: same name, folder, steps, guidance, true
    CFG and σ settings, at the same noise seeds over as many contexts."""
    earlier = json.loads(Path(path).read_text())
    asked = {"seeds": seeds, "seed": seed, "contexts": contexts}
    for key, value in asked.items():
        if earlier.get(key) != value:
            parser.error(f"--scored {path}: scored with {key} {earlier.get(key)}, this run has {value}")
    old = earlier.get("settings", {})
    return {name: earlier["results"][name] for name, s in settings.items() if old.get(name) == s}


def main(argv=None):
    from components.warnings import quiet_known_warnings
    quiet_known_warnings()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compare", nargs="+", default=[], metavar="NAME=PATH",
                   help="pipeline folders (Kontext or Qwen-Image-Edit)")
    p.add_argument("--task_dir", default="out/palette_task", help="where the splits are written")
    p.add_argument("--make_data", default="", help="only write the splits into this folder and exit")
    p.add_argument("--cfg_split", type=int, default=None,
                   help="with --make_data: write the CFG split too (default: at 32 px only)")
    p.add_argument("--size", type=int, default=ke.IMAGE_SIZE, help="image side in px (FLUX.2: 64, its smallest)")
    p.add_argument("--n", type=int, default=0, help="use the first N held-out contexts (0 = all)")
    p.add_argument("--seeds", type=int, default=SEEDS, help="noise seeds per context")
    p.add_argument("--steps", type=int, default=28)
    p.add_argument("--steps_for", nargs="+", default=[], metavar="NAME=N")
    p.add_argument("--guidance", type=float, default=1.0, help="FLUX guidance (Kontext models)")
    p.add_argument("--true_cfg", nargs="+", default=[], metavar="NAME=S",
                   help="Qwen-Image-Edit models sampled with true CFG S against \" \" (the pipeline's rescale), "
                        "FLUX.2 [klein] ones against \"\"")
    p.add_argument("--neutral_sigmas", nargs="+", default=[], metavar="NAME",
                   help="models sampled with their scheduler's shift and terminal stretch off: Qwen-Image's "
                        "(shift_terminal 0.02) divides by zero at 1 step (its σ list is NaN)")
    p.add_argument("--seed", type=int, default=0, help="first noise seed (seed s of a context: SEED + 1000 s)")
    p.add_argument("--reference", default="", help="the model whose entropy is 100 %% variety (default: the first)")
    p.add_argument("--grid", default="", help="PNG grid path ('' = none)")
    p.add_argument("--json", default="")
    p.add_argument("--scored", default="", help="an earlier --json of this task at the same seeds: a row there "
                   "with the same name, folder, steps and sampling settings is read, not sampled again (a second "
                   "training seed's students beside the same teacher)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (2 crawls on shared cores)")
    args = p.parse_args(argv)
    if args.make_data:
        cfg = None if args.cfg_split is None else bool(args.cfg_split)
        for split, path in ensure_task_data(args.make_data, args.size, cfg=cfg).items():
            print(split, path)
        return 0
    models = ke.named_paths(p, args.compare)
    if not models:
        p.error("give --compare NAME=PATH ...")
    steps = {name: args.steps for name in models}
    for item in args.steps_for:
        name, _, value = item.partition("=")
        if name not in models or not value.isdigit():
            p.error(f"--steps_for wants NAME=N with NAME one of {sorted(models)}, got {item!r}")
        steps[name] = int(value)
    reference = args.reference or next(iter(models))
    true_cfg = {}
    for item in args.true_cfg:
        name, _, value = item.partition("=")
        try:
            true_cfg[name] = float(value)
        except ValueError:
            p.error(f"--true_cfg wants NAME=S, got {item!r}")
        if name not in models:
            p.error(f"--true_cfg: {name!r} is not one of {sorted(models)}")
    for name in args.neutral_sigmas:
        if name not in models:
            p.error(f"--neutral_sigmas: {name!r} is not one of {sorted(models)}")
    import torch
    torch.set_num_threads(args.threads)
    rows = ke.load_rows(ensure_task_data(args.task_dir, args.size)["heldout"])
    rows = rows[:args.n] if args.n else rows
    settings = {name: {"folder": models[name], "steps": steps[name], "guidance": args.guidance,
                       "true_cfg": true_cfg.get(name, 1.0), "neutral": name in args.neutral_sigmas}
                for name in models}
    scored = read_scored(p, args.scored, settings, args.seeds, args.seed, len(rows)) if args.scored else {}
    results, outputs = {}, {}
    for name, folder in models.items():
        if name in scored:
            results[name] = scored[name]
            print(f"{name}: {folder} ({steps[name]} steps) read from {args.scored}", file=sys.stderr)
            continue
        t0 = time.time()
        results[name], outputs[name] = evaluate(rows=rows, seeds=args.seeds, seed0=args.seed, **settings[name])
        print(f"{name}: {folder} ({steps[name]} steps) evaluated in {time.time() - t0:.1f}s", file=sys.stderr)
    print(markdown_table(results, steps, reference))
    for name in results:
        if name != reference:
            at_counts = variety_at_counts(results[name]["valid_colours"], results[reference]["valid_colours"])
            print(f"{name}: variety at equal counts {at_counts:.0f} % of {reference}'s (both rarefied to the "
                  "smaller count of valid outputs in each context); saturation error "
                  f"{abs(results[name]['saturation'] - results[reference]['saturation']):.1f} points")
    if args.grid:
        save_grid([ke.load_rgb(r["image"]) for r in rows], outputs, args.grid, min(6, len(rows)), min(4, args.seeds))
        print(f"\ngrid: {args.grid} (per row: context | {' | '.join(outputs)}, 4 seeds each)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"models": models, "steps": steps, "guidance": args.guidance,
                                               "true_cfg": true_cfg, "settings": settings,
                                               "seeds": args.seeds, "seed": args.seed, "reference": reference,
                                               "contexts": len(rows), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
