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


def test_per_sample_draws_do_not_depend_on_who_draws_them():
    """Each sample's numbers come from (seed, step, its global index): the whole batch drawn at once
    equals any split of it over ranks or micro-batches; other steps, samples and streams differ."""
    import torch

    def draw(g):
        return {"noise": torch.randn(3, 4, generator=g, device=g.device),
                "t": torch.randint(0, 1000, (), generator=g, device=g.device)}
    cpu = torch.device("cpu")
    whole = data_utils.per_sample_draws(5, 7, range(8), cpu, draw)
    for world in (2, 4):
        parts = [data_utils.per_sample_draws(5, 7, data_utils.rank_slice(range(8), r, world), cpu, draw)
                 for r in range(world)]
        assert all(torch.equal(torch.cat([p[k] for p in parts]), whole[k]) for k in whole)
    assert whole["noise"].shape == (8, 3, 4) and whole["t"].shape == (8,)
    assert not torch.equal(whole["noise"][0], whole["noise"][1])  # samples differ
    assert not torch.equal(data_utils.per_sample_draws(5, 8, range(8), cpu, draw)["noise"], whole["noise"])
    assert not torch.equal(data_utils.per_sample_draws(5, 7, range(8), cpu, draw, stream=1)["noise"], whole["noise"])


def test_prefetcher_loads_the_next_step_while_this_one_runs():
    import threading
    import time

    import pytest
    import torch
    started, release = [], threading.Event()

    def load(step):
        started.append(step)
        if step == 3:
            release.wait(5)
        if step == 4:
            raise ValueError("bad row in step 4")
        return {"x": torch.full((2,), float(step)), "names": [f"s{step}"]}
    with data_utils.Prefetcher(load, last_step=4, device=torch.device("cpu")) as prefetch:
        data, waited = prefetch.get(1)
        assert torch.equal(data["x"], torch.tensor([1.0, 1.0])) and data["names"] == ["s1"] and waited >= 0
        deadline = time.monotonic() + 5
        while started != [1, 2] and time.monotonic() < deadline:  # step 2 loads before anyone asks for it
            time.sleep(0.01)
        assert started == [1, 2]
        assert prefetch.get(2)[0]["names"] == ["s2"]  # ... and starts step 3, which blocks until released
        threading.Timer(0.3, release.set).start()
        data, waited = prefetch.get(3)
        assert data["names"] == ["s3"] and waited > 0.1  # the wait for step 3's data is measured
        with pytest.raises(ValueError, match="bad row in step 4"):  # a loader error surfaces at its step
            prefetch.get(4)
    assert started == [1, 2, 3, 4]  # nothing past last_step
