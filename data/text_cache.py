"""The text-embedding cache of the FLUX scripts: T5 token embeddings + the pooled CLIP vector per
prompt, one file each, keyed by the encoders' files, the T5 length and the dtype. Each rank embeds
its share of the missing prompts with the pipeline's own encode_prompt, then the encoders are freed.
Caches are filled in rounds (fill_in_rounds): a collective after every few items, so that no rank
waits in one collective for the slowest rank's whole share, however large the dataset.

    python -m pytest tests/test_train_flux_kontext.py -q -k cache
"""
from __future__ import annotations

import hashlib
import json
import os
import time

import torch

import precision
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


def encoder_identity(model_path, max_length, dtype) -> str:
    """What the embeddings depend on besides the prompt: encoder and tokenizer files (config text,
    weight sizes and mtimes), the T5 length and the dtype."""
    parts = [f"v{_TEXT_CACHE_VERSION}", str(max_length), precision.dtype_name(dtype)]
    for sub in ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2"):
        folder = os.path.join(model_path, sub)
        for name in sorted(os.listdir(folder)):
            path = os.path.join(folder, name)
            st = os.stat(path)
            parts.append(f"{sub}/{name}:{st.st_size}:{st.st_mtime_ns}")
            if name.endswith(".json") and st.st_size < 2**20:
                with open(path, "rb") as f:
                    parts.append(hashlib.sha256(f.read()).hexdigest())
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def cache_file(cache_dir, identity, prompt) -> str:
    key = hashlib.sha256(f"{identity}\n{prompt}".encode()).hexdigest()
    return os.path.join(cache_dir, key[:2], key + ".pt")


def load_text_encoders(model_path, dtype, device):
    """A FluxKontextPipeline holding only CLIP + T5 and their tokenizers: its encode_prompt is
    exactly the pipeline's own text path, so cached embeddings equal what it would compute."""
    from diffusers import FluxKontextPipeline
    from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5TokenizerFast
    return FluxKontextPipeline(
        scheduler=None, vae=None, transformer=None,
        tokenizer=CLIPTokenizer.from_pretrained(os.path.join(model_path, "tokenizer")),
        tokenizer_2=T5TokenizerFast.from_pretrained(os.path.join(model_path, "tokenizer_2")),
        text_encoder=CLIPTextModel.from_pretrained(os.path.join(model_path, "text_encoder"),
                                                   dtype=dtype).to(device).eval(),
        text_encoder_2=T5EncoderModel.from_pretrained(os.path.join(model_path, "text_encoder_2"),
                                                      dtype=dtype).to(device).eval())


def t5_length(model_path, max_length) -> int:
    """MAX_SEQUENCE_LENGTH capped at the T5 tokenizer's model_max_length (32 for the tiny one)."""
    with open(os.path.join(model_path, "tokenizer_2", "tokenizer_config.json")) as f:
        limit = json.load(f).get("model_max_length", max_length)
    return int(min(max_length, limit))


def fill_text_cache(prompts, model_path, cache_dir, identity, max_length, dtype, device, batch=16):
    """Each rank embeds its share (prompts[rank::world]) of the prompts missing from the cache, in
    rounds (fill_in_rounds); the encoders are loaded only where something is missing and freed
    before training. Returns (computed, reused), summed over ranks."""
    pipe = []  # the encoders, loaded at this rank's first missing prompt

    def work(chunk):
        missing = [p for p in chunk if not os.path.exists(cache_file(cache_dir, identity, p))]
        if missing and not pipe:
            pipe.append(load_text_encoders(model_path, dtype, device))
        with torch.no_grad():
            for i in range(0, len(missing), batch):
                part = missing[i:i + batch]
                embeds, pooled, _ = pipe[0].encode_prompt(part, prompt_2=None, device=device,
                                                          max_sequence_length=max_length)
                for p, e, v in zip(part, embeds.cpu(), pooled.cpu()):
                    save_atomic({"prompt": p, "prompt_embeds": e.clone(), "pooled": v.clone()},
                                cache_file(cache_dir, identity, p))
        return len(missing), len(chunk) - len(missing)

    rounds = fill_in_rounds(sorted(set(prompts)), work, TEXT_ROUND, "prompts")
    if pipe:
        pipe.clear()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    counts = [n for shares in rounds for n in shares]
    return sum(c for c, _ in counts), sum(r for _, r in counts)


def save_atomic(obj, path) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def load_text_embeds(prompts, cache_dir, identity, device):
    """(B, T, D) T5 embeddings and (B, D) pooled CLIP vectors for `prompts`, read from the cache."""
    if not prompts:
        return None
    items = [torch.load(cache_file(cache_dir, identity, p), weights_only=True) for p in prompts]
    embeds = torch.stack([it["prompt_embeds"] for it in items]).to(device)
    pooled = torch.stack([it["pooled"] for it in items]).to(device)
    return embeds, pooled


def prepare_text_cache(prompts, model_path, cache_dir, max_length, dtype, device) -> str:
    """Fill the text-embedding cache for `prompts`; returns the encoder identity (cache key part)."""
    length = t5_length(model_path, max_length)
    identity = encoder_identity(model_path, length, dtype)
    computed, reused = fill_text_cache(prompts, model_path, cache_dir, identity, length, dtype, device)
    print0(f"text cache: {computed + reused} unique prompts, computed {computed}, reused {reused} "
           f"({cache_dir}; T5 length {length}, {precision.dtype_name(dtype)})")
    return identity
