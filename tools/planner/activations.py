"""What one forward saves for backward, measured on meta: flash SDPA's saves, the forward inputs per
kind, and context parallelism's per-rank share."""
from __future__ import annotations

import contextlib
import functools
import math
import os
from dataclasses import dataclass

import torch
import torch.nn as nn

from parallel import lora as lora_lib
from families import FAMILIES  # the rooms
from tools.planner.build import (DMD_KINDS, FLUX2_REFERENCES, QWEN_REFERENCES, Part, Settings, _config,
                                  _folder_shapes, _size, layout, meta_model, native_resolution)
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


def _pooled_dim(folder: str, unet_config) -> int:
    """SDXL's pooled text embedding width: text_encoder_2's projection_dim (1280), else what the
    UNet's add embedding takes besides the time ids (projection_class_embeddings_input_dim - 6 x
    addition_time_embed_dim)."""
    dim = _config(folder, "text_encoder_2").get("projection_dim")
    if dim:
        return int(dim)
    return unet_config.projection_class_embeddings_input_dim - 6 * unet_config.addition_time_embed_dim


def _meta_inputs(kind: str, model: nn.Module, batch: int, resolution: int, dtype: torch.dtype,
                 factor: int = 8, text: int | None = None, pooled: int | None = None, references: tuple = ()) -> dict:
    """The trainable model's forward inputs on meta. SDXL: encoder_hidden_states (B, 77, 2048) and
    added_cond_kwargs text_embeds (B, pooled) + time_ids (B, 6), as train_dmd.py passes them.
    Qwen-Image-Edit: the target's and QWEN_REFERENCES references' tokens and their img_shapes, the
    prompt's hidden states without a mask (the pipeline drops an all-ones one). FLUX.2: the target's
    tokens and those of `references` (their (h, w) token grids, reference_grids), 4-D ids, the padded
    text, [dev]'s guidance."""
    cfg = model.config
    text = text or (77 if kind in ("sd15", "sdxl") else 512)
    with torch.device("meta"):
        if kind in ("sd15", "sdxl"):
            lat = resolution // factor
            inputs = dict(sample=torch.empty(batch, cfg.in_channels, lat, lat, dtype=dtype, requires_grad=True),
                          timestep=torch.zeros(batch, dtype=torch.long),
                          encoder_hidden_states=torch.empty(batch, text, cfg.cross_attention_dim, dtype=dtype),
                          return_dict=False)
            if kind == "sdxl":
                pooled = pooled or cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim
                n_time = (cfg.projection_class_embeddings_input_dim - pooled) // cfg.addition_time_embed_dim
                inputs["added_cond_kwargs"] = {"text_embeds": torch.empty(batch, pooled, dtype=dtype),
                                               "time_ids": torch.empty(batch, n_time, dtype=dtype)}
            return inputs
        if kind == "qwen_image_edit":  # target + QWEN_REFERENCES references, each its own (frame, h, w) for RoPE
            side = resolution // (2 * factor)
            shapes = [(1, side, side)] * (1 + QWEN_REFERENCES)
            return dict(hidden_states=torch.empty(batch, len(shapes) * side * side, cfg.in_channels, dtype=dtype,
                                                  requires_grad=True),
                        encoder_hidden_states=torch.empty(batch, text, cfg.joint_attention_dim, dtype=dtype),
                        timestep=torch.empty(batch, dtype=dtype), img_shapes=[shapes] * batch, return_dict=False)
        if kind == "flux2":  # [target ; references], as families/flux2.model_inputs packs them
            side = resolution // (2 * factor)
            tokens = side * side + sum(h * w for h, w in references)
            return dict(hidden_states=torch.empty(batch, tokens, cfg.in_channels, dtype=dtype, requires_grad=True),
                        encoder_hidden_states=torch.empty(batch, text, cfg.joint_attention_dim, dtype=dtype),
                        timestep=torch.empty(batch, dtype=dtype),
                        img_ids=torch.zeros(batch, tokens, 4, dtype=torch.long),
                        txt_ids=torch.zeros(batch, text, 4, dtype=torch.long),
                        guidance=torch.empty(batch) if cfg.guidance_embeds else None, return_dict=False)
        tokens = _image_tokens(resolution, factor)  # target + context: VAE factor, 2x2 packing
        return dict(hidden_states=torch.empty(batch, tokens, cfg.in_channels, dtype=dtype, requires_grad=True),
                    encoder_hidden_states=torch.empty(batch, text, cfg.joint_attention_dim, dtype=dtype),
                    pooled_projections=torch.empty(batch, cfg.pooled_projection_dim, dtype=dtype),
                    timestep=torch.empty(batch, dtype=dtype), img_ids=torch.zeros(tokens, 3),
                    txt_ids=torch.zeros(text, 3), guidance=torch.empty(batch), return_dict=False)


