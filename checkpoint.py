"""Sharded checkpoints with torch.distributed.checkpoint (DCP), exact resume, and diffusers export.

Layout of OUTPUT_DIR/checkpoints/step_XXXXXX/:
    .metadata, __*_*.distcp       DCP shards: every model (incl. EMA) and optimizer, each rank its own
    trainer_state.json            step, LR schedulers, data position, world size, user extras
    config.json                   the run's final config
    rng/rank_R.pt                 per-rank RNG states (torch, CUDA, numpy, python)

A checkpoint is written to `step_XXXXXX.partial/` and renamed to `step_XXXXXX/` by rank 0 only
after DCP has written `.metadata` (which DCP writes last): a crash at any moment leaves either no
new checkpoint or a complete one, and the previous one untouched. Resharding on load is DCP's, so a
run saved on 2 ranks resumes on 1 or 4.

Before the loop, `disk_preflight` estimates one checkpoint and the export from the built models and
optimizers and compares KEEP_LAST + 1 checkpoints and the export with OUTPUT_DIR's free space.

    python -m pytest tests/test_checkpoint.py tests/test_disk_preflight.py -q
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import shutil
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from parallel.lora import is_adapter, safetensors_key
from parallel.lowbit import state_bytes
from precision import check_state_dict_dtypes, dtype_name
from run_utils import (ConfigError, RunError, all_gather_objects, barrier, broadcast_from_rank0, first_error, print0,
                       rank, world_size)

PARTIAL = ".partial"


def checkpoint_root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def is_complete(path: str) -> bool:
    return (not path.endswith(PARTIAL) and os.path.exists(os.path.join(path, ".metadata"))
            and os.path.exists(os.path.join(path, "trainer_state.json")))


def list_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """Complete checkpoints, oldest first, as (step, path)."""
    root = checkpoint_root(output_dir)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if name.startswith("step_") and name[5:].isdigit() and is_complete(path):
            found.append((int(name[5:]), path))
    return sorted(found)


def resolve_resume(resume: str, output_dir: str) -> str | None:
    """RESUME='' -> fresh start; 'auto' -> newest complete checkpoint (or fresh); else that path.
    Collective: rank 0 decides and every rank gets its answer (or its error), because on a shared
    filesystem that caches attributes, ranks listing checkpoints/ right after a save's rename can
    see different newest checkpoints."""
    answer = None
    if rank() == 0:
        try:
            answer = ("path", _resolve_resume(resume, output_dir))
        except ConfigError as e:
            answer = ("error", str(e))
    kind, value = broadcast_from_rank0(answer)
    if kind == "error":
        raise ConfigError(value)
    return value


def _resolve_resume(resume: str, output_dir: str) -> str | None:
    if not resume:
        return None
    if resume == "auto":
        ckpts = list_checkpoints(output_dir)
        return ckpts[-1][1] if ckpts else None
    if not is_complete(resume):
        raise ConfigError(f"RESUME={resume}: not a complete checkpoint folder (no .metadata / trainer_state.json)")
    return resume


# ----------------------------------------------------------------------------------------------
# RNG

def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ----------------------------------------------------------------------------------------------
# save / load

def _model_options(model: nn.Module) -> StateDictOptions:
    """What a checkpoint holds of a model: everything, except for a model that mixes trainable and
    frozen params (a LoRA model: adapters on a frozen base), of which only the trainable ones —
    the base is the model folder's, so a LoRA checkpoint is a few MB."""
    grads = {p.requires_grad for p in model.parameters()}
    return StateDictOptions(ignore_frozen_params=len(grads) == 2)


def _model_state(models: dict[str, nn.Module]) -> dict:
    return {f"model.{k}": get_model_state_dict(m, options=_model_options(m)) for k, m in models.items()}


def _set_models(models: dict[str, nn.Module], state: dict) -> None:
    """Load each model's entries; a LoRA model's frozen base (not in checkpoints) is left as loaded
    from the model folder, and any other missing tensor is an error."""
    for k, m in models.items():
        options = _model_options(m)
        loose = dataclasses.replace(options, strict=not options.ignore_frozen_params)
        missing = set(set_model_state_dict(m, state[f"model.{k}"], options=loose).missing_keys)
        frozen = {n for n, p in m.named_parameters() if not p.requires_grad}
        if missing - frozen:
            raise RunError(f"checkpoint lacks {k} tensors, e.g. {sorted(missing - frozen)[:3]}")


