"""Rebuild assets/flux2_edit_base/: the base tiny FLUX.2 [klein] model that the two-reference demo
fine-tunes (demos/flux2_edit_eval.py has the task and its evaluation, at 64 px).

The folder has the Flux2KleinPipeline diffusers layout (transformer/, vae/, text_encoder/, tokenizer/,
scheduler/, model_index.json; is_distilled false: the pipeline samples klein-base with true CFG) and loads
with from_pretrained. Built in five stages, as demos/make_qwen_edit_base.py builds the Qwen base, each
deterministic from its seed and skipped when its output exists (--force=1 redoes them):

  1. vae       a tiny AutoencoderKLFlux2 (8x down: 3 downsamplings, 8 latent channels) trained on 64x64
               coloured-shape images (L1 + MSE + a small KL); its BatchNorm's running mean and variance then
               set to the statistics of its 2x2-patchified latents, the normalisation the pipeline applies.
  2. init      tools/tiny_models.py's klein folder (its Qwen3 tokenizer with the chat template, random Qwen3
               text encoder, FLUX.2's scheduler) with the trained VAE and a random Flux2Transformer2DModel
               (hidden 128: 4 heads of 32, 2 double + 2 single blocks); 64 px = 8x8 latents patchified into
               16 tokens of 32 channels, each reference 16 more.
  3. data      demos/make_qwen_edit_base.py's pre-training edits at 64 px: one reference ("keep it",
               "make it <colour>", "turn it into a <shape>"), two references ("make the background the colour
               of picture 2"). Never the demo's edit (the shape in picture 2's colour).
  4. pretrain  train_flux_kontext.py itself (torchrun, 2 ranks) on that data from the init folder; its
               export/ is the base.
  5. package   copy the export (links resolved) into assets/flux2_edit_base and evaluate it.

    nice -n 10 python -m demos.make_flux2_edit_base        # all stages
    python -m demos.make_flux2_edit_base --stages=pretrain,package --pretrain_steps=4000

Everything but the final folder goes to --work_dir (default out/flux2_edit_base_build).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch

from demos import flux2_edit_eval as fe
from demos import make_kontext_base as mkb
from demos import make_qwen_edit_base as mqb
from demos import qwen_edit_eval as qe
from tools import shapes
from tools import tiny_models

ROOT = Path(__file__).resolve().parent.parent  # the repository root
ASSET_DIR = ROOT / "assets" / "flux2_edit_base"
IMAGE_SIZE = fe.IMAGE_SIZE  # 64

Z_DIM = 8
VAE_CONFIG = dict(latent_channels=Z_DIM, block_out_channels=(8, 16, 32, 32), layers_per_block=1, norm_num_groups=8,
                  sample_size=IMAGE_SIZE, use_quant_conv=False, use_post_quant_conv=False)  # 8x: 64 px -> 8x8
TRANSFORMER_CONFIG = dict(
    patch_size=1, in_channels=4 * Z_DIM, num_layers=2, num_single_layers=2, attention_head_dim=32,
    num_attention_heads=4, timestep_guidance_channels=64, axes_dims_rope=(8, 8, 8, 8), guidance_embeds=False)
VAE_STEPS, VAE_BATCH, VAE_LR, VAE_KL = 3000, 24, 3e-3, 1e-4
PRETRAIN_ARGS = dict(  # train_flux_kontext.py overrides for the pre-training run
    precision="fp32", resolution=IMAGE_SIZE, reference_area=IMAGE_SIZE**2, max_references=2,
    max_sequence_length=fe.MAX_SEQUENCE_LENGTH, cache_latents=True, batch_size=8, grad_accum=1, lr=1e-3,
    warmup_steps=100, weight_decay=0.0, max_grad_norm=1.0, ema_decay=0.999, export_dtype="bf16", num_sample_pairs=4,
    sample_steps=20, sample_guidance=1.0, save_every=500, log_every=50, val_every=0)
PRETRAIN_STEPS = 4000


def log(msg):
    shapes.log(msg, tag="make_flux2_edit_base")


def patchify(z: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) latents -> (B, 4C, H/2, W/2), the pipeline's Flux2KleinPipeline._patchify_latents."""
    from diffusers import Flux2KleinPipeline
    return Flux2KleinPipeline._patchify_latents(z)


