"""The host's work per training step (tools/host_work.py): aten ops, copies and syncs, and
RESHARD_AFTER_FORWARD auto against 1."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from tools.bench.common import ROOT


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
