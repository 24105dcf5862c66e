"""DMD2's validation wired to a run (train_dmd.py's VAL_EVERY): which rows, the guidance the teacher's reference
samples at, and the teacher / student samplers of each parametrisation that components/validation.Validator
scores: UNets (the teacher by DDIM, the generator over its step list) and flow teachers (the teacher's ODE on the
pipeline's shifted σ, the generator over its σ list). Every sampler runs on every rank (the models are sharded);
rank 0 decodes.

    python -m pytest tests/test_validation.py -q
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch

import fsdp_utils
from algorithms import dmd2 as dm
from algorithms import dmd2_flow as flow_dm
from components import validation as val
from core.dist import print0
from core.dist import rank as d_rank
from data import randomness
from data.buckets import load_pairs, references
from families import dit
from parallel import lora_merge


@dataclass(frozen=True)
class ValSettings:
    """train_dmd.py's validation settings, and what the teacher's cache key needs of the run."""
    every: int  # VAL_EVERY
    prompts: str  # VAL_PROMPTS
    count: int  # VAL_COUNT
    seeds: int  # VAL_SEEDS
    teacher_steps: int  # VAL_TEACHER_STEPS
    warn: float  # COLLAPSE_WARN
    stop: bool  # COLLAPSE_STOP
    seed: int  # SEED
    folder: str  # OUTPUT_DIR/validation
    run: dict  # the run's settings (the script's constants)
    floor: float = 0.0  # COLLAPSE_FLOOR


def validation_rows(s: ValSettings, rows: list, key: Callable, read_own: Callable) -> list:
    """VAL_EVERY's rows: VAL_PROMPTS' first VAL_COUNT distinct ones (by `key`), else the data's last VAL_COUNT
    distinct ones. Those stay in training: DMD2 trains on prompts without targets, and a run with validation trains
    exactly as one without; VAL_PROMPTS holds prompts it never trains on."""
    if not s.every:
        return []
    own = bool(s.prompts)
    seen: dict = {}
    for r in (read_own() if own else reversed(rows)):
        seen.setdefault(key(r), r)
    picked = list(seen.values())[:s.count]
    print0(f"validation: {len(picked)} prompts x {s.seeds} seeds every {s.every} steps ("
           + (f"VAL_PROMPTS={s.prompts}" if own else "the data's last distinct rows, still trained on")
           + f"); the teacher's reference at {s.teacher_steps} steps")
    return picked if own else picked[::-1]


def reference_guidance(room, settings: dict) -> dm.Guidance:
    """The guidance the teacher's reference samples with: its family's own (REAL_GUIDANCE_SCALE,
    REAL_GUIDANCE_NORM and FLUX_GUIDANCE at "" / 0: the pipeline's CFG and its rescale, or the embedded value),
    whatever the run trains with, so that a run trained at another CFG shows against the teacher as it is used."""
    return room.dmd_guidance({**settings, "REAL_GUIDANCE_SCALE": 0.0, "REAL_GUIDANCE_SCALE_2": 0.0,
                              "REAL_GUIDANCE_NORM": "", "FLUX_GUIDANCE": 0.0})


def make_validator(s: ValSettings, teacher_samples: Callable, student_samples: Callable, labels: list,
                   extra: dict) -> val.Validator:
    """The run's Validator: grids and the teacher's cache in s.folder, the cache keyed by everything the teacher's
    samples depend on."""
    r = s.run
    lora = os.path.realpath(r["TEACHER_LORA"]) if r["TEACHER_LORA"] else ""
    identity = {"model": os.path.realpath(r["MODEL_PATH"]), "teacher_lora": lora,
                "teacher_lora_size": os.path.getsize(lora_merge.lora_file(lora)) if lora else 0,
                **({"teacher_lora_2": os.path.realpath(r["TEACHER_LORA_2"]),  # a two-expert teacher's second
                    "teacher_lora_2_size": os.path.getsize(lora_merge.lora_file(r["TEACHER_LORA_2"]))}
                   if r.get("TEACHER_LORA_2") else {}),
                "rows": labels, "seeds": s.seeds, "seed": s.seed, "steps": s.teacher_steps,
                "precision": r["PRECISION"], "teacher_dtype": r["TEACHER_DTYPE"], "vae": r["VAE_PATH"],
                "vae_dtype": r["VAE_DTYPE"], **extra}
    return val.Validator(teacher_samples, student_samples, s.folder, identity, s.warn, s.stop, floor=s.floor)


def unet_validator(s: ValSettings, final_weights, *, room, rows, encode, uncond, latent_shape, step_list, alphas,
                   teacher, vae, resolution, device) -> val.Validator:
    """A UNet teacher's: per prompt, its seeds in one batch; the teacher's reference by DDIM (s.teacher_steps)
    under its own CFG, the generator over its whole step list, from the same noise."""
    reference = reference_guidance(room, s.run)
    g = randomness.step_generator(s.seed, 0, stream=randomness.VALIDATION_STREAM)
    draws = [(encode([r["prompt"]] * s.seeds), torch.randn((s.seeds, *latent_shape), generator=g),
              torch.randn((s.seeds, len(step_list) - 1, *latent_shape), generator=g)) for r in rows]
    draws = [(text, noise.to(device), sim.to(device)) for text, noise, sim in draws]

    def side(latents_of, model):
        latents = [latents_of(model, text, noise, sim) for text, noise, sim in draws]
        fsdp_utils.reshard_all(model)
        if d_rank() != 0:
            return val.Samples(None, None)
        return val.Samples([room.decode(vae, x).float().cpu() for x in latents], [x.float().cpu() for x in latents])

    @torch.no_grad()
    def teacher_samples():
        return side(lambda m, text, noise, _: dm.ddim_teacher(m, noise, text, uncond, reference.scale, alphas,
                                                              s.teacher_steps, reference.norm), teacher)

    @torch.no_grad()
    def student_samples():
        with final_weights() as model:
            return side(lambda m, text, noise, sim: room.generator_latents(m, text, noise, sim, step_list, alphas),
                        model)
    return make_validator(s, teacher_samples, student_samples, [r["prompt"] for r in rows],
                          {"resolution": resolution, "scale": reference.scale, "norm": reference.norm})


def flow_validator(s: ValSettings, final_weights, *, room, rows, shapes, loader, guide: dm.Guidance, sigmas,
                   cache_dir, identity, teacher, vae, grid, pack, channels, device, ode=False) -> val.Validator:
    """A flow teacher's: per validation row, its seeds' noises in one batch; the teacher's reference is its ODE
    from each noise (Euler, s.teacher_steps on the pipeline's shifted σ at the row's size) under its family's own
    guidance (its CFG pair against the negative prompt, or its embedded value), the student's the whole σ list as
    the export samples, at the run's guidance input (`guide`). `grid`: a row's latent grid from its size in px;
    `pack`: the room's latents -> tokens."""
    model_path = s.run["MODEL_PATH"]
    guidance = 1.0 if guide.embedded is None else guide.embedded
    reference = reference_guidance(room, s.run)
    scale = reference.scale
    teacher_guidance = guidance if reference.embedded is None else reference.embedded
    g = randomness.step_generator(s.seed, 0, stream=randomness.VALIDATION_STREAM)
    draws = []
    for row, shape in zip(rows, shapes):
        (h, w), n = shape[0], s.seeds
        latent = (channels, *grid((h, w)))
        refs, _ = load_pairs([row] * n, shape, [False] * n, target=False, loader=loader)
        refs = [x.to(device) for x in refs]
        text = room.load_text([(row["prompt"], row)] * n, cache_dir, identity, device)
        negative = (room.load_text([(reference.negative, row)] * n, cache_dir, identity, device)
                    if reference.negative is not None else None)
        tokens = flow_dm.token_count(latent[1:])
        shift = dit.teacher_sampling_shift(room, model_path, tokens, s.teacher_steps)
        draws.append((room.dmd_cond(text, None, vae, refs, latent[1:]),
                      room.dmd_cond(text, negative, vae, refs, latent[1:]),
                      pack(torch.randn((n, *latent), generator=g)).to(device),
                      flow_dm.pack_steps(torch.randn((n, len(sigmas) - 1, *latent), generator=g), pack).to(device),
                      shift))

    def side(tokens_of, model):
        tokens = [tokens_of(model, *draw) for draw in draws]
        fsdp_utils.reshard_all(model)
        if d_rank() != 0:
            return val.Samples(None, None)
        pixels = [room.decode_tokens(vae, t, cond.size).float().cpu() for t, (cond, *_) in zip(tokens, draws)]
        return val.Samples(pixels, [t.float().cpu() for t in tokens])

    @torch.no_grad()
    def teacher_samples():
        return side(lambda m, _, cond, noise, __, shift: dm.fm_teacher_ode(
            cond.velocity(m, teacher_guidance if scale == 1 else scale, reference.norm,
                          **flow_dm.low_noise_scale(scale, reference.scale_2)), noise, s.teacher_steps,
            shift), teacher)

    @torch.no_grad()
    def student_samples():
        with final_weights() as model:
            return side(lambda m, cond, _, noise, sim, __: flow_dm.sample_tokens(
                m, cond, noise, sim, sigmas, guidance, ode), model)
    r = s.run
    return make_validator(s, teacher_samples, student_samples, [(str(references(row)), row["prompt"]) for row in rows],
                          {"shapes": shapes, "scale": scale, "norm": reference.norm, "guidance": teacher_guidance,
                           "negative": reference.negative, "reference_area": r["REFERENCE_AREA"],
                           "condition_area": r["CONDITION_AREA"], "max_sequence_length": r["MAX_SEQUENCE_LENGTH"]})