# ----------------------------------------------------------------------------------------------
# context parallelism (train_flux_kontext.py's CONTEXT_PARALLEL)

def check_context_parallel(folder: str, s: Settings) -> dict:
    """The checks train_flux_kontext.py makes before any work (fsdp_utils.check_context_parallel,
    families/flux.check_context_parallel), on the planner's flags: SystemExit with one line if one fails.
    Returns the sequence CP splits: {"heads", "text", "image"} (image: target + context tokens at
    s.resolution, the model's native one if None); {} without CP (nothing is read)."""
    c = s.context_parallel
    if not isinstance(c, int) or c < 1:
        raise SystemExit(f"plan: --context_parallel={c}: must be >= 1 (1 = off)")
    if c == 1:
        return {}
    script, kind = layout(folder, s.script)
    if kind != "flux_kontext":
        raise SystemExit(_no_cp(f"--context_parallel={c}", os.path.basename(os.path.normpath(folder)), script, kind))
    if s.world_size % (c * s.dp_replicate):
        raise SystemExit(f"plan: --context_parallel={c} x --dp_replicate={s.dp_replicate} does not divide "
                         f"--world_size={s.world_size}")
    heads = _config(folder, "transformer")["num_attention_heads"]
    if heads % c:
        raise SystemExit(f"plan: --context_parallel={c}: the transformer's {heads} attention heads do not divide "
                         f"by it (Ulysses splits the heads)")
    factor, text = _folder_shapes(folder, kind)
    if text % c:
        raise SystemExit(f"plan: --context_parallel={c}: the {text} text tokens (T5 length) do not divide by it")
    resolution = s.resolution or native_resolution(folder, kind)
    image = _image_tokens(resolution, factor)
    if image % c:
        raise SystemExit(f"plan: --context_parallel={c}: {resolution} px has {image} image tokens (target + context, "
                         f"2 x ({resolution}/{2 * factor})^2), not divisible by it; change --resolution")
    return dict(heads=heads, text=text, image=image)


def _no_cp(flag: str, name: str, script: str, kind: str) -> str:
    """The one line refusing context parallelism for a layout other than FLUX Kontext's fine-tune."""
    if script == "train_flux_kontext.py":  # another family of the script: its CP is not planned
        return f"plan: {flag}: context parallelism is planned for FLUX Kontext only; {name} is {kind}"
    return (f"plan: {flag}: context parallelism is train_flux_kontext.py's (FLUX layout); {name} is planned for "
            f"{script}, which has none")


