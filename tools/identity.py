"""Fingerprints of what the scripts produce, for refactors that must not change a number.

    python tools/identity.py --out=out/identity/before.json      # on the commit before a move
    python tools/identity.py --out=out/identity/after.json       # after it
    python tools/identity.py --compare out/identity/before.json out/identity/after.json

Four jobs, 2 CPU ranks (torchrun), one thread each, 4 steps with EMA, checkpoints at steps 2 and 4,
samples at 2 and 4 (and validation for Kontext): DMD2 with the shipped UNet teacher (GAN head on),
DMD2 with the shipped Kontext teacher (4-step generator, GAN head on), Kontext fine-tuning on its
embedded default, and DMD2 with the tiny Qwen-Image-Edit-2509 teacher (tools/tiny_models.py: two
references per row, 4-step generator, the teacher's true CFG, GAN head on). A fingerprint holds, per
job: every metrics.jsonl record without its timings, a hash of every checkpoint file (trainer_state.json
without its run id and save time, field by field; DCP's pickled .metadata and the per-process RNG files
only by their presence) and the checkpoints' config setting by setting (its temporary and checkout folders named
alike, so a new setting shows by name),
every export file (links by where they point) and every sample grid's pixels. `--compare` prints
what differs and exits 1 if anything does.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KONTEXT_BASE = os.path.join(ROOT, "assets", "kontext_base")
KONTEXT_PAIRS = os.path.join(ROOT, "assets", "kontext_blue", "train.jsonl")
STEPS = ["--max_steps=4", "--log_every=1", "--ema_decay=0.9", "--save_every=2", "--sample_every=2", "--keep_last=2"]
JOBS = {
    "dmd_unet": ("train_dmd.py", STEPS + ["--dfake_gen_update_ratio=2", "--use_gan=1"]),
    "dmd_kontext": ("train_dmd.py", STEPS + [f"--model_path={KONTEXT_BASE}", f"--data_path={KONTEXT_PAIRS}",
                                             "--resolution=32", "--dfake_gen_update_ratio=2", "--batch_size=1",
                                             "--denoising_steps=999,749,499,249", "--sample_count=2", "--use_gan=1"]),
    "kontext_ft": ("train_flux_kontext.py", STEPS + ["--val_every=2", "--sample_steps=2"]),
    # the tiny Qwen teacher's folder and rows are built into the work folder ({qwen}: tools/tiny_models.py)
    "dmd_qwen": ("train_dmd.py", STEPS + ["--model_path={qwen}/model", "--data_path={qwen}/data/data.jsonl",
                                          "--precision=fp32", "--resolution=64", "--condition_area=4096",
                                          "--dfake_gen_update_ratio=2", "--batch_size=1", "--sample_count=2",
                                          "--denoising_steps=999,749,499,249", "--use_gan=1"]),
}
# metrics.jsonl fields that measure the machine, not the computation
TIMING_WORDS = ("_ms", "time", "mfu", "hfu", "tflop", "throughput", "per_s", "mem", "rss", "gib", "eta", "seconds")
RUN_FIELDS = ("run_id", "saved_at")  # trainer_state.json: who saved it and when, not what
# files whose bytes differ between two runs of the same code: DCP's pickled .metadata and the RNG
# states of processes that are not seeded alike (counted by their presence; the .distcp shards hold
# every tensor and are compared)
PER_PROCESS = (".metadata", "rank_0.pt", "rank_1.pt")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _file_hash(path: str, work: str) -> str | dict:
    name = os.path.basename(path)
    if name in PER_PROCESS:
        return "present"
    if name == "config.json" and os.path.basename(os.path.dirname(os.path.dirname(path))) == "checkpoints":
        with open(path) as f:  # the run's settings: its folders (temporary, the checkout's) named alike
            text = f.read().replace(os.path.realpath(work), "$WORK").replace(work, "$WORK")
            return json.loads(text.replace(ROOT, "$ROOT"))
    if name == "trainer_state.json":  # compared field by field, as the config
        with open(path) as f:
            return {k: v for k, v in json.load(f).items() if k not in RUN_FIELDS}
    if name.endswith(".png"):
        import numpy as np
        from PIL import Image
        return _sha(np.asarray(Image.open(path).convert("RGB")).tobytes())
    with open(path, "rb") as f:
        return _sha(f.read())


def _where(path: str, work: str) -> str:
    """A link's target, named the same in every run: below the run's work folder or the repository."""
    target = os.path.realpath(path)
    for base, name in ((os.path.realpath(work), "$WORK"), (ROOT, "$ROOT")):
        if target.startswith(base + os.sep):
            return f"{name}/{os.path.relpath(target, base)}"
    return target


def _tree(folder: str, work: str) -> dict[str, str]:
    """{relative path: hash} of every file below `folder`; a link counts by where it points."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in sorted(dirnames + filenames):
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, folder)
            if os.path.islink(path):
                out[rel] = "link:" + _where(path, work)
            elif name in filenames:
                out[rel] = _file_hash(path, work)
        dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]
    return out


