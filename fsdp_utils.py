"""Distributed training mechanics, and only that: process groups (with a single-process fallback),
device meshes (FSDP, HSDP, data x context parallel), generic FSDP2 sharding of a model's units
(`fully_shard` per unit, then the root), DDP, frozen parts, sharding checks, clipping over DTensor
shards, resharding.

Everything here calls PyTorch directly. Which modules are a model's units, and in which order, is
the model's recipe in parallel/parallelize.py; LoRA, EMA, compile, context parallelism, loading and
the memory report are in parallel/ too. Run control (errors, signals, settings, logging) and the
optimizer are in components/; data order and files in data/. The memory planner is
tools/memory_plan.py.

    python -m pytest tests/test_fsdp_utils.py -q
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
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

from core.dist import barrier, gather_before_init, print0, rank, world_size
from core.launch import cpu_threads, gpu_index, host_and_gpu, shared_gpus, slurm_rank_env
from core.errors import ConfigError

# ----------------------------------------------------------------------------------------------
# process groups and meshes

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
    """Init the default process group under torchrun, under srun without torchrun (one task per
    GPU, the ranks from SLURM's variables: slurm_rank_env), or as a 1-rank group for `python
    script.py`.

    CUDA -> NCCL bound to this rank's GPU (device_id); with CPU offload a `cuda:nccl,cpu:gloo`
    group so reductions of CPU-resident grads work. No GPU -> gloo on CPU. The timeout turns a
    stuck rank into an error instead of an endless hang (long enough for real checkpoint saves).
    Before NCCL connects, every rank's (host, GPU) goes through the rendezvous store: two ranks on
    one GPU stop in one line naming them (NCCL's own start-up would fail on it naming neither).
    """
    from_srun = slurm_rank_env(os.environ)
    if from_srun:
        os.environ.update(from_srun)
    elif "RANK" not in os.environ:  # plain `python script.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    rank_, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    timeout = datetime.timedelta(seconds=timeout_s)
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", gpu_index(local_rank, local_world, torch.cuda.device_count(),
                                                same_devices="TORCHELASTIC_RUN_ID" in os.environ))
        torch.cuda.set_device(device)
    store = next(dist.rendezvous("env://", rank_, world, timeout=timeout))[0]
    store.set_timeout(timeout)
    devices = gather_before_init(store, rank_, world, "fsdp_utils/devices", host_and_gpu(device))
    shared = shared_gpus([tuple(d.split("\t")) for d in devices])
    if shared:
        raise ConfigError(shared)
    store = dist.PrefixStore("default_pg", store)  # as init_process_group names its own store's keys
    if device.type == "cuda":
        backend = "cuda:nccl,cpu:gloo" if cpu_offload else "nccl"
        dist.init_process_group(backend, store=store, rank=rank_, world_size=world, timeout=timeout, device_id=device)
    else:
        backend = "gloo"
        dist.init_process_group(backend, store=store, rank=rank_, world_size=world, timeout=timeout)
    torch.set_num_threads(cpu_threads(local_world, per_task=bool(from_srun)))
    if "TORCHELASTIC_RUN_ID" in os.environ:
        _exit_with_launcher()
    if from_srun:
        print0(f"srun: {world} tasks, {local_world} on this node, rendezvous at "
               f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}")
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
        barrier()
        dist.destroy_process_group()


def check_dp_replicate(dp_replicate: int, world: int | None = None) -> None:
    """Fails before any work if the world cannot be split into DP_REPLICATE equal replicas."""
    world = world_size() if world is None else world
    if dp_replicate < 1 or world % dp_replicate:
        raise ConfigError(f"DP_REPLICATE={dp_replicate} does not divide the world size {world}")


def check_context_parallel(context_parallel: int, dp_replicate: int, world: int | None = None) -> None:
    """Fails before any work if the world cannot be laid out as replicas x shards x CP groups."""
    world = world_size() if world is None else world
    if context_parallel < 1:
        raise ConfigError(f"CONTEXT_PARALLEL={context_parallel}: must be >= 1 (1 = off)")
    if world % (context_parallel * dp_replicate):
        raise ConfigError(f"CONTEXT_PARALLEL={context_parallel} x DP_REPLICATE={dp_replicate} does not divide "
                          f"the world size {world}")


