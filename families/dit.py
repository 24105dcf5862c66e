"""What the flow-matching transformer rooms (families/flux/, families/qwen_image/, families/flux2/) share: a
transformer built on meta, adapted (LoRA, NF4 base), sharded by the recipe (parallel/parallelize.py) with its
family's model facts (families/<name>/parallelism.py) and loaded slice by slice, in every role the scripts hold
one (trained, EMA copy, frozen teacher); and the FlowMatchEulerDiscreteScheduler a distilled generator's export carries.
"""
from __future__ import annotations

import json
import os

import torch

import fsdp_utils
from algorithms import flux_kontext as km
from parallel import attention, float8, lowbit
from parallel.loading import build_on_meta, fill_built_model
from parallel.lora import Lora, add_lora
from parallel.model_facts import ModelFacts
from parallel.parallelize import parallelize
from precision import Precision


def build_transformer(model_class, facts: ModelFacts, folder, mesh, prec, device, *, load, sharding, block_classes,
                      lora=Lora(), seed=0, base_dtype="", attention_backend=attention.DEFAULT, trainable=True,
                      compute=None, frozen_dtype=None, weights="", prepare=None, merge=None, fp8=""):
    """`model_class` on meta -> (LoRA: adapters added, see parallel/lora.py) -> the recipe by its `facts`
    (parallel/parallelize.py: fully_shard per block, then the root) -> each rank loads its slices (load=False:
    allocate only, e.g. for the EMA copy that is then filled from the model); `facts`: its family's model facts
    (LoRA's default targets, FP8's Linears, the units); families/flux/room.py's build_transformer says what each
    argument does; `prepare(model)` runs on the meta skeleton (what a meta build leaves unset); `merge`: a
    LoRA (parallel/lora_merge.LoraDelta) added into the base weights as they load; `fp8`: FP8's recipe for the
    blocks' Linears (parallel/float8.py; the trained weights of a full model gathered in float8)."""
    model = build_on_meta(model_class, folder)
    if prepare is not None:
        prepare(model)
    attention.set_backend(model, attention_backend)  # ATTENTION_BACKEND, checked at start
    shards = mesh.size() if mesh is not None else 1
    if not trainable:
        dtype = frozen_dtype or prec.compute_dtype
        model.to(dtype).requires_grad_(False).eval()
        if base_dtype == "nf4":
            lowbit.quantize_base(model, shards)
        float8.convert(model, fp8, float8_all_gather=False, emulate=device.type != "cuda", facts=facts)
        frozen = fsdp_utils.Sharding(compile=sharding.compile, frozen=True)
        parallelize(model, mesh, Precision.frozen_mp_policy(dtype), frozen, block_classes, verbose=False, facts=facts)
        return fill_built_model(model, weights or folder, mesh, device, True, merge=merge)
    storage = prec.compute_dtype if lora else prec.param_dtype
    if storage != torch.float32:  # storage dtype of the params (on meta: free)
        model.to(storage)
    if lora:
        add_lora(model, lora, facts)
        if base_dtype == "nf4":
            lowbit.quantize_base(model, shards)
    gather = float8.gathers_in_float8(bool(lora), fsdp_utils.shard_group_size(mesh) if mesh is not None else 1)
    float8.convert(model, fp8, float8_all_gather=gather, emulate=device.type != "cuda", facts=facts)
    policy = prec.adapter_mp_policy(compute) if lora else prec.mp_policy(compute)
    parallelize(model, mesh, policy, sharding, block_classes, verbose=load, facts=facts)
    home = torch.device("cpu") if sharding.cpu_offload else device
    return fill_built_model(model, weights or folder, mesh, home, load, lora_seed=seed, merge=merge)