def _cp_activations(folder: str, trainable: Part, kind: str, unit_names: tuple, dtype: torch.dtype, s: Settings,
                    sequence: dict, one_forward: int, activations) -> dict:
    """A CP rank's activations: {"per_rank", "whole", "buffers"}. Ulysses keeps on each rank the
    token-wise tensors of its 1/C of the sequence, and attention's flash saves over all tokens for
    H/C heads (1/C too); what has no sequence dimension (timestep, guidance and pooled embeddings,
    the modulation vectors) is whole on every rank. With flash saves every saved tensor is linear in
    the tokens, A(L) = a + b L: a second meta forward at a quarter of the text and image tokens gives
    a. Added: the all-to-all buffers of one attention call (q, k, v and the output, each sent and
    received: 8 x L/C x inner width) and the final output all-gathered for the loss (fp32)."""
    ac, c, text, image = s.activation_checkpointing, s.context_parallel, sequence["text"], sequence["image"]
    factor = _folder_shapes(folder, kind)[0]
    small_res, small_text = s.resolution // 2, max(1, text // 4)
    n1, n2 = text + image, small_text + _image_tokens(small_res, factor)
    small = activations(folder, trainable.spec.subfolder, kind, unit_names, dtype, s.batch_size, small_res,
                        trainable.lora, small_text).total(ac)
    whole = min(one_forward, max(0, (n1 * small - n2 * one_forward) // (n1 - n2)))
    cfg = _config(folder, trainable.spec.subfolder)
    inner = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    out_channels = cfg.get("out_channels") or cfg["in_channels"]
    buffers = (8 * s.batch_size * n1 * inner // c * _size(dtype)
               + s.batch_size * image * out_channels * (c - 1) // c * _size(torch.float32))
    return dict(per_rank=whole + -(-(one_forward - whole) // c) + buffers, whole=whole, buffers=buffers)


def reference_grids(kind: str, s: Settings) -> tuple:
    """FLUX.2's references as (h, w) token grids: s.references (FLUX2_REFERENCES) images at least
    s.reference_area (the pipeline's REFERENCE_AREA) large, so each downsized to it and cut to multiples of 16
    by the pipeline's rule (families/flux2.pipeline_size), square; () for other kinds."""
    if DMD_KINDS.get(kind, kind) != "flux2":
        return ()
    room = FAMILIES["Flux2Pipeline"]
    area = s.reference_area or room.REFERENCE_AREA
    side = math.isqrt(area)
    h, w = room.pipeline_size(side, side, area)[1]
    return ((h // room.MULTIPLE, w // room.MULTIPLE),) * (FLUX2_REFERENCES if s.references is None else s.references)


def _image_tokens(resolution: int, factor: int) -> int:
    """FLUX Kontext's image tokens at a square resolution: target + context, 2x2-packed latents."""
    return 2 * (resolution // (2 * factor)) ** 2


@functools.lru_cache(maxsize=None)
def _activations(folder: str, subfolder: str, kind: str, unit_names: tuple, dtype: torch.dtype, batch: int,
                 resolution: int, lora: lora_lib.Lora = lora_lib.Lora(), text: int = 0,
                 references: tuple = ()) -> ActivationProfile:
    """What one forward of the trainable model (folder/subfolder) saves, by unit (activation_profile),
    its blocks being the units of `unit_names`: those its recipe made. With `lora`: of the model with
    its adapters (computed in `dtype`, as FSDP all-gathers them) on a frozen base, its inputs not
    requiring grad (the latents do not), so autograd saves what LoRA keeps: each adapted Linear's
    input (lora_A's grad) and its rank-r intermediate (lora_B's), and of the frozen layers only what
    the input grads need. `text`: the text tokens (0: the folder's); `references`: FLUX.2's reference grids."""
    model = meta_model(os.path.join(folder, subfolder)).to(dtype)
    if lora:
        _add_lora_on_meta(model, lora)
        model.to(dtype)
    factor, folder_text = _folder_shapes(folder, kind)
    pooled = _pooled_dim(folder, model.config) if kind == "sdxl" else None
    inputs = _meta_inputs(kind, model, batch, resolution, dtype, factor, text or folder_text, pooled, references)
    if lora:
        for x in inputs.values():
            if torch.is_tensor(x):
                x.requires_grad_(False)
    return activation_profile(model, inputs, list(unit_names))


# the built-in real-size configs never change within a process: their measured activations (and shard
# counts: plan._BUILTIN_SHARDS) are kept for every later plan (tests and fit tables plan the same models many times)
@functools.lru_cache(maxsize=None)
def _builtin_activations(*args, **kwargs) -> ActivationProfile:
    return _activations(*args, **kwargs)
