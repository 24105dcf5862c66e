"""One row's training run: its steps (the timed window after the warm-up, the compile seconds apart), then
optionally the resume by one step and the export loaded as a user loads it."""
from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys

from tools.gpu.budget import Deadline
from tools.gpu.folders import ROOT, model_label, spec, trained_subfolder


def launch(script: str, args: list[str], world: int, log: str, timeout: float) -> int:
    """torchrun of `script`; its output appended to `log`; killed (rc 124) past `timeout` seconds."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           os.path.join(ROOT, script), *args]
    with open(log, "a") as f:
        f.write(f"\n===== {' '.join(cmd[4:])}\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"})
        try:
            return proc.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            f.write(f"===== killed: past the check's deadline ({timeout:.0f} s left for it)\n")
            return 124


def run_args(script: str, s: dict, model: str, data: str, out: str) -> list[str]:
    args = [f"--model_path={model}", f"--data_path={data}", f"--output_dir={out}", f"--precision={s['precision']}",
            f"--batch_size={s['batch_size']}", f"--resolution={s['resolution']}", "--log_every=1", "--save_every=0",
            "--keep_last=1", "--sample_every=0", f"--activation_checkpointing={int(s.get('ac', False))}",
            f"--export_dtype={s['export_dtype']}"]
    args += [f"--{k}={v}" for k, v in s.get("extra", {}).items()]
    if s.get("lora_rank"):
        args.append(f"--lora_rank={s['lora_rank']}")
    if script == "train_flux_kontext.py":
        args.append("--val_every=0")
    return args


METRICS = ("step_ms", "mfu", "hfu", "model_tflop", "allocated_gib", "reserved_gib", "planned_gib")


def blank_result(row: dict, status: str, ok: bool) -> dict:
    """A row's result before (or without) running it; `ok`: whether it counts as passed."""
    return {"run": row["run"], "model": model_label(row.get("family"), row.get("size")), "world": row["world"],
            "status": status, "ok": ok, "resume_export": "-", "wall_s": float("nan"), "expect_s": row["expect_s"],
            "disk_need_gb": float("nan"), "disk_free_gb": float("nan"), "warmup_s": float("nan"),
            "compile_s": float("nan"), "timed_steps": [], **{k: float("nan") for k in METRICS}}


def one_run(row: dict, folder: str, data: str, out: str, log: str, deadline: Deadline) -> dict:
    name, script, family, world, s = row["run"], row["script"], row["family"], row["world"], row["settings"]
    run_dir = os.path.join(out, name)
    shutil.rmtree(run_dir, ignore_errors=True)
    args = run_args(script, s, folder, data, run_dir)
    steps = row["steps"]
    result = blank_result(row, "", False)
    rc = launch(script, args + [f"--max_steps={steps}"], world, log, deadline.left())
    records = []
    path = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(path):
        records = [json.loads(line) for line in open(path) if '"step_ms"' in line]
    warm, later = timed_window(records, row["warmup"], finished=rc == 0)
    result["warmup_s"] = sum(r["step_ms"] for r in warm) / 1000
    result["timed_steps"] = [int(r["step"]) for r in later]
    result["losses"] = [r["loss"] for r in records if "loss" in r]  # the FP8 rows' side-by-side table
    result["step_indices"] = [int(r["step_index"]) for r in later if "step_index" in r]  # a few-step DMD2 run's
    if s["extra"].get("compile"):  # this launch's output: after its "===== <command>" line (a cut adds "===== killed")
        result["compile_s"] = compile_seconds(open(log).read().rsplit("\n===== --", 1)[-1])
    if later:  # the mean over whole DMD2 cycles (steps 3-12 at ratio 5: 2 generator + 8 fake-score steps)
        result["step_ms"] = statistics.mean(r["step_ms"] for r in later)
        for k_out, k_in in (("mfu", "mfu"), ("hfu", "hfu"), ("model_tflop", "model_tflop"),
                            ("allocated_gib", "cuda_peak_gib"),
                            ("reserved_gib", "cuda_reserved_gib")):
            if k_in in later[-1]:
                result[k_out] = later[-1][k_in]
    result["status"] = "pass" if rc == 0 else ("cut at the deadline" if rc == 124 else f"FAIL rc {rc} (runs.log)")
    result["ok"] = rc == 0
    if row["probe"]:  # a kernel the start-up check should stop: say what happened, pass or stop
        said = [line for line in open(log).read().rsplit("=====", 1)[-1].splitlines() if "start-up check" in line]
        result["status"] = (f"stopped at start: {said[0].split(': ', 2)[-1][:160]}" if rc == 1 and said
                            else "trained: the kernel passed the check" if rc == 0 else result["status"])
        result["ok"] = rc == 0 or (rc == 1 and bool(said))
        result["probe"] = said[:1]
    if rc == 0 and row["resume"]:
        if deadline.left() < 30:
            result["resume_export"], result["ok"] = "not run (deadline)", False
        else:
            rc2 = launch(script, args + [f"--max_steps={steps + 1}", "--resume=auto"], world, log, deadline.left())
            resumed = rc2 == 0 and "resumed from" in open(log).read().rsplit("=====", 1)[-1]
            result["resume_export"] = "pass" if resumed and export_loads(run_dir, family, s, folder, data) else \
                ("cut at the deadline" if rc2 == 124 else "FAIL (runs.log)")
            result["ok"] = result["resume_export"] == "pass"
    table_path = os.path.join(run_dir, "profile", "ops_rank0.txt")
    if os.path.exists(table_path):  # PROFILE_STEPS' table (the traces stay behind: too big to bring back)
        shutil.copy(table_path, os.path.join(out, f"profile_{name}.txt"))  # its step times include the profiler
    shutil.rmtree(run_dir, ignore_errors=True)  # a full checkpoint is tens of GB: the next row needs the disk
    return result


def timed_window(records: list[dict], warmup: int, finished: bool) -> tuple[list[dict], list[dict]]:
    """(warm-up records, timed records) of a run's per-step records: the first `warmup` steps (the
    first steps' allocations, cuDNN's autotuning and, under COMPILE, every graph's compilation) are
    not timed. A finished run with no step past them (a 2-step probe) is timed over all its steps;
    one cut before its timed window has none."""
    if len(records) > warmup or not finished:
        return records[:warmup], records[warmup:]
    return [], records


def compile_seconds(log: str) -> float:
    """The seconds torch.compile spent in a run, from its last compile report in `log`
    (parallel/compile.compile_report: "... (12.3 s compiling)"); NaN when there is none."""
    import re
    found = re.findall(r"\(([0-9.]+) s compiling\)", log)
    return float(found[-1]) if found else float("nan")


def export_loads(run_dir: str, family: str, s: dict, base: str = "", data: str = "") -> bool:
    """The row's export as a user loads it (the family's GpuCheck.export_loads; else a LoRA export's weights file,
    a full export's trained model through diffusers.AutoModel)."""
    import diffusers
    export = os.path.join(run_dir, "export")
    check = spec(family).gpu.export_loads
    if check:
        return check(export, base, s, data)
    if s.get("lora_rank"):
        return os.path.exists(os.path.join(export, "pytorch_lora_weights.safetensors"))
    return diffusers.AutoModel.from_pretrained(os.path.join(export, trained_subfolder(family))) is not None
