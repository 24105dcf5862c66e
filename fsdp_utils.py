"""Distributed training, and only that: process-group init with a single-process fallback, the
device mesh, FSDP2 wrapping (`fully_shard` per block, then the root) and the per-model
parallelize recipes, frozen components, meta-device build with sharded loading from diffusers
folders, grad clipping over DTensor shards, resharding, EMA of sharded params, memory report.

Everything here calls PyTorch directly: `torch.distributed.fsdp.fully_shard` per block, then the
root; DTensor for sharded params; `init_device_mesh` for FSDP (1-D) and HSDP (2-D), and for the
data-parallel x context-parallel layout (build_meshes, enable_context_parallel). Run control
(errors, signals, settings, logging) is run_utils.py; data order and files are data_utils.py.

    python fsdp_utils.py plan --model=flux-kontext-dev --world_size=4 --gpu_memory_gb=24
    python -m pytest tests/test_fsdp_utils.py -q
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import resource
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

from run_utils import ConfigError, print0, rank, world_size

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
    return build_meshes(device, dp_replicate)[0]


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
    """(FSDP mesh, CP mesh or None). Without CP: build_mesh's 1-D or 2-D mesh. With
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


@contextlib.contextmanager
def _accelerator_count_at_least_one():
    """diffusers' enable_parallelism records a device as rank % torch.accelerator.device_count(),
    which divides by zero on a CPU-only machine (diffusers/models/modeling_utils.py,
    _resolve_parallel_config); that device is not used by the CP attention or hooks. Only then,
    and only for the call, the count reads 1."""
    real = torch.accelerator.device_count
    if real() > 0:
        yield
        return
    torch.accelerator.device_count = lambda: 1
    try:
        yield
    finally:
        torch.accelerator.device_count = real


def enable_context_parallel(model: nn.Module, cp_mesh: DeviceMesh) -> None:
    """Context parallelism on a (sharded) diffusers model, by diffusers' own implementation:
    Ulysses attention (ContextParallelConfig(ulysses_degree=C)), whose autograd function
    all-to-alls q/k/v from sequence-split to head-split, runs the attention over the full
    sequence for H/C heads, and all-to-alls the output and, in backward, the grads back
    (diffusers/models/attention_dispatch.py, TemplatedUlyssesAttention). The model's _cp_plan
    (FluxTransformer2DModel: hidden_states, encoder_hidden_states, img_ids, txt_ids split along the
    sequence at the root; proj_out's output all-gathered, whose backward keeps this rank's slice)
    places the splits, so every rank of a CP group returns the full output.

    Why Ulysses and not ring: it is exact with the ordinary (flash / memory-efficient) SDPA kernel,
    needs two all-to-alls per attention instead of C-1 KV rotations, and FLUX's 24 heads divide
    every CP size a node offers (2, 4, 8); diffusers' ring attention merges partial results by their
    log-sum-exp, which its native SDPA backend (the one that runs everywhere, CPU included) cannot
    return. Gradient scale: every rank of a CP group
    computes the same loss from the gathered output, and its param grads hold only its tokens'
    share; FSDP2 averages over dp x cp ranks, so the caller multiplies the loss by C before
    backward (FSDP's set_gradient_divide_factor would do it, but needs PREMUL_SUM, which gloo lacks)."""
    from diffusers.models._modeling_parallel import ContextParallelConfig
    from diffusers.utils import logging as diffusers_logging
    config = ContextParallelConfig(ulysses_degree=cp_mesh["ulysses"].size(), mesh=cp_mesh)
    level = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()  # its "experimental feature" warning, once per model and rank
    try:
        with _accelerator_count_at_least_one():
            model.enable_parallelism(config=config)
    finally:
        diffusers_logging.set_verbosity(level)


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


