"""The attention kernel, chosen by the run and checked at start (ATTENTION_BACKEND, both scripts).

A kernel choice must not be left to a default that changes under users: from torch 2.11 SDPA tries
cuDNN attention first on Hopper and Blackwell, and its backward fails at FLUX's shapes
(`mha_graph.execute(...).is_good()`, pytorch#190321 / #134001), surfacing as a CUBLAS error or an
illegal memory access a few kernels later. So:

- ATTENTION_BACKEND names one of diffusers' attention-dispatcher backends
  (diffusers/models/attention_dispatch.py `AttentionBackendName`). Models that go through the
  dispatcher (the FLUX transformer) get it with `set_attention_backend`; models that call
  `F.scaled_dot_product_attention` themselves (SD UNet, VAE, CLIP, T5) see only torch's global SDPA
  flags, set from the same name by `sdpa_flags`:

      native             flash, mem-efficient, math; cuDNN off        (the default)
      _native_cudnn      torch's own order, cuDNN first on sm90/sm100
      _native_flash      flash, with math for shapes flash cannot run (the VAE's head dim 512)
      _native_efficient  mem-efficient, with math as above
      _native_math       math only

  Dispatcher-only backends (flash, _flash_3, sage, flex, xformers, ...) keep the flags of `native`
  for the models outside the dispatcher, and are refused where the trained model is one of those.
- `self_check` runs one forward+backward at the run's own attention shapes in the chosen kernel
  against the math kernel in fp32, so a broken kernel stops the run in its first seconds with
  one line naming the kernel and an alternative.
- `CastSdpaProcessor` runs a UNet's attention products in another dtype than its weights and
  projections (FAKE_SCORE_ATTENTION_DTYPE: DMD2's fp32 fake score with bf16 attention): flash has
  no fp32 kernel, and SDPA's fp32 path (the memory-efficient kernel; TF32 does not reach it) was
  ~half the GPU time of an SD-1.5 DMD2 step with the fp32 fake score (docs/dmd2.md).

    python -m pytest tests/test_attention.py -q
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from core.errors import ConfigError, LocalError

DEFAULT = "native"
TORCH_SDPA = ("native", "_native_cudnn", "_native_flash", "_native_efficient", "_native_math")
# (flash, mem-efficient, math, cuDNN) enabled for each torch-SDPA name
_FLAGS = {"native": (True, True, True, False), "_native_cudnn": (True, True, True, True),
          "_native_flash": (True, False, True, False), "_native_efficient": (False, True, True, False),
          "_native_math": (False, False, True, False)}
_NOT_HERE = ("_hub", "_npu", "_xla")  # need a download, or another accelerator


def dispatcher_names() -> list[str]:
    """Every backend name diffusers' dispatcher knows."""
    from diffusers.models.attention_dispatch import AttentionBackendName
    return [b.value for b in AttentionBackendName]


def installed() -> list[str]:
    """The dispatcher backends whose packages are present here (diffusers' own requirement check),
    without those that download kernels or need another accelerator."""
    from diffusers.models import attention_dispatch as ad
    check = getattr(ad, "_check_attention_backend_requirements", None)  # private: absent in some releases
    names = []
    for name in dispatcher_names():
        if any(name.endswith(s) or s + "_" in name for s in _NOT_HERE):
            continue
        if name == "_native_cudnn" and not torch.cuda.is_available():
            continue
        if check is None and name not in TORCH_SDPA:
            continue
        try:
            if check is not None:
                check(ad.AttentionBackendName(name))
        except (RuntimeError, ImportError):
            continue
        names.append(name)
    order = {n: i for i, n in enumerate(TORCH_SDPA)}
    return sorted(names, key=lambda n: (order.get(n, len(order)), n))  # torch's own kernels first


def check_backend(name: str, dispatcher_model: bool) -> str:
    """ATTENTION_BACKEND checked before any work: a known, installed name, and one the trained
    model can use (`dispatcher_model`: it goes through diffusers' dispatcher). Returns the name."""
    name = (name or DEFAULT).lower()
    known = dispatcher_names()
    here = installed()
    if name not in known:
        raise ConfigError(f"ATTENTION_BACKEND={name!r}: unknown; installed here: {', '.join(here)}")
    if name not in here:
        raise ConfigError(f"ATTENTION_BACKEND={name!r}: not usable here (its package or device is missing); "
                          f"installed here: {', '.join(here)}")
    if not dispatcher_model and name not in TORCH_SDPA:
        raise ConfigError(f"ATTENTION_BACKEND={name!r}: this model calls torch's SDPA directly, so only "
                          f"{', '.join(TORCH_SDPA)} reach it")
    return name


