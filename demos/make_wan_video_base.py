"""Rebuild assets/wan_video_base/: the tiny Wan 2.1 text-to-video teacher that demos/demo_dmd_video.sh distils
(demos/video_eval.py has the task, "a red or blue square moving left", and its scorer). A WanPipeline folder
(transformer/, vae/, text_encoder/, tokenizer/, scheduler/, model_index.json) that loads with
WanPipeline.from_pretrained and samples 9 frames at 32 px. Built offline on CPU in four stages, each deterministic
from its seed and skipped when its output exists (--force=1 redoes them):

  1. vae       an AutoencoderKLWan (4x down in space, 4x in time: 9 x 32 x 32 -> 3 x 8 x 8 latents of Z_DIM
               channels) trained on the tiny world's clips (world(): a shape of one of VAE_COLOURS, any shape and
               direction, random starts; the task draws 4 of those colours): VAE_STEPS of the image
               bases' recipe (L1 + MSE + a small KL), then FG_STEPS with the shape's pixels weighted; latents_mean
               / latents_std then set to its latents' per-channel mean and std.
               Its reconstructions are scored with the task's scorer (a VAE that cannot keep colour, shape and
               path would cap every model's validity).
  2. latents   CLIPS_PER_PROMPT clips of each training prompt, encoded (the posterior's mode, normalised as the
               pipeline does); the prompts' UMT5 embeddings (a random 2-layer UMT5 and a Unigram tokenizer with
               the task's words, families/wan/tiny.py's) as WanPipeline.encode_prompt makes them, at
               video_eval.TEXT_LENGTH (32) tokens.
  3. pretrain  a random WanTransformer3DModel of TRANSFORMER_CONFIG trained by flow matching as WanPipeline samples
               it: x_t = (1 - σ) x0 + σ ε, target ε - x0, timestep σ·1000, σ = the scheduler's flow_shift (3;
               --train_shift another) applied to u ~ U(0, 1); CAPTION_DROPOUT of the prompts "" (the pipeline's
               negative); AdamW, warmup then cosine, EMA. The EMA weights are the teacher.
  4. package   the WanPipeline folder (the real repo's UniPC scheduler config) into assets/wan_video_base,
               then its 28- and 4-step samples of the held-out prompts scored.

    nice -n 10 python -m demos.make_wan_video_base        # all stages; times printed per stage
    python -m demos.make_wan_video_base --vae_from=assets/wan_video_base  # the shipped VAE kept (stage 1 skipped)
    python -m demos.make_wan_video_base --stages=pretrain,package --pretrain_steps=3000 --force=1
    # pre-training continued from a built teacher (its weights; a new warmup, cosine and EMA) into another folder:
    python -m demos.make_wan_video_base --vae_from=assets/wan_video_base --init_from=assets/wan_video_base \
        --work_dir=out/wan_more --dest=out/wan_more/base

Everything but the final folder goes to --work_dir (default out/wan_video_base_build).
"""
from __future__ import annotations

import argparse
import copy
import itertools
import json
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

from demos import video_eval as ve
from tools import shapes

ROOT = Path(__file__).resolve().parent.parent  # the repository root
ASSET_DIR = ROOT / "assets" / "wan_video_base"
Z_DIM = 16  # 8 channels blur the shapes' edges past the scorer's reading (triangles read as circles)
VAE_CONFIG = dict(base_dim=8, z_dim=Z_DIM, dim_mult=[1, 2, 2], num_res_blocks=1, temperal_downsample=[True, True],
                  scale_factor_spatial=4, scale_factor_temporal=4)  # 2 downsamplings in space and time
VAE_STEPS, VAE_BATCH, VAE_LR, VAE_KL = 600, 8, 2e-3, 1e-4
# then FG_STEPS more with the shape's pixels weighted FG_WEIGHT x (the shape is 12 % of a frame: the plain recipe
# leaves its colour off, red read as orange, green as purple)
FG_STEPS, FG_LR, FG_WEIGHT = 1000, 1.5e-3, 8.0
TEXT_CONFIG = dict(d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2, relative_attention_num_buckets=8,
                   feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
TRANSFORMER_CONFIG = dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=32, in_channels=Z_DIM,
                          out_channels=Z_DIM, text_dim=TEXT_CONFIG["d_model"], freq_dim=64, ffn_dim=512, num_layers=4,
                          cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=64)
# The VAE learns the tiny world's clips, wider than the task: a shape of one of 8 colours, any shape and direction,
# from any start (the task draws 4 of these colours)
VAE_COLOURS = ("red", "green", "blue", "yellow", "purple", "orange", "pink", "cyan")
CLIPS_PER_PROMPT = 48
PRETRAIN_STEPS, PRETRAIN_BATCH, PRETRAIN_LR, WARMUP, EMA = 10000, 32, 1e-3, 100, 0.998
CAPTION_DROPOUT = 0.1
TASK_WORDS = ve.COLOURS + ve.SHAPES + tuple(ve.DIRECTIONS) + ("a", "or", "moving")