# torch.compile per unit
#
# What is compiled is each unit's `forward`, patched on the instance like _checkpointed does: the
# block's own forward, or with activation checkpointing the checkpoint wrapper, so the recompute
# is inside the compiled region (a checkpoint higher-order op that AOTAutograd replays in the
# backward graph). That is torchtitan's order, AC -> compile -> fully_shard
# (torchtitan/models/llama3/infra/parallelize.py: apply_ac, then apply_compile per TransformerBlock,
# then apply_fsdp). torchtitan swaps each block for torch.compile's OptimizedModule, whose
# state-dict keys gain an `_orig_mod.` prefix; patching `forward` keeps the module tree, parameter
# names, checkpoints, exports, EMA and LoRA code exactly as without compile. FSDP2's pre- and
# post-forward hooks run in nn.Module.__call__, around the patched forward, so, as in torchtitan,
# all-gathers, reduce-scatters and dtype casts stay eager, outside the compiled region, and the
# compiled graph takes the unsharded parameters as inputs.
#
# Sharing and recompiles. Dynamo inlines nn.Module calls and lifts parameters to graph inputs (the
# only behaviour in current torch), caching compiled code per Python code object behind guards on
# input and parameter shapes, dtypes, requires_grad and grad mode. So all blocks of one class and
# shape share one compiled graph (FLUX: one per block kind for the whole stack, per grad mode), and
# each other shape adds an entry to that code object's cache: the UNet's ResnetBlock2D at every
# (in, out) channel pair and its BasicTransformerBlock at every width, and, with activation
# checkpointing, all unit classes share the checkpoint wrapper's one code object. Past
# `torch._dynamo.config.recompile_limit` entries (8) dynamo stops compiling that code object and
# runs it eagerly; the shipped 2-level shapes UNet with AC hit that in its first forward (9 unit
# shapes). compile_units therefore raises the limit to 4 entries per distinct unit shape in this
# process ({grad, no grad} x {first input shapes, dynamic shapes after an input shape changes}):
# it bounds the cache without ever falling back to eager. compile_report counts what happened.
#
# Graph breaks, measured (torch 2.13, diffusers 0.42.1, CPU): none without context parallelism.
# FLUX: 0 in FluxTransformerBlock
# and FluxSingleTransformerBlock (one graph each). UNet: 0 in ResnetBlock2D and BasicTransformerBlock,
# whose Python-side branches (deprecated `scale` kwarg checks, norm-type and attention-processor
# dispatch, peft's LoRA layer loops) are resolved at trace time and guarded, not broken on. DMD's
# first fp32 step on the shapes teacher compiles 27 graphs, 9 unit shapes x {trained params with
# grad (generator and fake score share them), the same without grad (the fake score inside the DM
# loss), the frozen teacher}; its samples add 9 (a new batch size: dynamic shapes). Measured with
# and without AC, with LoRA, in fp32 and bf16-mixed, under FSDP and DDP. Even the whole
# UNet2DConditionModel and FluxTransformer2DModel trace as one graph each
# (forward and backward). The root units stay eager here by design (their stem, time embedding,
# samplers and Transformer2DModel projections run once per forward, around FSDP's root hooks).
# The one break seen: FLUX with CONTEXT_PARALLEL > 1, at each attention. diffusers' Ulysses
# attention is an autograd.Function whose backward (attention_dispatch.py,
# _native_attention_backward_op) calls requires_grad_(True) on its saved q/k/v to recompute SDPA
# under enable_grad, a side effect dynamo cannot trace inside the Function, so the all-to-all
# attention runs eagerly between two compiled graphs per block (tiny FLUX, 2 ranks, CP 2: 9
# graphs, 9 breaks; losses and grad norms equal to eager CP).

_COMPILED_UNIT_SHAPES: set = set()  # (class, compute dtype, parameter shapes/dtypes/requires_grad) compiled here
_ENTRIES_PER_UNIT_SHAPE = 4


def compile_units(units: list[nn.Module], mp_policy: MixedPrecisionPolicy | None = None) -> list[nn.Module]:
    """torch.compile (inductor) the forward of each innermost unit of `units` in place (a unit that
    holds another unit stays eager: compiling it would pull the inner unit's FSDP hooks into the
    graph). Call after activation checkpointing and before fully_shard. Returns the compiled units."""
    inner = _innermost(units)
    compute = mp_policy.param_dtype if mp_policy is not None else None
    for u in inner:
        _COMPILED_UNIT_SHAPES.add((type(u).__name__, compute,
                                   tuple((tuple(p.shape), p.dtype, p.requires_grad) for p in u.parameters())))
        u.forward = torch.compile(u.forward)
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, _ENTRIES_PER_UNIT_SHAPE * len(_COMPILED_UNIT_SHAPES))
    cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, cfg.recompile_limit)
    return inner


