"""The command line: tests/test_gpu.py in the background, the models built and sized, the plain references,
the rows under one deadline, the table (what it does: tools/gpu/__init__.py)."""
from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time

import families
from families.spec import FlowDistillationRoom
from tools import gpu as package
from tools.gpu.budget import CALL_S, GB, GIB, HEADROOM, Deadline, build, disk_usage, plan_all
from tools.gpu.folders import ROOT, dataset, model_label, real_configs, spec, trained_subfolder
from tools.gpu.reference import plain_reference
from tools.gpu.report import disk_line, table
from tools.gpu.rows import REF_EXPECT_S, RENAMED, SUITES, plan_runs, select_runs
from tools.gpu.run import blank_result, one_run


RENAMED_OPTIONS = {"qwen_blocks": "qwen_image_blocks"}  # an option renamed: refused in one line naming its name
TEST_WORKERS = 3  # tests/test_gpu.py's launches side by side (pytest-xdist): ~100 s instead of ~280 s


def start_tests(out: str) -> subprocess.Popen:
    """tests/test_gpu.py in the background: it uses the GPU little, the model build mostly the CPU."""
    cmd = [sys.executable, "-m", "pytest", "tests/test_gpu.py", "-q", "-p", "no:cacheprovider"]
    if importlib.util.find_spec("xdist"):
        cmd += ["-n", str(TEST_WORKERS)]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=open(os.path.join(out, "test_gpu.log"), "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def finish_tests(tests: subprocess.Popen | None, out: str, timeout: float) -> tuple[bool, str]:
    """(passed, its summary line): waited for until `timeout`, then cut."""
    if tests is None:
        return True, "not run (--skip_tests)"
    try:
        tests.wait(timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        os.killpg(tests.pid, signal.SIGKILL)
        tests.wait()
        return False, "cut at the deadline (test_gpu.log)"
    last = open(os.path.join(out, "test_gpu.log")).read().strip().splitlines()[-1:] or [""]
    return tests.returncode == 0, f"{last[0].strip('= ')} (rc {tests.returncode})"


def blocks_help(f) -> str:
    """--<family>_blocks' help: the config keys counted and the real model's counts."""
    with open(os.path.join(real_configs(f.name), trained_subfolder(f.name), "config.json")) as file:
        real = json.load(file)
    return f"{','.join(f.gpu.blocks)}; all: {','.join(str(real[k]) for k in f.gpu.blocks)}"


def main() -> None:
    # counted from gpu_check.sh's start where it set GPU_CHECK_T0 (the wheels' install included)
    started = time.monotonic() - max(time.time() - float(os.environ.get("GPU_CHECK_T0", time.time())), 0)
    ap = argparse.ArgumentParser(description=package.__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "out", "gpu_check"))
    ap.add_argument("--work", default="", help="where models go; '' = --out/work (removed at the end)")
    ap.add_argument("--tiny", action="store_true", help="the tiny models (a plumbing check, minutes on CPU)")
    ap.add_argument("--cpu", action="store_true", help="allow a machine without CUDA (rows that need CUDA: skipped)")
    sized = [f for f in families.SPECS if f.gpu and f.gpu.blocks]  # the families built in blocks at real width
    for f in sized:
        ap.add_argument(f"--{f.name}_blocks", default=",".join(map(str, f.gpu.default_blocks)),
                        help=f"{f.gpu.label} blocks at real width ({blocks_help(f)}); rows that do not fit the disk "
                             "get fewer")
    for old in RENAMED_OPTIONS:
        ap.add_argument(f"--{old}", help=argparse.SUPPRESS)
    ap.add_argument("--deadline_s", type=float, default=0,
                    help=f"seconds for everything from the start; rows that do not fit are not started, runs "
                         f"past it are cut (0: {CALL_S} with CUDA, 1800 without)")
    ap.add_argument("--skip_tests", action="store_true", help="do not run tests/test_gpu.py")
    ap.add_argument("--runs", default="", help="comma-separated run names, or parts of names, to keep ('' = all)")
    ap.add_argument("--suite", default="acceptance",
                    help=f"one of {', '.join(SUITES)}. acceptance: every script and mode once; speed: step-time rows "
                         "(kernels, AC, compile); qwen_image: the Qwen-Image-Edit rows, flux2: FLUX.2 klein-base DMD2, "
                         "wan: Wan 2.1 T2V-1.3B DMD2 (81 frames at 480p), z_image: Z-Image's text-to-image LoRA and "
                         "DMD2 at 1024 px, "
                         "fp8 / fp8_qwen: FP8 against bf16 on Kontext's 1024 px full fine-tune / Qwen-Image-Edit's "
                         "1024 px LoRA (each a call of its own)")
    a = ap.parse_args()
    for old, new in RENAMED_OPTIONS.items():
        if getattr(a, old) is not None:
            sys.exit(f"gpu_check: --{old}: the option is named by its family: --{new}")
    if a.suite in RENAMED:
        sys.exit(f"gpu_check: --suite={a.suite}: the suite is named by its family: --suite={RENAMED[a.suite]}")
    if a.suite not in SUITES:
        sys.exit(f"gpu_check: --suite={a.suite}: choose one of {', '.join(SUITES)}")
    blocks = {}
    for f in sized:
        value = getattr(a, f"{f.name}_blocks")
        got = tuple(int(x) for x in value.split(",") if x.strip().isdigit())
        if len(got) != len(f.gpu.blocks) or min(got) < 1:
            sys.exit(f"gpu_check: --{f.name}_blocks={value}: give {len(f.gpu.blocks)} block count(s) "
                     f"({', '.join(f.gpu.blocks)}), each >= 1 (e.g. {','.join(map(str, f.gpu.default_blocks))})")
        blocks[f.name] = got
    import torch

    from components.warnings import quiet_known_warnings
    quiet_known_warnings()
    cuda = torch.cuda.is_available()
    if not cuda and not a.cpu:
        sys.exit("gpu_check: no CUDA GPU here (use --cpu --tiny for the plumbing check on CPU)")
    deadline = Deadline(a.deadline_s or (CALL_S if cuda else 1800), started)
    os.makedirs(a.out, exist_ok=True)
    work = a.work or os.path.join(a.out, "work")
    os.makedirs(work, exist_ok=True)
    device = torch.device("cuda") if cuda else torch.device("cpu")
    gpu_gb = torch.cuda.get_device_properties(0).total_memory / GIB if cuda else 0.0
    name = f"{torch.cuda.get_device_name(0)} ({gpu_gb:.1f} GiB)" if cuda else "CPU"
    import diffusers
    versions = (f"torch {torch.__version__}" + (f", CUDA {torch.version.cuda}" if cuda else "")
                + f", diffusers {diffusers.__version__}")
    tests = None if a.skip_tests else start_tests(a.out)
    t = time.monotonic()
    runs = select_runs(plan_runs(a.tiny, a.suite), a.runs)
    if not cuda:  # a CPU without native bf16 emulates it (~80x slower); on CPU the rows check plumbing, not dtypes
        for r in runs:
            r["settings"]["precision"] = "fp32"
    folders, peaks, disk = build(runs, work, a.out, a.tiny, blocks)
    data = {r["run"]: dataset(work, r["family"], r["settings"]["resolution"], a.tiny, r["script"]) for r in runs}
    with open(os.path.join(a.out, "build.log"), "w") as log:
        log.write(f"models and data built and sized in {time.monotonic() - t:.0f} s\n{disk_line(disk)}\n")
    print(f"models and data built and sized in {time.monotonic() - t:.0f} s\n{disk_line(disk)}", flush=True)

    planner = None
    plans = os.path.join(work, "planned.jsonl")
    if os.path.exists(plans):  # an earlier check's, in a kept --work
        os.remove(plans)
    if cuda:  # the planner's GPU totals, all CPU work, beside the reference and the runs
        jobs = [(r["run"], (folders[r["family"], r["size"]], r["world"], r["settings"], r["script"], gpu_gb))
                for r in runs if r["size"] is not None]
        planner = multiprocessing.get_context("spawn").Process(target=plan_all, args=(jobs, plans), daemon=True)
        planner.start()

    # the plain reference of the rows that compare with it, while the rows would still fit after it
    refs = {}
    runnable = [r for r in runs if r["size"] is not None and (cuda or not r["gpu_only"])]
    for r in runs:
        s = r["settings"]
        r["ref"] = (f"{model_label(r['family'], r['size'])}, {s['resolution']} px, batch {s['batch_size']}"
                    + spec(r["family"]).gpu.reference_note if r["ref"] and r in runnable else "")
        r["full"] = not s.get("lora_rank") and r["script"] == "train_flux_kontext.py"
    for r in runnable:
        s, folder = r["settings"], folders[r["family"], r["size"]]
        if not r["ref"] or r["ref"] in refs:
            continue
        if deadline.left() - REF_EXPECT_S < sum(q["expect_s"] for q in runnable):
            refs[r["ref"]] = {"error": "left out: the rows would not fit after it"}
            continue
        try:
            gpu = spec(r["family"]).gpu
            text_len, references = gpu.reference_shape(folder, data[r["run"]], s)
            grid = gpu.target_grid(folder, s) if gpu.target_grid else None
            refs[r["ref"]] = plain_reference(r["family"], folder, s["resolution"], s["batch_size"], text_len, device,
                                             references, grid)
        except Exception as e:  # noqa: BLE001 - the row says what failed; the runs still go on
            refs[r["ref"]] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        print(f"plain {r['ref']}: {refs[r['ref']]}", flush=True)

    rows, log = [], os.path.join(a.out, "runs.log")
    open(log, "w").close()
    for r in runs:
        if r["size"] is None:
            room = disk["free"] - disk["to_write"] - HEADROOM
            result = blank_result(r, f"not run: needs {peaks[r['run']] / GB:.1f} GB of disk with its smallest "
                                     f"model, {room / GB:.1f} GB to spare", False)
        elif r["gpu_only"] and not cuda:
            result = blank_result(r, "skipped: needs CUDA", True)
        elif not deadline.fits(r["expect_s"]):
            result = blank_result(r, f"not run: ~{r['expect_s'] * deadline.scale():.0f} s expected, "
                                     f"{max(deadline.left(), 0):.0f} s left", False)
        else:
            free = disk_usage(a.out)[1]
            if peaks[r["run"]] + HEADROOM > free:  # what earlier rows or the tests left behind
                result = blank_result(r, f"not run: needs {peaks[r['run']] / GB:.1f} GB of disk, "
                                         f"{free / GB:.1f} GB free", False)
            else:
                t = time.monotonic()
                result = one_run(r, folders[r["family"], r["size"]], data[r["run"]], a.out, log, deadline)
                result["wall_s"] = time.monotonic() - t
                if result["ok"]:
                    deadline.record(r["expect_s"], result["wall_s"])
            result["disk_free_gb"] = free / GB
        result["disk_need_gb"] = peaks[r["run"]] / GB
        extra, family = r["settings"]["extra"], spec(r["family"])
        cfg_pair = family.gpu.true_cfg and float(extra.get("real_guidance_scale", 0)) > 1
        rows.append({**result, "ref": r["ref"], "full": r["full"], "ac": r["settings"].get("ac", False),
                     "ratio": extra.get("dfake_gen_update_ratio"),
                     "lora_generator": bool(r["settings"].get("lora_rank")),
                     "lora_fake": bool(r["settings"].get("lora_rank")) and bool(int(extra.get("fake_lora", 0))),
                     "flow": family.protocols.get("train_dmd.py") is FlowDistillationRoom,
                     "cfg_pair": cfg_pair,  # and DMD_LOSS as train_dmd.py resolves "" (components/dmd_settings.py)
                     "decoupled": cfg_pair and (extra.get("dmd_loss") or family.dmd_loss) == "decoupled"})
        print(f"{r['run']}: {result}", flush=True)

    tests_ok, tests_line = finish_tests(tests, a.out, deadline.left())
    print(f"tests/test_gpu.py: {tests_line}", flush=True)
    if planner is not None:
        planner.join(timeout=max(deadline.left(), 1))
        planner.kill()
        planned = {}
        if os.path.exists(plans):
            planned = {p["run"]: p["planned"] for p in map(json.loads, open(plans))}
        for row in rows:
            value = planned.get(row["run"], float("nan"))
            row["planned_gib"] = value if isinstance(value, float) else float("nan")
            if isinstance(value, str):
                row["status"] += f"; {value}"
    header = [f"GPU check on {name}: {versions}", "", disk_line(disk), f"tests/test_gpu.py: {tests_line}",
              f"time: {time.monotonic() - started:.0f} s of the {deadline.seconds:.0f} s deadline"]
    report = table(rows, refs, header)
    with open(os.path.join(a.out, "gpu_check.md"), "w") as f:
        f.write(report + "\n")
    with open(os.path.join(a.out, "gpu_check.json"), "w") as f:
        json.dump({"device": name, "versions": versions, "disk": disk, "tests": tests_line, "refs": refs,
                   "rows": rows}, f, indent=1)
    print("\n" + report, flush=True)
    if not a.work:
        shutil.rmtree(work, ignore_errors=True)
    sys.exit(0 if tests_ok and all(r["ok"] for r in rows) else 1)