def build_meshes(device: torch.device, dp_replicate: int = 1,
                 context_parallel: int = 1) -> tuple[DeviceMesh, DeviceMesh | None]:
    """(FSDP mesh, CP mesh or None). Without CP: FSDP's 1-D mesh ("dp_shard",), or with
    dp_replicate > 1 HSDP's 2-D mesh ("dp_replicate", "dp_shard"): parameters sharded inside each
    replica group, replicated (all-reduced) across groups. With
    context_parallel = C > 1 the world is laid out (dp_replicate, dp_shard, ring=1, ulysses=C), CP
    innermost: a CP group is C consecutive ranks (one node's GPUs, where the all-to-alls are
    cheapest), the data-parallel rank is rank // C. FSDP shards over dp_shard x ring x ulysses
    flattened ("dp_shard_cp"), so the model states spread over every rank as without CP
    (torchtitan's layout, torchtitan/distributed/parallel_dims.py). The CP mesh has the
    ("ring", "ulysses") dims diffusers' ContextParallelConfig(mesh=...) expects."""
    world = world_size()
    check_dp_replicate(dp_replicate, world)
    check_context_parallel(context_parallel, dp_replicate, world)
    if context_parallel == 1:
        if dp_replicate == 1:
            return init_device_mesh(device.type, (world,), mesh_dim_names=("dp_shard",)), None
        return init_device_mesh(device.type, (dp_replicate, world // dp_replicate),
                                mesh_dim_names=("dp_replicate", "dp_shard")), None
    shard = world // (dp_replicate * context_parallel)
    root = init_device_mesh(device.type, (dp_replicate, shard, 1, context_parallel),
                            mesh_dim_names=("dp_replicate", "dp_shard", "ring", "ulysses"))
    root["dp_shard", "ring", "ulysses"]._flatten("dp_shard_cp")
    fsdp_mesh = root["dp_shard_cp"] if dp_replicate == 1 else root["dp_replicate", "dp_shard_cp"]
    return fsdp_mesh, root["ring", "ulysses"]


def data_parallel_rank(context_parallel: int = 1) -> tuple[int, int]:
    """(rank, size) of this rank's data-parallel group: the C ranks of a CP group (consecutive, see
    build_meshes) share one slice of every batch."""
    return rank() // context_parallel, world_size() // context_parallel



# ----------------------------------------------------------------------------------------------
# FSDP2: units, sharding them, reading them back

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


def checkpoint_activations(module: nn.Module) -> None:
    """Per-block activation checkpointing: recompute the block in backward instead of storing its
    activations. Patching the instance's forward keeps parameter names (and so checkpoints)
    unchanged; FSDP2's hooks run around it and unshard the params before the recompute."""
    inner = module.forward

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward
    module.activation_checkpointed = True  # MFU's counter adds its forward once more for HFU


def outermost(blocks: list[nn.Module]) -> list[nn.Module]:
    inner = {id(c) for b in blocks for c in b.modules() if c is not b}
    return [b for b in blocks if id(b) not in inner]


@dataclass(frozen=True)
class Sharding:
    """How a model is sharded: the scripts' settings of the same names (activation checkpointing
    and compile are applied by the model's recipe, before shard_units)."""
    reshard_after_forward: bool | None = True  # free each unit's gathered params after its forward (ZeRO-3);
    # None: decided per model (auto_reshard)
    cpu_offload: bool = False  # sharded params, grads and optimizer state live in host memory
    activation_checkpointing: bool = False  # recompute each outermost unit in backward
    prefetch: int = 0  # > 0: explicit forward/backward prefetch of this many units ahead
    compile: bool = False  # torch.compile each innermost unit's forward (after AC, before fully_shard)
    frozen: bool = False  # a model that never runs backward: every unit, the last and the root too, reshards

    def never_backward(self) -> Sharding:
        """The same sharding for a copy that only runs no-grad forwards (an EMA): its units are the
        same, each resharded after its forward (nothing to keep for a backward)."""
        return dataclasses.replace(self, frozen=True)


def shard_units(model: nn.Module, units: list[nn.Module], mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy,
                sharding: Sharding = Sharding()) -> list[nn.Module]:
    """`fully_shard` each unit (inner before outer), then the root; `units` in execution order
    (the model's recipe, parallel/parallelize.py, gives them so, after activation checkpointing and
    compile).

    - the last unit in execution order is not resharded after forward: backward needs it first;
      a frozen model (no backward ever) reshards every unit and its root, or they stay gathered
    - only the root hands its output back in `output_dtype` (fp32 for losses); units pass the
      compute dtype on, so the root's own layers (conv_out, proj_out) see their compute dtype
    - prefetch > 0 sets explicit forward/backward prefetch of that many units ahead
    Returns `units`, now FSDP modules."""
    # pinned host memory speeds H2D copies on GPUs; there is no pinning without an accelerator
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if sharding.cpu_offload else OffloadPolicy()
    last = units[-1] if units else None
    unit_policy = dataclasses.replace(mp_policy, output_dtype=None)
    ignored = unsharded_on_one_rank(model, mesh)
    after_forward = sharding.reshard_after_forward
    if after_forward is None and not sharding.frozen:
        after_forward, why = auto_reshard(model, mesh, mp_policy, sharding.cpu_offload)
        print0(f"fsdp: {type(model).__name__}: {why}")
    for u in reversed(units):  # children before parents: nested units are allowed in FSDP2
        reshard = sharding.frozen or (after_forward and u is not last)
        fully_shard(u, mesh=mesh, mp_policy=unit_policy, offload_policy=offload, reshard_after_forward=reshard,
                    ignored_params=ignored)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, offload_policy=offload, reshard_after_forward=sharding.frozen,
                ignored_params=ignored)
    if sharding.prefetch > 0 and len(units) > 1:
        n = sharding.prefetch
        for i, u in enumerate(units):
            u.set_modules_to_forward_prefetch(units[i + 1:i + 1 + n])
            u.set_modules_to_backward_prefetch(units[max(0, i - n):i][::-1])
    return units


