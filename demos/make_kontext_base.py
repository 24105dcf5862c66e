"""Rebuild assets/kontext_base/: the base tiny FLUX.1 Kontext model that the "make it blue" demo
fine-tunes (demos/kontext_eval.py has the task and its evaluation).

The folder has the full FLUX.1-Kontext diffusers layout (transformer/, vae/, text_encoder/,
tokenizer/, text_encoder_2/, tokenizer_2/, scheduler/, model_index.json) and loads with
FluxKontextPipeline.from_pretrained. It is built in five stages, each deterministic from its seed
and skipped when its output already exists (--force=1 redoes them):

  1. vae       a tiny AutoencoderKL (4x down, 8 latent channels) trained on 32x32 coloured-shape
               images (L1 + MSE + a small KL); then shift_factor / scaling_factor are set to the
               latents' mean and 1/std, as FLUX's VAE config does for its own latents.
  2. init      the pipeline folder: the tokenizers and random CLIP / T5 encoders (fp16) of
               tools/tiny_models.py, the trained VAE (fp16), a random FluxTransformer2DModel
               (hidden 128, 2 double + 2 single blocks, 8x8 latents packed into 16 tokens of 32
               channels), FLUX's scheduler; the T5 tokenizer's model_max_length is 8 (prompts
               are at most 7 tokens), which sets the T5 length of training and of the pipeline.
  3. data      the pre-training edits (6000 pairs): "keep it" (reconstruction), "make it <colour>"
               for every colour except blue, "turn it into a <shape>". Blue is never a target colour
               here, so "make it blue" is left for the fine-tune to learn.
  4. pretrain  train_flux_kontext.py itself (torchrun, 2 ranks) on that data from the init folder
               (the Kontext objective: flow matching on the target tokens, context tokens appended
               with ids (1, row, col)); its export/ is the base model.
  5. package   copy the export (links resolved) into assets/kontext_base and evaluate it.

    python -m demos.make_kontext_base                      # all stages; about 25 min on 2 CPU cores
    python -m demos.make_kontext_base --stages=pretrain,package --pretrain_steps=3000

Everything but the final folder goes to --work_dir (default out/kontext_base_build).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from demos import kontext_eval as ke
from tools import shapes
from tools.shapes import COLOURS, SHAPES, nearest_colour, to_tensor, to_uint8
from tools import tiny_models

ROOT = Path(__file__).resolve().parent.parent  # the repository root
ASSET_DIR = ROOT / "assets" / "kontext_base"
IMAGE_SIZE = ke.IMAGE_SIZE  # 32

VAE_CONFIG = dict(
    in_channels=3, out_channels=3, latent_channels=8, sample_size=IMAGE_SIZE,
    down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
    block_out_channels=(16, 32, 32), layers_per_block=1, norm_num_groups=8,
    use_quant_conv=False, use_post_quant_conv=False)
TRANSFORMER_CONFIG = dict(
    patch_size=1, in_channels=4 * VAE_CONFIG["latent_channels"], num_layers=2, num_single_layers=2,
    attention_head_dim=32, num_attention_heads=4, joint_attention_dim=32, pooled_projection_dim=32,
    guidance_embeds=True, axes_dims_rope=(8, 12, 12))  # rope axes sum to attention_head_dim

T5_LENGTH = 8  # tokenizer_2 model_max_length: T5 tokens per prompt (padding included), in training
#               (train_flux_kontext.py caps MAX_SEQUENCE_LENGTH at it) and in the pipeline
VAE_STEPS, VAE_BATCH, VAE_LR, VAE_KL = 1500, 32, 3e-3, 1e-4
PRETRAIN_PAIRS = 6000
PRETRAIN_MIX = {"keep": 0.2, "recolour": 0.5, "reshape": 0.3}
PRETRAIN_ARGS = dict(  # train_flux_kontext.py overrides for the pre-training run
    precision="fp32", resolution=IMAGE_SIZE, batch_size=8, grad_accum=1, lr=1e-3, warmup_steps=100,
    weight_decay=0.0, max_grad_norm=1.0, ema_decay=0.999, export_dtype="bf16", num_sample_pairs=4,
    sample_steps=20, sample_guidance=1.0, save_every=500, log_every=50)
PRETRAIN_STEPS = 3000
FROZEN_DTYPE = torch.float16  # storage dtype of the VAE and the text encoders in the shipped folder


def log(msg):
    shapes.log(msg, tag="make_kontext_base")


# ----------------------------------------------------------------------------------------------
# 1. VAE


def shape_batch(rng, n, size=IMAGE_SIZE) -> torch.Tensor:
    """(n, 3, size, size) in [-1, 1]: random scenes, as the task draws them (any colours)."""
    ims = [np.asarray(ke.draw(shapes.random_scene(rng, size), size=size)) for _ in range(n)]
    return to_tensor(np.stack(ims))


def psnr(a, b) -> float:
    mse = float(((a.clamp(-1, 1) - b) ** 2).mean())
    return 10 * math.log10(4.0 / mse)


def fit_vae(vae, draw, steps, lr, kl_weight, seed, log_every, log, warmup=50, pixel_weight=None, name="vae"):
    """The tiny bases' VAE recipe: `steps` AdamW steps on batches `draw(rng)` makes, L1 + MSE on a posterior
    sample plus kl_weight x KL per pixel, `warmup` steps then cosine to 0, grad clip 1; the VAE left in eval.
    `pixel_weight(x)`: a weight per pixel on the L1 + MSE (None: plain means)."""
    rng = np.random.default_rng(seed)
    opt = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (min(1.0, (s + 1) / warmup) if warmup else 1.0) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    gen = torch.Generator().manual_seed(seed)
    t0 = time.time()
    for step in range(steps):
        x = draw(rng)
        post = vae.encode(x).latent_dist
        z = post.mean + post.std * torch.randn(post.mean.shape, generator=gen)
        y = vae.decode(z).sample
        if pixel_weight is None:
            fit = (y - x).abs().mean() + ((y - x) ** 2).mean()
        else:
            err = y - x
            fit = (pixel_weight(x) * (err.abs() + err ** 2)).mean()
        loss = fit + kl_weight * post.kl().mean() / x[0].numel()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        sched.step()
        if log_every and (step % log_every == 0 or step == steps - 1):
            log(f"{name} step {step}: loss {loss.item():.4f}, {time.time() - t0:.0f}s")
    vae.eval()
    return vae


def train_vae(steps=VAE_STEPS, batch=VAE_BATCH, lr=VAE_LR, kl_weight=VAE_KL, seed=0, log_every=100):
    """A tiny AutoencoderKL trained on shape images: L1 + MSE on a posterior sample, plus
    kl_weight x KL per pixel; AdamW, 50 warmup steps then cosine to 0, grad clip 1. Returns the
    VAE with shift_factor / scaling_factor set from its latents, and a report dict."""
    from diffusers import AutoencoderKL
    torch.manual_seed(seed)
    vae = AutoencoderKL(**VAE_CONFIG)
    held_out = shape_batch(np.random.default_rng(seed + 1), 256)
    t0 = time.time()
    fit_vae(vae, lambda rng: shape_batch(rng, batch), steps, lr, kl_weight, seed, log_every, log)
    with torch.no_grad():
        z = torch.cat([vae.encode(held_out[i:i + 64]).latent_dist.mode() for i in range(0, 256, 64)])
        shift, std = float(z.mean()), float(z.std())
        vae.register_to_config(shift_factor=round(shift, 4), scaling_factor=round(1.0 / std, 4))
        vae = vae.to(FROZEN_DTYPE).float()  # measure what is shipped: fp16-rounded weights
        rec = torch.cat([vae.decode(vae.encode(held_out[i:i + 64]).latent_dist.mode()).sample
                         for i in range(0, 256, 64)])
    report = {"vae_steps": steps, "vae_seconds": round(time.time() - t0, 1),
              "vae_psnr_db": round(psnr(rec, held_out), 2),
              "vae_shift_factor": vae.config.shift_factor, "vae_scaling_factor": vae.config.scaling_factor,
              **{f"vae_recon_{k}": v for k, v in recon_scores(rec, held_out).items()}}
    return vae, report


def recon_scores(rec, ref) -> dict:
    """The task metrics of VAE reconstructions against their inputs (an upper bound for any
    model that decodes through this VAE): colour accuracy and mean IoU of the foreground."""
    scores = []
    for out, img in zip(to_uint8(rec), to_uint8(ref)):
        bg = nearest_colour(ke.mode_colour(img))
        colour = nearest_colour(np.median(img[ke.foreground_mask(img, bg)].astype(np.float64), axis=0))
        scores.append(ke.score_edit(out, img, bg, colour))
    m = ke.summarize(scores)
    return {"colour_acc": round(m["colour_acc"], 1), "iou": round(m["iou"], 3), "success": round(m["success"], 1)}


# ----------------------------------------------------------------------------------------------
# 2. init folder


def make_init_folder(folder, vae, seed=0):
    """The pre-training start: tools/tiny_models.py's FLUX.1-Kontext folder (tokenizers, CLIP, T5,
    scheduler, as tiny_models writes them) with the trained VAE and a random transformer of
    TRANSFORMER_CONFIG; VAE and text encoders stored in FROZEN_DTYPE."""
    from diffusers import FluxKontextPipeline, FluxTransformer2DModel
    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tiny_models.make_tiny_flux_kontext(tmp, seed=seed)
    shutil.rmtree(tmp / "tokenizer_2")
    tiny_models.write_t5_tokenizer(tmp / "tokenizer_2", max_length=T5_LENGTH)
    pipe = FluxKontextPipeline.from_pretrained(tmp, torch_dtype=torch.float32)
    with tiny_models.seeded(seed + 2):
        transformer = FluxTransformer2DModel(**TRANSFORMER_CONFIG)
    pipe.transformer = transformer
    pipe.register_modules(transformer=transformer, vae=vae.to(FROZEN_DTYPE))
    pipe.text_encoder.to(FROZEN_DTYPE)
    pipe.text_encoder_2.to(FROZEN_DTYPE)
    shutil.rmtree(tmp)
    pipe.save_pretrained(tmp, safe_serialization=True)
    shutil.rmtree(folder, ignore_errors=True)
    os.rename(tmp, folder)
    return folder


def init_from_tiny(folder, write_tiny, pipeline_class, make_transformer, vae, seed=0):
    """A tiny builder's folder (`write_tiny(tmp, seed=seed)`: its tokenizers, text encoders, scheduler as it writes
    them) loaded with `pipeline_class`, its VAE replaced by `vae` and its transformer by `make_transformer(pipe)`
    built under seed + 3; saved as `folder` (replacing it). The FLUX.2 and Z-Image bases' init stage."""
    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    write_tiny(tmp, seed=seed)
    pipe = pipeline_class.from_pretrained(tmp, torch_dtype=torch.float32)
    with tiny_models.seeded(seed + 3):
        transformer = make_transformer(pipe)
    pipe.register_modules(transformer=transformer, vae=vae)
    out = folder.with_name(folder.name + ".out")
    shutil.rmtree(out, ignore_errors=True)
    with tiny_models._quiet_logs():
        pipe.save_pretrained(out, safe_serialization=True)
    shutil.rmtree(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    os.rename(out, folder)
    return folder


# ----------------------------------------------------------------------------------------------
# 3. pre-training data


def pretrain_scenes(n=PRETRAIN_PAIRS, seed=10):
    """Deterministic mixed edits: keep / recolour (never to blue) / reshape, as write_pairs rows."""
    rng = np.random.default_rng(seed)
    kinds, probs = list(PRETRAIN_MIX), np.array(list(PRETRAIN_MIX.values()))
    out = []
    for _ in range(n):
        shape, colour, background, box = shapes.random_scene(rng, IMAGE_SIZE)
        d = {"shape": shape, "colour": colour, "background": background, "box": list(box)}
        kind = kinds[rng.choice(len(kinds), p=probs / probs.sum())]
        if kind == "keep":
            d.update(target_colour=colour, prompt="keep it")
        elif kind == "recolour":
            choices = [c for c in COLOURS if c not in (ke.TASK_COLOUR, colour, background)]
            new = str(choices[rng.integers(len(choices))])
            d.update(target_colour=new, prompt=f"make it {new}")
        else:
            new = str([s for s in SHAPES if s != shape][rng.integers(len(SHAPES) - 1)])
            d.update(target_colour=colour, target_shape=new, prompt=f"turn it into a {new}")
        out.append(d)
    return out


# ----------------------------------------------------------------------------------------------
# 4. pre-training through train_flux_kontext.py


def pretrain_command(init, data, out, steps, nproc, pretrain_args, overrides) -> list[str]:
    """The torchrun command of train_flux_kontext.py that pre-trains the init folder on `data`: the
    family's `pretrain_args`, then the user's `overrides`."""
    args = {**pretrain_args, **overrides, "max_steps": steps, "sample_every": steps,
            "model_path": str(init), "data_path": str(data), "output_dir": str(out)}
    return ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
             str(ROOT / "train_flux_kontext.py")] + [f"--{k}={v}" for k, v in args.items()])