def compile_blocks(model: nn.Module, block_classes: list[str] | None = None,
                   mp_policy: MixedPrecisionPolicy | None = None) -> list[nn.Module]:
    """compile_units on the blocks the model's FSDP recipe would shard (or `block_classes`), for a
    model that is not sharded (PARALLELISM=ddp: trained replicas in apply_ddp, DMD's frozen teacher)."""
    names, _ = find_block_classes(model, list(block_classes or MODEL_BLOCKS.get(type(model).__name__, ())))
    return compile_units(blocks_of(model, names), mp_policy)


def compile_report(label: str = "compile") -> str:
    """One line about torch.compile in this process so far: graphs compiled (recompiles included),
    graph breaks with their deduplicated reasons, recompile-limit fallbacks to eager, seconds spent
    compiling (dynamo + AOTAutograd + inductor, forward and backward)."""
    from torch._dynamo.utils import calculate_time_spent, counters
    breaks = counters["graph_break"]
    line = (f"{label}: {counters['stats']['unique_graphs']} graphs, {sum(breaks.values())} graph breaks "
            f"({calculate_time_spent().get('total_wall_time', 0.0):.1f} s compiling)")
    fallbacks = sum(n for reason, n in counters["unimplemented"].items() if "recompile limit" in reason.lower())
    if fallbacks:
        line += f"; recompile limit hit {fallbacks}x (those calls run eagerly)"
    if breaks:
        reasons = Counter()
        for reason, n in breaks.items():
            reasons[_break_reason(reason)] += n
        line += "; breaks: " + "; ".join(f"{r} (x{n})" for r, n in reasons.most_common())
    return line


def _break_reason(message: str) -> str:
    """A graph-break counter key (dynamo's multi-line message) as one short line: its title and
    its explanation, e.g. "Failed to trace builtin operator: Dynamo does not know how to trace
    builtin operator `print` ..."."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    why = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Explanation:")), "")
    return (lines[0] + (f": {why}" if why else ""))[:200] if lines else "?"


def check_compile(compile: bool) -> None:
    """COMPILE=1 checked before any work: inductor needs a C++ compiler on CPU (g++, or whatever
    torch._inductor.config.cpp.cxx names) and triton on GPUs."""
    if not compile:
        return
    if torch.cuda.is_available():
        from torch.utils._triton import has_triton
        if not has_triton():
            raise ConfigError("COMPILE=1 on GPUs needs triton (inductor's GPU code generator): pip install triton")
        return
    from torch._inductor import cpp_builder
    try:
        cpp_builder.get_cpp_compiler()
    except Exception as e:  # noqa: BLE001 - whatever the search raises, the message says what is missing
        raise ConfigError(f"COMPILE=1 on CPU needs a C++ compiler for inductor (g++): {e}") from None


def _innermost(units: list[nn.Module]) -> list[nn.Module]:
    ids = {id(u) for u in units}
    return [u for u in units if not any(id(m) in ids for m in u.modules() if m is not u)]


@dataclass(frozen=True)
class Sharding:
    """How a trainable model is sharded: the scripts' settings of the same names."""
    reshard_after_forward: bool = True  # free each unit's gathered params after its forward (ZeRO-3)
    cpu_offload: bool = False  # sharded params, grads and optimizer state live in host memory
    activation_checkpointing: bool = False  # recompute each outermost unit in backward
    prefetch: int = 0  # > 0: explicit forward/backward prefetch of this many units ahead
    compile: bool = False  # torch.compile each innermost unit's forward (after AC, before fully_shard)


