"""DMD2's flow-matching step (FLUX.1 Kontext, FLUX.1 text-to-image, Qwen-Image-Edit), the twin of
algorithms/dmd2_unet.py: the same functions with the same shape, taking `guidance` where the UNet
step takes its ᾱ table and CFG conditioning. The three transformers enter algorithms/dmd2.py's
flow-matching math as velocity callables that hold the sample's conditioning: each micro-batch's
`cond` (FluxCond here, the Qwen room's QwenCond) says how its family's transformer reads x_σ, by the
function its fine-tuning builds its input with. FLUX: flux_kontext.token_sequence, [target tokens ;
clean context tokens], ids (0, r, c) then (1, r, c), T5 embeddings + pooled CLIP vector, timestep = σ,
the raw guidance value.

Guidance. FLUX.1 [dev] and Kontext [dev] are guidance-distilled: the guidance value is an input
embedding, not a CFG pair of forwards. All three transformers get the same value (FLUX_GUIDANCE), as
NVlabs/FastGen's FLUX DMD2 does (fastgen/configs/experiments/Flux/config_dmd2.py:37-39 sets one
guidance_scale on the net config that student, teacher and fake score are all built from;
fastgen/networks/Flux/network.py:642-646 fills it in every forward). Why the same value: the
generator starts as the teacher at that value, so the fake score, which must track the generator's
distribution, starts exact when it sees it too, and the DM gradient (teacher − fake) then measures
the distribution gap, not a difference of conditioning. The export is sampled at that value.

σ convention: a few-step list given as DDPM-style timesteps t (DENOISING_STEPS, 999 = pure noise)
maps to σ = (t + 1) / 1000, so [999, 749, 499, 249] is σ = [1, .75, .5, .25]: the list
FluxKontextPipeline builds for num_inference_steps=4 (np.linspace(1, 1/4, 4),
diffusers pipeline_flux_kontext.py:965) when its scheduler does not shift.

    python -m pytest tests/test_train_dmd_kontext.py -q
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from algorithms import dmd2 as dm
from algorithms import flux_kontext as km
from algorithms.dmd2 import Losses


def timestep_sigmas(timesteps) -> list[float]:
    """DENOISING_STEPS / CONDITIONING_TIMESTEP (DDPM-style, 999 = pure noise) -> FLUX σ = (t + 1) / 1000."""
    return [(int(t) + 1) / 1000 for t in timesteps]


@dataclass
class FluxCond:
    """One micro-batch's conditioning, shared by the three transformers."""
    text: torch.Tensor  # (B, T, D) T5 token embeddings
    pooled: torch.Tensor  # (B, P) pooled CLIP vector
    context: torch.Tensor | None  # (B, Nc, 4C) packed clean context latents (Kontext), None for text-to-image
    size: tuple[int, int]  # the target latent's (h, w); a context has the same size

    def velocity(self, model, guidance: float, norm: str = "none"):
        return velocity(model, self, guidance)  # guidance-distilled: no CFG pair, nothing to rescale


