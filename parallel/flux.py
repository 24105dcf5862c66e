"""The FLUX transformer and its VAE as both FLUX paths hold them (train_flux_kontext.py's trained
transformer; train_dmd.py's generator, fake score and teacher): built on meta, adapted, sharded by
the FLUX recipe, loaded slice by slice; and the attention calls the start-up kernel check runs.

    python -m pytest tests/test_train_flux_kontext.py -q
"""
from __future__ import annotations

import json
import os

import torch

import fsdp_utils
from precision import Precision
from parallel import attention, lowbit
from parallel.loading import build_on_meta, fill_built_model
from parallel.lora import Lora, add_lora
from parallel.parallelize import parallelize_flux


def build_transformer(folder, mesh, prec, device, *, load, sharding, block_classes, lora=Lora(), seed=0,
                      base_dtype="", attention_backend=attention.DEFAULT, trainable=True, compute=None,
                      frozen_dtype=None, weights=""):
    """FluxTransformer2DModel on meta -> (LoRA: adapters added, see parallel/lora.py) -> the FLUX
    recipe (parallel/parallelize.py: fully_shard per block, then the root) -> each rank loads its
    slices (load=False: allocate only, e.g. for the EMA copy that is then filled from the model).
    With CPU offload the shards are materialised in host memory, where FSDP keeps them. mesh=None
    (DDP): the recipe's AC and compile only, every rank loads the whole model (the caller wraps it
    in DDP).

    Dtypes: full fine-tuning stores the params in PRECISION's storage dtype; LoRA stores the frozen
    base in the compute dtype (base_dtype="nf4": its Linear weights in 4-bit NF4, parallel/lowbit.py)
    and the adapters in fp32, in the same per-block units. `compute`: a compute dtype other than the
    mode's (DMD2's FAKE_SCORE_FP32). trainable=False (DMD2's teacher): no grads ever, stored and
    computed in `frozen_dtype` (its Linear weights in NF4 with base_dtype="nf4"), resharded after
    every forward. `weights`: another transformer folder to load from ("" = `folder`)."""
    from diffusers import FluxTransformer2DModel
    model = build_on_meta(FluxTransformer2DModel, folder)
    attention.set_backend(model, attention_backend)  # ATTENTION_BACKEND, checked at start
    shards = mesh.size() if mesh is not None else 1
    if not trainable:
        dtype = frozen_dtype or prec.compute_dtype
        model.to(dtype).requires_grad_(False).eval()
        if base_dtype == "nf4":
            lowbit.quantize_base(model, shards)
        frozen = fsdp_utils.Sharding(compile=sharding.compile, frozen=True)
        parallelize_flux(model, mesh, Precision.frozen_mp_policy(dtype), frozen, block_classes, verbose=False)
        return fill_built_model(model, weights or folder, mesh, device, True)
    storage = prec.compute_dtype if lora else prec.param_dtype
    if storage != torch.float32:  # storage dtype of the params (on meta: free)
        model.to(storage)
    if lora:
        add_lora(model, lora)
        if base_dtype == "nf4":
            lowbit.quantize_base(model, shards)
    policy = prec.adapter_mp_policy(compute) if lora else prec.mp_policy(compute)
    parallelize_flux(model, mesh, policy, sharding, block_classes, verbose=load)
    home = torch.device("cpu") if sharding.cpu_offload else device
    return fill_built_model(model, weights or folder, mesh, home, load, lora_seed=seed)


def load_vae(folder, dtype, device):
    """The frozen VAE, replicated on every rank in its own dtype."""
    from diffusers import AutoencoderKL
    vae = AutoencoderKL.from_pretrained(folder, dtype=dtype, low_cpu_mem_usage=False)  # small: plain load
    return fsdp_utils.prepare_frozen(vae, dtype, device)


def attention_shapes(model_path, text_length, sizes, vae_factor, batch, context_parallel):
    """The run's attention calls for the start-up kernel check: the transformer's joint attention
    over text + target + context tokens (Ulysses: all tokens, heads / C per rank) at each (h, w) in
    `sizes`, and the VAE mid-block's single head of its channels at the latent grid (forward only)."""
    with open(os.path.join(model_path, "transformer", "config.json")) as f:
        t = json.load(f)
    with open(os.path.join(model_path, "vae", "config.json")) as f:
        vae_channels = json.load(f)["block_out_channels"][-1]
    trained, vae = [], []
    for h, w in dict.fromkeys(sizes):
        image = (h // (2 * vae_factor)) * (w // (2 * vae_factor))
        tokens = text_length + 2 * image
        trained.append(attention.Shape(f"transformer at {h}x{w}", batch, tokens, tokens,
                                       t["num_attention_heads"] // context_parallel, t["attention_head_dim"]))
        grid = (h // vae_factor) * (w // vae_factor)
        vae.append(attention.Shape(f"VAE mid-block at {h}x{w}", batch, grid, grid, 1, vae_channels, backward=False))
    return trained, vae