def shard_units(model: nn.Module, units: list[nn.Module], mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy,
                sharding: Sharding = Sharding()) -> list[nn.Module]:
    """The FSDP2 recipe every model goes through, torchtitan's order: activation checkpointing of
    the outermost units -> torch.compile of each innermost unit's forward (see compile_units) ->
    `fully_shard` of each unit (inner before outer) -> the root.

    - the last unit in execution order is not resharded after forward: backward needs it first
    - only the root hands its output back in `output_dtype` (fp32 for losses); units pass the
      compute dtype on, so the root's own layers (conv_out, proj_out) see their compute dtype
    - prefetch > 0 sets explicit forward/backward prefetch of that many units ahead
    Returns `units`, now FSDP modules, in registration (~ execution) order."""
    if sharding.activation_checkpointing:
        for u in _outermost(units):
            _checkpointed(u)
    if sharding.compile:
        compile_units(units, mp_policy)
    # pinned host memory speeds H2D copies on GPUs; there is no pinning without an accelerator
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if sharding.cpu_offload else OffloadPolicy()
    last = units[-1] if units else None
    unit_policy = dataclasses.replace(mp_policy, output_dtype=None)
    for u in reversed(units):  # children before parents: nested units are allowed in FSDP2
        fully_shard(u, mesh=mesh, mp_policy=unit_policy, offload_policy=offload,
                    reshard_after_forward=sharding.reshard_after_forward and u is not last)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, offload_policy=offload, reshard_after_forward=False)
    if sharding.prefetch > 0 and len(units) > 1:
        n = sharding.prefetch
        for i, u in enumerate(units):
            u.set_modules_to_forward_prefetch(units[i + 1:i + 1 + n])
            u.set_modules_to_backward_prefetch(units[max(0, i - n):i][::-1])
    return units


def blocks_of(model: nn.Module, names: list[str] | tuple[str, ...]) -> list[nn.Module]:
    """The submodules whose class is one of `names`, in registration order."""
    return [m for m in model.modules() if m is not model and type(m).__name__ in names]


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy, *,
               block_classes: list[str] | None = None, reshard_after_forward: bool = True,
               cpu_offload: bool = False, activation_checkpointing: bool = False,
               prefetch: int = 0, compile: bool = False, verbose: bool = True) -> list[nn.Module]:
    """Any model: one unit per block of the named classes (or of the detected ones, see
    find_block_classes), sharded by `shard_units`. The per-model recipes below name theirs."""
    names, why = find_block_classes(model, block_classes)
    blocks = blocks_of(model, names)
    if verbose:
        print0(f"fsdp: {type(model).__name__}: {len(blocks)} units of {names} ({why})")
    return shard_units(model, blocks, mesh, mp_policy,
                       Sharding(reshard_after_forward, cpu_offload, activation_checkpointing, prefetch, compile))


# ----------------------------------------------------------------------------------------------
# per-model parallelize recipes, and the one table of which models each script builds and how.
# The memory planner (tools/memory_plan.py) builds real-size models through these same recipes.

MODEL_BLOCKS = {
    # DMD2's FSDP config wraps SD UNets per BasicTransformerBlock and ResnetBlock2D (accelerate's
    # TRANSFORMER_BASED_WRAP on those classes); the attention blocks nest inside Transformer2DModel
    "UNet2DConditionModel": ("BasicTransformerBlock", "ResnetBlock2D"),
    # FLUX: its `_no_split_modules`, the units torchtitan's flux/parallelize.py shards
    "FluxTransformer2DModel": ("FluxTransformerBlock", "FluxSingleTransformerBlock"),
}


@dataclass(frozen=True)
class Component:
    name: str       # what the script calls it
    subfolder: str  # where it lives in the diffusers pipeline folder
    role: str       # trainable | frozen-sharded | replicated | offline (text embeddings cached, then freed)
    optional: bool = False  # only some pipelines have it (SDXL's second text encoder)


SCRIPT_COMPONENTS = {
    "train_dmd.py": (Component("generator", "unet", "trainable"), Component("fake_score", "unet", "trainable"),
                     Component("teacher", "unet", "frozen-sharded"), Component("vae", "vae", "replicated"),
                     Component("text_encoder", "text_encoder", "replicated"),
                     Component("text_encoder_2", "text_encoder_2", "replicated", optional=True)),
    "train_flux_kontext.py": (Component("transformer", "transformer", "trainable"),
                              Component("vae", "vae", "replicated"),
                              Component("text_encoder", "text_encoder", "offline"),
                              Component("text_encoder_2", "text_encoder_2", "offline")),
}


def parallelize_unet(model: nn.Module, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy,
                     sharding: Sharding = Sharding(), block_classes: list[str] | None = None,
                     verbose: bool = True) -> list[nn.Module]:
    """SD-1.5 / SDXL UNet2DConditionModel: a unit per ResnetBlock2D and BasicTransformerBlock of the
    down, mid and up blocks (unless `block_classes` names others); the stem, time embedding and
    conv_out stay in the root unit."""
    names, _ = find_block_classes(model, list(block_classes or MODEL_BLOCKS["UNet2DConditionModel"]))
    units = blocks_of(model, names)
    if verbose:
        print0(f"fsdp: {type(model).__name__}: {len(units)} units of {names}")
    return shard_units(model, units, mesh, mp_policy, sharding)