def log(msg):
    shapes.log(msg, tag="make_wan_video_base")


def clips_tensor(clips: np.ndarray) -> torch.Tensor:
    """(N, T, H, W, 3) uint8 -> (N, 3, T, H, W) float in [-1, 1], the VAE's input."""
    return torch.from_numpy(clips).permute(0, 4, 1, 2, 3).float() / 127.5 - 1.0


def to_uint8(video: torch.Tensor) -> np.ndarray:
    """(N, 3, T, H, W) in [-1, 1] -> (N, T, H, W, 3) uint8."""
    return ((video.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 4, 1).numpy()


# ----------------------------------------------------------------------------------------------
# 1. VAE


def fit_foreground(vae, draw, steps, lr, kl_weight, seed, log_every):
    """make_kontext_base.fit_vae with each pixel weighted 1 + FG_WEIGHT where it differs from the white background,
    cosine from lr to 0 without warmup; the VAE left in eval."""
    from demos import make_kontext_base as mkb

    def weight(x):
        return 1 + FG_WEIGHT * ((x - x.amax()).abs().amax(dim=1, keepdim=True) > 0.05).float()
    return mkb.fit_vae(vae.train(), draw, steps, lr, kl_weight, seed, log_every, log, warmup=0, pixel_weight=weight,
                       name="vae foreground")


def world():
    """The VAE's clips as (colour, shape, direction): the 64 it trains on and the 32 whose latents set latents_mean /
    latents_std, split as (colour + shape + direction) % 3 (it trains on all 96)."""
    train, held = [], []
    for (ci, c), (si, s), (di, d) in itertools.product(enumerate(VAE_COLOURS), enumerate(ve.SHAPES),
                                                       enumerate(ve.DIRECTIONS)):
        (held if (ci + si + di) % 3 == 0 else train).append((c, s, d))
    return train, held


def render_world(items, rng) -> np.ndarray:
    """(N, frames, SIZE, SIZE, 3) uint8: each (colour, shape, direction) from a random start."""
    return np.stack([ve.render(ve.prompt_for((c, c), s, d), ve.random_start(rng, d), c) for c, s, d in items])


def train_vae(steps=VAE_STEPS, batch=VAE_BATCH, lr=VAE_LR, kl_weight=VAE_KL, seed=0, log_every=100, phase1=None):
    """The image bases' VAE recipe (demos/make_kontext_base.fit_vae) on batches of the world's clips, then FG_STEPS
    of fit_foreground; `phase1`: a folder of the first phase's VAE (saved there when missing).
    Returns the VAE with latents_mean / latents_std of held-out latents, and a report with its reconstructions'
    PSNR and task scores (the task's held-out prompts, 8 clips each)."""
    from diffusers import AutoencoderKLWan

    from demos import make_kontext_base as mkb
    items = sum(world(), [])

    def draw(rng):
        return clips_tensor(render_world([items[i] for i in rng.integers(0, len(items), batch)], rng))

    t0 = time.time()
    if phase1 and (Path(phase1) / "config.json").exists():
        vae = AutoencoderKLWan.from_pretrained(phase1, torch_dtype=torch.float32)
    else:
        torch.manual_seed(seed)
        vae = AutoencoderKLWan(**VAE_CONFIG, latents_mean=[0.0] * Z_DIM, latents_std=[1.0] * Z_DIM)
        mkb.fit_vae(vae, draw, steps, lr, kl_weight, seed, log_every, log)
        if phase1:
            vae.save_pretrained(phase1)
    fit_foreground(vae, draw, FG_STEPS, FG_LR, kl_weight, seed + 3, log_every)
    held = render_world([item for item in world()[1] for _ in range(4)], np.random.default_rng(seed + 1))
    with torch.no_grad():
        z = torch.cat([vae.encode(clips_tensor(held[i:i + 32])).latent_dist.mode() for i in range(0, len(held), 32)])
        mean, std = z.mean(dim=(0, 2, 3, 4)), z.std(dim=(0, 2, 3, 4))
        vae.register_to_config(latents_mean=[round(float(v), 4) for v in mean],
                               latents_std=[round(float(v), 4) for v in std])
    report = {"vae_steps": steps, "vae_seconds": round(time.time() - t0, 1), **score_vae(vae, seed + 1)}
    return vae, report


def score_vae(vae, seed=1) -> dict:
    """The PSNR and task scores of the VAE's reconstructions of the task's held-out prompts, 8 clips each."""
    from demos import make_kontext_base as mkb
    prompts = [p for p in ve.splits()[1] for _ in range(8)]
    with torch.no_grad():
        x = clips_tensor(ve.render_batch(prompts, np.random.default_rng(seed)))
        rec = torch.cat([vae.decode(vae.encode(x[i:i + 32]).latent_dist.mode()).sample for i in range(0, len(x), 32)])
    scores = ve.score_clips(to_uint8(rec), prompts)
    return {"vae_psnr_db": round(mkb.psnr(rec, x), 2), **{f"vae_recon_{k}": round(v, 2) for k, v in scores.items()}}


# ----------------------------------------------------------------------------------------------
# 2. the pipeline's parts and the cached training latents and text


def make_parts(work, vae, seed=0):
    """The tokenizer (task words whole), a random UMT5 encoder, a random transformer, the scheduler: a WanPipeline
    with the trained VAE."""
    from diffusers import UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from families.tiny.models import seeded
    from families.tiny.tokenizers import WORDS
    from families.wan import tiny
    tokenizer = tiny.write_umt5_tokenizer(Path(work) / "tokenizer", words=tuple(dict.fromkeys(WORDS + TASK_WORDS)))
    with seeded(seed + 1):
        text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), **TEXT_CONFIG)).eval()
    with seeded(seed + 2):
        transformer = WanTransformer3DModel(**TRANSFORMER_CONFIG)
    return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                       scheduler=UniPCMultistepScheduler(**tiny.SCHEDULER))


