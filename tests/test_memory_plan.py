"""Memory planner at real scale on the meta device with a fake process group (no GPU, no weights).

    python -m pytest tests/test_memory_plan.py -q
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT

import tools.planner.plan
from tools import memory_plan
from tools.memory_plan import Settings
from families import pipelines
from parallel import lora
from parallel.model_facts import MODELS
from precision import get_precision
from families import spec_of
from families.wan import plan_spec

SMALL = dict(world_size=2, batch_size=1, resolution=64)


def test_flux_kontext_shards_to_a_quarter_at_world_size_4():
    # at 64 px: the rows do not depend on the resolution, and SMALL's activations are measured once for the file
    p = memory_plan.plan("flux-kontext-dev", Settings(world_size=4, resolution=64))
    row = p["rows"]["transformer"]
    assert abs(row["count"] - 11.90e9) < 0.01e9          # REFERENCE: ≈ 11.90 B parameters
    assert abs(row["local_count"] - 2.975e9) < 0.002e9    # 2.975 B per rank at world size 4
    # bf16-mixed: fp32 master + fp32 grads + 2 fp32 Adam states = 16 B/param -> 47.6 GB per rank
    states = row["params"] + row["grads"] + row["optim"]
    assert abs(states / 1e9 - 47.6) < 0.1
    assert p["largest_unit"] == pytest.approx(339.8e6 * 2, rel=0.01)   # one double block in bf16
    assert p["rows"]["text_encoder_2"]["params"] == 0     # T5 is not resident during training


def test_checkpointing_and_offload_shrink_the_gpu_total():
    # SMALL (64 px: 512 text + 32 image tokens), whose shards and activation profile the file plans anyway: with
    # 57 blocks, checkpointing keeps their inputs and one block's saves at any sequence length
    base = memory_plan.plan("flux-kontext-dev", Settings(**SMALL))
    ac = memory_plan.plan("flux-kontext-dev", Settings(**SMALL, activation_checkpointing=True))
    off = memory_plan.plan("flux-kontext-dev", Settings(**SMALL, activation_checkpointing=True, cpu_offload=True))
    assert ac["activations"] < base["activations"] / 4
    assert off["gpu_total"] < ac["gpu_total"] and off["host_total"] > 0


def test_auto_reshard_plans_the_scripts_choice():
    """RESHARD_AFTER_FORWARD=auto, SD-1.5 DMD2 on one GPU: both trained UNets reshard-free on 80 GB
    (their whole compute copies in flight, as with 0), the fp32 fake score's 3.2 GiB copy resharded
    on 24 GB (over 10 %); across ranks, or with the GPU unknown, as with 1."""
    def plan(world, gb, reshard=None):
        return memory_plan.plan("sd15-dmd", Settings(world_size=world, resolution=64, reshard_after_forward=reshard,
                                                     gpu_memory_gb=gb, fake_score_fp32=True))
    big, small, off, on = plan(1, 80), plan(1, 24), plan(1, 80, False), plan(1, 80, True)
    assert big["reshard_free"] == ["fake_score", "generator"] and big["gathered"] == off["gathered"]
    assert small["reshard_free"] == ["generator"] and on["gathered"] < small["gathered"] < big["gathered"]
    assert plan(2, 80)["reshard_free"] == plan(1, 0)["reshard_free"] == []
    assert "reshard_after_forward=0 (auto: fake_score, generator)" in memory_plan.format_plan("sd15-dmd", big)


def test_activation_probe_matches_a_hand_count():
    # y = relu(x @ W): autograd saves x (for W's grad) and the relu output; W is a parameter (excluded)
    lin = torch.nn.Sequential(torch.nn.Linear(64, 128, bias=False), torch.nn.ReLU())
    x = torch.randn(10, 64, requires_grad=True)
    got = memory_plan.activation_bytes(lin, {"input": x}, [], False)
    assert got == (10 * 64 + 10 * 128) * 4


def test_lora_activations_are_what_autograd_keeps_on_a_frozen_base():
    # a frozen Linear saves nothing for its weight grad: with x requiring no grad, y = x @ W saves nothing; a
    # LoRA'd one (peft) saves x for lora_A's grad and the rank-r intermediate x @ A for lora_B's
    frozen = torch.nn.Sequential(torch.nn.Linear(64, 128, bias=False)).requires_grad_(False)
    x = torch.randn(10, 64)
    assert memory_plan.activation_bytes(frozen, {"input": x}, [], False) == 0
    adapted = lora.add_lora(_Wrap(frozen), lora.Lora(4, targets=("0",)))
    assert memory_plan.activation_bytes(adapted, {"input": x}, [], False) == (10 * 64 + 10 * 4) * 4


class _Wrap(torch.nn.Module):
    """A plain module with diffusers' add_adapter, which parallel.lora.add_lora calls."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input):
        return self.inner(input)

    def add_adapter(self, config):
        from peft import inject_adapter_in_model
        inject_adapter_in_model(config, self)


def test_attention_is_counted_as_flash_sdpa_saves_it():
    # one attention call on meta, as the planner measures: the stand-in saves q, k, v, out (bf16) and an
    # fp32 logsumexp (B, heads, L); the math reference (what meta runs) saves L x L matrices instead
    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    b, h, n, d = 1, 24, 4096, 128   # FLUX at 1024 px: 24 heads of 128, 4096 + 512 tokens (here 4096)
    qkv = {k: torch.empty(b, h, n, d, dtype=torch.bfloat16, device="meta", requires_grad=True) for k in "qkv"}
    sdpa = torch.nn.functional.scaled_dot_product_attention
    flash = memory_plan.activation_bytes(Attention(), qkv, [], False)
    assert torch.nn.functional.scaled_dot_product_attention is sdpa   # patched only for the measurement
    assert flash == 4 * b * h * n * d * 2 + b * h * n * 4             # q + k + v + out + lse
    math = memory_plan.activation_bytes(Attention(), qkv, [], False, flash_attention=False)
    assert math >= flash + b * h * n * n * 4 and math > 10 * flash    # at least one fp32 L x L more


