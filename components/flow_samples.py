"""The sample grids of DMD2 with a flow teacher (train_dmd.py's SAMPLE_EVERY): the fixed inputs, per sample shape in
order of first appearance (its rows' text and references, the noise of the whole σ list, drawn once on the host),
and the grid every rank's sharded generator makes of them, which rank 0 decodes and writes.

    python -m pytest tests/test_train_dmd.py -q
"""
from __future__ import annotations

import torch

import fsdp_utils
from algorithms import dmd2_flow as flow_dm
from core.dist import rank as d_rank
from data.buckets import load_pairs, stretched
from data.images import save_image_grid


def sample_groups(room, rows, shapes, *, loader, grid, channels, sigmas, pack, vae, cache_dir, identity,
                  g: torch.Generator, device, edits: bool) -> list[tuple]:
    """Per sample shape: (cond, packed noise, packed re-noising draws, [(references, target)] per row; the targets,
    which only an editing grid shows, read for it alone, a clip as room.frames_tile shows it). `grid`: a target's
    latent grid from its size; the noise from `g` on the host (the same on every device), moved once."""
    groups = []
    read = loader or stretched
    tile = getattr(room, "frames_tile", None)
    for shape in dict.fromkeys(shapes):
        picked = [r for r, s in zip(rows, shapes) if s == shape]
        (h, w), latent = shape[0], (channels, *grid(shape[0]))
        refs, _ = load_pairs(picked, shape, [False] * len(picked), target=False, loader=loader)
        targets = [read(r["target"], (h, w), False, "target") if edits and "target" in r else torch.zeros(3, h, w)
                   for r in picked]
        targets = [tile(t) if tile is not None and t.ndim == 4 else t for t in targets]
        cond = room.dmd_cond(room.load_text([(r["prompt"], r) for r in picked], cache_dir, identity, device), None,
                             vae, [x.to(device) for x in refs], latent[1:])
        noise = pack(torch.randn((len(picked), *latent), generator=g)).to(device)
        sim = flow_dm.pack_steps(torch.randn((len(picked), len(sigmas) - 1, *latent), generator=g), pack).to(device)
        groups.append((cond, noise, sim, [([x[i] for x in refs], targets[i]) for i in range(len(picked))]))
    return groups


@torch.no_grad()
def write_samples(room, model, vae, groups, sigmas, guidance, edits: bool, path: str, ode: bool = False) -> None:
    """Every rank runs the sharded generator over the whole σ list, one sample shape at a time; rank 0
    decodes and writes the grid: per editing row its references | output | target (grey where a row
    has no target; blank where it has fewer references), all padded to the largest tile; outputs alone
    for text-to-image."""
    outputs = []
    for cond, noise, sim, _ in groups:
        tokens = flow_dm.sample_tokens(model, cond, noise, sim, sigmas, guidance, ode)
        outputs.append(room.decode_tokens(vae, tokens, cond.size) if d_rank() == 0 else None)
    fsdp_utils.reshard_all(model)
    if d_rank() != 0:
        return
    if not edits:
        return save_image_grid(torch.cat(outputs).clamp(-1, 1), path, nrow=4)
    most = max(len(refs) for group in groups for refs, _ in group[3])
    tiles = []
    for (_, _, _, rows), out in zip(groups, outputs):
        for (refs, target), o in zip(rows, out.clamp(-1, 1)):
            tiles += [*refs, *[torch.zeros_like(o)] * (most - len(refs)), o, target]
    hmax, wmax = max(t.shape[1] for t in tiles), max(t.shape[2] for t in tiles)
    grid = [torch.nn.functional.pad(t, (0, wmax - t.shape[2], 0, hmax - t.shape[1])) for t in tiles]
    save_image_grid(torch.stack(grid), path, nrow=most + 2)
