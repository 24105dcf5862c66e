"""What each pipeline the scripts train holds, by model_index.json's `_class_name`: its components,
where each lives in the folder, in which role the scripts hold it; which pipelines each script
trains; and the VAE factor all of them share. The tables are the family specs' (families/<name>/spec.py),
gathered when families/__init__.py lists the specs.

    python -m pytest tests/test_parallelize.py tests/test_families.py -q
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Component:
    name: str       # what the script calls it
    subfolder: str  # where it lives in the diffusers pipeline folder
    role: str       # trainable | frozen-sharded | replicated | offline (text embeddings cached, then freed)
    #               | files (tokenizer, scheduler: configs the script reads, no weights)
    class_name: str | None = None  # the class model_index.json must name for it (None: any)


PIPELINES: dict[str, tuple[Component, ...]] = {}  # by model_index.json's _class_name: its components
SCRIPTS: dict[str, tuple[str, ...]] = {}  # the pipelines each script trains (the first is its default layout)


def gather(specs) -> None:
    """PIPELINES and SCRIPTS from the family specs, in their order (families/__init__.py calls it once)."""
    for spec in specs:
        for p in spec.pipelines:
            PIPELINES[p.name] = p.components
            for script in p.scripts:
                SCRIPTS[script] = (*SCRIPTS.get(script, ()), p.name)


def folder_layout(pipeline: str) -> dict[str, str | None]:
    """{subfolder: class model_index.json must name, or None} of a pipeline: what a script checks
    a MODEL_PATH for before any work."""
    return {c.subfolder: c.class_name for c in PIPELINES[pipeline]}


def trained_components(pipeline: str) -> list[Component]:
    """The pipeline's trainable components in its order: its UNet or transformer (Wan 2.2 A14B: and transformer_2)."""
    return [c for c in PIPELINES[pipeline] if c.role == "trainable"]


def trained_component(pipeline: str) -> Component:
    """The pipeline's (first) trainable component: its UNet or FLUX transformer."""
    return trained_components(pipeline)[0]


def vae_scale_factor(vae_config) -> int:
    """Pixels per latent side of an AutoencoderKL (its config, or config.json as a dict), as
    diffusers' pipelines compute it: 2 ** (levels - 1), 8 for SD and FLUX."""
    return 2 ** (len(vae_config["block_out_channels"]) - 1)
