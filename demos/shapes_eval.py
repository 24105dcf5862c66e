"""The coloured-shapes task of the DMD2 demo: its data, and an evaluation of models on it.

The task (shared with `demos/make_teacher.py`, which trains the shipped teacher on it): 32x32 px
images of one filled shape (circle, square, triangle) in one of 4 colours on a plain background of
one of 3 colours, at a random position and size (side 12..20 px), captioned
"a red circle on a white background" -> 4 x 3 x 3 = 36 prompts: a corner of the coloured-shapes
world of `tools/shapes.py`, whose `draw_shape` draws the pixels (PIL, no anti-aliasing).

Evaluation of a diffusers SD-1.5-layout folder (the teacher, or a DMD2 export) with a sampler:
N = len(prompts) x seeds images from fixed noise, scored on

(a) prompt adherence, read from pixels by `analyse_image`:
    background = the named colour (of all 10 in shapes.COLOURS) nearest to the median of
    the ring of pixels 1..2 px from the edge; foreground = the largest 4-connected component of
    pixels farther than FG_THRESHOLD (RGB, 0..255) from that measured background colour;
    colour = the named colour nearest to the median RGB of its core pixels; shape = nearest
    prototype in (fill ratio of the bounding box, fraction of the area in the box's upper half)
    of the half-level mask: square (1, 1/2), circle (pi/4, 1/2), triangle (1/2, 1/4) - the
    triangle's apex is up. A component smaller than MIN_AREA px is "none" (counts as wrong).
    Accuracies: colour, shape, background, and all three at once.
(b) distribution match to real data: the Frechet distance between Gaussian fits of per-image
    features of the generated set and of a real set (rendered images of the
    same prompts, REAL_PER_PROMPT each, fixed seed). Features (53-d, `image_features`), each
    standardised by the real set's mean and std so that no group dominates by scale:
      - 13 descriptors from `analyse_image`: background RGB, foreground RGB, foreground area
        fraction, fill ratio, upper-half fraction, box centre x, y and box width, height (/ size);
      - an 8-bin colour histogram (each RGB channel split at 128; each of the task's 7 colours
        falls in a bin of its own), fractions of pixels;
      - a 32-d embedding by a fixed random conv net (3 convs, ReLU, global average pool; weights
        drawn from torch.Generator seed 0, Kaiming-normal), as FID's Inception in miniature.
    The "real, other draw" row (real images of other random positions/sizes, same count as the
    generated set) gives the floor that a perfect generator would reach at this sample size.
(c) diversity: the mean pairwise Euclidean distance between the standardised features of the
    images of one prompt (different seeds), averaged over prompts; real data gives the target.
    Mode collapse -> 0.

    python -m demos.shapes_eval --model=assets/shapes_teacher --sampler=ddim --steps=25 --cfg=4
    python -m demos.shapes_eval --model=assets/shapes_teacher --sampler=onestep
    python -m demos.shapes_eval --compare teacher=assets/shapes_teacher student=out/dmd/export \
        --grid=shapes_grid.png
    python -m demos.shapes_eval --compare teacher=assets/shapes_teacher stage1=out/dmd/export \
        stage2=out/dmd_gan/export four_step=out/dmd_4step/export@4

Importable: `score_images(images, prompts)`, `evaluate_components(...)` (for a training loop that
holds the UNet etc. in memory), `evaluate_folder(path, ...)`, `compare(...)`.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

import numpy as np
import torch

from tools import shapes
from tools.shapes import COLOURS, nearest_colour  # noqa: F401 - nearest_colour: part of this API

# ---------------------------------------------------------------------------------------------
# the task

IMAGE_SIZE = 32
FG_COLOURS = ("red", "green", "blue", "yellow")
BG_COLOURS = ("white", "black", "cyan")
SHAPES = ("circle", "square", "triangle")
MIN_SIDE, MAX_SIDE = IMAGE_SIZE * 3 // 8, IMAGE_SIZE * 5 // 8  # 12..20 px at 32 px (shapes.random_box)

_PROMPT_RE = re.compile(r"^an? (\w+) (\w+) on an? (\w+) background$")


def combos():
    """All (shape, colour, background) of the task, in a fixed order (36)."""
    return [(s, c, b) for c in FG_COLOURS for s in SHAPES for b in BG_COLOURS]


def prompt_for(shape: str, colour: str, background: str) -> str:
    return shapes.describe(shape, colour, background)


def all_prompts() -> list[str]:
    return [prompt_for(*c) for c in combos()]


def parse_prompt(prompt: str) -> tuple[str, str, str]:
    """'a red circle on a white background' -> ('circle', 'red', 'white')."""
    m = _PROMPT_RE.match(prompt.strip())
    if not m:
        raise ValueError(f"not a shapes prompt: {prompt!r}")
    colour, shape, background = m.groups()
    return shape, colour, background


def random_box(rng: np.random.Generator, size: int = IMAGE_SIZE) -> tuple[int, int, int, int]:
    return shapes.random_box(rng, size)


def render(shape: str, colour: str, background: str, box, size: int = IMAGE_SIZE) -> np.ndarray:
    """(size, size, 3) uint8."""
    return np.asarray(shapes.draw_shape(size, shape, COLOURS[colour], COLOURS[background], box))


def render_prompt(prompt: str, rng: np.random.Generator, size: int = IMAGE_SIZE) -> np.ndarray:
    """A real image for `prompt` at a random position and size."""
    return render(*parse_prompt(prompt), random_box(rng, size), size=size)


def sample_dataset(n: int, seed: int, size: int = IMAGE_SIZE):
    """n random (image uint8 HxWx3, prompt) pairs, combos uniform."""
    rng = np.random.default_rng(seed)
    cs = combos()
    images, prompts = [], []
    for _ in range(n):
        c = cs[int(rng.integers(len(cs)))]
        images.append(render(*c, random_box(rng, size), size=size))
        prompts.append(prompt_for(*c))
    return np.stack(images), prompts


def real_set(prompts: list[str], per_prompt: int, seed: int, size: int = IMAGE_SIZE):
    """`per_prompt` real images for each prompt (prompt-major order), and their prompt list."""
    rng = np.random.default_rng(seed)
    images, out_prompts = [], []
    for p in prompts:
        for _ in range(per_prompt):
            images.append(render_prompt(p, rng, size))
            out_prompts.append(p)
    return np.stack(images), out_prompts


# ---------------------------------------------------------------------------------------------
# reading an image

FG_THRESHOLD = 60.0  # RGB distance (0..255) from the measured background that may be foreground
MIN_AREA = 20  # px (at 32 px); the smallest real shape (a 12-px triangle) has ~72
BORDER = (1, 3)  # the background is measured on the ring of pixels 1..2 px from the edge (the
# outermost pixel is skipped: decoders often get the image edge slightly wrong)
CORE = 0.8  # foreground colour = median of the component's pixels at >= CORE x its max distance
# (fill ratio of the bounding box, fraction of the area in the box's upper half); the triangle's
# apex is up, so only a quarter of its area is in the upper half
SHAPE_PROTOTYPES = {"square": (1.0, 0.5), "circle": (math.pi / 4, 0.5), "triangle": (0.5, 0.25)}
TOP_WEIGHT = 3.0  # scale of the upper-half fraction against the fill ratio in the prototype distance


def _largest_component(mask: np.ndarray) -> np.ndarray:
    """Largest 4-connected component of a boolean mask (iterative flood fill; 32x32 is cheap)."""
    h, w = mask.shape
    labels = np.zeros((h, w), dtype=np.int32)
    best, best_size, current = 0, 0, 0
    for y0, x0 in zip(*np.nonzero(mask)):
        if labels[y0, x0]:
            continue
        current += 1
        labels[y0, x0] = current
        stack, count = [(y0, x0)], 0
        while stack:
            y, x = stack.pop()
            count += 1
            for yy, xx in ((y - 1, x), (y + 1, x), (y, x - 1), (y, x + 1)):
                if 0 <= yy < h and 0 <= xx < w and mask[yy, xx] and not labels[yy, xx]:
                    labels[yy, xx] = current
                    stack.append((yy, xx))
        if count > best_size:
            best, best_size = current, count
    return labels == best if best else np.zeros_like(mask)


def classify_shape(fill: float, top: float) -> str:
    """Nearest prototype in (fill ratio, TOP_WEIGHT x upper-half fraction)."""
    def dist(proto):
        return (fill - proto[0]) ** 2 + (TOP_WEIGHT * (top - proto[1])) ** 2
    return min(SHAPE_PROTOTYPES, key=lambda s: dist(SHAPE_PROTOTYPES[s]))


def analyse_image(image: np.ndarray) -> dict:
    """Read background colour, foreground colour and shape from an (H, W, 3) uint8 image.

    1. background RGB = median of the border ring; 2. candidate foreground = largest 4-connected
    component of pixels > FG_THRESHOLD from it; its colour = median of its core (pixels at
    >= CORE x the component's largest distance), so blurred edges do not shift it; 3. the shape
    mask = largest component of pixels beyond half the fg-bg distance (the half-level contour is
    where a symmetric blur leaves the true edge), read as (fill ratio, upper-half fraction).
    """
    img = np.asarray(image, dtype=np.float64)
    h, w, _ = img.shape
    ring = np.zeros((h, w), dtype=bool)
    a, b = BORDER
    ring[a:h - a, a:w - a] = True
    ring[b:h - b, b:w - b] = False
    bg_rgb = np.median(img[ring], axis=0)
    dist = np.sqrt(((img - bg_rgb) ** 2).sum(axis=-1))
    out = {"background": nearest_colour(bg_rgb), "bg_rgb": bg_rgb}
    none = dict(colour="none", shape="none", fg_rgb=bg_rgb, area=0.0, fill=0.0, top=0.0,
                box=(0.5, 0.5, 0.0, 0.0))
    min_area = MIN_AREA * (h * w) / (32 * 32)
    comp = _largest_component(dist > FG_THRESHOLD)
    if comp.sum() < min_area:
        return {**out, **none}
    d = dist[comp]
    fg_rgb = np.median(img[comp][d >= CORE * d.max()], axis=0)
    contrast = float(np.sqrt(((fg_rgb - bg_rgb) ** 2).sum()))
    comp = _largest_component(dist > 0.5 * contrast)
    area = int(comp.sum())
    if area < min_area:
        return {**out, **none}
    ys, xs = np.nonzero(comp)
    bh, bw = ys.max() - ys.min() + 1, xs.max() - xs.min() + 1
    fill = area / float(bh * bw)
    mid = (ys.min() + ys.max()) / 2
    top = ((ys < mid).sum() + 0.5 * (ys == mid).sum()) / area
    out.update(colour=nearest_colour(fg_rgb), shape=classify_shape(fill, top), fg_rgb=fg_rgb,
               area=area / (h * w), fill=fill, top=top,
               box=((xs.min() + xs.max() + 1) / 2 / w, (ys.min() + ys.max() + 1) / 2 / h, bw / w, bh / h))
    return out


# ---------------------------------------------------------------------------------------------
# features, Frechet distance, diversity

_EMBED_NET = None


def _embed_net() -> torch.nn.Module:
    """The fixed random conv net of the feature set (seeded by its own generator)."""
    global _EMBED_NET
    if _EMBED_NET is None:
        g = torch.Generator().manual_seed(0)
        convs = [torch.nn.Conv2d(3, 16, 5, stride=2, padding=2), torch.nn.Conv2d(16, 32, 3, stride=2, padding=1),
                 torch.nn.Conv2d(32, 32, 3, stride=2, padding=1)]
        layers = []
        for conv in convs:
            fan_in = conv.in_channels * conv.kernel_size[0] * conv.kernel_size[1]
            with torch.no_grad():
                conv.weight.copy_(torch.randn(conv.weight.shape, generator=g) * math.sqrt(2.0 / fan_in))
                conv.bias.copy_(torch.randn(conv.bias.shape, generator=g) * 0.1)
            layers += [conv, torch.nn.ReLU()]
        layers += [torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten()]
        _EMBED_NET = torch.nn.Sequential(*layers).eval().requires_grad_(False)
    return _EMBED_NET


def descriptor(a: dict) -> np.ndarray:
    """13 numbers from `analyse_image`'s result."""
    return np.concatenate([np.asarray(a["bg_rgb"]) / 255.0, np.asarray(a["fg_rgb"]) / 255.0,
                           [a["area"], a["fill"], a["top"]], np.asarray(a["box"], dtype=np.float64)])


def image_features(images: np.ndarray, analyses: list[dict] | None = None) -> np.ndarray:
    """(N, 53) raw features of (N, H, W, 3) uint8 images (see the module docstring)."""
    images = np.asarray(images)
    if analyses is None:
        analyses = [analyse_image(im) for im in images]
    desc = np.stack([descriptor(a) for a in analyses])
    bits = (images >= 128).astype(np.int64)
    codes = bits[..., 0] * 4 + bits[..., 1] * 2 + bits[..., 2]
    hist = np.stack([np.bincount(c.ravel(), minlength=8) for c in codes]) / float(codes[0].size)
    with torch.no_grad():
        x = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1.0
        emb = torch.cat([_embed_net()(chunk) for chunk in x.split(256)]).double().numpy()
    return np.concatenate([desc, hist, emb], axis=1)


STD_FLOOR = 0.02  # raw features are O(0.1..1); a dimension constant in real data (the magenta
# histogram bin) would otherwise turn any deviation into a huge distance


class FeatureSpace:
    """Standardisation by a reference (real) feature set: z = (f - mean) / max(std, STD_FLOOR)."""

    def __init__(self, reference: np.ndarray):
        self.mean = reference.mean(axis=0)
        self.std = np.maximum(reference.std(axis=0), STD_FLOOR)

    def __call__(self, feats: np.ndarray) -> np.ndarray:
        return (feats - self.mean) / self.std


def _sqrtm_psd(a: np.ndarray) -> np.ndarray:
    w, v = np.linalg.eigh((a + a.T) / 2)
    return (v * np.sqrt(np.clip(w, 0, None))) @ v.T


def frechet_distance(f1: np.ndarray, f2: np.ndarray) -> float:
    """||mu1 - mu2||^2 + tr(S1 + S2 - 2 (S1^1/2 S2 S1^1/2)^1/2) of two (N, D) feature sets."""
    mu1, mu2 = f1.mean(axis=0), f2.mean(axis=0)
    s1, s2 = np.cov(f1, rowvar=False), np.cov(f2, rowvar=False)
    r1 = _sqrtm_psd(s1)
    cross = np.linalg.eigvalsh((r1 @ s2 @ r1 + (r1 @ s2 @ r1).T) / 2)
    fd = ((mu1 - mu2) ** 2).sum() + np.trace(s1) + np.trace(s2) - 2 * np.sqrt(np.clip(cross, 0, None)).sum()
    return float(max(fd, 0.0))


def diversity(feats: np.ndarray, prompts: list[str]) -> float:
    """Mean pairwise Euclidean feature distance within each prompt, averaged over prompts."""
    groups: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(p, []).append(i)
    values = []
    for idx in groups.values():
        if len(idx) < 2:
            continue
        f = feats[idx]
        d = np.sqrt(((f[:, None, :] - f[None, :, :]) ** 2).sum(-1))
        values.append(d[np.triu_indices(len(idx), 1)].mean())
    return float(np.mean(values)) if values else float("nan")


# ---------------------------------------------------------------------------------------------
# scoring

REAL_PER_PROMPT = 32
REAL_SEED = 1234


class Reference:
    """The real set of the evaluation prompts, its feature space and its own scores."""

    def __init__(self, prompts: list[str], per_prompt: int = REAL_PER_PROMPT, seed: int = REAL_SEED,
                 size: int = IMAGE_SIZE):
        self.prompts = list(prompts)
        self.images, self.image_prompts = real_set(self.prompts, per_prompt, seed, size)
        self.raw = image_features(self.images)
        self.space = FeatureSpace(self.raw)
        self.feats = self.space(self.raw)
        self.size = size


def score_images(images: np.ndarray, prompts: list[str], reference: Reference | None = None) -> dict:
    """Adherence (percent), Frechet distance and diversity of (N, H, W, 3) uint8 images made for
    `prompts` (one per image). `reference` defaults to the real set of the distinct prompts."""
    images = np.asarray(images)
    if reference is None:
        reference = Reference(list(dict.fromkeys(prompts)), size=images.shape[1])
    analyses = [analyse_image(im) for im in images]
    wanted = [parse_prompt(p) for p in prompts]
    ok = {"colour": [], "shape": [], "background": [], "all": []}
    for a, (shape, colour, bg) in zip(analyses, wanted):
        c, s, b = a["colour"] == colour, a["shape"] == shape, a["background"] == bg
        ok["colour"].append(c)
        ok["shape"].append(s)
        ok["background"].append(b)
        ok["all"].append(c and s and b)
    feats = reference.space(image_features(images, analyses))
    result = {f"{k}_acc": 100.0 * float(np.mean(v)) for k, v in ok.items()}
    result["fd"] = frechet_distance(feats, reference.feats)
    result["diversity"] = diversity(feats, prompts)
    result["real_diversity"] = diversity(reference.feats, reference.image_prompts)
    result["n"] = len(images)
    return result


# ---------------------------------------------------------------------------------------------
# sampling

def load_components(path: str, device="cpu"):
    """(unet, vae, text_encoder, tokenizer, scheduler) from an SD-1.5-layout folder, fp32, eval."""
    from diffusers import AutoencoderKL, DDIMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    unet = UNet2DConditionModel.from_pretrained(path, subfolder="unet", torch_dtype=torch.float32)
    vae = AutoencoderKL.from_pretrained(path, subfolder="vae", torch_dtype=torch.float32)
    text_encoder = CLIPTextModel.from_pretrained(path, subfolder="text_encoder", dtype=torch.float32)
    tokenizer = CLIPTokenizer.from_pretrained(path, subfolder="tokenizer")
    scheduler = DDIMScheduler.from_pretrained(path, subfolder="scheduler")
    for m in (unet, vae, text_encoder):
        m.to(device).eval().requires_grad_(False)
    return unet, vae, text_encoder, tokenizer, scheduler


@torch.no_grad()
def encode_text(tokenizer, text_encoder, prompts: list[str]) -> torch.Tensor:
    ids = tokenizer(prompts, padding="max_length", max_length=tokenizer.model_max_length,
                    truncation=True, return_tensors="pt").input_ids.to(text_encoder.device)
    return text_encoder(ids).last_hidden_state.float()


def eval_noise(n: int, shape: tuple, seed: int) -> torch.Tensor:
    """The fixed initial noise of the evaluation (same for every model compared)."""
    return torch.randn((n, *shape), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def sample_latents(unet, scheduler, cond, uncond, noise, sampler="ddim", steps=25, cfg=1.0,
                   batch=96, seed=0):
    """Latents (scaled, as the UNet sees them) from `noise`.

    ddim: the scheduler's DDIM (eta 0) over `steps` steps, CFG eps_u + cfg (eps_c - eps_u) when
    cfg != 1. onestep: x0 = (z - sqrt(1 - a) eps) / sqrt(a) at t = 999 (the DMD2 generator's
    sampler; for a teacher the 1-step baseline). fewstep: DMD2's multi-step sampling with
    algorithms.dmd2.denoising_step_list(steps), re-noising each x0 with fresh noise.
    """
    from algorithms import dmd2 as dm
    from diffusers import DDIMScheduler

    dtype = next(unet.parameters()).dtype
    device = noise.device
    alphas = scheduler.alphas_cumprod.to(device)

    def eps(z, t, c):
        if cfg == 1.0:
            return dm.predict_eps(unet, z.to(dtype), t, c.to(dtype))
        u = uncond.expand(c.shape[0], *uncond.shape[1:])
        e_u, e_c = dm.predict_eps(unet, torch.cat([z, z]).to(dtype), t,
                                  torch.cat([u, c]).to(dtype)).chunk(2)
        return e_u + cfg * (e_c - e_u)

    out = []
    gen = torch.Generator().manual_seed(seed + 1)
    for z, c in zip(noise.split(batch), cond.split(batch)):
        if sampler == "ddim":
            sched = DDIMScheduler.from_config(scheduler.config)
            sched.set_timesteps(steps)
            for t in sched.timesteps:
                z = sched.step(eps(z, int(t), c), t, z, eta=0.0).prev_sample
        elif sampler in ("onestep", "fewstep"):
            ts = [999] if sampler == "onestep" else dm.denoising_step_list(steps)
            for i, t in enumerate(ts):
                x0 = dm.x0_from_eps(z, eps(z, t, c), t, alphas, out_dtype=torch.float32)
                if i + 1 < len(ts):
                    fresh = torch.randn(x0.shape, generator=gen).to(device)
                    z = dm.add_noise(x0, fresh, ts[i + 1], alphas, out_dtype=torch.float32)
            z = x0
        else:
            raise ValueError(f"unknown sampler {sampler!r} (ddim, onestep, fewstep)")
        out.append(z.float())
    return torch.cat(out)


@torch.no_grad()
def decode(vae, latents: torch.Tensor, batch: int = 96) -> np.ndarray:
    """Scaled latents -> (N, H, W, 3) uint8."""
    out = [shapes.to_uint8(vae.decode((z / vae.config.scaling_factor).to(vae.dtype)).sample.float())
           for z in latents.split(batch)]
    # C order: the feature net's conv (image_features) rounds differently on other memory layouts,
    # and the published scores were computed on C-ordered images
    return np.ascontiguousarray(np.concatenate(out))


def generate(unet, vae, text_encoder, tokenizer, scheduler, prompts: list[str], seeds: int,
             sampler="ddim", steps=25, cfg=1.0, noise_seed=0):
    """`seeds` images per prompt (prompt-major), (images uint8, prompts, seconds per image)."""
    image_prompts = [p for p in prompts for _ in range(seeds)]
    shape = (unet.config.in_channels, unet.config.sample_size, unet.config.sample_size)
    device = next(unet.parameters()).device
    noise = eval_noise(len(image_prompts), shape, noise_seed).to(device)
    start = time.perf_counter()
    cond_unique = encode_text(tokenizer, text_encoder, prompts)
    cond = cond_unique.repeat_interleave(seeds, dim=0)
    uncond = encode_text(tokenizer, text_encoder, [""])
    latents = sample_latents(unet, scheduler, cond, uncond, noise, sampler, steps, cfg, seed=noise_seed)
    images = decode(vae, latents)
    seconds = (time.perf_counter() - start) / len(image_prompts)
    return images, image_prompts, seconds


def evaluate_components(unet, vae, text_encoder, tokenizer, scheduler, sampler="ddim", steps=25,
                        cfg=1.0, seeds=8, prompts=None, reference=None, noise_seed=0):
    """Generate and score; returns (metrics dict, images, image prompts)."""
    prompts = list(prompts or all_prompts())
    images, image_prompts, seconds = generate(unet, vae, text_encoder, tokenizer, scheduler, prompts,
                                              seeds, sampler, steps, cfg, noise_seed)
    if reference is None:
        reference = Reference(prompts, size=images.shape[1])
    metrics = score_images(images, image_prompts, reference)
    metrics.update(sampler=sampler, steps=steps if sampler != "onestep" else 1, cfg=cfg,
                   sec_per_image=seconds)
    return metrics, images, image_prompts


def evaluate_folder(path: str, sampler="ddim", steps=25, cfg=1.0, seeds=8, prompts=None,
                    reference=None, noise_seed=0):
    parts = load_components(path)
    return evaluate_components(*parts, sampler=sampler, steps=steps, cfg=cfg, seeds=seeds,
                               prompts=prompts, reference=reference, noise_seed=noise_seed)


def real_row(reference: Reference, seeds: int, seed: int = REAL_SEED + 1) -> dict:
    """Scores of real images of another draw, `seeds` per prompt: the floor/ceiling of each metric."""
    images, prompts = real_set(reference.prompts, seeds, seed, reference.size)
    m = score_images(images, prompts, reference)
    m.update(sampler="real data (other draw)", steps=0, cfg=0.0, sec_per_image=0.0)
    return m


# ---------------------------------------------------------------------------------------------
# reporting

COLUMNS = [("colour_acc", "colour acc %", "{:.1f}"), ("shape_acc", "shape acc %", "{:.1f}"),
           ("background_acc", "background acc %", "{:.1f}"), ("all_acc", "all 3 %", "{:.1f}"),
           ("fd", "Fréchet dist ↓", "{:.2f}"), ("diversity", "diversity", "{:.2f}"),
           ("sec_per_image", "s / image", "{:.4f}")]


def markdown_table(rows: list[tuple[str, dict]], real_diversity: float | None = None) -> str:
    """rows: (name, metrics dict); a note on the real data follows when `real_diversity` is given."""
    table = shapes.md_table(["model / sampler"] + [c[1] for c in COLUMNS],
                            [[name] + [fmt.format(m[key]) for key, _, fmt in COLUMNS] for name, m in rows])
    if real_diversity is not None:
        table += (f"\n\nReal-data diversity (target): {real_diversity:.2f}; N = {rows[0][1]['n']} images "
                  f"per row, Fréchet distance against {REAL_PER_PROMPT} real images per prompt.")
    return table


def save_grid(columns: list[tuple[str, np.ndarray]], prompts: list[str], seeds: int, path: str,
              show_seeds: int = 4, max_rows: int = 36, scale: int = 2, every: int = 1) -> str:
    """PNG: one row per prompt (every `every`-th prompt); per column (a model), `show_seeds`
    images side by side, enlarged `scale` times, under the column's name."""
    rows = list(range(0, len(prompts), every))[:max_rows]
    size = columns[0][1].shape[1] * scale
    gap, label_h, left = 8, 14, 4
    col_w = show_seeds * size + gap
    labels = [(left + ci * col_w, 1, name) for ci, (name, _) in enumerate(columns)]
    tiles = [(left + ci * col_w + s * size, label_h + pi * size, images[prompt_index * seeds + s])
             for ci, (_, images) in enumerate(columns) for pi, prompt_index in enumerate(rows)
             for s in range(min(show_seeds, seeds))]
    canvas = shapes.tile_canvas(left + col_w * len(columns), label_h + len(rows) * size, (128, 128, 128),
                                tiles, scale, labels)
    return shapes.save_png(canvas, path)


def generator_runs(generators: dict[str, str]) -> list[tuple[str, str, str, int]]:
    """(label, path, sampler, steps) for --compare's generator entries NAME=PATH[@STEPS]: without
    @STEPS (or @1) the 1-step sampler at t=999, with @4 DMD2's few-step sampler over
    denoising_step_list(4) = 999/749/499/249, re-noising each x0 (the official inference)."""
    from algorithms import dmd2 as dm
    runs = []
    for name, spec in generators.items():
        path, _, n = spec.partition("@")
        n = int(n or 1)
        if n == 1:
            runs.append((f"{name}, 1 step (t=999, no CFG)", path, "onestep", 1))
        else:
            ts = "/".join(str(t) for t in dm.denoising_step_list(n))
            runs.append((f"{name}, {n} steps ({ts}, no CFG)", path, "fewstep", n))
    return runs


def compare(teacher: str, generators: dict[str, str] | str | None, steps=25, cfg=4.0, seeds=8, grid=None,
            json_out=None, prompts=None, grid_every=1):
    """The teacher (DDIM `steps` with CFG `cfg`, and its own 1-step prediction) beside each DMD2
    generator in `generators` ({name: PATH[@STEPS]}; a plain path is {"student": path}), on the
    same prompts and noise, then real data of another draw."""
    prompts = list(prompts or all_prompts())
    reference = Reference(prompts)
    if isinstance(generators, str):
        generators = {"student": generators}
    runs = [("teacher, %d-step DDIM, CFG %g" % (steps, cfg), teacher, "ddim", steps, cfg),
            ("teacher, 1 step (t=999, no CFG)", teacher, "onestep", 1, 1.0)]
    runs += [(label, path, sampler, n, 1.0) for label, path, sampler, n in generator_runs(generators or {})]
    rows, columns, image_prompts = [], [], None
    parts_cache = {}
    for name, path, sampler, n_steps, scale in runs:
        if path not in parts_cache:
            parts_cache[path] = load_components(path)
        m, images, image_prompts = evaluate_components(*parts_cache[path], sampler=sampler, steps=n_steps,
                                                       cfg=scale, seeds=seeds, prompts=prompts,
                                                       reference=reference)
        print(f"{name}: " + json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in m.items()}),
              flush=True)
        rows.append((name, m))
        columns.append((f"{name.split(',')[0]} {n_steps}-step", images))
    rows.append(("real data (other draw)", real_row(reference, seeds)))
    table = markdown_table(rows, rows[0][1]["real_diversity"])
    print(table)
    if grid:
        save_grid(columns, prompts, seeds, grid, every=grid_every)
        print(f"grid: {grid}")
    if json_out:
        Path(json_out).write_text(json.dumps([{"name": n, **m} for n, m in rows], indent=1))
    return rows, table


