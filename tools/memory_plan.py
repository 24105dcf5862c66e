"""Know before launching: per-rank GPU memory of a training run, from real-size models on the meta
device, wrapped exactly as the training scripts wrap them, with a fake process group (no GPU, no
weights, seconds).

    python fsdp_utils.py plan --model=flux-kontext-dev --world_size=4 --gpu_memory_gb=24
    python fsdp_utils.py plan --model=sd15-dmd --world_size=8 --batch_size=4 --resolution=512
    python fsdp_utils.py plan --model=/path/to/diffusers/folder --world_size=2

NAME is a built-in configuration (configs/<NAME>/: configs only, no weights) or a local diffusers
folder (SD-1.5 layout with unet/ -> train_dmd.py's models; FLUX layout with transformer/ ->
train_flux_kontext.py's). What is counted, per rank:
  params / grads / optimizer  the local shards (AdamW: 2 states), in the precision mode's dtypes;
                              frozen parts in their own dtype; with CPU offload these live on the host
  gathered                    unsharded units in compute dtype: the largest two (current + prefetched)
                              with reshard-after-forward, all of them without; plus the largest
                              unit's reduce-scatter buffer
  activations                 bytes saved for backward by one forward of the trainable model at the
                              batch and resolution, measured on the meta device with saved-tensor
                              hooks (with activation checkpointing: block inputs + one block's worth)
  runtime                     a fixed 1 GiB for the CUDA context and allocator slack
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the repository root: fsdp_utils, precision
GIB = 2**30
RUNTIME_BYTES = 1 * GIB


@dataclass
class Component:
    name: str
    module: nn.Module
    role: str                  # "trainable" | "frozen-sharded" | "replicated" | "offline"
    dtype: torch.dtype         # storage dtype
    blocks: list[str] = field(default_factory=list)


@dataclass
class Settings:
    world_size: int
    precision: str = "bf16-mixed"
    cpu_offload: bool = False
    activation_checkpointing: bool = False
    reshard_after_forward: bool = True
    dp_replicate: int = 1
    batch_size: int = 1
    resolution: int = 512


# ----------------------------------------------------------------------------------------------
# building the real-size models on meta, as the scripts hold them

def model_folder(name: str) -> str:
    builtin = os.path.join(HERE, "real_size_configs", name)
    if os.path.isdir(builtin):
        return builtin
    if os.path.isdir(name):
        return name
    choices = sorted(os.listdir(os.path.join(HERE, "real_size_configs")))
    raise SystemExit(f"plan: --model={name}: not a built-in configuration ({', '.join(choices)}) nor a folder")


def _meta(cls, folder):
    with torch.device("meta"):
        return cls.from_config(cls.load_config(folder))


def _meta_hf(cls, cfg_cls, folder):
    with torch.device("meta"):
        return cls(cfg_cls.from_pretrained(folder))


def build_components(folder: str, precision) -> tuple[str, list[Component]]:
    """(kind, components) for an SD-1.5 (DMD2) or FLUX Kontext folder, with the scripts' roles."""
    from diffusers import AutoencoderKL, FluxTransformer2DModel, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel
    compute, store = precision.compute_dtype, precision.param_dtype
    if os.path.isdir(os.path.join(folder, "unet")):
        unet = os.path.join(folder, "unet")
        blocks = ["BasicTransformerBlock", "ResnetBlock2D"]
        comps = [Component("generator", _meta(UNet2DConditionModel, unet), "trainable", store, blocks),
                 Component("fake_score", _meta(UNet2DConditionModel, unet), "trainable", store, blocks),
                 Component("teacher", _meta(UNet2DConditionModel, unet), "frozen-sharded", compute, blocks),
                 Component("vae", _meta(AutoencoderKL, os.path.join(folder, "vae")), "replicated", compute),
                 Component("text_encoder", _meta_hf(CLIPTextModel, CLIPTextConfig,
                                                    os.path.join(folder, "text_encoder")), "replicated", compute)]
        return "sd15", comps
    if os.path.isdir(os.path.join(folder, "transformer")):
        from transformers import T5Config, T5EncoderModel
        blocks = ["FluxTransformerBlock", "FluxSingleTransformerBlock"]
        comps = [Component("transformer", _meta(FluxTransformer2DModel, os.path.join(folder, "transformer")),
                           "trainable", store, blocks),
                 Component("vae", _meta(AutoencoderKL, os.path.join(folder, "vae")), "replicated", compute),
                 Component("text_encoder", _meta_hf(CLIPTextModel, CLIPTextConfig,
                                                    os.path.join(folder, "text_encoder")), "offline", compute),
                 Component("text_encoder_2", _meta_hf(T5EncoderModel, T5Config,
                                                      os.path.join(folder, "text_encoder_2")), "offline", compute)]
        return "flux_kontext", comps
    raise SystemExit(f"plan: {folder}: neither an SD-1.5 layout (unet/) nor a FLUX layout (transformer/)")