def test_flash_sdpa_stand_in_computes_attention_and_its_gradients():
    q, k, v = (torch.randn(2, 3, 17, 8, requires_grad=True) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    with memory_plan.flash_attention_saves():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert torch.allclose(out, ref, atol=1e-6)
    for got, want in zip(torch.autograd.grad(out.square().sum(), (q, k, v)), ref_grads):
        assert torch.allclose(got, want, atol=1e-5)


@pytest.mark.slow  # over 5 s on 2 cores: fresh interpreters build the meta models
def test_cli_prints_no_import_noise_before_its_plan():
    """`python tools/memory_plan.py` as the README runs it, in fresh interpreters side by side (the rest of
    the file calls main in process). A plan naming the cheapest settings that fit: building the meta models
    imports transformers, which imports torchao where it is installed; what that prints (its CUDA-only
    kernel libraries that do not load on CPU builds, torch's pytree notice on its Enum constants) is
    silenced as in the scripts. And --context_parallel on a UNet folder: one line on stderr, exit status 1,
    before any model is built (test_context_parallel_is_flux_only holds the in-process checks)."""
    def cli(*args):
        return subprocess.Popen([sys.executable, "tools/memory_plan.py", *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=ROOT)
    runs = [cli("--model=sd15-dmd", "--world_size=2", "--gpu_memory_gb=12", "--batch_size=2", "--resolution=256"),
            cli("--model=sd15-dmd", "--world_size=2", "--context_parallel=2")]
    try:
        (out, err), (cp_out, cp_err) = (r.communicate(timeout=300) for r in runs)
    finally:
        for r in runs:
            r.kill()
    assert runs[0].returncode == 0, err[-1000:]
    assert out.startswith("plan: sd15-dmd ")
    assert "generator" in out and "teacher" in out and "TOTAL per GPU" in out
    assert "fits in 12 GB" in out or "cheapest settings that fit" in out
    noise = ("Failed to load", "_C_mxfp8", "_C_cutlass", "_pytree", "is an Enum subclass")
    assert not [line for line in err.splitlines() if any(n in line for n in noise)], err
    assert runs[1].returncode == 1 and cp_out == ""
    assert cp_err.strip().splitlines() == [
        "plan: --context_parallel=2: sd15-dmd (sd15): its family takes no context parallelism"]



def _unit_params(model, classes):
    """Independent count: {module name: own params} of each unit of `classes`, plus the root's rest."""
    blocks = [(n, m) for n, m in model.named_modules() if m is not model and type(m).__name__ in classes]
    owned, out = set(), {}
    for n, m in reversed(blocks):
        ps = [p for p in m.parameters() if id(p) not in owned]
        owned.update(id(p) for p in ps)
        out[n] = sum(p.numel() for p in ps)
    out["<root>"] = sum(p.numel() for p in model.parameters() if id(p) not in owned)
    return out


def test_planner_follows_the_recipes_and_the_table(monkeypatch):
    src = "".join(open(f).read() for f in glob.glob(f"{ROOT}/tools/planner/*.py") + [memory_plan.__file__])
    for facts in MODELS.values():  # no wrapping decision repeated in the planner
        assert not any(f'"{c}"' in src for c in facts.units)
    unet = memory_plan.meta_model(f"{ROOT}/families/sd_unet/configs/sd15-dmd/unet")
    base = memory_plan.plan("sd15-dmd", Settings(**SMALL, fake_score_fp32=False))
    default = _unit_params(unet, MODELS["UNet2DConditionModel"].units)
    assert dict(base["units"]["generator"]) == default
    assert base["largest_unit"] == max(default.values()) * 2  # bf16 compute dtype
    # another unit choice in the UNet recipe: the planner's units, largest unit and gathered bytes follow
    monkeypatch.setitem(MODELS, "UNet2DConditionModel",
                        dataclasses.replace(MODELS["UNet2DConditionModel"], units=("ResnetBlock2D",)))
    coarse = memory_plan.plan("sd15-dmd", Settings(**SMALL, fake_score_fp32=False))
    want = _unit_params(unet, ("ResnetBlock2D",))
    for name in ("generator", "fake_score", "teacher"):
        assert dict(coarse["units"][name]) == want
    assert coarse["largest_unit"] == max(want.values()) * 2 > base["largest_unit"]
    # the two largest units in flight (generator, fake score and teacher all have this root) in bf16,
    # plus the largest trainable unit's fp32 reduce-scatter buffer
    assert coarse["gathered"] == 2 * max(want.values()) * 2 + max(want.values()) * 4 > base["gathered"]
    # the table decides the roles: a replicated teacher is a full copy, and its units gather nothing
    sd15 = pipelines.PIPELINES["StableDiffusionPipeline"]
    monkeypatch.setitem(pipelines.PIPELINES, "StableDiffusionPipeline", tuple(
        dataclasses.replace(c, role="replicated") if c.name == "teacher" else c for c in sd15))
    replicated = memory_plan.plan("sd15-dmd", Settings(**SMALL, fake_score_fp32=False))
    row = replicated["rows"]["teacher"]
    assert row["note"] == "replicated" and row["local_count"] == row["count"] and "teacher" not in replicated["units"]


def test_fake_score_fp32_is_counted_in_fp32():
    """train_dmd.py's FAKE_SCORE_FP32 (default off; on as published): the fake score's units are gathered in
    fp32 and its training forward saves fp32 activations; states are the same."""
    on = memory_plan.plan("sd15-dmd", Settings(**SMALL, fake_score_fp32=True))
    off = memory_plan.plan("sd15-dmd", Settings(**SMALL))
    unet = memory_plan.meta_model(f"{ROOT}/families/sd_unet/configs/sd15-dmd/unet")
    biggest = max(_unit_params(unet, MODELS["UNet2DConditionModel"].units).values())
    assert on["largest_unit"] == biggest * 4 and off["largest_unit"] == biggest * 2
    assert (
        on["rows"]["fake_score"]["note"] == "trainable (fp32 compute)"
        and off["rows"]["fake_score"]["note"] == "trainable"
    )
    assert {k: v["params"] for k, v in on["rows"].items()} == {k: v["params"] for k, v in off["rows"].items()}
    assert 1.9 * off["activations"] < on["activations"] <= 2 * off["activations"]  # fp32 instead of bf16


@pytest.mark.parametrize("name", ["sd15-dmd", "flux-kontext-dev"])
def test_unit_parameter_counts_sum_to_the_model(name):
    p = memory_plan.plan(name, Settings(**SMALL))
    assert p["units"]
    for comp, units in p["units"].items():
        folder = memory_plan.model_folder(name)
        spec = next(c for c in memory_plan.pipeline_components(memory_plan.pipeline_of(folder), p["script"])
                    if c.name == comp)
        model = memory_plan.meta_model(os.path.join(folder, spec.subfolder))
        total = sum(q.numel() for q in model.parameters())
        assert sum(n for _, n in units) == total == p["rows"][comp]["count"]
        assert len({n for n, _ in units}) == len(units) and units[-1][0] == "<root>"


SDXL_UNET_PARAMS = 2_567_463_684  # REFERENCE: stabilityai/stable-diffusion-xl-base-1.0 unet (≈ 2.567 B)


@pytest.mark.slow  # over 5 s on 2 cores: three 2.6 B UNets and two text encoders on meta, activations at 1024 px
def test_sdxl_unet_shards_to_an_eighth_at_world_size_8(capsys):
    """SDXL at world size 8, planned by the CLI (in process: the program's dispatch itself is
    test_cli_prints_no_import_noise_before_its_plan's) and by plan, at the native resolution both: one
    sharding and one activation profile."""
    assert memory_plan.main(["--model=sdxl-dmd", "--world_size=8", "--gpu_memory_gb=80"]) == 0
    out = capsys.readouterr().out
    assert "sdxl-dmd (sdxl)" in out and "at 1024px" in out and "TOTAL per GPU" in out
    assert "text_encoder_2" in out
    p = memory_plan.plan("sdxl-dmd", Settings(world_size=8, batch_size=1))
    assert p["kind"] == "sdxl" and p["script"] == "train_dmd.py"
    rows = p["rows"]
    for name in ("generator", "fake_score", "teacher"):
        assert rows[name]["count"] == SDXL_UNET_PARAMS
        assert abs(rows[name]["local_count"] - SDXL_UNET_PARAMS / 8) < 5000  # dim-0 padding only
        assert sum(n for _, n in p["units"][name]) == SDXL_UNET_PARAMS
    local = rows["generator"]["local_count"]
    assert rows["generator"]["params"] == local * 4 and rows["generator"]["optim"] == 2 * local * 4  # fp32 master
    assert rows["teacher"]["params"] == local * 2                                                    # bf16 frozen
    # the second text encoder (OpenCLIP bigG with projection), replicated in the compute dtype
    te2 = rows["text_encoder_2"]
    assert te2["local_count"] == te2["count"] and abs(te2["count"] - 694.66e6) < 0.01e6
    assert te2["params"] == te2["count"] * 2
    # SDXL's VAE stays fp32 whatever the precision (train_dmd.py's default); SD-1.5's is in the compute dtype
    assert rows["vae"]["params"] == rows["vae"]["count"] * 4 and "fp32" in rows["vae"]["note"]
    sd15 = memory_plan.plan("sd15-dmd", Settings(**SMALL))
    assert "text_encoder_2" not in sd15["rows"] and sd15["kind"] == "sd15"
    assert sd15["rows"]["vae"]["params"] == sd15["rows"]["vae"]["count"] * 2


def test_native_resolution_is_the_default():
    folder = memory_plan.model_folder
    assert memory_plan.native_resolution(folder("sd15-dmd")) == 512
    assert memory_plan.native_resolution(folder("sdxl-dmd")) == 1024
    assert memory_plan.native_resolution(folder("flux-kontext-dev")) == 512
    assert Settings(world_size=2).resolution is None  # plan() fills in the native one


def test_sdxl_meta_inputs_carry_the_added_conditioning():
    folder = memory_plan.model_folder("sdxl-dmd")
    unet = memory_plan.meta_model(f"{folder}/unet")
    shapes = memory_plan.latent_shapes(folder, Settings(world_size=1, resolution=1024))
    x = memory_plan._meta_inputs(folder, unet, 2, shapes, torch.bfloat16, memory_plan.text_length(folder))
    assert x["sample"].shape == (2, 4, 128, 128) and x["encoder_hidden_states"].shape == (2, 77, 2048)
    assert x["sample"].requires_grad and not x["encoder_hidden_states"].requires_grad  # the latents' grad only
    # the pooled width: what text_encoder_2 projects to
    pooled = memory_plan._config(folder, "text_encoder_2")["projection_dim"]
    assert x["added_cond_kwargs"]["text_embeds"].shape == (2, pooled) == (2, 1280)
    assert x["added_cond_kwargs"]["time_ids"].shape == (2, 6)


def test_fit_table_is_markdown():
    table = memory_plan.fit_table("sd15-dmd", world_sizes=(2,), gpu_memory_gbs=(1, 80), resolution=64)
    lines = table.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("| GPUs"))
    assert lines[head].count("|") == lines[head + 1].count("|") == lines[head + 2].count("|") == 10  # 9 columns
    row = lines[head + 2]
    assert row.startswith("| 2 |") and "does not fit" in row and "as is (" in row


# ----------------------------------------------------------------------------------------------
# LoRA mode (--lora_rank): adapters added by parallel.lora.add_lora before the recipe shards the model

# full fine-tuning's report: --lora_rank=0 prints it byte for byte (change it only on purpose)
FULL_FT_PLAN = """\
plan: sd15-dmd (sd15), world size 2 (dp_replicate 1), bf16-mixed, batch 1/rank at 64px, activation_checkpointing=0, \
cpu_offload=0, reshard_after_forward=1
component           params   on rank  param GiB  grad GiB  optim GiB  role
generator            0.86B     0.43B       1.60      1.60       3.20  trainable
fake_score           0.86B     0.43B       1.60      1.60       3.20  trainable
teacher              0.86B     0.43B       0.80      0.00       0.00  frozen-sharded
vae                  0.08B     0.08B       0.16      0.00       0.00  replicated
text_encoder         0.12B     0.12B       0.23      0.00       0.00  replicated
model states on: GPU
all-gathered units in flight: 0.59 GiB (largest unit 0.15 GiB)
activations (measured on meta): 0.02 GiB
attention counted as flash/memory-efficient SDPA saves it: q, k, v, out, logsumexp
runtime reserve: 1.00 GiB
TOTAL per GPU: 15.60 GiB"""

FULL_FT_TABLE = """\
sd15-dmd (sd15), bf16-mixed, batch 1/GPU at 64 px. Per-rank GiB as planned without checkpointing or offload (params: \
every component's local share); per GPU memory (budget N GiB): the cheapest settings that fit, and their per-GPU \
total. Activations: attention counted as flash/memory-efficient SDPA saves it: q, k, v, out, logsumexp.

| GPUs | params | grads | optimizer | activations | activations (AC) | total as is | 1 GB | 80 GB |
|---:|---:|---:|---:|---:|---:|---:|---|---|
| 2 | 4.39 | 3.20 | 6.40 | 0.02 | 0.01 | 15.60 | does not fit | as is (15.6) |"""


def test_full_fine_tuning_report_is_unchanged():
    # pinned before LoRA existed, when the fake score computed in bf16 (FAKE_SCORE_FP32 came later)
    p = memory_plan.plan("sd15-dmd", Settings(**SMALL, lora_rank=0, fake_score_fp32=False))
    assert memory_plan.format_plan("sd15-dmd", p) == FULL_FT_PLAN and "lora" not in p
    assert memory_plan.fit_table("sd15-dmd", world_sizes=(2,), gpu_memory_gbs=(1, 80), resolution=64,
                                 fake_score_fp32=False) == FULL_FT_TABLE


def _adapters(model, settings):
    """Direct count: the parameters parallel.lora.add_lora creates, and rank 0's FSDP shard of them
    (fully_shard gives rank 0 the first ceil(dim0 / world) rows of each)."""
    before = sum(p.numel() for p in model.parameters())
    lora.add_lora(model, settings)
    new = [(n, p) for n, p in model.named_parameters() if lora.is_adapter(n)]
    assert new and all(p.requires_grad and p.dtype == torch.float32 for _, p in new)
    assert sum(p.numel() for p in model.parameters()) == before + sum(p.numel() for _, p in new)
    assert not any(p.requires_grad for n, p in model.named_parameters() if not lora.is_adapter(n))
    world = SMALL["world_size"]
    return sum(p.numel() for _, p in new), sum(-(-p.shape[0] // world) * p[0].numel() for _, p in new)


# LoRA settings as test_lora_fit_skips_bf16_states_and_the_cli_takes_lora_flags passes them: one plan for both
SD15_LORA = dict(lora_rank=4, lora_alpha=8, lora_targets=("to_q", "to_v"))


def test_lora_counts_the_adapters_add_lora_creates_and_only_they_train():
    unet = memory_plan.meta_model(f"{ROOT}/families/sd_unet/configs/sd15-dmd/unet").to(torch.bfloat16)
    base = sum(p.numel() for p in unet.parameters())
    adapters, adapters_local = _adapters(unet, Settings(1, **SD15_LORA).lora)
    full = memory_plan.plan("sd15-dmd", Settings(**SMALL))
    p = memory_plan.plan("sd15-dmd", Settings(**SMALL, **SD15_LORA))
    rows = p["rows"]
    adapted, gen = rows["generator.lora"], rows["generator"]
    assert adapted["count"] == adapters and adapted["local_count"] == adapters_local
    assert p["lora"] == {"generator": (adapters, base + adapters)}
    # adapters: fp32 params, fp32 grads, 2 fp32 AdamW states; the base: compute dtype, nothing else
    assert (adapted["params"], adapted["grads"], adapted["optim"]) == (
        adapters_local * 4,
        adapters_local * 4,
        adapters_local * 8,
    )
    assert gen["count"] == base and gen["local_count"] == full["rows"]["generator"]["local_count"]
    assert gen["params"] == gen["local_count"] * 2 and gen["grads"] == gen["optim"] == 0
    # the units fsdp_units reads hold the adapters too (all-gathered in bf16 with their block)
    assert sum(n for _, n in p["units"]["generator"]) == base + adapters
    # DMD: LoRA on the generator only; the fake score and the teacher are as in full fine-tuning
    for name in ("fake_score", "teacher", "vae", "text_encoder"):
        assert rows[name] == full["rows"][name]
    assert "fake_score.lora" not in rows
    states = sum(r["params"] + r["grads"] + r["optim"] for n, r in rows.items() if n.startswith("generator"))
    full_states = sum(full["rows"]["generator"][k] for k in ("params", "grads", "optim"))
    assert states < full_states / 7  # 16 B/param -> 2 B/param (+ 16 B per adapter param)
    assert p["gpu_total"] < full["gpu_total"]
    text = memory_plan.format_plan("sd15-dmd", p)
    assert "LoRA rank 4 (alpha 8) on generator" in text and f"{adapters:,} LoRA params" in text
    assert "trainable in all:" in text  # the full fake score trains beside the adapters


def test_fake_lora_puts_adapters_on_the_fake_score_too():
    p = memory_plan.plan("sd15-dmd", Settings(**SMALL, lora_rank=4, fake_lora=True, fake_score_fp32=False))
    rows = p["rows"]
    assert set(p["lora"]) == {"generator", "fake_score"}
    assert rows["fake_score.lora"] == rows["generator.lora"] and rows["fake_score"]["grads"] == 0
    assert rows["teacher"]["note"] == "frozen-sharded" and "teacher.lora" not in rows
    # only adapter grads are reduce-scattered (fp32): the largest unit's adapters, not the unit
    largest_adapters = max(memory_plan._trainable_per_unit(_lora_unet(4), p["units"]["generator"]))
    assert p["gathered"] == 2 * p["largest_unit"] + largest_adapters * 4
    with pytest.raises(SystemExit, match="fake_lora"):
        memory_plan.plan("flux-kontext-dev", Settings(**SMALL, lora_rank=4, fake_lora=True))


def _lora_unet(rank):
    unet = memory_plan.meta_model(f"{ROOT}/families/sd_unet/configs/sd15-dmd/unet").to(torch.bfloat16)
    return memory_plan.lora_lib.add_lora(unet, memory_plan.lora_lib.Lora(rank))


def test_flux_kontext_lora_rank_16_matches_a_hand_count():
    p = memory_plan.plan("flux-kontext-dev", Settings(**SMALL, lora_rank=16))
    # default targets (diffusers' Kontext LoRA example): a rank-r adapter on a Linear(i, o) is
    # r * (i + o). Double block (19): 8 attention projections 3072->3072 and 2 MLPs 3072->12288->3072
    # (image and text streams); single block (38): q, k, v 3072->3072 and proj_mlp 3072->12288
    r, d, m = 16, 3072, 12288
    double = r * (8 * 2 * d + 4 * (d + m))
    single = r * (3 * 2 * d + (d + m))
    adapters = 19 * double + 38 * single
    assert adapters == 54_165_504
    assert p["rows"]["transformer.lora"]["count"] == adapters
    assert abs(p["rows"]["transformer"]["count"] - 11.90e9) < 0.01e9  # the base, as in full fine-tuning
    assert p["lora"]["transformer"] == (adapters, p["rows"]["transformer"]["count"] + adapters)
    full = memory_plan.plan("flux-kontext-dev", Settings(**SMALL))
    lora_states = sum(
        p["rows"][n][k] for n in ("transformer", "transformer.lora") for k in ("params", "grads", "optim")
    )
    full_states = sum(full["rows"]["transformer"][k] for k in ("params", "grads", "optim"))
    assert lora_states < full_states / 7 and p["gpu_total"] < full["gpu_total"]
    # the units are all-gathered in bf16 with their adapters: one double block plus its adapters
    assert p["largest_unit"] == full["largest_unit"] + double * 2
    text = memory_plan.format_plan("flux-kontext-dev", p)
    assert "transformer.lora" in text and "54,165,504 LoRA params = 0.45%" in text
    # one LoRA model: in flight at the activations' peak, the turn to backward: the root, the last single
    # block and the one prefetched before it, with their adapters, in bf16; and one double block's adapter
    # grads for the reduce-scatter (fp32)
    units = dict(p["units"]["transformer"])
    at_turn = units["<root>"] + units["single_transformer_blocks.37"] + units["single_transformer_blocks.36"]
    assert p["at_peak"] and p["gathered"] == 2 * at_turn + 4 * double
    assert "all-gathered units in flight at the activations peak" in text


def test_lora_fit_skips_bf16_states_and_the_cli_takes_lora_flags(capsys):
    s = Settings(**SMALL, lora_rank=4)
    tried = []

    def planner(name, t):
        tried.append(t.precision)
        return {"gpu_total": 2**60}
    assert memory_plan.cheapest_fit("sd15-dmd", s, 1, planner) is None
    assert set(tried) == {"bf16-mixed"}  # bf16 states change nothing under LoRA
    assert memory_plan.main(["--model=sd15-dmd", "--world_size=2", "--resolution=64", "--lora_rank=4",
                             "--lora_alpha=8", "--lora_target_modules=to_q,to_v"]) == 0
    out = capsys.readouterr().out
    assert "LoRA rank 4 (alpha 8) on generator" in out and "LoRA targets: to_q, to_v" in out
    # bad flags fail before any planning (in-process: argparse and the early target check)
    with pytest.raises(SystemExit, match="no_such_layer"):
        memory_plan.main(["--model=sd15-dmd", "--world_size=2", "--lora_rank=4", "--lora_target_modules=no_such_layer"])
    with pytest.raises(SystemExit) as missing:
        memory_plan.main(["--model=sd15-dmd", "--world_size=2", "--fake_lora=1"])
    assert missing.value.code == 2 and "--lora_rank" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# context parallelism (--context_parallel, FLUX Kontext only): the sequence split C ways

# the FLUX report and fit table: CP 1 prints them byte for byte (change them only on purpose); the report
# ends with the text-cache fill of T5 and CLIP, before training
FLUX_PLAN = """\
plan: flux-kontext-dev (flux_kontext), world size 2 (dp_replicate 1), bf16-mixed, batch 1/rank at 64px, \
activation_checkpointing=0, cpu_offload=0, reshard_after_forward=1
component           params   on rank  param GiB  grad GiB  optim GiB  role
transformer         11.90B     5.95B      22.17     22.17      44.34  trainable
vae                  0.08B     0.08B       0.16      0.00       0.00  replicated
text_encoder             -         -       0.00      0.00       0.00  text embeddings cached before training
text_encoder_2           -         -       0.00      0.00       0.00  text embeddings cached before training
model states on: GPU
all-gathered units in flight: 2.53 GiB (largest unit 0.63 GiB)
activations (measured on meta): 4.69 GiB
attention counted as flash/memory-efficient SDPA saves it: q, k, v, out, logsumexp
runtime reserve: 1.00 GiB
TOTAL per GPU: 97.05 GiB
text-cache fill, before training (text_encoder 0.12B, text_encoder_2 4.76B in bf16, sharded over 2 ranks, freed \
before the trained model is built): params 4.55 + units in flight 0.96 + activations 4.41 (batch 16 x 512 tokens, no \
grad) + runtime 1.00 = 10.92 GiB
PEAK per GPU (training, text-cache fill): 97.05 GiB"""

FLUX_TABLE_ROW = "| 2 | 22.32 | 22.17 | 44.34 | 4.69 | 0.28 | 97.05 | CPU offload (8.4) | bf16 states (52.1) |"


@pytest.fixture(scope="module")
def flux_cp():
    """FLUX Kontext at world size 2, 64 px (512 text + 32 image tokens): {C: plan} for CP 1 and 2,
    each sharded on its own mesh (no shard cache shared)."""
    return {c: memory_plan.plan("flux-kontext-dev", Settings(**SMALL, context_parallel=c)) for c in (1, 2)}


def test_context_parallel_halves_the_activations_and_keeps_the_states(flux_cp):
    one, two = flux_cp[1], flux_cp[2]
    cp = two["cp"]
    assert "cp" not in one and {k: cp[k] for k in ("degree", "heads", "text", "image", "one_forward")} == dict(
        degree=2, heads=24, text=512, image=32, one_forward=one["activations"])
    # Ulysses' buffers of one attention call: q, k, v and out sent and received, 544 tokens / 2 x 3072 wide in
    # bf16; and the fp32 output (32 image tokens x 64 channels) all-gathered: the other rank's half
    assert cp["buffers"] == 8 * 544 // 2 * 3072 * 2 + 32 * 64 * 4 // 2
    # no sequence dimension (embeddings, modulation): held whole (the linear fit, as in the test below)
    assert 0 < cp["whole"] < 16 * 2**20
    assert two["activations"] == cp["whole"] + -(-(one["activations"] - cp["whole"]) // 2) + cp["buffers"]
    # sharded on train_flux_kontext.py's dp x cp mesh: FSDP spans every rank, so the same shards
    assert two["rows"] == one["rows"] and two["units"] == one["units"]
    assert (two["gathered"], two["runtime"], two["host_total"]) == (one["gathered"], one["runtime"], one["host_total"])
    assert one["gpu_total"] - two["gpu_total"] == one["activations"] - two["activations"]
    text = memory_plan.format_plan("flux-kontext-dev", two)
    assert "batch 1/CP group at 64px" in text
    assert ("context parallel 2: each rank holds 1/2 of the sequence (512 text + 32 image tokens (target + context) "
            "= 544, 272 per rank); Ulysses attention over all 544 tokens for 12 of 24 heads per rank") in text
    assert "global batch 1 x 2 / 2 = 1 per step" in text
    assert (f"per rank its 1/2, {cp['whole'] / 2**20:.1f} MiB without a sequence dimension held whole, "
            f"{cp['buffers'] / 2**20:.1f} MiB of all-to-all and output buffers): {two['activations'] / 2**30:.2f} GiB "
            f"({one['activations'] / 2**30:.2f} GiB") in text


def test_cp_1_report_is_unchanged(flux_cp):
    assert memory_plan.format_plan("flux-kontext-dev", flux_cp[1]) == FLUX_PLAN
    table = memory_plan.fit_table("flux-kontext-dev", world_sizes=(2,), gpu_memory_gbs=(24, 80), resolution=64)
    assert table.splitlines()[-1] == FLUX_TABLE_ROW and "context parallel" not in table


def test_activations_are_almost_all_along_the_sequence(flux_cp):
    # the planner's CP assumption: activations split C ways with the sequence. With flash attention every
    # saved tensor is linear in the tokens L, A(L) = a + b L; a (no sequence dim: embeddings, modulation)
    # is what each rank really holds whole. Both text and image tokens x 4: a = (4 A(L) - A(4L)) / 3.
    # The two forwards are the ones flux_cp's plans measured (memoised, asked for as plan and _cp_activations
    # ask): 128 + 2 x 2^2 = 136 tokens and 512 + 2 x 4^2 = 544. a does not depend on L, and its share is the
    # larger the shorter the sequence: at 64 px the bound is tighter than at 512 px (2560 tokens, 22 GiB)
    folder = memory_plan.model_folder("flux-kontext-dev")
    names = tuple(n for n, _ in flux_cp[1]["units"]["transformer"][:-1])

    def acts(resolution, *args):  # all that autograd saves in the forward (no checkpointing)
        shapes = memory_plan.latent_shapes(folder, Settings(world_size=1, resolution=resolution))
        return memory_plan._builtin_activations(folder, "transformer", names, torch.bfloat16, 1, shapes,
                                                *args).total(False)
    small = acts(32, lora.Lora(), 128)  # 32 px, 128 text tokens
    large = acts(64, lora.Lora())  # 64 px, the folder's 512 text tokens
    assert large == flux_cp[1]["activations"]
    whole = (4 * small - large) / 3
    assert 0 <= whole < 16 * 2**20 and whole < 0.002 * large   # under 16 MiB of 4.7 GiB at 64 px


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(context_parallel=0), r"^plan: --context_parallel=0: must be >= 1 \(1 = off\)$"),
        (
            dict(world_size=8, context_parallel=3),
            r"^plan: --context_parallel=3 x --dp_replicate=1 does not divide --world_size=8$",
        ),
        (
            dict(world_size=8, dp_replicate=4, context_parallel=4),
            r"--context_parallel=4 x --dp_replicate=4 does not divide",
        ),
        (
            dict(world_size=16, context_parallel=16),
            r"^plan: --context_parallel=16: the transformer's 24 attention heads \(transformer/config.json\) do not "
            r"divide by it",
        ),
        (
            dict(world_size=3, context_parallel=3),
            r"^plan: --context_parallel=3: 512 T5 tokens \(MAX_SEQUENCE_LENGTH, capped by the tokenizer\) do not "
            r"divide by it",
        ),
        (
            dict(world_size=4, context_parallel=4, resolution=48),
            r"^plan: --context_parallel=4: the 48x48 bucket has 18 image tokens \(target \+ context\), not "
            r"divisible by it",
        ),
    ],
)
def test_context_parallel_checks_fail_with_one_line_before_any_work(settings, message, monkeypatch):
    def no_work(*a, **k):
        raise AssertionError("built models before checking --context_parallel")
    monkeypatch.setattr(tools.planner.plan, "build_components", no_work)  # where plan looks it up
    with pytest.raises(SystemExit, match=message) as e:
        memory_plan.plan("flux-kontext-dev", Settings(**{**SMALL, **settings}))
    assert "\n" not in str(e.value)


def test_context_parallel_is_the_families_with_a_cp_plan(capsys):
    with pytest.raises(SystemExit, match=r"^plan: --context_parallel=2: sd15-dmd \(sd15\): its family takes no "
                                         r"context parallelism$"):
        memory_plan.plan("sd15-dmd", Settings(**SMALL, context_parallel=2))
    with pytest.raises(SystemExit, match="--cp_table: sdxl-dmd \\(sdxl\\): its family takes no context parallelism"):
        memory_plan.cp_table("sdxl-dmd")
    # the CLI in a fresh interpreter, one line on stderr: test_cli_prints_no_import_noise_before_its_plan
    with pytest.raises(SystemExit, match="--context_parallel=2 x --dp_replicate=1 does not divide --world_size=3"):
        memory_plan.main(["--model=flux-kontext-dev", "--fit_table", "--world_sizes=2,3", "--context_parallel=2"])
    with pytest.raises(SystemExit, match="--context_parallels: 0: must be >= 1"):
        memory_plan.main(["--model=flux-kontext-dev", "--cp_table", "--context_parallels=0,2"])
    with pytest.raises(SystemExit) as both:
        memory_plan.main(["--model=flux-kontext-dev", "--cp_table", "--context_parallel=2"])
    assert both.value.code == 2 and "--cp_table tries every" in capsys.readouterr().err


def test_cp_table_names_the_smallest_cp_that_fits_and_larger_ones_that_need_less():
    # a stand-in model: 20 GiB of states (10 with bf16 states, 0 on the GPU with CPU offload), 60 GiB of
    # activations (4 with AC) at 1024 px, 4x at 2048, divided by C; 1 GiB runtime. The real checks pick
    # the CP sizes: 3 (512 text tokens), 16 (24 heads) never; 4 and 8 not on 2 GPUs
    seen = []

    def planner(name, t):
        seen.append((t.world_size, t.context_parallel))
        states = 10 if t.precision == "bf16" else 20
        acts = (4 if t.activation_checkpointing else 60) * (t.resolution // 1024) ** 2 * 2**30 / t.context_parallel
        return dict(kind="flux_kontext", settings=t, activations=acts,
                    gpu_total=(0 if t.cpu_offload else states * 2**30) + acts + 2**30)
    table = memory_plan.cp_table("flux-kontext-dev", world_sizes=(2, 16), context_parallels=(1, 2, 3, 4, 8, 16),
                                 planner=planner)
    lines = table.splitlines()
    assert lines[2:] == [
        "| resolution | GPU memory | activations at CP 1 (AC) | 2 GPUs | 16 GPUs |",
        "|---:|---:|---:|---|---|",
        "| 1024 px | 24 GB | 60.00 (4.00) | CP 1: bf16 states + AC (15.0); CP 2: AC (23.0) "
        "| CP 1: bf16 states + AC (15.0); CP 2: AC (23.0) |",
        "| 1024 px | 80 GB | 60.00 (4.00) | CP 1: AC (25.0); CP 2: as is (51.0) "
        "| CP 1: AC (25.0); CP 2: as is (51.0) |",
        "| 2048 px | 24 GB | 240.00 (16.00) | CP 1: AC + CPU offload (17.0); CP 2: bf16 states + AC (19.0) "
        "| CP 1: AC + CPU offload (17.0); CP 2: bf16 states + AC (19.0); CP 8: AC (23.0) |",
        "| 2048 px | 80 GB | 240.00 (16.00) | CP 1: AC (37.0) | CP 1: AC (37.0); CP 8: as is (51.0) |"]
    assert {c for _, c in seen} == {1, 2, 4, 8} and {c for w, c in seen if w == 2} == {1, 2}


def test_cp_table_runs_on_the_real_size_model():
    table = memory_plan.cp_table("flux-kontext-dev", resolutions=(64,), gpu_memory_gbs=(1, 80), world_sizes=(2,),
                                 context_parallels=(1, 2))
    lines = table.splitlines()
    assert lines[0].startswith("flux-kontext-dev (flux_kontext), bf16-mixed, batch 1 per CP group")
    assert lines[4] == "| 64 px | 1 GB | 4.69 (0.28) | does not fit at CP <= 2 |"
    # the states (95 GiB at 2 ranks) need bf16 states at any CP; CP 2 needs no less, so it is not listed
    assert lines[5] == "| 64 px | 80 GB | 4.69 (0.28) | CP 1: bf16 states (52.1) |"


# ----------------------------------------------------------------------------------------------
# DMD2 with a FLUX.1 Kontext teacher: train_dmd.py on a FLUX folder (--model=flux-kontext-dmd), three
# 12 B transformers

GIB = 2**30
# docs/planner.md's rows as recipes/dmd_kontext_4step*.sh run them (tests/test_recipes.py checks the
# recipes pass these): {recipe: (GPU memory in GB, Settings)}
KONTEXT_DMD = {
    "dmd_kontext_4step.sh": (80, dict(world_size=8, precision="bf16-mixed", batch_size=1, resolution=1024,
                                      activation_checkpointing=True, fake_score_fp32=False)),
    "dmd_kontext_4step_lora.sh": (24, dict(world_size=8, precision="bf16-mixed", batch_size=1, resolution=1024,
                                           activation_checkpointing=True, fake_score_fp32=False, lora_rank=64,
                                           lora_alpha=8, fake_lora=True, base_dtype="nf4")),
}
FULL_DMD, LORA_DMD = (s for _, s in KONTEXT_DMD.values())


@pytest.fixture(scope="module")
def kontext_dmd():
    """planned(settings, **over): plan("flux-kontext-dmd") of `settings` changed by `over`, memoised. plan
    keeps the built-in shard counts and measured activations, so a variant that changes neither the LoRA
    settings nor the forward's shape builds nothing again."""
    plans = {}

    def planned(settings: dict, **over) -> dict:
        key = tuple(sorted({**settings, **over}.items()))
        if key not in plans:
            plans[key] = memory_plan.plan("flux-kontext-dmd", Settings(**dict(key)))
        return plans[key]
    return planned


def _states(p: dict, name: str) -> int:
    """Per-rank bytes of one model: params, grads and optimizer state (LoRA: base + adapters)."""
    return sum(r["params"] + r["grads"] + r["optim"] for n, r in p["rows"].items() if n.split(".")[0] == name)


def _doc_row(label: str, p: dict, gpu_gb: int) -> str:
    """A row of docs/planner.md's Kontext-DMD2 table."""
    cells = [_states(p, n) for n in ("generator", "fake_score", "teacher", "ema")]
    cells += [p["gathered"], p["activations"], p["gpu_total"]]
    return (f"| {label} | {p['settings'].world_size} x {gpu_gb} GB | " + " | ".join(f"{c / GIB:.2f}" for c in cells)
            + f" | {'fits' if p['gpu_total'] <= gpu_gb * GIB else 'does not fit'} |")


def test_kontext_dmd_plans_three_flux_transformers_for_train_dmd():
    p = memory_plan.plan("flux-kontext-dmd", Settings(**SMALL, fake_score_fp32=False))
    assert (p["script"], p["kind"]) == ("train_dmd.py", "flux_kontext_dmd")
    assert list(p["rows"]) == ["generator", "fake_score", "teacher", "vae", "text_encoder", "text_encoder_2"]
    # the fine-tune's transformer, sharded by the same FLUX recipe, in each of DMD2's roles
    dev = memory_plan.plan("flux-kontext-dev", Settings(**SMALL))
    transformer = dev["rows"]["transformer"]
    for name in ("generator", "fake_score", "teacher"):
        assert p["units"][name] == dev["units"]["transformer"]
        assert (p["rows"][name]["count"], p["rows"][name]["local_count"]) == (transformer["count"],
                                                                               transformer["local_count"])
    local, rows = transformer["local_count"], p["rows"]
    for name in ("generator", "fake_score"):  # bf16-mixed: fp32 master, fp32 grads, 2 fp32 AdamW states
        assert (rows[name]["params"], rows[name]["grads"], rows[name]["optim"]) == (local * 4, local * 4, local * 8)
    assert (rows["teacher"]["params"], rows["teacher"]["grads"]) == (local * 2, 0)  # frozen, bf16
    assert rows["text_encoder"]["params"] == rows["text_encoder_2"]["params"] == 0  # cached, then freed
    # the generator's and the fake score's training forwards: Kontext's (text + target + context tokens)
    assert p["activations"] == dev["activations"]
    # a FLUX folder planned for train_dmd.py by --script is the built-in name
    folder = memory_plan.plan(memory_plan.model_folder("flux-kontext-dev"),
                              Settings(**SMALL, fake_score_fp32=False, script="train_dmd.py"))
    assert folder["gpu_total"] == p["gpu_total"] and folder["rows"] == p["rows"]


@pytest.mark.slow  # over 5 s on 2 cores: three 12 B meta models at world size 8, activations at 1024 px
def test_kontext_dmd_full_fits_8_x_80_gb_with_ac(kontext_dmd):
    p, gb = kontext_dmd(FULL_DMD), KONTEXT_DMD["dmd_kontext_4step.sh"][0]
    assert p["gpu_total"] <= gb * GIB < kontext_dmd(FULL_DMD, activation_checkpointing=False)["gpu_total"]
    assert p["activations"] == memory_plan.plan("flux-kontext-dev", Settings(
        world_size=8, resolution=1024, activation_checkpointing=True))["activations"]  # 512 + 2 x 64² tokens
    # FAKE_SCORE_FP32=1: the fake score's units gathered in fp32 and its activations saved in fp32
    fp32 = kontext_dmd(FULL_DMD, fake_score_fp32=True)
    assert fp32["largest_unit"] == 2 * p["largest_unit"] and 1.9 < fp32["activations"] / p["activations"] <= 2
    assert fp32["rows"]["fake_score"]["note"] == "trainable (fp32 compute)"
    # an EMA of the generator: its shards again, fp32 (the storage), no grads or state; offloaded with it
    ema = kontext_dmd(FULL_DMD, ema=True)
    local = p["rows"]["generator"]["local_count"]
    assert list(ema["rows"])[:2] == ["generator", "ema"] and ema["rows"]["ema"]["params"] == local * 4
    assert ema["gpu_total"] - p["gpu_total"] == local * 4
    offload = kontext_dmd(FULL_DMD, ema=True, cpu_offload=True)
    assert offload["host_total"] == _states(p, "generator") + _states(p, "fake_score") + local * 4


@pytest.mark.slow  # over 5 s on 2 cores: LoRA on two 12 B meta models
def test_kontext_dmd_lora_and_nf4_fit_8_x_24_gb(kontext_dmd):
    p, gb = kontext_dmd(LORA_DMD), KONTEXT_DMD["dmd_kontext_4step_lora.sh"][0]
    rows = p["rows"]
    assert p["gpu_total"] <= gb * GIB and set(p["lora"]) == {"generator", "fake_score"}
    assert rows["generator.lora"] == rows["fake_score.lora"] and "rank 64" in rows["generator.lora"]["note"]
    assert rows["generator"]["note"] == rows["fake_score"]["note"] == "frozen LoRA base (nf4)"
    # BASE_DTYPE=nf4 stores the frozen teacher as the LoRA bases: the same weights, the same bytes
    assert rows["teacher"]["note"] == "frozen-sharded (nf4)" and rows["teacher"]["grads"] == 0
    assert rows["teacher"]["params"] == rows["generator"]["params"]
    bf16 = kontext_dmd(LORA_DMD, base_dtype="")
    assert bf16["rows"]["teacher"]["note"] == "frozen-sharded"
    assert 0.25 < rows["teacher"]["params"] / bf16["rows"]["teacher"]["params"] < 0.27
    assert p["load_peak"] > 0
    # an EMA of LoRA models: of the generator's adapters only (parallel/ema.py's AdapterEMA), fp32
    ema = kontext_dmd(LORA_DMD, ema=True)
    adapters = rows["generator.lora"]["local_count"]
    assert list(ema["rows"])[:3] == ["generator", "generator.lora", "ema"]
    assert ema["rows"]["ema"]["params"] == adapters * 4 and ema["gpu_total"] - p["gpu_total"] == adapters * 4
    # the UNet path keeps its teacher in TEACHER_DTYPE (train_dmd.py quantises FLUX teachers only)
    sd15 = memory_plan.plan("sd15-dmd", Settings(**SMALL, lora_rank=4, fake_lora=True, fake_score_fp32=False,
                                                 base_dtype="nf4"))
    assert sd15["rows"]["teacher"]["note"] == "frozen-sharded"


DMD_DOC_ROWS = [  # (label, recipe whose settings it starts from, changes, GPU memory in GB)
    ("(a) full generator + full fake score (bf16), bf16 teacher, AC", "dmd_kontext_4step.sh", {}, 80),
    ("(a) with an EMA (`--ema=1`)", "dmd_kontext_4step.sh", dict(ema=True), 80),
    ("(a) with the fake score in fp32 (`--fake_score_fp32=1`)", "dmd_kontext_4step.sh", dict(fake_score_fp32=True), 80),
    ("(a) without AC", "dmd_kontext_4step.sh", dict(activation_checkpointing=False), 80),
    ("(a) + CPU offload", "dmd_kontext_4step.sh", dict(cpu_offload=True), 24),
    ("(b) LoRA r64 generator + fake score, NF4 bases and teacher, AC", "dmd_kontext_4step_lora.sh", {}, 24),
    ("(b) with an EMA (of the adapters)", "dmd_kontext_4step_lora.sh", dict(ema=True), 24),
    ("(b) with bf16 bases and teacher (`--base_dtype=`)", "dmd_kontext_4step_lora.sh", dict(base_dtype=""), 24),
]


@pytest.mark.slow  # over 5 s on 2 cores: the LoRA rows
def test_docs_carry_the_kontext_dmd_rows(kontext_dmd):
    docs = open(f"{ROOT}/docs/planner.md").read()
    for label, recipe, over, gb in DMD_DOC_ROWS:
        row = _doc_row(label, kontext_dmd(KONTEXT_DMD[recipe][1], **over), gb)
        assert row in docs, row


def test_kontext_dmd_cli_and_its_checks(capsys):
    # in process, on the shards and activations test_kontext_dmd_plans_three_flux_transformers_for_train_dmd kept
    assert memory_plan.main(["--model=flux-kontext-dmd", "--world_size=2", "--resolution=64", "--fake_score_fp32=0",
                             "--ema=1", "--gpu_memory_gb=80"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("plan: flux-kontext-dmd (flux_kontext_dmd), world size 2") and "\nema " in out
    assert "does NOT fit in 80 GB; cheapest settings that fit:" in out and "--cpu_offload=1" in out
    # DMD2 with CP (train_dmd.py's CONTEXT_PARALLEL): the three transformers' activations split as fine-tuning's
    cp = memory_plan.plan("flux-kontext-dmd", Settings(**SMALL, context_parallel=2))["cp"]
    assert (cp["degree"], cp["heads"], cp["text"], cp["image"]) == (2, 24, 512, 32)
    with pytest.raises(SystemExit, match=r"^plan: --script=train_flux_kontext.py: StableDiffusionPipeline is trained "
                                         r"by train_dmd.py only$"):
        memory_plan.plan("sd15-dmd", Settings(**SMALL, script="train_flux_kontext.py"))



# ----------------------------------------------------------------------------------------------
# the family specs: the planner's names, folders and per-family facts come from them

BUILTIN_NAMES = ("flux-kontext-dev", "flux-kontext-dmd", "flux2-dev", "flux2-dev-dmd", "flux2-klein-4b",
                 "flux2-klein-4b-dmd", "flux2-klein-9b", "flux2-klein-9b-dmd", "qwen-image-edit", "qwen-image-edit-dmd",
                 "sd15-dmd", "sdxl-dmd", "wan2.1-i2v-14b", "wan2.1-t2v-1.3b", "wan2.1-t2v-14b", "wan2.2-i2v-a14b",
                 "wan2.2-t2v-a14b", "wan2.2-ti2v-5b", "z-image", "z-image-dmd", "z-image-omni",
                 "z-image-omni-dmd")  # what docs, recipes, README name


def test_builtin_names_are_the_specs():
    """Every --model= name is declared once, in its family's spec (FamilySpec.builtins; the DMD2 names derived),
    its folder the pipeline that Builtin names, planned for the script its name says; nothing else is built in."""
    from families import SPECS
    assert sorted(memory_plan.BUILTINS) == sorted(BUILTIN_NAMES)
    declared = [name for spec in SPECS for name in spec.builtins]
    folders = [os.path.join(s.builtin_folder(""), n) for s in SPECS if os.path.isdir(s.builtin_folder(""))
               for n in os.listdir(s.builtin_folder(""))]  # every configs/ folder a family ships
    assert len(declared) == len(set(declared)) == len(folders)
    assert sorted(folders) == sorted(s.builtin_folder(n) for s in SPECS for n in s.builtins)
    for spec in SPECS:
        for name, builtin in spec.builtins.items():
            folder = memory_plan.model_folder(name)
            assert memory_plan.pipeline_of(folder) == builtin.pipeline
            assert memory_plan.layout(folder)[0] == memory_plan.default_script(
                next(p for p in spec.pipelines if p.name == builtin.pipeline))
    for name in BUILTIN_NAMES:  # DMD2's label: a -dmd name, or a pipeline only train_dmd.py trains (Wan)
        script, kind = memory_plan.layout(memory_plan.model_folder(name),
                                          memory_plan.with_script(name, Settings(1)).script)
        assert kind.endswith("_dmd") == (script == "train_dmd.py" and name not in ("sd15-dmd", "sdxl-dmd"))
        assert name.endswith("-dmd") or script == memory_plan.default_script(next(
            p for spec in SPECS for p in spec.pipelines if p.name == memory_plan.pipeline_of(
                memory_plan.model_folder(name))))


def test_planner_core_names_no_family():
    """No per-family branch in the planner's core: no string constant of its code (docstrings aside) is a
    family's name, one of its pipelines or a plan label; what differs is read from the specs."""
    import ast
    from families import SPECS
    names = {n for spec in SPECS for n in (spec.name, *spec.pipeline_names, *spec.plan_names.values())}
    for module in ("build", "activations", "plan", "shard", "fit"):
        tree = ast.parse(open(f"{ROOT}/tools/planner/{module}.py").read())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree) if isinstance(
            node, (ast.Module, ast.FunctionDef, ast.ClassDef)) and node.body and isinstance(node.body[0], ast.Expr)}
        found = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)
                 and isinstance(node.value, str) and id(node) not in docstrings} & names
        assert not found, (module, found)


