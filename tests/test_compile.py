"""COMPILE=1: torch.compile of each FSDP unit's forward (parallel/compile.py), AC -> compile ->
fully_shard, against eager.

    HF_HUB_OFFLINE=1 python -m pytest tests/test_compile.py -q

- train_flux_kontext.py end to end, as users launch it (2 CPU ranks, fp32, activation
  checkpointing on, 3 AdamW steps at lr 1e-3), eager and compiled with inductor (the default
  backend: C++ kernels built with g++): the same losses and grad norms to 1e-5 relative, the same
  trained weights to 5e-5 absolute (a twentieth of one lr step; measured: 3e-6), the same checkpoint
  and export keys (no `_orig_mod.`), and the start-up line `compile: 2 graphs, 0 graph breaks` (one
  graph per FLUX block kind, shared by every block of that kind); a compiled run resumed from the
  eager run's step-2 checkpoint ends where the eager run does.
- The same with LoRA (rank 4) at bf16-mixed, eager, compiled and eager in fp32, one process each,
  side by side: losses to 2e-3 relative, the trained lora_B no further from eager than bf16 puts it
  from fp32, 3 graphs and 0 breaks.
- train_flux_kontext.py on the tiny Qwen-Image-Edit-2509 default (two references), eager and
  compiled, one rank each: the same losses, grad norms and weights, 2 graphs and 0 breaks.
- The DMD UNet in process, on 2 spawned ranks: families.sd_unet.build_unet with activation checkpointing
  and COMPILE, 2 AdamW steps against the same model eager. Its 15 units have 9 distinct shapes
  (ResnetBlock2D at 7 channel pairs, BasicTransformerBlock at 2 widths), each a graph of the
  checkpoint wrapper's one code object: more than dynamo's default recompile limit (8), which
  compile_units raises, so no unit falls back to eager. Compiling those 9 graphs with inductor
  costs minutes on 2 CPU cores, and a DMD step compiles 27 (generator, fake score, teacher; with
  and without grad), so this check compiles with backend="aot_eager": dynamo's capture (graph
  breaks, guards, recompiles) and AOTAutograd's joint graph with the checkpoint op are exactly
  the inductor path's; inductor's own numerics on the UNet are measured by
  `python tools/benchmarks.py compile` (compiled vs eager train_dmd.py, side by side).

Runtime: the inductor compile dominates, g++ building each graph's kernels in one process at a time
while its other rank waits. So every launch starts at once, before the in-process UNet checks, which
run meanwhile, and the compiled Kontext run that resumes the eager one's checkpoint starts when that
run is done. With an empty inductor cache (TORCHINDUCTOR_CACHE_DIR, by default
/tmp/torchinductor_$USER), emulating the CI machine (ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2) on 2 cores shared with other jobs (load 13), the file took 237 s; with a
warm cache, not emulated, about 140 s.
"""
from __future__ import annotations

import functools
import os
import re

import pytest
import torch

from tests.conftest import (assert_trains_as_eager, copy_checkpoint, launch_env, read_metrics, run_ranks, start_all,
                            tiny_default)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import fsdp_utils
from core.errors import ConfigError
from parallel import compile as compiling
import train_dmd
import train_flux_kontext as tfk
from families import sd_unet

STEPS = 3
LR = 1e-3


def export(out):
    from safetensors.torch import load_file
    return load_file(os.path.join(out, "export", "transformer", "diffusion_pytorch_model.safetensors"))


def checkpoint_keys(out, step):
    import torch.distributed.checkpoint as dcp
    path = os.path.join(out, "checkpoints", f"step_{step:06d}")
    return set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)


def flux_setup(root):
    """(arguments, environment) that every FLUX launch here shares: the tiny Kontext default at 32 px,
    STEPS AdamW steps at LR, activation checkpointing, a loss line per step, no samples."""
    model, data = tiny_default("flux_kontext")
    args = [f"--model_path={model}", f"--data_path={os.path.join(data, 'data.jsonl')}",
            f"--text_cache_dir={root / 'text_cache'}", "--resolution=32", f"--max_steps={STEPS}", "--log_every=1",
            "--num_sample_pairs=2", "--sample_every=0", "--val_every=0", f"--lr={LR}", "--warmup_steps=0",
            "--activation_checkpointing=1"]
    return args, launch_env()


