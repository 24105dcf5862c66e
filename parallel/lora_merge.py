"""A LoRA export on its base: read once, added into the base weights as they load (a DMD2 teacher that is
a base plus a fine-tune's adapters, no merged folder needed), written into a full folder
(tools/merge_lora.py), or joined with a student's adapters into one file that loads on the base.

The file is diffusers' LoRA format (components/export.py writes it with the pipeline's
`save_lora_weights`): `<component>.<module>.lora_A.weight` (r, in) and `.lora_B.weight` (out, r), the
LoraConfig in the header's `lora_adapter_metadata`; the weight is W + scale · B @ A with scale =
lora_alpha / r (peft tuners/lora/layer.py update_layer; / sqrt(r) with use_rslora), per module by
rank_pattern / alpha_pattern. A file without metadata scales by 1, as diffusers' load does (alpha = r).

Any other key form (kohya / sd-scripts `lora_unet_` with `lora_down` / `lora_up` / `.alpha`, ai-toolkit,
musubi-tuner, ComfyUI and LightX2V `diffusion_model.`, peft's `base_model.model.`) goes through the base
pipeline's own `lora_state_dict` (diffusers' converters, loaders/lora_conversion_utils.py), as its
`load_lora_weights` reads the file; what is not a plain B @ A delta (DoRA, LoKr / LoHa, norm `.diff`,
biases, LoCon's mid) is refused in one line naming the key, before diffusers would drop it with a warning.

    python -m pytest tests/test_lora_merge.py -q
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

from core.errors import ConfigError

LORA_WEIGHTS = "pytorch_lora_weights.safetensors"


@dataclass
class LoraDelta:
    """One LoRA file's adapters of one component: {module: (A, B, scale)}, on the CPU in fp32."""
    path: str
    layers: dict

    def weight_keys(self) -> set[str]:
        return {f"{m}.weight" for m in self.layers}

    def delta(self, key: str) -> torch.Tensor | None:
        """scale · B @ A for the base tensor `key` (`<module>.weight`), fp32; None for an unadapted one."""
        if not key.endswith(".weight") or key[:-len(".weight")] not in self.layers:
            return None
        a, b, scale = self.layers[key[:-len(".weight")]]
        return (b @ a) * scale

    def check_base(self, shapes: dict, where: str) -> None:
        """Every adapted module is a 2-D tensor of the base (`shapes`: {name: shape}) of B @ A's shape, else
        one line naming the first that is not."""
        missing = sorted(self.weight_keys() - set(shapes))
        if missing:
            raise ConfigError(f"{self.path}: adapts {missing[0][:-len('.weight')]}, which {where} lacks "
                              f"({len(missing)} such modules): not a LoRA of this model")
        for module, (a, b, _) in sorted(self.layers.items()):
            if list(shapes[f"{module}.weight"]) != [b.shape[0], a.shape[1]]:
                raise ConfigError(f"{self.path}: {module}'s adapters make a {b.shape[0]}x{a.shape[1]} delta, the "
                                  f"weight in {where} is {list(shapes[module + '.weight'])}: not a LoRA of this model")


def lora_file(path: str) -> str:
    """The .safetensors of a LoRA export folder (or the file itself), else one line."""
    file = os.path.join(path, LORA_WEIGHTS) if os.path.isdir(path) else path
    if not (file.endswith(".safetensors") and os.path.isfile(file)):
        raise ConfigError(f"{path}: no {LORA_WEIGHTS} (a LoRA export folder or its .safetensors file)")
    return file


def scale_of(module: str, config: dict) -> float:
    """lora_alpha / r of `module` by the LoraConfig's patterns (peft matches a pattern as a name suffix)."""
    def pick(pattern: dict, default):
        for key, value in pattern.items():
            if re.fullmatch(rf"(.*\.)?{key}", module):
                return value
        return default
    r = pick(config.get("rank_pattern") or {}, config.get("r"))
    alpha = pick(config.get("alpha_pattern") or {}, config.get("lora_alpha"))
    return alpha / (math.sqrt(r) if config.get("use_rslora") else r)


