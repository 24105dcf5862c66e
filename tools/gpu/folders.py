"""The GPU check's models and data, built offline: each family's folder at real width with random weights (its
spec's GpuCheck: the parts beside a skeleton of its trained model with fewer blocks, written once its size is
chosen), the tiny rows' default folders, the rows' data. A row's model is (its family, its size): the size a
tuple of block counts at real width ((): the real model whole), "tiny" for the family's tiny folder."""
from __future__ import annotations

import json
import os
import shutil

import families

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tools/
ROOT = os.path.dirname(HERE)


def spec(name: str):
    """The FamilySpec of the family `name` (families.NAMES)."""
    return next(s for s in families.SPECS if s.name == name)


def real_configs(name: str) -> str:
    """The real model's configs the family's rows are built from (GpuCheck.configs, one of its built-ins)."""
    f = spec(name)
    return f.builtin_folder(f.gpu.configs)


def trained_subfolder(name: str) -> str:
    """Where the family's folders hold the model it trains ("transformer", "unet")."""
    return next(c.subfolder for p in spec(name).pipelines for c in p.components if c.role == "trainable")


def _copy_small_parts(tiny: str, out: str, keep: tuple[str, ...]) -> None:
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(tiny):
        if name in keep or name == "model_index.json":
            src = os.path.join(tiny, name)
            (shutil.copytree if os.path.isdir(src) else shutil.copy)(src, os.path.join(out, name))


def _init_device():
    """Where random weights are drawn: the GPU when there is one (seconds instead of a minute)."""
    import torch
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def tiny_default(name: str) -> str:
    """The tiny rows' model folder of a family: tools/tiny_models' default of its first tiny folder (spec.tiny's
    first key), built once in that cache ($FSDP_DIFFUSION_CACHE: the tests share theirs)."""
    from tools import tiny_models
    return tiny_models.ensure_default(next(iter(spec(name).tiny)))[0]


def parts_folder(name: str, root: str) -> str:
    """root/<name>_parts (written once, through a .partial folder): the family's folder at real width but for a
    trained model it builds in blocks (GpuCheck.parts, random weights drawn on the init device, in their order),
    with its tiny folder's small parts (GpuCheck.keep) and model_index.json."""
    gpu = spec(name).gpu
    out = os.path.join(root, f"{name}_parts")
    if os.path.isdir(out):
        return out
    partial = out + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    tiny, real = tiny_default(name), real_configs(name)
    _copy_small_parts(tiny, partial, gpu.keep)
    with _init_device():
        for sub, make in gpu.parts:
            make(tiny, real).save_pretrained(os.path.join(partial, sub))
    os.replace(partial, out)
    return out


def skeleton(name: str, root: str, blocks: tuple[int, ...], parts: str | None) -> str:
    """root/<name>_real_<blocks>: the trained model's real config with `blocks` (GpuCheck.blocks' counts), no
    weights yet (trained_weights writes them), beside links to `parts`' components (None: config only, enough
    to size a run)."""
    gpu, sub = spec(name).gpu, trained_subfolder(name)
    with open(os.path.join(real_configs(name), sub, "config.json")) as f:
        config = {**json.load(f), **dict(zip(gpu.blocks, blocks))}
    out = os.path.join(root, f"{name}_real_" + "_".join(map(str, blocks)))
    os.makedirs(os.path.join(out, sub), exist_ok=True)
    with open(os.path.join(out, sub, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    for part in os.listdir(parts) if parts else ():
        dst, src = os.path.join(out, part), os.path.join(parts, part)
        if not os.path.lexists(dst):  # folders linked (gigabytes), files copied (the export rewrites its copy)
            os.symlink(src, dst) if os.path.isdir(src) else shutil.copy(src, dst)
    return out


def trained_weights(name: str, folder: str) -> None:
    """The skeleton's trained model with random weights, of the class its config names (written once)."""
    import diffusers
    sub = os.path.join(folder, trained_subfolder(name))
    if any(f.endswith(".safetensors") for f in os.listdir(sub)):
        return
    with open(os.path.join(sub, "config.json")) as f:
        cls = getattr(diffusers, json.load(f)["_class_name"])
    with _init_device():
        cls.from_config(cls.load_config(sub)).save_pretrained(sub)


def real_folder(name: str, root: str, blocks: tuple[int, ...] = ()) -> str:
    """The family's folder at real width under `root`, with `blocks` (its GpuCheck.blocks' counts; () for a family
    built whole), random weights (written once)."""
    parts = parts_folder(name, root)
    if not blocks:
        return parts
    folder = skeleton(name, root, blocks, parts)
    trained_weights(name, folder)
    return folder


def default_size(name: str, tiny: bool):
    """A family's rows' model before the disk is counted: "tiny", or its GpuCheck.default_blocks."""
    return "tiny" if tiny else tuple(spec(name).gpu.default_blocks)


def model_label(name: str | None, size) -> str:
    """A row's model for the table: "FLUX 2+4 blocks", "FLUX.2 klein 2+4 blocks", "Qwen-Image-Edit 4 blocks",
    "SD-1.5", "tiny FLUX", ...; "-" for a row without a model."""
    if name is None or size is None:
        return "-"
    label = spec(name).gpu.label
    if size == "tiny":
        return f"tiny {label}"
    return f"{label} {'+'.join(map(str, size))} blocks" if size else label


# the tiny rows' prompts and pairs: 4 to train on beside the 4 the Kontext script holds out for samples (each run
# encodes all of them into its text cache first, which the rows' plumbing does not need 24 or 64 of)
TINY_SAMPLES = 8
# edits with n references: (folder name, tools/tiny_models' builder)
EDITS = {1: ("pairs", "make_edit_dataset"), 2: ("two_ref_pairs", "make_two_reference_edit_dataset")}


def dataset(root: str, name: str, size: int, tiny: bool = False, script: str = "") -> str:
    """The family's rows' data for `script`'s rows: its GpuCheck.data's where it writes its own, else by
    GpuCheck.data_references: a DMD2 prompts .txt, or edits with that many references at `size` px (data.jsonl's
    path); tiny: TINY_SAMPLES."""
    from tools import tiny_models
    if spec(name).gpu.data:
        return spec(name).gpu.data(root, size, tiny, script)
    suffix = "_tiny" if tiny else ""
    references = spec(name).gpu.data_references
    if not references:
        prompts = os.path.join(root, f"prompts{suffix}.txt")
        if not os.path.exists(prompts):
            tiny_models.make_prompts_file(prompts, TINY_SAMPLES if tiny else 64)
        return prompts
    base, builder = EDITS[references]
    folder = os.path.join(root, f"{base}_{size}{suffix}")
    if not os.path.isdir(folder):
        getattr(tiny_models, builder)(folder, TINY_SAMPLES if tiny else 24, size=size)
    return os.path.join(folder, "data.jsonl")
