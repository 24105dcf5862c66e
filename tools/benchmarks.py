"""Benchmarks (not tests): measured side by side in one run on this machine.

    python tools/benchmarks.py save       # checkpoint save: synchronous vs asynchronous (how long training waits)
    python tools/benchmarks.py step       # FSDP2 vs DDP per script step: per-rank memory and step time
    python tools/benchmarks.py planner    # memory planner estimate vs measured peak
    python tools/benchmarks.py compile    # COMPILE=1 vs eager per script step: step time, peak memory, compile time
    python tools/benchmarks.py stack      # FSDP1 (the DMD2 repository's settings) vs FSDP2 vs DDP, UNet and DMD2 steps
    python tools/benchmarks.py noise      # one DMD2 step's randomness per rank: whole global batch vs own samples
    python tools/benchmarks.py gan_head   # GAN head features: the whole fake UNet vs the forward cut after mid block
    python tools/benchmarks.py fake_fp32  # FAKE_SCORE_FP32 on vs off: SD-1.5 on 2 CPU ranks, and planned on GPUs
    python tools/benchmarks.py nf4_width  # NF4 vs bf16 LoRA base at FLUX.1 width (1 + 1 blocks): peak memory vs planner
    python tools/benchmarks.py kontext_dmd_width  # DMD2, Kontext teacher, FLUX width (0 + 1 blocks), fp32: vs planner
    python tools/benchmarks.py host       # host-side work per step outside the models: aten ops, copies, syncs
    python tools/benchmarks.py reshard    # RESHARD_AFTER_FORWARD auto vs 1 at world size 1: ops, copies, losses
    python tools/benchmarks.py all        # everything, as the markdown tables of docs/benchmarks.md

Each benchmark launches `torchrun --standalone --nproc_per_node=2` 2-rank CPU runs: of this file's
worker mode (save), or of the training scripts train_dmd.py / train_flux_kontext.py in the
repository root (step, planner, compile), and prints a markdown table; the numbers in docs/benchmarks.md
come from exactly these commands.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root: the scripts
sys.path.insert(0, ROOT)


def _torchrun(worker: str, *args: str, nproc: int = 2) -> list[dict]:
    """Run `benchmarks.py _worker <worker> args` on nproc CPU ranks; rank 0 prints JSON lines."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.join(ROOT, "tools", "benchmarks.py"), "_worker", worker, *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // nproc))}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if r.returncode:
        sys.exit(f"benchmark worker {worker} failed:\n{r.stderr[-3000:]}")
    return [json.loads(line[6:]) for line in r.stdout.splitlines() if line.startswith("BENCH ")]


def _emit(obj: dict) -> None:
    from core.dist import rank
    if rank() == 0:
        print("BENCH " + json.dumps(obj), flush=True)


def machine() -> str:
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


# ----------------------------------------------------------------------------------------------
# checkpoint save: sync vs async

