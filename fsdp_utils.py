"""What both training scripts stand on: distributed init, device mesh, FSDP2 wrapping, meta-device
loading from diffusers folders, grad clipping, memory report, config overrides, logging.

Everything here calls PyTorch directly: `torch.distributed.fsdp.fully_shard` per block, then the
root; DTensor for sharded params; `init_device_mesh` for FSDP (1-D) and HSDP (2-D).

    python -m pytest tests/test_fsdp_utils.py -q
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import difflib
import json
import math
import os
import resource
import signal
import socket
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor


class ConfigError(Exception):
    """A mistake in settings or inputs that every rank sees identically: rank 0 reports it in one
    line and every rank exits with code 2, before any collective is left waiting."""


# ----------------------------------------------------------------------------------------------
# rank-aware printing and error handling

def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def print0(*args, **kwargs) -> None:
    if rank() == 0:
        print(*args, **kwargs, flush=True)


def run_main(main_fn) -> None:
    """Run a script's main(): errors end the process with one clear line and a non-zero code.

    A ConfigError is the same on every rank, so only rank 0 prints it and all exit 2. Any other
    exception is local to one rank: that rank prints it once with its rank number and exits at
    once (os._exit) without entering another collective; torchrun then stops the other ranks, and
    the collective timeout set in init_distributed turns any leftover wait into an error.
    """
    try:
        main_fn()
    except ConfigError as e:
        if rank() == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        _teardown_quietly()
        sys.exit(2)
    except Preempted as e:
        # the checkpoint is saved: a launcher's SIGTERM (torchrun sends one to the other ranks as
        # soon as the first exits) must not turn this rank's exit code 128+signal into a kill
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        if rank() == 0:
            print(f"stopped: {e}", file=sys.stderr, flush=True)
        _teardown_quietly()
        sys.exit(128 + e.signum)
    except RunError as e:
        if rank() == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        _teardown_quietly()
        sys.exit(1)
    except KeyboardInterrupt:
        print(f"[rank {rank()}] interrupted", file=sys.stderr, flush=True)
        os._exit(130)
    except Exception as e:  # noqa: BLE001 - the point is to report any failure once
        import traceback
        if os.environ.get("FSDP_TRACEBACK"):
            traceback.print_exc()
        print(f"[rank {rank()}] error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)


def _teardown_quietly() -> None:
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


class Preempted(Exception):
    """Raised by a script after it saved a checkpoint on SIGTERM/SIGINT; run_main exits 128+signal."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum


class RunError(Exception):
    """A failure during training that every rank has learnt of together (through a collective:
    a failed save, too many non-finite steps): rank 0 reports it in one line, all ranks exit 1."""


class GracefulStop:
    """SIGTERM / SIGINT (cluster preemption, Ctrl-C): remember it; the training loop asks
    `should_stop()` once per step (a collective), so all ranks finish the same step, save together
    and exit. A second signal exits at once."""

    def __init__(self):
        self.signum: int | None = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.signum is not None:
            os._exit(128 + signum)
        self.signum = signum
        print(f"[rank {rank()}] {signal.Signals(signum).name}: finishing this step and saving a checkpoint "
              "(signal again to quit at once)", file=sys.stderr, flush=True)

    def should_stop(self) -> bool:
        """True on every rank as soon as any rank was signalled. From then on the rank saves and
        exits by itself: a SIGTERM (torchrun forwards one to every rank as soon as the first one
        exits) is ignored so it cannot cut the save or the final message short; a SIGINT (a
        user's second Ctrl-C) still exits at once."""
        stop = not all_ranks_agree(self.signum is None)
        if stop:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return stop

    def signal_received(self) -> int:
        """The signal to report (SIGTERM if this rank only heard of it from another rank)."""
        return self.signum or signal.SIGTERM


# ----------------------------------------------------------------------------------------------
# config: UPPER_CASE constants at the top of a script, overridden as --name=value

CONFIG_TYPES = (bool, int, float, str, list)


def script_constants(namespace: dict) -> dict:
    """The settings of a script: its UPPER_CASE module constants of plain types."""
    return {k: v for k, v in namespace.items()
            if k.isupper() and not k.startswith("_") and isinstance(v, CONFIG_TYPES)}


