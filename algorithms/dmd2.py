"""The pure pieces of a DMD2 training step (Yin et al. 2024, "Improved Distribution Matching
Distillation for Fast Image Synthesis"), SD-1.5 setting of the official code (tianweiy/DMD2,
main/sd_guidance.py and main/sd_unified_model.py). No global state, no distributed calls:
each parametrisation's step composes these (ε-prediction UNets: algorithms/dmd2_unet.py; flow
matching: algorithms/dmd2_flow.py), and `train_dmd.py` wires the step into its loop.

UNets are diffusers `UNet2DConditionModel`-like callables predicting epsilon:
`unet(sample, timestep, encoder_hidden_states=..., return_dict=False)[0]`. The text conditioning
`text_emb` is a tensor (SD-1.5: CLIP's last hidden state) or a `Cond` (SDXL: both encoders'
penultimate hidden states concatenated, plus the added `text_embeds` / `time_ids` conditions). Inputs are passed as
given (FSDP2's MixedPrecisionPolicy or autocast does any casting); every prediction is cast to
fp32 before arithmetic, x0 conversions run in float64 (as the official code does).
`alphas_cumprod` is the scheduler's ᾱ table (SD-1.5: scaled-linear betas 0.00085 -> 0.012,
1000 steps; ᾱ[999] ≈ 0.004660, ᾱ[20] ≈ 0.981314).

    python -m pytest tests/test_dmd2.py -q
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


# ---------------------------------------------------------------------------- conditioning

@dataclass
class Cond:
    """One batch's UNet conditioning when it is more than token embeddings (SDXL): `text` is
    encoder_hidden_states (B, L, D); `added` is the UNet's added_cond_kwargs, for SDXL
    {"text_embeds": (B, P) pooled embedding of the second encoder, "time_ids": (B, 6)}."""
    text: torch.Tensor
    added: dict

    def __len__(self) -> int:
        return self.text.shape[0]


def cond_kwargs(cond) -> dict:
    """UNet keyword arguments for a tensor (SD-1.5) or a `Cond` (SDXL) conditioning."""
    if isinstance(cond, Cond):
        return {"encoder_hidden_states": cond.text, "added_cond_kwargs": cond.added}
    return {"encoder_hidden_states": cond}


def expand_cond(cond, batch: int):
    """A batch-1 conditioning (the unconditional one) broadcast to `batch` rows."""
    if isinstance(cond, Cond):
        return Cond(cond.text.expand(batch, *cond.text.shape[1:]),
                    {k: v.expand(batch, *v.shape[1:]) for k, v in cond.added.items()})
    return cond.expand(batch, *cond.shape[1:])


def cat_cond(a, b):
    """Two conditionings stacked along the batch (the [uncond; cond] batch of CFG)."""
    if isinstance(a, Cond):
        return Cond(torch.cat([a.text, b.text]), {k: torch.cat([a.added[k], b.added[k]]) for k in a.added})
    return torch.cat([a, b])


# ---------------------------------------------------------------------------- noise schedule

def _per_sample_t(t, batch: int, device) -> torch.Tensor:
    """An int or a (B,) tensor of timesteps -> a (B,) long tensor on `device`."""
    if not torch.is_tensor(t):
        return torch.full((batch,), int(t), dtype=torch.long, device=device)
    t = t.to(device=device, dtype=torch.long).reshape(-1)
    return t.expand(batch) if t.numel() == 1 else t


def _alpha(alphas_cumprod: torch.Tensor, t: torch.Tensor, ndim: int) -> torch.Tensor:
    """ᾱ_t in float64, shaped (B, 1, 1, ...) to broadcast against an ndim-dimensional batch."""
    a = alphas_cumprod.to(device=t.device, dtype=torch.float64)[t]
    return a.reshape(-1, *([1] * (ndim - 1)))


def _out_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32/fp64 stay as they are; half types come back as fp32 (x0 at t=999 is ε amplified by
    1/√ᾱ ≈ 14.6, no reason to round that to bf16)."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def x0_from_eps(z: torch.Tensor, eps: torch.Tensor, t, alphas_cumprod: torch.Tensor,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x0 = (z − √(1−ᾱ_t)·ε) / √ᾱ_t, computed in float64 (official `get_x0_from_noise` on
    `.double()` inputs). `t`: int or per-sample (B,). Differentiable w.r.t. z and eps.
    Returned in `out_dtype`, default: z's dtype for fp32/fp64 inputs, fp32 for half inputs."""
    t = _per_sample_t(t, z.shape[0], z.device)
    a = _alpha(alphas_cumprod, t, z.ndim)
    x0 = (z.double() - (1.0 - a).sqrt() * eps.double()) / a.sqrt()
    return x0.to(out_dtype or _out_dtype(z.dtype))