def parallelize_flux_transformer(model: nn.Module, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy,
                                 sharding: Sharding = Sharding(), block_classes: list[str] | None = None,
                                 verbose: bool = True) -> list[nn.Module]:
    """FluxTransformer2DModel: each double-stream block, then each single-stream block, as units
    (the last single block not resharded after forward); the input embedders, norm_out and
    proj_out in the root unit."""
    if block_classes:  # checked to exist: a misspelt class would silently make one unit of all
        units = blocks_of(model, find_block_classes(model, list(block_classes))[0])
    else:
        units = [*model.transformer_blocks, *model.single_transformer_blocks]
    if verbose:
        print0(f"fsdp: {type(model).__name__}: {len(units)} units "
               f"({len(model.transformer_blocks)} double + {len(model.single_transformer_blocks)} single blocks)")
    return shard_units(model, units, mesh, mp_policy, sharding)


PARALLELIZE = {"UNet2DConditionModel": parallelize_unet, "FluxTransformer2DModel": parallelize_flux_transformer}


def parallelize(model: nn.Module, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy,
                sharding: Sharding = Sharding(), block_classes: list[str] | None = None,
                verbose: bool = True) -> list[nn.Module]:
    """The model's recipe (PARALLELIZE, by class), or `apply_fsdp`'s detection for other models."""
    recipe = PARALLELIZE.get(type(model).__name__)
    if recipe is not None:
        return recipe(model, mesh, mp_policy, sharding, block_classes, verbose)
    return apply_fsdp(model, mesh, mp_policy, block_classes=block_classes, verbose=verbose,
                      **dataclasses.asdict(sharding))


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


# ----------------------------------------------------------------------------------------------
# LoRA under FSDP2: peft adapters on a frozen base, inside the same per-block units
#
# Dtypes inside one unit: the base is frozen and stored in its compute dtype (bf16 in the bf16
# modes), the adapters are trainable and stored in fp32 (so their grads and AdamW state are fp32).
# They share their block's FSDP unit: FSDP2 shards per parameter and, with the unit's
# MixedPrecisionPolicy(param_dtype=compute), all-gathers every parameter of the unit cast to the
# compute dtype, so mixed storage dtypes are fine; only parameters that require grad get grads,
# reduce-scattered in `Precision.adapter_mp_policy`'s fp32. Separate units per adapter would add
# two tiny all-gathers per targeted Linear (hundreds per step) for nothing.

LORA_TARGETS = {
    # diffusers' FLUX Kontext LoRA example's default targets (examples/dreambooth/
    # train_dreambooth_lora_flux_kontext.py:1442-1456): attention and MLP projections of the
    # double-stream blocks (image and text streams), attention and proj_mlp of the single blocks
    "FluxTransformer2DModel": ("attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj",
                               "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2",
                               "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp"),
    # the UNet's attention projections (diffusers' text-to-image LoRA example's targets); the
    # official DMD2 SDXL LoRA also adapts convs, proj_in/out, ff and time_emb_proj
    # (tianweiy/DMD2 main/sd_unified_model.py:47-62): name them in LORA_TARGET_MODULES for that
    "UNet2DConditionModel": ("to_q", "to_k", "to_v", "to_out.0"),
}


@dataclass(frozen=True)
class Lora:
    """The scripts' LORA_* settings. rank 0 = no adapters (full fine-tuning)."""
    rank: int = 0
    alpha: float = 0.0  # scaling = alpha / rank; 0 = alpha equal to rank (scaling 1)
    targets: tuple[str, ...] = ()  # module-name suffixes (peft's target_modules); () = LORA_TARGETS
    dropout: float = 0.0

    def __bool__(self) -> bool:
        return self.rank > 0


def check_lora(lora: Lora) -> None:
    """The settings alone (before any model exists)."""
    if lora.rank < 0:
        raise ConfigError(f"LORA_RANK={lora.rank}: must be >= 0 (0 = full fine-tuning)")
    if lora.alpha < 0 or not 0 <= lora.dropout < 1:
        raise ConfigError(f"LORA_ALPHA={lora.alpha}, LORA_DROPOUT={lora.dropout}: need alpha >= 0 and 0 <= dropout < 1")


