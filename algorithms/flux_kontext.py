"""Pure-tensor pieces of the FLUX.1 Kontext training step.

Conventions (checked against diffusers 0.42.1, ``FluxKontextPipeline`` and the
``train_dreambooth_lora_flux_kontext.py`` example):

* Latents: ``(posterior.mode() - shift_factor) * scaling_factor``.
* Packing: 2x2 latent patches -> tokens of ``4*C`` channels, channel-major inside a
  token (``c, dy, dx``), tokens in row-major order over the ``(H/2, W/2)`` grid.
* Position ids: ``(index, row, col)`` per token, index 0 for the target (noisy) image
  and 1 for the context (conditioning) image; both 2-D ``(tokens, 3)`` and shared by
  the whole batch. Sequence order is ``[target ; context]``. Text ids are zeros.
* The transformer is called with ``timestep = sigma`` (it multiplies by 1000
  internally; the pipeline passes ``t / 1000`` with ``t = 1000 * sigma``) and with the
  *raw* guidance scale (also multiplied by 1000 internally, never divided beforehand).
* Flow-matching: ``z = (1 - sigma) * x0 + sigma * n``, target ``n - x0``; the
  prediction is cut to the target tokens before a weighted MSE in fp32.

Every function is stateless; nothing here holds module-level state.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "encode_latents",
    "pack_latents",
    "unpack_latents",
    "latent_image_ids",
    "build_model_inputs",
    "token_sequence",
    "sequence_ids",
    "sample_sigmas",
    "loss_weighting",
    "flow_matching_loss",
    "transformer_forward",
]

SIGMA_SCHEMES = ("uniform", "logit_normal", "mode")
WEIGHTING_SCHEMES = ("none", "sigma_sqrt", "cosmap")


def encode_latents(vae, images: torch.Tensor) -> torch.Tensor:
    """Encode images in [-1, 1] of shape (B, 3, H, W) into normalized FLUX latents.

    Returns ``(posterior.mode() - shift_factor) * scaling_factor`` as fp32, shape
    (B, C, H/f, W/f). The encode runs under ``no_grad`` on the VAE's device and in the
    VAE's parameter dtype; a ``shift_factor`` of None counts as 0.
    """
    param = next(vae.parameters())
    with torch.no_grad():
        x = images.to(device=param.device, dtype=param.dtype)
        latents = vae.encode(x).latent_dist.mode()
        shift = getattr(vae.config, "shift_factor", None)
        shift = 0.0 if shift is None else float(shift)
        scale = getattr(vae.config, "scaling_factor", None)
        scale = 1.0 if scale is None else float(scale)
        latents = (latents.float() - shift) * scale
    return latents


def _check_even(h: int, w: int) -> None:
    if h % 2 or w % 2:
        raise ValueError(f"latent height and width must be even for 2x2 packing, got {h}x{w}")


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/2 * W/2, 4C), the layout of FluxKontextPipeline._pack_latents."""
    if latents.ndim != 4:
        raise ValueError(f"expected (B, C, H, W) latents, got shape {tuple(latents.shape)}")
    b, c, h, w = latents.shape
    _check_even(h, w)
    x = latents.reshape(b, c, h // 2, 2, w // 2, 2)
    x = x.permute(0, 2, 4, 1, 3, 5)  # b, row, col, c, dy, dx
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Inverse of :func:`pack_latents`: (B, h/2 * w/2, 4C) -> (B, C, h, w); h, w are latent sizes."""
    if tokens.ndim != 3:
        raise ValueError(f"expected (B, N, 4C) tokens, got shape {tuple(tokens.shape)}")
    _check_even(h, w)
    b, n, d = tokens.shape
    if n != (h // 2) * (w // 2) or d % 4:
        raise ValueError(f"tokens of shape {tuple(tokens.shape)} do not match latent size {h}x{w}")
    x = tokens.reshape(b, h // 2, w // 2, d // 4, 2, 2)
    x = x.permute(0, 3, 1, 4, 2, 5)  # b, c, row, dy, col, dx
    return x.reshape(b, d // 4, h, w)


def latent_image_ids(h: int, w: int, index: int = 0, device=None, dtype=torch.float32) -> torch.Tensor:
    """Position ids (h/2 * w/2, 3) for a packed latent of size h x w: (index, row, col).

    index 0 marks the target image, 1 the Kontext context image (the pipeline builds
    the context ids like the target ids and then sets column 0 to 1).
    """
    _check_even(h, w)
    hh, ww = h // 2, w // 2
    # made where they are used: no host-to-device copy in the step (small integers: exact in any float dtype)
    rows = torch.arange(hh, dtype=torch.float32, device=device).repeat_interleave(ww)
    cols = torch.arange(ww, dtype=torch.float32, device=device).repeat(hh)
    first = torch.full_like(rows, float(index))
    return torch.stack([first, rows, cols], dim=-1).to(dtype=dtype)


def build_model_inputs(
    target_latents: torch.Tensor,
    context_latents: torch.Tensor,
    noise: torch.Tensor,
    sigmas: torch.Tensor,
) -> dict:
    """Assemble the Kontext transformer input for one batch.

    Args:
        target_latents: clean target latents x0, (B, C, H, W).
        context_latents: clean context latents, (B, C, Hc, Wc) (size may differ).
        noise: n, same shape as ``target_latents``.
        sigmas: (B,) noise levels in (0, 1].

    Returns a dict with
        ``hidden_states`` (B, Nt + Nc, 4C): packed ``(1 - sigma) x0 + sigma n`` followed
        by packed clean context (target first), fp32;
        ``img_ids`` (Nt + Nc, 3): target ids (0, r, c) then context ids (1, r, c);
        ``n_target_tokens`` Nt (int);
        ``target`` (B, Nt, 4C): packed flow-matching target ``n - x0``, fp32.
    """
    if target_latents.shape != noise.shape:
        raise ValueError("noise must have the shape of target_latents")
    if context_latents.shape[:2] != target_latents.shape[:2]:
        raise ValueError("context and target latents need the same batch size and channels")
    x0 = target_latents.float()
    n = noise.float()
    s = sigmas.float().reshape(-1, 1, 1, 1).to(x0.device)
    if s.shape[0] != x0.shape[0]:
        raise ValueError("one sigma per sample expected")
    noisy = (1.0 - s) * x0 + s * n
    packed_target = pack_latents(noisy)
    hidden, ids = token_sequence(packed_target, tuple(x0.shape[-2:]), pack_latents(context_latents.float()),
                                 tuple(context_latents.shape[-2:]))
    return {
        "hidden_states": hidden,
        "img_ids": ids,
        "n_target_tokens": packed_target.shape[1],
        "target": pack_latents(n - x0),
    }


def token_sequence(
    target: torch.Tensor,
    target_size: tuple[int, int],
    context: torch.Tensor | None = None,
    context_size: tuple[int, int] | None = None,
    ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The transformer's image sequence: packed target tokens (B, Nt, D), then the packed clean
    context tokens (B, Nc, D) cast to the target's dtype, and their position ids (Nt + Nc, 3):
    target (0, r, c), context (1, r, c). Sizes are the latents' (h, w). ``context`` None: the
    target alone (text-to-image FLUX.1). ``ids``: sequence_ids made once by a caller that calls this
    every step (made here on the target's device otherwise).
    """
    if ids is None:
        ids = sequence_ids(target_size, context_size if context is not None else None, target.device)
    if context is None:
        return target, ids
    return torch.cat([target, context.to(target.dtype)], dim=1), ids


def sequence_ids(target_size: tuple[int, int], context_size: tuple[int, int] | None, device=None) -> torch.Tensor:
    """token_sequence's position ids: the target's (0, r, c), then the context's (1, r, c) if any."""
    ids = latent_image_ids(*target_size, 0, device=device)
    if context_size is None:
        return ids
    return torch.cat([ids, latent_image_ids(*context_size, 1, device=device)], dim=0)


def sample_sigmas(
    batch: int,
    scheme: str = "uniform",
    generator: torch.Generator | None = None,
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
    mode_scale: float = 1.29,
    shift: float = 1.0,
    min_sigma: float = 1e-3,
) -> torch.Tensor:
    """Sample (batch,) fp32 noise levels in (0, 1] on the generator's device.

    Densities follow diffusers' ``compute_density_for_timestep_sampling``:
    "uniform" U(0,1); "logit_normal" sigmoid(N(logit_mean, logit_std)); "mode"
    ``1 - u - mode_scale * (cos^2(pi u / 2) - 1 + u)``. Here sigma = the sampled value
    (SD3-paper convention; diffusers' example maps u through the descending scheduler
    timestep table, i.e. sigma ~ 1 - u on a 1/1000 grid, which differs only for
    ``logit_mean != 0``). Then the optional shift ``s*sigma / (1 + (s-1)*sigma)`` and a
    clamp to [min_sigma, 1] (diffusers' grid also bottoms out at 1/1000).
    """
    device = generator.device if generator is not None else torch.device("cpu")
    if scheme == "uniform":
        u = 1.0 - torch.rand(batch, generator=generator, device=device)  # (0, 1]
    elif scheme == "logit_normal":
        z = torch.randn(batch, generator=generator, device=device) * logit_std + logit_mean
        u = torch.sigmoid(z)
    elif scheme == "mode":
        r = torch.rand(batch, generator=generator, device=device)
        u = 1.0 - r - mode_scale * (torch.cos(math.pi * r / 2) ** 2 - 1.0 + r)
    else:
        raise ValueError(f"unknown sigma scheme {scheme!r}; expected one of {SIGMA_SCHEMES}")
    return shift_sigmas(u.float(), shift).clamp(min=min_sigma, max=1.0)


def shift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """s·σ / (1 + (s − 1)·σ): the flow-matching schedulers' shift (diffusers FlowMatchEulerDiscreteScheduler,
    static shift; its exponential time_shift at mu is this with s = e^mu). s = 1 returns σ untouched."""
    if shift == 1.0:
        return sigmas
    return shift * sigmas / (1.0 + (shift - 1.0) * sigmas)


def valid_shift(setting: str) -> bool:
    """SHIFT: "auto" or a number > 0."""
    try:
        return setting == "auto" or float(setting) > 0
    except ValueError:
        return False


def sigma_shift(setting: str, config, image_seq_len: int) -> float:
    """SHIFT's value for a target of `image_seq_len` packed tokens: the number given, or with "auto"
    the pipeline's own (pipeline_shift of its scheduler `config`)."""
    return pipeline_shift(config, image_seq_len) if setting == "auto" else float(setting)


def pipeline_shift(config, image_seq_len: int) -> float:
    """The shift s (shift_sigmas) a FLUX.1 or Qwen-Image pipeline samples with for a target of
    `image_seq_len` packed tokens, from its scheduler's config: with use_dynamic_shifting, mu =
    calculate_shift(image_seq_len, ...) (linear between base_shift at base_image_seq_len and max_shift
    at max_image_seq_len, the pipelines' own defaults where a key is missing: pipeline_flux_kontext.py
    :103-112 and :967, pipeline_qwenimage_edit_plus.py:71-80 and :766), then e^mu (time_shift_type
    exponential) or mu (linear); without it, the static `shift` (UniPC with flow sigmas, Wan's: `flow_shift`).
    The terminal stretch (shift_terminal) and other respacings are sampling devices, not part of the density."""
    if not config.get("use_dynamic_shifting", False):
        return float(config.get("flow_shift" if config.get("use_flow_sigmas") else "shift", 1.0))
    base_len, max_len = config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096)
    base_shift, max_shift = config.get("base_shift", 0.5), config.get("max_shift", 1.15)
    m = (max_shift - base_shift) / (max_len - base_len)
    mu = image_seq_len * m + (base_shift - m * base_len)
    return math.exp(mu) if config.get("time_shift_type", "exponential") == "exponential" else mu


