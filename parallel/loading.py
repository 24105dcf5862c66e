"""Meta-device build and sharded loading from a diffusers model folder: the skeleton from its
config.json with no memory, sharded by its recipe, then every rank reads only the rows of each
safetensors tensor that it owns.

    python -m pytest tests/test_loading.py -q
"""
from __future__ import annotations

import contextlib
import json
import os

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from core.errors import ConfigError
from fsdp_utils import assert_sharded, fill_local
from parallel.lora import init_lora, is_adapter, safetensors_key
from parallel.lowbit import fill_nf4, is_nf4
from parallel.memory import mark_rss_baseline


WEIGHT_NAMES = ("diffusion_pytorch_model.safetensors", "model.safetensors")


def weight_map(source: str) -> dict[str, str]:
    """{tensor name: safetensors file} for a diffusers/transformers component folder, single-file
    or sharded (`*.safetensors.index.json`), or for one `.safetensors` file (a bare state dict)."""
    if source.endswith(".safetensors") and os.path.isfile(source):
        from safetensors import safe_open
        with safe_open(source, framework="pt") as f:
            return {k: source for k in f.keys()}
    for base in WEIGHT_NAMES:
        index = os.path.join(source, base + ".index.json")
        if os.path.exists(index):
            with open(index) as f:
                wm = json.load(f)["weight_map"]
            return {k: os.path.join(source, v) for k, v in wm.items()}
        single = os.path.join(source, base)
        if os.path.exists(single):
            from safetensors import safe_open
            with safe_open(single, framework="pt") as f:
                return {k: single for k in f.keys()}
    raise ConfigError(f"{source}: no *.safetensors weights (or index) found")


def tensor_shapes(source: str) -> dict[str, list[int]]:
    """{tensor name: shape} of `source` (weight_map's), read from the safetensors headers only."""
    from safetensors import safe_open
    shapes = {}
    for path in sorted(set(weight_map(source).values())):
        with safe_open(path, framework="pt") as f:
            shapes.update((k, list(f.get_slice(k).get_shape())) for k in f.keys())
    return shapes


def check_same_tensors(source: str, reference: str, what: str) -> None:
    """Before any work: `source` holds exactly the tensor names and shapes of `reference` (e.g. a
    generator's starting weights against the teacher's folder; dtypes may differ, loading casts),
    else a one-line ConfigError naming the first difference. `what` names the setting."""
    mine, ref = tensor_shapes(source), tensor_shapes(reference)
    missing, extra = sorted(set(ref) - set(mine)), sorted(set(mine) - set(ref))
    if missing or extra:
        raise ConfigError(f"{what}={source}: not the model of {reference}: "
                          + (f"{len(missing)} tensors missing, e.g. {missing[0]!r}" if missing else "")
                          + ("; " if missing and extra else "")
                          + (f"{len(extra)} unknown tensors, e.g. {extra[0]!r}" if extra else ""))
    bad = next((k for k in sorted(ref) if mine[k] != ref[k]), None)
    if bad is not None:
        raise ConfigError(f"{what}={source}: {bad} has shape {mine[bad]}, the model of {reference} {ref[bad]}")


def build_on_meta(model_cls, folder: str) -> nn.Module:
    """The model skeleton from `folder/config.json`, on the meta device: no memory, no init."""
    if not os.path.exists(os.path.join(folder, "config.json")):
        raise ConfigError(f"{folder}: no config.json — not a diffusers model folder")
    mark_rss_baseline()
    config = model_cls.load_config(folder)
    with torch.device("meta"):
        return model_cls.from_config(config)


def materialize_and_load(model: nn.Module, folder: str, device: torch.device, merge=None, rename=None) -> None:
    """Allocate the (already sharded) meta model on `device` and fill it from safetensors (`folder`:
    a model folder, or one .safetensors state dict, as weight_map reads).

    Each rank reads only the rows of each tensor that it owns (safetensors slices are lazy, memory-
    mapped), so no rank ever holds more than its shard plus one slice: a 12 B transformer loads
    without 12 B parameters of host RAM anywhere. Stored dtype is cast to the model's dtype.
    LoRA adapters (add_lora) are not in the folder: they are initialised by `init_lora`. `merge`: a
    parallel/lora_merge.LoraDelta whose delta each adapted base tensor gets as it loads (whole, in fp32,
    before any NF4 quantisation or cast). `rename`: the model's name of a stored tensor's name (a checkpoint saved
    in an older layout of the model's modules)."""
    from safetensors import safe_open

    model.to_empty(device=device)
    stored = weight_map(folder)
    keys = {(rename(k) if rename else k): k for k in stored}  # the model's name -> the stored name
    files = {k: stored[v] for k, v in keys.items()}
    handles: dict[str, object] = {}
    with contextlib.ExitStack() as stack, torch.no_grad():
        def slice_of(name):
            path = files.get(name)
            if path is None:
                raise ConfigError(f"{folder}: weights have no tensor {name!r} (wrong model kind or config?)")
            if path not in handles:
                handles[path] = stack.enter_context(safe_open(path, framework="pt"))
            return handles[path].get_slice(keys[name])

        tensors = {safetensors_key(n): t for n, t in model.named_parameters() if not is_adapter(n)}
        computed = {f"{m}.{b}" if m else b for m, mod in model.named_modules() for b in mod._non_persistent_buffers_set}
        tensors.update((safetensors_key(n), t) for n, t in model.named_buffers() if n not in computed)  # not saved
        if merge is not None:
            merge.check_base({k: t.shape for k, t in tensors.items()}, f"the model of {folder}")
        for name, t in tensors.items():
            sl = slice_of(name)
            if list(sl.get_shape()) != list(t.shape):
                raise ConfigError(f"{folder}: {name} has shape {sl.get_shape()}, model expects {list(t.shape)}")
            delta = merge.delta(name) if merge is not None else None
            if delta is not None:  # base + LoRA: the whole tensor merged, then read as a slice would be
                sl = sl[:].float() + delta  # cast to the model's dtype by the fill, as a plain load
            if is_nf4(t):  # a 4-bit base: the whole tensor quantised, this rank's chunk kept
                fill_nf4(t, sl[:])
            else:
                fill_local(t, lambda index: sl[index])
        extra = set(files) - set(tensors)
        if extra:
            raise ConfigError(f"{folder}: weights hold tensors the model lacks, e.g. {sorted(extra)[:3]}")


def fill_built_model(model: nn.Module, folder: str, mesh: DeviceMesh | None, home: torch.device,
                     load: bool = True, lora_seed: int = 0, merge=None, rename=None) -> nn.Module:
    """The last step of a meta-device build: allocate the (sharded, or with mesh=None whole) model
    on `home` and load it from `folder` (load=False: allocate only, e.g. an EMA copy filled from
    the model), LoRA adapters initialised from `lora_seed`, then check that every parameter is
    sharded on `mesh`. `merge`: a LoRA merged into the base as it loads, `rename` the model's names of the
    stored ones (materialize_and_load)."""
    if load:
        materialize_and_load(model, folder, home, merge, rename)
        init_lora(model, lora_seed)
    else:
        model.to_empty(device=home)
    if mesh is not None:
        assert_sharded(model, mesh)
    return model

