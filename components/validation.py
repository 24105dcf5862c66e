"""DMD2's validation: is the student learning, or collapsing? Fixed prompts, several seeds each; the
teacher's samples from the same noise, drawn once (cached by what they depend on, so a resume reads
them); every VAL_EVERY steps the student's, and figures that need no downloaded network:

    val_variety_ratio         the student's mean pairwise distance between a prompt's samples across seeds,
                              over the teacher's (pixels): near 1 healthy, towards 0 a student whose seeds
                              give one image (mode collapse; FastVideo's near-solid frames, the palette
                              demos' students on one colour)
    val_variety_ratio_latent  the same on the VAE latents the samples decode from
    val_teacher_distance      RMS distance (pixels in [-1, 1]) of each student sample from the teacher's
                              from the same noise: how far the student's noise-to-image map strays
    val_saturation_drift      the student's mean HSV saturation minus the teacher's: washed out < 0,
                              over-saturated > 0
    val_colour_drift          the distance between the two mean RGB colours (in [0, 1] units)

and a grid per validation (each row one prompt: the teacher's seeds, then the student's). A variety
ratio fallen below COLLAPSE_WARN times its best so far in the run prints one warning line naming the step and
the figures (an absolute floor cannot tell a collapsing student from a healthy one's first steps: on the shapes
demo a healthy run started at 0.62 and rose to 0.83, one collapsing onto a colour fell from 1.16 to 0.64, and a
run at the wrong CFG stayed near 0.71; docs/dmd2.md); with COLLAPSE_STOP the
run stops there (core/errors.RunError: one line, exit 1 on every rank), keeping the checkpoints saved
before it: this step's is not written, a save still in flight is finished first.

    python -m pytest tests/test_validation.py -q
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from typing import Callable

import torch

from core.dist import broadcast_from_rank0, print0, rank
from core.errors import RunError
from data.images import save_image_grid


def pairwise_variety(x: torch.Tensor) -> torch.Tensor:
    """(P, S, ...) samples, S seeds of each of P prompts -> (P,) the mean RMS distance (per element) over
    each prompt's S·(S-1)/2 pairs of seeds, in float64."""
    p, s = x.shape[:2]
    if s < 2:
        raise ValueError(f"variety needs 2 or more seeds per prompt, got {s}")
    flat = x.reshape(p, s, -1).double()
    d = torch.cdist(flat, flat) / math.sqrt(flat.shape[-1])
    i, j = torch.triu_indices(s, s, 1)
    return d[:, i, j].mean(1)


def saturation(images: torch.Tensor) -> torch.Tensor:
    """(..., 3, H, W) in [-1, 1] -> (...) the mean HSV saturation, (max - min) / max per pixel."""
    rgb = ((images.double() + 1) / 2).clamp(0, 1)
    hi, lo = rgb.amax(-3), rgb.amin(-3)
    return ((hi - lo) / hi.clamp_min(1e-6)).mean((-2, -1))


def figures(student: list, teacher: list, student_latents: list, teacher_latents: list) -> dict[str, float]:
    """The logged figures of one validation: per prompt, its seeds' pixels (S, 3, H, W) in [-1, 1] and latents
    (S, ...) of the student and of the teacher from the same noise (prompts may differ in size)."""
    for a, b in zip(student, teacher, strict=True):
        if a.shape != b.shape:
            raise ValueError(f"student samples {tuple(a.shape)} vs teacher {tuple(b.shape)}")

    def variety(side):
        return torch.stack([pairwise_variety(x[None])[0] for x in side]).mean()

    def mean_rgb(side):
        return torch.cat([((x.double() + 1) / 2).clamp(0, 1).flatten(2) for x in side], 2).mean((0, 2))
    squares = torch.cat([(a.double() - b.double()).square().flatten() for a, b in zip(student, teacher)])
    return {
        "val_variety_ratio": float(variety(student) / variety(teacher)),
        "val_variety_ratio_latent": float(variety(student_latents) / variety(teacher_latents)),
        "val_teacher_distance": float(squares.mean().sqrt()),
        "val_saturation_drift": float(torch.cat([saturation(x) for x in student]).mean()
                                      - torch.cat([saturation(x) for x in teacher]).mean()),
        "val_colour_drift": float((mean_rgb(student) - mean_rgb(teacher)).norm()),
    }


