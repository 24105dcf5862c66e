"""Rebuild assets/z_image_edit_base/: the base tiny Z-Image Omni model that the two-reference demo fine-tunes
(demos/z_image_edit_eval.py has the task and its evaluation, at 64 px).

The folder has the ZImageOmniPipeline diffusers layout (transformer/, vae/, text_encoder/, tokenizer/, siglip/,
siglip_processor/, scheduler/, model_index.json) and loads with from_pretrained. Built in five stages, as
demos/make_flux2_edit_base.py builds the FLUX.2 base, each deterministic and skipped when its output exists
(--force=1 redoes them):

  1. vae       FLUX.1's AutoencoderKL class (Z-Image's) holding the trained encoder and decoder of
               assets/flux2_edit_base's AutoencoderKLFlux2 (8x down to 8 latent channels, trained on 64x64
               coloured-shape images: the two classes share every weight but the FLUX.2 BatchNorm's
               statistics), its shift_factor / scaling_factor set from the mean and standard deviation of its
               latents of 256 held-out images, as demos/make_kontext_base.py sets FLUX.1's. Scored in bf16,
               the dtype ZImageOmniPipeline encodes references in. No training: --vae_steps is 0.
  2. init      families/z_image/tiny.py's Omni folder (its Qwen3 tokenizer and random 2-layer Qwen3 encoder,
               random SigLIP2 and its processor, the base model's scheduler, static shift 6.0) with that VAE
               and a random ZImageTransformer2DModel (dim 128: 4 heads of 32, 1 refiner block each for noise,
               caption and SigLIP, 4 main blocks); 64 px = 8x8 latents in 16 tokens of 2x2 patches.
  3. data      demos/make_qwen_edit_base.py's pre-training edits at 64 px: one reference ("keep it",
               "make it <colour>", "turn it into a <shape>"), two references ("make the background the colour
               of picture 2"). Never the demo's edit (the shape in picture 2's colour).
  4. pretrain  train_flux_kontext.py itself (torchrun, 2 ranks) on that data from the init folder, VAE in bf16
               (the pipeline's references); its export/ is the base.
  5. package   copy the export (links resolved) into assets/z_image_edit_base and evaluate it.

    nice -n 10 python -m demos.make_z_image_edit_base        # all stages
    python -m demos.make_z_image_edit_base --stages=pretrain,package --pretrain_steps=4000

Everything but the final folder goes to --work_dir (default out/z_image_edit_base_build).
"""
from __future__ import annotations

import functools
import sys
import time
from pathlib import Path

import numpy as np
import torch

from demos import make_kontext_base as mkb
from demos import make_qwen_edit_base as mqb
from demos import qwen_edit_eval as qe
from demos import z_image_edit_eval as ze
from tools import shapes

ROOT = Path(__file__).resolve().parent.parent  # the repository root
ASSET_DIR = ROOT / "assets" / "z_image_edit_base"
SOURCE_VAE = ROOT / "assets" / "flux2_edit_base" / "vae"
IMAGE_SIZE = ze.IMAGE_SIZE  # 64

TRANSFORMER_CONFIG = dict(
    all_patch_size=(2,), all_f_patch_size=(1,), dim=128, n_layers=4, n_refiner_layers=1, n_heads=4, n_kv_heads=4,
    axes_dims=[8, 12, 12], axes_lens=[1024, 64, 64])  # head 32 = 8 + 12 + 12 rotary channels (frame, h, w)
PRETRAIN_ARGS = dict(  # train_flux_kontext.py overrides for the pre-training run
    precision="fp32", vae_dtype="bf16", resolution=IMAGE_SIZE, max_references=2,
    max_sequence_length=ze.MAX_SEQUENCE_LENGTH, cache_latents=True, batch_size=8, grad_accum=1, lr=1e-3,
    warmup_steps=100, weight_decay=0.0, max_grad_norm=1.0, ema_decay=0.999, export_dtype="bf16", num_sample_pairs=4,
    sample_steps=20, sample_guidance=0.0, save_every=500, log_every=50, val_every=0)  # 0: CFG off
PRETRAIN_STEPS = 4000


def log(msg):
    shapes.log(msg, tag="make_z_image_edit_base")