def _dcp_state(models: dict[str, nn.Module], optimizers: dict[str, tuple[nn.Module, torch.optim.Optimizer]]) -> dict:
    state = _model_state(models)
    state.update({f"optim.{k}": get_optimizer_state_dict(m, o) for k, (m, o) in optimizers.items()})
    return state


class Checkpointer:
    """Owns the run's checkpoints: what they hold, when one is written, and loading them back.

    models:     {name: module}             (trainable models, EMA copies; frozen ones need not be saved)
    optimizers: {name: (module, optimizer)}
    schedulers: {name: LR scheduler}
    config:     the run's settings, written beside every checkpoint

    The loop calls `save(step, trainer_state, stopping=...)` after every step and the checkpointer
    decides, as torchtitan's does: a checkpoint every `save_every` steps, always at `last_step`,
    and when the run is stopping (signal, too many bad steps), then written synchronously so the
    process can exit. A step is never written twice.
    """

    def __init__(self, output_dir: str, models: dict, optimizers: dict, schedulers: dict, config: dict, *,
                 keep_last: int = 2, async_save: bool = False, save_every: int = 0, last_step: int = 0):
        if keep_last < 1:
            raise ConfigError(f"KEEP_LAST={keep_last}: must keep at least 1 checkpoint")
        self.root, self.keep_last, self.async_save = checkpoint_root(output_dir), keep_last, async_save
        self.models, self.optimizers, self.schedulers, self.config = models, optimizers, schedulers, config
        self.save_every, self.last_step = save_every, last_step
        self.saved_step = -1  # the newest step written (or loaded): never written again
        self._pending = None  # (future, partial path, final path)
        # async saves run collectives from a background thread: give them their own group so they
        # never interleave with the training step's collectives on the default group
        self._pg = dist.new_group(backend="gloo") if async_save and dist.is_initialized() else None

    def due(self, step: int, stopping: bool = False) -> bool:
        """Whether `step` gets a checkpoint: every SAVE_EVERY steps, the last step, or a stop."""
        if step == self.saved_step:
            return False
        return stopping or step == self.last_step or (self.save_every > 0 and step % self.save_every == 0)

    def save(self, step: int, trainer_state: dict, *, stopping: bool = False) -> str | None:
        """Collective; call after every step. Writes the checkpoint of `step` when it is due (see
        `due`) and returns its path, else None. With `stopping` the write is finished before
        returning (also a background one), so the caller can exit. A failure on any rank (full
        disk, unwritable folder) raises RunError on every rank naming the path; the partial folder
        is removed and never renamed, so the previous checkpoint stays the newest complete one."""
        if not self.due(step, stopping):
            if stopping:
                self.wait()
            return None
        path = self.write(step, trainer_state)
        self.saved_step = step
        if stopping:
            self.wait()
        return path

    def write(self, step: int, trainer_state: dict) -> str:
        """Write the checkpoint of `step` now (in the background with async_save)."""
        self.wait()
        final = os.path.join(self.root, f"step_{step:06d}")
        partial = final + PARTIAL

        def meta_files():
            if rank() == 0:
                shutil.rmtree(partial, ignore_errors=True)
                os.makedirs(os.path.join(partial, "rng"), exist_ok=True)
                meta = {"step": step, "world_size": world_size(),
                        "schedulers": {k: scheduler_state(s) for k, s in self.schedulers.items()}, **trainer_state}
                _write_json(os.path.join(partial, "trainer_state.json"), meta)
                _write_json(os.path.join(partial, "config.json"), self.config)

        _agreed(meta_files, partial)  # every rank waits here for the folder (was a barrier)
        _agreed(lambda: torch.save(rng_state(), os.path.join(partial, "rng", f"rank_{rank()}.pt")), partial)
        state = _dcp_state(self.models, self.optimizers)
        if self.async_save:
            future = dcp.async_save(state, checkpoint_id=partial, process_group=self._pg)
            self._pending = (future, partial, final)
        else:
            _agreed(lambda: dcp.save(state, checkpoint_id=partial), partial)
            _agreed(lambda: self._finalize(partial, final), partial)
        return final

    def poll(self) -> None:
        """Finish a background save if it is done (cheap; call every step)."""
        if self._pending is not None and self._pending[0].done():
            self.wait()

    def wait(self) -> None:
        """Block until the pending background save (if any) is written and made complete."""
        if self._pending is None:
            return
        future, partial, final = self._pending
        self._pending = None
        try:
            future.result()
        except (OSError, CheckpointException) as e:  # a rank-local error: run_main names the rank
            raise RuntimeError(f"background checkpoint save failed: {_reason(e, partial)}; "
                               "the previous checkpoint is intact") from None
        self._finalize(partial, final)

    def _finalize(self, partial: str, final: str) -> None:
        # DCP's coordinator (rank 0) writes .metadata only after every rank's data is written,
        # so once rank 0 is here the checkpoint is whole: make it visible, then prune.
        if rank() != 0:
            return
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(partial, final)
        try:  # the new checkpoint is complete: failing to prune old ones must not fail the save
            self._prune()
        except OSError as e:
            print(f"checkpoint: could not prune old checkpoints ({e})", flush=True)

    def _prune(self) -> None:
        ckpts = list_checkpoints(os.path.dirname(self.root))
        for _, path in ckpts[:-self.keep_last]:
            shutil.rmtree(path, ignore_errors=True)
        newest = ckpts[-1][0] if ckpts else -1
        for name in os.listdir(self.root):  # leftovers of crashed saves that nothing will finish
            step = name[5:-len(PARTIAL)]
            if name.endswith(PARTIAL) and step.isdigit() and int(step) < newest:
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)

    def load(self, path: str) -> dict:
        """Load everything into the already-sharded models, optimizers and schedulers (any world
        size). Returns trainer_state; the loaded step counts as saved."""
        state = _dcp_state(self.models, self.optimizers)
        dcp.load(state, checkpoint_id=path)
        _set_models(self.models, state)
        for k, (m, o) in self.optimizers.items():
            set_optimizer_state_dict(m, o, state[f"optim.{k}"])
        with open(os.path.join(path, "trainer_state.json")) as f:
            meta = json.load(f)
        for k, s in self.schedulers.items():
            load_scheduler_state(s, meta["schedulers"][k])
        rng_file = os.path.join(path, "rng", f"rank_{rank()}.pt")
        if meta["world_size"] == world_size() and os.path.exists(rng_file):
            set_rng_state(torch.load(rng_file, weights_only=False))
        else:
            print0(f"resume: saved on {meta['world_size']} ranks, running on {world_size()}: "
                   "per-rank RNG states not restored (step-seeded randomness is unaffected)")
        self.saved_step = meta["step"]
        return meta


