"""The GPU acceptance check: both scripts at real width on one bare GPU machine, inside one call of
at most 10 minutes (models built included), one table.

    bash tools/gpu_check.sh --out=$OUT             # on a machine with a CUDA GPU, no network needed
    python tools/gpu_check.py --tiny --cpu         # the same plumbing on the tiny models, on CPU

What it does, in order, each part under one deadline (--deadline_s): tests/test_gpu.py runs in the
background while the models are built (random weights: SD-1.5's UNet, VAE and CLIP at their real
configs; FLUX.1 Kontext's transformer at real width with --flux_blocks double + single blocks, its
real VAE, CLIP-L and a one-layer T5 of the real width). Then the plain-PyTorch reference: the same
transformer / UNet with the same tokens / latents, bf16 weights, forward + backward with no FSDP and
no optimizer (and, apart, the fused AdamW step over its fp32 parameters and the VAE encode of a
step's images). Then the training runs by value: Kontext 1024 px full fine-tune (with save -> resume
-> export -> load), DMD2 SD-1.5 512 px, Kontext LoRA 512 px, Kontext NF4 LoRA + adamw8bit, COMPILE=1
Kontext, DMD2 DDP bf16 (--suite=speed: the step-time rows, and a DMD2 generator + fake-score step under
torch.profiler, its table in profile_*.txt); a run that cannot finish before the deadline is cut and says so. Each run
keeps one checkpoint at a time and deletes its folder when read (a 1.3 B full checkpoint is 21 GB).

Every row shows its step time (the mean of the steps after the first two) as "x plain", its MFU
(model FLOPs: the trained networks' forward + backward, no VAE, no recomputation, against the peak
of the dtype used), its peak CUDA memory against the planner's. Output (at most 8 files):
gpu_check.md (the table), gpu_check.json, runs.log (every run's output, tracebacks included),
test_gpu.log, build.log, and with --suite=speed profile_dmd_sd15_*.txt.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

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


def _init_device():
    """Where random weights are drawn: the GPU when there is one (seconds instead of a minute)."""
    import torch
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


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
        with _init_device():
            for sub, cls in (("unet", UNet2DConditionModel), ("vae", AutoencoderKL)):
                config = cls.load_config(os.path.join(REAL, "sd15-dmd", sub))
                cls.from_config(config).save_pretrained(os.path.join(out, sub))
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
        with _init_device():
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
# the plain-PyTorch reference: the model alone, bf16 weights, no FSDP, no optimizer


def _timed(fn, device, warmup: int = 2, repeat: int = 5) -> float:
    """Median milliseconds of `fn()` (CUDA events on a GPU, wall clock on CPU)."""
    import torch
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def _model_flops(fn) -> dict:
    """{peak kind: FLOPs} of one forward `fn()` (components.metrics' counter)."""
    from components.metrics import _FlopCount
    counter = _FlopCount()
    with counter:
        fn()
    return dict(counter.by_kind)


def plain_reference(kind: str, folder: str, resolution: int, batch: int, text_len: int, device) -> dict:
    """Forward + backward of the bare model (ms, MFU), and apart the fused AdamW step over fp32
    copies of its parameters and the VAE encode of one step's images (Kontext: target + context)."""
    import torch
    from diffusers import AutoencoderKL

    from parallel import attention
    from components.metrics import peak_tflops
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    attention.sdpa_flags(attention.DEFAULT)
    g = torch.Generator(device=device).manual_seed(0)
    if kind == "flux":
        from diffusers import FluxTransformer2DModel
        model = FluxTransformer2DModel.from_pretrained(os.path.join(folder, "transformer"), torch_dtype=dtype)
        attention.set_backend(model, attention.DEFAULT)
        c, side = model.config, resolution // 16
        image = 2 * side * side  # target + context tokens
        ids = torch.zeros(image, 3, device=device)
        args = dict(hidden_states=torch.randn(batch, image, c.in_channels, device=device, dtype=dtype, generator=g),
                    encoder_hidden_states=torch.randn(batch, text_len, c.joint_attention_dim, device=device,
                                                      dtype=dtype, generator=g),
                    pooled_projections=torch.randn(batch, c.pooled_projection_dim, device=device, dtype=dtype,
                                                   generator=g),
                    timestep=torch.full((batch,), 0.5, device=device), guidance=torch.ones(batch, device=device),
                    txt_ids=torch.zeros(text_len, 3, device=device), img_ids=ids)
        images = 2 * batch
    else:
        from diffusers import UNet2DConditionModel
        model = UNet2DConditionModel.from_pretrained(os.path.join(folder, "unet"), torch_dtype=dtype)
        c, side = model.config, resolution // 8
        args = dict(sample=torch.randn(batch, c.in_channels, side, side, device=device, dtype=dtype, generator=g),
                    timestep=torch.full((batch,), 500, device=device),
                    encoder_hidden_states=torch.randn(batch, text_len, c.cross_attention_dim, device=device,
                                                      dtype=dtype, generator=g))
        images = batch
    model.to(device).train()

    def fwd_bwd():
        out = model(**args, return_dict=False)[0]
        out.float().square().mean().backward()
        model.zero_grad(set_to_none=False)

    out = {"fwd_bwd_ms": _timed(fwd_bwd, device)}
    flops = {k: 3 * n for k, n in _model_flops(lambda: model(**args, return_dict=False)).items()}
    peaks = peak_tflops(device)
    out["model_tflop"] = sum(flops.values()) / 1e12
    out["mfu"] = (sum(n / (peaks[k] * 1e12) for k, n in flops.items()) / (out["fwd_bwd_ms"] / 1000)
                  if peaks else float("nan"))
    master = [p.detach().float().requires_grad_() for p in model.parameters()]
    model = args = None  # free the bf16 model before the fp32 AdamW state
    for p in master:
        p.grad = torch.randn_like(p) * 1e-3
    opt = torch.optim.AdamW(master, lr=1e-5, fused=device.type == "cuda")
    out["adamw_ms"] = _timed(opt.step, device, warmup=1, repeat=3)
    master = opt = None
    vae = AutoencoderKL.from_pretrained(os.path.join(folder, "vae"), torch_dtype=dtype).to(device)
    pixels = torch.randn(images, 3, resolution, resolution, device=device, dtype=dtype, generator=g)
    with torch.no_grad():
        out["vae_ms"] = _timed(lambda: vae.encode(pixels).latent_dist.mode(), device, warmup=1, repeat=3)
    vae = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


# ----------------------------------------------------------------------------------------------
# one training run: steps, then (optionally) resume one step and load the export


class Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


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
            os.killpg(proc.pid, 9)
            proc.wait()
            f.write(f"===== killed: past the check's deadline ({timeout:.0f} s left for it)\n")
            return 124


def planned_bytes(model: str, world: int, s: dict, script: str = "") -> int:
    """The planner's GPU total for a row, with the scripts' RESHARD_AFTER_FORWARD=auto on this GPU."""
    import torch

    from tools import memory_plan
    extra = s.get("extra", {})
    gpu_gb = torch.cuda.get_device_properties(0).total_memory / memory_plan.GIB if torch.cuda.is_available() else 0
    settings = memory_plan.Settings(world_size=world, precision=s["precision"], batch_size=s["batch_size"],
                                    resolution=s["resolution"], activation_checkpointing=s.get("ac", False),
                                    lora_rank=s.get("lora_rank", 0), base_dtype=s.get("base_dtype", ""),
                                    optimizer=s.get("optimizer", "adamw"), script=script,
                                    fake_score_fp32=bool(int(extra.get("fake_score_fp32", 1))),
                                    reshard_after_forward=None, gpu_memory_gb=gpu_gb)
    return memory_plan.plan(model, settings)["gpu_total"]


def run_args(script: str, s: dict, model: str, data: str, out: str) -> list[str]:
    args = [f"--model_path={model}", f"--data_path={data}", f"--output_dir={out}", f"--precision={s['precision']}",
            f"--batch_size={s['batch_size']}", f"--resolution={s['resolution']}", "--log_every=1", "--save_every=0",
            "--keep_last=1", "--sample_every=0", f"--activation_checkpointing={int(s.get('ac', False))}"]
    args += [f"--{k}={v}" for k, v in s.get("extra", {}).items()]
    if s.get("lora_rank"):
        args.append(f"--lora_rank={s['lora_rank']}")
    if script == "train_flux_kontext.py":
        args += ["--val_every=0", "--export_dtype=bf16"]
    return args


def one_run(row: dict, models: dict, data: dict, out: str, log: str, deadline: Deadline, cpu: bool) -> dict:
    name, script, kind, world, s = row["run"], row["script"], row["kind"], row["world"], row["settings"]
    run_dir = os.path.join(out, name)
    shutil.rmtree(run_dir, ignore_errors=True)
    args = run_args(script, s, models[kind], data[(kind, s["resolution"])], run_dir)
    steps = row.get("steps", 6)
    result = {"run": name, "world": world, "status": "", "step_ms": float("nan"), "mfu": float("nan"),
              "hfu": float("nan"),
              "model_tflop": float("nan"), "allocated_gib": float("nan"), "reserved_gib": float("nan"),
              "planned_gib": float("nan"), "resume_export": "-"}
    rc = launch(script, args + [f"--max_steps={steps}"], world, log, deadline.left())
    records = []
    path = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(path):
        records = [json.loads(line) for line in open(path) if '"step_ms"' in line]
    later = records[2:] or records
    if later:  # the mean over whole DMD2 cycles (steps 3-12 at ratio 5: 2 generator + 8 fake-score steps)
        result["step_ms"] = statistics.mean(r["step_ms"] for r in later)
        for k_out, k_in in (("mfu", "mfu"), ("hfu", "hfu"), ("model_tflop", "model_tflop"),
                            ("allocated_gib", "cuda_peak_gib"),
                            ("reserved_gib", "cuda_reserved_gib")):
            if k_in in later[-1]:
                result[k_out] = later[-1][k_in]
    result["status"] = "pass" if rc == 0 else ("cut at the deadline" if rc == 124 else f"FAIL rc {rc} (runs.log)")
    if row.get("probe"):  # a kernel the start-up check should stop: say what happened, pass or stop
        said = [line for line in open(log).read().rsplit("=====", 1)[-1].splitlines() if "start-up check" in line]
        result["status"] = (f"stopped at start: {said[0].split(': ', 2)[-1][:160]}" if rc == 1 and said
                            else "trained: the kernel passed the check" if rc == 0 else result["status"])
        result["probe"] = said[:1]
    if not cpu:
        try:
            result["planned_gib"] = planned_bytes(models[kind], world, s, script) / GIB
        except Exception as e:  # noqa: BLE001 - a planner gap is a table cell, not the end of the check
            result["planned_gib"] = float("nan")
            result["status"] += f"; planner: {type(e).__name__}"
    if rc == 0 and row.get("resume"):
        rc2 = launch(script, args + [f"--max_steps={steps + 1}", "--resume=auto"], world, log, deadline.left())
        resumed = rc2 == 0 and "resumed from" in open(log).read().rsplit("=====", 2)[-1]
        result["resume_export"] = "pass" if resumed and export_loads(run_dir, kind, s) else \
            ("cut at the deadline" if rc2 == 124 else "FAIL (runs.log)")
    table_path = os.path.join(run_dir, "profile", "ops_rank0.txt")
    if os.path.exists(table_path):  # PROFILE_STEPS' table (the traces stay behind: too big to bring back)
        shutil.copy(table_path, os.path.join(out, f"profile_{name}.txt"))  # its step times include the profiler
    shutil.rmtree(run_dir, ignore_errors=True)  # a full checkpoint is tens of GB: one at a time
    return result


def export_loads(run_dir: str, kind: str, s: dict) -> bool:
    import diffusers
    export = os.path.join(run_dir, "export")
    if s.get("lora_rank"):
        return os.path.exists(os.path.join(export, "pytorch_lora_weights.safetensors"))
    sub = "transformer" if kind == "flux" else "unet"
    return diffusers.AutoModel.from_pretrained(os.path.join(export, sub)) is not None


# ----------------------------------------------------------------------------------------------


# DMD2 with a Kontext teacher as recipes/dmd_kontext_4step.sh runs it (three transformers of the FLUX folder)
KONTEXT_DMD = {"denoising_steps": "999,749,499,249", "fake_score_fp32": 0, "export_dtype": "bf16"}


def plan_runs(tiny: bool, suite: str = "acceptance") -> list[dict]:
    """The rows in order of value: what users hit first runs first. suite="speed": the step-time
    rows instead (Kontext 1024 px full fine-tune per attention kernel, AC, COMPILE and CACHE_LATENTS
    on and off; DMD2 SD-1.5 at the published batch 32 per GPU with AC, profiled, and with COMPILE)."""
    sd, lo, hi = (32, 32, 64) if tiny else (512, 512, 1024)
    base = {"precision": "bf16-mixed", "batch_size": 1}

    def row(name, script, kind, res, **s):
        extra, steps = s.pop("extra", {}), 6
        if script == "train_dmd.py":
            extra, steps = {"dfake_gen_update_ratio": 5, **extra}, 12
        profile = s.pop("profile", None)  # (first, last): PROFILE_STEPS, the run ends with the window
        if profile:
            extra, steps = {**extra, "profile_steps": f"[{profile[0]},{profile[1]}]"}, profile[1]
        probe = s.pop("probe", False)
        return {"run": name, "script": script, "kind": kind, "world": 1, "resume": s.pop("resume", False),
                "probe": probe, "steps": 2 if probe else steps,
                "settings": {**base, "resolution": res, **s, "extra": extra}}

    if suite == "speed":
        from parallel import attention
        kernels = [k for k in ("native", "_native_flash", "_native_efficient", "_flash_3", "flash")
                   if k in attention.installed()]
        return ([row(f"kontext_{hi}px_full_{k}", "train_flux_kontext.py", "flux", hi,
                     extra={"attention_backend": k}) for k in kernels]
                + [row(f"kontext_{hi}px_full_ac", "train_flux_kontext.py", "flux", hi, ac=True),
                   row(f"kontext_{hi}px_full_compile", "train_flux_kontext.py", "flux", hi, extra={"compile": 1}),
                   row(f"kontext_{hi}px_full_ac_compile", "train_flux_kontext.py", "flux", hi, ac=True,
                       extra={"compile": 1}),
                   row(f"kontext_{hi}px_full_cache_latents", "train_flux_kontext.py", "flux", hi,
                       extra={"cache_latents": 1}),
                   row(f"dmd_sd15_{sd}px_b32_ac", "train_dmd.py", "sd15", sd, batch_size=2 if tiny else 32, ac=True),
                   # a generator step (6: iteration 5 at ratio 5) and a fake-score step, profiled: profile_*.txt
                   row(f"dmd_sd15_{sd}px_b32_ac_profiled", "train_dmd.py", "sd15", sd, batch_size=2 if tiny else 32,
                       ac=True, profile=(6, 7)),
                   row(f"dmd_sd15_{sd}px_b32_ac_compile", "train_dmd.py", "sd15", sd, batch_size=2 if tiny else 32,
                       ac=True, extra={"compile": 1}),
                   row(f"dmd_kontext_{hi}px_4step_ac", "train_dmd.py", "flux", hi, ac=True, extra=KONTEXT_DMD)])
    return [
        row(f"kontext_{hi}px_full", "train_flux_kontext.py", "flux", hi, resume=True),
        row(f"dmd_sd15_{sd}px_b4", "train_dmd.py", "sd15", sd, batch_size=4),
        row(f"kontext_{lo}px_lora16", "train_flux_kontext.py", "flux", lo, lora_rank=16, resume=True,
            extra={"lora_alpha": 16}),
        row(f"kontext_{hi}px_cudnn_attention_probe", "train_flux_kontext.py", "flux", hi, probe=True,
            extra={"attention_backend": "_native_cudnn"}),
        row(f"kontext_{lo}px_nf4_lora16_adamw8bit", "train_flux_kontext.py", "flux", lo, lora_rank=16,
            base_dtype="nf4", optimizer="adamw8bit",
            extra={"lora_alpha": 16, "base_dtype": "nf4", "optimizer": "adamw8bit"}),
        row(f"kontext_{lo}px_full_compile", "train_flux_kontext.py", "flux", lo, extra={"compile": 1}),
        row(f"dmd_sd15_{sd}px_b4_ddp_bf16", "train_dmd.py", "sd15", sd, batch_size=4, precision="bf16",
            extra={"parallelism": "ddp"}),
        row(f"dmd_kontext_{lo}px_4step_ac", "train_dmd.py", "flux", lo, ac=True, resume=True, extra=KONTEXT_DMD),
    ]


def _fmt(v, spec: str) -> str:
    return "-" if v is None or v != v else format(v, spec)


def table(rows: list[dict], refs: dict, device: str, versions: str) -> str:
    lines = [f"GPU check on {device} ({versions})", "",
             "plain reference (bf16 weights, forward + backward, no FSDP, no optimizer; AdamW and VAE apart):", "",
             "| model | fwd+bwd ms | model TFLOP | MFU | fused AdamW ms | VAE encode ms |",
             "|---|---:|---:|---:|---:|---:|"]
    for key, r in refs.items():
        if "error" in r:
            lines.append(f"| {key} | {r['error']} | | | | |")
            continue
        lines.append(f"| {key} | {r['fwd_bwd_ms']:.1f} | {r['model_tflop']:.2f} | {_fmt(100 * r['mfu'], '.1f')} % | "
                     f"{r['adamw_ms']:.1f} | {r['vae_ms']:.1f} |")
    lines += ["", "| run | step ms | x plain fwd+bwd | x plain fwd+bwd+AdamW+VAE | MFU | HFU | model TFLOP/step | "
                  "peak alloc GiB | peak reserved GiB | planned GiB | error % | train | resume/export |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        ref = refs.get(r.get("ref", ""), {})
        plain = ref.get("fwd_bwd_ms")
        whole = plain + ref["adamw_ms"] + ref["vae_ms"] if plain and r.get("full") else None
        err = 100 * (r["reserved_gib"] - r["planned_gib"]) / r["planned_gib"] if r["planned_gib"] > 0 else None
        ratio, ratio_whole = (r["step_ms"] / plain if plain else None), (r["step_ms"] / whole if whole else None)
        lines.append(f"| {r['run']} | {_fmt(r['step_ms'], '.0f')} | {_fmt(ratio, '.2f')} | "
                     f"{_fmt(ratio_whole, '.2f')} | {_fmt(100 * r['mfu'], '.1f')} | {_fmt(100 * r['hfu'], '.1f')} | "
                     f"{_fmt(r['model_tflop'], '.2f')} | {_fmt(r['allocated_gib'], '.2f')} | "
                     f"{_fmt(r['reserved_gib'], '.2f')} | {_fmt(r['planned_gib'], '.2f')} | {_fmt(err, '+.1f')} | "
                     f"{r['status']} | {r['resume_export']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "out", "gpu_check"))
    ap.add_argument("--work", default="", help="where models and runs go; '' = --out/work (not copied back)")
    ap.add_argument("--tiny", action="store_true", help="the tiny models (a plumbing check, minutes on CPU)")
    ap.add_argument("--cpu", action="store_true", help="allow a machine without CUDA")
    ap.add_argument("--flux_blocks", default="2,4", help="double,single FLUX blocks at real width (all: 19,38)")
    ap.add_argument("--deadline_s", type=float, default=540, help="seconds for everything; runs past it are cut")
    ap.add_argument("--skip_tests", action="store_true", help="do not run tests/test_gpu.py")
    ap.add_argument("--runs", default="", help="comma-separated parts of run names to keep ('' = all)")
    ap.add_argument("--suite", default="acceptance", choices=("acceptance", "speed"),
                    help="acceptance: every script and mode once; speed: step-time rows (kernels, AC, compile)")
    a = ap.parse_args()
    deadline = Deadline(a.deadline_s)
    import torch

    from components.warnings import quiet_known_warnings
    quiet_known_warnings()
    if not torch.cuda.is_available() and not a.cpu:
        sys.exit("gpu_check: no CUDA GPU here (use --cpu --tiny for the plumbing check on CPU)")
    os.makedirs(a.out, exist_ok=True)
    work = a.work or os.path.join(a.out, "work")
    os.makedirs(work, exist_ok=True)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda") if cuda else torch.device("cpu")
    name = torch.cuda.get_device_name(0) if cuda else "CPU"
    import diffusers
    versions = (f"torch {torch.__version__}" + (f", CUDA {torch.version.cuda}" if cuda else "")
                + f", diffusers {diffusers.__version__}")
    tests = None
    if not a.skip_tests:  # while the models are built: it uses the GPU little, the build mostly the CPU
        cmd = [sys.executable, "-m", "pytest", "tests/test_gpu.py", "-q", "-p", "no:cacheprovider"]
        tests = subprocess.Popen(cmd, cwd=ROOT, stdout=open(os.path.join(a.out, "test_gpu.log"), "w"),
                                 stderr=subprocess.STDOUT)
    t = time.monotonic()
    blocks = tuple(int(x) for x in a.flux_blocks.split(","))
    with open(os.path.join(a.out, "build.log"), "w") as log:
        models = {"sd15": sd15_folder(work, a.tiny), "flux": flux_folder(work, a.tiny, blocks)}
        runs = [r for r in plan_runs(a.tiny, a.suite) if not a.runs or any(k in r["run"] for k in a.runs.split(","))]
        data = {}
        for r in runs:
            prompts, pairs = datasets(work, r["settings"]["resolution"])
            data[(r["kind"], r["settings"]["resolution"])] = prompts if r["kind"] == "sd15" else pairs
        log.write(f"models and data built in {time.monotonic() - t:.0f} s\n")
    print(f"models and data built in {time.monotonic() - t:.0f} s", flush=True)

    # the plain reference, for each model and size the runs use; T5 / CLIP lengths as the runs get them
    from transformers import AutoTokenizer
    t5_len = min(512, AutoTokenizer.from_pretrained(os.path.join(models["flux"], "tokenizer_2")).model_max_length)
    clip_len = AutoTokenizer.from_pretrained(os.path.join(models["sd15"], "tokenizer")).model_max_length
    refs = {}
    for r in runs:
        key = f"{r['kind']} {r['settings']['resolution']} px, batch {r['settings']['batch_size']}"
        r["ref"], r["full"] = key, not r["settings"].get("lora_rank") and r["script"] == "train_flux_kontext.py"
        if key in refs or deadline.left() < 200:
            continue
        try:
            refs[key] = plain_reference(r["kind"], models[r["kind"]], r["settings"]["resolution"],
                                        r["settings"]["batch_size"], t5_len if r["kind"] == "flux" else clip_len,
                                        device)
        except Exception as e:  # noqa: BLE001 - the row says what failed; the runs still go on
            refs[key] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        print(f"plain {key}: {refs[key]}", flush=True)

    if tests is not None:  # the training runs' step times need the GPU to themselves
        try:
            tests.wait(timeout=max(deadline.left() - 360, 1))
        except subprocess.TimeoutExpired:
            tests.kill()
            tests.wait()
        last = open(os.path.join(a.out, "test_gpu.log")).read().strip().splitlines()[-1:]
        print(f"tests/test_gpu.py: rc {tests.returncode}: {last}", flush=True)

    rows, log = [], os.path.join(a.out, "runs.log")
    open(log, "w").close()
    for r in runs:
        if deadline.left() < 30:
            rows.append({**{k: float("nan") for k in ("step_ms", "mfu", "hfu", "model_tflop", "allocated_gib",
                                                      "reserved_gib",
                                                      "planned_gib")}, "run": r["run"], "world": r["world"],
                         "status": "not run (deadline)", "resume_export": "-", "ref": r["ref"], "full": r["full"]})
            continue
        result = one_run(r, models, data, a.out, log, deadline, not cuda)
        rows.append({**result, "ref": r["ref"], "full": r["full"]})
        print(f"{r['run']}: {result}", flush=True)
    report = table(rows, refs, name, versions)
    with open(os.path.join(a.out, "gpu_check.md"), "w") as f:
        f.write(report + "\n")
    with open(os.path.join(a.out, "gpu_check.json"), "w") as f:
        json.dump({"device": name, "versions": versions, "refs": refs, "rows": rows}, f, indent=1)
    print("\n" + report, flush=True)
    if not a.work:
        shutil.rmtree(work, ignore_errors=True)
    sys.exit(0 if all(r["status"] == "pass" and r["resume_export"] in ("pass", "-") for r in rows) else 1)


if __name__ == "__main__":
    main()