RESHARD_FREE_SHARE = 0.1  # auto: reshard-free only while the gathered copy is at most this share of the memory


def parse_reshard(value) -> bool | None:
    """RESHARD_AFTER_FORWARD: auto (None: auto_reshard decides per model), 1 or 0."""
    if isinstance(value, bool):
        return value
    low = str(value).strip().lower()
    if low == "auto":
        return None
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"RESHARD_AFTER_FORWARD={value!r}: choose auto, 1 or 0")


def device_memory_bytes(device_type: str) -> int:
    """The memory one rank computes in: its GPU's, or the host's RAM on CPU."""
    if device_type == "cuda":
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def reshard_free_fits(shard_ranks: int, cpu_offload: bool, copy_bytes: int, memory_bytes: int) -> tuple[bool, str]:
    """RESHARD_AFTER_FORWARD=auto's rule, shared with tools/memory_plan.py: (reshard after forward?,
    why). Across ranks, resharding frees the gathered copies between forward and backward (ZeRO-3).
    A shard group of one rank (world size 1, or HSDP with DP_REPLICATE = world: full replicas)
    gathers nothing: FSDP2's "all-gather" is a cast-copy of each parameter into the compute dtype,
    made in forward and, when resharded, again in backward. Keeping it saves the second copy and
    changes no number (the same values, copied once). The copy stays from forward to backward, so
    it is kept only while it is at most RESHARD_FREE_SHARE of the device's memory, and never under
    CPU offload (whose point is the least GPU memory)."""
    if shard_ranks > 1:
        return True, f"reshard after forward ({shard_ranks} ranks per shard group)"
    gib = f"{copy_bytes / 2**30:.2f} GiB"
    if cpu_offload:
        return True, "reshard after forward (one rank per shard group, but CPU_OFFLOAD keeps GPU memory least)"
    if copy_bytes > RESHARD_FREE_SHARE * memory_bytes:
        return True, (f"reshard after forward (one rank per shard group; its {gib} compute copy is over "
                      f"{RESHARD_FREE_SHARE:.0%} of the device's {memory_bytes / 2**30:.0f} GiB)")
    return False, (f"reshard-free (one rank per shard group: its {gib} compute copy, at most "
                   f"{RESHARD_FREE_SHARE:.0%} of the device's {memory_bytes / 2**30:.0f} GiB, is cast once per step, "
                   "not again in backward)")