def save_grid(student: list, teacher: list, path: str) -> None:
    """Each row one prompt: its seeds' teacher samples, then the student's from the same noise (smaller
    prompts padded to the largest)."""
    hmax, wmax = max(x.shape[-2] for x in teacher), max(x.shape[-1] for x in teacher)
    tiles = [torch.nn.functional.pad(x, (0, wmax - x.shape[-1], 0, hmax - x.shape[-2]), value=-1)
             for t, s in zip(teacher, student) for x in (*t, *s)]
    save_image_grid(torch.stack(tiles), path, nrow=2 * teacher[0].shape[0])


def reference_key(identity: dict) -> str:
    """A short hash of everything the teacher's samples depend on (folders, LoRA, rows, seeds, steps,
    guidance, sizes, dtypes): the cache file's name."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass
class Samples:
    """One side's validation samples on rank 0 (None elsewhere), per prompt: pixels (S, 3, H, W), latents (S, ...)."""
    pixels: list | None
    latents: list | None


class Validator:
    """Runs on every rank (the samplers are collectives over the sharded models); rank 0 decodes, scores,
    writes the grid and the teacher's cache; the figures reach every rank, so that COLLAPSE_STOP stops
    them all at the same step.

    `teacher()` / `student()` -> Samples, with the same prompts, seeds and noise; `folder`: where the grids
    and the teacher's cache go (OUTPUT_DIR/validation, shared by every rank)."""

    def __init__(self, teacher: Callable[[], Samples], student: Callable[[], Samples], folder: str,
                 identity: dict, warn: float, stop: bool, before_stop: Callable[[], None] = lambda: None,
                 floor: float = 0.0):
        self.student, self.folder, self.warn, self.stop, self.before_stop = student, folder, warn, stop, before_stop
        self.floor = floor  # COLLAPSE_FLOOR: a ratio under it warns whatever came before
        self.best = 0.0  # the run's best variety ratio so far (a resume sets it from its checkpoint: val_best)
        self.cache = os.path.join(folder, f"teacher_{reference_key(identity)}.pt")
        self._teacher_fn, self.reference = teacher, None

    def teacher(self) -> Samples:
        """The teacher's samples: from the cache where a run with the same identity wrote them, else drawn
        now (every rank) and written by rank 0."""
        if self.reference is None:
            cached = broadcast_from_rank0(os.path.isfile(self.cache) if rank() == 0 else None)
            if cached:
                ref = torch.load(self.cache, weights_only=True) if rank() == 0 else None
                self.reference = Samples(ref["pixels"], ref["latents"]) if ref else Samples(None, None)
                print0(f"validation: the teacher's samples from {self.cache}")
            else:
                self.reference = self._teacher_fn()
                if rank() == 0:
                    os.makedirs(self.folder, exist_ok=True)
                    tmp = self.cache + ".partial"
                    torch.save({"pixels": [x.cpu() for x in self.reference.pixels],
                                "latents": [x.cpu() for x in self.reference.latents]}, tmp)
                    os.replace(tmp, self.cache)
        return self.reference

    def __call__(self, step: int) -> dict[str, float]:
        """The step's figures (every rank), its grid (rank 0), and the collapse warning or stop."""
        reference = self.teacher()
        mine = self.student()
        out = None
        if rank() == 0:
            out = figures(mine.pixels, reference.pixels, mine.latents, reference.latents)
            save_grid(mine.pixels, reference.pixels, os.path.join(self.folder, f"step_{step:06d}.png"))
        out = broadcast_from_rank0(out)
        ratio = out["val_variety_ratio"]
        self.best = max(self.best, ratio)
        fell, low = self.warn > 0 and ratio < self.warn * self.best, self.floor > 0 and ratio < self.floor
        if fell or low:
            why = (f"down from {self.best:.3f} (COLLAPSE_WARN={self.warn}: below {self.warn} of its best)" if fell else
                   f"under COLLAPSE_FLOOR={self.floor}")
            line = (f"collapse warning at step {step}: the student's variety across seeds is {ratio:.3f} of the "
                    f"teacher's, {why}; colour drift {out['val_colour_drift']:.3f}; "
                    f"grid: {self.folder}/step_{step:06d}.png")
            if self.stop:  # every rank has the same figures: all stop here, together
                self.before_stop()
                raise RunError(f"{line}; COLLAPSE_STOP=1: stopped before this step's checkpoint")
            print0(line)
        return out