def loss_weighting(sigmas: torch.Tensor, scheme: str = "none") -> torch.Tensor:
    """Per-sample fp32 loss weights as in diffusers' ``compute_loss_weighting_for_sd3``.

    "none": ones; "sigma_sqrt": sigma^-2; "cosmap": 2 / (pi (1 - 2 sigma + 2 sigma^2)).
    """
    s = sigmas.float()
    if scheme == "none":
        return torch.ones_like(s)
    if scheme == "sigma_sqrt":
        return s ** -2.0
    if scheme == "cosmap":
        return 2.0 / (math.pi * (1.0 - 2.0 * s + 2.0 * s**2))
    raise ValueError(f"unknown weighting scheme {scheme!r}; expected one of {WEIGHTING_SCHEMES}")


def flow_matching_loss(
    pred: torch.Tensor,
    target: torch.Tensor,
    n_target_tokens: int,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weighted MSE over the target tokens only, as an fp32 scalar.

    ``pred`` (B, Nt + Nc, D) is cut to its first ``n_target_tokens`` tokens, so the
    context part never enters the loss (nor receives gradient). ``target`` is (B, Nt, D);
    ``weights`` (B,) or None (ones). Loss = mean_b( w_b * mean((pred_b - target_b)^2) ),
    which equals diffusers' ``mean(w * (pred - target)^2)`` for per-sample weights.
    """
    if target.shape[1] != n_target_tokens:
        raise ValueError(f"target has {target.shape[1]} tokens, expected {n_target_tokens}")
    p = pred[:, :n_target_tokens].float()
    if p.shape != target.shape:
        raise ValueError(f"pred target part {tuple(p.shape)} != target {tuple(target.shape)}")
    per_sample = ((p - target.float()) ** 2).reshape(p.shape[0], -1).mean(dim=1)
    if weights is not None:
        per_sample = per_sample * weights.float().reshape(-1).to(per_sample.device)
    return per_sample.mean()


def transformer_forward(
    transformer,
    inputs: dict,
    timesteps_sigma: torch.Tensor,
    guidance: float | torch.Tensor | None,
    prompt_embeds: torch.Tensor,
    pooled: torch.Tensor,
    text_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run FluxTransformer2DModel on :func:`build_model_inputs` output; returns (B, Nt + Nc, D).

    ``timestep`` is passed as sigma in (0, 1] (the model multiplies by 1000 inside,
    after casting it to the hidden-state dtype). ``guidance`` is the raw scale (e.g. 1.0;
    the model also multiplies it by 1000); a float becomes an fp32 (B,) tensor, and it
    is dropped when ``config.guidance_embeds`` is False. ``text_ids`` default to zeros
    (T, 3). Inputs are passed in the dtype they have: cast beforehand, or rely on FSDP2's
    MixedPrecisionPolicy input casting.
    """
    hidden = inputs["hidden_states"]
    batch, device = hidden.shape[0], hidden.device
    timestep = torch.as_tensor(timesteps_sigma, device=device).reshape(-1)
    if timestep.numel() == 1 and batch > 1:
        timestep = timestep.expand(batch)
    config = getattr(transformer, "config", None)
    if config is None and hasattr(transformer, "module"):
        config = transformer.module.config
    if config is not None and not getattr(config, "guidance_embeds", False):
        g = None
    elif guidance is None:
        raise ValueError("this transformer has guidance embeddings: pass a guidance scale (e.g. 1.0)")
    elif isinstance(guidance, (int, float)):  # a fill on the device, not a host-to-device copy
        g = torch.full((batch,), float(guidance), dtype=torch.float32, device=device)
    else:
        g = torch.as_tensor(guidance, dtype=torch.float32, device=device).reshape(-1)
        if g.numel() == 1:
            g = g.expand(batch)
    if text_ids is None:
        text_ids = torch.zeros(prompt_embeds.shape[1], 3, device=device, dtype=inputs["img_ids"].dtype)
    out = transformer(
        hidden_states=hidden,
        encoder_hidden_states=prompt_embeds,
        pooled_projections=pooled,
        timestep=timestep,
        img_ids=inputs["img_ids"],
        txt_ids=text_ids,
        guidance=g,
        return_dict=False,
    )
    return out[0]


def edit_tokens(x0: torch.Tensor, references: list, noise: torch.Tensor, sigmas: torch.Tensor) -> dict:
    """The tokens of a multi-reference edit (Qwen-Image-Edit, FLUX.2): [noisy target ; each clean reference],
    each packed 2x2, in fp32; the number of target tokens; the flow-matching target n - x0 on them. The
    room adds its position information (img_shapes, ids)."""
    if x0.shape != noise.shape:
        raise ValueError("noise must have the shape of the target latents")
    x0, n = x0.float(), noise.float()
    s = sigmas.float().reshape(-1, 1, 1, 1).to(x0.device)
    target = pack_latents((1.0 - s) * x0 + s * n)
    refs = [pack_latents(r.float()) for r in references]
    return {"hidden_states": torch.cat([target, *refs], dim=1), "n_target_tokens": target.shape[1],
            "target": pack_latents(n - x0)}
