"""Rebuild the shipped DMD2 teacher, `assets/shapes_teacher/`, from scratch on the CPU.

The teacher is a tiny text-to-image latent diffusion model in the SD-1.5 folder layout
(StableDiffusionPipeline.save_pretrained: unet/ vae/ text_encoder/ tokenizer/ scheduler/
model_index.json), trained by this script on the coloured-shapes task of `demos/shapes_eval.py`:
32x32 px, one circle / square / triangle in red / green / blue / yellow on a white / black / cyan
background, captions like "a red circle on a white background" (36 prompts).

Stages (all seeded; 33 min for the shipped teacher on 2 CPU cores shared with other jobs):
 1. VAE: AutoencoderKL, SD-1.5 architecture in miniature (3 blocks, 32x32 px -> 4x8x8 latents),
    trained on freshly drawn images with L1 + L2 reconstruction and SD's tiny KL weight (1e-6);
    scaling_factor = 1 / (std of the latents of the training set), as SD-1.5's 0.18215 was chosen.
 2. Text encoder: a 2-layer, 64-wide CLIPTextModel with random frozen weights (it only has to
    tell prompts apart) and the tiny CLIP BPE tokenizer of `tools/tiny_models.py`
    (`write_clip_tokenizer`).
 3. UNet: UNet2DConditionModel with cross-attention down, mid and up blocks (BasicTransformerBlock
    and ResnetBlock2D, as SD-1.5), epsilon prediction under SD-1.5's noise schedule
    (scaled-linear betas 0.00085 -> 0.012, 1000 steps), on cached VAE latents, with 10 % caption
    dropout (the empty prompt) for classifier-free guidance, min-SNR-5 loss weights, AdamW with
    warmup + cosine decay, and an EMA of the weights (the EMA is what is saved).
 4. Save with DDIMScheduler (SD-1.5's scheduler_config), weights as fp16 safetensors, plus
    prompts.txt (the 36 training prompts, the DMD2 stage-1 data) and data.jsonl + images/
    (4 real images per prompt, the stage-2 GAN data), then a quick evaluation with shapes_eval.

    python -m demos.make_teacher                        # -> assets/shapes_teacher (about 30 min)
    python -m demos.make_teacher --out=/tmp/t --quick   # a 1-minute smoke run (poor model)

Bit-exact reproduction needs the same torch build, CPU kind and --threads (reduction order).
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from demos import shapes_eval as se
from tools.shapes import log, to_tensor, to_uint8
from tools.tiny_models import write_clip_tokenizer

TEXT_HIDDEN = 64
TEXT_MAX_LENGTH = 16  # prompts are 9 tokens with <bos>/<eos>; SD pads to the tokenizer's max length
LATENT_CHANNELS = 4
# SD-1.5's scheduler_config.json (runwayml/stable-diffusion-v1-5)
SCHEDULER_CONFIG = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                        beta_schedule="scaled_linear", prediction_type="epsilon", clip_sample=False,
                        set_alpha_to_one=False, steps_offset=1)


# ---------------------------------------------------------------------------------------------
# models

def build_text_encoder(tokenizer, seed: int):
    from transformers import CLIPTextConfig, CLIPTextModel

    config = CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=TEXT_HIDDEN, intermediate_size=2 * TEXT_HIDDEN,
        num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=tokenizer.model_max_length,
        projection_dim=TEXT_HIDDEN, hidden_act="quick_gelu", bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    return CLIPTextModel(config).eval().requires_grad_(False)


def build_vae(seed: int):
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=LATENT_CHANNELS, sample_size=se.IMAGE_SIZE,
        down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(16, 32, 64), layers_per_block=1, norm_num_groups=8,
        scaling_factor=1.0)  # replaced by the measured value
    # Start the posterior's log-variance at -6 (std 0.05) instead of 0: with SD's KL weight of 1e-6
    # nothing pulls it up, and unit-variance sampling noise on fresh latents slows training badly.
    with torch.no_grad():
        vae.quant_conv.bias[LATENT_CHANNELS:] = -6.0
    return vae


def build_unet(seed: int):
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    return UNet2DConditionModel(
        sample_size=se.IMAGE_SIZE // 4, in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=8,
        cross_attention_dim=TEXT_HIDDEN, attention_head_dim=4)


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------------
# schedule

def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup over `warmup` steps, then cosine decay from `peak` down to 5 % of it."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


# ---------------------------------------------------------------------------------------------
# stages

def train_vae(vae, steps: int, batch: int, lr: float, seed: int):
    opt = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0)
    vae.train()
    start = time.time()
    for step in range(steps):
        images, _ = se.sample_dataset(batch, seed=seed * 1_000_003 + step)
        x = to_tensor(images)
        posterior = vae.encode(x).latent_dist
        recon = vae.decode(posterior.sample()).sample
        rec = F.l1_loss(recon, x) + F.mse_loss(recon, x)
        kl = posterior.kl().mean() / x[0].numel()
        loss = rec + 1e-6 * kl
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr, warmup=50)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            log(f"vae step {step:5d}/{steps}  rec {rec.item():.4f}  kl/dim {kl.item():.2f}  "
                f"{time.time() - start:.0f}s")
    return vae.eval().requires_grad_(False)


@torch.no_grad()
def encode_latents(vae, n: int, seed: int, batch: int = 256):
    """Posterior mean and std of n freshly drawn images, and their prompts."""
    images, prompts = se.sample_dataset(n, seed=seed)
    means, stds = [], []
    for chunk in to_tensor(images).split(batch):
        dist = vae.encode(chunk).latent_dist
        means.append(dist.mean)
        stds.append(dist.std)
    return torch.cat(means), torch.cat(stds), prompts, images


@torch.no_grad()
def vae_check(vae, images: np.ndarray) -> np.ndarray:
    """Reconstructions (uint8, as `images`) of real images through the posterior mode, for
    shapes_eval's adherence scores (should be ~100 %)."""
    z = vae.encode(to_tensor(images)).latent_dist.mode()
    return to_uint8(vae.decode(z).sample)