def _parse_value(name: str, raw: str, default):
    kind = type(default)
    try:
        if kind is bool:
            low = raw.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if kind is int:
            return int(raw)
        if kind is float:
            return float(raw)
        if kind is list:
            text = raw.strip()
            items = json.loads(text) if text.startswith("[") else [v.strip() for v in text.split(",") if v.strip()]
            if not isinstance(items, list):
                raise ValueError
            return [_parse_value(name, str(v), default[0]) for v in items] if default else items
        return raw
    except (ValueError, json.JSONDecodeError):
        raise ConfigError(f"--{name.lower()}={raw!r}: expected {kind.__name__}") from None


def apply_overrides(namespace: dict, argv: list[str]) -> dict:
    """Apply `--name=value` overrides (case-insensitive, type-checked) to a script's constants,
    in place in `namespace`. Returns the final config dict. Unknown names suggest close matches."""
    consts = script_constants(namespace)
    by_lower = {k.lower(): k for k in consts}
    for arg in argv:
        if not arg.startswith("--") or "=" not in arg:
            raise ConfigError(f"argument {arg!r}: write settings as --name=value")
        key, raw = arg[2:].split("=", 1)
        name = by_lower.get(key.lower().replace("-", "_"))
        if name is None:
            close = difflib.get_close_matches(key.lower(), list(by_lower), n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join('--' + c for c in close)}?" if close else ""
            raise ConfigError(f"unknown setting --{key}{hint}")
        namespace[name] = _parse_value(name, raw, consts[name])
    return script_constants(namespace)


def format_config(config: dict) -> str:
    width = max(len(k) for k in config)
    return "\n".join(f"  {k.ljust(width)} = {v!r}" for k, v in config.items())


# ----------------------------------------------------------------------------------------------
# distributed init / mesh

@dataclass
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(cpu_offload: bool = False, timeout_s: float = 1800.0) -> Dist:
    """Init the default process group under torchrun, or as a 1-rank group for `python script.py`.

    CUDA -> NCCL bound to this rank's GPU (device_id); with CPU offload a `cuda:nccl,cpu:gloo`
    group so reductions of CPU-resident grads work. No GPU -> gloo on CPU. The timeout turns a
    stuck rank into an error instead of an endless hang (long enough for real checkpoint saves).
    """
    if "RANK" not in os.environ:  # plain `python script.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    rank_, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    timeout = datetime.timedelta(seconds=timeout_s)
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "cuda:nccl,cpu:gloo" if cpu_offload else "nccl"
        dist.init_process_group(backend, timeout=timeout, device_id=device)
    else:
        device, backend = torch.device("cpu"), "gloo"
        # ranks on one host share its cores; oversubscription makes CPU runs crawl
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
        dist.init_process_group(backend, timeout=timeout)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        _exit_with_launcher()
    return Dist(rank_, world, local_rank, device, backend)


def _exit_with_launcher(poll_s: float = 0.5) -> None:
    """torchrun starts each worker in a session of its own, so a SIGKILL of the launcher (or of its
    process group) leaves the workers running on as orphans, still training and saving into
    OUTPUT_DIR while the next `RESUME=auto` run starts. A daemon thread ends this rank at once when
    its launcher is gone; a half-written save stays a .partial folder that resume ignores."""
    launcher = os.getppid()

    def watch():
        while os.getppid() == launcher:
            time.sleep(poll_s)
        print(f"rank {rank()}: the torchrun launcher (pid {launcher}) is gone; exiting", file=sys.stderr, flush=True)
        os._exit(1)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


def cleanup_distributed() -> None:
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def check_dp_replicate(dp_replicate: int, world: int | None = None) -> None:
    """Fails before any work if the world cannot be split into DP_REPLICATE equal replicas."""
    world = world_size() if world is None else world
    if dp_replicate < 1 or world % dp_replicate:
        raise ConfigError(f"DP_REPLICATE={dp_replicate} does not divide the world size {world}")


