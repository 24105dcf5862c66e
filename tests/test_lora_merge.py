"""A LoRA export on its base (parallel/lora_merge.py), against diffusers' own load and fuse of the same file:
merged as the base loads (train_dmd.py's TEACHER_LORA), written into a full folder (tools/merge_lora.py),
and joined with a student's adapters into one file that loads on the plain base.

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