def train_unet(unet, latents_mean, latents_std, text_ids, text_table, steps: int, batch: int,
               lr: float, seed: int, ema_decay: float, dropout: float = 0.1, snr_gamma: float = 5.0,
               callback=None, callback_every: int = 0):
    """latents_* (N, 4, 8, 8) already scaled; text_ids (N,) index into text_table (P+1, L, D),
    whose last row is the empty prompt. `callback(step, ema_state_dict)` every `callback_every`
    steps (e.g. to evaluate the EMA weights along the way)."""
    from diffusers import DDPMScheduler

    sched = DDPMScheduler(**{k: v for k, v in SCHEDULER_CONFIG.items() if k != "set_alpha_to_one"})
    alphas = sched.alphas_cumprod
    snr = alphas / (1 - alphas)
    weights = torch.clamp(snr, max=snr_gamma) / snr  # min-SNR-gamma for epsilon prediction
    ema = {k: v.detach().clone() for k, v in unet.state_dict().items()}
    opt = torch.optim.AdamW(unet.parameters(), lr=lr, weight_decay=0.01)
    g = torch.Generator().manual_seed(seed)
    empty = text_table.shape[0] - 1
    n = latents_mean.shape[0]
    unet.train()
    start, running = time.time(), []
    for step in range(steps):
        idx = torch.randint(0, n, (batch,), generator=g)
        x0 = latents_mean[idx] + latents_std[idx] * torch.randn(latents_mean[idx].shape, generator=g)
        drop = torch.rand(batch, generator=g) < dropout
        ids = torch.where(drop, torch.full_like(text_ids[idx], empty), text_ids[idx])
        t = torch.randint(0, 1000, (batch,), generator=g)
        noise = torch.randn(x0.shape, generator=g)
        a = alphas[t].view(-1, 1, 1, 1)
        zt = a.sqrt() * x0 + (1 - a).sqrt() * noise
        pred = unet(zt, t, encoder_hidden_states=text_table[ids], return_dict=False)[0]
        loss = (weights[t] * ((pred - noise) ** 2).mean(dim=(1, 2, 3))).mean()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup=100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
        opt.step()
        decay = min(ema_decay, (1 + step) / (10 + step))
        with torch.no_grad():
            for k, v in unet.state_dict().items():
                if v.dtype.is_floating_point:
                    ema[k].mul_(decay).add_(v.detach(), alpha=1 - decay)
                else:
                    ema[k].copy_(v)
        running.append(loss.item())
        if callback is not None and callback_every and (step + 1) % callback_every == 0:
            callback(step + 1, ema)
        if step % 50 == 0 or step == steps - 1:
            log(f"unet step {step:5d}/{steps}  loss {np.mean(running):.4f}  lr {opt.param_groups[0]['lr']:.2e}  "
                f"{time.time() - start:.0f}s")
            running = []
    unet.load_state_dict(ema)
    return unet.eval().requires_grad_(False)


def save_teacher(folder: Path, unet, vae, text_encoder, tokenizer, dtype=torch.float16):
    from diffusers import DDIMScheduler, StableDiffusionPipeline

    scheduler = DDIMScheduler(**SCHEDULER_CONFIG)
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
                                   scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)
    pipe.to(dtype)
    pipe.save_pretrained(folder, safe_serialization=True)
    pipe.to(torch.float32)


def write_data(folder: Path, per_prompt: int, seed: int):
    """prompts.txt (the 36 prompts) and data.jsonl + images/ (per_prompt real PNGs per prompt)."""
    from PIL import Image

    prompts = se.all_prompts()
    (folder / "prompts.txt").write_text("\n".join(prompts) + "\n")
    images, image_prompts = se.real_set(prompts, per_prompt, seed)
    (folder / "images").mkdir(exist_ok=True)
    rows = []
    for i, (im, p) in enumerate(zip(images, image_prompts)):
        name = f"images/{i:04d}.png"
        Image.fromarray(im).save(folder / name, optimize=True)
        rows.append(json.dumps({"prompt": p, "image": name}))
    (folder / "data.jsonl").write_text("\n".join(rows) + "\n")


