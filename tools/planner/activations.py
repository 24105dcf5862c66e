"""What one forward saves for backward, measured on meta: flash SDPA's saves, the forward inputs (each
family spec's example_inputs), and context parallelism's per-rank share."""
from __future__ import annotations

import contextlib
import math
import functools
import dataclasses
import os
from dataclasses import dataclass

import torch
import torch.nn as nn

from core.errors import ConfigError
from families import SPECS, pipelines, spec_of
from parallel import lora as lora_lib
from tools.planner.build import (Part, Settings, _config, _size, frames, latent_shapes, layout, meta_model,
                                  native_resolution, pipeline_of, plans_references, target_size, text_length,
                                  vae_factor)
from tools.planner.shard import _add_lora_on_meta

# ----------------------------------------------------------------------------------------------
# activations, measured on meta

ATTENTION_NOTE = "attention counted as flash/memory-efficient SDPA saves it: q, k, v, out, logsumexp"


class _FlashSDPA(torch.autograd.Function):
    """scaled_dot_product_attention saving for backward what the GPU's flash / memory-efficient
    kernels save: q, k, v, the output and an fp32 logsumexp of shape (..., heads, L_q) (plus the
    mask, when one is given: the memory-efficient kernel keeps its attention bias). The output is
    the original SDPA's, computed without grad (on meta nothing is materialised; elsewhere its
    L x L temporaries are freed, not saved); backward recomputes through the original (math) SDPA."""

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        kw = dict(attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale)
        if enable_gqa:
            kw["enable_gqa"] = True
        out = _ORIGINAL_SDPA(q, k, v, **kw)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.kw = kw
        ctx.save_for_backward(q, k, v, out, lse, *([attn_mask] if torch.is_tensor(attn_mask) else []))
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v = (t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors[:3])
        with torch.enable_grad():
            out = _ORIGINAL_SDPA(q, k, v, **ctx.kw)
        wanted = [t for t in (q, k, v) if t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad)) if wanted else iter(())
        return tuple(next(grads) if t.requires_grad else None for t in (q, k, v)) + (None,) * 5


_ORIGINAL_SDPA = torch.nn.functional.scaled_dot_product_attention


