"""Low-bit storage (parallel/lowbit.py): BASE_DTYPE=nf4 (a 4-bit frozen LoRA base sharded by
FSDP2) and OPTIMIZER=adamw8bit / adamw4bit (torchao's AdamW), through train_flux_kontext.py on the
tiny Kontext model, plus the settings' checks and the quantisation error in process.

    python -m pytest tests/test_lowbit.py -q

Runs (module-scoped, fp32 compute so that 1 process and 2 ranks agree to rounding; each
one-process run beside a 2-rank one):
    nf4_ref      python, BATCH_SIZE=4, LoRA rank 4 on an NF4 base
    nf4_two      torchrun 2, BATCH_SIZE=2, the same, a checkpoint at step 2
    nf4_resumed  torchrun 2 from a copy of nf4_two's step 2 (must equal it bit for bit)
    nf4_ddp      torchrun 2, PARALLELISM=ddp, the same LoRA on an NF4 base
    adamw, adamw8bit, adamw4bit   torchrun 2, full fine-tunes, 20 steps, checkpoints at 18 and 20 (adamw: also
                 the fp32 base that NF4 is compared with, its first loss and its memory)
    <opt>_resumed   torchrun 2 from a copy of <opt>'s step 18 (bit for bit), for 8 and 4 bit
    adamw8bit_one   python, from the same 2-rank step-18 checkpoint (another world size)
The resumed runs take the last 2 steps: the first updates from the restored quantised states, the second from
states the resumed run computed itself.
"""
from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch

from tests.conftest import (assert_kontext_resumed_bit_exact, kontext_run, launch_all, launch_kontext, read_checkpoint,
                            read_metrics, run_ranks)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from core.errors import ConfigError
from components import optim
from parallel import lora, lowbit

torchao = pytest.importorskip("torchao")

LORA = ["--lora_rank=4", "--lora_alpha=8", "--lr=3e-3", "--sample_every=0"]
NF4 = LORA + ["--base_dtype=nf4"]
OPT_STEPS, OPT_RESUME = 20, 18  # steps of the optimizer runs, the step their resumed runs start from
OPT = [f"--max_steps={OPT_STEPS}", f"--save_every={OPT_RESUME}", "--sample_every=0", "--val_every=0", "--batch_size=2",
       "--lr=1e-3"]


@pytest.fixture(scope="module")
def runs(kontext_setup):
    root, out = kontext_setup["root"] / "lowbit", {}
    os.makedirs(root)

    def run(name, args, ranks=2, resume_from=None, step=None):
        if resume_from:
            os.makedirs(root / name / "checkpoints")
            shutil.copytree(root / resume_from / "checkpoints" / f"step_{step:06d}",
                            root / name / "checkpoints" / f"step_{step:06d}")
            args = args + ["--resume=auto"]
        return kontext_run(kontext_setup, root / name, args, ranks=ranks)

    def side_by_side(stage):
        out.update(launch_all({name: run(name, *spec) for name, spec in stage.items()}, check=False))

    # {name: (args, ranks, resumed from, at step)}; a one-process run beside a 2-rank one (it leaves
    # a core idle), the 2-rank runs one at a time (side by side they only cost more CPU)
    nf4_two = NF4 + ["--batch_size=2", "--save_every=2"]
    side_by_side({"nf4_ref": (NF4 + ["--batch_size=4"], 1), "nf4_two": (nf4_two,)})
    side_by_side({"nf4_resumed": (nf4_two, 2, "nf4_two", 2)})
    side_by_side({"nf4_ddp": (NF4 + ["--batch_size=2", "--parallelism=ddp"],)})
    for opt in lowbit.OPTIMIZERS:
        side_by_side({opt: (OPT + [f"--optimizer={opt}"],)})
    one = [a.replace("--batch_size=2", "--batch_size=4") for a in OPT] + ["--optimizer=adamw8bit"]
    side_by_side({"adamw8bit_one": (one, 1, "adamw8bit", OPT_RESUME),
                  "adamw8bit_resumed": (OPT + ["--optimizer=adamw8bit"], 2, "adamw8bit", OPT_RESUME)})
    side_by_side({"adamw4bit_resumed": (OPT + ["--optimizer=adamw4bit"], 2, "adamw4bit", OPT_RESUME)})
    return {k: (str(root / k), v) for k, v in out.items()}


def _ok(runs, name):
    out, proc = runs[name]
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{proc.stdout[-3000:]}"
    return out


