"""Every family against its spec (families/spec.py): one name per family, the spec's fields well formed, the
room answering every Protocol its spec names for the scripts (each name present, callables callable, the
parameter names the scripts call with), the Protocols holding every name the scripts ask of a room, and each
family's example_inputs accepted by its real model's forward at the tiny config, on CPU with the output shape
the room's own call gives, and on meta.

    python -m pytest tests/test_families.py -q
"""
from __future__ import annotations

import ast
import inspect
import os
import types
import typing

import pytest
import torch

import families
from families import spec as fs
from parallel.model_facts import ModelFacts
from tests.conftest import ROOT, tiny_default

ROLES = (fs.EditingRoom, fs.FlowDistillationRoom, fs.UnetDistillationRoom)
TYPES = {"str": str, "int": int, "bool": bool, "type": type}


# ----------------------------------------------------------------------------------------------
# the conformance check


def members(protocol) -> dict:
    """{name: the Protocol's function, or the annotation (a string) of a constant} over its bases."""
    out = {}
    for cls in reversed(protocol.__mro__):
        if cls in (typing.Protocol, typing.Generic) or not getattr(cls, "_is_protocol", False):
            continue
        out.update({n: a for n, a in vars(cls).get("__annotations__", {}).items()})
        out.update({n: f for n, f in vars(cls).items() if inspect.isfunction(f) and not n.startswith("_")})
    return out


def _signature_problems(name: str, want, got) -> list[str]:
    """How `got` (the room's callable) cannot be called as `want` (the Protocol's function, self dropped)."""
    try:
        have = inspect.signature(got)
    except (TypeError, ValueError):
        return [f"{name}: no signature"]
    params = list(have.parameters.values())
    if any(p.kind == p.VAR_KEYWORD for p in params) and any(p.kind == p.VAR_POSITIONAL for p in params):
        return []
    out = []
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    by_name = {p.name: p for p in params}
    asked = list(inspect.signature(want).parameters.values())[1:]
    for i, p in enumerate(q for q in asked if q.kind == q.POSITIONAL_OR_KEYWORD):
        if i >= len(positional) or positional[i].name != p.name:
            out.append(f"{name}: positional parameter {i} is "
                       f"{positional[i].name if i < len(positional) else 'missing'}, the scripts pass {p.name}")
    for p in asked:
        mine = by_name.get(p.name)
        if p.kind == p.KEYWORD_ONLY and (mine is None or mine.kind not in (mine.POSITIONAL_OR_KEYWORD,
                                                                             mine.KEYWORD_ONLY)):
            out.append(f"{name}: takes no keyword {p.name}")
        elif mine is not None and p.default is not p.empty and mine.default is mine.empty:
            out.append(f"{name}: {p.name} needs a default (the scripts may leave it out)")
    names = {p.name for p in asked}
    out += [f"{name}: its extra parameter {p.name} has no default" for p in params
            if p.name not in names and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty]
    return out


def conformance(room, protocol) -> list[str]:
    """What `room` lacks to answer `protocol`: missing names, constants of another type, callables that are
    not, or that cannot be called with the Protocol's parameters."""
    out = []
    for name, want in members(protocol).items():
        if not hasattr(room, name):
            out.append(f"{name}: missing")
        elif isinstance(want, str):
            kind = TYPES.get(want.split(" ")[0])
            if kind is not None and not isinstance(getattr(room, name), kind):
                out.append(f"{name}: not a {want}")
        elif not callable(getattr(room, name)):
            out.append(f"{name}: not callable")
        else:
            out += _signature_problems(name, want, getattr(room, name))
    if hasattr(room, "NEGATIVE_PROMPT") and protocol is fs.EditingRoom:  # fs.OPTIONAL: true CFG in samples
        if "negative" not in inspect.signature(room.sample).parameters:
            out.append("sample: a room with NEGATIVE_PROMPT takes negative=")
    return out


CASES = [(spec, script) for spec in families.SPECS for script in spec.protocols]


