"""A LoRA export on its base (parallel/lora_merge.py), against diffusers' own load and fuse of the same file:
merged as the base loads (train_dmd.py's TEACHER_LORA), written into a full folder (tools/merge_lora.py),
and joined with a student's adapters into one file that loads on the plain base; other tools' key forms
(kohya, ai-toolkit, musubi-tuner, LightX2V, ComfyUI, peft) for Qwen-Image-Edit, FLUX.1 Kontext and FLUX.2
against the pipeline's own reading of them.

    python -m pytest tests/test_lora_merge.py -q
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from core.errors import ConfigError
from parallel import lora_merge
from parallel.loading import build_on_meta, materialize_and_load

BASE = os.path.join(os.path.dirname(__file__), "..", "assets", "qwen_edit_base")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def transformer():
    from diffusers import QwenImageTransformer2DModel
    return QwenImageTransformer2DModel.from_pretrained(os.path.join(BASE, "transformer"), low_cpu_mem_usage=False)


def base_weights(model) -> dict:
    """{safetensors name: tensor} of a (possibly fused, adapter-wrapped) model, adapters left out."""
    return {n.replace(".base_layer.", "."): p.detach().clone() for n, p in model.named_parameters()
            if ".lora_" not in n}


def save_lora(model, config, folder, layers=None):
    """`model`'s adapters (or `layers`) in diffusers' LoRA format, as components/export.export_lora writes them."""
    from diffusers import QwenImageEditPlusPipeline
    from peft.utils import get_peft_model_state_dict
    QwenImageEditPlusPipeline.save_lora_weights(
        str(folder), weight_name=lora_merge.LORA_WEIGHTS,
        transformer_lora_layers=layers if layers is not None else get_peft_model_state_dict(model),
        transformer_lora_adapter_metadata=config)
    return str(folder)


def adapted(config_kwargs, seed):
    """The base with peft adapters of these LoraConfig settings, lora_B random (a trained adapter's delta)."""
    from peft import LoraConfig
    model = transformer()
    config = LoraConfig(**config_kwargs)
    model.add_adapter(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model, config.to_dict()


def fused(lora_folder) -> dict:
    """diffusers' reading of a LoRA file, as the pipeline's load_lora_weights reads it (with its metadata),
    onto the base, then fuse_lora."""
    from diffusers import QwenImageEditPlusPipeline
    state, meta = QwenImageEditPlusPipeline.lora_state_dict(lora_folder, return_lora_metadata=True)
    model = transformer()
    model.load_lora_adapter(state, prefix="transformer", metadata=meta)
    model.fuse_lora()
    return base_weights(model)


@pytest.fixture(scope="module")
def teacher_lora(tmp_path_factory):
    """A fine-tune's LoRA export: rank 4, alpha 8, with a per-module rank and alpha (rank_pattern)."""
    model, config = adapted(dict(r=4, lora_alpha=8, target_modules=["to_q", "to_v", "img_mlp.net.2"],
                                 rank_pattern={"to_v": 2}, alpha_pattern={"to_v": 6}), seed=0)
    return save_lora(model, config, tmp_path_factory.mktemp("teacher_lora"))


def test_merged_as_it_loads_is_diffusers_fuse(teacher_lora):
    """Each rank's base + the LoRA, merged as the tensors load (every scale by its pattern), equals the base
    that diffusers loads the file onto and fuses; unadapted tensors are the base's own."""
    from diffusers import QwenImageTransformer2DModel
    model = build_on_meta(QwenImageTransformer2DModel, os.path.join(BASE, "transformer"))
    merge = lora_merge.read_lora(teacher_lora)
    assert {s for _, _, s in merge.layers.values()} == {2.0, 3.0}  # 8 / 4 and to_v's 6 / 2
    materialize_and_load(model, os.path.join(BASE, "transformer"), torch.device("cpu"), merge)
    ours, ref, plain = base_weights(model), fused(teacher_lora), base_weights(transformer())
    assert ours.keys() == ref.keys()
    changed = 0
    for k, v in ref.items():
        torch.testing.assert_close(ours[k], v, msg=k)  # fp32: one B @ A each side, summed into W once
        changed += not torch.equal(v, plain[k])
    assert changed == len(merge.layers) == 3 * 3  # 3 modules in each of the 3 blocks


def test_rslora_scale_is_diffusers_fuse(tmp_path):
    """A LoRA trained with use_rslora (peft's rank-stabilised scale alpha / sqrt(r), with a per-module rank and
    alpha) merged as it loads equals diffusers' load_lora_weights + fuse_lora of the same file."""
    from diffusers import QwenImageTransformer2DModel
    model, config = adapted(dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["to_q", "to_v"],
                                 rank_pattern={"to_v": 2}, alpha_pattern={"to_v": 6}), seed=2)
    folder = save_lora(model, config, tmp_path / "rslora")
    merge = lora_merge.read_lora(folder)
    assert {s for _, _, s in merge.layers.values()} == {8 / 2, 6 / 2 ** 0.5}  # alpha / sqrt(r), not alpha / r
    model = build_on_meta(QwenImageTransformer2DModel, os.path.join(BASE, "transformer"))
    materialize_and_load(model, os.path.join(BASE, "transformer"), torch.device("cpu"), merge)
    ours, ref = base_weights(model), fused(folder)
    assert ours.keys() == ref.keys()
    for k, v in ref.items():
        torch.testing.assert_close(ours[k], v, msg=k)


@pytest.mark.slow  # 4.6 s: a whole pipeline folder written and loaded; the fast loop's budget
def test_merge_tool_writes_a_folder_the_pipeline_loads(teacher_lora, tmp_path):
    """tools/merge_lora.py BASE LORA OUT: a full pipeline folder, the transformer merged, the rest linked
    or copied as files (no symlink into BASE)."""
    from diffusers import QwenImageEditPlusPipeline
    from safetensors.torch import load_file
    out = tmp_path / "merged"
    r = subprocess.run([sys.executable, "tools/merge_lora.py", BASE, teacher_lora, str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not any(os.path.islink(os.path.join(d, f)) for d, _, fs in os.walk(out) for f in fs)
    pipe = QwenImageEditPlusPipeline.from_pretrained(str(out))
    ref = fused(teacher_lora)
    stored = load_file(os.path.join(BASE, "transformer", "diffusion_pytorch_model.safetensors"))
    for k, v in base_weights(pipe.transformer).items():  # written in the base's own dtype
        torch.testing.assert_close(v, ref[k].to(stored[k].dtype).float(), msg=k)
    again = subprocess.run([sys.executable, "tools/merge_lora.py", BASE, teacher_lora, str(out)], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode != 0 and again.stderr.strip().splitlines()[-1].startswith("error: "), again.stderr


def test_joined_adapters_load_as_the_sum(teacher_lora, tmp_path):
    """A student's adapters joined with the teacher's (a DMD2 export on a base + LoRA teacher) load on the
    plain base with diffusers as base + teacher delta + student delta, modules of either or both."""
    from peft.utils import get_peft_model_state_dict
    student, config = adapted(dict(r=2, lora_alpha=1, target_modules=["to_q", "to_k"]), seed=1)
    layers = get_peft_model_state_dict(student)
    tail = ".lora_A.weight"
    own = {k[:-len(tail)]: (v, layers[k[:-len(tail)] + ".lora_B.weight"])
           for k, v in layers.items() if k.endswith(tail)}
    joined, fields = lora_merge.joined(own, dict.fromkeys(own, 0.5), lora_merge.read_lora(teacher_lora))
    folder = save_lora(None, {**config, **fields}, tmp_path / "joined", layers=joined)
    teacher_fused = fused(teacher_lora)
    student.fuse_lora()
    student_fused, plain = base_weights(student), base_weights(transformer())
    for k, v in fused(folder).items():
        torch.testing.assert_close(v, teacher_fused[k] + student_fused[k] - plain[k], msg=k)


def test_a_lora_of_another_model_is_one_line(teacher_lora, tmp_path):
    from safetensors.torch import load_file, save_file
    merge = lora_merge.read_lora(teacher_lora)
    shapes = {k: list(v.shape) for k, v in base_weights(transformer()).items()}
    merge.check_base(shapes, "the base")
    with pytest.raises(ConfigError, match=r"adapts transformer_blocks\.0\.attn\.to_q, which the base lacks"):
        merge.check_base({k: s for k, s in shapes.items() if "blocks.0.attn.to_q" not in k}, "the base")
    key = "transformer_blocks.0.attn.to_q.weight"
    with pytest.raises(ConfigError, match=r"to_q's adapters make a 128x128 delta, the weight in the base is "
                                          r"\[128, 64\]"):
        merge.check_base({**shapes, key: [128, 64]}, "the base")
    tensors = load_file(os.path.join(teacher_lora, lora_merge.LORA_WEIGHTS))
    save_file({**tensors, "transformer.x.alpha": torch.ones(())}, str(tmp_path / "kohya.safetensors"))
    with pytest.raises(ConfigError, match=r"tensor 'transformer\.x\.alpha' is not a transformer LoRA pair's"):
        lora_merge.read_lora(str(tmp_path / "kohya.safetensors"))
    with pytest.raises(ConfigError, match="no pytorch_lora_weights.safetensors"):
        lora_merge.read_lora(str(tmp_path))
    meta = json.dumps({"transformer.r": 4, "transformer.lora_alpha": 4, "transformer.use_dora": True})
    save_file(tensors, str(tmp_path / "dora.safetensors"), metadata={"lora_adapter_metadata": meta})
    with pytest.raises(ConfigError, match="DoRA"):
        lora_merge.read_lora(str(tmp_path / "dora.safetensors"))


# ----------------------------------------------------------------------------------------------
# other tools' key forms, read through the base pipeline's lora_state_dict


def deltas(merge: lora_merge.LoraDelta) -> dict:
    return {m: (b @ a) * s for m, (a, b, s) in merge.layers.items()}


def write(folder, name: str, tensors: dict) -> str:
    from safetensors.torch import save_file
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    save_file({k: v.contiguous() for k, v in tensors.items()}, path)
    return path


def fused_foreign(pipeline: str, model, file: str) -> dict:
    """diffusers' reading of `file` as `pipeline`.load_lora_weights reads it (its lora_state_dict, then the
    transformer's load_lora_adapter with FLUX.1's network_alphas), onto `model`, then fuse_lora."""
    import inspect

    import diffusers
    loader = getattr(diffusers, pipeline)
    if "return_alphas" in inspect.signature(loader.lora_state_dict).parameters:
        state, alphas = loader.lora_state_dict(file, return_alphas=True)
    else:
        state, alphas = loader.lora_state_dict(file), None
    model.load_lora_adapter(state, prefix="transformer", network_alphas=alphas)
    model.fuse_lora()
    return base_weights(model)


def assert_same_adapters(foreign: str, pipeline: str, reference: lora_merge.LoraDelta, build, folder) -> None:
    """`foreign` read through `pipeline`'s converter makes the deltas of the diffusers-form `reference`, and
    the base merged with it as it loads equals diffusers' load + fuse of the foreign file."""
    merge = lora_merge.read_lora(foreign, pipeline=pipeline)
    ours, ref = deltas(merge), deltas(reference)
    assert ours.keys() == ref.keys()
    for m, d in ref.items():  # alpha / r folded into A by the converter instead of applied to B @ A: a rounding
        torch.testing.assert_close(ours[m], d, msg=m)
    model = build_on_meta(type(build()), folder)
    materialize_and_load(model, folder, torch.device("cpu"), merge)
    merged, theirs = base_weights(model), fused_foreign(pipeline, build(), foreign)
    assert merged.keys() == theirs.keys()
    for k, v in theirs.items():
        torch.testing.assert_close(merged[k], v, msg=k)


def test_qwen_lora_in_other_tools_forms_merges_as_the_pipeline_loads_it(teacher_lora, tmp_path):
    """Qwen-Image-Edit: kohya / musubi-tuner (`lora_unet_<module with _>` lora_down / lora_up / .alpha),
    ai-toolkit and ComfyUI (`diffusion_model.` + lora_A / lora_B / .alpha), LightX2V (`diffusion_model.` +
    lora_down / lora_up / .alpha) and peft's adapter-named keys (`.default.`), each made from the diffusers-form
    file (its per-module scales 2 and 3 as alpha = scale · r)."""
    reference = lora_merge.read_lora(teacher_lora)
    forms = {"kohya": ("lora_unet_{flat}", "lora_down", "lora_up", True),
             "ai_toolkit": ("diffusion_model.{m}", "lora_A", "lora_B", True),
             "lightx2v": ("diffusion_model.{m}", "lora_down", "lora_up", True),
             "peft_default": ("{m}", "lora_A.default", "lora_B.default", False)}
    for form, (name, a_key, b_key, alpha) in forms.items():
        tensors = {}
        for m, (a, b, s) in reference.layers.items():
            stem = name.format(m=m, flat=m.replace(".", "_"))
            tensors[f"{stem}.{a_key}.weight"] = a if alpha else a * s
            tensors[f"{stem}.{b_key}.weight"] = b
            if alpha:
                tensors[f"{stem}.alpha"] = torch.tensor(s * a.shape[0])
        file = write(tmp_path, f"{form}.safetensors", tensors)
        assert_same_adapters(file, "QwenImageEditPlusPipeline", reference, transformer,
                             os.path.join(BASE, "transformer"))


KONTEXT = os.path.join(ROOT, "assets", "kontext_base", "transformer")


def kontext_transformer():
    from diffusers import FluxTransformer2DModel
    return FluxTransformer2DModel.from_pretrained(KONTEXT, low_cpu_mem_usage=False)


def diffusers_adapter(model, scale: float, seed: int, targets: str):
    """A rank-2 peft adapter of `targets` (a regex) on `model` with lora_alpha = scale * r and random lora_B:
    ({module: (A, B)}, its LoraDelta as a diffusers-form file of it reads)."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict
    model.add_adapter(LoraConfig(r=2, lora_alpha=2 * scale, target_modules=targets))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    state = get_peft_model_state_dict(model)
    pairs = {k[:-len(".lora_A.weight")]: (v, state[k.replace("lora_A", "lora_B")]) for k, v in state.items()
             if k.endswith(".lora_A.weight")}
    return pairs, lora_merge.LoraDelta("diffusers form", {m: (a.float(), b.float(), scale)
                                                          for m, (a, b) in pairs.items()})


def block_diag_pair(pairs):
    """One fused Linear's adapter (A stacked, B block-diagonal) whose split by rows is each pair's B @ A:
    how a fused-qkv tool's file holds separate q, k and v adapters."""
    return torch.cat([a for a, _ in pairs]), torch.block_diag(*[b for _, b in pairs])


def test_flux_kontext_lora_in_kohya_and_alpha_forms_merges_as_the_pipeline_loads_it(tmp_path):
    """FLUX.1 Kontext: sd-scripts / kohya (BFL's module names, q, k and v fused into one `qkv` adapter,
    lora_down / lora_up / .alpha) and diffusers-named pairs with `.alpha` keys (network_alphas), each made from
    a diffusers-form adapter with scale 2."""
    pairs, reference = diffusers_adapter(kontext_transformer(), 2.0, 3, (
        r"transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)"
        r"|ff\.net\.0\.proj)|single_transformer_blocks\.\d+\.proj_out"))
    kohya = {}

    def put(stem, a, b):
        kohya.update({f"lora_unet_{stem}.lora_down.weight": a, f"lora_unet_{stem}.lora_up.weight": b,
                      f"lora_unet_{stem}.alpha": torch.tensor(2.0 * a.shape[0])})
    blocks = {int(m.split(".")[1]) for m in pairs if m.startswith("transformer_blocks.")}
    for i in blocks:
        t = f"transformer_blocks.{i}"
        put(f"double_blocks_{i}_img_attn_qkv",
            *block_diag_pair([pairs[f"{t}.attn.{p}"] for p in ("to_q", "to_k", "to_v")]))
        put(f"double_blocks_{i}_txt_attn_qkv",
            *block_diag_pair([pairs[f"{t}.attn.{p}"] for p in ("add_q_proj", "add_k_proj", "add_v_proj")]))
        put(f"double_blocks_{i}_img_attn_proj", *pairs[f"{t}.attn.to_out.0"])
        put(f"double_blocks_{i}_txt_attn_proj", *pairs[f"{t}.attn.to_add_out"])
        put(f"double_blocks_{i}_img_mlp_0", *pairs[f"{t}.ff.net.0.proj"])
    for m, (a, b) in pairs.items():
        if m.startswith("single_transformer_blocks."):
            put(f"single_blocks_{m.split('.')[1]}_linear2", a, b)
    files = {"kohya": write(tmp_path, "kohya.safetensors", kohya),
             "alpha": write(tmp_path, "alpha.safetensors", {
                 **{f"transformer.{m}.lora_A.weight": a for m, (a, _) in pairs.items()},
                 **{f"transformer.{m}.lora_B.weight": b for m, (_, b) in pairs.items()},
                 **{f"transformer.{m}.alpha": torch.tensor(2.0 * a.shape[0]) for m, (a, _) in pairs.items()}})}
    for file in files.values():
        assert_same_adapters(file, "FluxKontextPipeline", reference, kontext_transformer, KONTEXT)


def test_flux2_lora_in_ai_toolkit_form_merges_as_the_pipeline_loads_it(tmp_path):
    """FLUX.2: ai-toolkit / ComfyUI (`diffusion_model.` + BFL's names: q, k and v fused into `qkv`, the single
    blocks' `linear1` / `linear2`), made from a diffusers-form adapter (scale 1: the converter reads no alpha)."""
    from diffusers import Flux2Transformer2DModel

    from tests.conftest import tiny_default
    folder = os.path.join(tiny_default("flux2_klein")[0], "transformer")

    def build():
        return Flux2Transformer2DModel.from_pretrained(folder, low_cpu_mem_usage=False)
    pairs, reference = diffusers_adapter(build(), 1.0, 4, (
        r"transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)"
        r"|ff\.linear_in)|single_transformer_blocks\.\d+\.attn\.(to_qkv_mlp_proj|to_out)"))
    tool = {}

    def put(name, a, b):
        tool.update({f"diffusion_model.{name}.lora_A.weight": a, f"diffusion_model.{name}.lora_B.weight": b})
    for i in {int(m.split(".")[1]) for m in pairs if m.startswith("transformer_blocks.")}:
        t = f"transformer_blocks.{i}"
        put(f"double_blocks.{i}.img_attn.qkv",
            *block_diag_pair([pairs[f"{t}.attn.{p}"] for p in ("to_q", "to_k", "to_v")]))
        put(f"double_blocks.{i}.txt_attn.qkv",
            *block_diag_pair([pairs[f"{t}.attn.{p}"] for p in ("add_q_proj", "add_k_proj", "add_v_proj")]))
        put(f"double_blocks.{i}.img_attn.proj", *pairs[f"{t}.attn.to_out.0"])
        put(f"double_blocks.{i}.txt_attn.proj", *pairs[f"{t}.attn.to_add_out"])
        put(f"double_blocks.{i}.img_mlp.0", *pairs[f"{t}.ff.linear_in"])
    for i in {int(m.split(".")[1]) for m in pairs if m.startswith("single_transformer_blocks.")}:
        put(f"single_blocks.{i}.linear1", *pairs[f"single_transformer_blocks.{i}.attn.to_qkv_mlp_proj"])
        put(f"single_blocks.{i}.linear2", *pairs[f"single_transformer_blocks.{i}.attn.to_out"])
    file = write(tmp_path, "ai_toolkit.safetensors", tool)
    assert_same_adapters(file, "Flux2KleinPipeline", reference, build, folder)


@pytest.mark.parametrize("key,what", [
    ("diffusion_model.transformer_blocks.0.attn.to_q.dora_scale", "DoRA's magnitude"),
    ("lycoris_transformer_blocks_0_attn_to_q.lokr_w1", "a LoKr factor"),
    ("diffusion_model.transformer_blocks.0.img_norm1.diff", "a full-weight difference"),
    ("diffusion_model.transformer_blocks.0.attn.to_q.lora_B.bias", "a bias")])
def test_what_is_not_a_plain_delta_is_one_line_naming_the_key(teacher_lora, tmp_path, key, what):
    from safetensors.torch import load_file
    tensors = {k.replace("transformer.", "diffusion_model.", 1): v
               for k, v in load_file(os.path.join(teacher_lora, lora_merge.LORA_WEIGHTS)).items()}
    file = write(tmp_path, "other.safetensors", {**tensors, key: torch.ones(4)})
    with pytest.raises(ConfigError, match=rf"tensor '{key}' is {what}"):
        lora_merge.read_lora(file, pipeline="QwenImageEditPlusPipeline")
    if what == "a bias":  # once: without a pipeline that converts, another key form is one line too
        plain = write(tmp_path, "plain.safetensors", tensors)
        with pytest.raises(ConfigError, match=r"tensor 'diffusion_model\..+' is not a transformer LoRA pair's"):
            lora_merge.read_lora(plain)
        with pytest.raises(ConfigError, match="not in diffusers' LoRA format, and NoSuchPipeline has no"):
            lora_merge.read_lora(plain, pipeline="NoSuchPipeline")