def auto_reshard(model: nn.Module, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy,
                 cpu_offload: bool = False) -> tuple[bool, str]:
    """RESHARD_AFTER_FORWARD=auto for one model about to be sharded on `mesh` (reshard_free_fits).
    Returns (reshard after forward?, a line saying why)."""
    left = unsharded_on_one_rank(model, mesh) or set()
    copy = sum(p.numel() * (mp_policy.param_dtype or p.dtype).itemsize for p in model.parameters() if p not in left)
    return reshard_free_fits(shard_group_size(mesh), cpu_offload, copy, device_memory_bytes(mesh.device_type))


def shard_group_size(mesh: DeviceMesh) -> int:
    """Ranks that shard one copy of the parameters: the mesh's last dim (HSDP: inside a replica)."""
    return mesh.size(mesh.ndim - 1)


def has_all_gather_extension(p: torch.Tensor) -> bool:
    """Whether a parameter's storage is a tensor subclass with its own FSDP2 all-gather
    (fsdp_pre_all_gather / fsdp_post_all_gather: torchao's NF4Tensor, parallel/lowbit.py)."""
    return hasattr(getattr(p, "_local_tensor", p), "fsdp_pre_all_gather")


def unsharded_on_one_rank(model: nn.Module, mesh: DeviceMesh) -> set[nn.Parameter] | None:
    """The parameters FSDP2 must leave alone on a mesh of one rank: those with an all-gather
    extension. torch 2.13's world-size-1 shortcut (_fsdp_param_group.py, wait_for_unshard) copies
    only the first of an extension's all-gather inputs and NF4 has three; with one rank there is
    nothing to shard, so they stay plain (frozen) tensors of the module. HSDP with DP_REPLICATE =
    world takes the same shortcut: its shard groups are of one rank."""
    if shard_group_size(mesh) != 1:
        return None
    return {p for p in model.parameters() if has_all_gather_extension(p)} or None


def fsdp_units(model: nn.Module) -> list[tuple[str, int]]:
    """(module name, parameter count) of each FSDP unit of a sharded model, root last: the params
    that one all-gather of that unit brings in (its own, not those of units nested in it)."""
    fsdp = [(n, m) for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    owned, out = set(), []
    for name, m in sorted(fsdp, key=lambda nm: -nm[0].count(".") if nm[0] else 1):  # inner first
        ps = [p for p in m.parameters() if id(p) not in owned]
        owned.update(id(p) for p in ps)
        out.append((name or "<root>", sum(p.numel() for p in ps)))
    return out


def assert_sharded(model: nn.Module, mesh: DeviceMesh) -> None:
    """Every parameter is a DTensor on `mesh` (guards against a block that escaped wrapping)."""
    left = unsharded_on_one_rank(model, mesh) or set()
    for name, p in model.named_parameters():
        if (not isinstance(p, DTensor) or p.device_mesh != mesh) and p not in left:
            raise AssertionError(f"parameter {name} is not sharded on the expected mesh")



# ----------------------------------------------------------------------------------------------
# DDP, frozen parts

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


def apply_precision(model: nn.Module, mp_policy: MixedPrecisionPolicy) -> nn.Module:
    """FSDP2's MixedPrecisionPolicy contract for a model that is not sharded (PARALLELISM=ddp: the
    trained replicas, their EMA, a frozen teacher), patched on the instance's forward so that every
    caller gets it (the DDP wrapper's training forwards, samples, validation, the pipelines):
    floating inputs cast to `mp_policy.param_dtype` (the compute dtype), the forward under autocast
    when some parameter is stored wider than it (bf16-mixed: fp32 master weights; LoRA: fp32
    adapters on a bf16 base), floating outputs handed back in `output_dtype` (fp32 for losses).
    Without it a bf16 replica fails on the fp32 inputs FSDP2 would have cast. Returns `model`."""
    from torch.utils._pytree import tree_map
    compute, out_dtype = mp_policy.param_dtype, mp_policy.output_dtype
    autocast = compute is not None and any(p.dtype != compute for p in model.parameters() if p.is_floating_point())
    if autocast:  # norms with fp32 weights take bf16 inputs under autocast: correct, just unfused
        import warnings
        warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
    inner = model.forward

    def cast(dtype):
        return lambda t: t.to(dtype) if torch.is_tensor(t) and t.is_floating_point() and dtype else t

    def forward(*args, **kwargs):
        if compute is not None and mp_policy.cast_forward_inputs:
            args, kwargs = tree_map(cast(compute), (args, kwargs))
        device = next(model.parameters()).device
        with torch.autocast(device.type, dtype=compute, enabled=autocast):
            out = inner(*args, **kwargs)
        return tree_map(cast(out_dtype), out)

    model.forward = forward
    return model


def apply_ddp(model: nn.Module, device: torch.device, verbose: bool = True) -> nn.Module:
    """Plain `DistributedDataParallel` over a materialised model: a full replica per rank, grads
    all-reduced (averaged) in buckets during backward. Returns the DDP wrapper, to be used only for
    training forwards; keep the unwrapped model for checkpoints, EMA, samples and export. The
    model's recipe (parallel/parallelize.py with mesh=None) has already given it activation
    checkpointing, compile and the precision contract (apply_precision). dynamo's DDPOptimizer
    (which splits a graph compiled inside DDP's forward at gradient bucket boundaries, and refuses
    the checkpoint higher-order op) is off: each compiled block is already a small graph, and DDP's
    reducer still all-reduces buckets as grads arrive."""
    from torch.nn.parallel import DistributedDataParallel
    torch._dynamo.config.optimize_ddp = False
    if verbose:
        print0(f"ddp: {type(model).__name__}: full replica per rank")
    # frozen quantised weights (an NF4 base) are identical on every rank by construction, and DDP's
    # start-up broadcast and shape check take plain tensors only: leave them out of DDP's view
    quantised = [n for n, p in model.named_parameters() if not p.requires_grad and has_all_gather_extension(p)]
    if quantised:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, quantised)
    return DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None,
                                   gradient_as_bucket_view=True)