def lora_targets(model: nn.Module, lora: Lora) -> list[str]:
    """The target suffixes, each checked to name at least one Linear/Conv of `model` (peft's rule:
    a module whose full name equals the target or ends with "." + target); a target that matches
    nothing is a ConfigError naming it (peft alone would ignore it when another one matches)."""
    targets = list(lora.targets or LORA_TARGETS.get(type(model).__name__, ()))
    if not targets:
        raise ConfigError(f"LORA_TARGET_MODULES is empty and {type(model).__name__} has no default targets")
    names = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    for t in targets:
        if not any(n == t or n.endswith("." + t) for n in names):
            raise ConfigError(f"LORA_TARGET_MODULES: {t!r} matches no Linear or Conv2d module of "
                              f"{type(model).__name__} (e.g. {sorted({n.split('.')[-1] for n in names})[:8]})")
    return targets


def check_lora_targets(class_name: str, folder: str, lora: Lora) -> list[str]:
    """lora_targets on the diffusers model `class_name` of `folder`, built on the meta device (no
    memory, a second or two for 12 B): bad targets fail before any work."""
    import diffusers
    cls = getattr(diffusers, class_name)
    with torch.device("meta"):
        return lora_targets(cls.from_config(cls.load_config(folder)), lora)


def add_lora(model: nn.Module, lora: Lora) -> nn.Module:
    """peft LoRA adapters (diffusers' `add_adapter` with a `LoraConfig`) on the targets of `model`
    (on the meta device before sharding, or materialised): the base frozen, the adapters trainable
    and stored in fp32. Call before the parallelize recipe, so each adapter lands in its block's
    FSDP unit, and after casting the base to its storage dtype."""
    from peft import LoraConfig
    targets = lora_targets(model, lora)
    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=lora.rank, lora_alpha=lora.alpha or lora.rank, lora_dropout=lora.dropout,
                                 target_modules=targets, init_lora_weights="gaussian"))
    for name, p in model.named_parameters():
        if is_adapter(name):
            p.data = p.data.float()
            p.requires_grad_(True)
    return model


def is_adapter(name: str) -> bool:
    """Whether a parameter name is a LoRA adapter's (peft's `<layer>.lora_A.<adapter>.weight`)."""
    return ".lora_A." in name or ".lora_B." in name


def has_lora(model: nn.Module) -> bool:
    return any(is_adapter(n) for n, _ in model.named_parameters())


@torch.no_grad()
def init_lora(model: nn.Module, seed: int) -> None:
    """Initialise the adapters as peft's "gaussian" init does (lora_A ~ N(0, 1/rank²), lora_B = 0,
    so the model starts equal to its base), drawing each full lora_A from a generator seeded by
    (seed, name) and keeping this rank's rows: the same adapters whatever the world size."""
    import zlib
    for name, p in model.named_parameters():
        if not is_adapter(name):
            continue
        if ".lora_B." in name:
            _local(p).zero_()
            continue
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        full = torch.randn(p.shape, generator=g) / p.shape[0]  # std 1/rank (peft: normal_(std=1/r))
        _fill_local(p, lambda index: full[index])


class AdapterEMA(nn.Module):
    """EMA of a LoRA model's adapters only: one fp32 copy per trainable parameter (sharded like it,
    so the update is shard-local and DCP reshards it), not a second copy of the frozen base."""

    def __init__(self, model: nn.Module):
        super().__init__()
        reshard_all(model)  # sharded params, not a gathered unit's
        self.shadow = nn.ParameterList([nn.Parameter(p.detach().clone(), requires_grad=False)
                                        for p in model.parameters() if p.requires_grad])


