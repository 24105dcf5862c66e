"""At FLUX.1 width (a few blocks, random weights): the NF4 LoRA base and DMD2 with a Kontext teacher, measured
against the memory planner."""
from __future__ import annotations

import os
import time

from tools.bench.common import _root, _two_rank_memory


def flux_width_folder(root: str, blocks: tuple[int, int]) -> str:
    """A FLUX.1 Kontext folder at real width with `blocks` (double, single) blocks, random weights: gpu_check's
    transformer skeleton of that size with its weights written, beside its real-width parts (VAE, CLIP-L, a
    one-layer T5 of the real width; written once under `root`)."""
    from tools.gpu import folders
    return folders.real_folder("flux", root, blocks)


def bench_nf4_width() -> str:
    """Kontext LoRA (rank 16) on a FLUX.1-width transformer of 1 double + 1 single block (~0.55 B
    parameters, random weights, flux_width_folder), 2 CPU ranks, bf16, 256 px, batch 1,
    3 steps: BASE_DTYPE bf16 vs nf4, each rank's peak RSS above its baseline and model states,
    against the planner's per-GPU total for the same settings (without its fixed CUDA reserve)."""
    from tools import memory_plan
    from tools.gpu import folders
    root = _root()
    folder = flux_width_folder(os.path.join(root, "gpu_check_models"), (1, 1))
    data = folders.dataset(os.path.join(root, "gpu_check_models"), "flux", 256)
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
    from tools import memory_plan
    from tools.gpu import folders
    root = _root()
    folder = flux_width_folder(os.path.join(root, "gpu_check_models"), (0, 1))
    data = folders.dataset(os.path.join(root, "gpu_check_models"), "flux", 256)
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
