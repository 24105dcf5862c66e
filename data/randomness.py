"""Data order and randomness as functions of (seed, step): the same on every rank, at any world
size and after a resume; per-sample generators and caption dropout.

    python -m pytest tests/test_data.py -q
"""
from __future__ import annotations

import torch

# step_generator's streams: 0 a step's own draws (the Kontext step's noise, σ and flips), then
DATA_ORDER_STREAM = 99  # an epoch's permutation of the data (step = the epoch)
BUCKET_STREAM = 7  # Kontext: the resolution bucket of a step's global batch
SAMPLE_NOISE_STREAM = 7  # the fixed noise of the sample grids (step 0; another draw than a bucket's)
VALIDATION_STREAM = 11  # Kontext: the fixed noise and σ of the held-out pairs (step 0)


def step_generator(seed: int, step: int, stream: int = 0) -> torch.Generator:
    """A CPU generator seeded from (seed, step, stream): randomness for the *global* batch of a
    step, identical on every rank and after a resume, whatever the world size."""
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + step * 9_176 + stream * 7_919) % (2**63 - 1))
    return g


def sample_generator(seed: int, step: int, index: int, device, stream: int = 0) -> torch.Generator:
    """A generator on `device` seeded from (seed, step, index, stream): the randomness of sample
    `index` of the step's global batch. A rank draws only its own samples' numbers, on the run's
    device, and they do not depend on which rank holds the sample, the world size or GRAD_ACCUM.
    (The seed is a 64-bit hash of the four numbers, so no two samples or steps share a stream.)"""
    import hashlib
    key = hashlib.blake2b(f"{seed},{step},{index},{stream}".encode(), digest_size=8).digest()
    g = torch.Generator(device=device)
    g.manual_seed(int.from_bytes(key, "little") >> 1)
    return g


# sample_generator's streams: 0 the scripts' per-sample noise (per_sample_draws' default), then
POSTERIOR_STREAM = 1  # DMD2's real images' VAE posterior samples
CAPTION_DROPOUT_STREAM = 2  # caption dropout


def drop_captions(prompts: list[str], seed: int, step: int, indices, probability: float,
                  empty: str = "") -> list[str]:
    """`prompts` of the samples at global-batch positions `indices`, each replaced by `empty` (the
    family's unconditional text: the prompt its pipeline's CFG pairs with) with `probability`
    (CAPTION_DROPOUT), drawn on CPU from (seed, step, position): the same on any world size and after
    a resume. probability 0 draws nothing (the prompts are returned as they are)."""
    if probability <= 0:
        return list(prompts)
    return [empty if torch.rand((), generator=sample_generator(seed, step, i, "cpu", CAPTION_DROPOUT_STREAM))
            < probability else p for p, i in zip(prompts, indices)]


def per_sample_draws(seed: int, step: int, indices, device, draw, stream: int = 0) -> dict[str, torch.Tensor]:
    """`draw(generator)` -> {name: tensor of one sample} for each global sample index in
    `indices` (this rank's), stacked along a new dim 0: what a rank needs of the step's randomness,
    nothing more (every tensor made on `device` by its own generator; no host copy)."""
    parts = [draw(sample_generator(seed, step, i, device, stream)) for i in indices]
    return {k: torch.stack([p[k] for p in parts]) for k in parts[0]}
