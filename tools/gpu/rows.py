"""The rows of each suite, in order of value, with their expected seconds on an H100, and --runs' pick: the
suites across families here, a family's own suite in its GpuCheck.suite (families/<name>/gpu.py).
"""
from __future__ import annotations

from families import SPECS
from families.qwen_image import gpu as qwen  # the Qwen-Image-Edit rows of the suites across families


# before the first row on an H100: wheels, imports, the build (~17 s), sizing, the planner's start
STARTUP_EXPECT_S = 45
REF_EXPECT_S = 15  # one plain reference on an H100: load, 7 timed forward + backward, AdamW, VAE encode
COMPILE_DMD_EXPECT_S = 300  # DMD2 SD-1.5 under COMPILE=1: ~27 graphs (docs/gpu.md) with AC, then 5 timed steps

# DMD2 with a Kontext teacher as recipes/dmd_kontext_4step.sh runs it (three transformers of the FLUX folder)
KONTEXT_DMD = {"denoising_steps": "999,749,499,249", "fake_score_fp32": 0}
# --suite's choices: the checks across families, and a family's own rows named by the family (its GpuCheck.suite)
SUITES = ("acceptance", "speed", *(s.name for s in SPECS if s.gpu is not None and s.gpu.suite), "fp8", "fp8_qwen")
RENAMED = {"qwen": "qwen_image"}  # a suite renamed: refused in one line naming its name