def encode_text(pipe, prompts):
    with torch.no_grad():
        embeds, _ = pipe.encode_prompt(prompt=list(prompts), do_classifier_free_guidance=False,
                                       max_sequence_length=ve.TEXT_LENGTH)
    return embeds


def make_latents(pipe, per_prompt=CLIPS_PER_PROMPT, seed=20):
    """(latents (N, Z, 3, 8, 8) normalised as WanPipeline's, prompt index per clip, text embeds (P + 1, TEXT_LENGTH, D):
    the training prompts then "")."""
    train = ve.splits()[0]
    rng = np.random.default_rng(seed)
    vae = pipe.vae
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    index = np.repeat(np.arange(len(train)), per_prompt)
    out = []
    with torch.no_grad():
        for i in range(0, len(index), 64):
            x = clips_tensor(ve.render_batch([train[j] for j in index[i:i + 64]], rng))
            out.append((vae.encode(x).latent_dist.mode() - mean) / std)
    return torch.cat(out), torch.from_numpy(index), encode_text(pipe, train + [ve.NEGATIVE])


# ----------------------------------------------------------------------------------------------
# 3. flow-matching pre-training


def pretrain(transformer, latents, index, text, steps=PRETRAIN_STEPS, batch=PRETRAIN_BATCH, lr=PRETRAIN_LR,
             shift=3.0, seed=0, log_every=100):
    """Flow matching as WanPipeline samples: σ = shift·u / (1 + (shift - 1)·u), u ~ U(0, 1); returns the EMA."""
    gen = torch.Generator().manual_seed(seed)
    ema = copy.deepcopy(transformer).eval().requires_grad_(False)
    opt = torch.optim.AdamW(transformer.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / WARMUP) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    uncond = len(text) - 1
    t0, running = time.time(), 0.0
    transformer.train()
    for step in range(steps):
        pick = torch.randint(0, len(latents), (batch,), generator=gen)
        x0 = latents[pick]
        which = index[pick].clone()
        which[torch.rand(batch, generator=gen) < CAPTION_DROPOUT] = uncond
        u = torch.rand(batch, generator=gen)
        sigma = shift * u / (1 + (shift - 1) * u)
        noise = torch.randn(x0.shape, generator=gen)
        s = sigma.view(-1, 1, 1, 1, 1)
        xt = (1 - s) * x0 + s * noise
        v = transformer(hidden_states=xt, timestep=sigma * 1000, encoder_hidden_states=text[which],
                        return_dict=False)[0]
        loss = ((v - (noise - x0)) ** 2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)
        opt.step()
        sched.step()
        with torch.no_grad():
            for e, p in zip(ema.parameters(), transformer.parameters()):
                e.lerp_(p, 1 - EMA)
        running += loss.item()
        if log_every and ((step + 1) % log_every == 0 or step == steps - 1):
            log(f"pretrain step {step + 1}: loss {running / log_every:.4f}, {time.time() - t0:.0f}s")
            running = 0.0
    return ema


# ----------------------------------------------------------------------------------------------


def folder_mib(folder) -> float:
    return sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file()) / 2**20