def flux_jobs(root) -> dict:
    """The tiny Kontext default on 2 ranks, eager and compiled, otherwise identical (launch_all's jobs), and
    the arguments of the compiled run that resumes the eager run's step-2 checkpoint."""
    common, env = flux_setup(root)
    common += ["--precision=fp32", "--save_every=2", "--export_dtype=fp32"]
    jobs = {name: dict(script="train_flux_kontext.py", env=env,
                       args=common + [f"--compile={flag}", f"--output_dir={root / name}"])
            for name, flag in (("eager", "0"), ("compiled", "1"))}
    return {**jobs, "resumed": dict(script="train_flux_kontext.py", env=env, args=common + [
        "--compile=1", f"--output_dir={root / 'resumed'}", "--resume=auto"])}


def flux_lora_jobs(root) -> dict:
    """LoRA adapters on the tiny Kontext default at the scripts' default precision (bf16-mixed:
    fp32 adapters and AdamW state, bf16 compute), eager and compiled, otherwise identical; and
    eager in fp32, the yardstick for how far bf16 rounding alone moves the adapters."""
    common, env = flux_setup(root)
    common += ["--lora_rank=4", "--save_every=0"]
    # one process each: the 2-rank compiled path is flux_jobs'; here the graphs and numerics
    kinds = {"eager": ("bf16-mixed", "0"), "compiled": ("bf16-mixed", "1"), "fp32": ("fp32", "0")}
    return {name: dict(script="train_flux_kontext.py", ranks=1, env=env,
                       args=common + [f"--precision={p}", f"--compile={c}", f"--output_dir={root / name}"])
            for name, (p, c) in kinds.items()}


def qwen_jobs(root) -> dict:
    """The tiny Qwen-Image-Edit-2509 default (two references per sample) at 64 px, full fine-tune in
    fp32 with activation checkpointing, eager and compiled, one rank each."""
    model, data = tiny_default("qwen_image_edit")
    area = 64 * 64
    common = [f"--model_path={model}", f"--data_path={os.path.join(data, 'data.jsonl')}",
              f"--text_cache_dir={root / 'text_cache'}", "--resolution=64", f"--reference_area={area}",
              f"--condition_area={area}", "--precision=fp32", f"--max_steps={STEPS}", "--log_every=1",
              "--num_sample_pairs=2", "--sample_every=0", "--val_every=0", "--save_every=0", f"--lr={LR}",
              "--warmup_steps=0", "--activation_checkpointing=1", "--export_dtype=fp32"]
    return {name: dict(script="train_flux_kontext.py", ranks=1, env=launch_env(),
                       args=common + [f"--compile={flag}", f"--output_dir={root / name}"])
            for name, flag in (("eager", "0"), ("compiled", "1"))}


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    """Every launch of this file, started side by side before the in-process checks, which run meanwhile: a
    compiled run spends most of its time in g++, one process at a time, while its other rank waits and a core
    would idle. Yields {"wait": launch_all's answer when called, "roots": each group's folder (a job writes to
    <root>/<name>), "resume": the compiled Kontext run resuming the eager one's step-2 checkpoint, for after}."""
    roots = {g: tmp_path_factory.mktemp(f"compile_{g}") for g in ("flux", "lora", "qwen")}
    jobs = {"flux": flux_jobs(roots["flux"]), "lora": flux_lora_jobs(roots["lora"]), "qwen": qwen_jobs(roots["qwen"])}
    resume = jobs["flux"].pop("resumed")
    wait, kill = start_all({f"{g}/{name}": job for g in jobs for name, job in jobs[g].items()}, timeout=1800)
    yield {"wait": wait, "roots": roots, "jobs": jobs, "resume": resume}
    kill()