def train_vae(steps=0, seed=0):
    """The FLUX.2 base's trained VAE weights in an AutoencoderKL (no training: `steps` must be 0), with
    shift_factor / scaling_factor from its held-out latents. Returns the VAE and a report dict whose scores are
    of bf16 reconstructions."""
    from diffusers import AutoencoderKL, AutoencoderKLFlux2
    if steps:
        raise ValueError(f"--vae_steps={steps}: the Z-Image base reuses the FLUX.2 base's trained VAE; use 0")
    t0 = time.time()
    source = AutoencoderKLFlux2.from_pretrained(SOURCE_VAE, torch_dtype=torch.float32)
    c = source.config
    vae = AutoencoderKL(
        in_channels=c.in_channels, out_channels=c.out_channels, latent_channels=c.latent_channels,
        down_block_types=tuple(c.down_block_types), up_block_types=tuple(c.up_block_types),
        block_out_channels=tuple(c.block_out_channels), layers_per_block=c.layers_per_block,
        norm_num_groups=c.norm_num_groups, sample_size=c.sample_size, mid_block_add_attention=c.mid_block_add_attention,
        use_quant_conv=False, use_post_quant_conv=False)
    weights = source.state_dict()
    vae.load_state_dict({k: weights[k] for k in vae.state_dict()}, strict=True)  # all but the BatchNorm's
    vae.eval()
    held_out = mkb.shape_batch(np.random.default_rng(seed + 1), 256, size=IMAGE_SIZE)
    with torch.no_grad():
        z = torch.cat([vae.encode(held_out[i:i + 64]).latent_dist.mode() for i in range(0, 256, 64)])
        vae.register_to_config(shift_factor=round(float(z.mean()), 4), scaling_factor=round(1.0 / float(z.std()), 4))
        half = vae.to(torch.bfloat16)
        rec = torch.cat([half.decode(half.encode(held_out[i:i + 64].bfloat16()).latent_dist.mode()).sample.float()
                         for i in range(0, 256, 64)])
        vae = half.float()
    report = {"vae_source": str(SOURCE_VAE.relative_to(ROOT)), "vae_steps": 0,
              "vae_seconds": round(time.time() - t0, 1), "vae_psnr_db_bf16": round(mkb.psnr(rec, held_out), 2),
              "vae_shift_factor": vae.config.shift_factor, "vae_scaling_factor": vae.config.scaling_factor,
              **{f"vae_recon_{k}": v for k, v in mkb.recon_scores(rec, held_out).items()}}
    return vae, report


def make_init_folder(folder, vae, seed=0):
    """families/z_image/tiny.py's Omni folder (tokenizer, text encoder, SigLIP and its processor, scheduler, as
    it writes them) with the given VAE and a random transformer of TRANSFORMER_CONFIG."""
    from diffusers import ZImageOmniPipeline, ZImageTransformer2DModel
    from families.z_image.tiny import make_tiny_z_image
    return mkb.init_from_tiny(folder, functools.partial(make_tiny_z_image, omni=True), ZImageOmniPipeline,
                              lambda pipe: ZImageTransformer2DModel(
                                  **TRANSFORMER_CONFIG, in_channels=vae.config.latent_channels,
                                  cap_feat_dim=pipe.text_encoder.config.hidden_size,
                                  siglip_feat_dim=pipe.siglip.config.hidden_size), vae, seed)


def load_vae(folder):
    from diffusers import AutoencoderKL
    return AutoencoderKL.from_pretrained(folder, torch_dtype=torch.float32)


FAMILY = mkb.Family(
    name="z_image_edit_base", doc=__doc__, dest=ASSET_DIR, vae_steps=0, pretrain_steps=PRETRAIN_STEPS,
    pretrain_args=PRETRAIN_ARGS, train_vae=train_vae, load_vae=load_vae, make_init_folder=make_init_folder,
    write_data=lambda folder: qe.write_edits(folder, mqb.pretrain_scenes(size=IMAGE_SIZE), size=IMAGE_SIZE),
    retention_eval=lambda dest: ze.evaluate(dest, qe.load_rows(ze.ensure_task_data()["retention"]))[0], log=log)


def main(argv=None):
    return mkb.run_stages(FAMILY, argv)


if __name__ == "__main__":
    sys.exit(main())
