"""Export to diffusers: a trained model as a diffusers model folder (sharded safetensors, a LoRA
model merged), the adapters in diffusers' LoRA format, and the whole pipeline folder with the
frozen parts linked or converted; and the size of that export, for the disk preflight.

    python -m pytest tests/test_export.py tests/test_checkpoint.py tests/test_disk_preflight.py -q
"""
from __future__ import annotations

import json
import math
import os
import shutil
import time

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from checkpoint import PARTIAL, write_json
from core.dist import barrier, print0, rank
from parallel.lora import is_adapter, safetensors_key
from precision import check_state_dict_dtypes, dtype_name

SHARD_BYTES = 5 * 2**30


def _plan_shards(sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    shards, current, used = [], [], 0
    for name, n in sizes.items():
        if current and used + n > max_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += n
    return shards + [current] if current else shards


def model_class(model: nn.Module) -> type:
    """The model's own class: `fully_shard` swaps in a generated `FSDP<Name>` subclass, whose name
    no library knows (diffusers' AutoModel, converters and hub tooling read `_class_name`)."""
    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


def portable_json(path: str, class_name: str | None = None, updates: dict | None = None) -> None:
    """Rewrite a diffusers JSON (config.json, model_index.json) so it names no machine: drop
    `_name_or_path` (the folder it was loaded from, an absolute path of whoever built it) and,
    given `class_name`, set `_class_name` to it; `updates`: entries set."""
    with open(path) as f:
        data = json.load(f)
    data.pop("_name_or_path", None)
    if class_name:
        data["_class_name"] = class_name
    data.update(updates or {})
    write_json(path, data)


def check_loadable(folder: str, written: dict[str, torch.Size]) -> None:
    """The exported component's config names a diffusers class that builds (on the meta device,
    no weights read) a model with exactly the written tensor names and shapes: what
    `diffusers.AutoModel.from_pretrained(folder)` needs to load it."""
    import diffusers
    with open(os.path.join(folder, "config.json")) as f:
        name = json.load(f)["_class_name"]
    cls = getattr(diffusers, name, None)
    if cls is None:
        raise ValueError(f"export {folder}: config.json names {name!r}, which diffusers does not have")
    with torch.device("meta"):
        built = cls.from_config(cls.load_config(folder))
    expected = {k: tuple(v.shape) for k, v in built.state_dict().items()}
    got = {k: tuple(s) for k, s in written.items()}
    if expected != got:
        diff = sorted(set(expected.items()) ^ set(got.items()))[:3]
        raise ValueError(f"export {folder}: {name} from its config does not match the written tensors, e.g. {diff}")


def _full_state(model: nn.Module):
    """(name, full tensor) of every tensor of `model`'s diffusers layout, gathered one at a time
    (collective: every rank iterates the same names; each tensor is whole on every rank). A LoRA
    model (parallel.lora.add_lora) yields its base layout with each adapted weight merged,
    W + (alpha/rank)·B·A computed in fp32 from the gathered shards; the sharded training weights
    are never touched, so merging cannot fail on shards or alter the run."""
    sd = model.state_dict()
    for k in sd:
        if is_adapter(k):
            continue
        t = _gathered(sd[k])
        if k.endswith(".base_layer.weight"):
            name = k[:-len(".base_layer.weight")]
            for adapter, scale in model.get_submodule(name).scaling.items():
                a, b = (_gathered(sd[f"{name}.lora_{ab}.{adapter}.weight"]) for ab in "AB")
                t = t.float() + scale * _lora_delta(a.float(), b.float(), t.shape)
        yield safetensors_key(k), t


def _gathered(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly DTensor-sharded) parameter; collective for a DTensor."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def _lora_delta(a: torch.Tensor, b: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """B·A for a Linear (b: out×r, a: r×in) or a Conv2d (b: out×r×1×1, a: r×in×k×k), as peft's
    get_delta_weight computes it, without the scale."""
    if a.dim() == 2:
        return b @ a
    return torch.nn.functional.conv2d(a.permute(1, 0, 2, 3), b).permute(1, 0, 2, 3).reshape(shape)


def export_model(model: nn.Module, folder: str, dtype: torch.dtype, max_shard_bytes: int = SHARD_BYTES) -> None:
    """Write `model` (sharded or not; a LoRA model merged, see _full_state) as a diffusers model
    folder (config.json + safetensors, sharded with an index when large). Collective: every rank
    gathers tensor by tensor, rank 0 keeps them on CPU in `dtype` one shard at a time and writes;
    peak host memory ≈ one shard."""
    from safetensors.torch import save_file

    sd = {safetensors_key(k): v for k, v in model.state_dict().items() if not is_adapter(k)}
    sizes = {k: v.numel() * torch.empty((), dtype=dtype if v.is_floating_point() else v.dtype).element_size()
             for k, v in sd.items()}
    shards = _plan_shards(sizes, max_shard_bytes)
    n = len(shards)
    names = (["diffusion_pytorch_model.safetensors"] if n == 1 else
             [f"diffusion_pytorch_model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)])
    if rank() == 0:
        os.makedirs(folder, exist_ok=True)
        model.save_config(folder)
        portable_json(os.path.join(folder, "config.json"), model_class(model).__name__)
    tensors = _full_state(model)
    for fname, keys in zip(names, shards):
        out = {}
        for k in keys:
            name, t = next(tensors)
            assert name == k, (name, k)
            if rank() == 0:
                out[k] = t.to("cpu", dtype=dtype if t.is_floating_point() else t.dtype, copy=True).contiguous()
        if rank() == 0:
            check_state_dict_dtypes(out, dtype, where=f"export {folder}")
            save_file(out, os.path.join(folder, fname), metadata={"format": "pt"})
    if rank() == 0 and n > 1:
        index = {"metadata": {"total_size": sum(sizes.values())},
                 "weight_map": {k: f for f, keys in zip(names, shards) for k in keys}}
        write_json(os.path.join(folder, "diffusion_pytorch_model.safetensors.index.json"), index)
    if rank() == 0:
        check_loadable(folder, {k: v.shape for k, v in sd.items()})


LORA_WEIGHTS = "pytorch_lora_weights.safetensors"


def export_lora(model: nn.Module, out_dir: str, pipeline_class: str, component: str, dtype: torch.dtype,
                scheduler: dict | None = None, base_lora=None) -> str:
    """OUTPUT_DIR/export/pytorch_lora_weights.safetensors: the adapters of a LoRA model in
    diffusers' LoRA format, written by the pipeline's own `save_lora_weights` (peft's key names via
    `get_peft_model_state_dict`, the LoraConfig as adapter metadata, so alpha travels with the
    file), as diffusers' LoRA training examples save theirs. Load it with
    `Pipeline.from_pretrained(base).load_lora_weights(out_dir)`. With `scheduler`, the scheduler the
    adapters are to sample with goes beside them in scheduler/ (write_scheduler). With `base_lora` (a
    parallel/lora_merge.LoraDelta merged into the model's base as it loaded), the file holds both adapter
    sets joined (lora_merge.joined), so that it loads on the plain base. Collective (gathers the shards)."""
    import diffusers
    from peft.utils import get_peft_model_state_dict

    adapters = {}
    for k, v in model.state_dict().items():
        if is_adapter(k):
            t = _gathered(v)
            if rank() == 0:
                adapters[k] = t.to("cpu", dtype=dtype, copy=True).contiguous()
    if rank() == 0:
        partial = out_dir.rstrip("/") + PARTIAL
        shutil.rmtree(partial, ignore_errors=True)
        layers = get_peft_model_state_dict(model, state_dict=adapters, adapter_name="default")
        config = model.peft_config["default"].to_dict()
        if base_lora is not None:
            from parallel.lora_merge import joined, scale_of
            tail = ".lora_A.weight"
            own = {k[:-len(tail)]: (v, layers[k[:-len(tail)] + ".lora_B.weight"]) for k, v in layers.items()
                   if k.endswith(tail)}
            layers, fields = joined(own, {m: scale_of(m, config) for m in own}, base_lora)
            layers = {k: v.to(dtype) for k, v in layers.items()}
            config.update(fields)
        getattr(diffusers, pipeline_class).save_lora_weights(
            partial, weight_name=LORA_WEIGHTS, **{f"{component}_lora_layers": layers,
                                                   f"{component}_lora_adapter_metadata": config})
        if scheduler:
            write_scheduler(partial, scheduler)
        _swap_in(partial, out_dir)
        size = os.path.getsize(os.path.join(out_dir, LORA_WEIGHTS))
        print0(f"export: {out_dir}/{LORA_WEIGHTS} ({len(layers)} tensors, {size / 2**20:.2f} MiB, "
               f"{dtype_name(dtype)}; load with {pipeline_class}.load_lora_weights)")
    barrier()
    return out_dir


def write_scheduler(folder: str, config: dict) -> None:
    """folder/scheduler/: `config` saved by the diffusers class it names, so the file is one that class
    builds (a conflicting config fails here, not at inference), written out rather than linked."""
    import diffusers
    getattr(diffusers, config["_class_name"]).from_config(config).save_pretrained(os.path.join(folder, "scheduler"))


def _swap_in(partial: str, out_dir: str) -> None:
    """Replace out_dir by the finished `partial` folder, so an old export is never half-replaced."""
    if os.path.exists(out_dir):
        old = out_dir.rstrip("/") + f".old{int(time.time())}"
        os.replace(out_dir, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(partial, out_dir)


def _weight_dtypes(folder: str) -> set[torch.dtype]:
    """Dtypes of the floating tensors in a component folder's safetensors files (headers only)."""
    import glob
    from safetensors import safe_open
    found = set()
    for path in glob.glob(os.path.join(folder, "*.safetensors")):
        with safe_open(path, framework="pt") as f:
            for k in f.keys():
                dtype = getattr(torch, {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}.get(
                    f.get_slice(k).get_dtype(), "uint8"))
                if dtype.is_floating_point:
                    found.add(dtype)
    return found


def _copy_as(src: str, dst: str, dtype: torch.dtype) -> None:
    """A copy of a component folder with its floating tensors cast to `dtype`, file by file (its
    config.json as it was: what a plain load does with it is _pin_fp32_load's business)."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    for name in os.listdir(src):
        if name.endswith(".safetensors"):
            tensors = {k: v.to(dtype) if v.is_floating_point() else v
                       for k, v in load_file(os.path.join(src, name)).items()}
            save_file(tensors, os.path.join(dst, name), metadata={"format": "pt"})


def hardlink_tree(src: str, dst: str) -> None:
    """`src` (a file or folder, symlinks followed) at `dst` as plain files: each hard-linked where the
    filesystem allows (no bytes written, and the copy outlives the source), else copied."""
    if not os.path.isdir(src):
        try:
            os.link(os.path.realpath(src), dst)
        except OSError:  # another filesystem, or one without hard links
            shutil.copy2(src, dst)
        return
    os.makedirs(dst, exist_ok=True)
    for name in sorted(os.listdir(src)):
        hardlink_tree(os.path.join(src, name), os.path.join(dst, name))


def _place_frozen(src: str, dst: str, dtype: torch.dtype, link_frozen: bool) -> bool:
    """Put a frozen entry of the source folder into the export: a converted copy when it holds
    weights in another dtype than `dtype`, else its files hard-linked (copied across filesystems), or
    with `link_frozen` a symlink to the folder. Returns whether it converted."""
    if os.path.isdir(src) and _weight_dtypes(src) - {dtype}:
        _copy_as(src, dst, dtype)
        return True
    if os.path.isdir(src) and link_frozen:
        os.symlink(src, dst)
    else:
        hardlink_tree(src, dst)
    return False


def _loads_as_fp32(folder: str) -> bool:
    """Whether transformers 5 loads this model folder in fp32 without `dtype=` ("auto"): it takes
    the config's `dtype` (or the older `torch_dtype`), else the weights' dtype."""
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    hint = config.get("dtype") or config.get("torch_dtype")
    return hint == "float32" if hint else _weight_dtypes(folder) <= {torch.float32}


def _pin_fp32_load(folder: str) -> bool:
    """Make a plain `from_pretrained` load this transformers model (a text encoder) in fp32.

    Without a dtype, diffusers 0.42 builds its own models (UNet, transformer, VAE) in fp32 whatever
    the files hold, while transformers 5 loads in the config's `dtype`, else the weights' dtype: a
    bf16 text encoder beside an fp32 VAE makes the pipeline cast its inputs to bf16 and the VAE
    fail. Setting the config's dtype to float32 makes both libraries agree (the weights stay as
    stored; `torch_dtype=` overrides the hint). A linked folder becomes a folder of links with its
    own config.json, so the source is never written to. Returns whether anything changed."""
    config = os.path.join(folder, "config.json")
    if not os.path.isfile(config) or _loads_as_fp32(folder):
        return False
    if os.path.islink(folder):
        src = os.readlink(folder)
        os.remove(folder)
        os.makedirs(folder)
        for name in os.listdir(src):
            if name != "config.json":
                os.symlink(os.path.join(src, name), os.path.join(folder, name))
        shutil.copyfile(os.path.join(src, "config.json"), config)
    with open(config) as f:
        data = json.load(f)
    data["dtype"] = "float32"
    if "torch_dtype" in data:  # what older transformers read; keep the two keys from disagreeing
        data["torch_dtype"] = "float32"
    write_json(config, data)
    return True


def _transformers_models(model_path: str) -> set[str]:
    """The components model_index.json loads with transformers (text encoders, tokenizers)."""
    with open(os.path.join(model_path, "model_index.json")) as f:
        index = json.load(f)
    return {k for k, v in index.items() if isinstance(v, list) and v and v[0] == "transformers"}


def export_pipeline(model_path: str, out_dir: str, trained: dict[str, nn.Module], dtype: torch.dtype,
                    link_frozen: bool = False, frozen: dict[str, str] | None = None,
                    scheduler: dict | None = None, index: dict | None = None) -> str:
    """OUTPUT_DIR/export/: a diffusers pipeline folder = the source folder's model_index.json and
    frozen components (hard-linked file by file where the filesystem allows, else copied: the export
    outlives and travels without its source; symlinked folders with link_frozen) + the trained components.
    Every component's weights end up in `dtype`: a frozen one stored in another dtype (a shipped
    fp16 text encoder beside an fp32 UNet) is written as a converted copy instead of a link. The
    text encoders' configs say float32 (_pin_fp32_load), so a plain `Pipeline.from_pretrained(export)`
    loads every model in fp32 and `torch_dtype=dtype` every model in `dtype`, both runnable.
    `frozen` maps a component to another folder to use in place of the source's (e.g. a VAE the
    run used instead of the pipeline's own); `scheduler`, a scheduler config written as the export's
    scheduler/ in place of the source's (write_scheduler: a distilled model's own sampling); `index`, entries
    set in its model_index.json (a distilled FLUX.2 klein's is_distilled: its pipeline then skips CFG). Written to
    export.partial/ and swapped in at the end, so an old export is never half-replaced."""
    partial = out_dir.rstrip("/") + PARTIAL
    converted, pinned = [], []
    if rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
        text_models = _transformers_models(model_path)
        for name in sorted(os.listdir(model_path)):
            if name in trained or (scheduler and name == "scheduler"):
                continue
            src = os.path.abspath((frozen or {}).get(name) or os.path.join(model_path, name))
            dst = os.path.join(partial, name)
            if _place_frozen(src, dst, dtype, link_frozen):
                converted.append(name)
            if name in text_models and _pin_fp32_load(dst):
                pinned.append(name)
        named = {"scheduler": ["diffusers", scheduler["_class_name"]]} if scheduler else {}  # the class it loads as
        portable_json(os.path.join(partial, "model_index.json"), updates={**named, **(index or {})})
        if scheduler:
            write_scheduler(partial, scheduler)
    barrier()
    for name, model in trained.items():
        export_model(model, os.path.join(partial, name), dtype)
    if rank() == 0:
        _swap_in(partial, out_dir)
        print0(f"export: {out_dir} ({_export_summary(trained, dtype, link_frozen, converted, pinned)})")
    barrier()
    return out_dir


def _export_summary(trained, dtype: torch.dtype, link_frozen: bool, converted: list, pinned: list) -> str:
    """What the export holds and how it loads, for its log line."""
    name = dtype_name(dtype)
    text = (f"{', '.join(trained)} in {name}; frozen parts {'symlinked' if link_frozen else 'hard-linked or copied'}"
            + (f", {', '.join(converted)} converted to {name}" if converted else "")
            + (f"; {', '.join(pinned)}: config dtype float32, weights {name}" if pinned else ""))
    if dtype == torch.float32:
        return text + "; from_pretrained(path) loads it in fp32"
    return text + (f"; from_pretrained(path, torch_dtype={dtype}) loads it in {name}, "
                   "from_pretrained(path) in fp32")


def _component_bytes(model: nn.Module, dtype: torch.dtype, adapters: bool) -> int:
    """Bytes of `model`'s exported tensors: its base layout (a LoRA model's merged) or its adapters,
    floating tensors in `dtype`."""
    size = torch.empty((), dtype=dtype).element_size()
    return sum(v.numel() * (size if v.is_floating_point() else v.element_size())
               for k, v in model.state_dict().items() if is_adapter(k) == adapters)


def _converted_bytes(folder: str, dtype: torch.dtype) -> int:
    """Size of _copy_as(folder, ..., dtype): its safetensors' tensors with floating ones in `dtype`
    (from the headers), plus every other file copied as is."""
    from safetensors import safe_open
    floating, size = {"F32", "F16", "BF16"}, torch.empty((), dtype=dtype).element_size()
    total = 0
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            if root != folder or not name.endswith(".safetensors"):
                total += os.path.getsize(path)
                continue
            with safe_open(path, framework="pt") as f:
                for k in f.keys():
                    t = f.get_slice(k)
                    n, kind = math.prod(t.get_shape()), t.get_dtype()
                    total += n * size if kind in floating else n * _SAFETENSORS_BYTES.get(kind, 4)
    return total


_SAFETENSORS_BYTES = {"F64": 8, "I64": 8, "U64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2, "I8": 1, "U8": 1,
                      "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def export_bytes(model_path: str, component: str, model: nn.Module, dtype: torch.dtype, *, lora: bool = False,
                 merged: bool = False, frozen: dict[str, str] | None = None, out_dir: str = "",
                 link_frozen: bool = False) -> int:
    """Estimated size of what `finish` exports: the trained `component` (`model`'s layout) in `dtype`
    plus the frozen parts export_pipeline places (converted copies cost their bytes; the rest nothing
    where they are symlinked or hard-linked, their bytes where `out_dir` is on another filesystem than
    the source and they are copied); with LoRA the adapters in fp32, and the merged pipeline only with
    `merged`."""
    total = _component_bytes(model, torch.float32, adapters=True) if lora else 0
    if lora and not merged:
        return total
    total += _component_bytes(model, dtype, adapters=False)
    for name in os.listdir(model_path):
        if name == component:
            continue
        src = os.path.abspath((frozen or {}).get(name) or os.path.join(model_path, name))
        if not os.path.isdir(src):  # model_index.json and the like: rewritten
            total += os.path.getsize(src)
        elif _weight_dtypes(src) - {dtype}:
            total += _converted_bytes(src, dtype)
        elif not link_frozen and not _same_filesystem(src, out_dir):
            total += _tree_bytes(src)
    return total


def _same_filesystem(src: str, out_dir: str) -> bool:
    """Whether `out_dir` (or its nearest existing parent; "" = here) is on `src`'s filesystem: hard links work."""
    path = os.path.abspath(out_dir or ".")
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return os.stat(os.path.realpath(src)).st_dev == os.stat(path).st_dev


def _tree_bytes(src: str) -> int:
    """Bytes of every file under a folder (links followed)."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(src, followlinks=True) for f in fs)