@pytest.fixture(scope="module")
def runs(started):
    """{group: {name: (OUTPUT_DIR, log)}} of started's launches, and the compiled Kontext run resumed from the
    eager one's step-2 checkpoint, started once that run is done (beside the others still running; it hits
    the compiled run's inductor cache where that run got there first)."""
    roots, jobs = started["roots"], started["jobs"]
    started["wait"]("flux/eager")
    copy_checkpoint(roots["flux"] / "eager", 2, roots["flux"] / "resumed")
    wait_resumed, kill_resumed = start_all({"resumed": started["resume"]}, timeout=1800)
    try:
        done, resumed = started["wait"](), wait_resumed()["resumed"]
    finally:
        kill_resumed()
    out = {g: {name: (str(roots[g] / name), done[f"{g}/{name}"].stdout) for name in jobs[g]} for g in jobs}
    out["flux"]["resumed"] = (str(roots["flux"] / "resumed"), resumed.stdout)
    return out


# ----------------------------------------------------------------------------------------------
# the UNet, in process


def _unet_steps(rank, world, unet_dir, compile_: bool, steps: int = 2):
    """2 AdamW steps of an FSDP UNet (the DMD recipe, activation checkpointing on) on fixed
    per-rank inputs; returns (losses, full params, state-dict keys)."""
    from precision import get_precision
    prec = get_precision("fp32")
    mesh = fsdp_utils.build_meshes(torch.device("cpu"))[0]
    sharding = fsdp_utils.Sharding(activation_checkpointing=True, compile=compile_)
    model = sd_unet.build_unet(unet_dir, mesh, torch.float32, torch.device("cpu"), policy=prec.mp_policy(),
                               trainable=True, sharding=sharding, block_classes=[])
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    g = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(steps):
        x, target = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 4, 8, 8, generator=g)
        t, text = torch.randint(0, 1000, (2,), generator=g), torch.randn(2, 8, 64, generator=g)
        loss = (model(x, t, text).sample - target).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    fsdp_utils.reshard_all(model)
    params = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return losses, params, list(model.state_dict())


def _unet_parity(rank, world, unet_dir):
    from torch._dynamo.utils import counters
    real = torch.compile
    torch.compile = functools.partial(real, backend="aot_eager")  # see the module docstring
    try:
        eager = _unet_steps(rank, world, unet_dir, compile_=False)
        compiled = _unet_steps(rank, world, unet_dir, compile_=True)
    finally:
        torch.compile = real
    assert compiled[2] == eager[2]  # state-dict keys: unchanged, no `_orig_mod.`
    for a, b in zip(eager[0], compiled[0]):
        assert b == pytest.approx(a, rel=1e-5), (eager[0], compiled[0])
    for k, v in eager[1].items():
        torch.testing.assert_close(compiled[1][k], v, rtol=0, atol=LR / 20, msg=k)
    report = compiling.compile_report()
    # 9 unit shapes, one graph each, all under the checkpoint wrapper's code object, 0 breaks
    assert report.startswith("compile: 9 graphs, 0 graph breaks"), report
    assert "recompile limit" not in report and not counters["graph_break"]
    assert len(compiling._COMPILED_UNIT_SHAPES) == 9
    assert torch._dynamo.config.recompile_limit == 36 > 9 > 8


@pytest.mark.slow
@pytest.mark.usefixtures("started")  # the launches run meanwhile
def test_unet_compiled_matches_eager_without_breaks_or_eager_fallback():
    unet_dir = os.path.join(train_dmd.default_paths()[0], "unet")  # the shipped shapes teacher
    run_ranks(_unet_parity, 2, unet_dir)