def sdpa_flags(name: str) -> str:
    """Set torch's global SDPA flags from `name` (dispatcher-only names: those of `native`), for
    every model that calls SDPA itself. Returns what is enabled, for the start-up line."""
    flash, efficient, math, cudnn = _FLAGS.get(name, _FLAGS[DEFAULT])
    torch.backends.cuda.enable_flash_sdp(flash)
    torch.backends.cuda.enable_mem_efficient_sdp(efficient)
    torch.backends.cuda.enable_math_sdp(math)
    torch.backends.cuda.enable_cudnn_sdp(cudnn)
    return "+".join(k for k, on in zip(("flash", "efficient", "math", "cudnn"), (flash, efficient, math, cudnn)) if on)


def set_backend(model: torch.nn.Module, name: str) -> None:
    """Route every dispatcher attention of a diffusers model (e.g. FluxTransformer2DModel) to
    `name`, explicitly, so DIFFUSERS_ATTN_BACKEND or another model's choice cannot change it."""
    log = logging.getLogger("diffusers.models.modeling_utils")
    level = log.level
    log.setLevel(logging.ERROR)  # its "experimental feature" warning, once per model
    try:
        model.set_attention_backend(name)
    finally:
        log.setLevel(level)


def model_backends(model: torch.nn.Module) -> set:
    """The backends the model's dispatcher attentions are set to (None: the dispatcher's default)."""
    found = set()
    for m in model.modules():
        processor = getattr(m, "processor", None)
        if processor is not None and hasattr(processor, "_attention_backend"):
            b = processor._attention_backend
            found.add(getattr(b, "value", b))
    return found


# ----------------------------------------------------------------------------------------------
# attention products in another dtype than the model


class CastSdpaProcessor:
    """diffusers' AttnProcessor2_0 (the UNet's and VAE's default) with q, k, v cast to `sdpa_dtype`
    for F.scaled_dot_product_attention and its output cast back: projections, norms and weights stay
    in the model's dtype, the backward casts the gradients the same way. Set on a model with
    `model.set_attn_processor(CastSdpaProcessor(torch.bfloat16))`."""

    def __init__(self, sdpa_dtype: torch.dtype):
        self.sdpa_dtype = sdpa_dtype

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, temb: torch.Tensor | None = None, *args, **kwargs):
        residual = hidden_states
        if attn.spatial_norm is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)
        image = hidden_states.ndim == 4
        if image:
            b, c, h, w = hidden_states.shape
            hidden_states = hidden_states.view(b, c, h * w).transpose(1, 2)
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        batch, length = context.shape[:2]
        if attention_mask is not None:
            attention_mask = attn.prepare_attention_mask(attention_mask, length, batch)
            attention_mask = attention_mask.view(batch, attn.heads, -1, attention_mask.shape[-1]).to(self.sdpa_dtype)
        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
        query = attn.to_q(hidden_states)
        if encoder_hidden_states is None:
            context = hidden_states
        elif attn.norm_cross:
            context = attn.norm_encoder_hidden_states(context)
        key, value = attn.to_k(context), attn.to_v(context)
        head_dim = key.shape[-1] // attn.heads
        q, k, v = (t.view(batch, -1, attn.heads, head_dim).transpose(1, 2) for t in (query, key, value))
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        out = F.scaled_dot_product_attention(q.to(self.sdpa_dtype), k.to(self.sdpa_dtype), v.to(self.sdpa_dtype),
                                             attn_mask=attention_mask, dropout_p=0.0, is_causal=False)
        out = out.transpose(1, 2).reshape(batch, -1, attn.heads * head_dim).to(query.dtype)
        out = attn.to_out[1](attn.to_out[0](out))  # projection, dropout
        if image:
            out = out.transpose(-1, -2).reshape(b, c, h, w)
        if attn.residual_connection:
            out = out + residual
        return out / attn.rescale_output_factor