@pytest.mark.parametrize("spec, script", CASES, ids=[f"{s.name}-{script}" for s, script in CASES])
def test_each_room_answers_the_protocols_of_its_scripts(spec, script):
    problems = conformance(spec.room, spec.protocols[script])
    assert not problems, f"{spec.name} for {script}:\n" + "\n".join(problems)


def test_the_conformance_check_catches_what_a_room_lacks():
    """The check itself: a room less one name, with a constant of the wrong type, a callable that is not,
    a renamed keyword or a new parameter without a default fails it."""
    from families import flux2

    def room(**changes):
        fake = types.ModuleType("fake_room")
        fake.__dict__.update({k: v for k, v in vars(flux2).items() if not k.startswith("__")})
        for k, v in changes.items():
            if v is None:
                del fake.__dict__[k]
            else:
                setattr(fake, k, v)
        return fake
    assert not conformance(room(), fs.EditingRoom)
    assert conformance(room(text_row=None), fs.EditingRoom) == ["text_row: missing"]
    assert conformance(room(MAX_REFERENCES="4"), fs.FlowDistillationRoom) == ["MAX_REFERENCES: not a int"]
    assert conformance(room(dmd_cond=3), fs.FlowDistillationRoom) == ["dmd_cond: not callable"]

    def build_transformer(folder, mesh, prec, device, *, load, sharding, blocks, **kw):
        pass
    assert "build_transformer: takes no keyword block_classes" in conformance(room(
        build_transformer=build_transformer), fs.EditingRoom)
    assert conformance(room(forward=lambda transformer, inputs, sigmas, guidance, text, mask: 0), fs.EditingRoom) == [
        "forward: its extra parameter mask has no default"]
    assert conformance(room(sample=lambda pipe, vae, references, text, size, steps, guidance, generator: 0),
                       fs.EditingRoom) == ["sample: a room with NEGATIVE_PROMPT takes negative="]


# ----------------------------------------------------------------------------------------------
# the Protocols hold what the scripts ask


# (file, the name the room goes by there, the Protocol that must hold every name asked of it)
ASKED = [("train_flux_kontext.py", "room", fs.EditingRoom), ("train_dmd.py", "room", fs.FlowDistillationRoom),
         ("train_dmd.py", "unet", fs.UnetDistillationRoom), ("components/trainer.py", "room", fs.Room),
         ("data/buckets.py", "room", fs.TransformerRoom)]


def asked(path: str, var: str) -> tuple[dict, set]:
    """({name asked of `var`: keywords it is called with}, names read with getattr) in the file at `path`:
    `var.name`, `var.name(..., k=...)` and functools.partial(var.name, ..., k=...)."""
    tree = ast.parse(open(os.path.join(ROOT, path)).read())
    names, optional = {}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == var:
            names.setdefault(node.attr, set())
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        target = node.args[0] if (isinstance(f, ast.Attribute) and f.attr == "partial" and node.args) else f
        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == var:
            names.setdefault(target.attr, set()).update(k.arg for k in node.keywords if k.arg)
        if (isinstance(f, ast.Name) and f.id == "getattr" and len(node.args) >= 2 and isinstance(node.args[0], ast.Name)
                and node.args[0].id == var and isinstance(node.args[1], ast.Constant)):
            optional.add(node.args[1].value)
    return names, optional


@pytest.mark.parametrize("path, var, protocol", ASKED, ids=[f"{p}-{v}" for p, v, _ in ASKED])
def test_the_protocols_hold_every_name_the_scripts_ask(path, var, protocol):
    names, optional = asked(path, var)
    have = members(protocol)
    assert names, f"{path}: nothing asked of {var}"
    assert sorted(set(names) - set(have)) == [], f"{path} asks {var} for names {protocol.__name__} lacks"
    for name, keywords in names.items():
        if isinstance(have[name], str):  # a constant (or PromptCache, called positionally)
            assert not keywords, f"{path}: {var}.{name} called with {keywords}"
            continue
        params = inspect.signature(have[name]).parameters
        assert keywords <= set(params), f"{path}: {var}.{name} called with {keywords - set(params)}"
    assert optional <= set(fs.OPTIONAL), f"{path} reads {optional - set(fs.OPTIONAL)} with getattr: fs.OPTIONAL"


