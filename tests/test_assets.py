"""The shipped data and models (everything under assets/) carry nothing of the machine that built
them, and every component config names a class its library has.

    python -m pytest tests/test_assets.py -q
"""
import json
import os
import re
import sys

import pytest

from tests.conftest import ROOT

ASSETS = os.path.join(ROOT, "assets")
TEXT = (".json", ".jsonl", ".txt", ".md", ".yaml", ".yml", ".cfg")
# an absolute path in a string: POSIX (/x/y, ~/x), Windows (C:\ or C:/), or a file:// URL
ABSOLUTE = re.compile(r"(?:^|[\s=:'\"(,])(?:/(?:[\w.@+-]+/)*[\w.@+-]+|~/|[A-Za-z]:[\\/]|file://)")


def text_files():
    for root, _, files in os.walk(ASSETS):
        for name in files:
            if name.endswith(TEXT):
                yield os.path.join(root, name)


def strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from strings(k)
            yield from strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from strings(v)


def absolute_paths(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".json"):
        values = list(strings(json.loads(text)))
    elif path.endswith(".jsonl"):
        values = [s for line in text.splitlines() if line.strip() for s in strings(json.loads(line))]
    else:
        values = text.splitlines()
    return [v for v in values if ABSOLUTE.search(v)]


def test_the_scanner_catches_absolute_paths(tmp_path):
    for bad in ({"_name_or_path": "/work/main/out/vae"}, {"cmd": "x.py --model_path=/home/u/m"},
                {"p": "C:\\models\\sd"}, {"p": "~/data"}):
        (tmp_path / "c.json").write_text(json.dumps(bad))
        assert absolute_paths(str(tmp_path / "c.json")), bad
    (tmp_path / "ok.json").write_text(json.dumps({"cmd": "train.py --model_path=out/x --lr=1e-3", "a/b": "c/d"}))
    assert not absolute_paths(str(tmp_path / "ok.json"))


def test_no_shipped_file_holds_an_absolute_path():
    files = list(text_files())
    assert len(files) > 10
    found = {os.path.relpath(p, ROOT): hits[:2] for p in files if (hits := absolute_paths(p))}
    assert not found, found


def test_component_configs_name_real_library_classes():
    import diffusers
    import transformers
    checked = 0
    for model_index in (os.path.join(ASSETS, d, "model_index.json") for d in os.listdir(ASSETS)):
        if not os.path.isfile(model_index):
            continue
        folder = os.path.dirname(model_index)
        for component, entry in json.load(open(model_index)).items():
            config = os.path.join(folder, component, "config.json")
            if component.startswith("_") or not os.path.isfile(config):
                continue
            library, cls = entry
            name = json.load(open(config)).get("_class_name") or json.load(open(config))["architectures"][0]
            module = diffusers if library == "diffusers" else transformers
            assert hasattr(module, name) and name == cls, (config, name, cls)
            checked += 1
    assert checked >= 6


@pytest.mark.parametrize("component", ["assets/kontext_base/transformer", "assets/shapes_teacher/unet",
                                       "assets/qwen_edit_base/transformer", "assets/flux2_edit_base/transformer",
                                       "assets/z_image_edit_base/transformer"])
def test_shipped_models_load_with_automodel(component):
    import diffusers
    from safetensors.torch import load_file
    sys.path.insert(0, ROOT)
    folder = os.path.join(ROOT, component)
    model = diffusers.AutoModel.from_pretrained(folder)
    config = json.load(open(os.path.join(folder, "config.json")))
    assert type(model).__name__ == config["_class_name"]
    weights = load_file(os.path.join(folder, "diffusion_pytorch_model.safetensors"))
    state = model.state_dict()
    assert state.keys() == weights.keys()
    assert all((state[k].to(weights[k].dtype) == weights[k]).all() for k in weights)
