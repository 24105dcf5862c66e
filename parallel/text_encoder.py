"""A frozen transformers text encoder sharded with FSDP2 for the text-cache fill: FLUX.2 [dev]'s Mistral-Small 3
is 24 B (48 GB in bf16), more than a 24 or 40 GB card holds, while the fill runs before the diffusion
transformer exists. Built on meta, one unit per decoder layer (the model's `_no_split_modules`), each rank
loading only its slices (parallel/loading.py), every unit resharded after its forward; freed with the cache
filled. The ranks then all run each forward together (data/text_cache.fill_text_cache, sharded=True).

    python -m pytest tests/test_flux2.py -q -k sharded
"""
from __future__ import annotations

import os

import torch
from torch import nn

import fsdp_utils
from core.dist import print0
from core.errors import ConfigError
from parallel.loading import fill_built_model
from parallel.parallelize import parallelize
from precision import Precision


def _host_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The non-persistent buffers a meta build leaves empty (RoPE frequency tables, made in __init__ and not
    saved), remade on the host: each owning module built again from its config (transformers' rotary
    embeddings take `config`)."""
    out = {}
    for name, module in model.named_modules():
        lost = [b for b in module._non_persistent_buffers_set if getattr(module, b, None) is not None]
        if not lost:
            continue
        if not hasattr(module, "config"):
            raise ConfigError(f"{type(model).__name__}.{name} ({type(module).__name__}): a computed buffer "
                              f"({lost[0]}) that a meta build cannot remake; the text encoder cannot be sharded")
        with torch.device("cpu"):
            fresh = type(module)(config=module.config)
        for b in lost:
            out[f"{name}.{b}" if name else b] = getattr(fresh, b)
    return out


def stored_name_mapping(model: nn.Module):
    """The model's name of a stored tensor's name, as transformers renames on load: checkpoints of vision-language
    models (FLUX.2 [dev]'s Mistral-3) keep the older layout (language_model.model.*, vision_tower.*) that the
    modules have since moved from (transformers' conversion_mapping)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key
    renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    names = {n: True for n, _ in [*model.named_parameters(), *model.named_buffers()]}
    return lambda key: rename_source_key(key, renamings, [], model.base_model_prefix, names)[0]


def sharded_text_encoder(model_cls, folder: str, mesh, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """`model_cls` (a transformers model) of `folder`, frozen in `dtype`, sharded on `mesh` one unit per
    decoder layer, loaded slice by slice."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = model_cls._from_config(config, dtype=dtype)
    buffers = _host_buffers(model)
    rename = stored_name_mapping(model)  # before fully_shard renames the classes that transformers looks up
    model.requires_grad_(False).eval()
    units = parallelize(model, mesh, Precision.frozen_mp_policy(dtype), fsdp_utils.Sharding(frozen=True),
                        verbose=False)
    fill_built_model(model, folder, mesh, device, rename=rename)
    with torch.no_grad():
        for name, value in buffers.items():
            owner, _, leaf = name.rpartition(".")
            module = model.get_submodule(owner)
            module._buffers[leaf] = value.to(device=device, dtype=module._buffers[leaf].dtype)
    print0(f"text encoder: {model_cls.__name__} sharded over {mesh.size()} ranks, {len(units)} units "
           f"({os.path.basename(folder.rstrip('/'))}, {str(dtype).removeprefix('torch.')})")
    return model
