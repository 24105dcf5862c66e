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
    python tools/benchmarks.py fp32_modules  # Wan width: the pipeline's fp32-kept modules vs bf16-mixed compute
    python tools/benchmarks.py all        # everything, as the markdown tables of docs/benchmarks.md

Each benchmark launches `torchrun --standalone --nproc_per_node=2` 2-rank CPU runs: of tools/benchmarks.py's
worker mode (save, stack), or of the training scripts train_dmd.py / train_flux_kontext.py in the
repository root (step, planner, compile), and prints a markdown table; the numbers in docs/benchmarks.md
come from exactly these commands.
"""
from __future__ import annotations

import sys
import time

from tools.bench.common import _RUNS, machine
from tools.bench.dmd import bench_fake_fp32, bench_gan_head, bench_noise
from tools.bench.fp32_modules import bench_fp32_modules
from tools.bench.host import bench_host, bench_reshard
from tools.bench.scripts import bench_compile, bench_planner, bench_save, bench_step, worker_save
from tools.bench.stack import bench_stack, worker_stack
from tools.bench.width import bench_kontext_dmd_width, bench_nf4_width


BENCHES = {"save": bench_save, "step": bench_step, "planner": bench_planner, "compile": bench_compile,
           "stack": bench_stack, "noise": bench_noise, "gan_head": bench_gan_head, "fake_fp32": bench_fake_fp32,
           "nf4_width": bench_nf4_width, "kontext_dmd_width": bench_kontext_dmd_width, "host": bench_host,
           "reshard": bench_reshard, "fp32_modules": bench_fp32_modules}
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