def test_flux2_context_parallelism_is_checked_by_its_room():
    """FLUX.2's CP (its trainer's): planned, checked by the room's check_context_parallel at the planned shapes
    (target + 2 references at the pipeline's area, 512 text tokens), its refusal in one line before any work."""
    folder = memory_plan.model_folder("flux2-klein-4b")
    s = Settings(world_size=8, resolution=1024, context_parallel=2)
    assert memory_plan.check_context_parallel(folder, s) == dict(heads=24, text=512, image=3 * 4096)
    with pytest.raises(SystemExit, match=r"^plan: --context_parallel=5: the transformer's 24 attention heads "):
        memory_plan.check_context_parallel(folder, dataclasses.replace(s, world_size=5, context_parallel=5))
    # DMD2 (train_dmd.py's CONTEXT_PARALLEL) by the same check
    assert memory_plan.check_context_parallel(memory_plan.model_folder("flux2-klein-4b-dmd"), dataclasses.replace(
        s, script="train_dmd.py")) == dict(heads=24, text=512, image=3 * 4096)

# ----------------------------------------------------------------------------------------------
# Qwen-Image-Edit-2509 (QwenImageEditPlusPipeline): train_flux_kontext.py's and train_dmd.py's third family

QWEN_PARAMS = 20_430_401_088  # REFERENCE: Qwen/Qwen-Image-Edit-2509 transformer (60 dual-stream blocks, 3072 wide)