def _memory(stdout: str, which: int = -1) -> list[dict]:
    """The per-rank memory_bytes rows of a run's memory table (-1: after training)."""
    lines = [line for line in stdout.splitlines() if line.startswith("memory_bytes ")]
    return json.loads(lines[which].split(" ", 1)[1])


# ----------------------------------------------------------------------------------------------
# NF4 base


@pytest.mark.slow
def test_nf4_two_ranks_match_one_process_losses_and_adapters(runs):
    """Same quantised base on any world size (whole tensors quantised, then chunked): 2 ranks and
    1 process agree to fp32 rounding, as the fp32-base LoRA test does (1e-5)."""
    ref, two = read_metrics(_ok(runs, "nf4_ref")), read_metrics(_ok(runs, "nf4_two"))
    for a, b in zip(ref, two, strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-5 and abs(a["grad_norm"] - b["grad_norm"]) < 1e-5, (a, b)
    a = read_checkpoint(runs["nf4_ref"][0], 3)["model.transformer"]
    b = read_checkpoint(runs["nf4_two"][0], 3)["model.transformer"]
    assert a.keys() == b.keys() and all(lora.is_adapter(k) for k in a)  # adapters only: no 4-bit base saved
    for k in a:
        assert a[k].dtype == torch.float32  # the adapters stay fp32
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5, msg=k)


@pytest.mark.slow
def test_nf4_resume_is_bit_exact_and_ddp_matches_fsdp(runs):
    assert_kontext_resumed_bit_exact(_ok(runs, "nf4_two"), _ok(runs, "nf4_resumed"), 3, models=("model.transformer",))
    two, ddp = read_metrics(runs["nf4_two"][0]), read_metrics(_ok(runs, "nf4_ddp"))
    for a, b in zip(two, ddp, strict=True):  # the quantized-DDP alternative: same base, same updates
        assert abs(a["loss"] - b["loss"]) < 1e-5, (a, b)


@pytest.mark.slow
def test_nf4_base_trains_like_the_full_precision_base_in_a_quarter_of_the_memory(runs):
    """Against the fp32 base (the fused-AdamW fine-tune, on the same first batch of 4): the first
    loss (adapters still zero, so base alone) within the quantisation error, and the base's bytes per rank
    measured from the memory table (the NF4 run's adapters counted on its side)."""
    nf4, base = read_metrics(runs["nf4_two"][0]), read_metrics(_ok(runs, "adamw"))
    assert abs(nf4[0]["loss"] - base[0]["loss"]) < 0.05 * base[0]["loss"], (nf4[0], base[0])
    out = _ok(runs, "nf4_two")
    assert "fp32/nf4" in runs["nf4_two"][1].stdout  # the audit shows the 4-bit storage
    params_nf4 = [r["params"] for r in _memory(runs["nf4_two"][1].stdout)]
    params_fp32 = [r["params"] for r in _memory(runs["adamw"][1].stdout)]
    ratios = [a / b for a, b in zip(params_nf4, params_fp32)]
    # the tiny model's root (embedders, norms, biases: not quantised) keeps this far from the
    # 0.13 of an all-Linear fp32 model; the real-width ratios are test_state_bytes_at_flux_width's
    assert all(r < 0.5 for r in ratios), ratios
    assert os.path.exists(os.path.join(out, "export", "pytorch_lora_weights.safetensors"))


@pytest.mark.slow
def test_nf4_lora_export_loads_onto_the_full_precision_base(runs, kontext_setup):
    """The adapters trained on the 4-bit base load onto the full-precision base with
    load_lora_weights, and change its output."""
    from diffusers import FluxKontextPipeline
    from tests.test_lora import transformer_inputs
    pipe = FluxKontextPipeline.from_pretrained(kontext_setup["model_path"], dtype=torch.float32)
    inputs = transformer_inputs(pipe.transformer.config)
    with torch.no_grad():
        before = pipe.transformer(**inputs).sample
        pipe.load_lora_weights(os.path.join(_ok(runs, "nf4_two"), "export"))
        after = pipe.transformer(**inputs).sample
    assert (after - before).abs().max() > 1e-4


