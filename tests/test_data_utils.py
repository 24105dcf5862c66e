"""data_utils.py: data order as a function of (SEED, step), the same at any world size.
Record loading, images and grids are exercised through the scripts' tests.

    python -m pytest tests/test_data_utils.py -q
"""
from __future__ import annotations

import data_utils


def test_global_batch_indices_cover_epochs():
    seen = [i for s in range(5) for i in data_utils.global_batch_indices(s, 4, 10, seed=3)]
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:20]) == list(range(10))
    assert data_utils.global_batch_indices(3, 4, 10, 3) == seen[12:16]


def test_rank_slices_partition_the_batch():
    batch = list(range(8))
    assert [x for r in range(4) for x in data_utils.rank_slice(batch, r, 4)] == batch