@pytest.mark.slow
@pytest.mark.usefixtures("started")  # the launches run meanwhile
def test_fake_score_attention_cast_and_channels_last_compile_without_breaks():
    """The fp32 fake score's bf16 attention (CastSdpaProcessor) and CHANNELS_LAST's conv
    pre-hooks trace whole: a tiny UNet compiled (aot_eager: dynamo and AOTAutograd, no code
    generation) has no graph break and gives eager's output and grads (the same aten ops on CPU; a reduction
    such as a bias grad over the 2 x 8 x 8 = 128 positions may run in another order, so each tensor agrees to
    128 fp32 roundings of its largest element, 2^-17 relative)."""
    import copy

    from torch._dynamo.utils import counters

    from families.sd_unet import to_channels_last
    from parallel.attention import CastSdpaProcessor
    from tests.conftest import tiny_unet
    torch._dynamo.reset()
    counters.clear()
    eager = to_channels_last(tiny_unet())
    eager.set_attn_processor(CastSdpaProcessor(torch.bfloat16))
    compiled = copy.deepcopy(eager)
    compiled.forward = torch.compile(compiled.forward, backend="aot_eager")
    outs = []
    for model in (eager, compiled):
        g = torch.Generator().manual_seed(0)
        x, text = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 6, 32, generator=g)
        out = model(x, torch.tensor([10, 500]), text).sample
        out.square().mean().backward()
        outs.append([out.detach()] + [p.grad for p in model.parameters()])
    assert not counters["graph_break"], dict(counters["graph_break"])
    for a, b in zip(*outs):
        assert (a - b).abs().max() <= 2 ** -17 * a.abs().max()


# ----------------------------------------------------------------------------------------------
# the launches


@pytest.fixture(scope="module")
def flux_runs(runs):
    return runs["flux"]


@pytest.mark.slow
def test_flux_compiled_matches_eager(flux_runs):
    (eager, _), (compiled, _) = flux_runs["eager"], flux_runs["compiled"]
    assert_trains_as_eager(eager, compiled, lr=LR, steps=STEPS)
    # module tree untouched: the same checkpoint keys, none with torch.compile's `_orig_mod.`
    keys = checkpoint_keys(compiled, STEPS)
    assert keys == checkpoint_keys(eager, STEPS) and not any("_orig_mod" in k for k in keys)


@pytest.mark.slow
def test_compiled_run_resumes_an_eager_checkpoint(flux_runs):
    (eager, _), (resumed, log) = flux_runs["eager"], flux_runs["resumed"]
    assert "resumed from" in log and "(step 2)" in log
    last = read_metrics(resumed)
    assert [r["step"] for r in last] == [STEPS]
    assert last[0]["loss"] == pytest.approx(read_metrics(eager)[-1]["loss"], rel=1e-5)
    wa, wb = export(eager), export(resumed)
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=0, atol=LR / 20, msg=k)


@pytest.mark.slow
def test_flux_prints_graphs_and_no_graph_breaks(flux_runs):
    eager_log, log = flux_runs["eager"][1], flux_runs["compiled"][1]
    lines = [line for line in log.splitlines() if line.startswith("compile: ")]
    assert len(lines) == 1, lines  # once, after the first step, on rank 0
    m = re.match(r"compile: (\d+) graphs, (\d+) graph breaks \((\d+\.\d) s compiling\)$", lines[0])
    assert m, lines[0]
    # one graph per block kind (FluxTransformerBlock, FluxSingleTransformerBlock), 0 breaks
    assert (int(m.group(1)), int(m.group(2))) == (2, 0), lines[0]
    assert not any(line.startswith("compile") for line in eager_log.splitlines())  # COMPILE=0: no line
    assert "recompile_limit" not in log  # dynamo's warning when it falls back to eager


@pytest.fixture(scope="module")
def flux_lora_runs(runs):
    return runs["lora"]