# ----------------------------------------------------------------------------------------------
# 5. package


def package(export, dest=ASSET_DIR):
    """Copy the export (symlinked frozen parts resolved) into `dest`, atomically, with no path of
    this machine in any JSON (the frozen parts' configs still name the build folders they were
    saved from)."""
    from components.export import portable_json
    dest = Path(dest)
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(export, tmp, symlinks=False)
    for path in [tmp / "model_index.json", *tmp.glob("*/config.json")]:
        portable_json(str(path))
    shutil.rmtree(dest, ignore_errors=True)
    os.rename(tmp, dest)
    return dest


def relative_command(args) -> str:
    """A command line for BUILD.json with the repository's paths made relative to its root, so
    the record names no machine and replays from the root of any checkout."""
    root = str(ROOT) + os.sep
    return " ".join(a.replace(root, "") for a in args)


def folder_mib(folder) -> float:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file()) / 2**20


# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Family:
    """What a tiny editing base needs of its family for the five stages (run_stages)."""
    name: str  # for the work folder: out/<name>_build
    doc: str  # the builder module's docstring: its first paragraph is --help's description
    dest: Path  # the shipped folder
    vae_steps: int
    pretrain_steps: int
    pretrain_args: dict  # train_flux_kontext.py overrides of the pre-training run
    train_vae: Callable  # (steps) -> (vae, report)
    load_vae: Callable  # (folder) -> the trained VAE, fp32
    make_init_folder: Callable  # (folder, vae)
    write_data: Callable  # (folder) -> writes the pre-training data.jsonl there
    retention_eval: Callable  # (packaged folder) -> metrics of its named-colour recolours
    log: Callable