def quiet() -> None:
    """Drop the diffusers/transformers chatter (accelerate hint, loading bars), and first the import
    noise the training scripts silence too (torchao's CPU-build kernel libraries, pytree notices)."""
    from components.warnings import quiet_known_warnings
    quiet_known_warnings()
    import diffusers
    import transformers
    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def main(argv=None):
    quiet()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="SD-1.5-layout diffusers folder")
    ap.add_argument("--sampler", default="ddim", choices=("ddim", "onestep", "fewstep"))
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--cfg", type=float, default=None, help="CFG scale (default 4 for ddim, 1 otherwise)")
    ap.add_argument("--seeds", type=int, default=8, help="images per prompt")
    ap.add_argument("--compare", nargs="+", metavar="NAME=PATH",
                    help="teacher=PATH, then DMD2 generators NAME=PATH (1 step) or NAME=PATH@4 (4 steps)")
    ap.add_argument("--grid", default=None, help="PNG path for the image grid")
    ap.add_argument("--grid_every", type=int, default=1,
                    help="grid rows: every n-th prompt (5: shapes, colours and backgrounds all vary)")
    ap.add_argument("--json_out", default=None)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.compare:
        paths = dict(item.split("=", 1) for item in args.compare)
        if "teacher" not in paths:
            ap.error("--compare needs teacher=PATH")
        cfg = 4.0 if args.cfg is None else args.cfg
        teacher = paths.pop("teacher")
        compare(teacher, paths, args.steps, cfg, args.seeds,
                args.grid or "shapes_grid.png", args.json_out, grid_every=args.grid_every)
        return
    if not args.model:
        ap.error("--model or --compare is required")
    cfg = args.cfg if args.cfg is not None else (4.0 if args.sampler == "ddim" else 1.0)
    prompts = all_prompts()
    reference = Reference(prompts)
    m, images, _ = evaluate_folder(args.model, args.sampler, args.steps, cfg, args.seeds, prompts, reference)
    label = f"{args.model}, {args.sampler}" + (f" {args.steps} steps" if args.sampler != "onestep" else "") + \
        (f", CFG {cfg:g}" if cfg != 1 else "")
    print(markdown_table([(label, m), ("real data (other draw)", real_row(reference, args.seeds))],
                         m["real_diversity"]))
    if args.grid:
        save_grid([(label, images)], prompts, args.seeds, args.grid)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(m, indent=1))


if __name__ == "__main__":
    sys.exit(main())