@pytest.mark.slow  # over 5 s on 2 cores: a 20 B and an 8 B meta model, then three 20 B ones for DMD2
def test_qwen_image_edit_plans_the_2509_transformer():
    # at 1024 px, whose activation profile test_docs_carry_the_qwen_image_edit_rows measures for its rows too
    p = memory_plan.plan("qwen-image-edit", Settings(world_size=8, resolution=1024))
    assert (p["script"], p["kind"]) == ("train_flux_kontext.py", "qwen_image_edit")
    assert list(p["rows"]) == ["transformer", "vae", "text_encoder"]
    row = p["rows"]["transformer"]
    assert row["count"] == QWEN_PARAMS and abs(row["local_count"] / (QWEN_PARAMS / 8) - 1) < 1e-3  # dim-0 padding
    units = p["units"]["transformer"]
    assert [n for n, _ in units] == [f"transformer_blocks.{i}" for i in range(60)] + ["<root>"]
    assert p["rows"]["text_encoder"]["params"] == 0  # Qwen2.5-VL: its embeddings cached, then freed
    assert p["rows"]["vae"]["note"] == "replicated"
    # the native resolution is the pipeline's 1024^2 area; the DMD2 name plans the same transformer in 3 roles
    assert memory_plan.native_resolution(memory_plan.model_folder("qwen-image-edit")) == 1024
    dmd = memory_plan.plan("qwen-image-edit-dmd", Settings(world_size=8, resolution=1024, fake_score_fp32=False))
    assert (dmd["script"], dmd["kind"]) == ("train_dmd.py", "qwen_image_edit_dmd")
    assert list(dmd["rows"]) == ["generator", "fake_score", "teacher", "vae", "text_encoder"]
    assert dmd["units"]["teacher"] == units and dmd["activations"] == p["activations"]


