"""Rebuild assets/qwen_edit_base/: the base tiny Qwen-Image-Edit-2509 model that the two-reference
demo fine-tunes (demos/qwen_edit_eval.py has the task and its evaluation).

The folder has the QwenImageEditPlusPipeline diffusers layout (transformer/, vae/, text_encoder/,
tokenizer/, processor/, scheduler/, model_index.json) and loads with from_pretrained (the processor
through families.qwen_image.load_processor where torchvision is missing). Built in five stages, as
demos/make_kontext_base.py builds the Kontext base, each deterministic from its seed and skipped when
its output exists (--force=1 redoes them):

  1. vae       a tiny AutoencoderKLQwenImage (4x down: 2 downsamplings, 8 latent channels) trained
               on 32x32 coloured-shape images (L1 + MSE + a small KL); latents_mean / latents_std
               then set to its latents' per-channel mean and std, as the real VAE's config has them.
  2. init      tools/tiny_models.py's Qwen-Image-Edit-2509 folder (its Qwen2 tokenizer, processor,
               random Qwen2.5-VL text encoder, Qwen-Image's scheduler) with the trained VAE and a
               random QwenImageTransformer2DModel (hidden 128: 4 heads of 32, 3 blocks); 32 px =
               8x8 latents packed into 16 tokens of 32 channels, each reference 16 more.
  3. data      the pre-training edits (PRETRAIN_PAIRS): one reference: "keep it",
               "make it <colour>", "turn it into a <shape>"; two references: "make the background
               the colour of picture 2" (picture 2 a colour swatch). Never the demo's edit (the
               shape in picture 2's colour): the base reads a colour from picture 2 and recolours
               shapes by name, the fine-tune has to join the two.
  4. pretrain  train_flux_kontext.py itself (torchrun, 2 ranks) on that data from the init folder,
               both reference areas at 32^2 (REFERENCE_AREA, CONDITION_AREA); its export/ is the base.
  5. package   copy the export (links resolved) into assets/qwen_edit_base and evaluate it.

    nice -n 10 python -m demos.make_qwen_edit_base        # all stages; about 22 CPU minutes on 2 cores
    python -m demos.make_qwen_edit_base --stages=pretrain,package --pretrain_steps=4000

Everything but the final folder goes to --work_dir (default out/qwen_edit_base_build).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

from demos import make_kontext_base as mkb
from demos import qwen_edit_eval as qe
from tools import shapes
from tools.shapes import COLOURS, SHAPES
from tools import tiny_models

ROOT = Path(__file__).resolve().parent.parent  # the repository root
ASSET_DIR = ROOT / "assets" / "qwen_edit_base"
IMAGE_SIZE = qe.IMAGE_SIZE  # 32

Z_DIM = 8
VAE_CONFIG = dict(base_dim=8, z_dim=Z_DIM, dim_mult=[1, 2, 2], num_res_blocks=1,
                  temperal_downsample=[False, True])  # 2 spatial downsamplings: 4x, 32 px -> 8x8 latents
TRANSFORMER_CONFIG = dict(
    patch_size=2, in_channels=4 * Z_DIM, out_channels=Z_DIM, num_layers=3, attention_head_dim=32,
    num_attention_heads=4, guidance_embeds=False, axes_dims_rope=(8, 12, 12))  # rope axes sum to the head dim
VAE_STEPS, VAE_BATCH, VAE_LR, VAE_KL = 1600, 24, 3e-3, 1e-4
PRETRAIN_PAIRS = 3000
PRETRAIN_MIX = {"keep": 0.1, "recolour": 0.4, "reshape": 0.2, "background": 0.3}
PRETRAIN_ARGS = dict(  # train_flux_kontext.py overrides for the pre-training run
    precision="fp32", resolution=IMAGE_SIZE, reference_area=IMAGE_SIZE**2, condition_area=IMAGE_SIZE**2,
    max_references=2, cache_latents=True, batch_size=8, grad_accum=1, lr=1e-3, warmup_steps=100,
    weight_decay=0.0, max_grad_norm=1.0, ema_decay=0.999, export_dtype="bf16", num_sample_pairs=4,
    sample_steps=20, sample_guidance=1.0, save_every=500, log_every=50, val_every=0)
PRETRAIN_STEPS = 4000


def log(msg):
    shapes.log(msg, tag="make_qwen_edit_base")


# ----------------------------------------------------------------------------------------------
# 1. VAE


def train_vae(steps=VAE_STEPS, batch=VAE_BATCH, lr=VAE_LR, kl_weight=VAE_KL, seed=0, log_every=100):
    """make_kontext_base.train_vae's recipe for AutoencoderKLQwenImage (one-frame videos): L1 + MSE
    on a posterior sample plus kl_weight x KL per pixel, AdamW, 50 warmup steps then cosine, clip 1.
    Returns the VAE with latents_mean / latents_std of its held-out latents, and a report dict."""
    from diffusers import AutoencoderKLQwenImage
    torch.manual_seed(seed)
    vae = AutoencoderKLQwenImage(**VAE_CONFIG, latents_mean=[0.0] * Z_DIM, latents_std=[1.0] * Z_DIM)
    held_out = mkb.shape_batch(np.random.default_rng(seed + 1), 256)[:, :, None]
    t0 = time.time()
    mkb.fit_vae(vae, lambda rng: mkb.shape_batch(rng, batch)[:, :, None], steps, lr, kl_weight, seed, log_every, log)
    with torch.no_grad():
        z = torch.cat([vae.encode(held_out[i:i + 64]).latent_dist.mode() for i in range(0, 256, 64)])
        mean, std = z.mean(dim=(0, 2, 3, 4)), z.std(dim=(0, 2, 3, 4))
        vae.register_to_config(latents_mean=[round(float(v), 4) for v in mean],
                               latents_std=[round(float(v), 4) for v in std])
        rec = torch.cat([vae.decode(vae.encode(held_out[i:i + 64]).latent_dist.mode()).sample
                         for i in range(0, 256, 64)])[:, :, 0]
    held_out = held_out[:, :, 0]
    report = {"vae_steps": steps, "vae_seconds": round(time.time() - t0, 1),
              "vae_psnr_db": round(mkb.psnr(rec, held_out), 2),
              **{f"vae_recon_{k}": v for k, v in mkb.recon_scores(rec, held_out).items()}}
    return vae, report


# ----------------------------------------------------------------------------------------------
# 2. init folder


def make_init_folder(folder, vae, seed=0):
    """tools/tiny_models.py's Qwen-Image-Edit-2509 folder (tokenizer, processor, text encoder,
    scheduler, as it writes them) with the trained VAE and a random transformer of
    TRANSFORMER_CONFIG (its text width the text encoder's)."""
    from diffusers import QwenImageEditPlusPipeline, QwenImageTransformer2DModel
    from families.qwen_image import load_processor
    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tiny_models.make_tiny_qwen_image_edit(tmp, seed=seed)
    processor = load_processor(tmp / "processor")
    pipe = QwenImageEditPlusPipeline.from_pretrained(tmp, processor=processor, torch_dtype=torch.float32)
    with tiny_models.seeded(seed + 3):
        transformer = QwenImageTransformer2DModel(
            **TRANSFORMER_CONFIG, joint_attention_dim=pipe.text_encoder.config.text_config.hidden_size)
    pipe.register_modules(transformer=transformer, vae=vae)
    keep = tmp.with_name(tmp.name + ".processor")
    shutil.rmtree(keep, ignore_errors=True)
    shutil.copytree(tmp / "processor", keep)  # written directly by tiny_models (see its _write_qwen_processor)
    shutil.rmtree(tmp)
    pipe.processor = None  # saved from `keep`: a processor without torchvision cannot save itself
    pipe.register_modules(processor=None)
    with tiny_models._quiet_logs():
        pipe.save_pretrained(tmp, safe_serialization=True)
    shutil.move(keep, tmp / "processor")
    index = json.loads((tmp / "model_index.json").read_text())
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    (tmp / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    shutil.rmtree(folder, ignore_errors=True)
    os.rename(tmp, folder)
    return folder


# ----------------------------------------------------------------------------------------------
# 3. pre-training data


def pretrain_scenes(n=PRETRAIN_PAIRS, seed=10, size=IMAGE_SIZE):
    """Deterministic mixed edits at `size` px as qwen_edit_eval.write_edits rows: keep / recolour / reshape
    (one reference) and the background in picture 2's colour (two references)."""
    rng = np.random.default_rng(seed)
    kinds, probs = list(PRETRAIN_MIX), np.array(list(PRETRAIN_MIX.values()))
    out = []
    for _ in range(n):
        shape, colour, background, box = shapes.random_scene(rng, size)
        d = {"shape": shape, "colour": colour, "background": background, "box": list(box)}
        kind = kinds[rng.choice(len(kinds), p=probs / probs.sum())]
        others = [c for c in COLOURS if c not in (colour, background)]
        if kind == "keep":
            d.update(target_colour=colour, prompt="keep it")
        elif kind == "recolour":
            new = str(others[rng.integers(len(others))])
            d.update(target_colour=new, prompt=f"make it {new}")
        elif kind == "reshape":
            new = str([s for s in SHAPES if s != shape][rng.integers(len(SHAPES) - 1)])
            d.update(target_colour=colour, target_shape=new, prompt=f"turn it into a {new}")
        else:
            new = str(others[rng.integers(len(others))])
            d.update(target_colour=colour, target_background=new, swatch=new,
                     prompt="make the background the colour of picture 2")
        out.append(d)
    return out


# ----------------------------------------------------------------------------------------------


def load_vae(folder):
    from diffusers import AutoencoderKLQwenImage
    return AutoencoderKLQwenImage.from_pretrained(folder, torch_dtype=torch.float32)


FAMILY = mkb.Family(
    name="qwen_edit_base", doc=__doc__, dest=ASSET_DIR, vae_steps=VAE_STEPS, pretrain_steps=PRETRAIN_STEPS,
    pretrain_args=PRETRAIN_ARGS, train_vae=train_vae, load_vae=load_vae, make_init_folder=make_init_folder,
    write_data=lambda folder: qe.write_edits(folder, pretrain_scenes()),
    retention_eval=lambda dest: qe.evaluate(dest, qe.load_rows(qe.ensure_task_data()["retention"]))[0], log=log)


def main(argv=None):
    return mkb.run_stages(FAMILY, argv)


if __name__ == "__main__":
    sys.exit(main())