@pytest.mark.slow
def test_flux_lora_bf16_mixed_compiled_matches_eager(flux_lora_runs):
    """The adapters (peft's LoRA Linear inside each compiled block) trace without graph breaks and
    train as eagerly, up to bf16 rounding: inductor keeps fused elementwise chains in fp32 where
    eager rounds every op to bf16, so compiled and eager bf16 differ by rounding, which AdamW then
    amplifies on near-zero gradients. The check: compiled moves the trained lora_B (zero at the
    start) no further from eager than bf16 itself moves it from fp32, and the losses agree to
    LOSS_RTOL (measured: losses 4.2e-4 apart, relative; lora_B 0.074 from eager
    against bf16's 0.33 from fp32, in relative norm)."""
    from safetensors.torch import load_file
    LOSS_RTOL = 2e-3
    (eager, _), (compiled, log), (fp32, _) = flux_lora_runs["eager"], flux_lora_runs["compiled"], flux_lora_runs["fp32"]
    a, b = read_metrics(eager), read_metrics(compiled)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, STEPS + 1))
    for ra, rb in zip(a, b):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=LOSS_RTOL), (ra["step"], ra["loss"], rb["loss"])
    w = {name: load_file(os.path.join(out, "export", "pytorch_lora_weights.safetensors"))
         for name, out in (("eager", eager), ("compiled", compiled), ("fp32", fp32))}
    assert w["eager"].keys() == w["compiled"].keys() == w["fp32"].keys()
    keys = [k for k in w["eager"] if "lora_B" in k]
    B = {name: torch.cat([v[k].flatten() for k in keys]) for name, v in w.items()}
    assert B["eager"].abs().max() > 0  # B starts at 0: the adapters trained
    compile_gap = float((B["compiled"] - B["eager"]).norm() / B["eager"].norm())
    bf16_gap = float((B["eager"] - B["fp32"]).norm() / B["fp32"].norm())
    assert compile_gap <= bf16_gap, (compile_gap, bf16_gap)
    # 3 graphs, 0 breaks: the single block's, and the double block's twice: the first double
    # block's input comes from the frozen x_embedder (no grad), every later one's through the
    # adapters (requires grad), and dynamo guards on requires_grad
    line = next(line for line in log.splitlines() if line.startswith("compile: "))
    assert re.match(r"compile: 3 graphs, 0 graph breaks \(", line), line
    assert "recompile_limit" not in log


@pytest.fixture(scope="module")
def qwen_runs(runs):
    return runs["qwen"]


@pytest.mark.slow
def test_qwen_image_edit_compiled_matches_eager(qwen_runs):
    """QwenImageTransformerBlock compiles whole: 2 graphs (the last block's unused text outputs are
    frozen, so its parameters' requires_grad differ and dynamo guards on it), 0 breaks; the same
    losses, grad norms and trained weights as eager."""
    (eager, _), (compiled, log) = qwen_runs["eager"], qwen_runs["compiled"]
    assert_trains_as_eager(eager, compiled, lr=LR, steps=STEPS)
    line = next(line for line in log.splitlines() if line.startswith("compile: "))
    assert re.match(r"compile: 2 graphs, 0 graph breaks \(", line), line
    assert "recompile_limit" not in log


# ----------------------------------------------------------------------------------------------
# settings


def test_compile_is_off_by_default_and_checked_before_any_work():
    assert tfk.COMPILE is False and train_dmd.COMPILE is False
    compiling.check_compile(False)  # off: nothing to check
    compiling.check_compile(True)  # g++ is here


def test_nested_units_compile_only_the_innermost():
    """A unit holding another unit stays eager (compiling it would trace the inner unit's FSDP
    hooks); the inner one gets the compiled forward, on the instance (no module is replaced)."""
    inner = torch.nn.Sequential(torch.nn.Linear(4, 4))
    outer = torch.nn.Sequential(inner, torch.nn.Linear(4, 4))
    other = torch.nn.Linear(4, 4)
    keys = list(outer.state_dict())
    assert compiling.compile_units([outer, inner, other]) == [inner, other]
    assert "forward" in vars(inner) and "forward" in vars(other) and "forward" not in vars(outer)
    assert list(outer.state_dict()) == keys and outer[0] is inner


def test_compile_report_names_graph_breaks():
    from torch._dynamo.utils import counters

    def fn(x):
        print("a graph break")  # dynamo cannot trace print: it breaks the graph there
        return x + 1
    counters.clear()
    torch.compile(fn, backend="eager")(torch.ones(2))
    report = compiling.compile_report()
    assert re.match(r"compile: 1 graphs, 1 graph breaks \(\d+\.\d s compiling\); breaks: ", report), report
    assert "breaks: Failed to trace builtin operator: Dynamo does not know how to trace builtin operator `print`" \
        in report
    counters.clear()


def test_missing_cxx_compiler_is_one_clear_error(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("the C++ compiler is checked on CPU only")
    import torch._inductor.config as inductor_config
    monkeypatch.setattr(inductor_config.cpp, "cxx", ("no-such-c++",))
    with pytest.raises(ConfigError, match="COMPILE=1 on CPU needs a C\\+\\+ compiler"):
        compiling.check_compile(True)