def medium_unet(width: int):
    from diffusers import UNet2DConditionModel
    import torch
    torch.manual_seed(0)
    return UNet2DConditionModel(
        block_out_channels=(width, 2 * width, 4 * width, 4 * width), layers_per_block=2, sample_size=32,
        cross_attention_dim=256, norm_num_groups=32, attention_head_dim=8,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"))


def worker_save(width: str, repeats: str, out: str) -> None:
    import torch
    import checkpoint
    import fsdp_utils
    from parallel.memory import local_state_bytes
    from parallel.parallelize import parallelize
    from precision import get_precision
    d = fsdp_utils.init_distributed()
    mesh = fsdp_utils.build_meshes(d.device)[0]
    model = medium_unet(int(width))
    n_params = sum(p.numel() for p in model.parameters())
    parallelize(model, mesh, get_precision("fp32").mp_policy(), verbose=False)  # the UNet recipe
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # materialise Adam state
    bytes_ = sum(local_state_bytes({"m": model}, {"m": opt}).values()) * d.world_size
    for mode in ("sync", "async"):
        ck = checkpoint.Checkpointer(os.path.join(out, mode), {"m": model}, {"m": (model, opt)}, {}, {},
                                     keep_last=2, async_save=(mode == "async"), save_every=1)
        for i in range(int(repeats)):
            torch.distributed.barrier()
            t0 = time.perf_counter()
            ck.save(i + 1, {})
            blocked = time.perf_counter() - t0
            ck.wait()
            torch.distributed.barrier()
            total = time.perf_counter() - t0
            _emit({"mode": mode, "blocked_s": blocked, "total_s": total, "params": n_params, "bytes": bytes_})
    fsdp_utils.cleanup_distributed()


def bench_save() -> str:
    with tempfile.TemporaryDirectory(prefix="bench_save_") as out:
        rows = _torchrun("save", "96", "3", out)
    lines = ["| save mode | checkpoint size | training waits (s) | save completes (s) |",
             "|---|---|---|---|"]
    by_mode = {}
    for r in rows:
        by_mode.setdefault(r["mode"], []).append(r)
    for mode, rs in by_mode.items():
        rs = rs[1:] or rs  # the first save warms caches and spawns the writer thread
        blocked = sum(r["blocked_s"] for r in rs) / len(rs)
        total = sum(r["total_s"] for r in rs) / len(rs)
        lines.append(f"| {mode} | {rs[0]['params'] / 1e6:.0f} M params, {rs[0]['bytes'] / 2**30:.2f} GiB "
                     f"| {blocked:.2f} | {total:.2f} |")
    sync = sum(r["blocked_s"] for r in by_mode["sync"][1:]) / max(1, len(by_mode["sync"]) - 1)
    asyn = sum(r["blocked_s"] for r in by_mode["async"][1:]) / max(1, len(by_mode["async"]) - 1)
    lines.append(f"\nasync hides {100 * (1 - asyn / sync):.0f} % of the synchronous save time "
                 f"(training waits {asyn:.2f} s instead of {sync:.2f} s).")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# training step: FSDP2 vs DDP, per script; planner estimate vs measured

SCRIPTS = {"kontext": ("train_flux_kontext.py", "flux_kontext"), "dmd": ("train_dmd.py", "sd15")}
STEP_STEPS = 8    # optimizer steps per run; the first WARMUP are not timed
WARMUP = 3
_RUNS: dict = {}  # (script, size, parallelism) -> measured run, shared by `step` and `planner`


def medium_folder(kind: str, root: str) -> str:
    """The tiny default's folder with its trained model swapped for a medium one (tens of M
    params), so state bytes and step times are not lost in fixed costs. Frozen parts: symlinks."""
    import torch
    from tools import tiny_models
    tiny, _ = tiny_models.ensure_default(kind)
    folder = os.path.join(root, f"medium_{kind}")
    if os.path.isdir(folder):
        return folder
    os.makedirs(folder)
    trained = "transformer" if kind == "flux_kontext" else "unet"
    for name in os.listdir(tiny):
        if name != trained:
            os.symlink(os.path.join(tiny, name), os.path.join(folder, name))
    torch.manual_seed(0)
    if kind == "flux_kontext":
        from diffusers import FluxTransformer2DModel
        cfg = FluxTransformer2DModel.load_config(os.path.join(tiny, "transformer"))
        cfg.update(num_layers=4, num_single_layers=8, attention_head_dim=64, num_attention_heads=6,
                   axes_dims_rope=(16, 24, 24))
        model = FluxTransformer2DModel.from_config(cfg)
    else:
        from diffusers import UNet2DConditionModel
        cfg = UNet2DConditionModel.load_config(os.path.join(tiny, "unet"))
        cfg.update(block_out_channels=(128, 256), layers_per_block=2, norm_num_groups=32, attention_head_dim=8)
        model = UNet2DConditionModel.from_config(cfg)
    model.save_pretrained(os.path.join(folder, trained))
    return folder


def run_script(script: str, size: str, parallelism: str, root: str) -> dict:
    """One 2-rank CPU run of a training script; returns per-rank memory and median step time."""
    key = (script, size, parallelism)
    if key in _RUNS:
        return _RUNS[key]
    import statistics
    path, kind = SCRIPTS[script]
    out = os.path.join(root, f"{script}_{size}_{parallelism}".replace(", ", "_").replace(" ", "_"))
    mode = {"fsdp": ["--parallelism=fsdp"], "ddp": ["--parallelism=ddp"],
            "fsdp, no reshard": ["--parallelism=fsdp", "--reshard_after_forward=0"],
            "fsdp, compiled": ["--parallelism=fsdp", "--compile=1"],
            "fsdp, prefetch 0": ["--parallelism=fsdp", "--prefetch=0"],
            "fsdp, prefetch 1": ["--parallelism=fsdp", "--prefetch=1"]}[parallelism]
    args = [*mode, "--precision=fp32", f"--max_steps={STEP_STEPS}", "--log_every=1",
            "--sample_every=0", "--save_every=0", f"--output_dir={out}"]
    if script == "dmd":  # every step a full DMD2 step (generator and fake score update)
        args += ["--dfake_gen_update_ratio=1"]
    if size == "tiny":
        folder, data = tiny_default(script)
        args += [f"--model_path={folder}", "--resolution=64", f"--data_path={data}"]
    if size == "medium":
        args += [f"--model_path={medium_folder(kind, root)}", "--resolution=64"]
        from tools import tiny_models
        data = tiny_models.ensure_default(kind)[1]
        data_file = next(os.path.join(data, f) for f in sorted(os.listdir(data)) if f.endswith((".jsonl", ".txt")))
        args.append(f"--data_path={data_file}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(ROOT, path), *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // 2)),
           # a fresh inductor cache per run: compile times are cold, never another run's cache hits
           "TORCHINDUCTOR_CACHE_DIR": os.path.join(out, "inductor_cache")}
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if r.returncode:
        sys.exit(f"{path} --parallelism={parallelism} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    mem = [json.loads(line[len("memory_bytes "):]) for line in r.stdout.splitlines()
           if line.startswith("memory_bytes ")][-1]  # the report after training
    with open(os.path.join(out, "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f]
    run = {"mem": mem, "step_ms": statistics.median(s["step_ms"] for s in steps if s["step"] > WARMUP),
           "state": max(m["params"] + m["grads_held"] + m["optim"] for m in mem),
           "peak": max(m["rss_peak"] - m["rss_base"] for m in mem), "wall_s": time.perf_counter() - t0,
           "first_step_ms": steps[0]["step_ms"], "losses": [{k: v for k, v in s.items() if k.startswith("loss")}
                                                           for s in steps],
           # COMPILE=1: rank 0's lines after the first step and at the end (graphs, breaks, compile s)
           "compile": [line for line in r.stdout.splitlines() if line.startswith("compile")]}
    _RUNS[key] = run
    return run


def tiny_default(script: str) -> tuple[str, str]:
    """(model folder, data file) of the script's embedded default, as the script resolves it: the
    shipped shapes teacher and its prompts (DMD), the tiny Kontext folder and its pairs."""
    if script == "dmd":
        import train_dmd
        return train_dmd.default_paths()
    from tools import tiny_models
    folder, data_dir = tiny_models.ensure_default(SCRIPTS[script][1])
    return folder, os.path.join(data_dir, "data.jsonl")


def _scripts_ready() -> list[str]:
    """The scripts that have the PARALLELISM setting, which the step, planner and compile benchmarks
    set; a script without it is skipped."""
    ready = []
    for name, (path, _) in SCRIPTS.items():
        with open(os.path.join(ROOT, path)) as f:
            if "\nPARALLELISM = " in f.read():
                ready.append(name)
    return ready


def _root() -> str:
    if "root" not in _RUNS:
        _RUNS["root"] = tempfile.mkdtemp(prefix="bench_step_")
    return _RUNS["root"]


def default_prefetch(script: str) -> int:
    """The script's PREFETCH constant, read from its source (importing it would load diffusers)."""
    import re
    with open(os.path.join(ROOT, SCRIPTS[script][0])) as f:
        return int(re.search(r"^PREFETCH = (\d+)", f.read(), re.M).group(1))


def bench_step() -> str:
    root = _root()
    lines = ["| script (model) | trainable params | mode | model states / rank | peak RSS above baseline / rank "
             "| step time (median) |", "|---|---|---|---|---|---|"]
    ratios = []
    for script in _scripts_ready():
        prefetch = default_prefetch(script)
        other = f"fsdp, prefetch {1 - prefetch}"  # the script's PREFETCH is 0 or 1
        runs = {p: run_script(script, "medium", p, root) for p in ("fsdp", "ddp", "fsdp, no reshard", other)}
        n_params = runs["ddp"]["mem"][0]["grads_held"] / 4  # fp32
        for p, r in runs.items():
            lines.append(f"| {SCRIPTS[script][0]} (medium) | {n_params / 1e6:.1f} M | {p} "
                         f"| {r['state'] / 2**20:.0f} MiB | {r['peak'] / 2**20:.0f} MiB | {r['step_ms']:.0f} ms |")
        ratios.append(f"| {SCRIPTS[script][0]} | {runs['fsdp']['state'] / runs['ddp']['state']:.2f} "
                      f"| {runs['fsdp']['peak'] / runs['ddp']['peak']:.2f} "
                      f"| {runs['fsdp']['step_ms'] / runs['ddp']['step_ms']:.2f} "
                      f"| {runs['fsdp, no reshard']['step_ms'] / runs['ddp']['step_ms']:.2f} "
                      f"| {prefetch} | {runs[other]['step_ms'] / runs['fsdp']['step_ms']:.2f}, "
                      f"{runs[other]['peak'] / runs['fsdp']['peak']:.2f} |")
    lines += ["", "| script | FSDP / DDP model states (target ≈ 1/2) | FSDP / DDP peak | FSDP / DDP step time "
              "| FSDP without reshard-after-forward / DDP step time | script's PREFETCH "
              "| the other PREFETCH / the script's: step time, peak |",
              "|---|---|---|---|---|---|---|", *ratios,
              "", f"2 CPU ranks (gloo), fp32, batch 1/rank at 64 px, {STEP_STEPS} steps, median step_ms of steps > "
              f"{WARMUP}; model states = params + grads (as held in a step) + AdamW state of everything the script "
              "keeps in its memory report; peak = max over ranks of peak RSS minus RSS before the first model build."]
    return "\n".join(lines)


def bench_planner() -> str:
    from tools import memory_plan
    from diffusers.utils import logging as dlogging
    dlogging.set_verbosity_error()
    root = _root()
    lines = ["| model | planner: model states | measured | error | planner: total (no CUDA reserve) "
             "| measured peak above baseline | error |", "|---|---|---|---|---|---|---|"]
    for script in _scripts_ready():
        path, kind = SCRIPTS[script]
        for size in ("tiny", "medium"):
            run = run_script(script, size, "fsdp", root)
            folder = tiny_default(script)[0] if size == "tiny" else medium_folder(kind, root)
            s = memory_plan.Settings(world_size=2, precision="fp32", batch_size=1, resolution=64)
            p = memory_plan.plan(folder, s)
            est_states = sum(r["params"] + r["grads"] + r["optim"] for r in p["rows"].values()
                             if r["sharded"])  # what the script reports: its sharded models
            est_total = p["gpu_total"] - p["runtime"]
            meas_states, meas_peak = run["state"], run["peak"]
            lines.append(f"| {path} {size} | {est_states / 2**20:.1f} MiB | {meas_states / 2**20:.1f} MiB "
                         f"| {100 * (est_states / meas_states - 1):+.0f} % | {est_total / 2**20:.1f} MiB "
                         f"| {meas_peak / 2**20:.1f} MiB | {100 * (est_total / meas_peak - 1):+.0f} % |")
    lines += ["", "planner: `memory_plan.plan(folder, world_size=2, fp32, batch 1, 64 px)`; measured: the same "
              "settings run with PARALLELISM=fsdp on 2 CPU ranks (max over ranks). Model states include the "
              "frozen components the script reports (DMD's sharded teacher); the peak compares the planner's "
              "total without its fixed 1 GiB CUDA reserve against host RSS growth, which also holds "
              "allocator caches, the replicated VAE and the gloo buffers."]
    return "\n".join(lines)


def _compile_seconds(line: str) -> float:
    import re
    m = re.search(r"\(([\d.]+) s compiling\)", line)
    return float(m.group(1)) if m else float("nan")


def _compile_graphs(line: str) -> str:
    """"N graphs, M graph breaks" of a `compile: ...` or `compile, whole run: ...` line."""
    return line.split(": ", 1)[-1].split(" (")[0]


def bench_compile() -> str:
    """COMPILE=1 vs eager, side by side: the `step` benchmark's medium models and settings (FSDP,
    fp32, no activation checkpointing), the compiled run after its warm-up steps, which hold the
    whole compile (no recompile follows: one bucket, every DMD step the same kind). Compile time
    is rank 0's dynamo + AOTAutograd + inductor seconds (the `compile:` line), cold (a fresh
    inductor cache per run)."""
    root = _root()
    lines = ["| script (model) | mode | step time (median) | peak RSS above baseline / rank | first step | "
             "compile time (rank 0) | graphs, graph breaks (after step 1) |", "|---|---|---|---|---|---|---|"]
    ratios, notes = [], []
    for script in _scripts_ready():
        runs = {p: run_script(script, "medium", p, root) for p in ("fsdp", "fsdp, compiled")}
        eager, comp = runs["fsdp"], runs["fsdp, compiled"]
        first = comp["compile"][0] if comp["compile"] else "compile: (no line)"
        whole = comp["compile"][-1] if comp["compile"] else first
        graphs = _compile_graphs(first)
        for p, r in runs.items():
            compiled = p == "fsdp, compiled"
            compile_cols = f"{_compile_seconds(first):.0f} s | {graphs}" if compiled else "— | —"
            lines.append(f"| {SCRIPTS[script][0]} (medium) | {'compiled' if compiled else 'eager'} "
                         f"| {r['step_ms']:.0f} ms | {r['peak'] / 2**20:.0f} MiB | {r['first_step_ms'] / 1000:.1f} s "
                         f"| {compile_cols} |")
        loss_diff = max((abs(a[k] - b[k]) / max(abs(a[k]), 1e-12) for a, b in zip(eager["losses"], comp["losses"])
                         for k in a if k in b), default=float("nan"))
        ratios.append(f"| {SCRIPTS[script][0]} | {comp['step_ms'] / eager['step_ms']:.2f} "
                      f"| {comp['peak'] / eager['peak']:.2f} | {_compile_seconds(first):.0f} s | {loss_diff:.1e} |")
        if _compile_graphs(whole) != graphs:  # more graphs than after step 1
            notes.append(f"{SCRIPTS[script][0]}: {whole} "
                         "(the end-of-run sample grid's no-grad forwards are graphs of their own)")
    lines += ["", "| script | compiled / eager step time | compiled / eager peak RSS | compile time "
              "| max relative loss difference, all steps |", "|---|---|---|---|---|", *ratios,
              "", f"2 CPU ranks (gloo), fp32, batch 1/rank at 64 px, {STEP_STEPS} steps, median step_ms of steps > "
              f"{WARMUP} (the first step holds the compile); peak = max over ranks of peak RSS minus RSS before the "
              "first model build, which in the compiled run also holds dynamo's and inductor's own state. "
              "Compile: torch.compile (inductor, C++ kernels via g++) of each FSDP unit's forward.", *notes]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# the stack users come from: FSDP1 with the DMD2 repository's settings, beside FSDP2 and DDP
#
# The official DMD2 code wraps its UNets with accelerate + torch FSDP1 (seed 000's config):
# TRANSFORMER_BASED_WRAP on BasicTransformerBlock and ResnetBlock2D, FULL_SHARD, bf16
# MixedPrecision (params, reduce, buffers), use_orig_params, BACKWARD_PRE, no forward prefetch.
# Here that is torch's own FullyShardedDataParallel with those arguments (accelerate only passes
# them through); on CPU it needs device_id=cpu and no sync_module_states (every rank builds the
# same seeded model). FSDP1 lives in this benchmark only, never in the training path.
#
# Modes (each its own 2-rank launch, so each peak is its own):
#   fsdp1             the settings above, AdamW as the DMD2 repository makes it (torch's default)
#   fsdp1 + fused     the same with the scripts' optimizer (components.optim.adamw: fused AdamW)
#   fsdp2             this project's recipe as the scripts run it (parallel/parallelize.py, PRECISION=bf16)
#   fsdp2 bare        fully_shard per block and on the root, MixedPrecisionPolicy(bf16, bf16), nothing else
#   ddp               DistributedDataParallel of the bf16 model
# (bf16 where the CPU computes it natively, else fp32 throughout: see native_bf16)
# Every mode but fsdp1 uses the scripts' optimizer, components.optim.adamw.
#   fsdp2 + KNOB      the recipe with one knob changed (see STACK_KNOBS)
# Workloads: `unet` = one UNet forward + backward + AdamW; `dmd` = one full DMD2 step (the
# generator's 1-step sample, the DM gradient from the fake score and the CFG teacher, the
# generator's backward and AdamW, the fake score's denoising loss, backward and AdamW), with
# algorithms/dmd2's functions, all three UNets wrapped by the mode (the teacher frozen).

STACK_BLOCKS = ("BasicTransformerBlock", "ResnetBlock2D")
UNET_STAGES = ["CrossAttnDownBlock2D", "DownBlock2D", "UNetMidBlock2DCrossAttn", "CrossAttnUpBlock2D", "UpBlock2D"]
STACK_KNOBS = {  # mode -> changes to the recipe (fsdp_utils.Sharding fields, block classes, reduce dtype)
    "fsdp2 + per stage": {"blocks": UNET_STAGES},     # a unit per down/mid/up block: fewer, larger all-gathers
    "fsdp2 + prefetch 1": {"prefetch": 1},            # explicit prefetch of the next unit
    "fsdp2 + no reshard": {"reshard_after_forward": False},  # no all-gathers in backward (holds full params)
    "fsdp2 + fp32 reduce": {"reduce": "fp32"},        # reduce-scatter in fp32 (bf16-mixed's choice; bf16 runs only)
}


def _vm_hwm() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _reset_peak_rss() -> None:
    """Linux: writing 5 to clear_refs resets the peak RSS (VmHWM) to the current RSS."""
    import ctypes
    import gc
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # give freed build-time memory back first
    except OSError:
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _wrap(model, mode: str, mesh, device, trainable: bool, dtype):
    """`model` (in `dtype`, on CPU) wrapped as `mode` does it; returns the module to call."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    import fsdp_utils
    from parallel.parallelize import parallelize
    from precision import get_precision
    prec = get_precision("bf16" if dtype == torch.bfloat16 else "fp32")  # pure: params, compute, reduce alike
    if mode.startswith("fsdp1"):
        from torch.distributed.fsdp import BackwardPrefetch, FullyShardedDataParallel, MixedPrecision, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        classes = {type(m) for m in model.modules() if type(m).__name__ in STACK_BLOCKS}
        return FullyShardedDataParallel(
            model, auto_wrap_policy=ModuleWrapPolicy(classes), sharding_strategy=ShardingStrategy.FULL_SHARD,
            mixed_precision=MixedPrecision(param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype),
            use_orig_params=True, backward_prefetch=BackwardPrefetch.BACKWARD_PRE, forward_prefetch=False,
            device_id=device, sync_module_states=False)
    if mode == "ddp":  # the scripts' DDP path (inputs cast); the teacher replicated, its inputs cast
        if trainable:
            return fsdp_utils.apply_ddp(fsdp_utils.apply_precision(model, prec.mp_policy()), device, verbose=False)
        return fsdp_utils.apply_precision(model, prec.frozen_mp_policy(dtype))
    if mode == "fsdp2 bare":
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
        for name in STACK_BLOCKS:
            for m in model.modules():
                if type(m).__name__ == name:
                    fully_shard(m, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return model
    knob = STACK_KNOBS.get(mode, {})
    if not trainable:  # the scripts' frozen teacher: prepare_frozen, then sharded by its recipe
        fsdp_utils.prepare_frozen(model, dtype)
        parallelize(model, mesh, prec.frozen_mp_policy(dtype), fsdp_utils.Sharding(frozen=True), knob.get("blocks"),
                    verbose=False)
        return model.to(device)
    policy = prec.mp_policy()
    if knob.get("reduce") == "fp32":
        import dataclasses
        policy = dataclasses.replace(policy, reduce_dtype=torch.float32)
    sharding = fsdp_utils.Sharding(reshard_after_forward=knob.get("reshard_after_forward", True),
                                   prefetch=knob.get("prefetch", 0))
    parallelize(model, mesh, policy, sharding, knob.get("blocks"), verbose=False)
    return model


def _step_memory(fn) -> tuple[int, int]:
    """Run fn twice; return (tensor peak above the start, heap in use at the peak). Tensor peak: the
    most bytes of tensors allocated during the first run that were live at once, from torch's
    profiler memory events: what a caching allocator would have to add.
    The profiler does not see frees of tensors made before it started, so a tensor the step frees
    and makes again (FSDP1's sharded gradient, kept until the next forward) counts in full. Malloc:
    the bytes glibc reports in use (mallinfo2, sampled every 2 ms from a thread: all threads'
    mallocs, tensors and everything else) during the second run, which is not profiled (the
    profiler's own event records would count); its highest value is the heap in use at the step's
    peak, comparable across modes that carry different things from one step into the next. RSS
    above it is freed heap that glibc keeps mapped."""
    import ctypes
    import threading
    import torch
    from torch.profiler import ProfilerActivity, profile

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                    "fsmblks", "uordblks", "fordblks", "keepcost")]
    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
        mallinfo2.restype = MallInfo2
    except (OSError, AttributeError):  # not glibc >= 2.33
        mallinfo2 = None
    in_use = (lambda: (lambda m: m.uordblks + m.hblkhd)(mallinfo2())) if mallinfo2 else (lambda: 0)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    heap_peak, done = [in_use()], threading.Event()

    def sample():
        while not done.wait(0.002):
            heap_peak[0] = max(heap_peak[0], in_use())
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    fn()
    done.set()
    sampler.join()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak, heap_peak[0]


def native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX); without, oneDNN emulates bf16
    matmuls and convolutions some 50-90x slower than fp32, which drowns every FSDP cost measured."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def worker_stack(workload: str, mode: str, width: str, steps: str, dtype: str = "bf16") -> None:
    import statistics
    import torch
    import fsdp_utils
    from components.optim import adamw
    from algorithms import dmd2
    from parallel.memory import host_rss_bytes, local_state_bytes
    d = fsdp_utils.init_distributed()
    mesh = fsdp_utils.build_meshes(d.device)[0] if mode.startswith("fsdp2") else None
    dt, batch, latent, tokens = getattr(torch, {"bf16": "bfloat16", "fp32": "float32"}[dtype]), 2, 32, 77
    names = ("unet",) if workload == "unet" else ("generator", "fake", "teacher")
    models = {n: medium_unet(int(width)).to(dt) for n in names}  # same seed: the same weights
    models["teacher"].requires_grad_(False) if "teacher" in models else None
    wrapped = {n: _wrap(m, mode, mesh, d.device, (n != "teacher"), dt) for n, m in models.items()}
    trained = [n for n in names if n != "teacher"]
    # FSDP1: AdamW as the DMD2 repository makes it (torch's default: foreach over its plain
    # tensors); the rest the scripts' optimizer (components.optim.adamw: fused)
    opts = {n: torch.optim.AdamW(wrapped[n].parameters(), lr=1e-5) if mode == "fsdp1" else
            adamw(wrapped[n].parameters(), lr=1e-5) for n in trained}
    n_params = sum(p.numel() for p in models[names[0]].parameters()) if mode != "fsdp1" else \
        sum(p.numel() for p in medium_unet(int(width)).parameters())
    betas = torch.linspace(0.00085 ** 0.5, 0.012 ** 0.5, 1000, dtype=torch.float64) ** 2
    alphas = torch.cumprod(1 - betas, 0)
    g = torch.Generator().manual_seed(1 + d.rank)

    def step():
        text = torch.randn(batch, tokens, 256, generator=g).to(dt)
        if workload == "unet":
            x = torch.randn(batch, 4, latent, latent, generator=g)
            target = torch.randn(batch, 4, latent, latent, generator=g)
            t = torch.randint(0, 1000, (batch,), generator=g)
            out = wrapped["unet"](x.to(dt), t, text).sample.float()
            loss = (out - target).square().mean()
            loss.backward()
            opts["unet"].step()
            opts["unet"].zero_grad(set_to_none=True)
            return
        noise = torch.randn(batch, 4, latent, latent, generator=g)
        x = dmd2.generator_forward(wrapped["generator"], noise.to(dt), 999, text, alphas).float()
        t = torch.randint(20, 981, (batch,), generator=g)
        grad, _ = dmd2.dm_grad(x.to(dt), t, torch.randn(batch, 4, latent, latent, generator=g).to(dt),
                               wrapped["teacher"], wrapped["fake"], text, torch.zeros(1, tokens, 256, dtype=dt),
                               1.75, alphas)
        dmd2.dm_loss(x, grad).backward()
        opts["generator"].step()
        opts["generator"].zero_grad(set_to_none=True)
        loss = dmd2.fake_score_loss(wrapped["fake"], x.detach().to(dt),
                                    torch.randn(batch, 4, latent, latent, generator=g).to(dt),
                                    torch.randint(0, 1000, (batch,), generator=g), text, alphas)
        loss.backward()
        opts["fake"].step()
        opts["fake"].zero_grad(set_to_none=True)

    step()  # warm-up: allocator, AdamW state, FSDP lazy init
    _reset_peak_rss()
    base = host_rss_bytes()
    times = []
    for _ in range(int(steps)):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        step()
        torch.distributed.barrier()
        times.append(time.perf_counter() - t0)
    peak = torch.tensor([_vm_hwm(), _vm_hwm() - base, base], dtype=torch.float64)
    torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    live = torch.tensor(_step_memory(step), dtype=torch.float64)  # two more steps, untimed
    torch.distributed.all_reduce(live, op=torch.distributed.ReduceOp.MAX)
    states = local_state_bytes({n: wrapped[n] for n in trained}, opts)  # after zero_grad: no grads
    states = 2 * states["params"] + states["optim"]  # params, grads as held in a step (same size), AdamW
    _emit({"workload": workload, "mode": mode, "dtype": dtype, "params": n_params, "states": states,
           "step_s": statistics.median(times), "rss_peak": peak[0].item(), "peak_above": peak[1].item(),
           "live_peak": live[0].item(), "malloc_at_peak": live[1].item()})
    fsdp_utils.cleanup_distributed()


STACK_RUNS = {  # workload -> (UNet width, timed steps, modes)
    "unet": (96, 3, ["fsdp1", "fsdp1 + fused", "fsdp2", "fsdp2 bare", "ddp", *STACK_KNOBS]),
    "dmd": (64, 3, ["fsdp1", "fsdp2", "fsdp2 bare", "ddp"]),
}
STACK_ROUNDS = 3  # every mode runs this often, the rounds interleaved (drift hits all modes alike)


def bench_stack() -> str:
    import statistics

    def each(rs: list, key: str, unit: float, fmt: str = ".2f") -> str:
        return ", ".join(format(r[key] / unit, fmt) for r in rs)
    dtype = "bf16" if native_bf16() else "fp32"
    lines = [] if dtype == "bf16" else [
        "This CPU has no native bf16 (no AVX512-BF16 / AMX): oneDNN emulates bf16 matmuls and convolutions "
        "some 50-90x slower than fp32, which would drown every FSDP cost, so every mode runs in fp32 "
        "(FSDP1's MixedPrecision and FSDP2's MixedPrecisionPolicy name fp32; all else as listed).", ""]
    for workload, (width, steps, modes) in STACK_RUNS.items():
        if dtype == "fp32":  # a bf16 -> fp32 knob is a no-op in fp32
            modes = [m for m in modes if STACK_KNOBS.get(m, {}).get("reduce") != "fp32"]
        runs: dict = {m: [] for m in modes}
        for _ in range(STACK_ROUNDS):
            for m in modes:
                runs[m] += _torchrun("stack", workload, m, str(width), str(steps), dtype)
        ref = runs["fsdp1"]
        t_ref = statistics.mean(r["step_s"] for r in ref)
        p_ref = statistics.mean(r["rss_peak"] for r in ref)
        h_ref = statistics.mean(r["malloc_at_peak"] for r in ref)
        what = ("UNet forward + backward + AdamW" if workload == "unet" else
                "full DMD2 step: generator, fake score (trained), teacher (frozen, CFG)")
        lines += [f"**{what}**: SD-1.5-layout UNet of {ref[0]['params'] / 1e6:.0f} M params in {dtype}, batch 2 "
                  f"at 32×32 latents, 77 text tokens; median of {steps} steps after one warm-up step, "
                  f"{STACK_ROUNDS} runs per mode (interleaved)", "",
                  "| mode | step time (s), each run | step / FSDP1 | peak RSS in the steps / rank (GiB), each run "
                  "| peak RSS / FSDP1 | heap in use at the step's peak / rank (MiB) | heap / FSDP1 "
                  "| RSS the steps add / rank (MiB), each run "
                  "| tensors the step allocates, peak / rank (MiB), each run "
                  "| model states / rank (MiB) |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for m, rs in runs.items():
            t = statistics.mean(r["step_s"] for r in rs)
            p = statistics.mean(r["rss_peak"] for r in rs)
            h = statistics.mean(r["malloc_at_peak"] for r in rs)
            lines.append(f"| {m} | {each(rs, 'step_s', 1)} | {t / t_ref:.2f} "
                         f"| {each(rs, 'rss_peak', 2**30, '.3f')} | {p / p_ref:.2f} "
                         f"| {h / 2**20:.0f} | {h / h_ref:.2f} "
                         f"| {each(rs, 'peak_above', 2**20, '.0f')} | {each(rs, 'live_peak', 2**20, '.0f')} "
                         f"| {rs[0]['states'] / 2**20:.0f} |")
        lines.append("")
    lines.append("2 CPU ranks (gloo), one thread each. Peak RSS in the steps: the largest rank's peak RSS during the "
                 "timed steps (reset with /proc/self/clear_refs after the warm-up step): what the rank occupies, "
                 "model states included. Heap in use at the step's peak: glibc's bytes in use (mallinfo2: all "
                 "threads, tensors and all else) at the highest point of one more step, not profiled, sampled every "
                 "2 ms: what a caching allocator plus the libraries would hold; RSS above it is freed heap that "
                 "glibc keeps mapped. RSS the steps add: the peak RSS in the steps minus the RSS before them. "
                 "Tensors the step allocates: the most bytes of tensors made during one more step that were live "
                 "at once (torch's profiler memory events). The last two start from what each mode carries from "
                 "one step into the next: FSDP1 keeps its sharded gradient (the flat parameter's .grad) until the "
                 "next forward, FSDP2 and DDP free gradients at zero_grad(set_to_none=True), so FSDP1's \"adds\" "
                 "start from a higher floor; the two absolute columns and their ratios are the fair comparison. "
                 "Model states: params + grads (as held in a step) + AdamW state of the trained model(s) on one "
                 "rank. FSDP1: torch's FullyShardedDataParallel with the DMD2 repository's settings (benchmark only).")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------

# ----------------------------------------------------------------------------------------------
# per-step randomness: the whole global batch on every rank (before) vs this rank's samples (after)

NOISE_GLOBAL_BATCH, NOISE_LATENT = 2048, (4, 64, 64)  # recipes/dmd_sd15_stage1.sh: 32 x 64 GPUs, 512 px


def _noise_before(seed: int, it: int, batch: int, shape: tuple, gan: bool) -> dict:
    """bench_noise's "before" draw (`draw_step_noise` in train_dmd.py at commit 525cc8f): every
    tensor for the whole global batch from one CPU generator; each rank then keeps its slice."""
    import torch
    from data.randomness import step_generator
    from algorithms import dmd2 as dm
    g = step_generator(seed, it)
    r = {"noise": torch.randn((batch, *shape), generator=g), "dm_t": dm.sample_dm_timesteps(batch, g),
         "dm_noise": torch.randn((batch, *shape), generator=g), "fake_t": dm.sample_fake_timesteps(batch, g),
         "fake_noise": torch.randn((batch, *shape), generator=g),
         "sim_noise": torch.randn((batch, 0, *shape), generator=g)}
    if gan:
        for name in ("gan_gen", "gan_fake", "gan_real"):
            r[name + "_t"] = torch.randint(0, 1000, (batch,), generator=g)
            r[name + "_noise"] = torch.randn((batch, *shape), generator=g)
    return r


def bench_noise() -> str:
    """Per-rank time to draw one DMD2 step's randomness at the stage-1 recipe's global batch, on
    one CPU thread (torchrun's OMP_NUM_THREADS=1): "before" (_noise_before), every rank draws all 2048
    samples; "after" (train_dmd.py's draw), a rank draws its own 2048 / world samples
    (algorithms/dmd2_unet.draw_sample_noise per sample)."""
    import functools
    import torch
    from algorithms import dmd2_unet as unet_dm
    from data.randomness import per_sample_draws
    torch.set_num_threads(1)

    def timed(fn, repeats=3):
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        return best * 1000
    lines = ["| DMD2 step randomness (global batch 2048, latents 4x64x64) | ranks | samples drawn per rank "
             "| before: ms per rank | after: ms per rank | after / before |", "|---|---:|---:|---:|---:|---:|"]
    for gan in (False, True):
        before = timed(lambda: _noise_before(10, 5, NOISE_GLOBAL_BATCH, NOISE_LATENT, gan), repeats=2)
        draw = functools.partial(unet_dm.draw_sample_noise, shape=NOISE_LATENT, n_sim=0, num_train_timesteps=1000,
                                 step_percent=(0.02, 0.98), gan_max_t=1000 if gan else None)
        for world in (8, 64):
            mine = range(NOISE_GLOBAL_BATCH // world)  # rank 0's samples
            after = timed(lambda: per_sample_draws(10, 5, mine, torch.device("cpu"), draw))
            lines.append(f"| {'stage 2 (GAN: 6 noise tensors)' if gan else 'stage 1 (3 noise tensors)'} | {world} "
                         f"| {len(mine)} | {before:.0f} | {after:.1f} | {after / before:.3f} |")
    lines += ["", "One CPU thread, best of 3 (before: of 2). After draws on the run's device: here the CPU; on "
              "a GPU the draws are device kernels (a few per sample) and no host memory or copy is involved."]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# the GAN head's features: the whole fake UNet (before) vs the forward cut after the mid block

def bench_gan_head() -> str:
    """Forward + backward of the GAN head's bottleneck features on the SD-1.5-layout medium UNet
    (as the benchmarks' other UNet rows), one process: the whole UNet run with the mid block's
    output captured by a hook (before) vs the forward stopped after the mid block (after)."""
    import torch
    from algorithms import dmd2 as dm

    unet = medium_unet(64).train()
    x = torch.randn(4, 4, 32, 32)
    text = torch.randn(4, 77, 256)

    def full(z):
        captured = []
        handle = unet.mid_block.register_forward_hook(lambda m, a, out: captured.append(out))
        unet(z, torch.zeros(4, dtype=torch.long), text, return_dict=False)
        handle.remove()
        return captured[0]

    def cut(z):
        return dm.bottleneck_features(unet, z, 0, text)

    results = {}
    for name, fn in (("whole UNet (before)", full), ("cut after the mid block (after)", cut)) * 2:
        times = []
        for _ in range(3):
            unet.zero_grad(set_to_none=True)
            z = x.clone().requires_grad_(True)
            t0 = time.perf_counter()
            fn(z).float().square().mean().backward()
            times.append(time.perf_counter() - t0)
        results[name] = min(times) * 1000  # the second round's (warm) numbers overwrite the first's
    n = sum(p.numel() for p in unet.parameters()) / 1e6
    before, after = results["whole UNet (before)"], results["cut after the mid block (after)"]
    return "\n".join([
        "| GAN head features, forward + backward | ms (best of 3) | / before |", "|---|---:|---:|",
        f"| whole UNet (before) | {before:.0f} | 1.00 |",
        f"| cut after the mid block (after) | {after:.0f} | {after / before:.2f} |", "",
        f"{n:.0f} M-parameter SD-1.5-layout UNet (`medium_unet(64)`), batch 4 of 4x32x32 latents, fp32, one process, "
        f"{torch.get_num_threads()} threads. The features, and their gradients, are bit-identical "
        "(tests/test_dmd2.py::test_bottleneck_stops_after_the_mid_block_with_identical_values_and_grads)."])


# ----------------------------------------------------------------------------------------------
# the price of FAKE_SCORE_FP32 at SD-1.5's real architecture, and planned on GPUs

def _two_rank_memory(script: str, args: list[str]) -> list[dict]:
    """Run `script` on 2 CPU ranks (one thread each, as torchrun sets) with `args`; exit with its
    output if it fails; return its per-rank memory table after training (the memory_bytes line)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(ROOT, script), *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if r.returncode:
        sys.exit(f"{script} {' '.join(args)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return [json.loads(line[len("memory_bytes "):]) for line in r.stdout.splitlines()
            if line.startswith("memory_bytes ")][-1]


# The GPU's side, measured (one H100 80GB HBM3, torch 2.11, cuDNN 9.19; tools/gpu_check.py --suite=speed,
# SD-1.5's real UNet/VAE/CLIP with random weights, 512 px, batch 32, AC, bf16-mixed, ratio 5, steps 3-12):
# the step in ms with the published fp32 fake score (its attention in SDPA's fp32 memory-efficient
# kernel, 47 % of the GPU time) and with FAKE_SCORE_FP32=0. A FLOP count at the dense peaks would say
# 1.69x: attention's fp32 kernel runs at neither the TF32 nor the bf16 peak.
H100_STEP_MS = {"fp32": 1697, "bf16": 765}


def bench_fake_fp32() -> str:
    """FAKE_SCORE_FP32 on and off, side by side: two 2-rank CPU runs of train_dmd.py on SD-1.5's
    real architecture (random weights, tools/gpu_check.sd15_folder), PRECISION=bf16, 128 px, batch 1
    per rank, a generator step every step (DFAKE_GEN_UPDATE_RATIO=1), LoRA rank 64 on the generator
    and the fake score (FAKE_LORA: the two runs fit in 6 GiB per rank beside other work; the price
    is in the fake score's fp32 gathers, compute and activations, which LoRA does not change); then the
    planner's GPU memory for both at 512 px and the step times measured on an H100 (H100_STEP_MS)."""
    import statistics
    from tools import gpu_check, memory_plan
    root = _root()
    folder = gpu_check.sd15_folder(os.path.join(root, "gpu_check_models"), tiny=False)
    data = os.path.join(root, "fake_fp32_prompts.txt")
    with open(data, "w") as f:
        f.write("a red circle on a white background\na blue square on a black background\n")
    runs = {}
    for fp32 in (1, 0):
        out = os.path.join(root, f"fake_fp32_{fp32}")
        mem = _two_rank_memory("train_dmd.py", [
            f"--model_path={folder}", f"--data_path={data}", f"--output_dir={out}", "--precision=bf16",
            f"--fake_score_fp32={fp32}", "--resolution=128", "--batch_size=1", "--max_steps=3",
            "--dfake_gen_update_ratio=1", "--log_every=1", "--sample_every=0", "--save_every=0", "--lora_rank=64",
            "--fake_lora=1"])
        with open(os.path.join(out, "metrics.jsonl")) as f:
            steps = [json.loads(line) for line in f]
        runs[fp32] = {"ms": statistics.median(s["step_ms"] for s in steps[1:]), "rss": max(m["rss_peak"] for m in mem),
                      "states": max(m["params"] + m["grads_held"] + m["optim"] for m in mem)}
    on, off = runs[1], runs[0]
    lines = ["| SD-1.5 real architecture, 2 CPU ranks, bf16, 128 px, LoRA 64 on G and fake "
             "| step time (median of steps 2-3) | peak RSS / rank |",
             "|---|---:|---:|",
             f"| FAKE_SCORE_FP32=1 (published) | {on['ms'] / 1000:.1f} s | {on['rss'] / 2**30:.2f} GiB |",
             f"| FAKE_SCORE_FP32=0 | {off['ms'] / 1000:.1f} s | {off['rss'] / 2**30:.2f} GiB |",
             f"| on / off | {on['ms'] / off['ms']:.2f} | {on['rss'] / off['rss']:.2f} |", ""]
    plans = {}
    for fp32 in (True, False):
        s = memory_plan.Settings(world_size=8, precision="bf16-mixed", batch_size=32, resolution=512,
                                 activation_checkpointing=True, fake_score_fp32=fp32)
        plans[fp32] = memory_plan.plan(memory_plan.model_folder("sd15-dmd"), s)["gpu_total"]
    ms = H100_STEP_MS
    lines += ["| SD-1.5 stage 1 on GPUs (bf16-mixed, batch 32 per GPU, 512 px, AC) "
              "| FAKE_SCORE_FP32=1 | =0 | on / off |",
              "|---|---:|---:|---:|",
              f"| memory per GPU, 8 GPUs (planner) | {plans[True] / 2**30:.1f} GiB | {plans[False] / 2**30:.1f} GiB "
              f"| {plans[True] / plans[False]:.2f} |",
              f"| step on one H100, batch 32 (measured) | {ms['fp32']} ms | {ms['bf16']} ms "
              f"| {ms['fp32'] / ms['bf16']:.2f} |", "",
              "The H100 row: tools/gpu_check.py --suite=speed on one H100 80GB HBM3 (torch 2.11, cuDNN 9.19), "
              "SD-1.5's real architecture with random weights, DFAKE_GEN_UPDATE_RATIO=5, the mean of steps 3-12; "
              "the fp32 fake score's attention ran in SDPA's fp32 memory-efficient kernel (47 % of the GPU time; "
              "flash has no fp32 path, TF32 does not reach attention). FAKE_SCORE_ATTENTION_DTYPE's default "
              "(fp32 weights and math, bf16 attention) is the gpu_check row dmd_sd15_512px_b32_ac."]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# the NF4 LoRA base at FLUX.1 width: measured peak memory against the planner and the bf16 base

def flux_width_folder(root: str, blocks: tuple[int, int]) -> str:
    """A FLUX.1 Kontext folder at real width with `blocks` (double, single) blocks, random weights: gpu_check's
    transformer skeleton of that size with its weights written, beside its real-width parts (VAE, CLIP-L, a
    one-layer T5 of the real width; written once under `root`)."""
    from tools import gpu_check
    folder = gpu_check.flux_skeleton(root, blocks, gpu_check.flux_parts(root))
    gpu_check.transformer_weights(folder)
    return folder


def bench_nf4_width() -> str:
    """Kontext LoRA (rank 16) on a FLUX.1-width transformer of 1 double + 1 single block (~0.55 B
    parameters, random weights, flux_width_folder), 2 CPU ranks, bf16, 256 px, batch 1,
    3 steps: BASE_DTYPE bf16 vs nf4, each rank's peak RSS above its baseline and model states,
    against the planner's per-GPU total for the same settings (without its fixed CUDA reserve)."""
    from tools import gpu_check, memory_plan
    root = _root()
    folder = flux_width_folder(os.path.join(root, "gpu_check_models"), (1, 1))
    data = gpu_check.datasets(os.path.join(root, "gpu_check_models"), 256)[1]
    runs = {}
    for base in ("", "nf4"):
        out = os.path.join(root, f"nf4_width_{base or 'bf16'}")
        mem = _two_rank_memory("train_flux_kontext.py", [
            f"--model_path={folder}", f"--data_path={data}", f"--output_dir={out}", "--precision=bf16",
            "--resolution=256", "--batch_size=1", "--max_steps=3", "--lora_rank=16", f"--base_dtype={base}",
            "--log_every=1", "--sample_every=0", "--save_every=0", "--val_every=0", "--num_sample_pairs=2",
            f"--text_cache_dir={os.path.join(out, 'text_cache')}"])
        plan = memory_plan.plan(folder, memory_plan.Settings(world_size=2, precision="bf16", batch_size=1,
                                                             resolution=256, lora_rank=16, base_dtype=base))
        runs[base] = {"peak": max(m["rss_peak"] - m["rss_base"] for m in mem),
                      "params": max(m["params"] for m in mem), "planned": plan["gpu_total"] - plan["runtime"]}
    lines = ["| FLUX.1 width, 1 + 1 blocks, LoRA r16, 2 CPU ranks, bf16, 256 px | params / rank (measured) "
             "| peak RSS above baseline / rank | planner total / rank | measured / planned |",
             "|---|---:|---:|---:|---:|"]
    for base, r in runs.items():
        lines.append(f"| BASE_DTYPE={base or 'bf16'} | {r['params'] / 2**20:.0f} MiB | {r['peak'] / 2**20:.0f} MiB "
                     f"| {r['planned'] / 2**20:.0f} MiB | {r['peak'] / r['planned']:.2f} |")
    nf4, bf16 = runs["nf4"], runs[""]
    lines += [f"| nf4 / bf16 | {nf4['params'] / bf16['params']:.2f} | {nf4['peak'] / bf16['peak']:.2f} "
              f"| {nf4['planned'] / bf16['planned']:.2f} | |", "",
              "Peak RSS above the rank's RSS before the first model build (host memory also holds allocator "
              "caches, the replicated VAE and text encoders' load, gloo buffers); the planner's total is its GPU "
              "estimate less the fixed 1 GiB CUDA reserve."]
    return "\n".join(lines)


def bench_kontext_dmd_width() -> str:
    """train_dmd.py with a FLUX.1 Kontext teacher at FLUX.1 width (3072) with 0 double + 1 single
    block (~0.21 B parameters per transformer, random weights, flux_width_folder): full
    generator and full fake score with AdamW, the teacher frozen and sharded, all fp32, 2 CPU ranks,
    256 px, batch 1, a generator step every step, 2 steps; then the planner for the same settings on
    the same folder. One double block instead would hold ~7 GiB of model states per rank."""
    from tools import gpu_check, memory_plan
    root = _root()
    folder = flux_width_folder(os.path.join(root, "gpu_check_models"), (0, 1))
    data = gpu_check.datasets(os.path.join(root, "gpu_check_models"), 256)[1]
    out = os.path.join(root, "kontext_dmd_width")
    t0 = time.perf_counter()
    mem = _two_rank_memory("train_dmd.py", [
        f"--model_path={folder}", f"--data_path={data}", f"--output_dir={out}", "--precision=fp32",
        "--fake_score_fp32=1", "--activation_checkpointing=0", "--resolution=256", "--batch_size=1",
        "--max_steps=2", "--dfake_gen_update_ratio=1", "--ema_decay=0", "--log_every=1", "--sample_every=0",
        "--save_every=0", "--sample_count=1", f"--text_cache_dir={os.path.join(out, 'text_cache')}"])
    run_s = time.perf_counter() - t0
    p = memory_plan.plan(folder, memory_plan.Settings(
        world_size=2, precision="fp32", batch_size=1, resolution=256, activation_checkpointing=False,
        fake_score_fp32=True, ema=False, script="train_dmd.py"))
    sharded = [r for r in p["rows"].values() if r["sharded"]]  # generator, fake score, teacher: what the script reports
    planned = {k: sum(r[k] for r in sharded) for k in ("params", "grads", "optim")}
    big = max(mem, key=lambda m: m["params"] + m["grads_held"] + m["optim"])
    measured = {"params": big["params"], "grads": big["grads_held"], "optim": big["optim"]}
    planned["states"], measured["states"] = sum(planned.values()), sum(measured.values())
    planned["total"] = p["gpu_total"] - p["runtime"]
    measured["total"] = max(m["rss_peak"] - m["rss_base"] for m in mem)
    names = {"params": "parameters (G + fake + teacher)", "grads": "gradients (G + fake, as held in a step)",
             "optim": "AdamW state (G + fake)", "states": "**model states**",
             "total": "**total** (planner: GPU total less the 1 GiB CUDA reserve; measured: peak RSS above baseline)"}
    lines = ["| FLUX.1 width, 0 + 1 blocks, DMD2 full G + fake, fp32, 2 CPU ranks, 256 px, per rank "
             "| planned | measured | measured / planned |", "|---|---:|---:|---:|"]
    for k, name in names.items():
        lines.append(f"| {name} | {planned[k] / 2**20:.1f} MiB | {measured[k] / 2**20:.1f} MiB "
                     f"| {measured[k] / planned[k]:.4f} |")
    lines += ["", f"Measured - planned parameters: {measured['params'] - planned['params']} bytes (the frozen teacher "
              "reshards every unit and its root after each forward). Planned beyond the model states: units in "
              f"flight {p['gathered'] / 2**20:.0f} MiB, activations {p['activations'] / 2**20:.0f} MiB, the replicated "
              f"VAE {p['rows']['vae']['params'] / 2**20:.0f} MiB. Measured: the larger rank's; the 2-rank training run "
              f"took {run_s:.0f} s."]
    return "\n".join(lines)


def _host_work(repo: str, script: str, steps: int, out: str, extra: tuple = ()) -> dict:
    args = [sys.executable, os.path.join(ROOT, "tools", "host_work.py"), f"--repo={repo}", script,
            f"--max_steps={steps}", "--log_every=100", "--save_every=0", "--sample_every=0", f"--output_dir={out}",
            *extra]
    if script == "train_flux_kontext.py":
        args.append("--val_every=0")
    r = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    line = next((x for x in r.stdout.splitlines() if x.startswith("HOST_WORK ")), None)
    if r.returncode or line is None:
        sys.exit(f"host_work {script} failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    return json.loads(line[len("HOST_WORK "):])


def _host_work_per_step(repo: str, script: str, short: int, long: int, out: str, extra: tuple = ()) -> dict:
    """tools/host_work.py's counts per step between a `short`- and a `long`-step run: the steps
    without setup, checkpoint and export. The long run writes into `out`."""
    a = _host_work(repo, script, short, out + f"_{short}", extra)
    b = _host_work(repo, script, long, out, extra)
    return {k: (b.get(k, 0) - a.get(k, 0)) / (long - short) for k in b}


def bench_host(repo: str = ROOT) -> str:
    """Per training step, on one CPU rank with the embedded defaults: the aten ops dispatched, the
    bytes copied and the host syncs outside the diffusion models' forwards and autograd's backward
    (tools/host_work.py), per step between a short and a long run (_host_work_per_step)."""
    rows = ["| script | aten ops / step | bytes copied / step | host syncs / step | most dispatched |",
            "|---|---:|---:|---:|---|"]
    # the prompt cache at steady state: the 36 shipped prompts are all cached by step 18 (2 per step)
    cases = [("train_dmd.py", (), 2, 4), ("train_flux_kontext.py", (), 2, 4),
             ("train_dmd.py", (), 20, 40), ("train_dmd.py", ("--prompt_cache=64",), 20, 40)]
    with tempfile.TemporaryDirectory() as tmp:
        for i, (script, extra, a, b) in enumerate(cases):
            per = _host_work_per_step(repo, script, a, b, os.path.join(tmp, str(i)), extra)
            top = sorted(((n, k[3:]) for k, n in per.items() if k.startswith("op:")), reverse=True)[:5]
            name = f"{script}{', ' + ' '.join(extra) if extra else ''}, steps {a + 1}-{b}"
            rows.append(f"| {name} | {per['ops']:.0f} | {per.get('copied_bytes', 0) / 2**20:.2f} MiB | "
                        f"{per.get('syncs', 0):.1f} | {', '.join(f'{k} {n:.0f}' for n, k in top)} |")
    return "\n".join(rows)


def bench_reshard() -> str:
    """RESHARD_AFTER_FORWARD=auto against 1 on one CPU rank (world size 1: reshard-free), the embedded
    defaults: the whole step's aten ops and bytes copied (tools/host_work.py, per step between a 2-step
    and a 4-step run), and whether the 4 steps' logged losses are the same."""
    rows = ["| script | setting | aten ops / step | bytes copied / step | losses |", "|---|---|---:|---:|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for script in ("train_dmd.py", "train_flux_kontext.py"):
            per, losses = {}, {}
            for setting in ("1", "auto"):
                out = os.path.join(tmp, f"{script}{setting}")
                per[setting] = _host_work_per_step(ROOT, script, 2, 4, out,
                                                   ("--log_every=1", f"--reshard_after_forward={setting}"))
                with open(os.path.join(out, "metrics.jsonl")) as f:  # the 4-step run's
                    losses[setting] = [{k: v for k, v in r.items() if "loss" in k or "norm" in k}
                                       for r in map(json.loads, f) if "step" in r]
            logged = len(losses["1"]) == 4 and all(losses["1"])  # 4 steps, each with its losses and norms
            same = "the same" if logged and losses["1"] == losses["auto"] else "DIFFER (or not logged)"
            for setting in ("1", "auto"):
                p, ratio = per[setting], "" if setting == "1" else " ({:.2f}x, {:.2f}x)".format(
                    per["auto"]["step_ops"] / per["1"]["step_ops"],
                    per["auto"]["step_copied_bytes"] / per["1"]["step_copied_bytes"])
                rows.append(f"| {script} | `{setting}` | {p['step_ops']:.0f} | "
                            f"{p['step_copied_bytes'] / 2**20:.2f} MiB{ratio} | {same} |")
    return "\n".join(rows)


BENCHES = {"save": bench_save, "step": bench_step, "planner": bench_planner, "compile": bench_compile,
           "stack": bench_stack, "noise": bench_noise, "gan_head": bench_gan_head, "fake_fp32": bench_fake_fp32,
           "nf4_width": bench_nf4_width, "kontext_dmd_width": bench_kontext_dmd_width, "host": bench_host,
           "reshard": bench_reshard}
WORKERS = {"save": worker_save, "stack": worker_stack}


def usage() -> str:
    return "usage: python tools/benchmarks.py [" + "|".join([*BENCHES, "all"]) + "]\n" + __doc__.split("\n\n", 1)[1]


def main(argv: list[str]) -> int:
    if argv[:1] == ["_worker"] and len(argv) >= 2 and argv[1] in WORKERS:
        WORKERS[argv[1]](*argv[2:])
        return 0
    if argv[:1] in (["-h"], ["--help"]):
        print(usage())
        return 0
    if len(argv) > 1 or (argv and argv[0] not in [*BENCHES, "all"]):
        print(f"benchmarks: unknown arguments {argv}\n{usage()}", file=sys.stderr)
        return 2
    which = argv[0] if argv else "all"
    names = list(BENCHES) if which == "all" else [which]
    print(f"machine: {machine()}\n")
    for name in names:
        t0 = time.perf_counter()
        print(f"### {name}\n\n{BENCHES[name]()}\n\n(command: `python tools/benchmarks.py {name}`, "
              f"{time.perf_counter() - t0:.0f} s)\n", flush=True)
    if "root" in _RUNS:  # the step/planner runs' outputs (checkpoints of the medium models)
        import shutil
        shutil.rmtree(_RUNS["root"], ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