def run_stages(family: Family, argv=None) -> int:
    """The five stages (vae, init, data, pretrain, package) of a tiny editing base: each skipped when
    its output exists (--force=1 redoes it), all but the package under --work_dir; BUILD.json records
    the report (VAE scores, pre-training command and time, size, retention)."""
    log = family.log
    p = argparse.ArgumentParser(description=family.doc.split("\n\n")[0])
    p.add_argument("--stages", default="vae,init,data,pretrain,package")
    p.add_argument("--work_dir", default=str(ROOT / "out" / f"{family.name}_build"))
    p.add_argument("--dest", default=str(family.dest))
    p.add_argument("--force", type=int, default=0, help="redo stages whose output exists")
    p.add_argument("--vae_steps", type=int, default=family.vae_steps)
    p.add_argument("--pretrain_steps", type=int, default=family.pretrain_steps)
    p.add_argument("--nproc", type=int, default=2, help="ranks of the pre-training run")
    p.add_argument("--threads", type=int, default=1, help="torch threads (VAE) / OMP threads per rank")
    p.add_argument("--train_arg", action="append", default=[], metavar="NAME=VALUE",
                   help="extra train_flux_kontext.py override for the pre-training run (repeatable)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    stages = args.stages.split(",")
    report_path = work / "report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else {}

    def save_report():
        report_path.write_text(json.dumps(report, indent=1))

    vae_file = work / "vae"
    if "vae" in stages and (args.force or not (vae_file / "config.json").exists()):
        vae, rep = family.train_vae(steps=args.vae_steps)
        vae.save_pretrained(vae_file, safe_serialization=True)
        report.update(rep)
        save_report()
        log(f"vae: {rep}")
    init = work / "init"
    if "init" in stages and (args.force or not (init / "model_index.json").exists()):
        family.make_init_folder(init, family.load_vae(vae_file))
        log(f"init folder: {init} ({folder_mib(init):.2f} MiB)")
    data = work / "pretrain_data" / "data.jsonl"
    if "data" in stages and (args.force or not data.exists()):
        shutil.rmtree(data.parent, ignore_errors=True)
        family.write_data(data.parent)
        log(f"pre-training data: {data}")
    out = work / "pretrain"
    if "pretrain" in stages and (args.force or not (out / "export" / "model_index.json").exists()):
        overrides = dict(a.split("=", 1) for a in args.train_arg)
        cmd = pretrain_command(init, data, out, args.pretrain_steps, args.nproc, family.pretrain_args, overrides)
        log("pre-training: " + " ".join(cmd))
        t0, cpu0 = time.time(), os.times()
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        subprocess.run(cmd, check=True, env=env, cwd=ROOT)
        cpu1 = os.times()
        report.update(pretrain_steps=args.pretrain_steps, pretrain_seconds=round(time.time() - t0, 1),
                      pretrain_cpu_seconds=round(cpu1.children_user + cpu1.children_system
                                                 - cpu0.children_user - cpu0.children_system, 1),
                      pretrain_command=relative_command(cmd[2:]))
        save_report()
    if "package" in stages:
        dest = package(out / "export", args.dest)
        report["size_mib"] = round(folder_mib(dest), 2)
        log(f"packaged {dest} ({report['size_mib']} MiB); evaluating")
        metrics = family.retention_eval(str(dest))
        report["retention_eval"] = {k: v for k, v in metrics.items() if k != "pairs"}
        save_report()
        (Path(dest) / "BUILD.json").write_text(json.dumps(report, indent=1))
        log(json.dumps(report, indent=1))
    return 0


def load_vae(folder):
    from diffusers import AutoencoderKL
    return AutoencoderKL.from_pretrained(folder, torch_dtype=torch.float32)


FAMILY = Family(
    name="kontext_base", doc=__doc__, dest=ASSET_DIR, vae_steps=VAE_STEPS, pretrain_steps=PRETRAIN_STEPS,
    pretrain_args=PRETRAIN_ARGS, train_vae=train_vae, load_vae=load_vae, make_init_folder=make_init_folder,
    write_data=lambda folder: ke.write_pairs(folder, pretrain_scenes()),
    retention_eval=lambda dest: ke.evaluate(dest, ke.load_rows(ke.ensure_task_data()["retention"]))[0], log=log)


def main(argv=None):
    return run_stages(FAMILY, argv)


if __name__ == "__main__":
    sys.exit(main())
