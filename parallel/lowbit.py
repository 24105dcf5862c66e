"""Low-bit storage from torchao, for fitting where bf16 does not: a 4-bit NF4 frozen base under
LoRA (QLoRA, Dettmers et al. 2023) sharded by the same per-block FSDP2 recipe, and AdamW with 8-bit
or 4-bit states (torchao.optim, built by components/optim.py) for full fine-tunes and LoRA.

NF4 base (BASE_DTYPE=nf4). On the meta skeleton, after the adapters are added and before the
recipe shards it, every frozen 2-D Linear weight becomes a torchao `NF4Tensor` parameter (4-bit
codes in blocks of 64 with an absmax scale each, the scales themselves quantised to 8 bits in
blocks of 256: "double quantisation"; ~0.52 byte/param, ~4.1 bits). `NF4Tensor` implements FSDP2's
all-gather extension (`fsdp_pre_all_gather` hands FSDP its codes and scales, `fsdp_post_all_gather`
rebuilds the unsharded NF4 weight), so a unit all-gathers 4-bit codes and dequantises to the
compute dtype inside `F.linear` (torchao's `linear_nf4`; its backward also dequantises, no weight
grad). Loading quantises each whole tensor once (every rank reads the full tensor, one at a time,
quantises it on its own device and keeps its dim-0 chunk, every inner tensor on that device: a code
book left on the CPU fails CUDA's lookup): the codes are those of the whole tensor whatever the world
size, and NF4's scale statistics (its `scaler_mean` is over all of a tensor's blocks) are identical
on every shard. torchtune's QLoRA does the same, quantise-then-chunk into a DTensor after
`fully_shard` (torchtune/training/_distributed.py:336-459, `load_from_full_model_state_dict`;
the base quantised with `to_nf4` in torchtune/modules/peft/lora.py:86, forward via `linear_nf4`
at :138); this module writes the chunk into the shard FSDP already holds instead of assigning new
parameters.

Peak memory of loading: a rank's NF4 shards plus one full tensor in the storage dtype and the
quantiser's temporaries, all on the host on CPU (tools/memory_plan.py counts it: `load_peak`); on a
GPU the host holds only the tensor read, the shards and temporaries sit on the GPU.

Low-bit AdamW (OPTIMIZER=adamw8bit | adamw4bit): torchao's AdamW8bit / AdamW4bit, whose states are
tensor subclasses (block-wise quantised, 256 values per fp32 scale for 8 bit, 128 for 4 bit)
wrapped in DTensors over FSDP2's shards, so DCP saves and resharding see DTensors. A parameter
shard of fewer than 4096 values (or not a multiple of the block) keeps fp32 states (torchao's
rule, torchao/optim/adam.py `_new_buffer`): which shards qualify depends on the world size.

    python -m pytest tests/test_lowbit.py -q
"""
from __future__ import annotations

import torch
import torch.nn as nn

from core.errors import ConfigError

BASE_DTYPES = ("", "nf4")  # BASE_DTYPE's choices: "" = PRECISION's compute dtype (today's LoRA base)
OPTIMIZERS = ("adamw", "adamw8bit", "adamw4bit")  # OPTIMIZER's choices
TORCHAO_TESTED = "0.18.0"  # the torchao release tested with torch 2.13 (requirements-dev.txt pins it)

NF4_BLOCK = 64  # values per 4-bit block (QLoRA's and torchao's default)
NF4_SCALER_BLOCK = 256  # block scales per 8-bit scale block (QLoRA's and torchao's default)
NF4_MAX_SHARDS = 8  # smaller scale blocks where a tensor cannot give 8 shards of whole 256-blocks


def torchao(what: str):
    """torchao, imported only when a setting asks for it; missing = one-line ConfigError."""
    try:
        import torchao as ao
    except ImportError:
        raise ConfigError(f"{what} needs torchao (pip install torchao=={TORCHAO_TESTED}, tested with "
                          f"torch 2.13); it is not installed") from None
    return ao


