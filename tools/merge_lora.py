"""A LoRA export merged onto its base into a full pipeline folder, which `from_pretrained` loads alone.

    python tools/merge_lora.py BASE LORA OUT
    python tools/merge_lora.py /models/Qwen-Image-Edit-2509 out/qwen_edit_lora/export out/qwen_edit_merged

BASE: the pipeline folder the adapters were trained on (MODEL_PATH); LORA: a LoRA export (its folder or
the .safetensors); OUT: a new folder. The trained component's safetensors are rewritten file by file, each
adapted weight W + scale · B @ A summed in fp32 and stored in W's dtype (parallel/lora_merge.py, diffusers'
fuse); every other file is hard-linked where the filesystem allows, else copied, so OUT is
self-contained. Works on one process in host memory one safetensors file at a time (a 20 B transformer's
~5 GB shards). An NF4-trained LoRA merges onto the base's own weights, as a QLoRA merge does.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from components.export import PARTIAL, hardlink_tree  # noqa: E402
from core.errors import ConfigError, run_main  # noqa: E402
from parallel import lora_merge  # noqa: E402
from parallel.loading import tensor_shapes, weight_map  # noqa: E402


def merge(base: str, lora: str, out: str, component: str = "transformer") -> None:
    from safetensors.torch import load_file, save_file
    if not os.path.isfile(os.path.join(base, "model_index.json")):
        raise ConfigError(f"{base}: no model_index.json, not a pipeline folder")
    if os.path.exists(out):
        raise ConfigError(f"{out} exists: name a new folder")
    folder = os.path.join(base, component)
    with open(os.path.join(base, "model_index.json")) as f:  # its lora_state_dict reads other tools' key forms
        delta = lora_merge.read_lora(lora, component, json.load(f)["_class_name"])
    delta.check_base(tensor_shapes(folder), f"{folder}")  # before anything is written
    partial = out.rstrip("/") + PARTIAL
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    for name in sorted(os.listdir(base)):
        if name != component:
            hardlink_tree(os.path.join(base, name), os.path.join(partial, name))
    files = set(weight_map(folder).values())
    os.makedirs(os.path.join(partial, component))
    for name in sorted(os.listdir(folder)):
        src, dst = os.path.join(folder, name), os.path.join(partial, component, name)
        if os.path.realpath(src) not in {os.path.realpath(f) for f in files}:
            hardlink_tree(src, dst)
            continue
        tensors = load_file(src)
        for key, t in tensors.items():
            d = delta.delta(key)
            if d is not None:
                tensors[key] = (t.float() + d).to(t.dtype)
        save_file(tensors, dst, metadata={"format": "pt"})
    os.replace(partial, out)
    with open(os.path.join(out, "model_index.json")) as f:
        pipeline = json.load(f)["_class_name"]
    print(f"merged {len(delta.layers)} adapted modules of {lora_merge.lora_file(lora)} into {out}/{component}; "
          f"load with {pipeline}.from_pretrained({out!r})")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("base", help="the pipeline folder the LoRA was trained on")
    p.add_argument("lora", help="the LoRA export (folder or .safetensors)")
    p.add_argument("out", help="the merged pipeline folder to write (must not exist)")
    p.add_argument("--component", default="transformer", help="the adapted component (SD: unet)")
    args = p.parse_args(argv)
    merge(args.base, args.lora, args.out, args.component)


if __name__ == "__main__":
    run_main(main)
