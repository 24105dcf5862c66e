"""train_dmd.py's settings checked before any work: each bad or contradictory one refused in one line
(core.errors.ConfigError) naming it. The script passes its settings as attributes (`c`) and the names it was
given other than their defaults (`changed`); what is true of one family alone, its room checks
(check_dmd_settings), called from here.

    python -m pytest tests/test_train_dmd.py tests/test_decoupled_dmd.py -q
"""
from __future__ import annotations

import os
from types import SimpleNamespace

import checkpoint
import families
import fsdp_utils
from algorithms import dmd2 as dm
from algorithms import flux_kontext as km
from components import optim, trainer
from components.config import check_settings
from core.errors import ConfigError
from data.sources import source_kind
from families import pipelines
from families import sd_unet as unet
from parallel import float8, lora_merge
from parallel import lora as lora_lib
from parallel.context_parallel import check_diffusers_supports_it
from parallel.loading import check_same_tensors, tensor_shapes
from precision import parse_dtype


def validate(c, changed: set[str], default_model: str) -> list[int]:
    """Reject bad or contradictory settings before any work (`c`: the script's settings as attributes, `changed`:
    those not at their default, `default_model`: the embedded default's folder). Returns the generator's step list."""
    check_settings({
        "DFAKE_GEN_UPDATE_RATIO >= 1": c.DFAKE_GEN_UPDATE_RATIO >= 1, "SAMPLE_COUNT >= 1": c.SAMPLE_COUNT >= 1,
        "REAL_GUIDANCE_SCALE >= 0": c.REAL_GUIDANCE_SCALE >= 0,
        "REAL_GUIDANCE_SCALE_2 >= 0": c.REAL_GUIDANCE_SCALE_2 >= 0,
        f"LR_SCHEDULE in ({', '.join(optim.LR_SCHEDULES)})": c.LR_SCHEDULE in optim.LR_SCHEDULES,
        f"REAL_GUIDANCE_NORM in ({', '.join(dm.CFG_NORMS)}) or \"\"": c.REAL_GUIDANCE_NORM in ("", *dm.CFG_NORMS),
        "0 <= MIN_STEP_PERCENT < MAX_STEP_PERCENT <= 1": 0 <= c.MIN_STEP_PERCENT < c.MAX_STEP_PERCENT <= 1,
        "DIFFUSION_GAN_MAX_TIMESTEP >= 1": not (c.USE_GAN and c.DIFFUSION_GAN) or c.DIFFUSION_GAN_MAX_TIMESTEP >= 1,
        "0 <= CONDITIONING_TIMESTEP <= 999": 0 <= c.CONDITIONING_TIMESTEP < 1000,
        "0 <= CAPTION_DROPOUT < 1": 0 <= c.CAPTION_DROPOUT < 1, "PROMPT_CACHE >= 0": c.PROMPT_CACHE >= 0,
        f"GAN_HEAD_FEATURES in ({', '.join(dm.HEAD_FEATURES)})": c.GAN_HEAD_FEATURES in dm.HEAD_FEATURES,
        f"FAKE_SCORE_TARGET in ({', '.join(dm.FAKE_TARGETS)})": c.FAKE_SCORE_TARGET in dm.FAKE_TARGETS,
        "REGRESSION_WEIGHT >= 0": c.REGRESSION_WEIGHT >= 0, "REGRESSION_STEPS >= 1": c.REGRESSION_STEPS >= 1,
        "DIVERSITY_WEIGHT >= 0": c.DIVERSITY_WEIGHT >= 0,
        f"STUDENT_SAMPLE_TYPE in ({', '.join(dm.STUDENT_SAMPLE_TYPES)})":
            c.STUDENT_SAMPLE_TYPE in dm.STUDENT_SAMPLE_TYPES,
        "1 <= DIVERSITY_ANCHOR < REGRESSION_STEPS": (not c.DIVERSITY_WEIGHT
                                                      or 1 <= c.DIVERSITY_ANCHOR < c.REGRESSION_STEPS),
        "SHIFT > 0 or auto": km.valid_shift(c.SHIFT),
        f"DMD_LOSS in ({', '.join(dm.DMD_LOSSES)}) or \"\"": c.DMD_LOSS in ("", *dm.DMD_LOSSES),
        "DMD_CA_WEIGHT >= 0": c.DMD_CA_WEIGHT >= 0, "DMD_DM_WEIGHT >= 0": c.DMD_DM_WEIGHT >= 0,
        "VAL_EVERY >= 0": c.VAL_EVERY >= 0, "VAL_COUNT >= 1": c.VAL_COUNT >= 1,
        "VAL_SEEDS >= 2 (the variety across seeds)": c.VAL_SEEDS >= 2,
        "VAL_TEACHER_STEPS >= 1": c.VAL_TEACHER_STEPS >= 1,
        "COLLAPSE_WARN >= 0": c.COLLAPSE_WARN >= 0, "COLLAPSE_FLOOR >= 0": c.COLLAPSE_FLOOR >= 0,
    })
    for name, given in (("VAL_PROMPTS", c.VAL_PROMPTS), ("COLLAPSE_STOP", c.COLLAPSE_STOP)):
        if given and not c.VAL_EVERY:
            raise ConfigError(f"{name}={given} without VAL_EVERY: validation is off, so it would do nothing")
    if c.COLLAPSE_STOP and not c.COLLAPSE_WARN and not c.COLLAPSE_FLOOR:
        raise ConfigError("COLLAPSE_STOP=1 with COLLAPSE_WARN=0 and COLLAPSE_FLOOR=0: nothing would ever warn, so "
                          "nothing would stop")
    if c.REGRESSION_WEIGHT > 0 and c.DENOISING_STEPS:
        raise ConfigError(f"REGRESSION_WEIGHT={c.REGRESSION_WEIGHT} with DENOISING_STEPS={c.DENOISING_STEPS}: the "
                          "regression target is the teacher's ODE from the generator's noise: a 1-step generator")
    if c.DIVERSITY_WEIGHT > 0 and (not c.DENOISING_STEPS or c.CONDITIONING_TIMESTEP != 999):
        raise ConfigError(f"DIVERSITY_WEIGHT={c.DIVERSITY_WEIGHT} " + (
            "without DENOISING_STEPS: it trains a few-step generator's first step, and the later steps' DM loss keeps "
            "the quality" if not c.DENOISING_STEPS else f"with CONDITIONING_TIMESTEP={c.CONDITIONING_TIMESTEP}: its "
            "target is the teacher's ODE from pure noise (999)"))
    if c.STUDENT_SAMPLE_TYPE == "ode" and not c.DENOISING_STEPS:
        raise ConfigError("STUDENT_SAMPLE_TYPE=ode without DENOISING_STEPS: it is how a few-step generator goes from "
                          "one step to the next; a 1-step generator has none")
    if c.REAL_DATA_PATH and not c.USE_GAN:
        raise ConfigError(f"REAL_DATA_PATH={c.REAL_DATA_PATH} without USE_GAN: real images feed the GAN head only")
    if c.PARALLELISM == "ddp" and c.USE_GAN:
        raise ConfigError("PARALLELISM=ddp with USE_GAN=1: the GAN head runs the fake UNet several times per "
                          "backward, which DistributedDataParallel does not support; use fsdp")
    for name in ("TEACHER_DTYPE", "FAKE_SCORE_ATTENTION_DTYPE"):
        value = getattr(c, name)
        try:
            if value:
                parse_dtype(value)
        except ValueError as e:
            raise ConfigError(f"{name}: {e}") from None
    if c.FAKE_SCORE_ATTENTION_DTYPE and not c.FAKE_SCORE_FP32:
        raise ConfigError(f"FAKE_SCORE_ATTENTION_DTYPE={c.FAKE_SCORE_ATTENTION_DTYPE} without FAKE_SCORE_FP32=1: it "
                          "sets the fp32 fake score's attention (the published all-fp32 pass: both set to fp32 / 1)")
    if c.VAE_PATH and not os.path.isfile(os.path.join(c.VAE_PATH, "config.json")):
        raise ConfigError(f"VAE_PATH={c.VAE_PATH}: no config.json, not a diffusers AutoencoderKL folder")
    if c.INIT_FROM and not checkpoint.is_complete(c.INIT_FROM):
        raise ConfigError(f"INIT_FROM={c.INIT_FROM}: not a complete checkpoint folder")
    if c.GENERATOR_INIT:
        check_generator_init(c, c.GENERATOR_INIT, os.path.join(c.MODEL_PATH or default_model, "unet"))
    if c.MODEL_PATH and not c.DATA_PATH:
        raise ConfigError("MODEL_PATH is set but DATA_PATH is empty: "
                          "give the prompts (.txt) or rows (.jsonl) to train on")
    pipeline = trainer.pipeline_of(c.MODEL_PATH, "train_dmd.py") if c.MODEL_PATH else ""
    room = families.FAMILIES.get(pipeline, unet)
    trainer.check_text_sharding(c.SHARD_TEXT_ENCODER, room)
    if c.NUM_FRAMES and not hasattr(room, "latent_grid"):
        raise ConfigError(f"NUM_FRAMES={c.NUM_FRAMES} with a {pipeline or 'SD-1.5'} teacher: it makes images, not "
                          "videos")
    guide = room.dmd_guidance(vars(c))
    embedded = guide.embedded  # a guidance-distilled teacher's value
    known = not c.MODEL_PATH or os.path.isfile(os.path.join(c.MODEL_PATH, "model_index.json"))  # else checked later
    if c.REAL_GUIDANCE_SCALE_2 and guide.scale_2 is None and known:
        raise ConfigError(f"REAL_GUIDANCE_SCALE_2={c.REAL_GUIDANCE_SCALE_2} with a {pipeline or 'SD-1.5'} teacher: it "
                          "is the low-noise expert's CFG of a two-expert teacher (Wan 2.2 A14B)")
    if c.REAL_GUIDANCE_NORM not in ("", "none") and (c.REAL_GUIDANCE_SCALE == 1 or embedded is not None):
        raise ConfigError(f"REAL_GUIDANCE_NORM={c.REAL_GUIDANCE_NORM}: the teacher runs no CFG pair to combine "
                          + ("at REAL_GUIDANCE_SCALE=1" if c.REAL_GUIDANCE_SCALE == 1 else
                             f"(a {pipeline} teacher's guidance is FLUX_GUIDANCE)"))
    check_dmd_loss(c, changed, room, pipeline)
    if c.CONTEXT_PARALLEL != 1:
        check_context_parallel(c, room, pipeline)
    second = pipelines.trained_components(pipeline)[1:] if pipeline in pipelines.PIPELINES else []
    for name, value in (("TEACHER_LORA_2", c.TEACHER_LORA_2), ("GENERATOR_LORA_2", c.GENERATOR_LORA_2)):
        if value and known and not second:
            raise ConfigError(f"{name}={value} with a {pipeline or 'SD-1.5'} teacher: it is a two-expert teacher's "
                              "second LoRA (Wan 2.2 A14B's transformer_2); its pipeline trains one model")
    generator_lora = c.GENERATOR_LORA or c.GENERATOR_LORA_2
    if generator_lora and (room is unet or not c.LORA_RANK or c.INIT_FROM):
        raise ConfigError(f"GENERATOR_LORA={generator_lora} " + (
            "with a UNet teacher: GENERATOR_INIT starts its generator" if room is unet else
            "without LORA_RANK: it starts LoRA adapters" if not c.LORA_RANK else
            "and INIT_FROM both set: INIT_FROM's checkpoint already holds the generator"))
    if room is unet:
        unet.check_dmd_settings(vars(c), changed)
    else:
        check_flow_settings(c, changed, room, pipeline)
    try:
        steps = [int(t) for t in c.DENOISING_STEPS]
    except ValueError:
        raise ConfigError(f"DENOISING_STEPS={c.DENOISING_STEPS}: expected integers like [999,749,499,249]") from None
    if not steps:
        return [c.CONDITIONING_TIMESTEP]
    if steps != sorted(set(steps), reverse=True) or steps[0] >= 1000 or steps[-1] < 1:
        raise ConfigError(f"DENOISING_STEPS={steps}: must be strictly decreasing timesteps in [1, 999]")
    if steps[0] != c.CONDITIONING_TIMESTEP:
        raise ConfigError(f"DENOISING_STEPS starts at {steps[0]} but CONDITIONING_TIMESTEP={c.CONDITIONING_TIMESTEP}: "
                          "the first step must be the conditioning timestep (pure noise in)")
    return steps


