"""Inputs checked up front, before any rank starts work: OUTPUT_DIR (and TEXT_CACHE_DIR where it
lies outside it) writable and shared by all ranks, MODEL_PATH a diffusers folder of the pipeline a
script trains.

    python -m pytest tests/test_components.py tests/test_fault_tolerance.py -q
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import time

from core.dist import all_gather_objects, barrier, broadcast_from_rank0, rank
from core.errors import ConfigError

def shared_folders(config: dict) -> dict[str, str]:
    """{setting: folder} of the folders every rank reads what other ranks wrote: OUTPUT_DIR
    (checkpoints, resume) and TEXT_CACHE_DIR where it is set outside OUTPUT_DIR (each rank embeds
    and encodes its share of the text and latent caches, any rank reads any file)."""
    folders = {"OUTPUT_DIR": config["OUTPUT_DIR"]}
    cache = config.get("TEXT_CACHE_DIR") or ""
    out = os.path.realpath(config["OUTPUT_DIR"])
    if cache and os.path.commonpath([out, os.path.realpath(cache)]) != out:
        folders["TEXT_CACHE_DIR"] = cache
    return folders


def check_output_dir(path: str, setting: str = "OUTPUT_DIR") -> None:
    """OUTPUT_DIR (or another folder the run writes, named by `setting`) must be creatable and
    writable (a probe file is written and removed), so a bad path fails before any work instead of
    at the first save."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write_test.{socket.gethostname()}.{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"{setting}={path!r} is not writable ({e.strerror or e})") from None


def check_output_dir_shared(path: str, setting: str = "OUTPUT_DIR") -> None:
    """Collective, after the process group is up: every rank sees a file rank 0 writes in OUTPUT_DIR
    (or the folder named by `setting`). Checkpoints (DCP: each rank writes its shards, rank 0 the
    metadata and the rename), the text cache and resume need one folder that all ranks share; a
    node-local folder on a multi-node run would otherwise fail mid-run, at the first save or the
    first batch. Fails on every rank, naming the hosts that do not see it. The probe's name is this
    run's own, so runs that share a folder (a TEXT_CACHE_DIR) can start together."""
    token = broadcast_from_rank0(f"{socket.gethostname()}:{os.getpid()}:{time.time()}")
    probe = os.path.join(path, ".shared_check." + hashlib.sha256(token.encode()).hexdigest()[:16])
    if rank() == 0:
        with open(probe, "w") as f:
            f.write(token)
    barrier()
    try:
        with open(probe) as f:
            seen = f.read() == token
    except OSError:
        seen = False
    blind = [h for h in all_gather_objects(None if seen else f"rank {rank()} on {socket.gethostname()}") if h]
    barrier()
    if rank() == 0:
        os.remove(probe)
    if blind:
        raise ConfigError(f"{setting}={path!r} is not shared by all ranks: {', '.join(blind)} cannot see the file "
                          f"rank 0 wrote there; on several nodes put {setting} on a filesystem every node mounts")


_COMPONENT_FILES = ("config.json", "scheduler_config.json", "tokenizer_config.json", "tokenizer.json", "vocab.json",
                    "preprocessor_config.json")


def check_model_folder(path: str, pipeline: str, components: dict, setting: str = "MODEL_PATH") -> None:
    """`path` must be a diffusers pipeline folder with every component a script loads.

    components: {subfolder: expected class name in model_index.json, or None for any}. A wrong
    folder (e.g. a FLUX folder given to an SD-1.5 script) fails in one line naming what is missing."""
    if not os.path.isdir(path):
        raise ConfigError(f"{setting}={path!r}: no such folder")
    index = os.path.join(path, "model_index.json")
    if not os.path.isfile(index):
        raise ConfigError(f"{setting}={path}: no model_index.json, not a diffusers pipeline folder "
                          f"(expected a {pipeline} folder)")
    try:
        with open(index) as f:
            meta = json.load(f)
        if not isinstance(meta, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        raise ConfigError(f"{index}: unreadable ({e})") from None
    problems = []
    for name, cls in components.items():
        folder, entry = os.path.join(path, name), meta.get(name)
        if entry == [None, None]:  # a part the pipeline leaves out (Wan 2.1's transformer_2): diffusers loads None
            continue
        found = isinstance(entry, list) and len(entry) == 2 and entry[1] or None
        if not os.path.isdir(folder) or not any(os.path.isfile(os.path.join(folder, f)) for f in _COMPONENT_FILES):
            problems.append(f"{name}/")
        elif cls and found and found != cls:
            problems.append(f"{name} (is {found}, need {cls})")
    if problems:
        raise ConfigError(f"{setting}={path}: a {meta.get('_class_name', 'diffusers')} folder, not the {pipeline} "
                          f"layout this script trains: missing {', '.join(problems)}")