@contextlib.contextmanager
def gradient_sync(model: nn.Module, last_micro_batch: bool):
    """Around one micro-batch's forward and backward under gradient accumulation (DDP decides in
    the forward): communicate what can wait only on the last micro-batch, where that costs no
    memory. DDP: no all-reduce until the last (`no_sync`; the local grads accumulate in place).
    HSDP: no cross-replica all-reduce until the
    last (`set_requires_all_reduce(False)`: the reduce-scattered shards accumulate; the
    replica all-reduce is the one that crosses nodes). Plain FSDP keeps its per-micro-batch
    reduce-scatter: skipping it would hold the unsharded gradients (a full copy) until the end."""
    from torch.nn.parallel import DistributedDataParallel
    if isinstance(model, DistributedDataParallel) and not last_micro_batch:
        with model.no_sync():
            yield
        return
    if isinstance(model, FSDPModule):
        model.set_requires_all_reduce(last_micro_batch)
    yield


def prepare_frozen(model: nn.Module, dtype: torch.dtype, device: torch.device | None = None) -> nn.Module:
    """A frozen component (teacher, VAE, text encoder): eval mode, no grads ever, stored in its
    compute dtype `dtype` (precision.Precision.frozen_mp_policy: no cast, no reduction). With
    `device`, moved there (a replica on every rank); a sharded one goes through its model's recipe
    (parallel/parallelize.py) instead."""
    model.requires_grad_(False).eval()
    model.to(dtype)
    return model if device is None else model.to(device)



# ----------------------------------------------------------------------------------------------
# shards: the local part of a DTensor, filling it, freeing gathered params

def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; a plain tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def fill_local(t: torch.Tensor, read) -> None:
    """Copy into `t` (a DTensor shard or a plain tensor) the part of the full tensor it holds;
    `read(index)` returns the full tensor at `index` (a tuple of slices, or slice(None): all of it)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    if isinstance(t, DTensor):
        local = t.to_local()
        if local.numel() == 0:
            return
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        local.copy_(read(tuple(slice(o, o + s) for o, s in zip(offset, shape))).to(local.dtype))
    else:
        t.copy_(read(slice(None)).to(t.dtype))


def reshard_all(model: nn.Module) -> None:
    """Free the gathered params that a no-grad forward leaves behind (the root and the last block
    skip reshard-after-forward; only a backward reshards them). Needed before editing shards in
    place: a gathered unit shows its unsharded params in .parameters() and would not see the edit."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


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
