"""Sharded checkpoints with torch.distributed.checkpoint (DCP), exact resume and the disk preflight
(the diffusers export is components/export.py).

Layout of OUTPUT_DIR/checkpoints/step_XXXXXX/:
    .metadata, __*_*.distcp       DCP shards: every model (incl. EMA) and optimizer, each rank its own
    trainer_state.json            step, run id, LR schedulers, data position, world size, user extras
    config.json                   the run's final config
    rng/rank_R.pt                 per-rank RNG states (torch, CUDA, numpy, python) as tensors and plain types

Resume loads no pickle of its own: JSON, the RNG files and DCP's non-tensor entries with
torch.load(weights_only=True); only DCP's own `.metadata` is a plain pickle (docs/checkpoints.md).

Every checkpoint names its run (a random id; a resumed run keeps the checkpoint's). A fresh run into
an OUTPUT_DIR that holds checkpoints is refused unless RESUME=new, and pruning only ever removes the
run's own checkpoints; a step's folder is `step_XXXXXX-RUNID` where another run's holds the plain name.

A checkpoint is written to `step_XXXXXX.partial/` and renamed to `step_XXXXXX/` by rank 0 only
after DCP has written `.metadata` (which DCP writes last): a crash at any moment leaves either no
new checkpoint or a complete one, and the previous one untouched. Resharding on load is DCP's, so a
run saved on 2 ranks resumes on 1 or 4.

Before the loop, `disk_preflight` estimates one checkpoint from the built models and optimizers and
compares KEEP_LAST + 1 checkpoints and the export (components.export.export_bytes) with OUTPUT_DIR's
free space.

    python -m pytest tests/test_checkpoint.py tests/test_disk_preflight.py -q
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import pickle
import random
import re
import shutil
import time
import uuid

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint._traverse import set_element
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.tensor import DTensor

from core.dist import all_gather_objects, broadcast_from_rank0, first_error, print0, rank, world_size
from core.errors import ConfigError, RunError
from parallel.lowbit import state_bytes

PARTIAL = ".partial"
NEW = "new"  # RESUME=new: a fresh run even where OUTPUT_DIR holds other runs' checkpoints (they stay)
LEGACY = ""  # the run id of checkpoints that name none (an earlier format)
_FOLDER = re.compile(r"step_(\d+)(?:-[0-9a-f]+)?")  # step_XXXXXX[-RUNID]


def checkpoint_root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def is_complete(path: str) -> bool:
    return (not path.endswith(PARTIAL) and os.path.exists(os.path.join(path, ".metadata"))
            and os.path.exists(os.path.join(path, "trainer_state.json")))


def read_meta(path: str) -> dict:
    """A checkpoint folder's trainer_state.json ({} where missing or unreadable)."""
    try:
        with open(os.path.join(path, "trainer_state.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def run_of(path: str) -> str:
    """The id of the run that wrote the checkpoint at `path` (LEGACY for one that names none)."""
    return str(read_meta(path).get("run_id", LEGACY))


def _folders(output_dir: str) -> list[tuple[int, str, bool]]:
    """Every checkpoint folder in OUTPUT_DIR/checkpoints/ as (step, path, complete), complete or not."""
    root = checkpoint_root(output_dir)
    found = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else ():
        m = _FOLDER.fullmatch(name[:-len(PARTIAL)] if name.endswith(PARTIAL) else name)
        if m:
            path = os.path.join(root, name)
            found.append((int(m.group(1)), path, is_complete(path)))
    return found


def list_checkpoints(output_dir: str, run_id: str | None = None) -> list[tuple[int, str]]:
    """Complete checkpoints, oldest first, as (step, path): of every run, or of run `run_id`."""
    return sorted((step, path) for step, path, complete in _folders(output_dir)
                  if complete and (run_id is None or run_of(path) == run_id))


def resolve_resume(resume: str, output_dir: str) -> str | None:
    """RESUME='' -> fresh start (refused where OUTPUT_DIR holds checkpoints); 'new' -> fresh start
    beside them; 'auto' -> the newest complete checkpoint (or fresh); else that path.
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
    if resume in ("", NEW):
        held = [os.path.basename(path) for _, path, _ in _folders(output_dir)]
        if held and not resume:
            shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
            raise ConfigError(f"OUTPUT_DIR={output_dir} holds checkpoints of an earlier run "
                              f"({shown}): continue it with --resume=auto "
                              f"(RESUME=auto), or start a new run in a new OUTPUT_DIR (or beside them: --resume={NEW})")
        return None
    if resume == "auto":
        return newest_checkpoint(output_dir)
    if not is_complete(resume):
        raise ConfigError(f"RESUME={resume}: not a complete checkpoint folder (no .metadata / trainer_state.json)")
    return resume


def newest_checkpoint(output_dir: str) -> str | None:
    """RESUME=auto: the complete checkpoint saved last (by the time in its trainer_state.json, so
    where RESUME=new put a second run beside a first it is the run that saved last, at the step it
    saved last); checkpoints that name no time (an earlier format) by step, before any that do."""
    def order(path_step):
        step, path = path_step
        saved = read_meta(path).get("saved_at")
        return (saved if isinstance(saved, (int, float)) else -1.0, step)
    ckpts = list_checkpoints(output_dir)
    return max(ckpts, key=order)[1] if ckpts else None


# ----------------------------------------------------------------------------------------------
# RNG

def rng_state() -> dict:
    """This rank's RNG states as tensors and plain types only (torch.load(weights_only=True) reads
    them back): torch's and the CUDA device's as the uint8 tensors torch gives (on the CPU), numpy's
    MT19937 key as an int64 tensor, Python's as its tuple of ints. CUDA: the current device's, the one
    this rank draws on; it goes back into whichever device the resumed rank has."""
    name, key, pos, has_gauss, gauss = np.random.get_state()
    state = {"torch": torch.get_rng_state(),
             "numpy": [name, torch.from_numpy(key.astype(np.int64)), int(pos), int(has_gauss), float(gauss)],
             "python": list(random.getstate())}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state().cpu()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    name, key, *rest = state["numpy"]
    key = key.numpy() if torch.is_tensor(key) else key  # a tensor; a numpy array in the earlier format
    np.random.set_state((name, key.astype(np.uint32), *rest))
    random.setstate(tuple(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# what an RNG file of the earlier format holds besides plain types: numpy's key array. Allowed (as
# weights_only allows them: numpy's array rebuild, nothing callable else) so those checkpoints resume.
_MULTIARRAY = getattr(np, "_core", None) or np.core  # numpy 2 renamed numpy.core to numpy._core
_NUMPY_ARRAY = (np.ndarray, np.dtype, _MULTIARRAY.multiarray._reconstruct, type(np.dtype(np.uint32)))


def load_rng_state(path: str) -> dict:
    """An RNG file, read with weights_only=True (never running a pickle's code); a file that needs
    more fails in one line naming it."""
    try:
        with torch.serialization.safe_globals(list(_NUMPY_ARRAY)):
            return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        raise RunError(f"{path}: not RNG states of tensors and plain types, refused to unpickle ({_refusal(e)}); "
                       "delete the rng/ folder to resume without restoring RNG states") from None


def _refusal(e: BaseException) -> str:
    """The gist of torch's many-line weights_only refusal: what it would not unpickle."""
    m = re.search(r"WeightsUnpickler error: (.*?)(?: Please use|$)", str(e), re.M)
    lines = str(e).strip().splitlines()
    return m.group(1).strip() if m else lines[-1] if lines else type(e).__name__


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


class _WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading a checkpoint's non-tensor entries (optimizer param_groups
    settings) with weights_only=True: DCP itself unpickles them unrestricted. Tensors DCP already
    reads weights_only; its `.metadata` stays a pickle (docs/checkpoints.md)."""

    def load_bytes(self, read_item, value) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def _dcp_load(state: dict, path: str) -> None:
    """dcp.load with the weights_only planner; an entry it refuses fails in one line naming `path`."""
    try:
        dcp.load(state, checkpoint_id=path, planner=_WeightsOnlyLoadPlanner())
    except CheckpointException as e:
        refused = [inner for inner, _ in e.failures.values() if isinstance(inner, pickle.UnpicklingError)]
        if not refused:
            raise
        raise RunError(f"{path}: an entry is not tensors and plain types, refused to unpickle "
                       f"({_refusal(refused[0])})") from None


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

    Its checkpoints name the run (`run_id`: a new random id, or the loaded checkpoint's), and pruning
    to the newest `keep_last` only ever removes this run's.

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
        self.run_id = uuid.uuid4().hex[:8]  # only rank 0's is used: rank 0 writes the meta and prunes
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
        final = broadcast_from_rank0(self._folder(step) if rank() == 0 else None)
        partial = final + PARTIAL

        def meta_files():
            if rank() == 0:
                shutil.rmtree(partial, ignore_errors=True)
                os.makedirs(os.path.join(partial, "rng"), exist_ok=True)
                meta = {"step": step, "run_id": self.run_id, "saved_at": time.time(), "world_size": world_size(),
                        "schedulers": {k: scheduler_state(s) for k, s in self.schedulers.items()}, **trainer_state}
                write_json(os.path.join(partial, "trainer_state.json"), meta)
                write_json(os.path.join(partial, "config.json"), self.config)

        _agreed(meta_files, partial)  # its collective is the barrier: every rank waits here for the folder
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
        if os.environ.get("FSDP_TEST_SAVE_DELAY_S"):  # tests only: a save slower than a launcher's shutdown wait
            time.sleep(float(os.environ["FSDP_TEST_SAVE_DELAY_S"]))
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(partial, final)
        try:  # the new checkpoint is complete: failing to prune old ones must not fail the save
            self._prune()
        except OSError as e:
            print(f"checkpoint: could not prune old checkpoints ({e})", flush=True)

    def _folder(self, step: int) -> str:
        """Where step `step` goes: step_XXXXXX, or step_XXXXXX-RUNID where that name (complete or
        .partial) holds another run's checkpoint, which is never overwritten."""
        plain = os.path.join(self.root, f"step_{step:06d}")
        taken = any(os.path.exists(os.path.join(p, "trainer_state.json")) and run_of(p) != self.run_id
                    for p in (plain, plain + PARTIAL))
        return f"{plain}-{self.run_id}" if taken else plain

    def _prune(self) -> None:
        """Keep this run's newest `keep_last` checkpoints; remove this run's crashed saves older than
        its newest. Other runs' checkpoints and crashed saves are left alone."""
        output_dir = os.path.dirname(self.root)
        ckpts = list_checkpoints(output_dir, self.run_id)
        for _, path in ckpts[:-self.keep_last]:
            shutil.rmtree(path, ignore_errors=True)
        newest = ckpts[-1][0] if ckpts else -1
        for step, path, complete in _folders(output_dir):  # leftovers of crashed saves that nothing will finish
            if not complete and step < newest and run_of(path) == self.run_id:
                shutil.rmtree(path, ignore_errors=True)

    def load(self, path: str) -> dict:
        """Load everything into the already-sharded models, optimizers and schedulers (any world
        size). Returns trainer_state; the loaded step counts as saved."""
        state = _dcp_state(self.models, self.optimizers)
        _dcp_load(state, path)
        _set_models(self.models, state)
        for k, (m, o) in self.optimizers.items():
            set_optimizer_state_dict(m, o, state[f"optim.{k}"])
        with open(os.path.join(path, "trainer_state.json")) as f:
            meta = json.load(f)
        for k, s in self.schedulers.items():
            load_scheduler_state(s, meta["schedulers"][k])
        rng_file = os.path.join(path, "rng", f"rank_{rank()}.pt")
        if meta["world_size"] == world_size() and os.path.exists(rng_file):
            set_rng_state(load_rng_state(rng_file))
        else:
            print0(f"resume: saved on {meta['world_size']} ranks, running on {world_size()}: "
                   "per-rank RNG states not restored (step-seeded randomness is unaffected)")
        self.saved_step = meta["step"]
        self.run_id = str(meta.get("run_id", LEGACY))  # the run goes on: its checkpoints stay its own
        return meta


def load_models(path: str, models: dict[str, nn.Module]) -> None:
    """Weights only, from a checkpoint's `model.<name>` entries, into already-sharded models (any
    world size): e.g. stage 2 of DMD2 starting its generator and fake score from stage 1."""
    state = _model_state(models)
    _dcp_load(state, path)
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


def write_json(path: str, obj) -> None:
    """Written beside and moved into place: never half-written, and a hard-linked file (an export's frozen
    part) gets a file of its own instead of writing through the link into its source."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)


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
                   export: int, resume: str | None = None) -> str:
    """Collective, before the loop: will KEEP_LAST + 1 checkpoints (the newest is written before
    the oldest is pruned) and the export (`export` bytes) fit the free space of OUTPUT_DIR's
    filesystem? The complete checkpoints in OUTPUT_DIR of the run that `resume` (a checkpoint path)
    continues are on disk already and pruned as new ones come: up to KEEP_LAST of them count against
    the need, each at most one new checkpoint's size (a fresh run has none; other runs' stay). Free
    space is the least any rank sees. Not even one checkpoint fits: ConfigError on every rank; not
    all of them: a warning on rank 0. Returns (and prints on rank 0) the estimate line."""
    one = checkpoint_bytes(models, optimizers)
    fs = _existing_ancestor(output_dir)
    present = [_folder_bytes(p) for _, p in list_checkpoints(output_dir, run_of(resume))] if resume else []
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