def _flash_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return _FlashSDPA.apply(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


@contextlib.contextmanager
def flash_attention_saves():
    """Within: torch.nn.functional.scaled_dot_product_attention (which diffusers' attention calls,
    looked up at call time) is _FlashSDPA, so saved-tensor hooks count what a GPU's flash /
    memory-efficient kernel keeps for backward, not the math reference's L x L matrices (meta and CPU
    run the math one). The original is restored on exit."""
    F = torch.nn.functional
    previous = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _flash_sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = previous


@dataclass(frozen=True)
class ActivationProfile:
    """What one forward saves for backward, by where it is saved: `outside` every unit (embedders,
    final norm and projection), and per outermost unit in forward order `blocks`: (its name, bytes
    saved inside it, bytes of its tensor inputs: what activation checkpointing keeps of it)."""
    outside: int
    blocks: tuple[tuple[str, int, int], ...]

    def total(self, checkpointing: bool) -> int:
        """The activations at their peak, the turn from forward to backward. With checkpointing:
        outside + every block's inputs + the largest block's saves (recomputed one block at a time)."""
        if checkpointing:
            return self.outside + sum(i for _, _, i in self.blocks) + max((a for _, a, _ in self.blocks), default=0)
        return self.outside + sum(a for _, a, _ in self.blocks)

    def timeline(self, checkpointing: bool) -> list[tuple[str, int]]:
        """(unit, activations held while it runs, forward or backward) in forward order: all saved
        outside, what the units before it keep (checkpointing: their inputs) and its own saves."""
        out, kept = [], self.outside
        for name, saved, inputs in self.blocks:
            out.append((name, kept + saved + (inputs if checkpointing else 0)))
            kept += inputs if checkpointing else saved
        return out


def activation_profile(model: nn.Module, inputs: dict, unit_names: list[str],
                       flash_attention: bool = True) -> ActivationProfile:
    """What autograd saves for backward in one forward (saved-tensor hooks; parameters excluded,
    views counted once), by unit (ActivationProfile). `unit_names`: the submodules (by name) that are
    FSDP units; the outermost of them are the blocks activation checkpointing recomputes.
    `flash_attention`: attention saves what the GPU's flash / memory-efficient SDPA saves
    (flash_attention_saves); False: what the math reference saves (two fp32 L x L per call). The
    hooks see what autograd really keeps: ops save an input only where a grad needs it, so under
    LoRA (frozen base, inputs without grad) the count is of what LoRA keeps."""
    params = {id(p) for p in model.parameters()}
    seen, per_block, outside, block_inputs = set(), {}, [0], {}
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
    blocks = {n: model.get_submodule(n) for n in unit_names}
    inside = [set(o.modules()) for o in blocks.values()]
    outer = {n: b for n, b in blocks.items() if not any(b is not o and b in m for o, m in zip(blocks.values(), inside))}

    def hooks_for(name):
        def enter(mod, args, kwargs):
            if current[0] is None:
                current[0] = name
                block_inputs[name] = sum(a.numel() * a.element_size() for a in list(args) + list(kwargs.values())
                                         if torch.is_tensor(a))

        def leave(mod, args, kwargs, out):
            if current[0] == name:
                current[0] = None
        return enter, leave

    for name, b in outer.items():
        enter, leave = hooks_for(name)
        hooks.append(b.register_forward_pre_hook(enter, with_kwargs=True))
        hooks.append(b.register_forward_hook(leave, with_kwargs=True))
    try:
        attention = flash_attention_saves() if flash_attention else contextlib.nullcontext()
        with attention, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(**inputs)
    finally:
        for h in hooks:
            h.remove()
    # block_inputs is filled in forward order (dicts keep insertion order)
    return ActivationProfile(outside[0], tuple((n, per_block.get(n, 0), i) for n, i in block_inputs.items()))


def activation_bytes(model: nn.Module, inputs: dict, unit_names: list[str], checkpointing: bool,
                     flash_attention: bool = True) -> int:
    """Bytes autograd saves for backward in one forward (activation_profile), with checkpointing:
    what is saved outside blocks + every block's inputs + the largest block's own saved bytes."""
    return activation_profile(model, inputs, unit_names, flash_attention).total(checkpointing)


def _meta_inputs(folder: str, model: nn.Module, batch: int, shapes: tuple, dtype: torch.dtype, text: int,
                 trained_input: bool = True) -> dict:
    """The trained model's forward inputs on meta, as its family's spec builds them (FamilySpec.example_inputs):
    `shapes` the latents' (h, w), the target first, then each reference; `text` tokens. `trained_input`: the
    first tensor (the noisy latents) requires grad, as the latents of a full fine-tune's forward do."""
    inputs = spec_of(pipeline_of(folder)).example_inputs(model.config, batch, shapes, text, device="meta",
                                                          dtype=dtype)
    if trained_input:
        next(x for x in inputs.values() if torch.is_tensor(x)).requires_grad_(True)
    return inputs


def _image_tokens(folder: str, shapes: tuple) -> int:
    """The trained model's image tokens per sample for these latents: its spec's plan_tokens, else its example
    inputs' first tensor's sequence dimension."""
    cfg, spec = _config(folder, next(c.subfolder for c in _trained_parts(folder))), spec_of(pipeline_of(folder))
    if spec.plan_tokens is not None:
        return spec.plan_tokens(cfg, shapes)
    inputs = spec.example_inputs(cfg, 1, shapes, 1, device="meta", dtype=torch.bfloat16)
    return next(x for x in inputs.values() if torch.is_tensor(x)).shape[1]


def _trained_parts(folder: str) -> list:
    return pipelines.trained_components(pipeline_of(folder))


# ----------------------------------------------------------------------------------------------
# context parallelism (train_flux_kontext.py's CONTEXT_PARALLEL)

def check_context_parallel(folder: str, s: Settings) -> dict:
    """The checks the script makes before any work (fsdp_utils.check_context_parallel's mesh, then the family's
    FamilySpec.check_context_parallel, its room's, at the planned shapes), on the planner's flags: SystemExit
    with one line if one fails. Returns the sequence CP splits: {"heads", "text", "image"} (image: all the
    image tokens of a sample at s.resolution, the model's native one if None); {} without CP."""
    c = s.context_parallel
    if not isinstance(c, int) or c < 1:
        raise SystemExit(f"plan: --context_parallel={c}: must be >= 1 (1 = off)")
    if c == 1:
        return {}
    script, kind = layout(folder, s.script)
    refusal = _no_cp(f"--context_parallel={c}", os.path.basename(os.path.normpath(folder)), folder, script, kind)
    if refusal:
        raise SystemExit(refusal)
    if s.world_size % (c * s.dp_replicate):
        raise SystemExit(f"plan: --context_parallel={c} x --dp_replicate={s.dp_replicate} does not divide "
                         f"--world_size={s.world_size}")
    resolution = s.resolution or native_resolution(folder)
    shapes = latent_shapes(folder, dataclasses.replace(s, resolution=resolution))
    factor, text = vae_factor(folder), text_length(folder)
    s = dataclasses.replace(s, resolution=resolution)
    pixels = (target_size(folder, s)[0], *((h * factor, w * factor) for h, w in shapes[1:]))
    settings = {"CONTEXT_PARALLEL": c, "MAX_SEQUENCE_LENGTH": text, "RESOLUTION": resolution,
                "REFERENCE_AREA": s.reference_area}
    if frames(folder, s):
        settings["NUM_FRAMES"] = frames(folder, s)
    try:
        spec_of(pipeline_of(folder)).check_context_parallel(folder, c, settings, [(pixels[0], pixels[1:])])
    except ConfigError as e:
        raise SystemExit(f"plan: {str(e).replace(f'CONTEXT_PARALLEL={c}', f'--context_parallel={c}', 1)}") from None
    trained = next(p for p in _trained_parts(folder))
    return dict(heads=_config(folder, trained.subfolder)["num_attention_heads"], text=text,
                image=_image_tokens(folder, shapes))


def _no_cp(flag: str, name: str, folder: str, script: str, kind: str) -> str:
    """The one line refusing context parallelism where the script or the family has none ("" where both do):
    a script has it where a room's Protocol for it asks check_context_parallel, a family where its spec has a check
    and its room's Protocol for the script asks it."""
    spec = spec_of(pipeline_of(folder))
    scripts = sorted({s for sp in SPECS for s, p in sp.protocols.items() if hasattr(p, "check_context_parallel")})
    if script not in scripts:
        return (f"plan: {flag}: context parallelism is {' / '.join(scripts)}'s; {name} is planned for {script}, "
                f"which has none")
    if spec.check_context_parallel is None or not hasattr(spec.protocols.get(script), "check_context_parallel"):
        return f"plan: {flag}: {name} ({kind}): its family takes no context parallelism"
    return ""


def _cp_activations(folder: str, trainable: Part, unit_names: tuple, dtype: torch.dtype, s: Settings,
                    sequence: dict, one_forward: int, activations) -> dict:
    """A CP rank's activations: {"per_rank", "whole", "buffers"}. Ulysses keeps on each rank the
    token-wise tensors of its 1/C of the sequence, and attention's flash saves over all tokens for
    H/C heads (1/C too); what has no sequence dimension (timestep, guidance and pooled embeddings,
    the modulation vectors) is whole on every rank. With flash saves every saved tensor is linear in
    the tokens, A(L) = a + b L: a second meta forward at half the side and a quarter of the text tokens gives
    a. Added: the all-to-all buffers of one attention call (q, k, v and the output, each sent and
    received: 8 x L/C x inner width) and the final output all-gathered for the loss (fp32)."""
    ac, c, text, image = s.activation_checkpointing, s.context_parallel, sequence["text"], sequence["image"]
    small_shapes = latent_shapes(folder, dataclasses.replace(s, resolution=s.resolution // 2))
    small_text = max(1, text // 4)
    n1, n2 = text + image, small_text + _image_tokens(folder, small_shapes)
    small = activations(folder, trainable.spec.subfolder, unit_names, dtype, s.batch_size, small_shapes,
                        trainable.lora, small_text).total(ac)
    whole = min(one_forward, max(0, (n1 * small - n2 * one_forward) // (n1 - n2)))
    cfg = _config(folder, trainable.spec.subfolder)
    inner = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    out_channels = cfg.get("out_channels") or cfg["in_channels"]
    if isinstance(cfg.get("patch_size"), list):  # a video model's (t, h, w) patch: unpatchified after the gather
        out_channels *= math.prod(cfg["patch_size"])
    buffers = (8 * s.batch_size * n1 * inner // c * _size(dtype)
               + s.batch_size * image * out_channels * (c - 1) // c * _size(torch.float32))
    return dict(per_rank=whole + -(-(one_forward - whole) // c) + buffers, whole=whole, buffers=buffers)


def reference_grids(folder: str, s: Settings) -> tuple:
    """The references a family plans at an area (FamilySpec.reference_area: FLUX.2's), as (h, w) token grids
    of their 2x2-packed latents (latent_shapes); () for the others."""
    if not spec_of(pipeline_of(folder)).reference_area or not plans_references(folder):
        return ()
    return tuple((h // 2, w // 2) for h, w in latent_shapes(folder, s)[1:])


@functools.lru_cache(maxsize=None)
def _activations(folder: str, subfolder: str, unit_names: tuple, dtype: torch.dtype, batch: int, shapes: tuple,
                 lora: lora_lib.Lora = lora_lib.Lora(), text: int = 0) -> ActivationProfile:
    """What one forward of the trainable model (folder/subfolder) saves, by unit (activation_profile),
    its blocks being the units of `unit_names`: those its recipe made; `shapes` its latents (latent_shapes).
    With `lora`: of the model with its adapters (computed in `dtype`, as FSDP all-gathers them) on a frozen
    base, its inputs not requiring grad (the latents do not), so autograd saves what LoRA keeps: each adapted
    Linear's input (lora_A's grad) and its rank-r intermediate (lora_B's), and of the frozen layers only what
    the input grads need. `text`: the text tokens (0: the folder's, text_length)."""
    model = meta_model(os.path.join(folder, subfolder)).to(dtype)
    if lora:
        _add_lora_on_meta(model, lora)
        model.to(dtype)
    inputs = _meta_inputs(folder, model, batch, shapes, dtype, text or text_length(folder), trained_input=not lora)
    return activation_profile(model, inputs, list(unit_names))


# the built-in real-size configs never change within a process: their measured activations (and shard
# counts: plan._BUILTIN_SHARDS) are kept for every later plan (tests and fit tables plan the same models many times)
@functools.lru_cache(maxsize=None)
def _builtin_activations(*args, **kwargs) -> ActivationProfile:
    return _activations(*args, **kwargs)