# ----------------------------------------------------------------------------------------------
# sharding with a fake process group

@contextlib.contextmanager
def fake_world(world_size: int):
    """A process group of `world_size` fake ranks (we are rank 0): collectives are no-ops."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        if owned:
            dist.destroy_process_group()


def _units(model: nn.Module, block_classes: list[str]) -> list[int]:
    """Parameter count of each FSDP unit (blocks minus nested blocks, then the root's rest)."""
    blocks = [m for m in model.modules() if m is not model and type(m).__name__ in block_classes]
    owned, sizes = set(), []
    for b in reversed(blocks):  # inner first, as apply_fsdp shards them
        ps = [p for p in b.parameters() if id(p) not in owned]
        owned.update(id(p) for p in ps)
        sizes.append(sum(p.numel() for p in ps))
    sizes.append(sum(p.numel() for p in model.parameters() if id(p) not in owned))
    return sizes


def shard_components(comps: list[Component], s: Settings, precision) -> dict:
    """Apply the scripts' wrapping at world size s.world_size; return per-rank local numels and units."""
    import fsdp_utils
    out = {}
    with fake_world(s.world_size):
        mesh = fsdp_utils.build_mesh(torch.device("cpu"), s.dp_replicate)
        for c in comps:
            c.module.to(c.dtype)
            units = _units(c.module, c.blocks) if c.blocks else [sum(p.numel() for p in c.module.parameters())]
            if c.role == "trainable":
                fsdp_utils.apply_fsdp(c.module, mesh, precision.mp_policy(), block_classes=c.blocks,
                                      reshard_after_forward=s.reshard_after_forward, verbose=False)
            elif c.role == "frozen-sharded":
                fsdp_utils.prepare_frozen(c.module, mesh, precision.frozen_mp_policy(c.dtype), torch.device("meta"), sharded=True,
                                          block_classes=c.blocks, verbose=False)
            local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in c.module.parameters())
            out[c.name] = {"local": local, "global": sum(p.numel() for p in c.module.parameters()), "units": units}
    return out


# ----------------------------------------------------------------------------------------------
# activations, measured on meta

def activation_bytes(model: nn.Module, inputs: dict, block_classes: list[str], checkpointing: bool) -> int:
    """Bytes autograd saves for backward in one forward (parameters excluded, views counted once).
    With checkpointing: what is saved outside blocks + every block's inputs + the largest block's
    own saved bytes (recomputed one block at a time in backward)."""
    params = {id(p) for p in model.parameters()}
    seen, per_block, outside, inputs_b = set(), {}, [0], [0]
    current: list = [None]

    def pack(t):
        base = t._base if t._base is not None else t
        if id(base) in params or id(t) in params or id(base) in seen:
            return t
        seen.add(id(base))
        keep.append(base)
        n = base.numel() * base.element_size()
        if current[0] is None:
            outside[0] += n
        else:
            per_block[current[0]] = per_block.get(current[0], 0) + n
        return t

    keep: list = []
    hooks = []
    blocks = [m for m in model.modules() if type(m).__name__ in block_classes]
    outer = [b for b in blocks if not any(b is not o and b in set(o.modules()) for o in blocks)]

    def enter(mod, args, kwargs):
        if current[0] is None:
            current[0] = id(mod)
            inputs_b[0] += sum(a.numel() * a.element_size() for a in list(args) + list(kwargs.values())
                               if torch.is_tensor(a))

    def leave(mod, args, kwargs, out):
        if current[0] == id(mod):
            current[0] = None

    for b in outer:
        hooks.append(b.register_forward_pre_hook(enter, with_kwargs=True))
        hooks.append(b.register_forward_hook(leave, with_kwargs=True))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(**inputs)
    finally:
        for h in hooks:
            h.remove()
    total_blocks = sum(per_block.values())
    if checkpointing:
        return outside[0] + inputs_b[0] + max(per_block.values(), default=0)
    return outside[0] + total_blocks


