"""What the benchmarks share: 2-rank CPU launches of tools/benchmarks.py's worker mode, the rank-0 result
lines, the machine's line, the medium UNet, the scratch folder of a run."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root: the scripts

_RUNS: dict = {}  # (script, size, parallelism) -> measured run, shared by `step` and `planner`


def _root() -> str:
    if "root" not in _RUNS:
        _RUNS["root"] = tempfile.mkdtemp(prefix="bench_step_")
    return _RUNS["root"]


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


def medium_unet(width: int):
    from diffusers import UNet2DConditionModel
    import torch
    torch.manual_seed(0)
    return UNet2DConditionModel(
        block_out_channels=(width, 2 * width, 4 * width, 4 * width), layers_per_block=2, sample_size=32,
        cross_attention_dim=256, norm_num_groups=32, attention_head_dim=8,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"))


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