# ---------------------------------------------------------------------------------------------

def main(argv=None):
    se.quiet()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="assets/shapes_teacher")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads; the shipped teacher was built with 1 (bit-exact only with the same)")
    ap.add_argument("--vae_steps", type=int, default=900)
    ap.add_argument("--vae_batch", type=int, default=16)
    ap.add_argument("--vae_lr", type=float, default=2e-3)
    ap.add_argument("--latent_images", type=int, default=20000, help="training images encoded once for the UNet")
    ap.add_argument("--unet_steps", type=int, default=2000)
    ap.add_argument("--unet_batch", type=int, default=64)
    ap.add_argument("--unet_lr", type=float, default=2e-3)
    ap.add_argument("--ema", type=float, default=0.995)
    ap.add_argument("--gan_images_per_prompt", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="tiny step counts: a smoke run, not a usable model")
    ap.add_argument("--eval_seeds", type=int, default=4, help="images per prompt in the final check (0 = skip)")
    args = ap.parse_args(argv)
    if args.quick:
        args.vae_steps, args.unet_steps, args.latent_images, args.eval_seeds = 20, 20, 512, 1
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t_start = time.time()
    out = Path(args.out)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)

    # 1. VAE
    vae = build_vae(args.seed + 1)
    log(f"VAE: {n_params(vae) / 1e6:.2f} M params; training {args.vae_steps} steps x {args.vae_batch}")
    vae = train_vae(vae, args.vae_steps, args.vae_batch, args.vae_lr, args.seed)
    t_vae = time.time() - t_start

    check_images, check_prompts = se.sample_dataset(288, seed=args.seed + 777)
    recon = vae_check(vae, check_images)
    m = se.score_images(recon, check_prompts)
    log(f"VAE reconstructions: colour {m['colour_acc']:.1f} %  shape {m['shape_acc']:.1f} %  "
        f"background {m['background_acc']:.1f} %  FD {m['fd']:.2f}  "
        f"L1 {np.abs(recon.astype(float) - check_images).mean():.2f}/255")

    # 2. latents and scaling factor
    mean, std, prompts, _ = encode_latents(vae, args.latent_images, seed=args.seed + 2)
    samples = mean + std * torch.randn(mean.shape, generator=torch.Generator().manual_seed(args.seed + 3))
    scaling = float(1.0 / samples.std())
    vae.register_to_config(scaling_factor=scaling)
    log(f"latents {tuple(mean.shape)}: mean {samples.mean():.3f} std {samples.std():.3f} -> "
        f"scaling_factor {scaling:.5f}; posterior std mean {std.mean():.4f}")
    mean, std = mean * scaling, std * scaling

    # 3. text encoder + cached prompt embeddings
    tokenizer = write_clip_tokenizer(tmp / "tokenizer", max_length=TEXT_MAX_LENGTH)
    text_encoder = build_text_encoder(tokenizer, args.seed + 4)
    table_prompts = se.all_prompts() + [""]
    text_table = se.encode_text(tokenizer, text_encoder, table_prompts)
    index = {p: i for i, p in enumerate(table_prompts)}
    text_ids = torch.tensor([index[p] for p in prompts])
    log(f"text encoder: {n_params(text_encoder) / 1e6:.3f} M params (random, frozen); "
        f"embeddings {tuple(text_table.shape)}")

    # 4. UNet
    unet = build_unet(args.seed + 5)
    log(f"UNet: {n_params(unet) / 1e6:.2f} M params; training {args.unet_steps} steps x {args.unet_batch}")
    t_unet = time.time()
    unet = train_unet(unet, mean, std, text_ids, text_table, args.unet_steps, args.unet_batch, args.unet_lr,
                      args.seed + 6, args.ema)
    t_unet = time.time() - t_unet

    # 5. save
    save_teacher(tmp, unet, vae, text_encoder, tokenizer)
    write_data(tmp, args.gan_images_per_prompt, seed=args.seed + 8)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    log(f"wrote {out} ({size / 1e6:.2f} MB); VAE {t_vae:.0f}s, UNet {t_unet:.0f}s, "
        f"total {time.time() - t_start:.0f}s")

    # 6. quick check through the saved folder
    if args.eval_seeds:
        reference = se.Reference(se.all_prompts())
        for sampler, steps, cfg in (("ddim", 25, 2.0), ("ddim", 25, 4.0), ("onestep", 1, 1.0)):
            m, _, _ = se.evaluate_folder(str(out), sampler, steps, cfg, args.eval_seeds, reference=reference)
            log(f"{sampler} {steps} steps cfg {cfg}: colour {m['colour_acc']:.1f} %  shape {m['shape_acc']:.1f} %  "
                f"background {m['background_acc']:.1f} %  all {m['all_acc']:.1f} %  FD {m['fd']:.2f}  "
                f"diversity {m['diversity']:.2f} (real {m['real_diversity']:.2f})")


if __name__ == "__main__":
    sys.exit(main())