# key parts of adapters that are not a B @ A delta, and what they are
NOT_LORA = {"dora_scale": "DoRA's magnitude", "lokr_": "a LoKr factor", "hada_": "a LoHa factor",
            "lora_mid": "LoCon's mid (Tucker) factor", ".diff": "a full-weight difference (.diff / .diff_b)",
            ".bias": "a bias"}


def _pair_key(component: str) -> str:
    return rf"{re.escape(component)}\.(.+)\.lora_([AB])\.weight"


def convert_foreign(file: str, tensors: dict, pipeline: str) -> tuple[dict, dict]:
    """A LoRA file in another tool's key form, as `pipeline`'s `load_lora_weights` reads it: ({diffusers
    key: tensor}, {module key prefix: alpha}). The converters fold alpha / r into the tensors; FLUX.1's
    files with `.alpha` beside diffusers-named pairs keep it apart (network_alphas), scaled here as
    diffusers' load does."""
    import inspect

    import diffusers
    for key in tensors:
        for part, what in NOT_LORA.items():
            if part in key:
                raise ConfigError(f"{file}: tensor {key!r} is {what}, not a LoRA pair's: only plain B @ A "
                                  "adapters merge into the base")
    loader = getattr(diffusers, pipeline, None)
    if loader is None or not hasattr(loader, "lora_state_dict"):
        raise ConfigError(f"{file}: not in diffusers' LoRA format, and {pipeline or 'the base'} has no "
                          "lora_state_dict to convert it")
    alphas_too = "return_alphas" in inspect.signature(loader.lora_state_dict).parameters
    try:
        out = loader.lora_state_dict(file, **({"return_alphas": True} if alphas_too else {}))
    except (ValueError, KeyError, AssertionError, IndexError) as e:
        raise ConfigError(f"{file}: {pipeline}.lora_state_dict could not read its keys: {e}") from None
    state, alphas = out if isinstance(out, tuple) else (out, None)
    return state, {k[:-len(".alpha")]: float(v) for k, v in (alphas or {}).items()}


def read_lora(path: str, component: str = "transformer", pipeline: str = "") -> LoraDelta:
    """The adapters of `component` in a LoRA export (folder or file), each with its scale. A file in another
    tool's key form is converted by `pipeline`'s (the base's model_index.json `_class_name`) lora_state_dict;
    anything other than plain LoRA pairs refused in one line."""
    from safetensors import safe_open
    file = lora_file(path)
    with safe_open(file, framework="pt") as f:
        meta = (f.metadata() or {}).get("lora_adapter_metadata")
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    config, alphas = {}, {}
    if pipeline and not all(re.fullmatch(_pair_key(component), k) for k in tensors):
        tensors, alphas = convert_foreign(file, tensors, pipeline)
        meta = None  # a converted file's scales are in its tensors (or its alphas)
    if meta:
        config = {k[len(component) + 1:]: v for k, v in json.loads(meta).items() if k.startswith(component + ".")}
        if config.get("use_dora"):
            raise ConfigError(f"{file}: a DoRA adapter (use_dora): its magnitude vector is not a plain B @ A delta")
    prefix = component + "."
    pairs: dict[str, dict] = {}
    for key, t in tensors.items():
        m = re.fullmatch(_pair_key(component), key)
        if m is None:
            raise ConfigError(f"{file}: tensor {key!r} is not a {component} LoRA pair's "
                              f"({prefix}<module>.lora_A.weight / .lora_B.weight, diffusers' format)")
        pairs.setdefault(m.group(1), {})[m.group(2)] = t.float()
    if not pairs:
        raise ConfigError(f"{file}: no {component} adapters")
    layers = {}
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"} or ab["A"].dim() != 2 or ab["B"].shape[1] != ab["A"].shape[0]:
            raise ConfigError(f"{file}: {module} has no matching lora_A / lora_B pair of 2-D tensors")
        scale = scale_of(module, config) if config.get("r") else 1.0
        if f"{prefix}{module}" in alphas:  # diffusers' load: lora_alpha / r of this module
            scale = alphas[f"{prefix}{module}"] / ab["A"].shape[0]
        layers[module] = (ab["A"], ab["B"], scale)
    return LoraDelta(file, layers)