def test_the_scripts_ask_about_forty_names():
    """The interface as the scripts see it: every name each script asks of a room."""
    union = set()
    for path, var, _ in ASKED:
        union |= set(asked(path, var)[0])
    assert len(union) >= 40, sorted(union)


# ----------------------------------------------------------------------------------------------
# the specs


def test_one_name_per_family_and_one_family_per_pipeline():
    names = [s.name for s in families.SPECS]
    assert names == list(families.NAMES) and len(set(names)) == len(names)
    pipelines = [p for s in families.SPECS for p in s.pipeline_names]
    assert len(set(pipelines)) == len(pipelines) and set(pipelines) == set(families.FAMILIES)
    kinds = [k for s in families.SPECS for k in s.tiny]
    assert len(set(kinds)) == len(kinds)


@pytest.mark.parametrize("spec", families.SPECS, ids=[s.name for s in families.SPECS])
def test_each_spec_is_well_formed(spec):
    assert spec.name.isidentifier() and spec.room.__name__ == f"families.{spec.name}"
    assert all(families.FAMILIES[p] is spec.room and families.spec_of(p) is spec for p in spec.pipeline_names)
    scripts = set()
    for p in spec.pipelines:
        trained = [c for c in p.components if c.role == "trainable"]
        # its trained model's facts are the family's own (families/<name>/parallelism.py)
        assert p.name.endswith("Pipeline") and trained and all(c.class_name in spec.models for c in trained), p.name
        assert p.scripts and set(p.scripts) <= set(fs.SCRIPTS), p.name
        assert len({c.subfolder for c in p.components if c.role != "trainable"}) == len(
            [c for c in p.components if c.role != "trainable"]), p.name  # one component per folder
        assert p.resolution is None or (p.resolution > 0 and p.resolution % 16 == 0)
        scripts |= set(p.scripts)
    assert set(spec.protocols) == scripts and all(v in ROLES for v in spec.protocols.values())
    assert all(isinstance(f, ModelFacts) and families.MODELS[c] is f for c, f in spec.models.items())
    assert isinstance(spec.default_resolution, int) and spec.default_resolution % 16 == 0 < spec.default_resolution
    assert isinstance(spec.text_len, int) and spec.text_len > 0
    assert list(inspect.signature(spec.example_inputs).parameters) == ["config", "batch", "shapes", "text_len",
                                                                      "device", "dtype"]
    editing = "train_flux_kontext.py" in spec.protocols
    # the room's check where its family splits sequences (every editing family's: its script asks it), else None
    assert spec.check_context_parallel in ((spec.room.check_context_parallel,) if editing else
                                           (None, getattr(spec.room, "check_context_parallel", None)))
    assert spec.tiny and all(callable(b) for b in spec.tiny.values())  # tools/tiny_models.BUILDERS
    if hasattr(spec.room, "DEFAULT_RESOLUTION"):
        assert spec.default_resolution == spec.room.DEFAULT_RESOLUTION


# ----------------------------------------------------------------------------------------------
# example_inputs against the real models at the tiny configs


# tiny kind -> the (h, w) latents of one sample's images (64 px at the VAE's factor; a 32 px second reference)
TINY_SHAPES = {"sd15": ((16, 16),), "sdxl": ((16, 16),), "flux_kontext": ((8, 8), (8, 8)),
               "qwen_image_edit": ((8, 8), (8, 8), (4, 4)), "flux2_klein": ((8, 8), (8, 8), (4, 4)),
               "flux2_dev": ((8, 8), (8, 8), (4, 4)), "wan_t2v": ((3, 4, 4),)}
BATCH, TEXT = 2, 7


def _trained_class(pipeline: str):
    import diffusers
    return getattr(diffusers, families.pipelines.trained_component(pipeline).class_name)


def _pipeline(model: str) -> str:
    import json
    with open(os.path.join(model, "model_index.json")) as f:
        return json.load(f)["_class_name"]