def _ema_pairs(ema: nn.Module, model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(ema param, model param) pairs: an AdapterEMA pairs with the model's trainable params, a
    full EMA copy with all of them."""
    src = [p for p in model.parameters() if p.requires_grad] if isinstance(ema, AdapterEMA) else model.parameters()
    return list(zip(ema.parameters(), src, strict=True))


@contextlib.contextmanager
def output_weights(model: nn.Module, ema: nn.Module | None):
    """The module that samples and exports use: the model, its full EMA copy, or (AdapterEMA) the
    model with the EMA adapters swapped in for the duration (shard-local, swapped back after)."""
    if not isinstance(ema, AdapterEMA):
        yield model if ema is None else ema
        return
    reshard_all(model)
    locals_ = [(_local(pe), _local(pm)) for pe, pm in _ema_pairs(ema, model)]

    def swap():
        with torch.no_grad():
            for le, lm in locals_:
                tmp = lm.clone()
                lm.copy_(le)
                le.copy_(tmp)
    swap()
    try:
        yield model
    finally:
        reshard_all(model)
        swap()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


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
              compile: bool = False, verbose: bool = True) -> nn.Module:
    """Plain `DistributedDataParallel` over a materialised model: a full replica per rank, grads
    all-reduced (averaged) in buckets during backward. Returns the DDP wrapper, to be used only for
    training forwards; keep the unwrapped model for checkpoints, EMA, samples and export.

    The same precision contract as `apply_fsdp`: floating inputs cast to `mp_policy.param_dtype`
    (the compute dtype), the forward under autocast when the stored params are wider than it
    (bf16-mixed: fp32 master weights, bf16 matmuls), floating outputs handed back in
    `output_dtype` (fp32 for losses). Activation checkpointing and compile use the same per-block
    patches, in the same order (AC -> compile), on the blocks the FSDP recipe would shard. With
    compile, dynamo's DDPOptimizer (which splits a graph compiled inside DDP's forward at gradient
    bucket boundaries, and refuses the checkpoint higher-order op) is turned off: each compiled
    block is already a small graph, and DDP's reducer still all-reduces buckets as grads arrive."""
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils._pytree import tree_map
    if activation_checkpointing:  # the units the model's FSDP recipe would shard
        names, _ = find_block_classes(model, block_classes or MODEL_BLOCKS.get(type(model).__name__))
        for b in _outermost(blocks_of(model, names)):
            _checkpointed(b)
    if compile:
        torch._dynamo.config.optimize_ddp = False
        compile_blocks(model, block_classes, mp_policy)
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


def _outermost(blocks: list[nn.Module]) -> list[nn.Module]:
    inner = {id(c) for b in blocks for c in b.modules() if c is not b}
    return [b for b in blocks if id(b) not in inner]


def prepare_frozen(model: nn.Module, mesh: DeviceMesh | None, mp_policy: MixedPrecisionPolicy,
                   device: torch.device, *, sharded: bool, block_classes: list[str] | None = None,
                   verbose: bool = True, compile: bool = False) -> nn.Module:
    """A frozen component (teacher, VAE, text encoder): eval mode, no grads ever, stored in its
    compute dtype `mp_policy.param_dtype` (precision.frozen_mp_policy: no cast, no reduction);
    sharded per unit by its model's recipe like a trainable model (`compile`: its units' forwards
    compiled, as Sharding.compile), or replicated on every rank."""
    model.requires_grad_(False).eval()
    model.to(mp_policy.param_dtype)
    if sharded and mesh is not None:
        parallelize(model, mesh, mp_policy, Sharding(reshard_after_forward=True, compile=compile), block_classes,
                    verbose)
        if any(p.device.type == "meta" for p in model.parameters()):
            return model  # caller materialises (meta-device loading)
    return model.to(device)


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


def checkpoint_name(name: str) -> str:
    """The tensor name in the model's safetensors for a (possibly LoRA-wrapped) parameter: peft
    moves a targeted layer's own weight to `<layer>.base_layer.weight`."""
    return name.replace(".base_layer.", ".")


def materialize_and_load(model: nn.Module, folder: str, device: torch.device) -> None:
    """Allocate the (already sharded) meta model on `device` and fill it from safetensors.

    Each rank reads only the rows of each tensor that it owns (safetensors slices are lazy, memory-
    mapped), so no rank ever holds more than its shard plus one slice: a 12 B transformer loads
    without 12 B parameters of host RAM anywhere. Stored dtype is cast to the model's dtype.
    LoRA adapters (add_lora) are not in the folder: they are initialised by `init_lora`."""
    from safetensors import safe_open

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

        tensors = {checkpoint_name(n): t for n, t in model.named_parameters() if not is_adapter(n)}
        tensors.update((checkpoint_name(n), t) for n, t in model.named_buffers())
        for name, t in tensors.items():
            sl = slice_of(name)
            if list(sl.get_shape()) != list(t.shape):
                raise ConfigError(f"{folder}: {name} has shape {sl.get_shape()}, model expects {list(t.shape)}")
            _fill_local(t, lambda index: sl[index])
        extra = set(files) - set(tensors)
        if extra:
            raise ConfigError(f"{folder}: weights hold tensors the model lacks, e.g. {sorted(extra)[:3]}")