def test_qwen_sequence_is_the_target_two_references_and_the_vl_prompt():
    """At 1024 px: 3 x (1024 / 16)^2 = 12 288 image tokens (target + 2 references, 2x2-packed 16-channel
    latents, 64 channels), each image its own RoPE frame; the text stream: 2 x (196 image + 7 template)
    tokens of the references at 384^2 (392^2 in 28 px cells) + 64 instruction + 5 closing tokens."""
    folder = memory_plan.model_folder("qwen-image-edit")
    assert (memory_plan.vae_factor(folder), memory_plan.text_length(folder)) == (8, 2 * (196 + 7) + 64 + 5)
    model = memory_plan.meta_model(f"{folder}/transformer")
    shapes = memory_plan.latent_shapes(folder, Settings(world_size=1, resolution=1024))
    x = memory_plan._meta_inputs(folder, model, 1, shapes, torch.bfloat16, 475)
    assert tuple(x["hidden_states"].shape) == (1, 3 * 64 * 64, 64)
    assert tuple(x["encoder_hidden_states"].shape) == (1, 475, 3584)
    assert x["img_shapes"] == [[(1, 64, 64)] * 3]
    # the family's room refuses context parallelism (its check, as train_flux_kontext.py's): one line, before
    # any model is built
    with pytest.raises(SystemExit, match=r"^plan: --context_parallel=2: not for Qwen-Image-Edit here \(its text is "
                                         r"a padded, masked sequence of varying length per sample\); use "
                                         r"CONTEXT_PARALLEL=1$"):
        memory_plan.check_context_parallel(folder, Settings(world_size=2, context_parallel=2))


QWEN_1024 = dict(resolution=1024, reshard_after_forward=None)  # the scripts' auto resharding
QWEN_FINE_TUNE_ROWS = [  # (label, settings, GPU memory in GB): docs/planner.md's Qwen-Image-Edit fine-tuning table
    ("LoRA r16, NF4 base", dict(world_size=1, lora_rank=16, base_dtype="nf4"), 24),
    ("LoRA r64, NF4 base", dict(world_size=1, lora_rank=64, base_dtype="nf4"), 24),
    ("LoRA r16, bf16 base", dict(world_size=1, lora_rank=16), 80),
    ("LoRA r64, bf16 base", dict(world_size=1, lora_rank=64), 80),
    ("full fine-tune", dict(world_size=8), 80),
]
QWEN_DMD = dict(world_size=8, resolution=1024, activation_checkpointing=True, fake_score_fp32=False)
QWEN_DMD_LORA = dict(QWEN_DMD, lora_rank=64, lora_alpha=8, fake_lora=True, base_dtype="nf4")
QWEN_DMD_ROWS = [  # as DMD_DOC_ROWS, for qwen-image-edit-dmd
    ("(a) full generator + full fake score (bf16-mixed), bf16 teacher, AC", QWEN_DMD, 80),
    ("(a) with bf16 states (`--precision=bf16`)", dict(QWEN_DMD, precision="bf16"), 80),
    ("(a) + CPU offload", dict(QWEN_DMD, cpu_offload=True), 24),
    ("(b) LoRA r64 generator + fake score, NF4 bases and teacher, AC", QWEN_DMD_LORA, 24),
    ("(b) with bf16 bases and teacher (`--base_dtype=`)", dict(QWEN_DMD_LORA, base_dtype=""), 24),
]


def _qwen_fine_tune_row(label: str, over: dict, gb: int, planner) -> str:
    """A row of docs/planner.md's Qwen-Image-Edit fine-tuning table: the transformer's weights (LoRA: the
    frozen base; full: the fp32 master shard), what training adds (grads and AdamW; LoRA: with the adapters),
    units in flight, activations without (with) AC, the total as is, and the cheapest settings that fit."""
    s = Settings(**QWEN_1024, **over)
    p = planner("qwen-image-edit", s)
    ac = planner("qwen-image-edit", dataclasses.replace(s, activation_checkpointing=True))
    rows = p["rows"]
    trained = sum(r[k] for n, r in rows.items() if n.startswith("transformer") for k in ("grads", "optim")) + \
        rows.get("transformer.lora", {}).get("params", 0)
    fit = memory_plan.cheapest_fit("qwen-image-edit", s, gb * GIB, planner)
    cheapest = "does not fit" if fit is None else \
        f"{memory_plan._setting_name(fit[0], s.precision)} ({fit[1]['gpu_total'] / GIB:.2f})"
    cells = [rows["transformer"]["params"], trained, p["gathered"]]
    return (f"| {label} | {s.world_size} x {gb} GB | " + " | ".join(f"{c / GIB:.2f}" for c in cells)
            + f" | {p['activations'] / GIB:.2f} ({ac['activations'] / GIB:.2f}) | {p['gpu_total'] / GIB:.2f} | "
            + f"{cheapest} |")


@pytest.mark.slow  # over 5 s on 2 cores: 20 B meta models at 1024 px with 2 references, LoRA and full, DMD2
def test_docs_carry_the_qwen_image_edit_rows():
    docs = open(f"{ROOT}/docs/planner.md").read()
    planner = memory_plan.memo_planner()
    for label, over, gb in QWEN_FINE_TUNE_ROWS:
        row = _qwen_fine_tune_row(label, over, gb, planner)
        assert row in docs, row
    for label, over, gb in QWEN_DMD_ROWS:
        p = planner("qwen-image-edit-dmd", Settings(**over))
        assert (p["kind"], p["settings"].resolution) == ("qwen_image_edit_dmd", 1024)
        row = _doc_row(label, p, gb)
        assert row in docs, row


# ----------------------------------------------------------------------------------------------
# FLUX.2 ([dev]: Flux2Pipeline; klein 4B / 9B: Flux2KleinPipeline): one kind, the text encoder by model_index.json

FLUX2 = {  # name: (pipeline, transformer params, text encoder class, its params)
    "flux2-dev": ("Flux2Pipeline", 32_223_281_152, "Mistral3ForConditionalGeneration", 24_011_361_280),
    "flux2-klein-4b": ("Flux2KleinPipeline", 3_875_544_576, "Qwen3ForCausalLM", 4_022_468_096),
    "flux2-klein-9b": ("Flux2KleinPipeline", 9_078_581_248, "Qwen3ForCausalLM", 8_190_735_360),
}


@pytest.mark.parametrize("name", list(FLUX2))
def test_flux2_folders_are_planned_by_their_pipeline(name):
    """Each built-in FLUX.2 folder is the flux2 kind of train_flux_kontext.py, planned by the table entry of the
    pipeline its model_index.json names (FLUX.2 [dev] and klein differ in their text encoder); no model built."""
    pipeline, _, encoder, _ = FLUX2[name]
    folder = memory_plan.model_folder(name)
    assert memory_plan.layout(folder) == ("train_flux_kontext.py", "flux2")
    assert memory_plan.pipeline_of(folder) == pipeline
    script, kind, parts = memory_plan.build_components(folder, memory_plan.get_precision("bf16-mixed"), build=False)
    assert [(p.name, p.spec.role, p.spec.class_name) for p in parts] == [
        ("transformer", "trainable", "Flux2Transformer2DModel"), ("vae", "replicated", "AutoencoderKLFlux2"),
        ("text_encoder", "offline", encoder)]
    assert memory_plan.native_resolution(folder) == 1024


def test_flux2_sequence_is_the_target_the_references_and_512_text_tokens():
    """At 1024 px: 4 096 target tokens and, per reference at the pipeline's 1024^2 area, 4 096 more (128-channel
    tokens: 2x2-patchified 32-channel latents at the VAE's factor 8), 4-D ids; 512 text tokens 3 x the encoder's
    hidden size wide; [dev] embeds the guidance, klein has none. A smaller REFERENCE_AREA shrinks the references
    only; --references is FLUX.2's."""
    s = Settings(world_size=1, resolution=1024)
    refs = memory_plan.reference_grids(memory_plan.model_folder("flux2-dev"), s)
    assert refs == ((64, 64), (64, 64))
    assert memory_plan.reference_grids(memory_plan.model_folder("flux2-dev"), dataclasses.replace(
        s, references=3, reference_area=512 * 512)) == ((32, 32),) * 3
    for name, joint, guided in (("flux2-klein-4b", 3 * 2560, False), ("flux2-dev", 3 * 5120, True)):
        folder = memory_plan.model_folder(name)
        model = memory_plan.meta_model(f"{folder}/transformer")
        assert memory_plan.text_length(folder) == 512
        x = memory_plan._meta_inputs(folder, model, 1, memory_plan.latent_shapes(folder, s), torch.bfloat16, 512)
        assert tuple(x["hidden_states"].shape) == (1, 3 * 4096, 128) and tuple(x["img_ids"].shape) == (1, 12288, 4)
        assert tuple(x["encoder_hidden_states"].shape) == (1, 512, joint) and (x["guidance"] is not None) == guided
    with pytest.raises(SystemExit, match=r"^plan: --references / --reference_area: for families that plan "
                                         r"references by area; qwen-image-edit is "):
        memory_plan.plan("qwen-image-edit", Settings(world_size=1, references=1))


