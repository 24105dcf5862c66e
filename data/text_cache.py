"""The text-embedding cache of the flow-matching families: one file per key (a prompt, or a prompt
with its reference images), keyed by the encoders' files and the room's settings. The family's room
says what a key holds, how its encoder loads and encodes (the pipeline's own encode_prompt) and how
entries batch; here each rank embeds its share of the missing keys, then the encoder is freed.
Caches are filled in rounds (fill_in_rounds): a collective after every few items, so that no rank
waits in one collective for the slowest rank's whole share, however large the dataset.

    python -m pytest tests/test_train_flux_kontext.py -q -k cache
"""
from __future__ import annotations

import hashlib
import os
import time

import torch

from core.dist import all_gather_objects, print0, rank, world_size

_TEXT_CACHE_VERSION = 1  # part of every text-cache key: bump when the embedding recipe changes
TEXT_ROUND = 64  # prompts per rank between two collectives of the fill (4 encoder batches)
PROGRESS_EVERY_S = 60.0  # a long fill prints how far it is at most this often


def fill_in_rounds(items: list, work, round_size: int, what: str = "items") -> list[list]:
    """Collective: run work(chunk) on this rank's share of `items` (items[rank::world]) in chunks
    of `round_size`, with one all-gather of work's results after each chunk. Returns, per round,
    [the result of rank 0, of rank 1, ...] (the same on every rank).

    Every rank runs the same number of rounds (its last chunks may be empty), so a rank that has
    nothing to compute waits at each collective for one chunk of the slowest rank, never for its
    whole share: a fill of any size stays within COLLECTIVE_TIMEOUT_S. The last collective comes
    after every rank's last write, so once this returns every file is there for every rank."""
    mine = items[rank()::world_size()]
    rounds = -(-len(items[0::world_size()]) // round_size)  # rank 0's share is the largest
    results, shown = [], time.monotonic()
    for r in range(rounds):
        results.append(all_gather_objects(work(mine[r * round_size:(r + 1) * round_size])))
        if time.monotonic() - shown > PROGRESS_EVERY_S and r + 1 < rounds:
            shown = time.monotonic()
            print0(f"  {min(len(items), (r + 1) * round_size * world_size())}/{len(items)} {what}")
    return results


def folder_identity(model_path, subfolders, *extra) -> str:
    """What cached embeddings depend on besides their inputs: the files of the encoder and
    tokenizer subfolders (config text, weight sizes and mtimes) and the room's `extra` settings."""
    parts = [f"v{_TEXT_CACHE_VERSION}", *map(str, extra)]
    for sub in subfolders:
        folder = os.path.join(model_path, sub)
        for name in sorted(os.listdir(folder)):
            path = os.path.join(folder, name)
            st = os.stat(path)
            parts.append(f"{sub}/{name}:{st.st_size}:{st.st_mtime_ns}")
            if name.endswith(".json") and st.st_size < 2**20:
                with open(path, "rb") as f:
                    parts.append(hashlib.sha256(f.read()).hexdigest())
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def cache_file(cache_dir, identity, key) -> str:
    key = hashlib.sha256(f"{identity}\n{key}".encode()).hexdigest()
    return os.path.join(cache_dir, key[:2], key + ".pt")


def fill_text_cache(items, cache_dir, identity, load_encoder, encode, batch=16, sharded=False):
    """Each rank embeds its share (items[rank::world], by key) of the items missing from the cache,
    in rounds (fill_in_rounds). `items` maps a key to what the room's encoder reads (a prompt, or a
    prompt with its images); load_encoder() is called only where something is missing, and the
    encoder is freed before training; encode(encoder, inputs) returns one dict of CPU tensors per
    input. Returns (computed, reused), summed over ranks.

    sharded: the encoder is sharded over the ranks (parallel/text_encoder.py), so each of its forwards is a
    collective: every rank loads it once any rank misses an item, and runs as many batches per round as the
    busiest rank, a rank with fewer encoding a stand-in item whose output it drops."""
    encoder = []  # loaded at this rank's first missing item (sharded: every rank's, at the first round missing any)
    stand_in = items[min(items)] if items else None

    def work(chunk):
        missing = [k for k in chunk if not os.path.exists(cache_file(cache_dir, identity, k))]
        batches = -(-len(missing) // batch)
        if sharded:
            batches = max(all_gather_objects(batches))
        if batches and not encoder:
            encoder.append(load_encoder())
        with torch.no_grad():
            for i in range(batches):
                part = missing[i * batch:(i + 1) * batch]
                for k, entry in zip(part, encode(encoder[0], [items[k] for k in part] or [stand_in])):
                    save_atomic(entry, cache_file(cache_dir, identity, k))
        return len(missing), len(chunk) - len(missing)

    rounds = fill_in_rounds(sorted(items), work, TEXT_ROUND, "prompts")
    if encoder:
        encoder.clear()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    counts = [n for shares in rounds for n in shares]
    return sum(c for c, _ in counts), sum(r for _, r in counts)


def save_atomic(obj, path) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def load_entries(keys, cache_dir, identity) -> list[dict]:
    """The cached entries (dicts of CPU tensors) of `keys`, in order."""
    return [torch.load(cache_file(cache_dir, identity, k), weights_only=True) for k in keys]