def check_context_parallel(c, room, pipeline: str) -> None:
    """CONTEXT_PARALLEL > 1, before any work: the mesh divides the world, the family splits its tokens (its spec's
    check_context_parallel; the token counts are checked once the data's shapes are known), and nothing reads
    a model's tokens but its output: the GAN head reads the fake score's token features, which CP splits."""
    fsdp_utils.check_context_parallel(c.CONTEXT_PARALLEL, c.DP_REPLICATE, int(os.environ.get("WORLD_SIZE", 1)))
    teacher = f"a {pipeline or 'SD-1.5'} teacher"
    refused = [(teacher, room is unet, "a UNet's convolutions need the whole image"),
               (teacher, room is not unet and families.spec_of(pipeline).check_context_parallel is None,
                "its family takes no context parallelism"),
               ("USE_GAN=1", c.USE_GAN, "the GAN head reads the fake score's token features, which it splits"),
               (f"FP8={c.FP8}", c.FP8, "float8 training is built and tested on FSDP2 alone")]
    for name, bad, why in refused:
        if bad:
            raise ConfigError(f"CONTEXT_PARALLEL={c.CONTEXT_PARALLEL} with {name}: {why}")
    # the family's own check without shapes (heads, text; a family without a _cp_plan refuses), then diffusers'
    families.spec_of(pipeline).check_context_parallel(c.MODEL_PATH, c.CONTEXT_PARALLEL, vars(c), ())
    check_diffusers_supports_it(pipelines.trained_component(pipeline).class_name)