def velocity(model, cond: FluxCond, guidance: float):
    """v(x_σ, σ) of `model` under `cond`: x_σ are the packed target tokens (B, Nt, 4C); the context
    tokens are appended as fine-tuning appends them (flux_kontext.token_sequence) and the prediction
    cut back to the target's (as the pipeline does, pipeline_flux_kontext.py:1038, 1052)."""
    ids = km.sequence_ids(cond.size, cond.size if cond.context is not None else None, cond.text.device)  # once

    def v(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        hidden, _ = km.token_sequence(x, cond.size, cond.context, cond.size, ids=ids)
        out = km.transformer_forward(model, {"hidden_states": hidden, "img_ids": ids}, sigma, guidance,
                                     cond.text, cond.pooled)
        return out[:, :x.shape[1]].float()
    return v


def generator_images(generator, mb: dict, sigmas: list[float], index: int, guidance: float,
                     ode: bool = False) -> torch.Tensor:
    """G's clean tokens x̂0 for this micro-batch: from pure noise at sigmas[0], or (few-step) from the
    input at sigmas[index] built by backward simulation without gradients (fresh noise per step, as
    inference with the exported stochastic scheduler does; `ode`: Euler steps, as its deterministic one does).
    Gradients as the caller's mode."""
    v = mb["cond"].velocity(generator, guidance)
    z = mb["noise"]
    if index > 0:
        fresh = [] if ode else [mb["sim_noise"][:, i] for i in range(index)]  # the ODE's steps draw none
        z, _ = dm.fm_backward_simulation(v, z, sigmas, index, fresh, ode)
    s = torch.full((z.shape[0],), float(sigmas[index]), device=z.device)
    return dm.x0_from_velocity(z, v(z, s), s).float()


def generator_loss(x: torch.Tensor, mb: dict, teacher, fake, guidance: float,
                   losses: Losses = Losses()) -> tuple[torch.Tensor, dict]:
    """loss_dm on G's tokens x: the per-sample normalised (teacher − fake) x̂0 direction at a σ drawn
    in the DM range (+ regression_weight · loss_reg, + gen_cls_weight · loss_gen_cls). FLUX: teacher and
    fake at the same guidance value, no CFG pair (losses.real_guidance_scale 1); a family whose teacher
    takes true CFG (Qwen-Image-Edit) gives the teacher losses.real_guidance_scale, the fake staying at
    `guidance`, its pair combined by losses.real_guidance_norm. loss_reg's target is the teacher's ODE from
    the same noise, under the same guidance. losses.dmd_loss "decoupled": loss_ca + loss_dm of decoupled_loss
    in loss_dm's place (the conditional teacher is the teacher at `guidance`, the pair's other half).
    losses.diversity_weight > 0 and a first step (mb["step_index"] 0 of a few-step list): diversity_weight ·
    loss_div (dm.diversity_loss, the teacher's ODE under mb["ode_shift"]) in place of the DM terms."""
    cond, scale = mb["cond"], losses.real_guidance_scale
    teacher_v = cond.velocity(teacher, guidance if scale == 1 else scale, losses.real_guidance_norm,
                              **low_noise_scale(scale, losses.real_guidance_scale_2))
    if losses.diversity_weight > 0 and mb.get("step_index") == 0:
        k, shift = losses.diversity_anchor, mb["ode_shift"]
        anchor = dm.fm_teacher_ode(teacher_v, mb["noise"], losses.regression_steps, shift, stop=k)
        loss_div = dm.diversity_loss(x, mb["noise"], anchor, dm.ode_sigmas(losses.regression_steps, shift)[k])
        loss, logs = losses.diversity_weight * loss_div, {"loss_div": loss_div.detach()}
    elif losses.dmd_loss == "decoupled":
        loss, logs = decoupled_loss(x, mb, teacher_v, cond.velocity(teacher, guidance), cond.velocity(fake, guidance),
                                    losses)
    else:
        grad, _ = dm.fm_dm_grad(x, mb["dm_sigma"], mb["dm_noise"], teacher_v, cond.velocity(fake, guidance))
        loss = dm.dm_loss(x, grad)
        logs = {"loss_dm": loss.detach()}
    if losses.regression_weight > 0:  # a 1-step generator: x = G(mb["noise"]), the ODE's start
        loss_reg = dm.regression_loss(x, dm.fm_teacher_ode(teacher_v, mb["noise"], losses.regression_steps))
        logs["loss_reg"] = loss_reg.detach()
        loss = loss + losses.regression_weight * loss_reg
    if losses.head is None:
        return loss, logs
    loss_cls = dm.gen_cls_loss(cls_logits(fake, losses.head, x, mb, "gan_gen", losses.diffusion_gan, guidance))
    logs["loss_gen_cls"] = loss_cls.detach()
    return loss + losses.gen_cls_weight * loss_cls, logs


def low_noise_scale(scale: float, scale_2: float | None) -> dict:
    """The teacher velocity's keyword for a two-expert teacher's low-noise CFG scale (Wan 2.2 A14B's
    guidance_scale_2), only where one is set and the teacher runs its CFG pair (scale > 1, as WanPipeline's
    do_classifier_free_guidance reads guidance_scale alone); {} for every other teacher."""
    return {"guidance_2": scale_2} if scale_2 is not None and scale > 1 else {}


def decoupled_loss(x: torch.Tensor, mb: dict, teacher_cfg, teacher_cond, fake_cond,
                   losses: Losses = Losses()) -> tuple[torch.Tensor, dict]:
    """Decoupled DMD (Liu et al. 2025, "Decoupled DMD: CFG Augmentation as the Spear, Distribution Matching as
    the Shield", arXiv 2511.22677; Z-Image-Turbo's distillation): DMD's CFG'd direction split in two terms, each
    at its own re-noising, each normalised as DMD2 normalises (dm.fm_dm_grad), G's loss their weighted sum
    ("the final loss is the sum of ca_loss and dm_loss": github.com/Tongyi-MAI/Z-Image/issues/56):

        loss_ca  the teacher's CFG'd x̂0 against its conditional x̂0 at x_τ (mb["ca_sigma"], mb["ca_noise"]), i.e.
                 G pulled along (w − 1)(x̂0_cond − x̂0_uncond) / mean|x − x̂0_cfg|
        loss_dm  the conditional teacher against the fake score, no CFG, at DMD2's σ (mb["dm_sigma"], mb["dm_noise"])

    Our choices (the sources do not say them): the CA term is teacher_cfg − teacher_cond, the family's own CFG
    combination minus its conditional prediction, so REAL_GUIDANCE_NORM's rescale applies to it (with "none"
    it is exactly (w − 1)(cond − uncond); at one σ and noise the two unnormalised terms add up to DMD2's
    direction); each term's normaliser is mean|x − x̂0| of its own first prediction (CA: the CFG'd teacher, as
    DMD2's; DM: the conditional teacher); the CA term has its own noise draw. Signs as dm.fm_dm_grad: −grad is
    where G moves. Costs 3 teacher batch-forwards at τ (the pair, then the conditional) + 1 at σ."""
    grad_ca, _ = dm.fm_dm_grad(x, mb["ca_sigma"], mb["ca_noise"], teacher_cfg, teacher_cond)
    grad_dm, _ = dm.fm_dm_grad(x, mb["dm_sigma"], mb["dm_noise"], teacher_cond, fake_cond)
    loss_ca, loss_dm = dm.dm_loss(x, grad_ca), dm.dm_loss(x, grad_dm)
    loss = losses.ca_weight * loss_ca + losses.dm_weight * loss_dm
    return loss, {"loss_ca": loss_ca.detach(), "loss_dm": loss_dm.detach()}


def ca_sigma(u: torch.Tensor, student_sigma: float, shift: float = 1.0) -> torch.Tensor:
    """The CA term's re-noising σ from u ~ U[0, 1): uniform between clean and the student's current σ before the
    shift, then shifted as the run shifts (github.com/Tongyi-MAI/Z-Image/issues/78: "we use the pre-shift t value
    ... as the lower bound, and uniformly sample τ ... After that, we timeshift the sampled tau"; its t = 1 − σ).
    Ours: the bound is the student's σ as its list gives it (the generator's σ list is not shifted by SHIFT)."""
    return km.shift_sigmas(u * student_sigma, shift)


def guidance_loss(x: torch.Tensor, mb: dict, fake, guidance: float,
                  losses: Losses = Losses()) -> tuple[torch.Tensor, dict]:
    """loss_fake: the fake score's flow-matching loss on detached generator tokens (+ guidance_cls_weight
    · loss_guidance_cls: the head on those tokens against the pairs' own targets, `mb["real"]`, under
    the same conditioning)."""
    x = x.detach()
    loss = dm.fm_fake_score_loss(mb["cond"].velocity(fake, guidance), x, mb["fake_noise"], mb["fake_sigma"],
                                 losses.fake_target)
    logs = {"loss_fake": loss.detach()}
    if losses.head is None:
        return loss, logs
    logits_fake = cls_logits(fake, losses.head, x, mb, "gan_fake", losses.diffusion_gan, guidance)
    logits_real = cls_logits(fake, losses.head, mb["real"], mb, "gan_real", losses.diffusion_gan, guidance)
    loss_cls = dm.guidance_cls_loss(logits_fake, logits_real)
    logs["loss_guidance_cls"] = loss_cls.detach()
    return loss + losses.guidance_cls_weight * loss_cls, logs


def draw_sample_noise(g: torch.Generator, shape: tuple, n_sim: int, sigma_range: tuple[float, float],
                      gan_max_sigma: float | None = None, shift: float = 1.0,
                      ca_max_sigma: float | None = None) -> dict:
    """All randomness of one sample at one iteration, from its own generator on the run's device, in
    a fixed order; latents unpacked (C, h, w), as the pipeline draws them before packing.
    gan_max_sigma: the diffusion GAN's σ range [0, gan_max_sigma) when the GAN is on, else None.
    shift: the DM loss's and the fake score's σ, drawn uniformly, are then shifted (flux_kontext.shift_sigmas:
    SHIFT); the generator's σ list and the GAN's draws are not.
    ca_max_sigma (DMD_LOSS=decoupled): the student's σ this iteration; the CA term's σ (ca_sigma) and noise are
    drawn last, so that every other draw is the same as without them."""
    dev = g.device
    r = {"noise": torch.randn(shape, generator=g, device=dev),
         "dm_sigma": km.shift_sigmas(dm.sample_dm_sigmas(1, g, *sigma_range), shift)[0],
         "dm_noise": torch.randn(shape, generator=g, device=dev),
         "fake_sigma": km.sample_sigmas(1, "uniform", g, shift=shift)[0],
         "fake_noise": torch.randn(shape, generator=g, device=dev),
         "sim_noise": torch.randn((n_sim, *shape), generator=g, device=dev)}
    if gan_max_sigma is not None:  # three head inputs: G's turn on fake, guidance turn on fake and real
        for name in dm.GAN_INPUTS:
            r[name + "_sigma"] = torch.rand((), generator=g, device=dev) * gan_max_sigma
            r[name + "_noise"] = torch.randn(shape, generator=g, device=dev)
    if ca_max_sigma is not None:
        r["ca_sigma"] = ca_sigma(torch.rand((), generator=g, device=dev), ca_max_sigma, shift)
        r["ca_noise"] = torch.randn(shape, generator=g, device=dev)
    return r


def pack_draws(r: dict, pack=km.pack_latents) -> dict:
    """draw_sample_noise's latents of a micro-batch (B, C, *grid) -> packed tokens (B, N, D) by `pack` (the room's
    pack_latents: images (B, C, h, w) -> 2x2 patches (B, N, 4C))."""
    out = dict(r)
    for k in ("noise", "dm_noise", "fake_noise", *(n + "_noise" for n in (*dm.GAN_INPUTS, "ca") if n + "_noise" in r)):
        out[k] = pack(r[k])
    out["sim_noise"] = pack_steps(r["sim_noise"], pack)
    return out


def pack_steps(sim: torch.Tensor, pack=km.pack_latents) -> torch.Tensor:
    """(B, n_sim, C, *grid) -> (B, n_sim, N, D); n_sim may be 0 (a 1-step generator)."""
    return pack(sim.flatten(0, 1)).unflatten(0, sim.shape[:2])


def latent_grid(room, size: tuple[int, int], factor: int, settings: dict) -> tuple:
    """A target of `size` px as its latent grid: the room's latent_grid where it has one (a video room's (T, h,
    w)), else (h/f, w/f)."""
    own = getattr(room, "latent_grid", None)
    return tuple(own(size, settings)) if own is not None else (size[0] // factor, size[1] // factor)


def token_count(grid: tuple) -> int:
    """The tokens of a latent grid (..., h, w) in 2x2 patches of each frame: (h/2)(w/2) per frame."""
    return math.prod(grid[:-2]) * (grid[-2] // 2) * (grid[-1] // 2)


@torch.no_grad()
def sample_tokens(generator, cond, noise: torch.Tensor, sim_noise: torch.Tensor, sigmas: list[float],
                  guidance: float, ode: bool = False) -> torch.Tensor:
    """Inference over the whole σ list (the exported scheduler's steps, stochastic or with `ode` Euler's):
    packed noise (B, N, 4C) -> x̂0 tokens after the last step."""
    last = len(sigmas) - 1
    mb = {"cond": cond, "noise": noise, "sim_noise": sim_noise}
    return generator_images(generator, mb, sigmas, last, guidance, ode)


# ---------------------------------------------------------------------------- GAN head (optional)
# What it reads: the fake transformer's image stream after its last double-stream block (the joint
# text-image blocks: FLUX's 19, before its single-stream blocks; every block of Qwen-Image, which has
# only these), target tokens only (the context / reference tokens after them are cut as the velocity
# cuts them), as a (B, D, h/2, w/2) grid: the flow transformers' counterpart of the UNet bottleneck the
# published head reads (tianweiy/DMD2 main/sd_guidance.py:107-133). D = 3072 for both at full size, so a
# 1x1 convolution first brings it to HEAD_CHANNELS, then the published head's stride-2 stages
# (algorithms/dmd2.ClassifierHead).

HEAD_CHANNELS = 256


class _Passthrough(nn.Module):
    def forward(self, x, *args, **kwargs):
        return x


# what the features skip, with the stand-ins that skip it (a module the model lacks is left out)
_AFTER_DOUBLE_STREAM = {"single_transformer_blocks": nn.ModuleList, "norm_out": _Passthrough, "proj_out": nn.Identity}


def head_grid(side: int) -> int:
    """The head's native grid: the token grid (latent side / 2), pooled to at most 8, a power of two >= 4."""
    return max(4, min(8, 1 << ((side // 2).bit_length() - 1)))


class TransformerHead(nn.Sequential):
    def __init__(self, width: int, grid: int):
        super().__init__(nn.Conv2d(width, HEAD_CHANNELS, kernel_size=1), dm.ClassifierHead(HEAD_CHANNELS, grid))


def double_stream_features(model, x: torch.Tensor, sigma: torch.Tensor, cond, guidance: float) -> torch.Tensor:
    """The model's forward under `cond` (FluxCond, or families/qwen_image.QwenCond at guidance 1) with
    the units after its double-stream blocks swapped out for its duration (the forward itself runs,
    so FSDP2 gathers, frees and registers backward as in any forward; the removed units never run).
    Returns (B, D, h/2, w/2) fp32, keeping the graph."""
    removed = {name: make() for name, make in _AFTER_DOUBLE_STREAM.items() if hasattr(model, name)}
    saved = {name: getattr(model, name) for name in removed}
    for name, stand_in in removed.items():
        setattr(model, name, stand_in)
    try:
        tokens = cond.velocity(model, guidance)(x, sigma)  # (B, Nt, D): the target tokens' hidden states
    finally:
        for name, module in saved.items():
            setattr(model, name, module)
    h, w = cond.size  # the target latent's: its tokens are its 2x2 patches, row by row
    return tokens.transpose(1, 2).reshape(tokens.shape[0], tokens.shape[2], h // 2, w // 2)


def cls_logits(fake, head, x: torch.Tensor, mb: dict, name: str, diffusion_gan: bool, guidance: float) -> torch.Tensor:
    """(B, 1) realism logits of clean tokens x, or (diffusion GAN) of x noised to the draw `name`'s σ."""
    if diffusion_gan:
        sigma = mb[name + "_sigma"]
        x = dm.fm_noise(x, mb[name + "_noise"], sigma)
    else:
        sigma = torch.zeros(x.shape[0], device=x.device)
    cond = mb["cond"]
    read = getattr(cond, "head_features", None)  # a room whose transformer has no double-stream blocks (Wan)
    features = read(fake, x, sigma, guidance) if read else double_stream_features(fake, x, sigma, cond, guidance)
    if features.ndim == 5:  # a video's (B, D, T, h, w): each latent frame's grid through the head, logits averaged
        b, d, t = features.shape[:3]
        logits = head(features.transpose(1, 2).reshape(b * t, d, *features.shape[3:]))
        return logits.view(b, t).mean(dim=1, keepdim=True)
    return head(features)
