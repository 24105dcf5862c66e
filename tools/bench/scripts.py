"""The training scripts' costs, side by side: checkpoint save (sync vs async), the step under FSDP2 vs DDP,
the memory planner against the measured peak, COMPILE=1 against eager."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from tools.bench.common import _RUNS, ROOT, _emit, _root, _torchrun, medium_unet


def worker_save(width: str, repeats: str, out: str) -> None:
    import torch
    import checkpoint
    import fsdp_utils
    from parallel.memory import local_state_bytes
    from families import MODELS
    from parallel.parallelize import parallelize
    from precision import get_precision
    d = fsdp_utils.init_distributed()
    mesh = fsdp_utils.build_meshes(d.device)[0]
    model = medium_unet(int(width))
    n_params = sum(p.numel() for p in model.parameters())
    parallelize(model, mesh, get_precision("fp32").mp_policy(), verbose=False, facts=MODELS["UNet2DConditionModel"])
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


def medium_folder(kind: str, root: str) -> str:
    """The tiny default's folder with its trained model swapped for a medium one (its family spec's
    bench_medium), so state bytes and step times are not lost in fixed costs. Frozen parts: symlinks."""
    import diffusers
    import torch
    import families
    from families import pipelines
    from tools import tiny_models
    spec = next((s for s in families.SPECS if kind in s.bench_medium), None)
    if spec is None:
        raise ValueError(f"no medium model for the tiny default {kind!r} (a family spec's bench_medium)")
    tiny, _ = tiny_models.ensure_default(kind)
    folder = os.path.join(root, f"medium_{kind}")
    if os.path.isdir(folder):
        return folder
    os.makedirs(folder)
    with open(os.path.join(tiny, "model_index.json")) as f:
        trained = pipelines.trained_component(json.load(f)["_class_name"])
    for name in os.listdir(tiny):
        if name != trained.subfolder:
            os.symlink(os.path.join(tiny, name), os.path.join(folder, name))
    torch.manual_seed(0)
    cls = getattr(diffusers, trained.class_name)
    cfg = cls.load_config(os.path.join(tiny, trained.subfolder))
    cfg.update(spec.bench_medium[kind])
    cls.from_config(cfg).save_pretrained(os.path.join(folder, trained.subfolder))
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
