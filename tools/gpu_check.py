"""The GPU acceptance check: both scripts on NCCL at real width, a few steps each, one table.

    bash tools/gpu_check.sh                 # on a machine with >= 1 CUDA GPU, no network needed
    python tools/gpu_check.py --tiny --cpu  # the same plumbing on the tiny models, CPU and gloo

For each run: step time (median of the logged steps after the first two), images/s, the peak CUDA
memory of the busiest rank (torch.cuda.max_memory_allocated and max_memory_reserved, from the
scripts' own memory table) against the planner's total for the same settings (error % of
reserved vs planned), and whether save -> resume -> export worked (a run to step 4 saving every 2
steps, then a fresh launch with RESUME=auto to step 5, whose export loads with from_pretrained).

Models are built offline with random weights: SD-1.5's UNet, VAE and CLIP at their real configs
(tools/real_size_configs/sd15-dmd) at 512 px; FLUX.1 Kontext's transformer at real width (3072
hidden, 24 heads) with FLUX_BLOCKS double + single blocks, its real VAE, a CLIP-L and a one-layer
T5 of the real width (4096), at 512 and 1024 px. The tokenizers are the project's tiny ones.
Runs: world size = the GPUs present, and 1 when there are more; LoRA; CONTEXT_PARALLEL=2 where
2 GPUs exist.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
REAL = os.path.join(HERE, "real_size_configs")
GIB = 2**30


# ----------------------------------------------------------------------------------------------
# models and data, built offline


def _copy_small_parts(tiny: str, out: str, keep: tuple[str, ...]) -> None:
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(tiny):
        if name in keep or name == "model_index.json":
            src = os.path.join(tiny, name)
            (shutil.copytree if os.path.isdir(src) else shutil.copy)(src, os.path.join(out, name))


def sd15_folder(root: str, tiny: bool) -> str:
    """An SD-1.5 pipeline folder: the real UNet, VAE and CLIP configs with random weights (or, tiny,
    the project's tiny SD-1.5 folder), the tiny tokenizer, SD-1.5's scheduler."""
    from tools import tiny_models
    base = os.path.join(root, "sd15_tiny")
    if not os.path.isdir(base):
        tiny_models.make_tiny_sd15(base)
    if tiny:
        return base
    out = os.path.join(root, "sd15_real")
    if not os.path.isdir(out):
        from diffusers import AutoencoderKL, UNet2DConditionModel
        from transformers import CLIPTextConfig, CLIPTextModel
        _copy_small_parts(base, out, ("tokenizer", "scheduler"))
        for sub, cls in (("unet", UNet2DConditionModel), ("vae", AutoencoderKL)):
            cls.from_config(cls.load_config(os.path.join(REAL, "sd15-dmd", sub))).save_pretrained(os.path.join(out, sub))
        config = CLIPTextConfig.from_pretrained(os.path.join(REAL, "sd15-dmd", "text_encoder"))
        CLIPTextModel(config).save_pretrained(os.path.join(out, "text_encoder"))
    return out


def flux_folder(root: str, tiny: bool, blocks: tuple[int, int]) -> str:
    """A FLUX.1 Kontext folder: the transformer at real width with `blocks` (double, single) blocks,
    the real VAE, CLIP-L, a one-layer T5 of the real width (or, tiny, the tiny Kontext folder)."""
    from tools import tiny_models
    base = os.path.join(root, "flux_tiny")
    if not os.path.isdir(base):
        tiny_models.make_tiny_flux_kontext(base)
    if tiny:
        return base
    out = os.path.join(root, f"flux_real_{blocks[0]}_{blocks[1]}")
    if not os.path.isdir(out):
        from diffusers import AutoencoderKL, FluxTransformer2DModel
        from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel, T5TokenizerFast
        _copy_small_parts(base, out, ("tokenizer", "tokenizer_2", "scheduler"))
        config = FluxTransformer2DModel.load_config(os.path.join(REAL, "flux-kontext-dev", "transformer"))
        config.update(num_layers=blocks[0], num_single_layers=blocks[1])
        FluxTransformer2DModel.from_config(config).save_pretrained(os.path.join(out, "transformer"))
        AutoencoderKL.from_config(AutoencoderKL.load_config(os.path.join(REAL, "flux-kontext-dev", "vae"))
                                  ).save_pretrained(os.path.join(out, "vae"))
        clip = CLIPTextConfig.from_pretrained(os.path.join(REAL, "flux-kontext-dev", "text_encoder"))
        CLIPTextModel(clip).save_pretrained(os.path.join(out, "text_encoder"))
        vocab = len(T5TokenizerFast.from_pretrained(os.path.join(out, "tokenizer_2")))
        t5 = T5Config(vocab_size=vocab, d_model=config["joint_attention_dim"], d_kv=64, d_ff=1024, num_layers=1,
                      num_heads=8, feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1)
        T5EncoderModel(t5).save_pretrained(os.path.join(out, "text_encoder_2"))
    return out


def datasets(root: str, size: int) -> tuple[str, str]:
    """(DMD2 prompts .txt, Kontext pairs .jsonl at `size` px)."""
    from tools import tiny_models
    prompts = os.path.join(root, "prompts.txt")
    if not os.path.exists(prompts):
        tiny_models.make_prompts_file(prompts, 64)
    pairs = os.path.join(root, f"pairs_{size}")
    if not os.path.isdir(pairs):
        tiny_models.make_edit_dataset(pairs, 24, size=size)
    return prompts, os.path.join(pairs, "data.jsonl")


# ----------------------------------------------------------------------------------------------
# one run: train to step 4 saving every 2, resume to 5, read back what it measured


def launch(script: str, args: list[str], world: int, log: str) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           os.path.join(ROOT, script), *args]
    with open(log, "a") as f:
        return subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"}).returncode


def measured_memory(log: str) -> tuple[int, int]:
    """(peak allocated, peak reserved) of the busiest rank, from the last memory table in `log`."""
    rows = [json.loads(line.split(" ", 1)[1]) for line in open(log) if line.startswith("memory_bytes ")]
    last = rows[-1] if rows else [{}]
    return max(r.get("cuda_peak", 0) for r in last), max(r.get("cuda_reserved", 0) for r in last)


def planned_bytes(model: str, world: int, s: dict) -> int:
    from tools import memory_plan
    settings = memory_plan.Settings(world_size=world, precision=s["precision"], batch_size=s["batch_size"],
                                    resolution=s["resolution"], activation_checkpointing=s["ac"],
                                    lora_rank=s.get("lora_rank", 0), context_parallel=s.get("cp", 1))
    return memory_plan.plan(model, settings)["gpu_total"]


def one_run(name: str, script: str, model: str, data: str, world: int, s: dict, out: str, cpu: bool) -> dict:
    """Steps 1-4 (checkpoints at 2 and 4, export), then RESUME=auto to step 5."""
    run_dir, log = os.path.join(out, name), os.path.join(out, name + ".log")
    shutil.rmtree(run_dir, ignore_errors=True)
    args = [f"--model_path={model}", f"--data_path={data}", f"--output_dir={run_dir}", f"--precision={s['precision']}",
            f"--batch_size={s['batch_size']}", f"--resolution={s['resolution']}",
            f"--activation_checkpointing={int(s['ac'])}", "--log_every=1", "--save_every=2", "--sample_every=0",
            f"--lora_rank={s.get('lora_rank', 0)}"]
    if script == "train_flux_kontext.py":
        args += [f"--context_parallel={s.get('cp', 1)}", "--num_sample_pairs=2", "--val_every=0", "--export_dtype=bf16"]
    first = launch(script, args + ["--max_steps=4"], world, log)
    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))] if first == 0 else []
    allocated, reserved = measured_memory(log) if first == 0 else (0, 0)
    second = launch(script, args + ["--max_steps=5", "--resume=auto"], world, log) if first == 0 else 1
    resumed = second == 0 and "resumed from" in open(log).read() and export_loads(run_dir, script, s)
    ms = statistics.median(r["step_ms"] for r in records[2:]) if len(records) > 2 else float("nan")
    images = s["batch_size"] * world // s.get("cp", 1) / (ms / 1000)
    planned = 0 if cpu else planned_bytes(model, world, s)
    return {"run": name, "world": world, "step_ms": ms, "images_per_s": images, "allocated_gib": allocated / GIB,
            "reserved_gib": reserved / GIB, "planned_gib": planned / GIB,
            "error_pct": 100 * (reserved - planned) / planned if planned else float("nan"),
            "save_resume_export": "pass" if first == 0 and resumed else f"FAIL (see {log})"}


def export_loads(run_dir: str, script: str, s: dict) -> bool:
    import diffusers
    export = os.path.join(run_dir, "export")
    if s.get("lora_rank"):
        return os.path.exists(os.path.join(export, "pytorch_lora_weights.safetensors"))
    sub = "unet" if script == "train_dmd.py" else "transformer"
    return diffusers.AutoModel.from_pretrained(os.path.join(export, sub)) is not None


# ----------------------------------------------------------------------------------------------


def plan_runs(gpus: int, tiny: bool) -> list[tuple]:
    """(name, script, model kind, world, settings) of every run: each script at world = GPUs
    (and 1 when more), LoRA, and CP=2 where two GPUs exist."""
    res_sd, res_flux = (32, (32,)) if tiny else (512, (512, 1024))
    base = {"precision": "bf16-mixed", "batch_size": 1, "ac": not tiny}
    worlds = [gpus] + ([1] if gpus > 1 else [])
    runs = [(f"dmd_sd15_{res_sd}px_w{w}", "train_dmd.py", "sd15", w, {**base, "resolution": res_sd}) for w in worlds]
    runs += [(f"dmd_sd15_lora_w{gpus}", "train_dmd.py", "sd15", gpus, {**base, "resolution": res_sd, "lora_rank": 16})]
    for res in res_flux:
        runs += [(f"kontext_{res}px_w{w}", "train_flux_kontext.py", "flux", w, {**base, "resolution": res}) for w in worlds]
    runs += [(f"kontext_lora_w{gpus}", "train_flux_kontext.py", "flux", gpus, {**base, "resolution": res_flux[0],
                                                                              "lora_rank": 16})]
    if gpus >= 2:
        runs += [("kontext_cp2_w2", "train_flux_kontext.py", "flux", 2, {**base, "resolution": res_flux[-1], "cp": 2})]
    return runs


def table(rows: list[dict], device: str) -> str:
    lines = [f"GPU check on {device}", "",
             "| run | ranks | step ms | images/s | peak alloc GiB | peak reserved GiB | planned GiB | error % | save/resume/export |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['run']} | {r['world']} | {r['step_ms']:.0f} | {r['images_per_s']:.2f} | {r['allocated_gib']:.2f} | "
                     f"{r['reserved_gib']:.2f} | {r['planned_gib']:.2f} | {r['error_pct']:+.1f} | {r['save_resume_export']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "out", "gpu_check"))
    ap.add_argument("--tiny", action="store_true", help="the tiny models (a plumbing check, minutes on CPU)")
    ap.add_argument("--cpu", action="store_true", help="allow a machine without CUDA (2 gloo ranks)")
    ap.add_argument("--flux_blocks", default="2,4", help="double,single FLUX blocks at real width (all: 19,38)")
    a = ap.parse_args()
    import torch

    import run_utils
    run_utils.quiet_known_warnings()
    if not torch.cuda.is_available() and not a.cpu:
        sys.exit("gpu_check: no CUDA GPU here (use --cpu --tiny for the plumbing check on CPU)")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 2
    device = torch.cuda.get_device_name(0) + f" x{gpus}" if torch.cuda.is_available() else "CPU (gloo)"
    os.makedirs(a.out, exist_ok=True)
    models = {"sd15": sd15_folder(a.out, a.tiny),
              "flux": flux_folder(a.out, a.tiny, tuple(int(x) for x in a.flux_blocks.split(",")))}
    rows = []
    for name, script, kind, world, s in plan_runs(gpus, a.tiny):
        prompts, pairs = datasets(a.out, s["resolution"])
        rows.append(one_run(name, script, models[kind], prompts if kind == "sd15" else pairs, world, s, a.out,
                            not torch.cuda.is_available()))
        print(table(rows[-1:], device).splitlines()[-1], flush=True)
    report = table(rows, device)
    with open(os.path.join(a.out, "gpu_check.md"), "w") as f:
        f.write(report + "\n")
    with open(os.path.join(a.out, "gpu_check.json"), "w") as f:
        json.dump({"device": device, "rows": rows}, f, indent=1)
    print("\n" + report)
    sys.exit(0 if all(r["save_resume_export"] == "pass" for r in rows) else 1)


if __name__ == "__main__":
    main()