def test_nf4_output_within_the_quantisation_error(kontext_setup):
    """The tiny Kontext transformer with its Linear weights in NF4 against the same model in bf16
    on one input: NF4's weight error on these (roughly Gaussian) weights is ~9 % relative RMS
    (QLoRA's 4-bit NormalFloat: 16 levels per block of 64); through the 4 blocks the output's
    relative RMS error stays under 15 % where bf16's own rounding is ~0.5 %."""
    from diffusers import FluxTransformer2DModel
    from tests.test_lora import transformer_inputs
    folder = os.path.join(kontext_setup["model_path"], "transformer")
    ref = FluxTransformer2DModel.from_pretrained(folder, dtype=torch.float32)
    bf16 = FluxTransformer2DModel.from_pretrained(folder, dtype=torch.bfloat16).requires_grad_(False)
    nf4 = FluxTransformer2DModel.from_pretrained(folder, dtype=torch.bfloat16).requires_grad_(False)
    n = lowbit.quantize_base(nf4, shards=2)
    assert n == sum(lowbit.nf4_blocks(m.weight.shape) is not None for m in bf16.modules()
                    if isinstance(m, torch.nn.Linear))
    inputs = transformer_inputs(ref.config)
    with torch.no_grad():
        outs = {
            k: m(
                **{a: v.to(torch.bfloat16) if torch.is_tensor(v) and k != "ref" else v for a, v in inputs.items()}
            ).sample.float()
            for k, m in (("ref", ref), ("bf16", bf16), ("nf4", nf4))
        }

    def rel(a):
        return ((outs[a] - outs["ref"]).norm() / outs["ref"].norm()).item()
    assert rel("bf16") < 0.01 and rel("nf4") < 0.15, (rel("bf16"), rel("nf4"))
    weights = [(m.weight.float(), m.weight.get_original_weight().float()) for m in nf4.modules()
               if isinstance(m, torch.nn.Linear) and lowbit.is_nf4(m.weight)]
    for name, m in bf16.named_modules():
        if isinstance(m, torch.nn.Linear) and lowbit.is_nf4(nf4.get_submodule(name).weight):
            w, q = m.weight.float(), nf4.get_submodule(name).weight.get_original_weight().float()
            assert (q - w).norm() / w.norm() < 0.12, name  # per weight: QLoRA's block-wise 4-bit error
    assert weights


@pytest.mark.slow  # over 5 s on 2 cores
def test_state_bytes_at_flux_width():
    """Bytes per rank of a FLUX-width weight (3072 x 3072) as NF4 vs bf16, and of torchao's 8-/4-bit
    AdamW states vs fp32 ones, measured on the tensors themselves (parallel/lowbit.state_bytes):
    NF4 ~0.516 byte/param (4-bit codes + an 8-bit scale per 64 + an fp32 per 16384) -> 0.258 of bf16;
    8-bit states 1 + 4/256 byte each -> 0.254 of fp32; 4-bit 0.5 + 4/128 -> 0.133."""
    from torchao.optim import AdamW4bit, AdamW8bit
    from torchao.quantization import to_nf4
    w = torch.randn(3072, 3072, dtype=torch.bfloat16)
    ratio = lowbit.state_bytes(to_nf4(w, *lowbit.nf4_blocks(w.shape))) / lowbit.state_bytes(w)
    assert 0.255 < ratio < 0.26, ratio
    p = torch.nn.Parameter(torch.randn(3072, 3072))
    p.grad = torch.randn_like(p)
    full = 2 * p.numel() * 4
    for cls, expected in ((AdamW8bit, 0.254), (AdamW4bit, 0.133)):
        opt = optim.make_optimizer({AdamW8bit: "adamw8bit", AdamW4bit: "adamw4bit"}[cls], [p], lr=1e-3,
                                    betas=(0.9, 0.999))
        assert isinstance(opt, cls)
        opt.step()
        got = sum(lowbit.state_bytes(v) for k, v in opt.state[p].items() if k != "step") / full
        assert abs(got - expected) < 0.002, (cls.__name__, got)


def test_nf4_blocks_depend_on_the_shape_alone():
    assert lowbit.nf4_blocks(torch.Size([3072, 3072])) == (64, 256)
    assert lowbit.nf4_blocks(torch.Size([128, 128])) == (64, 32)  # tiny: 8 shards of whole scale blocks
    assert lowbit.nf4_blocks(torch.Size([3072])) is None  # 1-D: stays in its dtype
    assert lowbit.nf4_blocks(torch.Size([10, 10])) is None


# ----------------------------------------------------------------------------------------------
# device placement: the meta device stands in for a GPU (the safetensors slice stays on the CPU)


def _nf4_linear(device, shards=1):
    """A frozen Linear(128 -> 256) weight quantised to NF4 on the meta skeleton, FSDP2-sharded
    over the default group when shards > 1, then allocated on `device` (to_empty)."""
    with torch.device("meta"):
        m = torch.nn.Sequential(torch.nn.Linear(128, 256, bias=False)).requires_grad_(False)
    lowbit.quantize_base(m, shards=shards)
    if shards > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        fully_shard(m, mesh=init_device_mesh("cpu", (shards,)))
    return m.to_empty(device=device)


