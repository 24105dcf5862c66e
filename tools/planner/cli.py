"""The command line: python tools/memory_plan.py --help."""
from __future__ import annotations

import argparse


import fsdp_utils
from core.errors import ConfigError
from components.warnings import quiet_known_warnings
from parallel import lora as lora_lib
from parallel import lowbit
from families import SPECS, pipelines  # the family specs; what each pipeline holds, in which role
import tools.planner
from tools.planner.activations import check_context_parallel
from tools.planner.build import GIB, Settings, model_folder, with_script
from tools.planner.fit import (cheapest_fit, check_lora_targets, cp_table, fit_table, flux2_table, format_plan,
                                lowbit_tables)
from tools.planner.plan import peak_bytes, plan

def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python tools/memory_plan.py", description=tools.planner.__doc__.split("\n")[0])
    ap.add_argument("--model", help="a built-in configuration or a diffusers folder (required but for --flux2_table)")
    ap.add_argument("--world_size", type=int, default=None, help="required, except with --fit_table")
    ap.add_argument("--gpu_memory_gb", type=float, default=0.0)
    ap.add_argument("--batch_size", type=int, default=1)
    ap.add_argument("--resolution", type=int, default=None,
                    help="image side in px (default: the model's native one: 512 SD-1.5 and FLUX, 1024 SDXL)")
    ap.add_argument("--num_frames", type=int, default=None,
                    help="video: frames per sample, as train_dmd.py's NUM_FRAMES (default: the family's, Wan: 81)")
    ap.add_argument("--precision", default="bf16-mixed", choices=["fp32", "bf16-mixed", "bf16"])
    ap.add_argument("--cpu_offload", type=int, default=0)
    ap.add_argument("--activation_checkpointing", type=int, default=0)
    ap.add_argument("--reshard_after_forward", default="auto",
                    help="auto (the scripts' default: 0 for a model alone in its shard group whose compute copy "
                         "fits 10%% of --gpu_memory_gb, else 1) | 1 | 0")
    ap.add_argument("--dp_replicate", type=int, default=1)
    ap.add_argument("--block_classes", default="",
                    help="comma-separated FSDP unit classes, as the scripts' BLOCK_CLASSES (default: the recipe's)")
    ap.add_argument("--fit_table", action="store_true",
                    help="print a markdown table of the cheapest fitting settings, --world_sizes x --gpu_memory_gbs")
    ap.add_argument("--world_sizes", default=None, help="with --fit_table (default 2,4,8) or --cp_table (default 8)")
    ap.add_argument("--gpu_memory_gbs", default=None,
                    help="with --fit_table (default 24,40,80) or --cp_table (default 24,80)")
    ap.add_argument("--context_parallel", type=int, default=1,
                    help="FLUX Kontext: ranks that split each sample's sequence, as train_flux_kontext.py's "
                         "CONTEXT_PARALLEL (1 = off); activations per rank: about one forward's / C")
    ap.add_argument("--cp_table", action="store_true",
                    help="FLUX Kontext: markdown table of the smallest context parallelism that fits, "
                         "--resolutions x --gpu_memory_gbs, per --world_sizes")
    ap.add_argument("--context_parallels", default="1,2,4,8", help="with --cp_table: the CP sizes to try")
    ap.add_argument("--resolutions", default="1024,2048", help="with --cp_table")
    ap.add_argument("--lora_rank", type=int, default=0,
                    help="plan LoRA fine-tuning with adapters of this rank, as the scripts' LORA_RANK "
                         "(0: full fine-tuning)")
    ap.add_argument("--lora_alpha", type=float, default=0.0, help="the scripts' LORA_ALPHA (0: the rank)")
    ap.add_argument("--lora_target_modules", default="",
                    help="comma-separated module-name suffixes to adapt, as the scripts' LORA_TARGET_MODULES "
                         "(default: the model's, families/<name>/parallelism.py)")
    ap.add_argument("--fake_lora", type=int, default=0,
                    help="DMD with --lora_rank: the fake score trains LoRA adapters too (train_dmd.py's FAKE_LORA)")
    ap.add_argument("--fake_score_fp32", type=int, default=0,
                    help="DMD: the fake score gathers and computes in fp32, as published "
                         "(train_dmd.py's FAKE_SCORE_FP32, default off)")
    ap.add_argument("--base_dtype", default="", choices=list(lowbit.BASE_DTYPES),
                    help="LoRA: the frozen base's storage, as the scripts' BASE_DTYPE (nf4: 4-bit, parallel/lowbit.py)")
    ap.add_argument("--optimizer", default="adamw", choices=list(lowbit.OPTIMIZERS),
                    help="the scripts' OPTIMIZER: adamw (fp32/bf16 states) | adamw8bit | adamw4bit (torchao)")
    ap.add_argument("--fp8", default="", choices=["", "tensorwise", "rowwise"],
                    help="the scripts' FP8: the blocks' Linears in float8 (tensorwise: a full model's weights "
                         "gathered in float8, half the bytes of bf16)")
    ap.add_argument("--ema", type=int, default=0,
                    help="count an EMA of the trained model, as the scripts' EMA_DECAY > 0 (LoRA: of its adapters)")
    ap.add_argument("--script", default="", choices=["", *pipelines.SCRIPTS],
                    help="the training script to plan for (default: the folder's layout's, or the built-in name's); "
                         "train_dmd.py on a FLUX Kontext folder: DMD2 with three FLUX transformers")
    ap.add_argument("--lowbit_table", action="store_true",
                    help="FLUX Kontext: markdown tables of BASE_DTYPE x OPTIMIZER on 1/2/4 x 24 GB at 512 and "
                         "1024 px, and BF16/NF4-base LoRA under DDP and FSDP2 with their largest batch")
    ap.add_argument("--references", type=int, default=None,
                    help=f"FLUX.2: reference images per sample (default "
                         f"{next(s.references for s in SPECS if s.reference_area)}), each planned at "
                         "--reference_area")
    ap.add_argument("--reference_area", type=int, default=0,
                    help="FLUX.2: the scripts' REFERENCE_AREA, pixels of each reference (0: the pipeline's 1024^2)")
    ap.add_argument("--text_encoder_dtype", default="", choices=["", "nf4"],
                    help="the text-cache fill's encoders: the compute dtype, or their Linears in NF4")
    ap.add_argument("--flux2_table", action="store_true",
                    help="FLUX.2: markdown table of the fewest GPUs that fit each run of docs/planner.md (FLUX2_ROWS)")
    a = ap.parse_args(argv)
    # what importing transformers/diffusers prints with torchao installed (its CUDA-only kernel libraries,
    # torch's pytree notice), as the scripts silence it: before the first model is built
    quiet_known_warnings()
    if a.flux2_table:
        print(flux2_table())
        return 0
    if not a.model:
        ap.error("--model is required")
    if a.lowbit_table:
        print(lowbit_tables(a.model))
        return 0
    if a.base_dtype == "nf4" and not a.lora_rank:
        ap.error("--base_dtype=nf4 needs --lora_rank > 0 (only a frozen LoRA base is quantised)")
    lora = dict(lora_rank=a.lora_rank, lora_alpha=a.lora_alpha, fake_lora=bool(a.fake_lora),
                fake_score_fp32=bool(a.fake_score_fp32), base_dtype=a.base_dtype, optimizer=a.optimizer,
                ema=bool(a.ema), script=a.script, fp8=a.fp8, references=a.references,
                reference_area=a.reference_area, text_encoder_dtype=a.text_encoder_dtype, frames=a.num_frames,
                lora_targets=tuple(t.strip() for t in a.lora_target_modules.split(",") if t.strip()))
    try:
        lora_lib.check_lora(Settings(1, **lora).lora)
    except ConfigError as e:
        ap.error(str(e))
    if not a.lora_rank and (a.fake_lora or lora["lora_targets"] or a.lora_alpha):
        ap.error("--lora_alpha, --lora_target_modules and --fake_lora need --lora_rank > 0")
    if a.fit_table and a.cp_table:
        ap.error("--fit_table and --cp_table: one table at a time")
    if a.cp_table and a.context_parallel != 1:
        ap.error("--cp_table tries every --context_parallels size; --context_parallel is for a plan or --fit_table")
    table = a.fit_table or a.cp_table
    world_sizes = [int(w) for w in (a.world_sizes or ("8" if a.cp_table else "2,4,8")).split(",")]
    gbs = [float(g) for g in (a.gpu_memory_gbs or ("24,80" if a.cp_table else "24,40,80")).split(",")]
    if a.world_size is None and not table:
        ap.error("--world_size is required (or --fit_table / --cp_table)")
    # context parallelism's checks, one line each, before any work (no model is built for them)
    for ws in ([] if a.cp_table else world_sizes if a.fit_table else [a.world_size]):
        check_context_parallel(model_folder(a.model), with_script(a.model, Settings(
            ws, dp_replicate=a.dp_replicate, resolution=a.resolution, context_parallel=a.context_parallel,
            script=a.script, frames=a.num_frames)))
    from diffusers.utils import logging as dlogging
    dlogging.set_verbosity_error()
    if a.lora_rank:  # unknown targets fail here, on one meta model, as in the scripts, before any planning
        check_lora_targets(a.model, Settings(1, **lora).lora, a.script)
    if a.cp_table:
        print(cp_table(a.model, [int(r) for r in a.resolutions.split(",")], gbs, world_sizes,
                       [int(c) for c in a.context_parallels.split(",")], a.batch_size, a.precision, **lora))
        return 0
    if a.fit_table:
        cp = {"context_parallel": a.context_parallel} if a.context_parallel != 1 else {}
        print(fit_table(a.model, world_sizes, gbs, a.batch_size, a.resolution, a.precision, **lora, **cp))
        return 0
    s = Settings(a.world_size, a.precision, bool(a.cpu_offload), bool(a.activation_checkpointing),
                 fsdp_utils.parse_reshard(a.reshard_after_forward), a.dp_replicate, a.batch_size, a.resolution,
                 tuple(c for c in a.block_classes.split(",") if c), **lora, context_parallel=a.context_parallel,
                 gpu_memory_gb=a.gpu_memory_gb)
    result = plan(a.model, s)
    print(format_plan(a.model, result))
    if a.gpu_memory_gb > 0:
        budget = int(a.gpu_memory_gb * GIB)
        if peak_bytes(result) <= budget:
            print(f"fits in {a.gpu_memory_gb:g} GB per GPU" + (" (training and the text-cache fill)"
                                                               if "fill" in result else ""))
            return 0
        fit = cheapest_fit(a.model, s, budget)
        if fit is None:
            print(f"does NOT fit in {a.gpu_memory_gb:g} GB per GPU with any of activation checkpointing, "
                  f"bf16 states, CPU offload" + (", an NF4 text encoder for the text-cache fill" if "fill" in result
                                                 else "") + ": add GPUs or lower batch/resolution")
            return 1
        t, r = fit
        print(f"does NOT fit in {a.gpu_memory_gb:g} GB; cheapest settings that fit: "
              f"--precision={t.precision} --activation_checkpointing={int(t.activation_checkpointing)} "
              f"--cpu_offload={int(t.cpu_offload)}"
              + (f" --context_parallel={t.context_parallel}" if t.context_parallel > 1 else "")
              + (f" --text_encoder_dtype={t.text_encoder_dtype} (the scripts take no NF4 text encoder yet)"
                 if t.text_encoder_dtype else "")
              + f" ({peak_bytes(r) / GIB:.2f} GiB)")
    return 0