def has_cfg_pair(guide: dm.Guidance) -> bool:
    """The teacher's real score is a CFG pair's combination (no embedded guidance, a negative, a scale other than 1)."""
    return guide.embedded is None and guide.negative is not None and guide.scale != 1


def dmd_loss(c, room, pipeline: str) -> str:
    """DMD_LOSS as the run takes it: as given, or for "" its family's (FamilySpec.dmd_loss) where the teacher
    runs a CFG pair, else dmd2 (a UNet's, an embedded guidance's, REAL_GUIDANCE_SCALE 1's)."""
    if c.DMD_LOSS or room is unet:
        return c.DMD_LOSS or "dmd2"
    pair = has_cfg_pair(room.dmd_guidance(vars(c)))
    return families.spec_of(pipeline).dmd_loss if pair else "dmd2"


def check_dmd_loss(c, changed: set[str], room, pipeline: str) -> None:
    """DMD_LOSS=decoupled needs a flow teacher that samples with a CFG pair (its CA term is that pair's
    difference); its weights alone do nothing. One line before any work."""
    c = SimpleNamespace(**{**vars(c), "DMD_LOSS": dmd_loss(c, room, pipeline)})  # "": the family's
    for name in ("DMD_CA_WEIGHT", "DMD_DM_WEIGHT"):
        if c.DMD_LOSS != "decoupled" and name in changed:
            raise ConfigError(f"{name}={getattr(c, name)} with DMD_LOSS={c.DMD_LOSS}: it weighs a term of "
                              "DMD_LOSS=decoupled")
    if c.DMD_LOSS != "decoupled":
        return
    teacher = pipeline or "SD-1.5"
    guide = room.dmd_guidance(vars(c))
    why = ("a UNet teacher: the CA term is a flow teacher's CFG pair" if room is unet else
           f"its guidance is an embedded value (FLUX_GUIDANCE {guide.embedded:g}), not a CFG pair"
           if guide.embedded is not None else
           f"REAL_GUIDANCE_SCALE={guide.scale:g}: no CFG pair, so no CA term"
           if guide.negative is None or guide.scale == 1 else "")
    if why:
        raise ConfigError(f"DMD_LOSS=decoupled with a {teacher} teacher: {why}; use DMD_LOSS=dmd2")