def _inner(t) -> dict:
    """{name: inner tensor} of an NF4 parameter (or of a DTensor's NF4 shard)."""
    t = getattr(t, "_local_tensor", t)
    return {a: getattr(t, a) for a in t.__tensor_flatten__()[0]}


def _assert_filled(w, full, device, rank=0, world=1):
    """After fill_nf4: every inner tensor on `device`; on the CPU, bit for bit the whole tensor's
    codes (this rank's chunk)."""
    assert {a: x.device.type for a, x in _inner(w).items()} == dict.fromkeys(_inner(w), device)
    if device == "cpu":
        ref = torch.chunk(torchao.quantization.to_nf4(full, *lowbit.nf4_blocks(full.shape)), world, dim=0)[rank]
        for a, x in _inner(w).items():
            assert torch.equal(x, getattr(ref, a)), a


def test_fill_nf4_puts_every_inner_tensor_on_the_parameters_device():
    """fill_nf4 from a CPU slice into an NF4 weight allocated elsewhere: the code book and
    scaler_mean (meta after to_empty) land with the codes, not where the slice was read."""
    full = torch.randn(256, 128, generator=torch.Generator().manual_seed(0))
    for device in ("meta", "cpu"):
        w = _nf4_linear(device)[0].weight
        lowbit.fill_nf4(w, full)
        _assert_filled(w, full, device)