def _folder_shapes(folder: str, kind: str) -> tuple[int, int]:
    """(pixels per latent, text tokens) as the scripts see them: the VAE's downsampling factor
    (8 for the real models) and the tokenizer length (CLIP 77 / T5 512, capped at the tokenizer's
    model_max_length when the folder has tokenizers, e.g. 32 for the tiny defaults)."""
    import json
    with open(os.path.join(folder, "vae", "config.json")) as f:
        factor = 2 ** (len(json.load(f)["block_out_channels"]) - 1)
    text = 77 if kind == "sd15" else 512
    tok = os.path.join(folder, "tokenizer" if kind == "sd15" else "tokenizer_2", "tokenizer_config.json")
    if os.path.exists(tok):
        with open(tok) as f:
            text = int(min(text, json.load(f).get("model_max_length", text)))
    return factor, text


def _meta_inputs(kind: str, model: nn.Module, batch: int, resolution: int, dtype: torch.dtype,
                 factor: int = 8, text: int | None = None) -> dict:
    cfg = model.config
    text = text or (77 if kind == "sd15" else 512)
    with torch.device("meta"):
        if kind == "sd15":
            lat = resolution // factor
            return dict(sample=torch.empty(batch, cfg.in_channels, lat, lat, dtype=dtype, requires_grad=True),
                        timestep=torch.zeros(batch, dtype=torch.long),
                        encoder_hidden_states=torch.empty(batch, text, cfg.cross_attention_dim, dtype=dtype),
                        return_dict=False)
        tokens = (resolution // (2 * factor)) ** 2  # VAE factor, 2x2 packing
        return dict(hidden_states=torch.empty(batch, 2 * tokens, cfg.in_channels, dtype=dtype, requires_grad=True),
                    encoder_hidden_states=torch.empty(batch, text, cfg.joint_attention_dim, dtype=dtype),
                    pooled_projections=torch.empty(batch, cfg.pooled_projection_dim, dtype=dtype),
                    timestep=torch.empty(batch, dtype=dtype), img_ids=torch.zeros(2 * tokens, 3),
                    txt_ids=torch.zeros(text, 3), guidance=torch.empty(batch), return_dict=False)


# ----------------------------------------------------------------------------------------------
# the plan

def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@functools.lru_cache(maxsize=None)
def _activations(name: str, kind: str, cls, blocks: tuple, dtype: torch.dtype, batch: int, resolution: int,
                 checkpointing: bool) -> int:
    model = _meta(cls, _folder_of(name, kind)).to(dtype)
    factor, text = _folder_shapes(model_folder(name), kind)
    return activation_bytes(model, _meta_inputs(kind, model, batch, resolution, dtype, factor, text), list(blocks),
                            checkpointing)


def plan(name: str, s: Settings) -> dict:
    """Per-rank GPU bytes by category (and host bytes with CPU offload) for these settings."""
    from precision import get_precision
    precision = get_precision(s.precision)
    kind, comps = build_components(model_folder(name), precision)
    trainable = next(c for c in comps if c.role == "trainable")
    acts = _activations(name, kind, type(trainable.module), tuple(trainable.blocks), precision.compute_dtype,
                        s.batch_size, s.resolution, s.activation_checkpointing)
    sharded = shard_components(comps, s, precision)
    p_size, c_size, r_size = _size(precision.param_dtype), _size(precision.compute_dtype), _size(precision.reduce_dtype)
    rows, gathered_units = {}, []
    for c in comps:
        info = sharded[c.name]
        if c.role == "offline":
            rows[c.name] = dict(params=0, grads=0, optim=0, note="text embeddings cached before training")
            continue
        local = info["local"] if c.role in ("trainable", "frozen-sharded") else info["global"]
        train = c.role == "trainable"
        rows[c.name] = dict(params=local * _size(c.dtype), grads=local * p_size if train else 0,
                            optim=2 * local * p_size if train else 0, note=c.role,
                            count=info["global"], local_count=local)
        if c.role in ("trainable", "frozen-sharded"):
            gathered_units += [u * (c_size if train else _size(c.dtype)) for u in info["units"]]
    biggest = sorted(gathered_units, reverse=True)
    if s.reshard_after_forward:
        gathered = sum(biggest[:2])
    else:
        gathered = sum(u for c in comps if c.role == "trainable" for u in sharded[c.name]["units"]) * c_size
    gathered += max(sharded[trainable.name]["units"]) * r_size  # reduce-scatter input of the largest unit
    states = sum(r["params"] + r["grads"] + r["optim"] for n, r in rows.items()
                 if any(c.name == n and c.role == "trainable" for c in comps))
    frozen = sum(r["params"] for n, r in rows.items() if not any(c.name == n and c.role == "trainable" for c in comps))
    host = states if s.cpu_offload else 0
    gpu = (0 if s.cpu_offload else states) + frozen + gathered + acts + RUNTIME_BYTES
    return dict(kind=kind, rows=rows, gathered=gathered, largest_unit=biggest[0] if biggest else 0,
                activations=acts, runtime=RUNTIME_BYTES, gpu_total=gpu, host_total=host, settings=s)


def _folder_of(name: str, kind: str) -> str:
    return os.path.join(model_folder(name), "unet" if kind == "sd15" else "transformer")


def cheapest_fit(name: str, s: Settings, gpu_bytes: int) -> tuple[Settings, dict] | None:
    """Settings that fit, in order of what they cost in speed: nothing, checkpointing, bf16
    states, CPU offload (slowest), and their combinations."""
    order = [(False, False, s.precision), (True, False, s.precision), (False, False, "bf16"),
             (True, False, "bf16"), (False, True, s.precision), (True, True, s.precision),
             (True, True, "bf16")]
    for ac, off, prec in order:
        trial = Settings(**{**s.__dict__, "activation_checkpointing": ac, "cpu_offload": off, "precision": prec})
        result = plan(name, trial)
        if result["gpu_total"] <= gpu_bytes:
            return trial, result
    return None


def format_plan(name: str, p: dict) -> str:
    s = p["settings"]
    head = (f"plan: {name} ({p['kind']}), world size {s.world_size} (dp_replicate {s.dp_replicate}), "
            f"{s.precision}, batch {s.batch_size}/rank at {s.resolution}px, activation_checkpointing="
            f"{int(s.activation_checkpointing)}, cpu_offload={int(s.cpu_offload)}, "
            f"reshard_after_forward={int(s.reshard_after_forward)}")
    lines = [head, f"{'component':<16}{'params':>10}{'on rank':>10}{'param GiB':>11}{'grad GiB':>10}"
                   f"{'optim GiB':>11}  role"]
    for n, r in p["rows"].items():
        count = f"{r.get('count', 0) / 1e9:.2f}B" if r.get("count") else "-"
        local = f"{r.get('local_count', 0) / 1e9:.2f}B" if r.get("local_count") else "-"
        lines.append(f"{n:<16}{count:>10}{local:>10}{r['params'] / GIB:>11.2f}{r['grads'] / GIB:>10.2f}"
                     f"{r['optim'] / GIB:>11.2f}  {r['note']}")
    where = "host (CPU offload)" if s.cpu_offload else "GPU"
    lines += [f"model states on: {where}" + (f", {p['host_total'] / GIB:.2f} GiB per rank" if s.cpu_offload else ""),
              f"all-gathered units in flight: {p['gathered'] / GIB:.2f} GiB (largest unit {p['largest_unit'] / GIB:.2f} GiB)",
              f"activations (measured on meta): {p['activations'] / GIB:.2f} GiB",
              f"runtime reserve: {p['runtime'] / GIB:.2f} GiB",
              f"TOTAL per GPU: {p['gpu_total'] / GIB:.2f} GiB"]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python fsdp_utils.py plan", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--world_size", type=int, required=True)
    ap.add_argument("--gpu_memory_gb", type=float, default=0.0)
    ap.add_argument("--batch_size", type=int, default=1)
    ap.add_argument("--resolution", type=int, default=512)
    ap.add_argument("--precision", default="bf16-mixed", choices=["fp32", "bf16-mixed", "bf16"])
    ap.add_argument("--cpu_offload", type=int, default=0)
    ap.add_argument("--activation_checkpointing", type=int, default=0)
    ap.add_argument("--reshard_after_forward", type=int, default=1)
    ap.add_argument("--dp_replicate", type=int, default=1)
    a = ap.parse_args(argv)
    from diffusers.utils import logging as dlogging
    dlogging.set_verbosity_error()
    s = Settings(a.world_size, a.precision, bool(a.cpu_offload), bool(a.activation_checkpointing),
                 bool(a.reshard_after_forward), a.dp_replicate, a.batch_size, a.resolution)
    result = plan(a.model, s)
    print(format_plan(a.model, result))
    if a.gpu_memory_gb > 0:
        budget = int(a.gpu_memory_gb * GIB)
        if result["gpu_total"] <= budget:
            print(f"fits in {a.gpu_memory_gb:g} GB per GPU")
            return 0
        fit = cheapest_fit(a.model, s, budget)
        if fit is None:
            print(f"does NOT fit in {a.gpu_memory_gb:g} GB per GPU with any of activation checkpointing, "
                  f"bf16 states, CPU offload: add GPUs or lower batch/resolution")
            return 1
        t, r = fit
        print(f"does NOT fit in {a.gpu_memory_gb:g} GB; cheapest settings that fit: "
              f"--precision={t.precision} --activation_checkpointing={int(t.activation_checkpointing)} "
              f"--cpu_offload={int(t.cpu_offload)} ({r['gpu_total'] / GIB:.2f} GiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