def test_flux2_plans_training_and_the_text_cache_fill():
    """klein 4B, LoRA r16, 2 ranks, 256 px with one 256^2 reference (a small sequence: the state rows do not depend
    on it): the transformer's base and adapters are sharded; the Qwen3 text encoder holds nothing at training (its
    embeddings are cached, then it is freed) and its fill is a phase of its own: its shard (half its bf16
    weights), the root and two decoder layers in flight, a no-grad forward of TEXT_FILL_BATCH prompts x 512 tokens
    and the runtime reserve; the plan's peak is the larger phase, and the CLI prints both."""
    name, (_, params, _, encoder) = "flux2-klein-4b", FLUX2["flux2-klein-4b"]
    s = Settings(world_size=2, resolution=256, lora_rank=16, references=1, reference_area=256 * 256)
    p = memory_plan.plan(name, s)
    assert p["rows"]["transformer"]["count"] == params and p["rows"]["text_encoder"]["params"] == 0
    assert p["references"] == ((16, 16),) and "single_transformer_blocks.19.attn.to_out" in p["lora_targets"]
    fill = p["fill"]
    assert fill["components"] == {"text_encoder": encoder} and fill["sharded"] and fill["dtype"] == "bf16"
    assert (fill["batch"], fill["text"]) == (memory_plan.TEXT_FILL_BATCH, 512)
    assert abs(fill["params"] / (encoder * 2 / 2) - 1) < 1e-3  # dim-0 padding
    assert fill["total"] == fill["params"] + fill["gathered"] + fill["activations"] + fill["runtime"]
    # each layer's hidden states (37 of them, the pipeline reads 9 / 18 / 27) and the logits are held at the end
    assert fill["activations"] > (37 * 2560 + 151936) * 2 * 512 * memory_plan.TEXT_FILL_BATCH
    assert memory_plan.peak_bytes(p) == max(p["gpu_total"], fill["total"])
    nf4 = memory_plan.plan(name, dataclasses.replace(s, text_encoder_dtype="nf4"))
    assert nf4["fill"]["params"] < fill["params"] / 3 and nf4["gpu_total"] == p["gpu_total"]
    text = memory_plan.format_plan(name, p)
    assert "sequence per sample: 256 target tokens (256^2 / 16^2) + 1 reference(s) x 256 tokens" in text
    assert (f"text-cache fill, before training (text_encoder 4.02B in bf16, sharded over 2 ranks, freed before the "
            f"trained model is built): params {fill['params'] / GIB:.2f}") in text
    assert text.endswith(f"PEAK per GPU (training, text-cache fill): {memory_plan.peak_bytes(p) / GIB:.2f} GiB")
    assert "LoRA targets: to_k, to_q, to_v, to_out.0, to_qkv_mlp_proj, single_transformer_blocks.*.attn.to_out" \
        in text
    # a budget that training fits but the bf16 fill does not: the fit takes the NF4 text encoder
    budget = (p["gpu_total"] + fill["total"]) // 2
    assert p["gpu_total"] < budget < fill["total"]
    planner = memory_plan.memo_planner()
    fit = memory_plan.cheapest_fit(name, s, budget, planner)
    assert fit is not None and fit[0].text_encoder_dtype == "nf4" and memory_plan.peak_bytes(fit[1]) <= budget
    assert memory_plan.cheapest_fit(name, s, budget, planner, nf4_text_encoder=False) is None


@pytest.mark.slow  # over 5 s on 2 cores: 32 B, 9 B and 4 B meta models at 1024 px with 2 references, 1-8 ranks
def test_docs_carry_the_flux2_rows():
    docs = open(f"{ROOT}/docs/planner.md").read()
    for row in memory_plan.flux2_table().splitlines()[2:]:
        assert row in docs, row


@pytest.mark.slow  # two 4 B / 9 B transformers on meta at 4096 tokens and their Qwen3 fills
def test_the_flux2_text_to_image_recipe_and_docs_carry_the_planners_figures():
    """recipes/flux2_klein_t2i_lora.sh's figures (klein-base 4B, bf16 base; 9B, NF4 base; LoRA r16, no reference,
    1 x 24 GB) and docs/families/flux2.md's row are the planner's."""
    recipe = open(f"{ROOT}/recipes/flux2_klein_t2i_lora.sh").read()
    docs = open(f"{ROOT}/docs/families/flux2.md").read()
    common = dict(world_size=1, lora_rank=16, resolution=1024, activation_checkpointing=True, gpu_memory_gb=24,
                  references=0)
    four = memory_plan.plan("flux2-klein-4b", Settings(**common))
    nine = memory_plan.plan("flux2-klein-9b", Settings(**common, base_dtype="nf4"))
    (a, b), (c, d) = ((p["gpu_total"] / 2**30, p["fill"]["total"] / 2**30) for p in (four, nine))
    assert f"plans {a:.2f} GiB for training and {b:.2f} for the\n# text-cache fill" in recipe
    assert f"9B with --base_dtype=nf4: {c:.2f} and {d:.2f} GiB" in recipe
    assert f"bf16 base (`--references=0`) | 1 × 24 GB | AC | {a:.1f} (text-cache fill {b:.1f}) |" in docs


def test_flux2_dmd_plans_three_transformers_and_the_fill():
    """flux2-klein-4b-dmd: train_dmd.py's generator, fake score and teacher of the klein folder, the teacher in
    NF4 with the LoRA bases, and the text-cache fill as its own phase; docs/planner.md's 1 x 24 GB row."""
    s = Settings(world_size=1, resolution=1024, activation_checkpointing=True, fake_score_fp32=False, lora_rank=64,
                 fake_lora=True, base_dtype="nf4")
    p = memory_plan.plan("flux2-klein-4b-dmd", s)
    assert p["kind"] == "flux2_dmd" and {"generator", "fake_score", "teacher"} <= set(p["rows"])
    assert p["rows"]["teacher"]["note"] == "frozen-sharded (nf4)"
    assert f"| 1 x 24 GB | {p['gpu_total'] / GIB:.2f} / {p['fill']['total'] / GIB:.2f} |" in \
        open(f"{ROOT}/docs/planner.md").read()


# ----------------------------------------------------------------------------------------------
# the planner against real-width runs on 2 CPU ranks with gloo: one launch (width_runs), checked several ways

WIDTH_TEXT = 1  # text tokens of each LoRA run
# {family: (built-in configuration, its transformer's blocks, resolution, reference token grids)}: the
# transformer at real width (3072, 24 heads; 0.4-0.56 B parameters) with one block of each kind. At 16 px each
# image is one token (2 x 2-packed latents at the VAE's factor 8): FLUX.1 target + context, Qwen target + its 2
# references, FLUX.2 target + one reference; 3 or 4 tokens with the text. Few, as backward's bf16 products with
# the untransposed frozen weights (grad @ W) run ~35x slower than forward's on CPUs without AVX-512, in time
# linear in the tokens (~0.26 s per token and 3072 x 12288 weight); and every byte compared is per token or per
# block, so a few tokens of each stream show each term as many would
WIDTH = {
    "flux_kontext": ("flux-kontext-dev", dict(num_layers=1, num_single_layers=1), 16, ()),
    "qwen_image_edit": ("qwen-image-edit", dict(num_layers=1), 16, ()),
    "flux2": ("flux2-klein-4b", dict(num_layers=1, num_single_layers=1), 16, ((1, 1),)),
}
CP_TEXT, CP_RES = 4, 32  # 4 text + 2 x (32 / 16)^2 = 8 image tokens: 12, 6 per rank at CP 2; a quarter: 1 + 2


def _width_folder(root, family: str) -> str:
    """The family's built-in configs with WIDTH's blocks: its transformer at real width."""
    import json
    import shutil
    name, blocks, _, _ = WIDTH[family]
    folder = root / family
    shutil.copytree(memory_plan.model_folder(name), folder)
    cfg = json.loads((folder / "transformer" / "config.json").read_text())
    (folder / "transformer" / "config.json").write_text(json.dumps({**cfg, **blocks}))
    return str(folder)


def _width_settings(resolution: int, refs: tuple = ()) -> Settings:
    """LoRA r16 on 2 ranks at `resolution`; `refs`: FLUX.2's reference token grids, each at resolution^2."""
    return Settings(world_size=2, resolution=resolution, lora_rank=16,
                    **(dict(references=len(refs), reference_area=resolution ** 2) if refs else {}))


def _width_inputs(model, folder: str, resolution: int, text: int, refs: tuple = ()) -> dict:
    """The forward inputs on meta, as the planner makes them (_meta_inputs at latent_shapes)."""
    shapes = memory_plan.latent_shapes(folder, _width_settings(resolution, refs))
    return memory_plan._meta_inputs(folder, model, 1, shapes, torch.bfloat16, text)


def _on_cpu(x: dict) -> dict:
    """Meta inputs made real: floats drawn, the rest (FLUX.2's integer ids) zeros; the values do not matter here."""
    return {k: (torch.randn(v.shape, dtype=v.dtype) if v.is_floating_point() else torch.zeros(v.shape, dtype=v.dtype))
            if torch.is_tensor(v) else v for k, v in x.items()}


def _fill_random(model, rank):
    """Each local shard (or whole parameter) filled with values tiled from one draw: the values do not matter
    to the bytes."""
    pool = torch.randn(1 << 20, generator=torch.Generator().manual_seed(rank)) * 0.02
    with torch.no_grad():
        for p in model.parameters():
            flat = (p.to_local() if hasattr(p, "to_local") else p).view(-1)
            for i in range(0, flat.numel(), pool.numel()):
                flat[i:i + pool.numel()].copy_(pool[:flat.numel() - i])


