"""Benchmarks (not tests): measured side by side in one run on this machine.

    python benchmarks.py save       # checkpoint save: synchronous vs asynchronous (how long training waits)
    python benchmarks.py step       # FSDP2 vs DDP per script step: per-rank memory and step time
    python benchmarks.py planner    # memory planner estimate vs measured peak
    python benchmarks.py all        # everything, as the markdown tables of BENCHMARKS.md

Each benchmark launches `torchrun --standalone --nproc_per_node=2` on this file's worker mode and
prints a markdown table; the numbers in BENCHMARKS.md come from exactly these commands.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _torchrun(worker: str, *args: str, nproc: int = 2) -> list[dict]:
    """Run `benchmarks.py _worker <worker> args` on nproc CPU ranks; rank 0 prints JSON lines."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.join(HERE, "benchmarks.py"), "_worker", worker, *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // nproc))}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=HERE)
    if r.returncode:
        sys.exit(f"benchmark worker {worker} failed:\n{r.stderr[-3000:]}")
    return [json.loads(line[6:]) for line in r.stdout.splitlines() if line.startswith("BENCH ")]


def _emit(obj: dict) -> None:
    import fsdp_utils
    if fsdp_utils.rank() == 0:
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
    from precision import get_precision
    d = fsdp_utils.init_distributed()
    mesh = fsdp_utils.build_mesh(d.device)
    model = medium_unet(int(width))
    n_params = sum(p.numel() for p in model.parameters())
    fsdp_utils.apply_fsdp(model, mesh, get_precision("fp32").mp_policy(), verbose=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # materialise Adam state
    bytes_ = sum(fsdp_utils.local_state_bytes({"m": model}, {"m": opt}).values()) * d.world_size
    for mode in ("sync", "async"):
        ck = checkpoint.Checkpointer(os.path.join(out, mode), keep_last=2, async_save=(mode == "async"))
        for i in range(int(repeats)):
            torch.distributed.barrier()
            t0 = time.perf_counter()
            ck.save(i + 1, {"m": model}, {"m": (model, opt)}, {}, {}, {})
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

BENCHES = {"save": bench_save}
WORKERS = {"save": worker_save}


def main(argv: list[str]) -> None:
    sys.path.insert(0, HERE)
    if argv[:1] == ["_worker"]:
        WORKERS[argv[1]](*argv[2:])
        return
    which = argv[0] if argv else "all"
    names = list(BENCHES) if which == "all" else [which]
    print(f"machine: {machine()}\n")
    for name in names:
        t0 = time.perf_counter()
        print(f"### {name}\n\n{BENCHES[name]()}\n\n(command: `python benchmarks.py {name}`, "
              f"{time.perf_counter() - t0:.0f} s)\n", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