def build_mesh(device: torch.device, dp_replicate: int = 1) -> DeviceMesh:
    """FSDP: a 1-D mesh ("dp_shard",). HSDP: a 2-D mesh ("dp_replicate", "dp_shard") — parameters
    sharded inside each replica group, replicated (all-reduced) across groups."""
    world = world_size()
    check_dp_replicate(dp_replicate, world)
    if dp_replicate == 1:
        return init_device_mesh(device.type, (world,), mesh_dim_names=("dp_shard",))
    return init_device_mesh(device.type, (dp_replicate, world // dp_replicate),
                            mesh_dim_names=("dp_replicate", "dp_shard"))


def all_ranks_agree(ok: bool, device: torch.device | None = None) -> bool:
    """True only if `ok` is True on every rank (a MIN all-reduce): lets all ranks take the same
    branch, e.g. skip a step whose loss was non-finite on one rank."""
    if not dist.is_initialized() or world_size() == 1:
        return ok
    flag = torch.tensor([1.0 if ok else 0.0], device=device or _comm_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item() > 0.5)


def _comm_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def mean_across_ranks(values: dict[str, float]) -> dict[str, float]:
    """Average scalar metrics over ranks (for logging), one all-reduce."""
    if not values or not dist.is_initialized() or world_size() == 1:
        return dict(values)
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t)
    return {k: v / world_size() for k, v in zip(keys, t.tolist())}


# ----------------------------------------------------------------------------------------------
# block detection and FSDP2 wrapping

def find_block_classes(model: nn.Module, names: list[str] | None = None) -> tuple[list[str], str]:
    """Which module classes get their own `fully_shard` unit, and why.

    Named classes are checked to exist. With none named: the model's `_no_split_modules`, else the
    repeated non-leaf module class holding the most parameters."""
    present = Counter(type(m).__name__ for m in model.modules())
    if names:
        missing = [n for n in names if n not in present]
        if missing:
            raise ConfigError(f"block class(es) {missing} not found in {type(model).__name__}; "
                              f"repeated classes there: {_repeated_classes(model)[:6]}")
        return list(names), "named by the caller"
    declared = [n for n in (getattr(model, "_no_split_modules", None) or []) if n in present]
    if declared:
        return declared, f"{type(model).__name__}._no_split_modules"
    ranked = _repeated_classes(model)
    if not ranked:
        return [], "no repeated block class: the whole model is one unit"
    return [ranked[0]], f"largest repeated class by parameter count (candidates: {ranked[:4]})"


def _repeated_classes(model: nn.Module) -> list[str]:
    counts, params = Counter(), Counter()
    for m in model.modules():
        if m is model or not any(True for _ in m.children()):
            continue
        name = type(m).__name__
        counts[name] += 1
        params[name] += sum(p.numel() for p in m.parameters())
    return [n for n, _ in sorted(((n, params[n]) for n in counts if counts[n] >= 2), key=lambda x: -x[1])]


def _checkpointed(module: nn.Module) -> None:
    """Per-block activation checkpointing: recompute the block in backward instead of storing its
    activations. Patching the instance's forward keeps parameter names (and so checkpoints)
    unchanged; FSDP2's hooks run around it and unshard the params before the recompute."""
    inner = module.forward

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy, *,
               block_classes: list[str] | None = None, reshard_after_forward: bool = True,
               cpu_offload: bool = False, activation_checkpointing: bool = False,
               prefetch: int = 0, verbose: bool = True) -> list[nn.Module]:
    """`fully_shard` every block of the chosen classes (inner before outer), then the root.

    - the last block in execution order is not resharded after forward: backward needs it first
    - activation checkpointing wraps each outermost block
    - prefetch > 0 sets explicit forward/backward prefetch of that many blocks ahead
    Returns the sharded blocks in registration (≈ execution) order.
    """
    names, why = find_block_classes(model, block_classes)
    blocks = [m for m in model.modules() if m is not model and type(m).__name__ in names]
    if verbose:
        print0(f"fsdp: {type(model).__name__}: {len(blocks)} units of {names} ({why})")
    if activation_checkpointing:
        outer = _outermost(blocks)
        for b in outer:
            _checkpointed(b)
    # pinned host memory speeds H2D copies on GPUs; there is no pinning without an accelerator
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    last = blocks[-1] if blocks else None
    # only the root hands its output back in output_dtype (fp32 for losses); blocks pass compute
    # dtype on, so the root's own layers (conv_out, proj_out) see inputs in their compute dtype
    block_policy = dataclasses.replace(mp_policy, output_dtype=None)
    for b in reversed(blocks):  # children before parents: nested units are allowed in FSDP2
        fully_shard(b, mesh=mesh, mp_policy=block_policy, offload_policy=offload,
                    reshard_after_forward=reshard_after_forward and b is not last)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, offload_policy=offload, reshard_after_forward=False)
    if prefetch > 0 and len(blocks) > 1:
        flat = [b for b in blocks if isinstance(b, FSDPModule)]
        for i, b in enumerate(flat):
            b.set_modules_to_forward_prefetch(flat[i + 1:i + 1 + prefetch])
            b.set_modules_to_backward_prefetch(flat[max(0, i - prefetch):i][::-1])
    return blocks