def load_models(path: str, models: dict[str, nn.Module]) -> None:
    """Weights only, from a checkpoint's `model.<name>` entries, into already-sharded models (any
    world size): e.g. stage 2 of DMD2 starting its generator and fake score from stage 1."""
    state = _model_state(models)
    dcp.load(state, checkpoint_id=path)
    _set_models(models, state)


def _reason(e: BaseException, partial: str) -> str:
    """One line for a failed save: the first rank's OSError (DCP wraps them per rank)."""
    if isinstance(e, CheckpointException) and e.failures:
        r, (inner, _) = next(iter(sorted(e.failures.items())))
        return f"rank {r}: {type(inner).__name__}: {inner}"
    return f"{type(e).__name__}: {e}" if str(e) else f"{type(e).__name__} writing {partial}"


def _agreed(fn, partial: str) -> None:
    """Run this rank's part of a save, then learn (collectively) whether every rank's part worked.
    On any failure all ranks raise RunError together; rank 0 removes the partial folder."""
    error = None
    try:
        fn()
    except (OSError, CheckpointException) as e:
        error = _reason(e, partial)
    error = first_error(error)
    if error is not None:
        if rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise RunError(f"checkpoint save to {partial} failed ({error}); the previous checkpoint is intact")


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=str)


# ----------------------------------------------------------------------------------------------
# export to a diffusers folder

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


def portable_json(path: str, class_name: str | None = None) -> None:
    """Rewrite a diffusers JSON (config.json, model_index.json) so it names no machine: drop
    `_name_or_path` (the folder it was loaded from, an absolute path of whoever built it) and,
    given `class_name`, set `_class_name` to it."""
    with open(path) as f:
        data = json.load(f)
    data.pop("_name_or_path", None)
    if class_name:
        data["_class_name"] = class_name
    _write_json(path, data)


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
        _write_json(os.path.join(folder, "diffusion_pytorch_model.safetensors.index.json"), index)
    if rank() == 0:
        check_loadable(folder, {k: v.shape for k, v in sd.items()})