def reference_attention_shapes(model_path, text_length, shapes, vae_factor, batch, vae_channels, context_parallel=1):
    """The attention calls of a multi-reference room (Qwen-Image-Edit, FLUX.2) for the start-up kernel check: per
    shape, the transformer's joint attention over text + target + reference tokens (2x2-packed latents; Ulysses:
    all tokens, heads / C per rank), and the VAE mid-block's single head of `vae_channels` at the target's latent
    grid (forward only)."""
    with open(os.path.join(model_path, "transformer", "config.json")) as f:
        t = json.load(f)
    trained, vae = [], []
    for (h, w), sizes in dict.fromkeys(shapes):
        tokens = text_length + sum((a // (2 * vae_factor)) * (b // (2 * vae_factor)) for a, b in ((h, w), *sizes))
        trained.append(attention.Shape(f"transformer at {h}x{w} + {len(sizes)} references", batch, tokens, tokens,
                                       t["num_attention_heads"] // context_parallel, t["attention_head_dim"]))
        grid = (h // vae_factor) * (w // vae_factor)
        vae.append(attention.Shape(f"VAE mid-block at {h}x{w}", batch, grid, grid, 1, vae_channels, backward=False))
    return trained, vae


# FlowMatchEulerDiscreteScheduler's settings that move its σ list away from the one passed (diffusers 0.42
# set_timesteps: shift or resolution-dependent shift, stretch to a terminal σ, Karras / exponential / beta
# respacing, 1 − σ), each at its neutral value; base_shift, max_shift, *_image_seq_len and time_shift_type
# act only through use_dynamic_shifting
NEUTRAL_SIGMAS = {"use_dynamic_shifting": False, "shift": 1.0, "shift_terminal": None, "use_karras_sigmas": False,
                  "use_exponential_sigmas": False, "use_beta_sigmas": False, "invert_sigmas": False}


def distilled_scheduler_config(config: dict) -> dict:
    """The teacher's FlowMatchEulerDiscreteScheduler config made to sample the distilled generator:
    every σ-bending setting neutral (NEUTRAL_SIGMAS: the σ list trained is the one the pipeline
    passes, at any resolution), and stochastic sampling (x̂0 = x − σ·v, then re-noised to the next σ
    with fresh noise: diffusers scheduling_flow_match_euler_discrete.py:515-518), the generator's
    few-step inference."""
    out = {k: v for k, v in config.items() if not k.startswith("_") or k == "_class_name"}
    out.update(NEUTRAL_SIGMAS, stochastic_sampling=True)
    return out


def student_sampler(config: dict, sample_type: str) -> dict:
    """An export's scheduler config (a room's distilled_scheduler) sampling as the student trained between its
    steps: "sde" re-noises x̂0 with fresh noise, "ode" takes the Euler step along the generator's velocity
    (FlowMatchEulerDiscreteScheduler's stochastic_sampling True / False: diffusers
    scheduling_flow_match_euler_discrete.py:515-520)."""
    if "stochastic_sampling" not in config:
        raise ValueError(f"{config.get('_class_name')}: no stochastic_sampling to set, not a flow-matching Euler "
                         "scheduler")
    return {**config, "stochastic_sampling": sample_type == "sde"}


def scheduler_config(model_path: str) -> dict:
    """The pipeline folder's scheduler_config.json."""
    with open(os.path.join(model_path, "scheduler", "scheduler_config.json")) as f:
        return json.load(f)


def teacher_sampling_shift(room, model_path: str, tokens: int, steps: int) -> float:
    """The σ shift the teacher's pipeline samples a target of `tokens` tokens with in `steps` steps: the room's
    `sampling_shift` where it has one (FLUX.2's depends on the step count too), else its scheduler config's
    (algorithms/flux_kontext.pipeline_shift)."""
    own = getattr(room, "sampling_shift", None)
    if own is not None:
        return own(model_path, tokens, steps)
    return km.pipeline_shift(scheduler_config(model_path), tokens)


def distilled_scheduler(model_path: str, sigmas=None) -> dict:
    """The scheduler config every export of the distilled generator carries (export/, export_merged/):
    the teacher's made to sample the trained σ list (distilled_scheduler_config), whatever it is: these
    pipelines pass their σ list to set_timesteps themselves."""
    return distilled_scheduler_config(scheduler_config(model_path))