PARALLELISMS = ("fsdp", "ddp")


def check_parallelism(parallelism: str, cpu_offload: bool, dp_replicate: int) -> None:
    """PARALLELISM=fsdp (sharded, the default) or ddp (full replicas, for comparison and small
    models); the FSDP-only settings are refused under ddp before any work."""
    if parallelism not in PARALLELISMS:
        raise ConfigError(f"PARALLELISM={parallelism!r}: choose one of {list(PARALLELISMS)}")
    if parallelism == "ddp" and cpu_offload:
        raise ConfigError("PARALLELISM=ddp with CPU_OFFLOAD=1: CPU offload is an FSDP feature; use fsdp")
    if parallelism == "ddp" and dp_replicate != 1:
        raise ConfigError(f"PARALLELISM=ddp with DP_REPLICATE={dp_replicate}: DDP replicates on every "
                          "rank already; DP_REPLICATE (HSDP) needs fsdp")


def apply_ddp(model: nn.Module, device: torch.device, mp_policy: MixedPrecisionPolicy, *,
              block_classes: list[str] | None = None, activation_checkpointing: bool = False,
              verbose: bool = True) -> nn.Module:
    """Plain `DistributedDataParallel` over a materialised model: a full replica per rank, grads
    all-reduced (averaged) in buckets during backward. Returns the DDP wrapper, to be used only for
    training forwards; keep the unwrapped model for checkpoints, EMA, samples and export.

    The same precision contract as `apply_fsdp`: floating inputs cast to `mp_policy.param_dtype`
    (the compute dtype), the forward under autocast when the stored params are wider than it
    (bf16-mixed: fp32 master weights, bf16 matmuls), floating outputs handed back in
    `output_dtype` (fp32 for losses). Activation checkpointing uses the same per-block patch."""
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils._pytree import tree_map
    if activation_checkpointing:
        names, _ = find_block_classes(model, block_classes)
        for b in _outermost([m for m in model.modules() if m is not model and type(m).__name__ in names]):
            _checkpointed(b)
    stored = {p.dtype for p in model.parameters() if p.requires_grad}
    compute, out_dtype = mp_policy.param_dtype, mp_policy.output_dtype
    autocast = compute is not None and any(d != compute for d in stored)
    if autocast:  # norms with fp32 weights take bf16 inputs under autocast: correct, just unfused
        import warnings
        warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
    if verbose:
        print0(f"ddp: {type(model).__name__}: full replica per rank"
               + (f", autocast to {compute}" if autocast else ""))
    ddp = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None,
                                  gradient_as_bucket_view=True)
    inner = ddp.forward

    def cast(dtype):
        return lambda t: t.to(dtype) if torch.is_tensor(t) and t.is_floating_point() and dtype else t

    def forward(*args, **kwargs):
        if compute is not None and mp_policy.cast_forward_inputs:
            args, kwargs = tree_map(cast(compute), (args, kwargs))
        with torch.autocast(device.type, dtype=compute, enabled=autocast):
            out = inner(*args, **kwargs)
        return tree_map(cast(out_dtype), out)

    ddp.forward = forward
    return ddp


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper (FSDP2 modules are their own model)."""
    return getattr(model, "module", model)


def _outermost(blocks: list[nn.Module]) -> list[nn.Module]:
    inner = {id(c) for b in blocks for c in b.modules() if c is not b}
    return [b for b in blocks if id(b) not in inner]


def prepare_frozen(model: nn.Module, mesh: DeviceMesh | None, dtype: torch.dtype, device: torch.device, *,
                   sharded: bool, block_classes: list[str] | None = None, verbose: bool = True) -> nn.Module:
    """A frozen component (teacher, VAE, text encoder): eval mode, no grads ever, stored in its
    compute dtype; sharded per block like a trainable model, or replicated on every rank."""
    model.requires_grad_(False).eval()
    model.to(dtype)
    if sharded and mesh is not None:
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype, output_dtype=torch.float32)
        apply_fsdp(model, mesh, policy, block_classes=block_classes, reshard_after_forward=True, verbose=verbose)
        if any(p.device.type == "meta" for p in model.parameters()):
            return model  # caller materialises (meta-device loading)
        model.to(device)
    else:
        model.to(device)
    return model


def assert_sharded(model: nn.Module, mesh: DeviceMesh) -> None:
    """Every parameter is a DTensor on `mesh` (guards against a block that escaped wrapping)."""
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor) or p.device_mesh != mesh:
            raise AssertionError(f"parameter {name} is not sharded on the expected mesh")


# ----------------------------------------------------------------------------------------------
# meta-device build + sharded loading from a diffusers folder

WEIGHT_NAMES = ("diffusion_pytorch_model.safetensors", "model.safetensors")


def weight_map(folder: str) -> dict[str, str]:
    """{tensor name: safetensors file} for a diffusers/transformers component folder,
    single-file or sharded (`*.safetensors.index.json`)."""
    for base in WEIGHT_NAMES:
        index = os.path.join(folder, base + ".index.json")
        if os.path.exists(index):
            with open(index) as f:
                wm = json.load(f)["weight_map"]
            return {k: os.path.join(folder, v) for k, v in wm.items()}
        single = os.path.join(folder, base)
        if os.path.exists(single):
            from safetensors import safe_open
            with safe_open(single, framework="pt") as f:
                return {k: single for k in f.keys()}
    raise ConfigError(f"{folder}: no *.safetensors weights (or index) found")


def build_on_meta(model_cls, folder: str) -> nn.Module:
    """The model skeleton from `folder/config.json`, on the meta device: no memory, no init."""
    if not os.path.exists(os.path.join(folder, "config.json")):
        raise ConfigError(f"{folder}: no config.json — not a diffusers model folder")
    mark_rss_baseline()
    config = model_cls.load_config(folder)
    with torch.device("meta"):
        return model_cls.from_config(config)


def materialize_and_load(model: nn.Module, folder: str, device: torch.device) -> None:
    """Allocate the (already sharded) meta model on `device` and fill it from safetensors.

    Each rank reads only the rows of each tensor that it owns (safetensors slices are lazy, memory-
    mapped), so no rank ever holds more than its shard plus one slice: a 12 B transformer loads
    without 12 B parameters of host RAM anywhere. Stored dtype is cast to the model's dtype."""
    from safetensors import safe_open
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    model.to_empty(device=device)
    files = weight_map(folder)
    handles: dict[str, object] = {}
    with contextlib.ExitStack() as stack, torch.no_grad():
        def slice_of(name):
            path = files.get(name)
            if path is None:
                raise ConfigError(f"{folder}: weights have no tensor {name!r} (wrong model kind or config?)")
            if path not in handles:
                handles[path] = stack.enter_context(safe_open(path, framework="pt"))
            return handles[path].get_slice(name)

        tensors = dict(model.named_parameters())
        tensors.update(model.named_buffers())
        for name, t in tensors.items():
            sl = slice_of(name)
            if list(sl.get_shape()) != list(t.shape):
                raise ConfigError(f"{folder}: {name} has shape {sl.get_shape()}, model expects {list(t.shape)}")
            if isinstance(t, DTensor):
                local = t.to_local()
                shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
                if local.numel() == 0:
                    continue
                index = tuple(slice(o, o + s) for o, s in zip(offset, shape))
                local.copy_(sl[index].to(local.dtype))
            else:
                t.copy_(sl[:].to(t.dtype))
        extra = set(files) - set(tensors)
        if extra:
            raise ConfigError(f"{folder}: weights hold tensors the model lacks, e.g. {sorted(extra)[:3]}")