LORA_WEIGHTS = "pytorch_lora_weights.safetensors"


def export_lora(model: nn.Module, out_dir: str, pipeline_class: str, component: str, dtype: torch.dtype) -> str:
    """OUTPUT_DIR/export/pytorch_lora_weights.safetensors: the adapters of a LoRA model in
    diffusers' LoRA format, written by the pipeline's own `save_lora_weights` (peft's key names via
    `get_peft_model_state_dict`, the LoraConfig as adapter metadata, so alpha travels with the
    file), as diffusers' LoRA training examples save theirs. Load it with
    `Pipeline.from_pretrained(base).load_lora_weights(out_dir)`. Collective (gathers the shards)."""
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
        getattr(diffusers, pipeline_class).save_lora_weights(
            partial, weight_name=LORA_WEIGHTS, **{f"{component}_lora_layers": layers,
                                                   f"{component}_lora_adapter_metadata":
                                                       model.peft_config["default"].to_dict()})
        _swap_in(partial, out_dir)
        size = os.path.getsize(os.path.join(out_dir, LORA_WEIGHTS))
        print0(f"export: {out_dir}/{LORA_WEIGHTS} ({len(layers)} tensors, {size / 2**20:.2f} MiB, "
               f"{dtype_name(dtype)}; load with {pipeline_class}.load_lora_weights)")
    barrier()
    return out_dir


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
            tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in load_file(os.path.join(src, name)).items()}
            save_file(tensors, os.path.join(dst, name), metadata={"format": "pt"})


def _place_frozen(src: str, dst: str, dtype: torch.dtype, link_frozen: bool) -> bool:
    """Put a frozen entry of the source folder into the export: a converted copy when it holds
    weights in another dtype than `dtype`, else a link (or copy). Returns whether it converted."""
    if os.path.isdir(src) and _weight_dtypes(src) - {dtype}:
        _copy_as(src, dst, dtype)
        return True
    if os.path.isdir(src):
        os.symlink(src, dst) if link_frozen else shutil.copytree(src, dst)
    else:
        shutil.copy2(src, dst)
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
    _write_json(config, data)
    return True


def _transformers_models(model_path: str) -> set[str]:
    """The components model_index.json loads with transformers (text encoders, tokenizers)."""
    with open(os.path.join(model_path, "model_index.json")) as f:
        index = json.load(f)
    return {k for k, v in index.items() if isinstance(v, list) and v and v[0] == "transformers"}


def export_pipeline(model_path: str, out_dir: str, trained: dict[str, nn.Module], dtype: torch.dtype,
                    link_frozen: bool = True, frozen: dict[str, str] | None = None) -> str:
    """OUTPUT_DIR/export/: a diffusers pipeline folder = the source folder's model_index.json and
    frozen components (symlinked, or copied when link_frozen=False) + the trained components.
    Every component's weights end up in `dtype`: a frozen one stored in another dtype (a shipped
    fp16 text encoder beside an fp32 UNet) is written as a converted copy instead of a link. The
    text encoders' configs say float32 (_pin_fp32_load), so a plain `Pipeline.from_pretrained(export)`
    loads every model in fp32 and `torch_dtype=dtype` every model in `dtype`, both runnable.
    `frozen` maps a component to another folder to use in place of the source's (e.g. a VAE the
    run used instead of the pipeline's own). Written to export.partial/ and swapped in at the end,
    so an old export is never half-replaced."""
    partial = out_dir.rstrip("/") + PARTIAL
    converted, pinned = [], []
    if rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
        text_models = _transformers_models(model_path)
        for name in sorted(os.listdir(model_path)):
            if name in trained:
                continue
            src = os.path.abspath((frozen or {}).get(name) or os.path.join(model_path, name))
            dst = os.path.join(partial, name)
            if _place_frozen(src, dst, dtype, link_frozen):
                converted.append(name)
            if name in text_models and _pin_fp32_load(dst):
                pinned.append(name)
        portable_json(os.path.join(partial, "model_index.json"))
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
    text = (f"{', '.join(trained)} in {name}; frozen parts {'linked' if link_frozen else 'copied'}"
            + (f", {', '.join(converted)} converted to {name}" if converted else "")
            + (f"; {', '.join(pinned)}: config dtype float32, weights {name}" if pinned else ""))
    if dtype == torch.float32:
        return text + "; from_pretrained(path) loads it in fp32"
    return text + (f"; from_pretrained(path, torch_dtype={dtype}) loads it in {name}, "
                   "from_pretrained(path) in fp32")


