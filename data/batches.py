"""Which samples a step uses: the global batch of a step (seeded epochs), and each rank's and
micro-batch's share of it.

    python -m pytest tests/test_data.py -q
"""
from __future__ import annotations

import torch

from data.randomness import DATA_ORDER_STREAM, step_generator

def global_batch_indices(step: int, global_batch: int, n: int, seed: int) -> list[int]:
    """Dataset indices of the global batch of `step`: epochs of seeded permutations laid end to
    end, so the data position is just the step (resumable on any world size)."""
    out, pos = [], step * global_batch
    while len(out) < global_batch:
        epoch, offset = divmod(pos, n)
        perm = torch.randperm(n, generator=step_generator(seed, epoch, stream=DATA_ORDER_STREAM)).tolist()
        take = perm[offset:offset + global_batch - len(out)]
        out += take
        pos += len(take)
    return out


def micro_batch_positions(m: int, micro_global: int, rank_: int, world: int) -> list[int]:
    """Positions in the step's global batch of this rank's samples of micro-batch m: chunk m of
    `micro_global` samples (micro-batch size × data-parallel ranks), this rank's contiguous share."""
    return list(rank_slice(range(m * micro_global, (m + 1) * micro_global), rank_, world))


def rank_micro_batches(step: int, n: int, batch_size: int, grad_accum: int, rank_: int, world: int,
                       seed: int) -> list[tuple[list[int], list[int]]]:
    """This rank's share of every micro-batch of `step` over a dataset of `n` rows: per micro-batch,
    (positions in the global batch, their dataset indices). Positions key the per-sample randomness."""
    indices = global_batch_indices(step, batch_size * world * grad_accum, n, seed)
    return [(mine, [indices[i] for i in mine])
            for mine in (micro_batch_positions(m, batch_size * world, rank_, world) for m in range(grad_accum))]


def rank_slice(items, rank_: int, world: int):
    """This rank's contiguous share of a global batch (list or tensor along dim 0)."""
    per = len(items) // world
    return items[rank_ * per:(rank_ + 1) * per]