def _metrics(path: str) -> list[dict]:
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [{k: v for k, v in r.items() if not any(w in k.lower() for w in TIMING_WORDS)} for r in records]


def fingerprint(out_dir: str, work: str) -> dict:
    found = {"metrics": _metrics(os.path.join(out_dir, "metrics.jsonl"))}
    for part in ("checkpoints", "export", "export_merged", "samples"):
        if os.path.isdir(os.path.join(out_dir, part)):
            found[part] = _tree(os.path.join(out_dir, part), work)
    return found


def run_job(name: str, work: str, extra: list[str] = ()) -> dict:
    script, args = JOBS[name]
    if any("{qwen}" in a for a in args):
        sys.path.insert(0, ROOT)
        from tools import tiny_models
        model, _ = tiny_models.ensure_default("qwen_image_edit", os.path.join(work, "tiny"))
        args = [a.format(qwen=os.path.dirname(model)) for a in args]
    out_dir = os.path.join(work, name)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(ROOT, script), *args, f"--output_dir={out_dir}", f"--text_cache_dir={work}/text_cache_{name}",
           *extra]
    r = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"{name} failed (exit {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return fingerprint(out_dir, work)


def differences(a: dict, b: dict, where: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in differences(a.get(k), b.get(k), f"{where}/{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write the fingerprints here (JSON)")
    p.add_argument("--jobs", default=",".join(JOBS), help="comma-separated subset of " + ", ".join(JOBS))
    p.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    p.add_argument("--extra", nargs="*", default=[], metavar="[JOB:]NAME=VALUE",
                   help="settings added as --NAME=VALUE to every job, or to JOB's only (a default that changed, set "
                        "back to the old value, so the jobs compute what they computed before)")
    a = p.parse_args()
    if a.compare:
        before, after = (json.load(open(f)) for f in a.compare)
        diff = differences(before, after)
        print("\n".join(diff[:50]) if diff else "identical: " + ", ".join(sorted(before)))
        sys.exit(1 if diff else 0)
    if not a.out:
        p.error("--out or --compare")
    jobs = [j for j in a.jobs.split(",") if j]
    unknown = [j for j in jobs if j not in JOBS]
    if unknown:
        p.error(f"unknown job(s) {unknown}: choose from {', '.join(JOBS)}")
    with tempfile.TemporaryDirectory() as work:
        found = {}
        for name in jobs:
            extra = [e.split(":", 1)[-1] for e in a.extra if ":" not in e.split("=", 1)[0] or e.startswith(name + ":")]
            found[name] = run_job(name, work, ["--" + e for e in extra])
            print(f"{name}: {len(found[name]['metrics'])} records, "
                  f"{sum(len(v) for k, v in found[name].items() if k != 'metrics')} files", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(found, f, indent=1, sort_keys=True)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
