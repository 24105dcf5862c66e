"""Editing rows by shape: resolution buckets, the shape of every row (its target's bucket and its
references' sizes, by its family's rule), one shape per global batch drawn from seeded epochs, and a
micro-batch's images loaded as the family's pipeline reads them. Both editing scripts read their
rows through here: train_flux_kontext.py's fine-tuning and train_dmd.py's flow-matching teachers.

    python -m pytest tests/test_data.py -q -k "bucket or pairs"
"""
from __future__ import annotations

import math

import torch

from data.batches import global_batch_indices
from data.images import image_size, load_image
from data.randomness import BUCKET_STREAM, step_generator


def make_buckets(resolution, aspects, multiple) -> list[tuple[int, int]]:
    """(h, w) sizes of about resolution^2 pixels for each width/height ratio, both sides multiples
    of `multiple` (VAE factor x 2, so the latents pack 2x2); duplicates dropped, in ratio order."""
    buckets = []
    for a in sorted(aspects):
        w = max(multiple, round(math.sqrt(resolution**2 * a) / multiple) * multiple)
        h = max(multiple, round(math.sqrt(resolution**2 / a) / multiple) * multiple)
        if (h, w) not in buckets:
            buckets.append((h, w))
    return buckets


def nearest_bucket(height, width, buckets) -> int:
    """Index of the bucket whose aspect ratio is closest (in log space) to height x width."""
    return min(range(len(buckets)),
               key=lambda i: abs(math.log(width / height) - math.log(buckets[i][1] / buckets[i][0])))


def row_size(row) -> tuple[int, int] | None:
    """(h, w) of a row's image as shown (EXIF orientation applied): the "size" read_rows measured, else
    the target's (a row without one: its first reference's) header; None for a prompt alone."""
    if row.get("size"):
        return row["size"]
    source = row.get("target", row.get("control"))
    return image_size(source) if source is not None else None


def assign_buckets(rows, buckets) -> list[int]:
    """Bucket of each row, from row_size (a prompt alone: the square bucket's, or the nearest to it)."""
    return [nearest_bucket(*(row_size(row) or (1, 1)), buckets) for row in rows]


def references(row) -> list:
    """A row's reference images (data.sources: "controls" with several, else its one "control"; none
    for a prompt alone)."""
    return row.get("controls") or ([row["control"]] if "control" in row else [])


def row_shapes(room, rows, buckets, settings, seeded: bool = True) -> tuple[list[tuple], list[int]]:
    """(shapes, shape of each row): a shape is (target size, (each reference's size)), the target's
    from its bucket, the references' by the room's rule (room.target_size, room.reference_sizes).
    seeded: a room whose references follow the target (FLUX: the context at the target's size) has
    one shape per bucket, in bucket order, used or not (fine-tuning numbers its buckets so); else the
    shapes are numbered in order of first appearance (DMD2: one shape, the first, for a square run)."""
    shapes, shape_of = [], []
    if seeded:
        shapes = [s for s in ((b, room.reference_sizes(b, None, settings)) for b in buckets) if s[1] is not None]
    for row, b in zip(rows, assign_buckets(rows, buckets)):
        shape = (room.target_size(buckets[b], row, settings), room.reference_sizes(buckets[b], row, settings))
        if shape not in shapes:
            shapes.append(shape)
        shape_of.append(shapes.index(shape))
    return shapes, shape_of


def bucket_schedule(bucket_of, steps, seed) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """Which bucket each step draws its whole global batch from.

    Returns (members, schedule): members[b] = dataset indices in bucket b; schedule[step] =
    (b, k) with k = how many earlier steps used b. Step s picks b with probability proportional to
    the bucket's size, drawn from step_generator(seed, s): a pure function of (seed, step), so it is
    the same on every rank, at any world size, and after a resume."""
    n_buckets = max(bucket_of) + 1
    members = [[i for i, b in enumerate(bucket_of) if b == k] for k in range(n_buckets)]
    weights = torch.tensor([len(m) for m in members], dtype=torch.float64)
    used, schedule = [0] * n_buckets, []
    for step in range(steps):
        if (weights > 0).sum() == 1:
            b = int(weights.argmax())
        else:
            b = int(torch.multinomial(weights, 1, generator=step_generator(seed, step, BUCKET_STREAM)))
        schedule.append((b, used[b]))
        used[b] += 1
    return members, schedule


def step_indices(step, members, schedule, global_batch, seed) -> list[int]:
    """Dataset indices of the global batch of `step`: the k-th batch of its bucket, from that
    bucket's own seeded epochs (data.batches.global_batch_indices)."""
    b, k = schedule[step]
    local = global_batch_indices(k, global_batch, len(members[b]), seed + 1000 * b)
    return [members[b][i] for i in local]


def step_flips(seed, step, global_batch, random_flip) -> torch.Tensor:
    """The step's horizontal flips (G,) for the whole global batch, on CPU (the images are loaded
    there), from step_generator(seed, step): a function of (SEED, step) only."""
    g = step_generator(seed, step, 0)
    return (torch.rand(global_batch, generator=g) < 0.5) & random_flip


def mirrored_rows(rows, flips) -> list[dict]:
    """The rows as a flipped sample's text is keyed: with "mirror" where `flips` mirrors its images (a
    family whose text encoder reads them caches that text apart: families/qwen_image.text_key)."""
    flips = flips.tolist() if torch.is_tensor(flips) else flips  # CPU data: no device sync
    return [{**r, "mirror": True} if f else r for r, f in zip(rows, flips)]


def stretched(source, size, mirror, role) -> torch.Tensor:
    """An image as FLUX.1 Kontext's and Qwen-Image-Edit's pipelines read it: stretched to its size (their
    image processor's resize, Lanczos), mirrored first with `mirror`; `role`: "target" or "reference"."""
    return load_image(source, *size, stretch=True, mirror=mirror)


def load_pairs(rows, shape, flips, target: bool = True, loader=None) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Reference batches [(B, 3, h, w) per reference] and the target batch (B, 3, h, w) (None with
    target=False) of rows of one shape, each image read as the family's pipeline reads it (`loader`, the
    room's image_loader; None: stretched), a flipped sample's images all mirrored first."""
    loader = loader or stretched
    size, sizes = shape
    refs, targets = [[] for _ in sizes], []
    for row, flip in zip(rows, flips.tolist() if torch.is_tensor(flips) else flips):  # CPU data: no device sync
        for j, (c, s) in enumerate(zip(references(row), sizes)):
            refs[j].append(loader(c, s, flip, "reference"))
        if target:
            targets.append(loader(row["target"], size, flip, "target"))
    return [torch.stack(r) for r in refs], torch.stack(targets) if target else None