def evaluate(folder, seeds=2, steps=(28, 4)):
    """The folder's held-out scores at each step count (video_eval, guidance 1)."""
    pipe = ve.load(folder)
    prompts = ve.splits()[1]
    out = {}
    for n in steps:
        t0 = time.time()
        clips, clip_prompts = ve.generate(pipe, prompts, seeds, n)
        out[f"teacher_{n}"] = {**ve.score_clips(clips, clip_prompts), "s_per_clip": (time.time() - t0) / len(clips)}
        log(f"teacher at {n} steps: {out[f'teacher_{n}']}")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", default="vae,latents,pretrain,package")
    ap.add_argument("--work_dir", default=str(ROOT / "out" / "wan_video_base_build"))
    ap.add_argument("--dest", default=str(ASSET_DIR))
    ap.add_argument("--vae_steps", type=int, default=VAE_STEPS)
    ap.add_argument("--vae_from", default="", help="a WanPipeline folder whose vae/ is taken (the vae stage skipped)")
    ap.add_argument("--pretrain_steps", type=int, default=PRETRAIN_STEPS)
    ap.add_argument("--pretrain_lr", type=float, default=PRETRAIN_LR)
    ap.add_argument("--init_from", default="",
                    help="a WanPipeline folder whose transformer pre-training continues (its weights, a new EMA)")
    ap.add_argument("--train_shift", type=float, default=3.0,
                    help="the shift of the training σ (3: the scheduler's; 1: uniform; below 1: more low σ)")
    ap.add_argument("--eval_seeds", type=int, default=2)
    ap.add_argument("--force", type=int, default=0)
    args = ap.parse_args(argv)
    if args.init_from and not (Path(args.init_from) / "transformer" / "config.json").exists():
        ap.error(f"--init_from={args.init_from}: no transformer/config.json (a WanPipeline folder this script built)")
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    torch.set_num_threads(max(1, torch.get_num_threads()))
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    stages, times, report = args.stages.split(","), {}, {}
    report_path = work / "report.json"
    if report_path.exists():
        report = json.loads(report_path.read_text())

    def stage(name, done):
        go = name in stages and (args.force or not done.exists())
        if not go:
            log(f"{name}: kept {done}" if done.exists() else f"{name}: skipped")
        return go

    t = time.time()
    if args.vae_from and not (work / "vae" / "config.json").exists():
        shutil.copytree(Path(args.vae_from) / "vae", work / "vae")
        report.update(score_vae(AutoencoderKLWan.from_pretrained(work / "vae", torch_dtype=torch.float32).eval()))
        log(f"vae: from {args.vae_from}; {report}")
    if stage("vae", work / "vae" / "config.json"):
        vae, vae_report = train_vae(steps=args.vae_steps, phase1=work / "vae_phase1")
        vae.save_pretrained(work / "vae")
        report.update(vae_report)
        log(f"vae: {vae_report}")
    times["vae"] = time.time() - t
    vae = AutoencoderKLWan.from_pretrained(work / "vae", torch_dtype=torch.float32).eval()
    pipe = make_parts(work, vae)
    t = time.time()
    if stage("latents", work / "latents.pt"):
        latents, index, text = make_latents(pipe)
        torch.save({"latents": latents, "index": index, "text": text}, work / "latents.pt")
        log(f"latents: {tuple(latents.shape)}, text {tuple(text.shape)}")
    times["latents"] = time.time() - t
    t = time.time()
    if stage("pretrain", work / "transformer" / "config.json"):
        cache = torch.load(work / "latents.pt")
        if args.init_from:
            start = WanTransformer3DModel.from_pretrained(Path(args.init_from) / "transformer")
            pipe.register_modules(transformer=start)
        ema = pretrain(pipe.transformer, cache["latents"], cache["index"], cache["text"], steps=args.pretrain_steps,
                       lr=args.pretrain_lr, shift=args.train_shift)
        ema.save_pretrained(work / "transformer")
        report.update(pretrain_steps=args.pretrain_steps, pretrain_lr=args.pretrain_lr, train_shift=args.train_shift,
                      init_from=args.init_from)
        report["pretrain_seconds"] = round(time.time() - t, 1)
    times["pretrain"] = time.time() - t
    t = time.time()
    if "package" in stages:
        pipe.register_modules(transformer=WanTransformer3DModel.from_pretrained(work / "transformer"))
        dest = Path(args.dest)
        shutil.rmtree(dest, ignore_errors=True)
        pipe.save_pretrained(dest, safe_serialization=True)
        for config in dest.glob("*/config.json"):  # no path of this machine in the shipped folder
            values = json.loads(config.read_text())
            values.pop("_name_or_path", None)
            config.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")
        report["size_mib"] = round(folder_mib(dest), 2)
        report["eval"] = evaluate(dest, seeds=args.eval_seeds)
    times["package"] = time.time() - t
    report["stage_seconds"] = {k: round(v, 1) for k, v in times.items()}
    report_path.write_text(json.dumps(report, indent=2) + "\n")
    log(f"times (s): {report['stage_seconds']}; report {report_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