def _fill_sharded(rank, world):
    full = torch.randn(256, 128, generator=torch.Generator().manual_seed(0))
    for device in ("meta", "cpu"):
        m = _nf4_linear(device, shards=world)
        w = m[0].weight
        assert lowbit.is_nf4(w) and tuple(w._local_tensor.shape) == (256 // world, 128)
        lowbit.fill_nf4(w, full)
        _assert_filled(w, full, device, rank, world)
        assert lowbit.misplaced_inner_tensors(w, device) == []
        lowbit.check_devices(m)


@pytest.mark.slow
def test_fill_nf4_puts_every_inner_tensor_on_the_shards_device_under_fsdp2():
    run_ranks(_fill_sharded, 2)


def test_misplaced_inner_tensors_of_nf4_and_low_bit_optimizer_states():
    """The walker through subclasses' inner tensors, and check_devices' one line naming the
    parameter or optimizer state: a torchao 8-bit AdamW state after one step on the CPU, then its
    code book moved off the device."""
    from torchao.optim import AdamW8bit
    model = torch.nn.Linear(128, 64, bias=False)  # 8192 values: block-quantised states
    model.weight.grad = torch.randn_like(model.weight)
    opt = optim.make_optimizer("adamw8bit", model.parameters(), lr=1e-3, betas=(0.9, 0.999))
    assert isinstance(opt, AdamW8bit)
    opt.step()
    state = opt.state[model.weight]
    assert type(state["exp_avg"]).__name__ == "OptimState8bit"
    assert all(lowbit.misplaced_inner_tensors(v, "cpu") == [] for v in state.values())
    lowbit.check_devices(model, opt)
    lowbit.check_devices(model, opt, "cpu")
    assert lowbit.misplaced_inner_tensors(model.weight, "meta") == [""]  # a plain tensor: itself
    state["exp_avg"].qmap = state["exp_avg"].qmap.to("meta")
    assert lowbit.misplaced_inner_tensors(state["exp_avg"], "cpu") == ["qmap"]
    assert lowbit.misplaced_inner_tensors(state["exp_avg_sq"], "cpu") == []
    with pytest.raises(RuntimeError, match="optimizer state exp_avg of weight.qmap is on meta, expected cpu") as e:
        lowbit.check_devices(model, opt)  # expected: the device the parameter reports
    assert "\n" not in str(e.value)

    nf4 = _nf4_linear("cpu")
    lowbit.fill_nf4(nf4[0].weight, torch.randn(256, 128))
    lowbit.check_devices(nf4)
    nf4[0].weight.nf4 = nf4[0].weight.nf4.to("meta")
    assert lowbit.misplaced_inner_tensors(nf4[0].weight, "cpu") == ["nf4"]
    with pytest.raises(RuntimeError, match=r"parameter 0.weight.nf4 is on meta, expected cpu \(its NF4Tensor"):
        lowbit.check_devices(nf4)


# ----------------------------------------------------------------------------------------------
# low-bit AdamW


@pytest.mark.slow
def test_low_bit_adamw_follows_fused_adamw(runs):
    """20 full fine-tuning steps at LR 1e-3: the 8-bit run's losses stay within 2 % of fused
    AdamW's at every step, the 4-bit run's within 5 % (their states are block-quantised: the
    updates differ from the first step on, the trajectory barely)."""
    ref = [m["loss"] for m in read_metrics(_ok(runs, "adamw"))]
    assert len(ref) == OPT_STEPS
    for opt, band in (("adamw8bit", 0.02), ("adamw4bit", 0.05)):
        got = [m["loss"] for m in read_metrics(_ok(runs, opt))]
        worst = max(abs(a - b) / b for a, b in zip(got, ref, strict=True))
        assert worst < band, (opt, worst, got, ref)
        assert got != ref  # really another optimizer


@pytest.mark.slow
@pytest.mark.parametrize("opt", ["adamw8bit", "adamw4bit"])
def test_low_bit_adamw_resume_is_bit_exact(runs, opt):
    ckpt = assert_kontext_resumed_bit_exact(_ok(runs, opt), _ok(runs, f"{opt}_resumed"), OPT_STEPS,
                                            models=("model.transformer",))
    states = ckpt["optim.transformer"]["state"]
    assert states and all({"exp_avg", "exp_avg_sq"} <= set(s) for s in states.values())  # every moment saved


@pytest.mark.slow
def test_low_bit_adamw_state_memory_per_rank(runs):
    """Optimizer bytes per rank after training, from the memory table: 8-bit and 4-bit vs fp32
    (the tiny model's shards under 4096 values keep fp32 states, torchao's rule, so the ratios sit
    above the real-width 0.254 / 0.133)."""
    fp32 = [r["optim"] for r in _memory(runs["adamw"][1].stdout)]
    for opt, bound in (("adamw8bit", 0.95), ("adamw4bit", 0.95)):
        ratios = [r["optim"] / f for r, f in zip(_memory(runs[opt][1].stdout), fp32)]
        assert all(r < bound for r in ratios), (opt, ratios)


@pytest.mark.slow
def test_low_bit_adamw_resumes_onto_another_world_size_or_says_why(runs):
    """The 2-rank 8-bit checkpoint resumed by one process: it either trains on (DCP reshards the
    quantised states) or stops with one line naming the world sizes."""
    out, proc = runs["adamw8bit_one"]
    if proc.returncode == 0:
        assert len(read_metrics(out)) == OPT_STEPS - OPT_RESUME
    else:
        assert "OPTIMIZER=adamw8bit" in proc.stdout and "world size" in proc.stdout, proc.stdout[-2000:]


# ----------------------------------------------------------------------------------------------
# settings


def _settings(**over):
    c = {"BASE_DTYPE": "", "OPTIMIZER": "adamw", "LORA_RANK": 4, "CPU_OFFLOAD": False, "COMPILE": False,
         "DP_REPLICATE": 1, "LORA_EXPORT_MERGED": False, "CONTEXT_PARALLEL": 1}
    c.update(over)
    return c


@pytest.mark.parametrize("over, message", [
    ({"BASE_DTYPE": "int4"}, "BASE_DTYPE='int4': choose one of"),
    ({"OPTIMIZER": "adam8"}, "OPTIMIZER='adam8': choose one of"),
    ({"BASE_DTYPE": "nf4", "LORA_RANK": 0}, "BASE_DTYPE=nf4 needs LORA_RANK > 0"),
    ({"BASE_DTYPE": "nf4", "CPU_OFFLOAD": True}, "BASE_DTYPE=nf4 with CPU_OFFLOAD"),
    ({"BASE_DTYPE": "nf4", "LORA_EXPORT_MERGED": True}, "load_lora_weights"),
])
def test_bad_settings_fail_in_one_line(over, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as e:
        lowbit.check_lowbit(_settings(**over))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("over", [{"BASE_DTYPE": "nf4"}, {"OPTIMIZER": "adamw8bit"}])
def test_missing_torchao_is_one_line(monkeypatch, over):
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao -> ImportError
    with pytest.raises(ConfigError, match="needs torchao") as e:
        lowbit.check_lowbit(_settings(**over))
    assert "\n" not in str(e.value)
    lowbit.check_lowbit(_settings())  # the defaults never import it


@pytest.mark.slow  # launches the scripts
def test_scripts_refuse_bad_settings_before_any_work(kontext_setup, tmp_path):
    proc = launch_kontext(kontext_setup, tmp_path / "o", ["--base_dtype=nf4"], ranks=1, check=False)
    assert proc.returncode != 0 and "BASE_DTYPE=nf4 needs LORA_RANK > 0" in proc.stdout
    assert not os.path.exists(tmp_path / "o" / "metrics.jsonl")
