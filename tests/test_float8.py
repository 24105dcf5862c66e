"""FP8 (parallel/float8.py): torchao float8 on the transformer rooms' block Linears, emulated on the CPU.

Which Linears convert (real-size FLUX.1 Kontext and Qwen-Image-Edit on meta), 2-rank runs of both scripts on
the tiny Qwen-Image-Edit against bf16, resume, export, the planner's bytes and the refusals.

    python -m pytest tests/test_float8.py -q
"""
from __future__ import annotations

import functools
import json
import os

import pytest
import torch
import torch.nn as nn

from core.errors import ConfigError
from parallel import float8
from tests.conftest import (VALIDATE, assert_validated, launch_all_resuming, launch_env, read_checkpoint, read_metrics,
                            tiny_default)

HERE = os.path.dirname(os.path.abspath(__file__))


def real_size(name: str) -> nn.Module:
    from families import SPECS
    from tools.memory_plan import meta_model
    folder = next(s.builtin_folder(name) for s in SPECS if name in s.builtins)
    return meta_model(os.path.join(folder, "transformer"))


# FLUX: 12 Linears in each of 19 double blocks, 5 in each of 38 single ones; Qwen-Image: 12 in each of 60 blocks
# but the last one's to_add_out and txt_mlp (2 Linears); modulation in neither
@pytest.mark.parametrize("name,converted", [pytest.param("flux-kontext-dev", 19 * 12 + 38 * 5, marks=pytest.mark.slow),
                                            ("qwen-image-edit", 60 * 12 - 3)])
def test_only_the_blocks_linears_convert(name, converted):
    """Every Linear of the blocks but modulation (and Qwen's last text outputs, which nothing reads) becomes a
    Float8Linear; embedders, the final norm and projection stay; the state dict keeps its names (checkpoints and
    exports are unchanged); LoRA adapters stay high precision while their base layer converts."""
    from parallel.lora import Lora, add_lora
    from torchao.float8.float8_linear import Float8Linear
    model = real_size(name)
    keys = set(model.state_dict())
    assert float8.convert(model, "tensorwise", float8_all_gather=True, emulate=True) == converted
    fp8 = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert len(fp8) == converted and set(model.state_dict()) == keys
    for n in fp8:
        assert ".transformer_blocks." in f".{n}" or ".single_transformer_blocks." in f".{n}", n
        assert not any(part in n for part in ("norm1.", "norm1_context.", "norm.linear", "img_mod", "txt_mod")), n
    assert all(m.config.enable_fsdp_float8_all_gather for n, m in model.named_modules() if n in fp8)
    lora = real_size(name)
    add_lora(lora, Lora(rank=4))
    float8.convert(lora, "rowwise", float8_all_gather=True, emulate=True)
    adapted = {n for n, m in lora.named_modules() if isinstance(m, Float8Linear)}
    assert adapted and not any(".lora_" in n for n in adapted)
    assert {n for n in adapted if n.endswith(".base_layer")}  # the adapted layers' frozen bases
    assert not any(m.config.enable_fsdp_float8_all_gather for n, m in lora.named_modules() if n in adapted)


def test_refusals_are_one_line():
    with pytest.raises(ConfigError, match="FP8='e4m3': choose tensorwise, rowwise"):
        float8.check_fp8("e4m3", base_dtype="")
    with pytest.raises(ConfigError, match="FP8 with BASE_DTYPE=nf4"):
        float8.check_fp8("tensorwise", base_dtype="nf4")
    float8.check_fp8("rowwise", base_dtype="", device=torch.device("cpu"))