def add_noise(x0: torch.Tensor, noise: torch.Tensor, t, alphas_cumprod: torch.Tensor,
              out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """z_t = √ᾱ_t·x0 + √(1−ᾱ_t)·n (DDPM forward process, `scheduler.add_noise`), in float64,
    returned like `x0_from_eps`."""
    t = _per_sample_t(t, x0.shape[0], x0.device)
    a = _alpha(alphas_cumprod, t, x0.ndim)
    z = a.sqrt() * x0.double() + (1.0 - a).sqrt() * noise.double()
    return z.to(out_dtype or _out_dtype(x0.dtype))


def predict_eps(unet, z: torch.Tensor, t, text_emb: torch.Tensor) -> torch.Tensor:
    """ε̂ = unet(z, t, c) as fp32; t broadcast to a per-sample (B,) long tensor."""
    t = _per_sample_t(t, z.shape[0], z.device)
    return unet(z, t, return_dict=False, **cond_kwargs(text_emb))[0].float()


def generator_forward(unet, noise_or_zt: torch.Tensor, t, text_emb: torch.Tensor,
                      alphas_cumprod: torch.Tensor) -> torch.Tensor:
    """Generator image latents x = x0(z, G(z, t, c), t) (official SDUniModel.forward). 1-step
    mode: z is pure noise and t = 999 (CONDITIONING_TIMESTEP); few-step mode: z comes from
    `backward_simulation`. Keeps the graph: gradients flow into the generator's parameters."""
    eps = predict_eps(unet, noise_or_zt, t, text_emb)
    return x0_from_eps(noise_or_zt, eps, t, alphas_cumprod, out_dtype=torch.float32)


# ---------------------------------------------------------------------------- timesteps

def sample_dm_timesteps(batch: int, generator: torch.Generator | None = None,
                        num_train_timesteps: int = 1000, min_frac: float = 0.02,
                        max_frac: float = 0.98, device=None) -> torch.Tensor:
    """Per-sample t for the distribution-matching loss, uniform over the *inclusive* range
    [int(min_frac·T), int(max_frac·T)] = [20, 980] for SD-1.5. Mirrors the official
    `torch.randint(min_step, min(max_step + 1, T))` (int() truncation included).
    `device` defaults to the generator's."""
    lo, hi = int(min_frac * num_train_timesteps), int(max_frac * num_train_timesteps)
    hi = min(hi + 1, num_train_timesteps)
    if not 0 <= lo < hi:
        raise ValueError(f"empty DM timestep range [{lo}, {hi})")
    device = device if device is not None else (generator.device if generator is not None else "cpu")
    return torch.randint(lo, hi, (batch,), generator=generator, device=device)


def sample_fake_timesteps(batch: int, generator: torch.Generator | None = None,
                          num_train_timesteps: int = 1000, device=None) -> torch.Tensor:
    """Per-sample t for the fake-score loss, uniform over the full range [0, T) (official
    `compute_loss_fake`)."""
    device = device if device is not None else (generator.device if generator is not None else "cpu")
    return torch.randint(0, num_train_timesteps, (batch,), generator=generator, device=device)


# ---------------------------------------------------------------------------- the teacher's CFG

CFG_NORMS = ("none", "token", "scalar")  # REAL_GUIDANCE_NORM: how the teacher's CFG combination is rescaled


@dataclass(frozen=True)
class Guidance:
    """A teacher's guidance in DMD2 as its family's room gives it (`dmd_guidance(settings)`, 0 and ""
    resolved): the real score's CFG pair and its combination; for a flow teacher also the guidance value
    every transformer takes as an input and the prompt the pair is against."""
    scale: float  # REAL_GUIDANCE_SCALE: the teacher's CFG scale in the DM loss (1: no pair)
    norm: str  # REAL_GUIDANCE_NORM: how the pair is combined (cfg_combine)
    embedded: float | None = None  # the guidance embedding's value (FLUX.1: FLUX_GUIDANCE); None: none
    negative: str | None = None  # the pair's other prompt, cached beside the rows' text; None: no pair
    export_call: str = ""  # the pipeline call's guidance argument that samples the distilled export
    # a two-expert teacher's low-noise expert's own CFG scale (Wan 2.2 A14B's guidance_scale_2); None: `scale`
    scale_2: float | None = None

    def words(self) -> str:
        """How the start-up report names it."""
        if self.negative is not None:
            low = f", {self.scale_2:g} on the low-noise expert" if self.scale_2 is not None else ""
            return f"teacher true CFG {self.scale:g}{low} ({self.norm} rescale)"
        return "teacher without CFG" if self.embedded is None else f"guidance {self.embedded}"


def cfg_combine(cond: torch.Tensor, uncond: torch.Tensor, scale: float, norm: str = "none",
                dim: int = -1) -> torch.Tensor:
    """The teacher's real score under CFG, u + s·(c − u), in fp32, then rescaled by `norm`:
      none    as published (tianweiy/DMD2 main/sd_guidance.py, compute_distribution_matching_loss)
      token   each token's vector (along `dim`: the channels) to the conditional prediction's norm,
              c_norm / comb_norm per token: QwenImageEditPlusPipeline's sampling (diffusers 0.42.1
              pipeline_qwenimage_edit_plus.py:841-845; LightX2V's cfg_norm "layer_norm")
      scalar  each sample by min(1, ‖c‖ / ‖comb‖) over all its elements (LightX2V's "scalar" takes one
              ratio over the whole batch tensor; here one per sample, so a rank's share of the batch, and
              so the world size, does not change a sample's score)"""
    cond, uncond = cond.float(), uncond.float()
    comb = uncond + scale * (cond - uncond)
    if norm == "none":
        return comb
    if norm == "token":
        return comb * (torch.norm(cond, dim=dim, keepdim=True) / torch.norm(comb, dim=dim, keepdim=True))
    if norm == "scalar":
        dims = tuple(range(1, comb.ndim))
        ratio = cond.square().sum(dims, keepdim=True).sqrt() / comb.square().sum(dims, keepdim=True).sqrt()
        return comb * ratio.clamp(max=1.0)
    raise ValueError(f"CFG norm {norm!r}: one of {', '.join(CFG_NORMS)}")


# ---------------------------------------------------------------------------- DM loss

def real_eps(real_unet, z_t: torch.Tensor, t: torch.Tensor, text_emb, uncond_emb, guidance_scale: float,
             cfg_norm: str = "none") -> torch.Tensor:
    """The teacher's ε under CFG: one batched call on [uncond; cond] (the conditional batch alone at s == 1),
    combined by cfg_combine per pixel (`t`: per-sample (B,))."""
    if guidance_scale == 1:
        return predict_eps(real_unet, z_t, t, text_emb)
    if uncond_emb is None:
        raise ValueError("guidance_scale != 1 needs uncond_emb")
    uncond_emb = expand_cond(uncond_emb, z_t.shape[0])
    eps_u, eps_c = predict_eps(real_unet, torch.cat([z_t, z_t]), torch.cat([t, t]),
                               cat_cond(uncond_emb, text_emb)).chunk(2)
    return cfg_combine(eps_c, eps_u, guidance_scale, cfg_norm, dim=1)  # (B, C, h, w): a pixel's channels


@torch.no_grad()
def ddim_teacher(real_unet, noise: torch.Tensor, text_emb, uncond_emb, guidance_scale: float,
                 alphas_cumprod: torch.Tensor, steps: int, cfg_norm: str = "none") -> torch.Tensor:
    """The teacher's deterministic sample (DDIM, η = 0) from `noise` at the last train timestep, under the
    DM loss's CFG: `steps` timesteps spaced as diffusers' DDIMScheduler spaces them for SD-1.5 / SDXL
    ("leading", steps_offset 1: 1 + k·(T / steps)), each x̂0 from ε in float64, the last step to ᾱ = 1
    (the sample is x̂0 of the last timestep). Returns fp32 latents."""
    n = len(alphas_cumprod)
    timesteps = [k * (n // steps) + 1 for k in range(steps)][::-1]
    z = noise.float()
    for i, t in enumerate(timesteps):
        tt = torch.full((z.shape[0],), t, dtype=torch.long, device=z.device)
        eps = real_eps(real_unet, z, tt, text_emb, uncond_emb, guidance_scale, cfg_norm)
        x0 = x0_from_eps(z, eps, tt, alphas_cumprod, out_dtype=torch.float64)
        if i + 1 == len(timesteps):
            return x0.float()
        z = add_noise(x0, eps.double(), timesteps[i + 1], alphas_cumprod, out_dtype=torch.float32)
    return z

@torch.no_grad()
def dm_grad(x: torch.Tensor, t, noise: torch.Tensor, real_unet, fake_unet,
            text_emb: torch.Tensor, uncond_emb: torch.Tensor | None, guidance_scale: float,
            alphas_cumprod: torch.Tensor, cfg_norm: str = "none") -> tuple[torch.Tensor, dict]:
    """Distribution-matching direction (official `compute_distribution_matching_loss`):

        z_t    = √ᾱ_t·x + √(1−ᾱ_t)·n
        ε_fake = fake(z_t, t, c)                              (conditional only)
        ε_real = ε_u + s·(ε_c − ε_u)  from the teacher          (one batched call [uncond; cond];
                                                               cfg_norm: cfg_combine's rescale, per pixel)
        p_real = x − x̂0_real,   p_fake = x − x̂0_fake            (x̂0 in float64)
        grad   = (p_real − p_fake) / mean_{C,H,W}|p_real|,  non-finite -> 0

    With s == 1 the teacher is called on the conditional batch only (the official code skips
    CFG for s <= 1; here only s == 1 skips it, so s < 1 is honoured). Runs without gradients.
    Returns grad (fp32, x's shape) and diagnostics: per-sample `p_real_abs_mean` (B,), the
    `grad_norm`, and `z_t`, `x0_real`, `x0_fake` (fp32) for visualisation.
    """
    batch = x.shape[0]
    t = _per_sample_t(t, batch, x.device)
    z_t = add_noise(x, noise, t, alphas_cumprod, out_dtype=torch.float32)

    eps_fake = predict_eps(fake_unet, z_t, t, text_emb)
    eps_real = real_eps(real_unet, z_t, t, text_emb, uncond_emb, guidance_scale, cfg_norm)
    x0_real = x0_from_eps(z_t, eps_real, t, alphas_cumprod, out_dtype=torch.float64)
    x0_fake = x0_from_eps(z_t, eps_fake, t, alphas_cumprod, out_dtype=torch.float64)
    p_real = x.double() - x0_real
    p_fake = x.double() - x0_fake
    reduce_dims = list(range(1, x.ndim))
    norm = p_real.abs().mean(dim=reduce_dims, keepdim=True)
    grad = torch.nan_to_num((p_real - p_fake) / norm, nan=0.0, posinf=0.0, neginf=0.0).float()
    diagnostics = {
        "p_real_abs_mean": norm.reshape(batch).float(),
        "grad_norm": grad.norm(),
        "z_t": z_t, "x0_real": x0_real.float(), "x0_fake": x0_fake.float(),
    }
    return grad, diagnostics


def dm_loss(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """loss = 0.5·MSE(x, stopgrad(x − grad)) in fp32. Value 0.5·mean(grad²); ∂loss/∂x =
    grad / x.numel(), so backprop pushes the generator along −grad."""
    x = x.float()
    return 0.5 * F.mse_loss(x, (x - grad.float()).detach(), reduction="mean")


# ---------------------------------------------------------------------------- fake score

def fake_score_loss(fake_unet, x_detached: torch.Tensor, noise: torch.Tensor, t,
                    text_emb: torch.Tensor, alphas_cumprod: torch.Tensor) -> torch.Tensor:
    """Denoising loss of the fake score on generator images (official `compute_loss_fake`):
    mean((ε̂_fake(z_t, t, c) − n)²) in fp32, unweighted, no CFG. The input is detached here
    again, so this loss never reaches the generator."""
    z_t = add_noise(x_detached.detach(), noise, t, alphas_cumprod, out_dtype=torch.float32)
    eps = predict_eps(fake_unet, z_t, t, text_emb)
    return torch.mean((eps - noise.float()) ** 2)


# ---------------------------------------------------------------------------- the objective's settings

@dataclass(frozen=True)
class Losses:
    """The DMD2 objective's settings, one kind for every parametrisation's step (algorithms/dmd2_unet.py,
    algorithms/dmd2_flow.py): passed to the step, not read as globals. head None = no GAN term."""
    head: nn.Module | None = None  # the GAN classifier head (stage 2)
    gen_cls_weight: float = 0.0  # loss_gen_cls's weight in G's loss (published stage 2: 1e-3)
    guidance_cls_weight: float = 0.0  # loss_guidance_cls's weight in the guidance loss (published: 1e-2)
    diffusion_gan: bool = True  # the head's inputs noised first (diffusion GAN), else clean at t = 0
    real_guidance_scale: float = 1.0  # the teacher's CFG scale in loss_dm; 1 = no CFG pair (guidance-distilled)
    real_guidance_norm: str = "none"  # its combination's rescale (cfg_combine): none | token | scalar
    real_guidance_scale_2: float | None = None  # a two-expert teacher's low-noise expert's scale (Guidance.scale_2)
    fake_target: str = "flow"  # flow-matching fake scores: their loss, on the velocity (flow) or on x̂0 (x0)
    regression_weight: float = 0.0  # > 0: DMD's regression loss on the teacher's ODE output from G's noise (1-step)
    regression_steps: int = 28  # the teacher ODE's Euler steps for that target (and for diversity_weight's)
    diversity_weight: float = 0.0  # > 0 (few-step): the first step regresses on the teacher's ODE (diversity_loss)
    diversity_anchor: int = 5  # that target: the teacher's state after this many of its regression_steps
    dmd_loss: str = "dmd2"  # flow teachers with a CFG pair: dmd2 | decoupled (dmd2_flow.decoupled_loss)
    ca_weight: float = 1.0  # decoupled: loss_ca's weight in G's loss
    dm_weight: float = 1.0  # decoupled: loss_dm's weight in G's loss


DMD_LOSSES = ("dmd2", "decoupled")  # DMD_LOSS: the generator's distribution-matching objective


# the head's three inputs, each with its own draw (σ or t, and noise): G's turn on fake, guidance turn on fake and real
GAN_INPUTS = ("gan_gen", "gan_fake", "gan_real")


# ---------------------------------------------------------------------------- GAN head

HEAD_FEATURES = ("mid", "up")  # the head's input: the bottleneck (published) | the up path's output
MIN_GROUP_CHANNELS = 8


def head_norm_groups(channels: int) -> int:
    """GroupNorm groups of the head: the most groups, up to the official 32, that leave at least
    MIN_GROUP_CHANNELS channels in each. Official C = 1280: 32 (40 channels a group). The guard
    matters after the 4×4 -> 1×1 conv, where a group normalises only its channels: with 2 channels a
    group (C = 64, 32 groups) each normalised pair is ±1, a sign, so the head's logit is a sum of
    signs and almost no gradient passes it; with 1 (C = 32) the output is constant."""
    fits = [g for g in range(1, min(32, channels) + 1) if channels % g == 0 and channels // g >= MIN_GROUP_CHANNELS]
    return max(fits, default=1)


class ClassifierHead(nn.Sequential):
    """Realism logit from the fake UNet's bottleneck (official `cls_pred_branch`,
    main/sd_guidance.py lines 107-133): stride-2 stages down to 4×4, then

        [conv 4×4 s2 p1, GroupNorm, SiLU] × log2(native_size / 4)   (SD-1.5: 8×8 -> 4×4, once;
                                                                      SDXL: 32×32 -> 4×4, three times)
        conv 4×4 s4 p0 (4×4 -> 1×1), GroupNorm, SiLU, conv 1×1 -> 1 logit

    with C -> C channels throughout (1280 for both). `native_size` is the bottleneck's side at
    the model's native resolution (SD-1.5 at 512 px: 8; SDXL at 1024 px: 32). Module indices
    match the official nn.Sequential, so its state-dict keys load as they are.
    Deviations, both no-ops at the native sizes: GroupNorm uses `head_norm_groups(C)` groups (32 in
    the original, the same for any C >= 256 divisible by 32) so tiny UNets work; an input whose
    spatial size is not native_size is first adaptive-average-pooled to it, so any bottleneck gives
    (B, 1) logits.
    `features="up"` (not in the paper): the same head on the UNet's up-path output instead
    (`up_features`: block_out_channels[0] channels at the latent resolution, native_size = the
    latent side), for small latents whose bottleneck is too coarse to show shapes.
    """

    def __init__(self, in_channels: int, native_size: int = 8, features: str = "mid"):
        if native_size < 4 or native_size & (native_size - 1):
            raise ValueError(f"native_size {native_size}: must be a power of two >= 4")
        if features not in HEAD_FEATURES:
            raise ValueError(f"features {features!r}: one of {', '.join(HEAD_FEATURES)}")
        self.native_size = native_size
        self.features = features  # which UNet output it reads (cls_logits): not a parameter, not in the state dict
        groups = head_norm_groups(in_channels)
        c = in_channels
        down = []
        for _ in range(int(math.log2(native_size // 4))):
            down += [nn.Conv2d(c, c, kernel_size=4, stride=2, padding=1), nn.GroupNorm(groups, c), nn.SiLU()]
        super().__init__(
            *down,
            nn.Conv2d(c, c, kernel_size=4, stride=4, padding=0),
            nn.GroupNorm(groups, c),
            nn.SiLU(),
            nn.Conv2d(c, 1, kernel_size=1, stride=1, padding=0),
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        if tuple(features.shape[-2:]) != (self.native_size, self.native_size):
            features = F.adaptive_avg_pool2d(features, self.native_size)
        # (B, 1, 1, 1) -> (B, 1); a copy, not a view: FSDP2 warns when a unit returns a view
        return super().forward(features).flatten(1).clone()


def _cut_forward(unet, z: torch.Tensor, t, text_emb: torch.Tensor, **removed) -> torch.Tensor:
    """The UNet's own forward with the submodules in `removed` swapped for the given stand-ins for
    its duration, so it returns an inner output. The forward itself still runs, so an FSDP2-wrapped
    UNet gathers and frees its root parameters and registers its backward as in any forward, with
    activation checkpointing too; the removed units never run (no all-gather, no compute)."""
    saved = {name: getattr(unet, name) for name in removed}
    for name, stand_in in removed.items():
        setattr(unet, name, stand_in)
    try:
        out = unet(z, _per_sample_t(t, z.shape[0], z.device), return_dict=False, **cond_kwargs(text_emb))
    finally:
        for name, module in saved.items():
            setattr(unet, name, module)
    return out[0]


def bottleneck_features(unet, z: torch.Tensor, t, text_emb: torch.Tensor) -> torch.Tensor:
    """Output of `unet.mid_block` (the official `classify_forward(...)[-1]`, tianweiy/DMD2
    main/sd_unet_forward.py:224-251): the forward without its up path and output layers. Works on a
    plain or FSDP2-wrapped UNet. Keeps the graph to z and to the down/mid parameters."""
    return _cut_forward(unet, z, t, text_emb, up_blocks=nn.ModuleList(), conv_norm_out=None, conv_out=nn.Identity())


def up_features(unet, z: torch.Tensor, t, text_emb: torch.Tensor) -> torch.Tensor:
    """Output of the UNet's last up block (block_out_channels[0] channels at z's resolution), for a
    head with features="up": the forward without its output layers (diffusers skips the norm and
    activation when conv_norm_out is None)."""
    return _cut_forward(unet, z, t, text_emb, conv_norm_out=None, conv_out=nn.Identity())


def cls_logits(unet, head: nn.Module, z: torch.Tensor, t, text_emb: torch.Tensor) -> torch.Tensor:
    """head(features as fp32) -> (B, 1) realism logits (official `compute_cls_logits`, with t = 0
    and clean z unless `diffusion_gan_noise` was applied first). The features are the bottleneck's,
    or the up path's for a head built with features="up"."""
    read = up_features if head.features == "up" else bottleneck_features
    return head(read(unet, z, t, text_emb).float())


def diffusion_gan_noise(x: torch.Tensor, max_t: int, alphas_cumprod: torch.Tensor,
                        generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Optional "diffusion GAN": noise x to a per-sample t ~ U{0, …, max_t − 1} (official
    `torch.randint(0, diffusion_gan_max_timestep)`) with fresh noise. Apply to real and fake
    inputs separately. Without it the official code uses clean x and t = 0."""
    t = torch.randint(0, max_t, (x.shape[0],), generator=generator, device=x.device)
    n = torch.randn(x.shape, generator=generator, device=x.device, dtype=torch.float32)
    return add_noise(x, n, t, alphas_cumprod), t


def gen_cls_loss(logits_fake: torch.Tensor) -> torch.Tensor:
    """Generator GAN loss: mean softplus(−D(x_fake)) (non-saturating), fp32."""
    return F.softplus(-logits_fake.float()).mean()


def guidance_cls_loss(logits_fake_detached: torch.Tensor, logits_real: torch.Tensor) -> torch.Tensor:
    """Discriminator loss: mean softplus(D(x_fake.detach())) + mean softplus(−D(x_real)), fp32."""
    return F.softplus(logits_fake_detached.float()).mean() + F.softplus(-logits_real.float()).mean()


# ---------------------------------------------------------------------------- few-step mode

def denoising_step_list(num_steps: int, num_train_timesteps: int = 1000) -> list[int]:
    """Timesteps of the few-step generator, as in the official code:
    range(T − 1, 0, −T // num_steps) -> [999, 749, 499, 249] for 4 steps, [999] for 1."""
    return list(range(num_train_timesteps - 1, 0, -(num_train_timesteps // num_steps)))


def choose_step_index(step: int, seed: int, n_steps: int) -> int:
    """Index into the step list for backward simulation at global `step`: a pure function of
    (seed, step), uniform over [0, n_steps). Every rank computes the same index without
    communication (the official code broadcasts a random draw from rank 0), hence every rank
    runs the same number of generator forwards — required under FSDP, where each forward
    all-gathers parameters collectively. String seeding is hash-randomisation free."""
    return random.Random(f"dmd2-step-index:{seed}:{step}").randrange(n_steps)


@torch.no_grad()
def backward_simulation(generator_unet, noise: torch.Tensor, step_list, chosen_index: int,
                        text_emb: torch.Tensor, alphas_cumprod: torch.Tensor,
                        generator: torch.Generator | None = None,
                        fresh_noise: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, int]:
    """Input of the generator at step_list[chosen_index], built the way inference would
    (official `sample_backward`): from pure noise at step_list[0], for i < chosen_index,
    x0_i = G(z_i, step_list[i]) and z_{i+1} = add_noise(x0_i, fresh noise, step_list[i+1]).
    Without gradients. Returns (z for step_list[chosen_index], number of generator forwards
    = chosen_index); chosen_index == 0 returns `noise` itself (pure noise at t = 999).
    Fresh noise comes from `generator` (on noise's device), or is given as `fresh_noise[i]`
    for the re-noising after step i (drawn by the caller for the global batch, so the result
    does not depend on the world size)."""
    if not 0 <= chosen_index < len(step_list):
        raise ValueError(f"chosen_index {chosen_index} outside [0, {len(step_list)})")
    z, forwards = noise, 0
    for i in range(chosen_index):
        x0 = generator_forward(generator_unet, z, int(step_list[i]), text_emb, alphas_cumprod)
        forwards += 1
        fresh = (fresh_noise[i].to(device=x0.device, dtype=x0.dtype) if fresh_noise is not None else
                 torch.randn(x0.shape, generator=generator, device=x0.device, dtype=x0.dtype))
        z = add_noise(x0, fresh, int(step_list[i + 1]), alphas_cumprod).to(noise.dtype)
    return z, forwards


# ---------------------------------------------------------------------------- flow matching
# The same objectives for a flow-matching teacher (FLUX.1): x_σ = (1 − σ)·x0 + σ·n (diffusers'
# FlowMatchEulerDiscreteScheduler.scale_noise), the model predicts the velocity v = n − x0 (the
# Kontext training target), so x̂0 = x_σ − σ·v. Models enter as callables velocity(x_σ, σ) -> v,
# which hold their conditioning (text, context tokens, guidance value): the math knows no
# model, as the epsilon path's callers hand it UNets.


def fm_noise(x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """x_σ = (1 − σ)·x0 + σ·n with one σ per sample, in fp32."""
    s = sigma.float().reshape(-1, *([1] * (x0.ndim - 1)))
    return (1.0 - s) * x0.float() + s * noise.float()


def x0_from_velocity(x_sigma: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """x̂0 = x_σ − σ·v, in float64 as the epsilon path's x̂0."""
    s = sigma.double().reshape(-1, *([1] * (x_sigma.ndim - 1)))
    return x_sigma.double() - s * v.double()


def sample_dm_sigmas(batch: int, generator: torch.Generator | None = None, min_sigma: float = 0.02,
                     max_sigma: float = 0.98, device=None) -> torch.Tensor:
    """Per-sample σ for the distribution-matching loss, uniform in [min_sigma, max_sigma]: the
    flow-matching counterpart of t in [0.02·T, 0.98·T]."""
    if not 0 <= min_sigma < max_sigma <= 1:
        raise ValueError(f"empty DM sigma range [{min_sigma}, {max_sigma}]")
    device = device if device is not None else (generator.device if generator is not None else "cpu")
    u = torch.rand(batch, generator=generator, device=device)
    return min_sigma + (max_sigma - min_sigma) * u


@torch.no_grad()
def fm_dm_grad(x: torch.Tensor, sigma: torch.Tensor, noise: torch.Tensor, real_velocity,
               fake_velocity) -> tuple[torch.Tensor, dict]:
    """The distribution-matching direction of dm_grad for flow-matching models:

        x_σ    = (1 − σ)·x + σ·n
        p_real = x − x̂0_real,   p_fake = x − x̂0_fake,   x̂0 = x_σ − σ·v   (float64)
        grad   = (p_real − p_fake) / mean_{C,H,W}|p_real|,  non-finite -> 0

    `real_velocity` is the teacher (a guidance-distilled one takes its guidance value as an
    input, so there is no CFG pair here), `fake_velocity` the fake score. Without gradients."""
    x_sigma = fm_noise(x, noise, sigma)
    x0_real = x0_from_velocity(x_sigma, real_velocity(x_sigma, sigma), sigma)
    x0_fake = x0_from_velocity(x_sigma, fake_velocity(x_sigma, sigma), sigma)
    p_real, p_fake = x.double() - x0_real, x.double() - x0_fake
    norm = p_real.abs().mean(dim=list(range(1, x.ndim)), keepdim=True)
    grad = torch.nan_to_num((p_real - p_fake) / norm, nan=0.0, posinf=0.0, neginf=0.0).float()
    return grad, {"p_real_abs_mean": norm.reshape(x.shape[0]).float(), "grad_norm": grad.norm(),
                  "x_sigma": x_sigma, "x0_real": x0_real.float(), "x0_fake": x0_fake.float()}


FAKE_TARGETS = ("flow", "x0")


def fm_fake_score_loss(fake_velocity, x_detached: torch.Tensor, noise: torch.Tensor,
                       sigma: torch.Tensor, target: str = "flow") -> torch.Tensor:
    """The fake score's loss on generator images, in fp32, the input detached so this loss never
    reaches the generator. flow: mean((v̂(x_σ, σ) − (n − x))²); x0: mean((x_σ − σ·v̂ − x)²), the same
    error weighted by σ², so the high-σ inputs where a sample's layout and colours are decided weigh
    more (NVlabs/FastGen trains its flow fake scores so: fake_score_pred_type "x0" in
    fastgen/configs/experiments/Flux/config_dmd2.py:30 and QwenImage/config_dmd2.py:31, the loss
    fastgen/methods/common_loss.py:41-43)."""
    if target not in FAKE_TARGETS:
        raise ValueError(f"fake-score target {target!r}: one of {FAKE_TARGETS}")
    x = x_detached.detach()
    x_sigma = fm_noise(x, noise, sigma)
    v = fake_velocity(x_sigma, sigma).float()
    if target == "x0":
        s = sigma.float().reshape(-1, *([1] * (x.ndim - 1)))
        return torch.mean((x_sigma - s * v - x.float()) ** 2)
    return torch.mean((v - (noise.float() - x.float())) ** 2)


def ode_sigmas(steps: int, shift: float = 1.0) -> list[float]:
    """The teacher ODE's σ grid: `steps` uniform steps from 1 to 0, each σ mapped to s·σ / (1 + (s − 1)·σ) by
    `shift` s (the pipelines' schedule at their resolution; 1: uniform)."""
    sigmas = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
    return (shift * sigmas / (1 + (shift - 1) * sigmas)).tolist()


@torch.no_grad()
def fm_teacher_ode(teacher_velocity, noise: torch.Tensor, steps: int, shift: float = 1.0,
                   stop: int | None = None) -> torch.Tensor:
    """The teacher's deterministic sample from `noise` (σ = 1): Euler over ode_sigmas(steps, shift) to σ = 0,
    in fp32. The target of DMD's regression loss (Yin et al., "One-step Diffusion with Distribution
    Matching Distillation", CVPR 2024: the teacher's ODE output for the same noise, which pins the
    generator's noise-to-mode map to the teacher's), computed here for each generator step's own noise
    instead of from a precomputed set of pairs (DMD2 validation's teacher reference too). `stop`: the
    state after that many steps, at σ = ode_sigmas(steps, shift)[stop] (diversity_loss's anchor)."""
    sigmas = ode_sigmas(steps, shift)[:None if stop is None else stop + 1]
    x = noise.float()
    for hi, lo in zip(sigmas[:-1], sigmas[1:]):
        s = torch.full((x.shape[0],), hi, device=x.device)
        x = x + (lo - hi) * teacher_velocity(x, s).float()
    return x


def diversity_loss(x: torch.Tensor, noise: torch.Tensor, anchor: torch.Tensor, anchor_sigma: float) -> torch.Tensor:
    """DP-DMD's first-step loss (Wu et al., "Diversity-Preserved Distribution Matching Distillation", arXiv
    2602.03139; Multimedia-Analytics-Laboratory/dpdmd train_sd35_dpdmd.py:430-496): a few-step generator's first
    velocity, from pure noise at σ = 1, against the teacher ODE's mean velocity from the same noise to its state
    `anchor` at `anchor_sigma` (fm_teacher_ode's `stop`): mean((v − (noise − anchor) / (1 − σ_k))²), in
    fp32. G's step gives x̂0 = noise − v at σ = 1, so v = noise − x. That step gets no DM loss (the published
    code detaches its output before the later steps, which the DM loss trains): the layout each noise commits
    to at high noise stays the teacher's, and the reverse KL's mode seeking acts on the later steps only."""
    v = noise.float() - x.float()
    target = (noise.float() - anchor.float()) / (1.0 - anchor_sigma)
    return F.mse_loss(v, target.detach(), reduction="mean")


def regression_loss(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """mean((x − target)²) in fp32 on latents; DMD used LPIPS on decoded images, which needs a
    pretrained VGG this suite does not ship, so the latent MSE stands in for it."""
    return F.mse_loss(x.float(), target.float().detach(), reduction="mean")


STUDENT_SAMPLE_TYPES = ("sde", "ode")


@torch.no_grad()
def fm_backward_simulation(generator_velocity, noise: torch.Tensor, sigma_list, chosen_index: int,
                           fresh_noise: list[torch.Tensor], ode: bool = False) -> tuple[torch.Tensor, int]:
    """backward_simulation for a flow-matching generator: from pure noise at sigma_list[0], for i < chosen_index,
    v_i = G(x_i, σ_i) and either (sde, DMD2's) x̂0_i = x_i − σ_i·v_i re-noised with fresh noise,
    x_{i+1} = (1 − σ_{i+1})·x̂0_i + σ_{i+1}·fresh_noise[i], or (`ode`) the Euler step along v_i,
    x_{i+1} = x_i + (σ_{i+1} − σ_i)·v_i = (1 − σ_{i+1})·x̂0_i + σ_{i+1}·n̂_i, n̂_i the noise the
    generator implies (FlowMatchEulerDiscreteScheduler.step without stochastic_sampling; FastGen's
    student_sample_type="ode").
    Returns (the generator's input at sigma_list[chosen_index], forwards)."""
    if not 0 <= chosen_index < len(sigma_list):
        raise ValueError(f"chosen_index {chosen_index} outside [0, {len(sigma_list)})")
    x, batch = noise, noise.shape[0]
    for i in range(chosen_index):
        s = torch.full((batch,), float(sigma_list[i]), device=noise.device)
        v = generator_velocity(x, s)
        if ode:  # in fp32 as the scheduler steps: sample.float() + dt · model_output
            x = (x.float() + (float(sigma_list[i + 1]) - float(sigma_list[i])) * v.float()).to(noise.dtype)
            continue
        x0 = x0_from_velocity(x, v, s).float()
        nxt = torch.full((batch,), float(sigma_list[i + 1]), device=noise.device)
        x = fm_noise(x0, fresh_noise[i], nxt).to(noise.dtype)
    return x, chosen_index


# ---------------------------------------------------------------------------- schedule

def should_update_generator(step: int, ratio: int) -> bool:
    """Two-time-scale rule: the generator steps when step % ratio == 0 (DFAKE_GEN_UPDATE_RATIO,
    10 for SD-1.5); the fake score and head step every step."""
    if ratio < 1:
        raise ValueError(f"generator update ratio must be >= 1, got {ratio}")
    return step % ratio == 0