def _fill_local(t: torch.Tensor, read) -> None:
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


def fill_built_model(model: nn.Module, folder: str, mesh: DeviceMesh | None, home: torch.device,
                     load: bool = True, lora_seed: int = 0) -> nn.Module:
    """The last step of a meta-device build: allocate the (sharded, or with mesh=None whole) model
    on `home` and load it from `folder` (load=False: allocate only, e.g. an EMA copy filled from
    the model), LoRA adapters initialised from `lora_seed`, then check that every parameter is
    sharded on `mesh`."""
    if load:
        materialize_and_load(model, folder, home)
        init_lora(model, lora_seed)
    else:
        model.to_empty(device=home)
    if mesh is not None:
        assert_sharded(model, mesh)
    return model


# ----------------------------------------------------------------------------------------------
# optimizer

FUSED_ADAMW_DEVICES = ("cpu", "cuda", "xpu", "mps")  # where torch has a fused AdamW kernel


def adamw(params, **kwargs) -> torch.optim.AdamW:
    """torch's AdamW over (possibly DTensor) params, with its fused kernel where the params' devices
    have one. AdamW's default for DTensor params is the per-tensor loop: every elementwise op
    dispatches through DTensor once per param (~700 per SD UNet). Measured on 2 CPU ranks for an
    FSDP2 UNet of 78 M params (fp32, one thread per rank): per-tensor 0.36 s a step, foreach 0.17 s,
    fused 0.06 s; on the same shards as plain tensors (what FSDP1's use_orig_params views are)
    torch's default (foreach) takes 0.13 s, fused 0.03 s.
    Same algorithm, same state_dict layout; fused differs from foreach only in rounding."""
    params = list(params)
    fused = bool(params) and all(p.device.type in FUSED_ADAMW_DEVICES and p.is_floating_point() for p in params)
    return torch.optim.AdamW(params, **kwargs, **({"fused": True} if fused else {"foreach": True}))


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


def reshard_all(model: nn.Module) -> None:
    """Free the gathered params that a no-grad forward leaves behind (the root and the last block
    skip reshard-after-forward; only a backward reshards them). Needed before editing shards in
    place: a gathered unit shows its unsharded params in .parameters() and would not see the edit."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


@torch.no_grad()
def ema_update(ema: nn.Module, model: nn.Module, decay: float) -> None:
    """ema ← decay·ema + (1−decay)·model, shard by shard (both sharded identically, no comms).
    `ema` is a full copy of the model or an AdapterEMA of its trainable (LoRA) params."""
    reshard_all(ema)
    reshard_all(model)
    for pe, pm in _ema_pairs(ema, model):
        le, lm = _local(pe), _local(pm)
        le.lerp_(lm.to(le.dtype), 1.0 - decay)


@torch.no_grad()
def copy_params(dst: nn.Module, src: nn.Module) -> None:
    """Copy the local shards of src into dst (identically sharded), e.g. to start an EMA (dst may
    be an AdapterEMA of src)."""
    reshard_all(dst)
    reshard_all(src)
    for pd, ps in _ema_pairs(dst, src):
        _local(pd).copy_(_local(ps))


# ----------------------------------------------------------------------------------------------
# memory

def _local_bytes(t: torch.Tensor) -> int:
    t = _local(t)
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




if __name__ == "__main__":
    # `python fsdp_utils.py plan --model=NAME --world_size=N ...` runs the memory planner
    # (tools/memory_plan.py) as a program: a dispatch, not an import, so no module cycle
    if sys.argv[1:2] != ["plan"]:
        sys.exit("usage: python fsdp_utils.py plan --model=NAME --world_size=N [--gpu_memory_gb=G] ...")
    import runpy
    sys.argv = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "tools", "memory_plan.py")] + sys.argv[2:]
    runpy.run_path(sys.argv[0], run_name="__main__")