def _room_call(spec, model, inputs, shapes):
    """The room's own forward on the sizes of `inputs` (the script's path), its kwargs to the model as
    the model's forward binds them, and its output."""
    seen = {}

    def hook(module, args, kwargs):
        seen.update(inspect.signature(module.forward).bind(*args, **kwargs).arguments)
    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        if spec.name == "sd_unet":
            from algorithms import dmd2
            added = inputs.get("added_cond_kwargs")
            text = dmd2.Cond(inputs["encoder_hidden_states"], added) if added else inputs["encoder_hidden_states"]
            out = dmd2.predict_eps(model, inputs["sample"], 500, text)
            return seen, out, out.shape
        if spec.name == "wan":  # a video room: its velocity on the packed latents, unpacked back to the latents'
            x = inputs["hidden_states"]
            cond = spec.room.dmd_cond(inputs["encoder_hidden_states"], None, None, [], x.shape[2:])
            out = spec.room.unpack_latents(cond.velocity(model, 1.0)(spec.room.pack_latents(x), torch.rand(BATCH)),
                                           x.shape[2:])
            return seen, out, x.shape
        c = model.config.in_channels // 4  # the latents' channels: tokens are 2x2 patches of them
        x0, *refs = [torch.randn(BATCH, c, h, w) for h, w in shapes]
        step = spec.room.model_inputs(x0, refs, torch.randn_like(x0), torch.rand(BATCH))
        text = {"flux": (inputs["encoder_hidden_states"], inputs.get("pooled_projections")),
                "qwen_image": (inputs["encoder_hidden_states"], None),
                "flux2": inputs["encoder_hidden_states"]}[spec.name]
        out = spec.room.forward(model, step, torch.rand(BATCH), 1.0, text)
        return seen, out, step["target"].shape
    finally:
        handle.remove()


def _same_layout(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape, (
            f"{where}: {tuple(a.shape)} vs {tuple(b.shape) if isinstance(b, torch.Tensor) else b}")
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{where}: {sorted(a)} vs {sorted(b)}"
        for k in a:
            _same_layout(a[k], b[k], f"{where}.{k}")
    else:
        assert a == b, f"{where}: {a} vs {b}"


@pytest.mark.parametrize("kind", list(TINY_SHAPES))
def test_example_inputs_feed_the_real_model_as_the_room_does(kind):
    """At the tiny default's config: the real model takes example_inputs on CPU, every input laid out as the
    room's own call lays it out (the same names and shapes), with the output the room expects (the latent's
    shape for the UNet; for a transformer, all tokens, the target's first, as its loss reads them); and on
    meta, the model built on meta takes them too, with the same output shape."""
    from parallel.loading import build_on_meta
    model_path, _ = tiny_default(kind)
    pipeline = _pipeline(model_path)
    spec = families.spec_of(pipeline)
    assert kind in spec.tiny  # the family's own tiny folder
    cls = _trained_class(pipeline)
    folder = os.path.join(model_path, families.pipelines.trained_component(pipeline).subfolder)
    model = cls.from_pretrained(folder).eval()
    inputs = spec.example_inputs(model.config, BATCH, TINY_SHAPES[kind], TEXT, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        out = model(**inputs)[0]
        seen, room_out, expected = _room_call(spec, model, inputs, TINY_SHAPES[kind])
    ours = inspect.signature(model.forward).bind(**inputs).arguments
    _same_layout({k: v for k, v in ours.items() if k != "return_dict"},
                 {k: v for k, v in seen.items() if k != "return_dict"}, kind)
    assert out.shape == room_out.shape
    if spec.name == "sd_unet":
        assert out.shape == expected
    else:  # all tokens out, the target's first: what the loss reads
        assert out.shape[:2] == inputs["hidden_states"].shape[:2] and out[:, :expected[1]].shape == expected

    meta = build_on_meta(cls, folder)
    if hasattr(spec.room, "prepare"):  # fs.OPTIONAL: what a meta build leaves unset
        spec.room.prepare(meta)
    meta_inputs = spec.example_inputs(meta.config, BATCH, TINY_SHAPES[kind], TEXT, torch.device("meta"),
                                      torch.float32)
    assert all(t.is_meta for t in meta_inputs.values() if isinstance(t, torch.Tensor))
    assert meta(**meta_inputs)[0].shape == out.shape
