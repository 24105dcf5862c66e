"""DMD2's step for ε-prediction UNets (SD-1.5, SDXL): the twin of algorithms/dmd2_flow.py, the same
functions with the same shape, on algorithms/dmd2.py's epsilon math. A micro-batch `mb` holds the
prompts' conditioning ("text"; "real_text" for REAL_DATA_PATH's own captions), the GAN's real latents
("real") and the per-sample draws of `draw_sample_noise`. Models are UNets called as dmd2.py says;
`alphas` is the teacher's DDPM ᾱ table, `uncond` the unconditional conditioning of the teacher's CFG.

    python -m pytest tests/test_train_dmd.py -q
"""
from __future__ import annotations

import torch

from algorithms import dmd2 as dm
from algorithms.dmd2 import Losses


def generator_images(generator, mb: dict, step_list: list[int], index: int, alphas) -> torch.Tensor:
    """G's image latents for this micro-batch: 1-step from pure noise, or (few-step mode) from the
    input of step_list[index] built by backward simulation. Gradients as the caller's mode."""
    z = mb["noise"]
    if index > 0:
        fresh = [mb["sim_noise"][:, i] for i in range(index)]
        z, _ = dm.backward_simulation(generator, z, step_list, index, mb["text"], alphas, fresh_noise=fresh)
    return dm.generator_forward(generator, z, step_list[index], mb["text"], alphas)


def generator_loss(x: torch.Tensor, mb: dict, teacher, fake, alphas, uncond,
                   losses: Losses = Losses()) -> tuple[torch.Tensor, dict]:
    """loss_dm (+ gen_cls_weight · loss_gen_cls): the generator's objective on images x, the teacher
    under CFG at real_guidance_scale with `uncond`."""
    grad, _ = dm.dm_grad(x, mb["dm_t"], mb["dm_noise"], teacher, fake, mb["text"], uncond,
                         losses.real_guidance_scale, alphas, losses.real_guidance_norm)
    loss_dm = dm.dm_loss(x, grad)
    logs = {"loss_dm": loss_dm.detach()}  # device tensors: read on logging steps only
    if losses.head is None:
        return loss_dm, logs
    z, t = head_input(x, mb, "gan_gen", alphas, losses.diffusion_gan)
    loss_cls = dm.gen_cls_loss(dm.cls_logits(fake, losses.head, z, t, mb["text"]))
    logs["loss_gen_cls"] = loss_cls.detach()
    return loss_dm + losses.gen_cls_weight * loss_cls, logs


def guidance_loss(x: torch.Tensor, mb: dict, fake, alphas, losses: Losses = Losses()) -> tuple[torch.Tensor, dict]:
    """loss_fake (+ guidance_cls_weight · loss_guidance_cls) on detached generator images."""
    x = x.detach()
    loss_fake = dm.fake_score_loss(fake, x, mb["fake_noise"], mb["fake_t"], mb["text"], alphas)
    logs = {"loss_fake": loss_fake.detach()}
    if losses.head is None:
        return loss_fake, logs
    head = losses.head
    logits_fake = dm.cls_logits(fake, head, *head_input(x, mb, "gan_fake", alphas, losses.diffusion_gan), mb["text"])
    # the real images under their own captions (official: real_train_dict["text_embedding"],
    # sd_unified_model.py prepare_pure_generation_data); the prompt rows' when they are the same rows
    logits_real = dm.cls_logits(fake, head, *head_input(mb["real"], mb, "gan_real", alphas, losses.diffusion_gan),
                                mb.get("real_text", mb["text"]))
    loss_cls = dm.guidance_cls_loss(logits_fake, logits_real)
    logs["loss_guidance_cls"] = loss_cls.detach()
    return loss_fake + losses.guidance_cls_weight * loss_cls, logs


def head_input(x: torch.Tensor, mb: dict, name: str, alphas, diffusion_gan: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Input of the GAN head's UNet pass: clean x at t = 0, or (diffusion GAN) x noised to the draw `name`'s t."""
    if not diffusion_gan:
        return x, torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
    t = mb[name + "_t"]
    return dm.add_noise(x, mb[name + "_noise"], t, alphas, out_dtype=torch.float32), t


def draw_sample_noise(g: torch.Generator, shape: tuple, n_sim: int, num_train_timesteps: int,
                      step_percent: tuple[float, float], gan_max_t: int | None) -> dict[str, torch.Tensor]:
    """All randomness of one sample at one iteration, drawn from its own generator (on the run's
    device) in a fixed order. gan_max_t: the diffusion-GAN noise range when the GAN is on, else None."""
    T, dev = num_train_timesteps, g.device
    r = {"noise": torch.randn(shape, generator=g, device=dev),
         "dm_t": dm.sample_dm_timesteps(1, g, T, *step_percent)[0],
         "dm_noise": torch.randn(shape, generator=g, device=dev),
         "fake_t": dm.sample_fake_timesteps(1, g, T)[0],
         "fake_noise": torch.randn(shape, generator=g, device=dev),
         "sim_noise": torch.randn((n_sim, *shape), generator=g, device=dev)}
    if gan_max_t is not None:  # three independent head inputs
        for name in dm.GAN_INPUTS:
            r[name + "_t"] = torch.randint(0, gan_max_t, (), generator=g, device=dev)
            r[name + "_noise"] = torch.randn(shape, generator=g, device=dev)
    return r