def check_lowbit(c: dict) -> None:
    """BASE_DTYPE and OPTIMIZER (the scripts' constants `c`), before any work."""
    base, opt = c["BASE_DTYPE"], c["OPTIMIZER"]
    if base not in BASE_DTYPES:
        raise ConfigError(f"BASE_DTYPE={base!r}: choose one of {list(BASE_DTYPES)}")
    if opt not in OPTIMIZERS:
        raise ConfigError(f"OPTIMIZER={opt!r}: choose one of {list(OPTIMIZERS)}")
    if base == "nf4":
        if c["LORA_RANK"] <= 0:
            raise ConfigError("BASE_DTYPE=nf4 needs LORA_RANK > 0: "
                              "a 4-bit base is frozen, only LoRA adapters train on it")
        untested = {"CPU_OFFLOAD": c["CPU_OFFLOAD"], "COMPILE": c["COMPILE"], "DP_REPLICATE > 1": c["DP_REPLICATE"] > 1,
                    "LORA_EXPORT_MERGED": c["LORA_EXPORT_MERGED"],
                    "CONTEXT_PARALLEL > 1": c.get("CONTEXT_PARALLEL", 1) > 1}
        bad = [k for k, v in untested.items() if v]
        if bad:
            raise ConfigError(f"BASE_DTYPE=nf4 with {', '.join(bad)}: not supported (merged export: load the "
                              "adapters onto the full-precision base with load_lora_weights and fuse there)")
        torchao("BASE_DTYPE=nf4")
    if opt != "adamw":
        torchao(f"OPTIMIZER={opt}")


# ----------------------------------------------------------------------------------------------
# NF4 base


def _nf4_class():
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor
    return NF4Tensor


def is_nf4(t: torch.Tensor) -> bool:
    """Whether `t` (a parameter, or a DTensor's local shard) is stored as NF4."""
    t = getattr(t, "_local_tensor", t)
    return type(t).__name__ == "NF4Tensor"


def nf4_blocks(shape: torch.Size) -> tuple[int, int] | None:
    """(block, scale block) for an NF4 weight of `shape`, or None when it stays in its dtype: 2-D
    with a multiple of 64·8 values. The scale block is QLoRA's 256, halved until the tensor splits
    into NF4_MAX_SHARDS row shards of whole scale blocks (only tiny test models need fewer); it
    depends on the shape alone, so every world size quantises alike."""
    if len(shape) != 2 or (shape[0] * shape[1]) % (NF4_BLOCK * NF4_MAX_SHARDS):
        return None
    per_shard = shape[0] * shape[1] // NF4_BLOCK // NF4_MAX_SHARDS
    scaler = NF4_SCALER_BLOCK
    while per_shard % scaler:
        scaler //= 2
    return NF4_BLOCK, scaler


def quantize_base(model: nn.Module, shards: int) -> int:
    """Every frozen Linear weight of `model` (on meta, after add_lora, before the recipe) that
    nf4_blocks accepts becomes an NF4 parameter (on meta: no memory; load fills it), checked to
    split into `shards` FSDP shards (1: not sharded). The adapters and everything else keep their
    dtypes. Returns how many weights were converted."""
    from torchao.quantization import to_nf4
    n = 0
    for m in model.modules():
        if isinstance(m, nn.Linear) and not m.weight.requires_grad:
            blocks = nf4_blocks(m.weight.shape)
            if blocks is not None:
                m.weight = nn.Parameter(to_nf4(m.weight.detach(), *blocks), requires_grad=False)
                n += 1
    if n == 0:
        raise ConfigError(f"BASE_DTYPE=nf4: no Linear weight of {type(model).__name__} has a multiple of "
                          f"{NF4_BLOCK * NF4_MAX_SHARDS} values; nothing to quantise")
    check_nf4_shards(model, shards)
    return n