@pytest.mark.slow
def test_the_planner_gathers_float8_weights():
    """FP8=tensorwise: a full model's units gather the converted weights at 1 byte, the rest at 2 (bf16)."""
    from tools import memory_plan
    from tools.memory_plan import Settings
    plain = memory_plan.plan("flux-kontext-dev", Settings(world_size=8, resolution=512))
    fp8 = memory_plan.plan("flux-kontext-dev", Settings(world_size=8, resolution=512, fp8="tensorwise"))
    model = real_size("flux-kontext-dev")
    block = model.transformer_blocks[0]
    weights = sum(m.weight.numel() for n, m in block.named_modules() if n in {
        n[len("transformer_blocks.0."):] for n in float8.fp8_linears(model) if n.startswith("transformer_blocks.0.")})
    assert plain["largest_unit"] - fp8["largest_unit"] == weights  # (2 - 1) bytes each
    assert fp8["rows"]["transformer"]["params"] - plain["rows"]["transformer"]["params"] == 4 * (19 * 12 + 38 * 5)
    # one rank per shard group gathers nothing: the weights are cast in bf16 as without FP8
    one = [memory_plan.plan("flux-kontext-dev", Settings(world_size=1, resolution=512, fp8=fp8_))["largest_unit"]
           for fp8_ in ("", "tensorwise")]
    assert one[0] == one[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """train_flux_kontext.py on the tiny Qwen-Image-Edit, 2 ranks, bf16-mixed, 4 steps: without FP8, with each
    recipe, tensorwise resumed from its step-2 checkpoint; train_dmd.py with FP8=tensorwise (full generator and
    fake score, the teacher frozen)."""
    root = tmp_path_factory.mktemp("fp8")
    model, data = tiny_default("qwen_image_edit")
    env = launch_env()
    common = [f"--model_path={model}", f"--data_path={os.path.join(data, 'data.jsonl')}",
              f"--text_cache_dir={root / 'tc'}", "--precision=bf16-mixed", "--resolution=64",
              "--reference_area=4096", "--condition_area=4096", "--batch_size=1", "--log_every=1", "--seed=1"]
    tune = common + ["--max_steps=4", "--save_every=2", "--sample_every=0", "--val_every=0", "--lr=1e-3"]
    out = {k: root / k for k in ("bf16", "tensorwise", "rowwise", "stopped", "dmd", "one_rank")}
    job = functools.partial(dict, script="train_flux_kontext.py", ranks=2, env=env)
    done = launch_all_resuming({
        "bf16": job(args=tune + [f"--output_dir={out['bf16']}"]),
        "tensorwise": job(args=tune + [f"--output_dir={out['tensorwise']}", "--fp8=tensorwise"]),
        "rowwise": job(args=tune + [f"--output_dir={out['rowwise']}", "--fp8=rowwise"]),
        "dmd": job(script="train_dmd.py", args=common + [
            f"--output_dir={out['dmd']}", "--fp8=tensorwise", "--max_steps=2", "--save_every=0", "--sample_every=0",
            "--dfake_gen_update_ratio=1", "--denoising_steps=999,749,499,249", *VALIDATE]),
        # one rank: FSDP2 leaves weights with an all-gather extension unsharded there, so no float8 all-gather
        "one_rank": job(ranks=1, args=tune + [f"--output_dir={out['one_rank']}", "--fp8=tensorwise", "--max_steps=2",
                                              "--save_every=0"])},
        "tensorwise", job(args=tune + [f"--output_dir={out['stopped']}", "--fp8=tensorwise", "--resume=auto"]))
    return {"out": out, "logs": {k: v.stdout for k, v in done.items()}, "model": model}


@pytest.mark.slow
def test_float8_tracks_bf16_and_resumes_exactly(runs):
    """Both recipes run in float8 (the log says how many Linears) and their losses stay within 2^-3 of bf16's,
    relative: each fp8 product rounds both operands to e4m3 (3 mantissa bits, 2^-4 each), so one product is off by
    at most ~2^-3 and the loss, a mean of squares of such outputs, by about as much; bf16's own rounding is 2^-9.
    They differ from bf16 (the casts happen). Resuming tensorwise at step 2 is bit-exact."""
    base = [r["loss"] for r in read_metrics(runs["out"]["bf16"], timing=False)]
    for recipe in ("tensorwise", "rowwise"):
        assert f"FP8 {recipe}: 21 of QwenImageTransformer2DModel's 34 Linears in float8" in runs["logs"][recipe]
        losses = [r["loss"] for r in read_metrics(runs["out"][recipe], timing=False)]
        assert losses == pytest.approx(base, rel=2 ** -3) and losses != base, recipe
    assert "trained weights all-gathered in float8" in runs["logs"]["tensorwise"]
    assert "all-gathered" not in runs["logs"]["rowwise"]
    # one rank per shard group: float8 Linears without the all-gather, every weight sharded, finite losses
    assert "FP8 tensorwise: 21 of" in runs["logs"]["one_rank"] and "all-gathered" not in runs["logs"]["one_rank"]
    assert len(read_metrics(runs["out"]["one_rank"], timing=False)) == 2
    a, b = read_checkpoint(runs["out"]["tensorwise"], 4), read_checkpoint(runs["out"]["stopped"], 4)
    assert all(torch.equal(a["model.transformer"][k], v) for k, v in b["model.transformer"].items())
    assert read_metrics(runs["out"]["tensorwise"])[-1]["loss"] == read_metrics(runs["out"]["stopped"])[-1]["loss"]


@pytest.mark.slow
def test_float8_export_holds_plain_weights_the_pipeline_loads(runs):
    """The export is the ordinary bf16 folder: plain tensors equal to the final weights, loaded by
    QwenImageEditPlusPipeline into plain Linears."""
    from diffusers import QwenImageEditPlusPipeline
    from safetensors.torch import load_file
    export = runs["out"]["tensorwise"] / "export"
    weights = load_file(str(export / "transformer" / "diffusion_pytorch_model.safetensors"))
    final = read_checkpoint(runs["out"]["tensorwise"], 4)["model.transformer"]
    assert {v.dtype for v in weights.values()} == {torch.bfloat16}
    assert {type(v) for v in weights.values()} == {torch.Tensor}
    assert all(torch.equal(weights[k], v.to(torch.bfloat16)) for k, v in final.items())
    pipe = QwenImageEditPlusPipeline.from_pretrained(str(export))
    assert all(type(m) is nn.Linear for m in pipe.transformer.modules() if isinstance(m, nn.Linear))


@pytest.mark.slow
def test_dmd_runs_its_transformers_in_float8(runs):
    """train_dmd.py: generator and fake score with float8 all-gather, the frozen teacher converted without it;
    its validation (VAL_EVERY) runs on them."""
    log = runs["logs"]["dmd"]
    assert log.count("Linears in float8, trained weights all-gathered in float8") == 2, log[-3000:]
    assert log.count("Linears in float8 (emulated") == 1
    rows = read_metrics(runs["out"]["dmd"], timing=False)
    assert len(rows) == 2 and all(torch.isfinite(torch.tensor(r["loss_fake"])) for r in rows)
    assert_validated(runs["out"]["dmd"], [2])  # validation samples the float8 generator and the teacher
    assert json.load(open(runs["out"]["dmd"] / "export" / "transformer" / "config.json"))


def test_fp8_with_a_unet_teacher_or_nf4_is_refused_before_any_work():
    import train_dmd
    from components.config import script_constants
    from families import sd_unet
    with pytest.raises(ConfigError, match="FP8=tensorwise with a UNet teacher"):
        sd_unet.check_dmd_settings({**script_constants(vars(train_dmd)), "FP8": "tensorwise"}, set())