def fill_built_model(model: nn.Module, folder: str, mesh: DeviceMesh | None, home: torch.device,
                     load: bool = True) -> nn.Module:
    """The last step of a meta-device build: allocate the (sharded, or with mesh=None whole) model
    on `home` and load it from `folder` (load=False: allocate only, e.g. an EMA copy filled from
    the model), then check that every parameter is sharded on `mesh`."""
    if load:
        materialize_and_load(model, folder, home)
    else:
        model.to_empty(device=home)
    if mesh is not None:
        assert_sharded(model, mesh)
    return model


# ----------------------------------------------------------------------------------------------
# gradients

def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """Total grad norm over (possibly DTensor) grads, clipped to max_norm when max_norm > 0.
    Returns the pre-clip norm as a plain tensor, identical on every rank."""
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return torch.tensor(0.0)
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


# ----------------------------------------------------------------------------------------------
# memory

def _local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def local_state_bytes(models: dict[str, nn.Module], optimizers: dict[str, torch.optim.Optimizer]) -> dict:
    """Bytes this rank holds of parameters, gradients and optimizer state."""
    params = sum(_local_bytes(p) for m in models.values() for p in m.parameters())
    grads = sum(_local_bytes(p.grad) for m in models.values() for p in m.parameters() if p.grad is not None)
    optim = sum(_local_bytes(v) for o in optimizers.values() for s in o.state.values()
                for v in s.values() if torch.is_tensor(v))
    return {"params": params, "grads": grads, "optim": optim}