def train_vae(steps=VAE_STEPS, batch=VAE_BATCH, lr=VAE_LR, kl_weight=VAE_KL, seed=0, log_every=100):
    """make_kontext_base.train_vae's recipe for AutoencoderKLFlux2 at 64 px: L1 + MSE on a posterior sample plus
    kl_weight x KL per pixel, AdamW, 50 warmup steps then cosine, clip 1. Returns the VAE with its BatchNorm's
    running statistics those of its held-out patchified latents (momentum 1: the pipeline reads them as the
    latents' mean and variance), and a report dict."""
    from diffusers import AutoencoderKLFlux2
    torch.manual_seed(seed)
    vae = AutoencoderKLFlux2(**VAE_CONFIG)
    held_out = mkb.shape_batch(np.random.default_rng(seed + 1), 256, size=IMAGE_SIZE)
    t0 = time.time()
    mkb.fit_vae(vae, lambda rng: mkb.shape_batch(rng, batch, size=IMAGE_SIZE), steps, lr, kl_weight, seed, log_every,
                log)
    with torch.no_grad():
        z = torch.cat([vae.encode(held_out[i:i + 64]).latent_dist.mode() for i in range(0, 256, 64)])
        p = patchify(z)
        vae.bn.running_mean.copy_(p.mean(dim=(0, 2, 3)))
        vae.bn.running_var.copy_(p.var(dim=(0, 2, 3)))
        rec = torch.cat([vae.decode(vae.encode(held_out[i:i + 64]).latent_dist.mode()).sample
                         for i in range(0, 256, 64)])
    report = {"vae_steps": steps, "vae_seconds": round(time.time() - t0, 1),
              "vae_psnr_db": round(mkb.psnr(rec, held_out), 2),
              **{f"vae_recon_{k}": v for k, v in mkb.recon_scores(rec, held_out).items()}}
    return vae, report


def make_init_folder(folder, vae, seed=0):
    """tools/tiny_models.py's klein folder (tokenizer, text encoder, scheduler, as it writes them) with the
    trained VAE and a random transformer of TRANSFORMER_CONFIG (its text width three of the encoder's layers)."""
    from diffusers import Flux2KleinPipeline, Flux2Transformer2DModel
    return mkb.init_from_tiny(folder, tiny_models.make_tiny_flux2_klein, Flux2KleinPipeline, lambda pipe: (
        Flux2Transformer2DModel(**TRANSFORMER_CONFIG, joint_attention_dim=3 * pipe.text_encoder.config.hidden_size)),
        vae, seed)


def pretrain_scenes():
    """make_qwen_edit_base's pre-training mix, drawn at 64 px."""
    return mqb.pretrain_scenes(size=IMAGE_SIZE)


def load_vae(folder):
    from diffusers import AutoencoderKLFlux2
    return AutoencoderKLFlux2.from_pretrained(folder, torch_dtype=torch.float32)


FAMILY = mkb.Family(
    name="flux2_edit_base", doc=__doc__, dest=ASSET_DIR, vae_steps=VAE_STEPS, pretrain_steps=PRETRAIN_STEPS,
    pretrain_args=PRETRAIN_ARGS, train_vae=train_vae, load_vae=load_vae, make_init_folder=make_init_folder,
    write_data=lambda folder: qe.write_edits(folder, pretrain_scenes(), size=IMAGE_SIZE),
    retention_eval=lambda dest: fe.evaluate(dest, qe.load_rows(fe.ensure_task_data()["retention"]))[0], log=log)


def main(argv=None):
    return mkb.run_stages(FAMILY, argv)


if __name__ == "__main__":
    sys.exit(main())