# ----------------------------------------------------------------------------------------------
# disk preflight: do the run's checkpoints and export fit OUTPUT_DIR's filesystem?

# what DCP adds per written piece (each rank's shard of a tensor, a tensor, one pickled param_groups setting):
# torch.save's framing and its .metadata record, measured 1.6-1.8 KB with torch 2.13
ENTRY_BYTES = 1800


def _gb(n: float) -> str:
    """Bytes as decimal GB (as disks are sold and `df -H` shows), readable for test-sized values too."""
    x = n / 1e9
    return f"{x:.1f} GB" if abs(x) >= 1 else f"{x:.3g} GB"


def _shards(t: torch.Tensor) -> int:
    """How many pieces DCP writes of `t`: a DTensor's shards (replicas are written once), else one."""
    if not isinstance(t, DTensor):
        return 1
    return math.prod(t.device_mesh.size(i) for i, p in enumerate(t.placements) if p.is_shard())


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes DCP writes of `t`'s data over all ranks: a DTensor's global size, a sharded quantised
    subclass (NF4, torchao's optimizer states) by its inner tensors times the shard count, else its
    own bytes. Not the ENTRY_BYTES per piece."""
    local = t._local_tensor if isinstance(t, DTensor) else t
    if isinstance(t, DTensor) and type(local) in (torch.Tensor, nn.Parameter):
        return t.numel() * t.element_size()
    return state_bytes(local) * _shards(t)


def _state_dict_bytes(sd: dict) -> int:
    return sum(tensor_bytes(v) + ENTRY_BYTES * _shards(v) for v in sd.values() if torch.is_tensor(v))


def _new_state_bytes(opt: torch.optim.Optimizer, p: torch.Tensor, group: dict) -> int:
    """What an Adam-style optimizer will create for `p` at its first step: `step` (a float32 scalar)
    and two moments (three with amsgrad), sharded like `p`; torch's are zeros_like(p), torchao's a
    quantised subclass where its rule allows (built on meta and counted, to follow torchao's
    layout), else zeros_like."""
    moments = 3 if group.get("amsgrad") else 2
    step = 4 + ENTRY_BYTES
    subclass_zeros, block = getattr(opt, "_subclass_zeros", None), getattr(opt, "block_size", 0)
    local = p._local_tensor if isinstance(p, DTensor) else p
    if subclass_zeros is None or not block or local.numel() < 4096 or local.numel() % block:
        per = tensor_bytes(p)
    else:
        meta = torch.empty(local.shape, dtype=local.dtype, device="meta")
        per = _shards(p) * state_bytes(subclass_zeros(meta, True, block))  # signed or not: the same bytes
    return step + moments * (per + ENTRY_BYTES * _shards(p))


def optimizer_bytes(opt: torch.optim.Optimizer) -> int:
    """The optimizer's checkpointed states: those it holds, and for a parameter without state yet
    (AdamW creates them at the first step) what it will create. Not via get_optimizer_state_dict,
    which creates missing states by running a step."""
    total = 0
    for group in opt.param_groups:
        total += len(group) * ENTRY_BYTES
        for p in group["params"]:
            state = opt.state.get(p)
            if state:
                total += _state_dict_bytes(state)
            elif p.requires_grad:
                total += _new_state_bytes(opt, p, group)
    return total


def checkpoint_bytes(models: dict[str, nn.Module], optimizers) -> int:
    """Estimated size of one checkpoint's DCP files: every checkpointed model's state (as a save
    takes it: a LoRA model's trainable params only, buffers too) and every optimizer's states.
    `optimizers`: {name: optimizer} or {name: (module, optimizer)}; the count is over all ranks."""
    total = sum(_state_dict_bytes(sd) for sd in _model_state(models).values())
    for o in optimizers.values():
        total += optimizer_bytes(o[1] if isinstance(o, tuple) else o)
    return total


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
                 merged: bool = False, frozen: dict[str, str] | None = None) -> int:
    """Estimated size of what `finish` exports: the trained `component` (`model`'s layout) in `dtype`
    plus the frozen parts export_pipeline places (linked folders cost nothing, converted copies and
    plain files do); with LoRA the adapters in fp32, and the merged pipeline only with `merged`."""
    total = _component_bytes(model, torch.float32, adapters=True) if lora else 0
    if lora and not merged:
        return total
    total += _component_bytes(model, dtype, adapters=False)
    for name in os.listdir(model_path):
        if name == component:
            continue
        src = os.path.abspath((frozen or {}).get(name) or os.path.join(model_path, name))
        if not os.path.isdir(src):
            total += os.path.getsize(src)
        elif _weight_dtypes(src) - {dtype}:
            total += _converted_bytes(src, dtype)
    return total


def disk_verdict(need_one: int, need_all: int, free: int, where: str = "") -> tuple[str, str]:
    """('ok' | 'warn' | 'stop', message): stop when not even one checkpoint fits the free space
    (every save writes a whole new one before pruning), warn when all of the run's do not."""
    if free < need_one:
        return "stop", (f"{where}one checkpoint needs ~{_gb(need_one)} but only {_gb(free)} are free; "
                        "free space or choose another OUTPUT_DIR")
    if free < need_all:
        return "warn", (f"warning: {where}the run's checkpoints and export need ~{_gb(need_all)} but only "
                        f"{_gb(free)} are free: a later save or the export may fail")
    return "ok", ""


def _existing_ancestor(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def _folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, names in os.walk(folder) for f in names)


def disk_preflight(output_dir: str, models: dict[str, nn.Module], optimizers, keep_last: int,
                   export: int) -> str:
    """Collective, before the loop: will KEEP_LAST + 1 checkpoints (the newest is written before
    the oldest is pruned) and the export (`export` bytes) fit the free space of OUTPUT_DIR's
    filesystem? Complete checkpoints already in OUTPUT_DIR are on disk already and pruned as new
    ones come: up to KEEP_LAST of them count against the need, each at most one new checkpoint's
    size. Free space is the least any rank sees. Not even one checkpoint fits: ConfigError on every
    rank; not all of them: a warning on rank 0. Returns (and prints on rank 0) the estimate line."""
    one = checkpoint_bytes(models, optimizers)
    fs = _existing_ancestor(output_dir)
    present = [_folder_bytes(p) for _, p in list_checkpoints(output_dir)]
    present = present[max(len(present) - keep_last, 0):]  # the newest KEEP_LAST: pruned last
    # rank 0's estimate and checkpoints, every rank's free space: every rank decides alike
    views = all_gather_objects((shutil.disk_usage(fs).free, one, present))
    free, (_, one, present) = min(v[0] for v in views), views[0]
    on_disk = sum(min(b, one) for b in present)
    need_all = (keep_last + 1) * one + export - on_disk
    verdict, message = disk_verdict(one, need_all, free, where=f"OUTPUT_DIR={output_dir}: ")
    if verdict == "stop":
        raise ConfigError(message)
    line = (f"disk: one checkpoint ~{_gb(one)}, export ~{_gb(export)}; KEEP_LAST={keep_last} needs ~{_gb(need_all)}"
            + (f" (less {len(present)} on disk)" if present else "") + f", free {_gb(free)} on {fs}")
    print0(line)
    if verdict == "warn":
        print0(message + f"; lower KEEP_LAST or free space on {fs}")
    return line


def scheduler_state(scheduler) -> dict:
    """An LR scheduler's state for trainer_state.json: LRs held as 0-d tensors (torchao's
    optimizers keep `lr` a tensor, so the scheduler's base and last LRs are tensors too) written as
    floats (exactly: their float32 values)."""
    def plain(v):
        if torch.is_tensor(v):
            return v.item()
        return [plain(x) for x in v] if isinstance(v, list) else v
    return {k: plain(v) for k, v in scheduler.state_dict().items()}


def load_scheduler_state(scheduler, state: dict) -> None:
    """The inverse of scheduler_state: where the optimizer holds `lr` as a tensor (torchao), the
    restored LRs are tensors again (of the same float32 values, so a resume stays bit-exact)."""
    scheduler.load_state_dict(state)
    for key in ("base_lrs", "_last_lr"):
        values = getattr(scheduler, key, None)
        if values is not None:
            setattr(scheduler, key, [torch.tensor(v, dtype=g["lr"].dtype, device=g["lr"].device)
                                     if torch.is_tensor(g["lr"]) else v
                                     for v, g in zip(values, scheduler.optimizer.param_groups)])