def sdpa_dtypes(model: torch.nn.Module) -> set:
    """The dtypes a model's CastSdpaProcessor attentions compute in (empty: none cast)."""
    return {m.processor.sdpa_dtype for m in model.modules()
            if isinstance(getattr(m, "processor", None), CastSdpaProcessor)}


# ----------------------------------------------------------------------------------------------
# the start-up self-check


@dataclass(frozen=True)
class Shape:
    """One attention call of the run: batch, query and key lengths, heads, head dim; `backward`:
    whether the run differentiates through it (frozen models run forward only)."""
    what: str
    batch: int
    q_len: int
    k_len: int
    heads: int
    head_dim: int
    backward: bool = True


def dispatcher_attend(name: str):
    """q, k, v (B, S, H, D) -> out (B, S, H, D) through diffusers' dispatcher in backend `name`."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    def attend(q, k, v):
        return dispatch_attention_fn(q, k, v, backend=name)
    return attend


def sdpa_attend(q, k, v):
    """q, k, v (B, S, H, D) -> out through F.scaled_dot_product_attention under the global flags."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def _reference(q, k, v, grad, heads):
    """(out, dq, dk, dv) of the math kernel in fp32 on the listed heads only: its S x S scores are
    the memory cost, and a head's outputs and grads depend on that head alone."""
    q, k, v = (t[:, :, heads].detach().float().requires_grad_() for t in (q, k, v))
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    out.backward(grad[:, :, heads].float())
    return out.detach(), q.grad, k.grad, v.grad


def _rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b).norm() / b.norm().clamp_min(1e-12))


def tolerance(dtype: torch.dtype) -> float:
    """Relative (Frobenius) error a correct kernel stays under against fp32 math."""
    return 1e-3 if dtype == torch.float32 else 3e-2


def self_check(calls: list[tuple[Shape, object]], name: str, dtype: torch.dtype, device: torch.device,
               alternative: str = DEFAULT) -> list[str]:
    """Run each (shape, attend) forward (+ backward) in `dtype` on `device` and compare with fp32
    math: a kernel that fails, or returns wrong values or grads, raises LocalError in one line
    naming `name` and `alternative`. Returns one summary line per shape."""
    lines = []
    for s, attend in calls:
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(s.batch, s.q_len, s.heads, s.head_dim, device=device, generator=g, dtype=dtype)
        k, v = (torch.randn(s.batch, s.k_len, s.heads, s.head_dim, device=device, generator=g, dtype=dtype)
                for _ in range(2))
        grad = torch.randn(s.batch, s.q_len, s.heads, s.head_dim, device=device, generator=g, dtype=dtype)
        heads = sorted({0, s.heads - 1})
        where = (f"ATTENTION_BACKEND={name}: the start-up check failed on {s.what} (batch {s.batch}, "
                 f"{s.q_len}x{s.k_len} tokens, {s.heads} heads x {s.head_dim}, {str(dtype).replace('torch.', '')})")
        try:
            for t in (q, k, v):
                t.requires_grad_(s.backward)
            ctx = contextlib.nullcontext() if s.backward else torch.no_grad()
            with ctx:
                out = attend(q, k, v)
            if s.backward:
                out.backward(grad)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # a kernel's asynchronous failure surfaces here, not at step 1
            ref = _reference(q, k, v, grad, heads)
        except Exception as e:  # noqa: BLE001 - any failure of the kernel is the finding
            raise LocalError(f"{where}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}; "
                             f"use --attention_backend={alternative}") from None
        got = [out.detach()[:, :, heads]] + ([t.grad[:, :, heads] for t in (q, k, v)] if s.backward else [])
        errors = [_rel_error(a, b) for a, b in zip(got, ref)]
        worst = max(errors)
        if not worst <= tolerance(dtype):  # also catches NaN
            parts = ["out", "dq", "dk", "dv"]
            raise LocalError(f"{where}: relative error {worst:.3g} in {parts[errors.index(worst)]} against fp32 math "
                             f"(tolerance {tolerance(dtype):g}); use --attention_backend={alternative}")
        lines.append(f"{s.what}: {s.batch}x{s.q_len}x{s.k_len} tokens, {s.heads}x{s.head_dim}, "
                     f"{'fwd+bwd' if s.backward else 'fwd'} max rel err {worst:.1e}")
    return lines
