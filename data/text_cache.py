"""The text-embedding cache of the FLUX scripts: T5 token embeddings + the pooled CLIP vector per
prompt, one file each, keyed by the encoders' files, the T5 length and the dtype. Each rank embeds
its share of the missing prompts with the pipeline's own encode_prompt, then the encoders are freed.

    python -m pytest tests/test_train_flux_kontext.py -q -k cache
"""
from __future__ import annotations

import hashlib
import json
import os

import torch

import precision
from components.dist import all_reduce, barrier, print0, rank, world_size

_TEXT_CACHE_VERSION = 1  # part of every text-cache key: bump when the embedding recipe changes




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
    """Each rank embeds its share (prompts[rank::world]) of the prompts missing from the cache;
    the encoders are loaded only where something is missing and freed before training.
    Returns (computed, reused), summed over ranks."""
    mine = sorted(set(prompts))[rank()::world_size()]
    missing = [p for p in mine if not os.path.exists(cache_file(cache_dir, identity, p))]
    if missing:
        pipe = load_text_encoders(model_path, dtype, device)
        with torch.no_grad():
            for i in range(0, len(missing), batch):
                chunk = missing[i:i + batch]
                embeds, pooled, _ = pipe.encode_prompt(chunk, prompt_2=None, device=device,
                                                       max_sequence_length=max_length)
                for p, e, v in zip(chunk, embeds.cpu(), pooled.cpu()):
                    save_atomic({"prompt": p, "prompt_embeds": e.clone(), "pooled": v.clone()},
                                 cache_file(cache_dir, identity, p))
        del pipe
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    counts = all_reduce(torch.tensor([len(missing), len(mine) - len(missing)], dtype=torch.float64))
    barrier()  # every rank's cache files are written before any rank reads them
    return int(counts[0]), int(counts[1])


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