def check_flow_settings(c, changed: set[str], room, pipeline: str) -> None:
    """What a flow-matching teacher does not take, refused in one line before any work: what no
    flow room takes, then what its own room refuses (room.check_dmd_settings)."""
    refused = [
        ("PARALLELISM=ddp", c.PARALLELISM == "ddp", "its three transformers are sharded (PARALLELISM=fsdp)"),
        ("GENERATOR_INIT", c.GENERATOR_INIT, "it holds a UNet; start a generator from a checkpoint with INIT_FROM"),
        ("REAL_DATA_PATH", c.REAL_DATA_PATH, "the GAN's real images are the rows' own targets, under their own "
         "instruction and references"),
        (f"FAKE_SCORE_ATTENTION_DTYPE={c.FAKE_SCORE_ATTENTION_DTYPE}", c.FAKE_SCORE_ATTENTION_DTYPE,
         "the fake transformer's attention runs in its compute dtype (FAKE_SCORE_FP32 decides)"),
        ("CHANNELS_LAST=1", c.CHANNELS_LAST, "a transformer has no convolutions to lay out"),
        (f"GAN_HEAD_FEATURES={c.GAN_HEAD_FEATURES}", c.GAN_HEAD_FEATURES != "mid",
         "the UNets' setting; the head reads the image stream after the double-stream blocks"),
        (f"MAX_REFERENCES={c.MAX_REFERENCES}", c.MAX_REFERENCES > room.MAX_REFERENCES,
         f"it takes at most {room.MAX_REFERENCES} reference image(s)"),
    ]
    for name, bad, why in refused:
        if bad:
            raise ConfigError(f"{name} with a {pipeline} teacher: {why}")
    room.check_dmd_settings(pipeline, vars(c), changed, source_kind(c.DATA_PATH))
    float8.check_fp8(c.FP8, base_dtype=c.BASE_DTYPE if c.LORA_RANK else "")
    trained = pipelines.trained_component(pipeline)
    for name, file, part in lora_files(c, pipeline, teacher=True):  # a LoRA of its transformer, tensor for tensor
        folder = os.path.join(c.MODEL_PATH, part)
        lora_merge.read_lora(file, pipeline=pipeline).check_base(tensor_shapes(folder), f"{name}: {folder}")
    lora = lora_lib.Lora.from_settings(vars(c))
    for name, file, part in lora_files(c, pipeline, teacher=False):  # its adapters are the generator's, one by one
        lora_merge.check_adapters(lora_merge.read_lora(file, pipeline=pipeline), lora_lib.check_lora_targets(
            trained.class_name, os.path.join(c.MODEL_PATH, part), lora, families.MODELS[trained.class_name]),
            c.LORA_RANK, name)