def _lora_step_bytes(model, x) -> dict:
    """A forward whose saved tensors are counted once per storage (the gathered parameters excluded), backward, an
    AdamW step over the adapters: this rank's bytes (base, adapters, grads, AdamW moments, saves) and how many
    saved storages are rank-16 wide (the adapters' intermediates)."""
    def storage(t):
        return getattr(t, "_local_tensor", t).untyped_storage().data_ptr()
    saved, rank_r = {}, [0]

    def pack(t):  # FSDP2 registers a unit's gathered parameters while it runs: those are weights, not saves
        ptr = storage(t)
        if ptr not in saved and ptr not in {storage(p) for p in model.parameters()}:
            saved[ptr] = t.untyped_storage().nbytes()
            rank_r[0] += t.shape[-1] == 16
        return t
    with memory_plan.flash_attention_saves(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = model(**x)[0]
    y.square().mean().backward()
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-4)
    opt.step()

    def local_bytes(ts):
        return sum(t.to_local().numel() * t.to_local().element_size() for t in ts)
    return dict(base=local_bytes(p for p in model.parameters() if not p.requires_grad), adapters=local_bytes(trained),
                grads=local_bytes(p.grad for p in trained),
                optim=local_bytes(s[k] for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")),
                saved=sum(saved.values()), rank_r=rank_r[0])


def _width_lora_step(rank, folder, family) -> dict:
    """One rank of a LoRA r16 fine-tune step at real width as the scripts build it: meta model in bf16,
    adapters, the family's recipe (fully_shard per block, then the root) on the 2-rank gloo mesh, weights
    materialised on CPU (random, tiled from one draw), then _lora_step_bytes."""
    import fsdp_utils
    from parallel.parallelize import parallelize
    from precision import get_precision
    _, _, resolution, refs = WIDTH[family]
    model = memory_plan.meta_model(f"{folder}/transformer").to(torch.bfloat16)
    with torch.device("meta"):
        lora.add_lora(model, lora.Lora(16))
    x = _width_inputs(model, folder, resolution, WIDTH_TEXT, refs)
    mesh = fsdp_utils.build_meshes(torch.device("cpu"))[0]
    # kept gathered from forward to backward: neither the shards nor the saves depend on it, and it spares
    # backward's re-gather over gloo (~4 s per 0.68 GB block on 2 CPU ranks)
    parallelize(model, mesh, get_precision("bf16-mixed").adapter_mp_policy(),
                fsdp_utils.Sharding(reshard_after_forward=False), verbose=False)
    model.to_empty(device="cpu")
    _fill_random(model, rank)
    if family == "qwen_image_edit":  # QwenEmbedRope keeps its frequencies in plain attributes: left on meta
        from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope
        model.pos_embed = QwenEmbedRope(theta=10000, axes_dim=list(model.config.axes_dims_rope), scale_rope=True)
    # FLUX's and FLUX.2's position embeddings and timestep projections hold no tensors: nothing else on meta
    return _lora_step_bytes(model, _on_cpu(x))


def _cp_saved_bytes(rank, world, folder) -> int:
    """One rank of CP 2 as train_flux_kontext.py runs it (diffusers' Ulysses, enable_context_parallel) on the
    FLUX.1 width folder, every weight trained: the bytes autograd saves in a forward on CPU, once per storage."""
    import fsdp_utils
    from parallel.context_parallel import enable_context_parallel
    model = memory_plan.meta_model(f"{folder}/transformer").to(torch.bfloat16)
    x = _width_inputs(model, folder, CP_RES, CP_TEXT)
    model = model.to_empty(device="cpu")
    _fill_random(model, rank)
    x = _on_cpu(x)
    x["hidden_states"].requires_grad_(True)
    enable_context_parallel(model, fsdp_utils.build_meshes(torch.device("cpu"), 1, world)[1])
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved.setdefault(ptr, t.untyped_storage().nbytes())
        return t
    with memory_plan.flash_attention_saves(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = model(**x)[0]
    y.float().square().mean().backward()  # the CP graph runs through (its recomputation is not a forward save)
    return sum(saved.values())


NF4_SPLIT = 1e-3  # the planner's NF4 shard over the measured one, relative, at most
QWEN_DMD_WIDTH = {  # name: (train_dmd.py's settings, the planner's)
    "lightning": (dict(BASE_DTYPE="", FAKE_LORA=False), dict(lora_rank=64, lora_alpha=8)),
    "nf4": (dict(BASE_DTYPE="nf4", FAKE_LORA=True), dict(lora_rank=64, lora_alpha=8, fake_lora=True, base_dtype="nf4")),
}


def _qwen_dmd_builds(folder) -> dict:
    """One rank of train_dmd.py's three Qwen-Image transformers at real width, built by the script's own
    build_flow_transformers (meta -> LoRA / NF4 -> the Qwen recipe -> each rank's slices allocated) for
    each QWEN_DMD_WIDTH setting, then an AdamW step over what each model trains: each role's bytes on
    this rank. It replaces train_dmd's settings and the weights' loader: the launch's last step."""
    from types import SimpleNamespace

    import train_dmd
    from families import qwen_image
    from parallel import loading, lowbit
    from precision import get_precision
    # every build step but reading the weights: each rank allocates its slices (the values do not matter here)
    loading.materialize_and_load = lambda model, _folder, home, *_: model.to_empty(device=home)
    train_dmd.MODEL_PATH = folder
    config = {k: getattr(train_dmd, k) for k in ("DP_REPLICATE", "PARALLELISM", "RESHARD_AFTER_FORWARD",
                                                 "CPU_OFFLOAD", "PREFETCH", "COMPILE")}
    config["ACTIVATION_CHECKPOINTING"] = True

    def local_bytes(ts):  # NF4: its inner tensors (codes, scales)
        return sum(lowbit.state_bytes(t.to_local()) for t in ts)
    got = {}
    for name, (script, planner) in QWEN_DMD_WIDTH.items():
        for k, v in script.items():
            setattr(train_dmd, k, v)
        run = SimpleNamespace(d=SimpleNamespace(device=torch.device("cpu")), config=config,
                              lora=lora.Lora(planner["lora_rank"], planner["lora_alpha"]))
        _, _, generator, fake, teacher, ema, _, _ = train_dmd.build_flow_transformers(
            run, qwen_image, get_precision("bf16-mixed"))
        assert ema is None
        got[name] = {"teacher": local_bytes(teacher.parameters())}
        for role, model in (("generator", generator), ("fake_score", fake)):
            trained = [p for p in model.parameters() if p.requires_grad]
            for p in trained:
                p.grad = torch.zeros_like(p)
            opt = torch.optim.AdamW(trained, lr=1e-4)
            opt.step()
            got[name][role] = dict(frozen=local_bytes(p for p in model.parameters() if not p.requires_grad),
                                   trained=local_bytes(trained), grads=local_bytes(p.grad for p in trained),
                                   optim=local_bytes(st[k] for st in opt.state.values()
                                                     for k in ("exp_avg", "exp_avg_sq")))
        del generator, fake, teacher
    return got


def _width_rank(rank, world, folders, out):
    """One rank of the launch: each family's LoRA step, CP 2 on the FLUX.1 folder, then train_dmd.py's Qwen
    builds on the Qwen folder. Rank 0 writes what it measured."""
    import gc
    import json
    got = {}
    for family in WIDTH:
        got[family] = _width_lora_step(rank, folders[family], family)
        gc.collect()
    got["cp"] = _cp_saved_bytes(rank, world, folders["flux_kontext"])
    gc.collect()
    got["qwen_dmd"] = _qwen_dmd_builds(folders["qwen_image_edit"])
    if rank == 0:
        with open(out, "w") as f:
            json.dump(got, f)


@pytest.fixture(scope="module")
def width_runs(tmp_path_factory):
    """({family: its real-width folder}, what rank 0 measured) from one launch of _width_rank on 2 ranks."""
    import json

    from tests.conftest import run_ranks
    root = tmp_path_factory.mktemp("width")
    folders = {family: _width_folder(root, family) for family in WIDTH}
    run_ranks(_width_rank, 2, folders, str(root / "got.json"))
    return folders, json.loads((root / "got.json").read_text())


def _meta_stats(model, x) -> int:
    """The bytes of the (..., 1) norm statistics a forward on meta saves (fp32, as CUDA keeps them)."""
    stats = [0]

    def count_stats(t):
        if t.dim() > 1 and t.shape[-1] == 1:
            stats[0] += t.numel() * t.element_size()
        return t
    with memory_plan.flash_attention_saves(), torch.autograd.graph.saved_tensors_hooks(count_stats, lambda t: t):
        model(**x)
    return stats[0]


@pytest.mark.slow  # one 2-rank launch for the file (width_runs), each model 0.4-0.56 B materialised on CPU
@pytest.mark.parametrize("family", list(WIDTH))
def test_lora_plan_matches_a_real_width_2_rank_run_on_cpu(family, width_runs):
    """The planner on each family's transformer at real width (WIDTH: one block of each kind, LoRA r16 on the
    default targets, bf16-mixed, world size 2) against a rank of the same run on 2 CPU ranks with gloo: the
    base's and the adapters' shards, the adapter grads and AdamW's two moments exactly; the activations as
    autograd saves them within the planner's two known terms, so it never counts less. The copy: meta copies
    the double (dual-stream) block's joint attention output (tokens x 3072) where the kernels' layout gives a
    view; FLUX.2's single block concatenates its attention output with its MLP's before the fused to_out (a
    copy on every device), so it adds none. The statistics: meta keeps the norms' statistics in fp32 (CUDA's
    dtype; CPU's is bf16). FLUX.1 bounds them by all that meta saves; Qwen by half of them (the bf16 CPU
    keeps); FLUX.2 by the LayerNorms' mean and rstd of the norms whose input needs grad under LoRA: the double
    block's norm2 and norm2_context (its norm1s see the frozen embedders' output), the single block's norm
    and norm_out. FLUX.2's q / k norms are torch.nn.RMSNorm, torch's composite in fp32 on meta and CPU alike:
    they add no term (CUDA runs a fused kernel instead, which this check cannot see). FLUX.1 also counts the
    adapters' rank-r intermediates, one per adapted Linear."""
    folders, runs = width_runs
    folder, got = folders[family], runs[family]
    _, _, res, refs = WIDTH[family]
    s = _width_settings(res, refs)
    assert memory_plan.reference_grids(folder, s) == refs
    p = memory_plan.plan(folder, s)
    rows = p["rows"]
    names = tuple(n for n, _ in p["units"]["transformer"][:-1])
    assert names == (("transformer_blocks.0",) if family == "qwen_image_edit" else
                     ("transformer_blocks.0", "single_transformer_blocks.0"))
    planned = memory_plan._activations(folder, "transformer", names, torch.bfloat16, 1,
                                       memory_plan.latent_shapes(folder, s), lora.Lora(16), WIDTH_TEXT).total(False)
    assert got["base"] == rows["transformer"]["params"]
    assert (got["adapters"], got["grads"], got["optim"]) == tuple(rows["transformer.lora"][k] for k in
                                                                  ("params", "grads", "optim"))
    model = memory_plan.meta_model(f"{folder}/transformer").to(torch.bfloat16)
    with torch.device("meta"):
        lora.add_lora(model, lora.Lora(16))
    model.to(torch.bfloat16)
    x = _width_inputs(model, folder, res, WIDTH_TEXT, refs)
    x["hidden_states"].requires_grad_(False)  # as the planner measures LoRA: the latents need no grad
    image, text = x["hidden_states"].shape[1], WIDTH_TEXT
    copy = (image + text) * 3072 * 2  # one double (dual-stream) block
    diff = planned - got["saved"]
    if family == "flux_kontext":
        stats = _meta_stats(model, x)
        assert got["rank_r"] == 6 + 6 + 4  # every adapted Linear's rank-r intermediate: 6 per stream + 4 single
        assert 0 <= diff <= stats + copy and diff >= copy - stats
    elif family == "qwen_image_edit":
        stats = _meta_stats(model, x)
        assert copy - stats // 2 <= diff <= copy + stats // 2
    else:
        stats = 2 * (image + text + (image + text) + image) * (4 - 2)  # mean + rstd per token of those four norms
        assert copy <= diff <= copy + stats
    print(f"\n{family} width, LoRA r16, 2 ranks: saved {got['saved']} bytes, planned {planned}, planned - saved "
          f"{diff} (copy {copy}, statistics {stats}), measured / planned {got['saved'] / planned:.4f}; "
          f"base shard {got['base']}")


@pytest.mark.slow  # the CP 2 run of width_runs' launch
def test_cp_share_on_meta_matches_a_real_width_cp2_run_on_cpu(width_runs):
    """The planner's per-rank share of the activations under CP 2 (held whole: the constant of the linear
    fit; the rest halved) against what autograd saves on a rank of a real CP 2 forward of the FLUX.1 width
    folder (CP_TEXT + CP_RES: 12 tokens), on 2 CPU ranks. The planner never counts less; it counts more by
    known terms: diffusers' Ulysses op saves q, k, v and recomputes the attention output in backward (no
    output, no logsumexp), meta copies the double block's attention output where the kernels' layout gives a
    view, and meta keeps the norms' statistics in fp32 (CUDA's dtype; CPU's is bf16)."""
    folders, runs = width_runs
    model = memory_plan.meta_model(f"{folders['flux_kontext']}/transformer").to(torch.bfloat16)
    x = _width_inputs(model, folders["flux_kontext"], CP_RES, CP_TEXT)
    one = memory_plan.activation_bytes(model, x, [], False)
    quarter = _width_inputs(model, folders["flux_kontext"], CP_RES // 2, CP_TEXT // 4)
    whole = (4 * memory_plan.activation_bytes(model, quarter, [], False) - one) // 3  # 3 tokens: L / 4
    planned = whole + (one - whole) // 2
    stats = _meta_stats(model, x)
    tokens, width, heads = x["hidden_states"].shape[1] + CP_TEXT, 3072, 24
    out_and_lse = 2 * (tokens * width * 2 + heads * tokens * 4) // 2  # 2 attention calls, half per rank
    copy = tokens * width * 2 // 2
    real = runs["cp"]
    assert planned - out_and_lse - copy - stats <= real <= planned
    print(f"\nCP 2 width, {tokens} tokens: a rank saves {real} bytes, the planner's share {planned} ({whole} without a "
          f"sequence dimension whole, the rest halved), measured / planned {real / planned:.4f}")


@pytest.mark.slow  # train_dmd.py's builds of width_runs' launch
def test_qwen_dmd_plan_matches_train_dmds_real_width_build_on_2_ranks(width_runs):
    """The planner's qwen-image-edit DMD2 rows against train_dmd.py's own build on 2 CPU ranks with gloo,
    the transformer at real width (WIDTH's: 1 dual-stream block, 3072 wide, 0.38 B parameters): the Lightning
    recipe (LoRA r64 alpha 8 generator, full fake score in bf16-mixed: fp32 master, bf16 teacher) and the
    24 GB one (LoRA generator and fake score on NF4 bases, NF4 teacher). Each role's shard on rank 0, the
    adapters, their grads and AdamW's moments equal the planner's rows to the byte; NF4 shards up to
    NF4_SPLIT less (the planner gives each rank an even share of the quantised weights, the shards split
    them at their blocks; measured: 0.023 %). The activations are one training forward's, the
    fine-tune's: test_lora_plan_matches_a_real_width_2_rank_run_on_cpu holds those."""
    folders, runs = width_runs
    folder, got = folders["qwen_image_edit"], runs["qwen_dmd"]
    for name, (_, over) in QWEN_DMD_WIDTH.items():
        rows = memory_plan.plan(folder, Settings(world_size=2, resolution=64, fake_score_fp32=False,
                                                 activation_checkpointing=True, script="train_dmd.py",
                                                 **over))["rows"]
        g, nf4 = got[name], over.get("base_dtype") == "nf4"

        def frozen_ok(measured, planned):  # NF4: the planner splits the quantised weights evenly over the ranks
            return 0 <= planned - measured <= NF4_SPLIT * planned if nf4 else measured == planned
        assert frozen_ok(g["teacher"], rows["teacher"]["params"]), (name, g["teacher"], rows["teacher"]["params"])
        for role in ("generator", "fake_score"):
            if f"{role}.lora" in rows:  # the frozen base, then the adapters with their grads and moments
                assert frozen_ok(g[role]["frozen"], rows[role]["params"]), (name, role)
                trained = rows[f"{role}.lora"]
                assert g[role]["trained"] == trained["params"], (name, role)
            else:  # all weights, the last block's unused text outputs frozen (qwen_image.freeze_unused)
                trained = rows[role]
                assert 0 < g[role]["frozen"] and g[role]["frozen"] + g[role]["trained"] == trained["params"]
            assert (g[role]["grads"], g[role]["optim"]) == (trained["grads"], trained["optim"]), (name, role)
        print(f"\nQwen width, 1 block, DMD2 {name}, 2 ranks: rank 0 holds {g}")


# ----------------------------------------------------------------------------------------------
# Wan (families/wan/configs/): sizes, a clip's video tokens, DMD2 per expert, the forward inputs, the docs' rows

def wan_folder(name: str) -> str:
    return memory_plan.model_folder(name)


@pytest.mark.slow  # over 5 s on 2 cores: eight transformers of up to 16 B built on meta
def test_wan_configs_build_at_the_published_sizes():
    sizes = {"wan2.1-t2v-1.3b": 1.419e9, "wan2.1-t2v-14b": 14.288e9, "wan2.1-i2v-14b": 16.395e9,
             "wan2.2-ti2v-5b": 5.000e9, "wan2.2-t2v-a14b": 14.288e9, "wan2.2-i2v-a14b": 14.289e9}
    for name, size in sizes.items():
        subs = ("transformer", "transformer_2") if "a14b" in name else ("transformer",)
        for sub in subs:
            model = memory_plan.meta_model(os.path.join(wan_folder(name), sub))
            assert type(model).__name__ == "WanTransformer3DModel"
            assert sum(p.numel() for p in model.parameters()) == pytest.approx(size, abs=0.001e9), (name, sub)


def test_wan_builtins_are_planned_for_dmd2():
    for name in (n for n in BUILTIN_NAMES if n.startswith("wan")):
        assert memory_plan.BUILTINS[name][0] == wan_folder(name)
        assert memory_plan.layout(wan_folder(name))[0] == "train_dmd.py"


@pytest.mark.parametrize("name,resolution,tokens", [
    ("wan2.1-t2v-1.3b", 480, 32760), ("wan2.1-t2v-14b", 720, 75600), ("wan2.2-ti2v-5b", 480, 8190),
    ("wan2.2-ti2v-5b", 720, 18480), ("wan2.2-i2v-a14b", 480, 32760)])
def test_wan_81_frames_make_the_pipelines_video_tokens(name, resolution, tokens):
    """81 frames: 21 latent frames; 480p is 480 x 832, 720p 720 x 1280 (TI2V-5B: 704 x 1280, its 32 px patch)."""
    s = Settings(world_size=1, resolution=resolution)
    shapes = memory_plan.latent_shapes(wan_folder(name), s)
    assert len(shapes) == 1 and shapes[0][0] == 21
    assert memory_plan._image_tokens(wan_folder(name), shapes) == tokens


def test_wan_frames_are_4k_plus_1():
    s = Settings(world_size=1, resolution=480, frames=80)
    with pytest.raises(SystemExit, match=r"--num_frames=80: Wan takes 4k \+ 1 frames"):
        memory_plan.latent_shapes(wan_folder("wan2.1-t2v-1.3b"), s)
    assert memory_plan.latent_shapes(wan_folder("wan2.1-t2v-1.3b"), dataclasses.replace(s, frames=1)) == ((1, 60, 104),)


def test_wan_a14b_dmd_holds_each_role_per_expert():
    """DMD2 of A14B: generator, fake score and teacher per expert; the LoRA on both experts' generators (and fake
    scores with FAKE_LORA), none on the teachers. 2.1 has no transformer_2; 2.2 I2V no image encoder."""
    prec = get_precision("bf16-mixed")
    _, kind, parts = memory_plan.build_components(wan_folder("wan2.2-t2v-a14b"), prec, build=False, lora=lora.Lora(64))
    assert kind == "wan_dmd"
    assert [p.name for p in parts] == ["generator", "fake_score", "teacher", "generator_2", "fake_score_2",
                                       "teacher_2", "vae", "text_encoder"]
    assert [p.name for p in parts if p.lora] == ["generator", "generator_2"]
    assert [p.spec.subfolder for p in parts[:6]] == ["transformer"] * 3 + ["transformer_2"] * 3
    _, _, parts = memory_plan.build_components(wan_folder("wan2.2-i2v-a14b"), prec, build=False, lora=lora.Lora(64),
                                               fake_lora=True)
    assert [p.name for p in parts if p.lora] == ["generator", "fake_score", "generator_2", "fake_score_2"]
    assert "image_encoder" not in [p.name for p in parts]
    _, _, parts = memory_plan.build_components(wan_folder("wan2.1-i2v-14b"), prec, build=False)
    assert [p.name for p in parts] == ["generator", "fake_score", "teacher", "vae", "text_encoder", "image_encoder"]


def test_wan_example_inputs_are_the_pipelines():
    """5-D latents; 2.1 I2V's 257 CLIP tokens; TI2V-5B's per-token timesteps (expand_timesteps)."""
    def inputs(name, shape):
        cfg = memory_plan._config(wan_folder(name), "transformer")
        return spec_of("WanPipeline").example_inputs(cfg, 2, (shape,), 512, device="meta", dtype=torch.bfloat16)
    x = inputs("wan2.1-i2v-14b", (21, 60, 104))
    assert x["hidden_states"].shape == (2, 36, 21, 60, 104) and x["timestep"].shape == (2,)
    assert x["encoder_hidden_states"].shape == (2, 512, 4096)
    assert x["encoder_hidden_states_image"].shape == (2, plan_spec.IMAGE_TOKENS, 1280)
    x = inputs("wan2.2-ti2v-5b", (21, 30, 52))
    assert x["timestep"].shape == (2, 8190) and "encoder_hidden_states_image" not in x


@pytest.mark.slow  # over 5 s on 2 cores: three 1.4 B transformers at 32,760 tokens, the 5.7 B UMT5 fill
def test_docs_carry_the_wan_rows():
    doc = open(os.path.join(ROOT, "docs", "families", "wan.md"), encoding="utf-8").read()
    run = dict(lora_rank=64, fake_lora=True, activation_checkpointing=True)
    for world, gpus in ((1, "1 x 24 GB"), (8, "8 x 24 GB")):
        p = memory_plan.plan("wan2.1-t2v-1.3b", Settings(world_size=world, **run))
        fill = p["fill"]["total"] / 2**30
        row = f"| Wan 2.1 T2V-1.3B | 480p | {gpus} | AC | {p['gpu_total'] / 2**30:.2f} / {fill:.2f} |"
        assert row in doc, row


# ----------------------------------------------------------------------------------------------
# Z-Image (families/z_image/configs/): the published size, DMD2 at 4096 image tokens, no context parallelism

Z_IMAGE_PARAMS = 6_154_908_736  # REFERENCE: Tongyi-MAI/Z-Image(-Turbo)'s transformer as the Hub counts it (CONFIGS.md)


def test_z_image_builds_at_the_published_size_and_plans_dmd2():
    """The config builds the published 6.15 B on meta; z-image-dmd plans DMD2 (z-image: fine-tuning) at 1024^2:
    128 x 128 latents, 4096 image tokens, 512 text tokens; the Qwen3-4B text encoder (4.02 B) offline. Context
    parallelism is refused in one line (the transformer has no _cp_plan)."""
    folder = memory_plan.model_folder("z-image-dmd")
    model = memory_plan.meta_model(os.path.join(folder, "transformer"))
    assert sum(p.numel() for p in model.parameters()) == Z_IMAGE_PARAMS
    assert memory_plan.layout(memory_plan.model_folder("z-image")) == ("train_flux_kontext.py", "z_image")
    assert memory_plan.layout(folder, "train_dmd.py") == ("train_dmd.py", "z_image_dmd")
    s = Settings(world_size=8, resolution=memory_plan.native_resolution(folder))
    assert s.resolution == 1024 and memory_plan.latent_shapes(folder, s) == ((128, 128),)
    assert memory_plan._image_tokens(folder, ((128, 128),)) == 4096 and memory_plan.text_length(folder) == 512
    with pytest.raises(SystemExit, match=r"^plan: --context_parallel=2: [^\n]*Z-Image[^\n]*$"):
        memory_plan.check_context_parallel(folder, dataclasses.replace(s, context_parallel=2))


Z_IMAGE_ROWS = [  # docs/families/z_image.md's "What fits": (run, GPUs, fits with, settings)
    ("LoRA, NF4 bases and teacher", 1, "24", "AC", dict(base_dtype="nf4")),
    ("LoRA, NF4 bases and teacher", 8, "24", "AC", dict(base_dtype="nf4")),
    ("LoRA, bf16 bases and teacher", 1, "24", "AC + CPU offload", dict(cpu_offload=True)),
    ("LoRA, bf16 bases and teacher", 8, "24", "AC", {}),
    ("full, bf16 teacher", 8, "80", "AC", {})]


@pytest.mark.slow  # over 5 s on 2 cores: three 6.15 B transformers on meta at 4096 tokens, the Qwen3-4B fill
def test_docs_and_recipes_carry_the_z_image_rows():
    doc = open(os.path.join(ROOT, "docs", "families", "z_image.md"), encoding="utf-8").read()
    recipes = {name: open(os.path.join(ROOT, "recipes", name), encoding="utf-8").read()
               for name in ("dmd_z_image_8step_lora.sh", "dmd_z_image_4step_full_8x80gb.sh")}
    planned = {}
    for run, world, gb, fits, extra in Z_IMAGE_ROWS:
        lora = dict(lora_rank=64, fake_lora=True) if run.startswith("LoRA") else {}
        p = memory_plan.plan("z-image-dmd", Settings(world_size=world, activation_checkpointing=True,
                                                     gpu_memory_gb=int(gb), **lora, **extra))
        planned[run, world] = train, fill = p["gpu_total"] / 2**30, p["fill"]["total"] / 2**30
        assert max(train, fill) < int(gb) * 1e9 / 2**30, (run, world)
        row = f"| {run} | {world} x {gb} GB | {fits} | {train:.2f} / {fill:.2f} |"
        assert row in doc, row
    train, fill = planned["LoRA, NF4 bases and teacher", 1]
    eight = planned["LoRA, NF4 bases and teacher", 8]
    assert (f"plans {train:.1f} GiB for\n# training and {fill:.1f} for the text-cache fill" in
            recipes["dmd_z_image_8step_lora.sh"])
    assert f"(8 x 24 GB): {eight[0]:.1f} and {eight[1]:.1f}" in recipes["dmd_z_image_8step_lora.sh"]
    train, fill = planned["full, bf16 teacher", 8]
    assert (f"plans {train:.1f} GiB per GPU (the text-cache fill before it {fill:.1f};" in
            recipes["dmd_z_image_4step_full_8x80gb.sh"])


Z_IMAGE_OMNI_SIGLIP_PARAMS = 427_888_064  # REFERENCE: DiffSynth-Studio's Siglip2ImageEncoder428M (CONFIGS.md)


@pytest.mark.slow  # two 6.5 B transformers and a 428 M SigLIP built on meta
def test_z_image_omni_plans_its_references_siglip_and_segments():
    """z-image-omni is the same transformer with its SigLIP embedder and refiner (siglip_feat_dim 1152) and a 428 M
    SigLIP2 (so400m, patch 16, 256 patches) cached before training: two references at 1024^2 beside the target
    (12288 image tokens), fed in omni mode (x = the references + [the target], 4 caption segments, each reference's
    16 x 16 SigLIP grid); its fill runs 4 segments per prompt and one reference at a time. z-image (ZImagePipeline,
    no edits) plans its target alone, and --references is refused for it in one line."""
    from families.z_image import plan_spec
    folder, t2i = memory_plan.model_folder("z-image-omni"), memory_plan.model_folder("z-image")
    assert memory_plan.layout(folder) == ("train_flux_kontext.py", "z_image_omni")
    assert memory_plan.layout(memory_plan.model_folder("z-image-omni-dmd"), "train_dmd.py") == (
        "train_dmd.py", "z_image_omni_dmd")
    siglip = memory_plan.meta_model(os.path.join(folder, "siglip"))
    assert sum(p.numel() for p in siglip.parameters()) == Z_IMAGE_OMNI_SIGLIP_PARAMS
    with open(os.path.join(folder, "siglip_processor", "preprocessor_config.json")) as f:
        assert json.load(f)["max_num_patches"] == plan_spec.SIGLIP_PATCHES
    s = Settings(world_size=1, resolution=1024)
    assert memory_plan.latent_shapes(folder, s) == ((128, 128),) * 3 and memory_plan.latent_shapes(t2i, s) == (
        (128, 128),)
    assert memory_plan._image_tokens(folder, ((128, 128),) * 3) == 12288
    config = memory_plan.meta_model(os.path.join(folder, "transformer")).config
    inputs = plan_spec.example_inputs(config, 1, ((128, 128),) * 3, 512, "meta", torch.bfloat16)
    assert [len(c) for c in inputs["cap_feats"][0]] == [4, 4, 512, 4] and inputs["image_noise_mask"] == [[0, 0, 1]]
    assert [tuple(f.shape) for f in inputs["siglip_feats"][0][:2]] == [(16, 16, 1152)] * 2
    assert inputs["siglip_feats"][0][2] is None and [tuple(x.shape) for x in inputs["x"][0]] == [(16, 1, 128, 128)] * 3
    assert [plan_spec.fill_batch("ZImageOmniPipeline", sub, 16, 2) for sub in ("text_encoder", "siglip")] == [64, 1]
    assert plan_spec.fill_batch("ZImagePipeline", "text_encoder", 16, 0) == 16
    with pytest.raises(SystemExit, match=r"^plan: --references / --reference_area: [^\n]*z-image is z_image"):
        memory_plan.plan("z-image", Settings(world_size=1, references=1))


@pytest.mark.slow  # a 6.5 B transformer on meta at 12288 image tokens, the Qwen3-4B fill of 64 sequences
def test_the_z_image_omni_recipe_and_docs_carry_the_planners_figures():
    """recipes/z_image_omni_edit_lora.sh's figures (LoRA r64, AC, two references at 1024^2, 1 x 40 GB) and
    docs/families/z_image.md's rows are the planner's; on 24 GB the training fits, the fill does not."""
    recipe = open(f"{ROOT}/recipes/z_image_omni_edit_lora.sh").read()
    docs = open(f"{ROOT}/docs/families/z_image.md").read()
    p = memory_plan.plan("z-image-omni", Settings(world_size=1, lora_rank=64, resolution=1024,
                                                  activation_checkpointing=True, gpu_memory_gb=40))
    train, fill = p["gpu_total"] / 2**30, p["fill"]["total"] / 2**30
    assert f"plans {train:.2f} GiB for training and {fill:.2f} for the\n# text-cache fill" in recipe
    assert train < 24e9 / 2**30 < fill < 40e9 / 2**30
    assert (f"| LoRA r64, two references | 1 x 40 GB | AC | {train:.2f} / {fill:.2f} | "
            "`recipes/z_image_omni_edit_lora.sh` |") in docs
    # the sequence line names every part the activations were measured with: SigLIP grids and template segments
    assert ("sequence per sample: 4096 target tokens (1024^2 / 16^2) + 2 reference(s) x 4096 tokens (each downsized "
            "to 1024^2 px if larger) + 512 text tokens + 256 + 256 SigLIP tokens (2 reference(s), at most 256 patches "
            "each) + 3 template segments of 4 tokens") in memory_plan.format_plan("z-image-omni", p)