def peak_host_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def host_rss_bytes() -> int:
    """Resident set size now (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


_RSS_BASELINE: list[int] = []


def mark_rss_baseline() -> None:
    """Remember the host RSS before the first model is built (build_on_meta calls this): imports,
    data and text cache are in it, models are not. memory_report prints it as rss_base."""
    if not _RSS_BASELINE:
        _RSS_BASELINE.append(host_rss_bytes())


def memory_report(models: dict[str, nn.Module], optimizers: dict[str, torch.optim.Optimizer]) -> str:
    """Per-rank table (collective): local params / grads / optimizer bytes, peak host RSS, peak CUDA."""
    row = local_state_bytes(models, optimizers)
    row["rss_peak"] = peak_host_rss_bytes()
    row["cuda_peak"] = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    # grads as held during a step (the table's grads are 0 between steps, after zero_grad)
    row["grads_held"] = sum(_local_bytes(p) for m in models.values() for p in m.parameters() if p.requires_grad)
    row["rss_base"] = _RSS_BASELINE[0] if _RSS_BASELINE else 0
    rows = [row]
    if dist.is_initialized() and world_size() > 1:
        rows = [None] * world_size()
        dist.all_gather_object(rows, row)
    cols = ["params", "grads", "optim", "rss_peak", "cuda_peak"]
    lines = ["rank  " + "  ".join(c.rjust(10) for c in cols)]
    for r, vals in enumerate(rows):
        lines.append(f"{r:<4}  " + "  ".join(_mib(vals[c]).rjust(10) for c in cols))
    lines.append("memory_bytes " + json.dumps(rows))  # machine-readable (benchmarks.py)
    return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}MiB" if n < 2**30 else f"{n / 2**30:.2f}GiB"


# ----------------------------------------------------------------------------------------------
# data order and randomness shared by both scripts

def step_generator(seed: int, step: int, stream: int = 0) -> torch.Generator:
    """A CPU generator seeded from (seed, step, stream): randomness for the *global* batch of a
    step, identical on every rank and after a resume, whatever the world size."""
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + step * 9_176 + stream * 7_919) % (2**63 - 1))
    return g


def global_batch_indices(step: int, global_batch: int, n: int, seed: int) -> list[int]:
    """Dataset indices of the global batch of `step`: epochs of seeded permutations laid end to
    end, so the data position is just the step (resumable on any world size)."""
    out, pos = [], step * global_batch
    while len(out) < global_batch:
        epoch, offset = divmod(pos, n)
        perm = torch.randperm(n, generator=step_generator(seed, epoch, stream=99)).tolist()
        take = perm[offset:offset + global_batch - len(out)]
        out += take
        pos += len(take)
    return out


def rank_slice(items, rank_: int, world: int):
    """This rank's contiguous share of a global batch (list or tensor along dim 0)."""
    per = len(items) // world
    return items[rank_ * per:(rank_ + 1) * per]


# ----------------------------------------------------------------------------------------------
# logging: one line per step, tqdm bar on rank 0, JSONL metrics