def check_adapters(delta: LoraDelta, targets: list[str], rank: int, setting: str) -> None:
    """`delta` can start a LoRA model whose adapters are `targets` (peft's target_modules: module names or their
    suffixes) at `rank`: every module it adapts is a target, at that rank, else one line naming the first that is
    not (before any work)."""
    for module, (a, _, _) in sorted(delta.layers.items()):
        if not any(module == t or module.endswith("." + t) for t in targets):
            raise ConfigError(f"{setting}={delta.path}: adapts {module}, which LORA_TARGET_MODULES does not target "
                              f"({', '.join(targets[:4])}{', ...' if len(targets) > 4 else ''}): set "
                              "LORA_TARGET_MODULES to cover the file's modules")
        if a.shape[0] != rank:
            raise ConfigError(f"{setting}={delta.path}: {module} has rank {a.shape[0]}, LORA_RANK={rank}: "
                              f"set LORA_RANK={a.shape[0]}")


@torch.no_grad()
def load_adapters(model: torch.nn.Module, delta: LoraDelta) -> None:
    """Start `model`'s peft adapters (parallel/lora.add_lora, sharded or whole, already initialised) as `delta`'s:
    each adapted module's lora_A is the file's A and its lora_B the file's B times the file's scale over the
    model's, so that the model's scale · B @ A is the file's delta (check_adapters first). Modules the file does
    not adapt keep their init (lora_B = 0: no change)."""
    from fsdp_utils import fill_local
    config = model.peft_config["default"]
    own = {"r": config.r, "lora_alpha": config.lora_alpha, "use_rslora": config.use_rslora,
           "rank_pattern": config.rank_pattern, "alpha_pattern": config.alpha_pattern}
    params = dict(model.named_parameters())
    for module, (a, b, scale) in delta.layers.items():
        b = b * (scale / scale_of(module, own))
        fill_local(params[f"{module}.lora_A.default.weight"], lambda index: a[index])
        fill_local(params[f"{module}.lora_B.default.weight"], lambda index: b[index])


def joined(student: dict, scales: dict, teacher: LoraDelta) -> tuple[dict, dict]:
    """One adapter set equal to a teacher's adapters plus a student's: ({`<module>.lora_A.weight` /
    `.lora_B.weight`: tensor}, the LoraConfig fields r, lora_alpha, rank_pattern, alpha_pattern,
    target_modules). Each module's A stacks both A's and its B both B's times their scales (rank
    r_student + r_teacher where both adapt it), so that with lora_alpha = r everywhere the scale is 1 and
    B @ A is the sum of both deltas. `student`: {module: (A, B)}; `scales`: {module: its scale}."""
    out, ranks = {}, {}
    for module in sorted(set(student) | set(teacher.layers)):
        a_parts, b_parts = [], []
        if module in student:
            a, b = student[module]
            a_parts.append(a.float())
            b_parts.append(b.float() * scales[module])
        if module in teacher.layers:
            a, b, s = teacher.layers[module]
            a_parts.append(a)
            b_parts.append(b * s)
        out[f"{module}.lora_A.weight"] = torch.cat(a_parts, 0)
        out[f"{module}.lora_B.weight"] = torch.cat(b_parts, 1)
        ranks[module] = out[f"{module}.lora_A.weight"].shape[0]
    common = max(set(ranks.values()), key=list(ranks.values()).count)
    pattern = {m: r for m, r in ranks.items() if r != common}
    return out, {"r": common, "lora_alpha": common, "rank_pattern": pattern, "alpha_pattern": dict(pattern),
                 "target_modules": sorted(ranks), "use_rslora": False}