def check_nf4_shards(model: nn.Module, world: int) -> None:
    """Every NF4 weight splits into `world` row shards of whole scale blocks (FSDP2 shards dim 0;
    NF4's split keeps blocks whole), else one ConfigError naming the first that does not."""
    for name, p in model.named_parameters():
        if is_nf4(p) and world > 1:
            rows, cols = p.shape
            block = NF4_BLOCK * p.scaler_block_size
            if rows % world or (rows // world * cols) % block:
                raise ConfigError(f"BASE_DTYPE=nf4: {name} {tuple(p.shape)} does not split into {world} shards "
                                  f"of whole NF4 scale blocks ({block} values); use a world size dividing {rows}")


@torch.no_grad()
def fill_nf4(param: torch.Tensor, full: torch.Tensor, device: torch.device | str | None = None) -> None:
    """Quantise the whole tensor `full` as `param`'s NF4 layout and write this rank's dim-0 chunk
    into `param` (an NF4 parameter, or a DTensor sharded Shard(0) over a 1-D mesh whose local
    tensor is NF4). `full` (a safetensors slice, on the CPU) is moved to `device` (default: where
    `param` lives, nf4_home) and quantised there, so every inner tensor ends on the parameter's
    device. Every piece is copied into the tensors FSDP holds; NF4's copy_ leaves `scaler_mean`
    and its code book as they were (meta after to_empty), so those are set here."""
    from torchao.quantization import to_nf4
    local = getattr(param, "_local_tensor", param)
    device = torch.device(device) if device is not None else nf4_home(local)
    q = to_nf4(full.to(device=device, dtype=local.dtype), local.block_size, local.scaler_block_size)
    if local is not param:  # a DTensor: this rank's chunk along dim 0, as FSDP2 split it
        mesh = param.device_mesh
        q = torch.chunk(q, mesh.size(), dim=0)[mesh.get_local_rank()]
    if tuple(q.shape) != tuple(local.shape):
        raise ConfigError(f"NF4 shard {tuple(local.shape)} != chunk {tuple(q.shape)}: uneven sharding")
    for attr in local.__tensor_flatten__()[0]:
        src, dst = getattr(q, attr), getattr(local, attr)
        if dst.is_meta or dst.shape != src.shape:
            setattr(local, attr, src.clone())
        else:
            dst.copy_(src)
    bad = misplaced_inner_tensors(local, device)
    if bad:
        raise RuntimeError(f"NF4 weight {tuple(local.shape)}: inner tensors {bad} not on {device} after loading")


def nf4_home(local: torch.Tensor) -> torch.device:
    """The device of an NF4 tensor's allocated inner tensors (to_empty allocates the codes and
    scales but leaves the code book and `scaler_mean` on meta), or its own when all are meta."""
    devices = {x.device for _, x in _leaves(local) if not x.is_meta}
    if len(devices) > 1:
        raise RuntimeError(f"NF4 weight {tuple(local.shape)}: inner tensors on {sorted(map(str, devices))}")
    return devices.pop() if devices else local.device


# ----------------------------------------------------------------------------------------------
# device placement of tensor subclasses


def _inner_names(t: torch.Tensor) -> list[str] | None:
    """A tensor subclass's inner tensor names (NF4, torchao's optimizer states), None for a plain tensor."""
    if type(t) not in (torch.Tensor, nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        return t.__tensor_flatten__()[0]
    return None


def _leaves(t: torch.Tensor, prefix: str = ""):
    """(dotted name, plain tensor) for every tensor that really holds `t`'s data: through a DTensor's
    local shard and, recursively, subclasses' inner tensors; "" names a plain `t` itself."""
    t = getattr(t, "_local_tensor", t)
    names = _inner_names(t)
    if names is None:
        yield prefix, t
        return
    for a in names:
        yield from _leaves(getattr(t, a), f"{prefix}.{a}" if prefix else a)


def _on(actual: torch.device, expected: torch.device) -> bool:
    """Same device; an expected device without index ("cuda") accepts any index."""
    return actual.type == expected.type and (expected.index is None or actual.index == expected.index)


def misplaced_inner_tensors(t: torch.Tensor, device: torch.device | str) -> list[str]:
    """Names of the inner tensors of `t` (a DTensor, a tensor subclass, nested) that are not on
    `device` ("" = `t` itself, a plain tensor). A subclass's `.device` reports its wrapper only:
    a code book left on the CPU under CUDA codes fails later as an obscure indexing error."""
    device = torch.device(device)
    return [n for n, x in _leaves(t) if not _on(x.device, device)]


def check_devices(model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                  device: torch.device | str | None = None) -> None:
    """One RuntimeError naming the first parameter of `model`, or state of `optimizer`, with an
    inner tensor off `device` (None: the device its parameter reports, which to_empty and FSDP
    set: the GPU, or the CPU under CPU offload). Metadata only. "step" is skipped: torch's and
    torchao's AdamW keep it as a CPU scalar by design."""
    def check(what, t, home):
        for inner, x in _leaves(t):
            if not _on(x.device, home):
                raise RuntimeError(f"{what}{'.' + inner if inner else ''} is on {x.device}, expected {home} "
                                   f"(its {type(t).__name__} reports {t.device})")
    names = {}
    for name, p in model.named_parameters():
        names[id(p)] = name
        check(f"parameter {name}", p, torch.device(device) if device is not None else p.device)
    if optimizer is not None:
        for p, state in optimizer.state.items():
            for k, v in state.items():
                if k != "step" and torch.is_tensor(v):
                    check(f"optimizer state {k} of {names.get(id(p), tuple(p.shape))}", v,
                          torch.device(device) if device is not None else p.device)


def state_bytes(t: torch.Tensor) -> int:
    """Bytes a (possibly DTensor, possibly quantised subclass) tensor really holds on this rank:
    the sum over its inner tensors for NF4 and torchao's optimizer states (their numel and dtype
    describe the dequantised tensor)."""
    return sum(x.numel() * x.element_size() for _, x in _leaves(t))