class RunLogger:
    """`step 00042/10000 | loss_dm 0.1234 | ... | 812 ms` lines, a tqdm bar, and metrics.jsonl."""

    def __init__(self, output_dir: str, max_steps: int, start_step: int = 0):
        self.max_steps, self.is_main = max_steps, rank() == 0
        self.bar, self.file = None, None
        if self.is_main:
            from tqdm import tqdm
            os.makedirs(output_dir, exist_ok=True)
            self.file = open(os.path.join(output_dir, "metrics.jsonl"), "a")
            self.bar = tqdm(total=max_steps, initial=start_step, dynamic_ncols=True, file=sys.stdout)
        self._t = time.perf_counter()

    def step_done(self, step: int, metrics: dict | None) -> None:
        """Advance the bar; if metrics were given (a logging step), write the line and the JSONL."""
        now = time.perf_counter()
        ms, self._t = (now - self._t) * 1000, now
        if not self.is_main:
            return
        self.bar.update(1)
        if metrics is None:
            return
        record = {"step": step, **{k: float(v) for k, v in metrics.items()}, "step_ms": round(ms, 1)}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        parts = [f"step {step:05d}/{self.max_steps}"] + [f"{k} {v:.4g}" for k, v in metrics.items()]
        self.bar.write(" | ".join(parts + [f"{ms:.0f} ms"]))

    def close(self) -> None:
        if self.is_main:
            self.bar.close()
            self.file.close()


def is_finite(*values: float) -> bool:
    return all(math.isfinite(float(v)) for v in values)


# ----------------------------------------------------------------------------------------------
# optimisation helpers shared by both scripts