def plan_runs(tiny: bool, suite: str = "acceptance") -> list[dict]:
    """The rows in order of value: what users hit first runs first. Each row's expect_s: its seconds
    on one H100 with its 64 GB disk (launches, steps, checkpoint writes and reads, export, the load
    check), as docs/gpu.md lists them. suite="speed": the step-time rows instead (Kontext 1024 px full
    fine-tune per attention kernel, AC, COMPILE and CACHE_LATENTS on and off; DMD2 SD-1.5 at the
    published batch 32 per GPU with AC, profiled, and with COMPILE; DMD2 under DDP in bf16)."""
    sd, lo, hi = (32, 32, 64) if tiny else (512, 512, 1024)
    base = {"precision": "bf16-mixed", "batch_size": 1}

    def row(name, script, family, res, expect_s, warmup=2, **s):
        extra, steps = s.pop("extra", {}), s.pop("steps", 6)
        if script == "train_dmd.py":  # two whole cycles timed after the warm-up (COMPILE: one)
            extra, steps = {"dfake_gen_update_ratio": 5, **extra}, warmup + (5 if extra.get("compile") else 10)
        profile = s.pop("profile", None)  # (first, last): PROFILE_STEPS, the run ends with the window
        if profile:
            extra, steps = {**extra, "profile_steps": f"[{profile[0]},{profile[1]}]"}, profile[1]
        probe, ref = s.pop("probe", False), s.pop("ref", False)  # ref: beside the plain reference (a suite's row)
        export_dtype = s.pop("export_dtype", "bf16" if script == "train_flux_kontext.py" else "fp32")
        return {"run": name, "script": script, "family": family, "world": 1, "resume": s.pop("resume", False),
                "probe": probe, "gpu_only": probe, "steps": 2 if probe else steps, "warmup": warmup,
                "expect_s": expect_s,
                # the x-plain columns: the Kontext rows (their plain model is the trained transformer)
                "ref": ref or script == "train_flux_kontext.py" or suite in ("speed", "flux2", "fp8", "fp8_qwen"),
                "settings": {**base, "resolution": res, "export_dtype": export_dtype, **s, "extra": extra}}

    kontext, dmd = "train_flux_kontext.py", "train_dmd.py"
    def qwen_dmd():  # the Qwen DMD2 rows' settings (qwen_areas reads the pipeline's constants: only when asked)
        return {**qwen.DMD, **qwen_areas(tiny, lo)}  # references at the target's size, as planned

    own = next((s.gpu.suite for s in SPECS if s.name == suite and s.gpu is not None and s.gpu.suite), None)
    if own is not None:  # a family's own rows: a call of their own
        return own(row, tiny)
    if suite in ("fp8", "fp8_qwen"):  # FP8 against bf16, eager and compiled, FP8_STEPS steps each from one seed
        # (the losses side by side): Kontext's 1024 px full fine-tune with CACHE_LATENTS (the transformer's step:
        # FP8 does not touch the VAE), or Qwen-Image-Edit's 1024 px LoRA with two references (a call of its own)
        if suite == "fp8":
            name, family, s = f"kontext_{hi}px_full_cached", "flux", {"extra": {"cache_latents": 1}}
            expect = (50, 55, 85, 95)  # eager bf16 / fp8, compiled bf16 / fp8 (guesses until a GPU has run them)
        else:
            name, family = f"qwen_edit_{hi}px_lora16_2refs", "qwen_image"
            s = {"lora_rank": 16, "extra": {"lora_alpha": 16, **qwen_areas(tiny, hi, pipeline=True)}}
            expect = (45, 50, 80, 90)
        rows = []
        for compiled in (False, True):
            for recipe in ("", "tensorwise", "rowwise"):
                extra = {**s["extra"], **({"compile": 1} if compiled else {}), **({"fp8": recipe} if recipe else {})}
                rows.append(row(name + ("_compile" if compiled else "") + (f"_fp8_{recipe}" if recipe else ""),
                                kontext, family, hi, expect[2 * compiled + bool(recipe)], steps=FP8_STEPS,
                                **{**s, "extra": extra}))
        return rows
    if suite == "speed":
        from parallel import attention
        kernels = [k for k in ("native", "_native_flash", "_native_efficient", "_flash_3", "flash")
                   if k in attention.installed()]
        b32 = 2 if tiny else 32
        return ([row(f"kontext_{hi}px_full_{k}", kontext, "flux", hi, 45, extra={"attention_backend": k})
                 for k in kernels]
                + [row(f"kontext_{hi}px_full_ac", kontext, "flux", hi, 45, ac=True),
                   row(f"kontext_{hi}px_full_compile", kontext, "flux", hi, 80, extra={"compile": 1}),
                   row(f"kontext_{hi}px_full_ac_compile", kontext, "flux", hi, 80, ac=True, extra={"compile": 1}),
                   row(f"kontext_{hi}px_full_cache_latents", kontext, "flux", hi, 50, extra={"cache_latents": 1}),
                   # the default: the fake score in the compute dtype (FAKE_SCORE_FP32=0)
                   row(f"dmd_sd15_{sd}px_b32_ac", dmd, "sd_unet", sd, 105, batch_size=b32, ac=True),
                   row(f"dmd_sd15_{sd}px_b32_ac_fp32_attention", dmd, "sd_unet", sd, 120, batch_size=b32, ac=True,
                       extra={"fake_score_fp32": 1, "fake_score_attention_dtype": "fp32"}),  # the published pass
                   # the fp32 fake score with its attention in bf16 (FAKE_SCORE_ATTENTION_DTYPE's default)
                   row(f"dmd_sd15_{sd}px_b32_ac_fp32_fake", dmd, "sd_unet", sd, 110, batch_size=b32, ac=True,
                       extra={"fake_score_fp32": 1}),
                   row(f"dmd_sd15_{sd}px_b32_ac_channels_last", dmd, "sd_unet", sd, 110, batch_size=b32, ac=True,
                       extra={"channels_last": 1}),
                   # a generator step (6: iteration 5 at ratio 5) and a fake-score step, profiled: profile_*.txt
                   row(f"dmd_sd15_{sd}px_b32_ac_profiled", dmd, "sd_unet", sd, 70, batch_size=b32, ac=True,
                       profile=(6, 7)),
                   # COMPILE: the first 2 steps (a generator and a fake-score step) compile every graph and are
                   # not timed; their seconds and the compile report's are columns apart. One call each:
                   # --runs=dmd_sd15_512px_b32_ac_compile (the expectation is a guess until a GPU has run it)
                   row(f"dmd_sd15_{sd}px_b32_ac_compile", dmd, "sd_unet", sd, COMPILE_DMD_EXPECT_S, batch_size=b32,
                       ac=True, extra={"compile": 1}),
                   row(f"dmd_sd15_{sd}px_b32_ac_compile_channels_last", dmd, "sd_unet", sd, COMPILE_DMD_EXPECT_S,
                       batch_size=b32, ac=True, extra={"compile": 1, "channels_last": 1}),
                   row(f"dmd_sd15_{sd}px_b4_ddp_bf16", dmd, "sd_unet", sd, 60, batch_size=4, precision="bf16",
                       extra={"parallelism": "ddp"}),
                   row(f"dmd_kontext_{hi}px_4step_ac", dmd, "flux", hi, 70, ac=True, export_dtype="bf16",
                       extra=KONTEXT_DMD),
                   # the Qwen-Image-Edit DMD2 row's generator step and the fake-score step after it, profiled
                   row(f"dmd_qwen_edit_{lo}px_4step_lora64_ac_profiled", dmd, "qwen_image", lo, 70, ac=True,
                       lora_rank=64, profile=(6, 7), extra=qwen_dmd())])
    return [
        row(f"kontext_{hi}px_full", kontext, "flux", hi, 85, resume=True),
        row(f"dmd_sd15_{sd}px_b4", dmd, "sd_unet", sd, 65, batch_size=4),
        row(f"kontext_{lo}px_lora16", kontext, "flux", lo, 50, lora_rank=16, resume=True, extra={"lora_alpha": 16}),
        # LoRA: the kernel's forward + backward at FLUX's 1024 px shapes without a full checkpoint to write
        row(f"kontext_{hi}px_lora16_cudnn_attention_probe", kontext, "flux", hi, 30, probe=True, lora_rank=16,
            extra={"lora_alpha": 16, "attention_backend": "_native_cudnn"}),
        row(f"kontext_{lo}px_nf4_lora16_adamw8bit", kontext, "flux", lo, 50, lora_rank=16, base_dtype="nf4",
            optimizer="adamw8bit", extra={"lora_alpha": 16, "base_dtype": "nf4", "optimizer": "adamw8bit"}),
        row(f"dmd_kontext_{lo}px_4step_ac", dmd, "flux", lo, 100, ac=True, resume=True, export_dtype="bf16",
            extra=KONTEXT_DMD),
        row(f"kontext_{lo}px_lora16_compile", kontext, "flux", lo, 55, lora_rank=16,
            extra={"lora_alpha": 16, "compile": 1}),
    ]


FP8_STEPS = 12  # the FP8 rows' steps: 2 of warm-up, 10 timed, and all 12 losses beside bf16's


def select_runs(rows: list[dict], spec: str) -> list[dict]:
    """--runs: each comma-separated key keeps the row of that exact name, or where no row has it,
    every row whose name contains it ("" = all), e.g. dmd_sd15_512px_b32_ac is that one row while
    b32_ac keeps every DMD2 batch-32 row."""
    names = {r["run"] for r in rows}
    keys = [k for k in spec.split(",") if k]
    return [r for r in rows if not keys or any(k == r["run"] or (k not in names and k in r["run"]) for k in keys)]


qwen_areas = qwen.areas  # the cross-family rows' Qwen-Image-Edit areas (fp8_qwen, speed)