def lora_files(c, pipeline: str, teacher: bool) -> list[tuple[str, str, str]]:
    """(setting, file, the pipeline part it adapts) of TEACHER_LORA[_2] (or GENERATOR_LORA[_2]) that are set: the
    first for the trained model's first part (transformer), the second for a two-expert teacher's second."""
    parts = [c.subfolder for c in pipelines.trained_components(pipeline)]
    name = "TEACHER_LORA" if teacher else "GENERATOR_LORA"
    files = (c.TEACHER_LORA, c.TEACHER_LORA_2) if teacher else (c.GENERATOR_LORA, c.GENERATOR_LORA_2)
    return [(name + suffix, file, part) for suffix, file, part in zip(("", "_2"), files, parts) if file]


def check_generator_init(c, path: str, teacher_unet: str) -> None:
    """GENERATOR_INIT, before any work: a UNet folder (config.json + safetensors) or one
    .safetensors file, not combined with INIT_FROM or LoRA, holding the teacher's tensors (names
    and shapes, from the headers only; the official load is strict, main/train_sd.py:82)."""
    if path.endswith((".bin", ".pt", ".pth", ".ckpt")):
        raise ConfigError(f"GENERATOR_INIT={path}: a pickled state dict (the official pytorch_model.bin form) is not "
                          "read; convert it once: python -c \"import torch, safetensors.torch as st; "
                          f"st.save_file(torch.load('{path}', map_location='cpu'), 'generator.safetensors')\"")
    is_file = path.endswith(".safetensors") and os.path.isfile(path)
    if not is_file and not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"GENERATOR_INIT={path}: "
                          "neither a .safetensors file nor a diffusers UNet folder (config.json)")
    if c.INIT_FROM:
        raise ConfigError("GENERATOR_INIT and INIT_FROM both set: INIT_FROM's checkpoint already holds the generator")
    if c.LORA_RANK > 0:
        raise ConfigError("GENERATOR_INIT with LORA_RANK > 0: "
                          "the official generator init is for a full generator, and "
                          "a LoRA export's adapters assume MODEL_PATH's UNet as their base; "
                          "train it fully (LORA_RANK=0)")
    if os.path.isdir(teacher_unet):  # a missing teacher folder is reported by the model-folder check next
        check_same_tensors(path, teacher_unet, "GENERATOR_INIT")