def warmup_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Constant LR after a linear warmup over `warmup_steps` optimizer steps (DMD2's schedule)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, _Warmup(warmup_steps))


class _Warmup:
    def __init__(self, steps: int):
        self.steps = steps

    def __call__(self, step: int) -> float:
        return min(1.0, (step + 1) / self.steps) if self.steps > 0 else 1.0


def reshard_all(model: nn.Module) -> None:
    """Free the gathered params that a no-grad forward leaves behind (the root and the last block
    skip reshard-after-forward; only a backward reshards them). Needed before editing shards in
    place: a gathered unit shows its unsharded params in .parameters() and would not see the edit."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


@torch.no_grad()
def ema_update(ema: nn.Module, model: nn.Module, decay: float) -> None:
    """ema ← decay·ema + (1−decay)·model, shard by shard (both sharded identically, no comms)."""
    reshard_all(ema)
    reshard_all(model)
    for pe, pm in zip(ema.parameters(), model.parameters()):
        le = pe.to_local() if isinstance(pe, DTensor) else pe
        lm = pm.to_local() if isinstance(pm, DTensor) else pm
        le.lerp_(lm.to(le.dtype), 1.0 - decay)


@torch.no_grad()
def copy_params(dst: nn.Module, src: nn.Module) -> None:
    """Copy the local shards of src into dst (identically sharded), e.g. to start an EMA."""
    reshard_all(dst)
    reshard_all(src)
    for pd, ps in zip(dst.parameters(), src.parameters()):
        ld = pd.to_local() if isinstance(pd, DTensor) else pd
        ld.copy_(ps.to_local() if isinstance(ps, DTensor) else ps)


# ----------------------------------------------------------------------------------------------
# data files shared by both scripts: validated up front, identically on every rank

def load_records(path: str, required: tuple[str, ...], image_keys: tuple[str, ...] = (),
                 skip_bad: bool = False, check_images: bool = True) -> tuple[list[dict], int]:
    """Rows of a `.jsonl` (or prompts of a `.txt`, one a line) with image paths made absolute
    (relative to the file). A bad row -> ConfigError naming file and line, or with skip_bad it is
    dropped and counted. Every rank reads the whole file, so all ranks agree on errors and length."""
    if not path or not os.path.isfile(path):
        raise ConfigError(f"DATA_PATH={path!r}: no such file")
    base, rows, skipped = os.path.dirname(os.path.abspath(path)), [], 0
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = _parse_row(path, line, required, image_keys, base, check_images)
        except ValueError as e:
            if not skip_bad:
                raise ConfigError(f"{path}:{lineno}: {e}") from None
            skipped += 1
            continue
        rows.append(row)
    if not rows:
        raise ConfigError(f"{path}: no usable samples ({skipped} skipped)")
    return rows, skipped


def _parse_row(path, line, required, image_keys, base, check_images) -> dict:
    if path.endswith(".txt"):
        return {"prompt": line.strip()}
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg})") from None
    if not isinstance(row, dict):
        raise ValueError("expected a JSON object")
    for key in required:
        if not isinstance(row.get(key), str) or not row[key].strip():
            raise ValueError(f"missing or empty {key!r}")
    for key in image_keys:
        full = os.path.join(base, row[key])
        if check_images:
            _check_image(full)
        row[key] = full
    return row


def _check_image(path: str) -> None:
    from PIL import Image
    if not os.path.isfile(path):
        raise ValueError(f"image {path} not found")
    try:
        with Image.open(path) as im:
            im.verify()
    except Exception as e:  # noqa: BLE001 - any decoder failure means a corrupt file
        raise ValueError(f"image {path} is unreadable ({type(e).__name__})") from None


def save_image_grid(images: torch.Tensor, path: str, nrow: int) -> None:
    """(N,3,H,W) in [-1,1] -> one PNG grid with `nrow` images per row."""
    import numpy as np
    from PIL import Image
    images = ((images.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).cpu()
    n, c, h, w = images.shape
    rows = math.ceil(n / nrow)
    grid = torch.zeros(c, rows * h, nrow * w, dtype=torch.uint8)
    for i in range(n):
        r, col = divmod(i, nrow)
        grid[:, r * h:(r + 1) * h, col * w:(col + 1) * w] = images[i]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    Image.fromarray(np.ascontiguousarray(grid.permute(1, 2, 0).numpy())).save(path)


# ----------------------------------------------------------------------------------------------
# fault tolerance shared by both scripts: inputs checked up front, non-finite steps, agreed errors

def check_output_dir(path: str) -> None:
    """OUTPUT_DIR must be creatable and writable (a probe file is written and removed), so a bad
    path fails before any work instead of at the first save."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write_test.{socket.gethostname()}.{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"OUTPUT_DIR={path!r} is not writable ({e.strerror or e})") from None


_COMPONENT_FILES = ("config.json", "scheduler_config.json", "tokenizer_config.json", "tokenizer.json", "vocab.json")


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
        found = isinstance(entry, list) and len(entry) == 2 and entry[1] or None
        if not os.path.isdir(folder) or not any(os.path.isfile(os.path.join(folder, f)) for f in _COMPONENT_FILES):
            problems.append(f"{name}/")
        elif cls and found and found != cls:
            problems.append(f"{name} (is {found}, need {cls})")
    if problems:
        raise ConfigError(f"{setting}={path}: a {meta.get('_class_name', 'diffusers')} folder, not the {pipeline} "
                          f"layout this script trains: missing {', '.join(problems)}")


class NonFiniteGuard:
    """Skips optimizer steps whose loss or gradient norm is non-finite on any rank: `step_ok()` is a
    collective (MIN all-reduce), so every rank takes the same branch and no rank steps alone.
    Counts skipped steps (`skipped_steps` in metrics and checkpoints); `exhausted` after
    `max_in_a_row` bad steps in a row, when the script saves and stops with RunError."""

    def __init__(self, max_in_a_row: int):
        self.max_in_a_row, self.skipped, self.in_a_row = max_in_a_row, 0, 0

    def step_ok(self, *values) -> bool:
        good = all_ranks_agree(is_finite(*values))
        if good:
            self.in_a_row = 0
        else:
            self.skipped += 1
            self.in_a_row += 1
        return good

    @property
    def exhausted(self) -> bool:
        return self.in_a_row >= self.max_in_a_row

    def state(self) -> dict:
        return {"skipped_steps": self.skipped, "bad_steps_in_a_row": self.in_a_row}

    def load(self, meta: dict) -> None:
        self.skipped, self.in_a_row = int(meta.get("skipped_steps", 0)), int(meta.get("bad_steps_in_a_row", 0))

    def error(self, step: int) -> RunError:
        return RunError(f"{self.in_a_row} non-finite steps in a row (MAX_BAD_STEPS={self.max_in_a_row}) at step "
                        f"{step}; checkpoint saved. Lower the LR or check the data, then --resume=auto")


def first_error(error: str | None) -> str | None:
    """Collective: the first failing rank's message (None when every rank succeeded), on every
    rank, so all ranks stop together after a local failure (e.g. one rank's disk is full)."""
    if not dist.is_initialized() or world_size() == 1:
        return error
    errors = [None] * world_size()
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e), None)


if __name__ == "__main__":
    # `python fsdp_utils.py plan --model=NAME --world_size=N ...`: the memory planner (memory_plan.py)
    if sys.argv[1:2] != ["plan"]:
        sys.exit("usage: python fsdp_utils.py plan --model=NAME --world_size=N [--gpu_memory_gb=G] ...")
    from memory_plan import main as plan_main
    sys.exit(plan_main(sys.argv[2:]))
