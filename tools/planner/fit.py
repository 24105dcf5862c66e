"""The cheapest settings that fit, the plan's report, and the tables of docs/planner.md."""
from __future__ import annotations

import dataclasses
import math
import os
import re


from core.errors import ConfigError
from parallel import lora as lora_lib
from parallel import lowbit
from precision import dtype_name, get_precision
from tools.planner.activations import ATTENTION_NOTE, _no_cp, check_context_parallel
from tools.planner.build import (GIB, HOLDING, Settings, layout, meta_model, model_folder, pipeline_components,
                                  pipeline_of, with_script)
from tools.planner.plan import peak_bytes, plan

# what cheapest_fit tries, in order of what it costs in speed: (checkpointing, CPU offload, bf16 states)
FIT_ORDER = [(False, False, False), (True, False, False), (False, False, True), (True, False, True),
             (False, True, False), (True, True, False), (True, True, True)]


def cheapest_fit(name: str, s: Settings, gpu_bytes: int, planner=None, cpu_offload: bool = True,
                 nf4_text_encoder: bool = True) -> tuple[Settings, dict] | None:
    """Settings that fit, in order of what they cost in speed: nothing, checkpointing, bf16
    states, CPU offload (slowest; not tried without `cpu_offload`), and their combinations; both
    phases must fit: training, and the text-cache fill before it, whose encoders go NF4
    (text_encoder_dtype; not without `nf4_text_encoder`) where they do not fit as they are (none of
    the training settings changes the fill). `planner`: plan, or a cached one."""
    planner = planner or plan
    for ac, off, bf16 in FIT_ORDER:
        if (bf16 and s.lora_rank > 0) or (off and not cpu_offload):  # LoRA: the base is in the compute dtype
            continue
        trial = Settings(**{**s.__dict__, "activation_checkpointing": ac, "cpu_offload": off,
                            "precision": "bf16" if bf16 else s.precision,
                            "gpu_memory_gb": gpu_bytes / GIB})  # what auto resharding decides on
        result = planner(name, trial)
        if result["gpu_total"] > gpu_bytes:
            continue
        if peak_bytes(result) <= gpu_bytes:
            return trial, result
        if s.text_encoder_dtype != "nf4" and nf4_text_encoder:
            trial = dataclasses.replace(trial, text_encoder_dtype="nf4")
            result = planner(name, trial)
            if peak_bytes(result) <= gpu_bytes:
                return trial, result
        return None
    return None


def fewest_gpus(name: str, s: Settings, gpu_bytes: int, world_sizes=(1, 2, 4, 8), planner=None,
                **fit) -> tuple[Settings, dict] | None:
    """The smallest of `world_sizes` with settings that fit (cheapest_fit, `fit` its options), and
    those settings and their plan; None if none does."""
    for ws in world_sizes:
        found = cheapest_fit(name, dataclasses.replace(s, world_size=ws), gpu_bytes, planner, **fit)
        if found is not None:
            return found
    return None


def format_plan(name: str, p: dict) -> str:
    s = p["settings"]
    head = (f"plan: {name} ({p['kind']}), world size {s.world_size} (dp_replicate {s.dp_replicate}), "
            f"{s.precision}, batch {s.batch_size}/{'CP group' if 'cp' in p else 'rank'} at {s.resolution}px"
            + (f" x {s.frames} frames" if s.frames else "") + ", "
            f"activation_checkpointing={int(s.activation_checkpointing)}, cpu_offload={int(s.cpu_offload)}, "
            f"reshard_after_forward={int(not p['reshard_free'])}"
            + (f" (auto{': ' + ', '.join(p['reshard_free']) if p['reshard_free'] else ''})"
               if s.reshard_after_forward is None else ""))
    if s.lora:
        head += f", LoRA rank {s.lora_rank} (alpha {s.lora_alpha or s.lora_rank:g}) on {', '.join(p['lora'])}"
    lines = [head] + _reference_lines(p) + _cp_lines(p)
    lines.append(f"{'component':<16}{'params':>10}{'on rank':>10}"
                 f"{'param GiB':>11}{'grad GiB':>10}{'optim GiB':>11}  role")
    for n, r in p["rows"].items():
        count, local = (_count(r.get(k, 0), r.get("adapters", False)) for k in ("count", "local_count"))
        lines.append(f"{n:<16}{count:>10}{local:>10}{r['params'] / GIB:>11.2f}{r['grads'] / GIB:>10.2f}"
                     f"{r['optim'] / GIB:>11.2f}  {r['note']}")
    where = "host (CPU offload)" if s.cpu_offload else "GPU"
    acts = f"activations (measured on meta): {p['activations'] / GIB:.2f} GiB"
    if "cp" in p:
        cp = p["cp"]
        acts = (f"activations (measured on meta over the full sequence; per rank its 1/{s.context_parallel}, "
                f"{cp['whole'] / 2**20:.1f} MiB without a sequence dimension held whole, {cp['buffers'] / 2**20:.1f} "
                f"MiB of all-to-all and output buffers): {p['activations'] / GIB:.2f} GiB "
                f"({cp['one_forward'] / GIB:.2f} GiB for one forward without CP)")
    if s.lora:
        lines += _lora_lines(p)
        acts += (" (LoRA: as autograd keeps them on a frozen base: adapted Linears' inputs and rank-r "
                 "intermediates, what the input grads need elsewhere; no frozen weight's grad inputs)")
    lines += [f"model states on: {where}" + (f", {p['host_total'] / GIB:.2f} GiB per rank" if s.cpu_offload else ""),
              f"all-gathered units in flight{' at the activations peak' if p.get('at_peak') else ''}: "
              f"{p['gathered'] / GIB:.2f} GiB "
              f"(largest unit {p['largest_unit'] / GIB:.2f} GiB)",
              acts,
              ATTENTION_NOTE,
              f"runtime reserve: {p['runtime'] / GIB:.2f} GiB",
              *([f"host peak while loading the NF4 base (meta path, per rank): {p['load_peak'] / GIB:.2f} GiB "
                 "(its NF4 shards + one whole tensor read, cast and quantised)"] if "load_peak" in p else []),
              f"TOTAL per GPU: {p['gpu_total'] / GIB:.2f} GiB"]
    return "\n".join(lines + _fill_lines(p))


def _reference_lines(p: dict) -> list[str]:
    """format_plan's words on the sequence of a family that plans its references by area (FLUX.2's; none for
    the others)."""
    if "references" not in p:
        return []
    s, refs = p["settings"], p["references"]
    area, patch = p["reference_area"], p["patch"]
    side = math.isqrt(area)
    return [f"sequence per sample: {(s.resolution // patch) ** 2} target tokens ({s.resolution}^2 / {patch}^2) + "
            f"{len(refs)} reference(s) x {refs[0][0] * refs[0][1] if refs else 0} tokens (each downsized to "
            f"{f'{side}^2' if side * side == area else area} px if larger) + {p['text']} text tokens"
            + (f" + {p['sequence_extras']}" if p.get("sequence_extras") else "")]


def _fill_lines(p: dict) -> list[str]:
    """format_plan's words on the text-cache fill (none without offline components)."""
    f = p.get("fill")
    if not f:
        return []
    s = p["settings"]
    where = f"sharded over {s.world_size} ranks" if f["sharded"] else "whole on the one rank"
    return [f"text-cache fill, before training ({', '.join(f'{n} {c / 1e9:.2f}B' for n, c in f['components'].items())}"
            f" in {f['dtype']}, {where}, freed before the trained model is built): params {f['params'] / GIB:.2f} + "
            f"units in flight {f['gathered'] / GIB:.2f} + activations {f['activations'] / GIB:.2f} (batch "
            f"{f['batch']} x {f['text']} tokens, no grad) + runtime {f['runtime'] / GIB:.2f} = "
            f"{f['total'] / GIB:.2f} GiB",
            f"PEAK per GPU (training, text-cache fill): {peak_bytes(p) / GIB:.2f} GiB"]


def _cp_lines(p: dict) -> list[str]:
    """format_plan's words on context parallelism (none without it)."""
    if "cp" not in p:
        return []
    s, cp = p["settings"], p["cp"]
    c, tokens = cp["degree"], cp["text"] + cp["image"]
    groups = s.world_size // c
    return [f"context parallel {c}: each rank holds 1/{c} of the sequence ({cp['text']} text + {cp['image']} image "
            f"tokens (target + context) = {tokens}, {tokens // c} per rank); Ulysses attention over all {tokens} "
            f"tokens for {cp['heads'] // c} of {cp['heads']} heads per rank",
            f"global batch {s.batch_size} x {s.world_size} / {c} = {s.batch_size * groups} per step (x GRAD_ACCUM): "
            f"{groups} data-parallel group(s) of {c} ranks, each group's ranks on the same samples; "
            f"model states sharded over all {s.world_size} ranks, as without CP"]


def _count(n: int, adapters: bool = False) -> str:
    """A parameter count as the table prints it: billions, or millions for adapters ("-": none)."""
    if not n:
        return "-"
    return f"{n / 1e6:.2f}M" if adapters else f"{n / 1e9:.2f}B"


def _lora_lines(p: dict) -> list[str]:
    """What trains under LoRA: per LoRA component its adapter count and share (peft's trainable%:
    of all its parameters, adapters included), and the targets; then every trained parameter."""
    lines = []
    for name, (adapters, total) in p["lora"].items():
        lines.append(f"trainable in {name}: {adapters:,} LoRA params = {100 * adapters / total:.2f}% of its "
                     f"{total / 1e9:.2f}B (base frozen: no grads, no optimizer state)")
    # per-block names (FLUX.2's single blocks' to_out) as one pattern each
    targets = dict.fromkeys(re.sub(r"\.\d+\.", ".*.", t) for t in p["lora_targets"])
    lines.append(f"LoRA targets: {', '.join(targets)}")
    trained = sum(r["count"] for r in p["rows"].values() if r["grads"])
    if trained != sum(a for a, _ in p["lora"].values()):  # a full model trains beside (DMD's fake score)
        lines.append(f"trainable in all: {trained:,} params (with the full "
                     f"{', '.join(n for n, r in p['rows'].items() if r['grads'] and not r.get('adapters'))})")
    return lines


def _setting_name(s: Settings, base_precision: str) -> str:
    parts = (["bf16 states"] if s.precision != base_precision else []) + \
            (["AC"] if s.activation_checkpointing else []) + (["CPU offload"] if s.cpu_offload else []) + \
            (["NF4 text encoder"] if s.text_encoder_dtype == "nf4" else [])
    return " + ".join(parts) or "as is"


def fit_table(name: str, world_sizes=(2, 4, 8), gpu_memory_gbs=(24, 40, 80), batch_size: int = 1,
              resolution: int | None = None, precision: str = "bf16-mixed", **lora) -> str:
    """A markdown table: per world size, the per-rank params (all components) / grads / optimizer /
    activations (without and with activation checkpointing) in GiB as planned, and per GPU memory
    the cheapest settings that fit (cheapest_fit's order) with their GPU total, or "does not fit".
    Plans are memoised, and the sharded counts kept per world size (plan's shard_cache). `lora`:
    Settings' lora_rank / lora_alpha / lora_targets / fake_lora, and context_parallel (every world
    size planned with that CP)."""
    planner = memo_planner()
    gbs = list(gpu_memory_gbs)
    lines = []
    for ws in world_sizes:
        base = Settings(world_size=ws, precision=precision, batch_size=batch_size, resolution=resolution,
                        reshard_after_forward=None, **lora)  # the scripts' auto, decided per GPU memory
        p = planner(name, base)
        if not lines:
            r = p["settings"]
            lines += [f"{name} ({p['kind']}), {precision}, batch {r.batch_size}/GPU at {r.resolution} px"
                      + (f" x {r.frames} frames" if r.frames else "")
                      + (_lora_caption(p) if r.lora else "") + _cp_caption(p) + ". Per-rank GiB "
                      "as planned without checkpointing or offload (params: every component's local share); "
                      "per GPU memory (budget N GiB): the cheapest settings that fit, and their per-GPU total. "
                      f"Activations: {ATTENTION_NOTE}.", "",
                      "| GPUs | params | grads | optimizer | activations | activations (AC) | total as is | "
                      + " | ".join(f"{g:g} GB" for g in gbs) + " |",
                      "|" + "---:|" * 7 + "---|" * len(gbs)]
        ac = planner(name, Settings(**{**base.__dict__, "activation_checkpointing": True}))
        rows = p["rows"].values()
        cols = [sum(r[k] for r in rows) for k in ("params", "grads", "optim")]
        cols += [p["activations"], ac["activations"], p["gpu_total"]]
        cells = []
        for g in gbs:
            fit = cheapest_fit(name, base, int(g * GIB), planner)
            cells.append("does not fit" if fit is None else
                         f"{_setting_name(fit[0], precision)} ({fit[1]['gpu_total'] / GIB:.1f})")
        lines.append(f"| {ws} | " + " | ".join(f"{c / GIB:.2f}" for c in cols) + " | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def memo_planner():
    """plan, memoised per Settings, the sharded counts kept across settings that share them (plan's
    shard_cache): what fit_table and cp_table plan with."""
    shard_cache, memo = {}, {}

    def planner(n: str, t: Settings) -> dict:
        key = (n, *sorted(t.__dict__.items()))
        if key not in memo:
            memo[key] = plan(n, t, shard_cache)
        return memo[key]
    return planner


def _cp_caption(p: dict) -> str:
    """fit_table's words on context parallelism (none without it)."""
    if "cp" not in p:
        return ""
    c = p["cp"]["degree"]
    return (f", context parallel {c} (each rank holds 1/{c} of the sequence: activations are one forward's / {c}, "
            f"plus what has no sequence dimension and the all-to-all buffers; global batch = batch x GPUs / {c})")


def cp_frontier(name: str, base: Settings, gpu_bytes: int, context_parallels,
                planner=None) -> list[tuple[Settings, dict]]:
    """The context-parallel sizes worth knowing for these settings and this GPU memory: the smallest CP
    with which anything fits (with cheapest_fit's settings for it), then each larger CP that needs
    less (earlier in FIT_ORDER: fewer of AC, bf16 states, CPU offload), up to one that fits as is.
    CP sizes the world size, heads or tokens do not allow (check_context_parallel) are skipped.
    [] if nothing fits at any of them."""
    folder, out, best = model_folder(name), [], len(FIT_ORDER)
    for c in sorted(set(context_parallels)):
        trial = dataclasses.replace(base, context_parallel=c)
        try:
            check_context_parallel(folder, trial)
        except SystemExit:
            continue
        fit = cheapest_fit(name, trial, gpu_bytes, planner)
        if fit is None:
            continue
        t = fit[0]
        rank = FIT_ORDER.index((t.activation_checkpointing, t.cpu_offload, t.precision != base.precision))
        if rank < best:
            out.append(fit)
            best = rank
        if rank == 0:
            break
    return out


def cp_table(name: str, resolutions=(1024, 2048), gpu_memory_gbs=(24, 80), world_sizes=(8,),
             context_parallels=(1, 2, 4, 8), batch_size: int = 1, precision: str = "bf16-mixed",
             planner=None, **lora) -> str:
    """A markdown table for FLUX Kontext: which context parallelism fits. Rows: resolution x GPU
    memory (a budget of N GiB); columns: the activations per rank of one forward (and with
    activation checkpointing) at CP 1, then per world size the smallest CP that fits with the cheapest
    settings it needs (cheapest_fit) and its per-GPU total in GiB, then any larger CP that needs less
    (cp_frontier). `planner`: plan, or a stand-in (default: memo_planner()). `lora`: as fit_table's."""
    folder = model_folder(name)
    script, kind = layout(folder, with_script(name, Settings(1, **lora)).script)
    refusal = _no_cp("--cp_table", name, folder, script, kind)
    if refusal:
        raise SystemExit(refusal)
    for c in context_parallels:  # the other checks are per cell: a CP size they rule out is skipped there
        if c < 1:
            raise SystemExit(f"plan: --context_parallels: {c}: must be >= 1 (1 = off)")
    planner = planner or memo_planner()
    cps, gbs, wss = sorted(set(context_parallels)), list(gpu_memory_gbs), list(world_sizes)
    lines = []
    for res in resolutions:
        base = Settings(world_size=wss[0], precision=precision, batch_size=batch_size, resolution=res, **lora)
        p = planner(name, base)
        ac = planner(name, dataclasses.replace(base, activation_checkpointing=True))
        if not lines:
            lines += [f"{name} ({p['kind']}), {precision}, batch {batch_size} per CP group"
                      + (f" of {p['settings'].frames} frames" if p["settings"].frames else "")
                      + (_lora_caption(p) if base.lora else "") + ". Per GPU count and GPU memory (budget N GiB): "
                      f"the smallest context parallelism (CP c: each rank holds 1/c of the sequence; global batch "
                      f"= batch x GPUs / c) that fits, with the cheapest settings it needs and its per-GPU total "
                      f"in GiB; then any larger CP that needs less. CP tried: {', '.join(map(str, cps))} (those the "
                      f"GPU count, the attention heads and the token counts divide). Activations per rank: one "
                      f"forward's (measured on meta) / c, plus what has no sequence dimension and the all-to-all "
                      f"buffers; {ATTENTION_NOTE}.", "",
                      "| resolution | GPU memory | activations at CP 1 (AC) | "
                      + " | ".join(f"{w} GPUs" for w in wss) + " |",
                      "|---:|---:|---:|" + "---|" * len(wss)]
        for g in gbs:
            cells = []
            for ws in wss:
                front = cp_frontier(name, dataclasses.replace(base, world_size=ws), int(g * GIB), cps, planner)
                cells.append("; ".join(f"CP {t.context_parallel}: {_setting_name(t, precision)} "
                                       f"({r['gpu_total'] / GIB:.1f})" for t, r in front)
                             or f"does not fit at CP <= {max(cps)}")
            lines.append(f"| {p['settings'].resolution} px | {g:g} GB | {p['activations'] / GIB:.2f} "
                         f"({ac['activations'] / GIB:.2f}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def check_lora_targets(name: str, lora: lora_lib.Lora, script: str = "") -> list[str]:
    """The LoRA targets of the model a configuration trains (its first trainable component), each
    checked to name a layer of it (parallel.lora.lora_targets; SystemExit naming a bad one)."""
    folder = model_folder(name)
    script = layout(folder, with_script(name, Settings(1, script=script)).script)[0]
    spec = next(c for c in pipeline_components(pipeline_of(folder), script) if HOLDING[c.role].trained)
    try:
        return lora_lib.lora_targets(meta_model(os.path.join(folder, spec.subfolder)), lora)
    except ConfigError as e:
        raise SystemExit(f"plan: --lora_target_modules: {e}") from None


def _lora_caption(p: dict) -> str:
    """fit_table's words on LoRA: rank, trainable adapter params per LoRA model, and how it is counted."""
    s = p["settings"]
    each = ", ".join(f"{n} {a / 1e6:.2f}M ({100 * a / total:.2f}%)" for n, (a, total) in p["lora"].items())
    full = [n for n, r in p["rows"].items() if r["grads"] and not r.get("adapters")]
    return (f", LoRA rank {s.lora_rank} (alpha {s.lora_alpha or s.lora_rank:g}), trainable adapter params: {each}"
            + (f" ({', '.join(full)} fully trained)" if full else "")
            + f"; frozen base in {dtype_name(get_precision(s.precision).compute_dtype)} without grads or optimizer "
            f"state, adapters fp32 with fp32 grads and AdamW states; activations measured on the LoRA model, as "
            f"autograd keeps them on a frozen base" + ("; units in flight at the activations peak" if p.get("at_peak")
                                                        else ""))


# ----------------------------------------------------------------------------------------------
# low-bit storage (parallel/lowbit.py): where BASE_DTYPE and OPTIMIZER make a run fit


def _fit_without_offload(name: str, s: Settings, gpu_bytes: int, planner) -> str:
    """The cheapest no-offload settings that fit (as is, AC, bf16 states, AC + bf16 states; bf16
    states only for full fine-tunes), as "settings (GiB)", else "needs CPU offload"."""
    for ac, bf16 in ((False, False), (True, False), (False, True), (True, True)):
        if bf16 and s.lora_rank:
            continue
        t = Settings(**{**s.__dict__, "activation_checkpointing": ac, "precision": "bf16" if bf16 else s.precision})
        p = planner(name, t)
        if p["gpu_total"] <= gpu_bytes:
            return f"{_setting_name(t, s.precision)} ({p['gpu_total'] / GIB:.1f})"
    return "needs CPU offload"


def _ddp_total(p: dict) -> int:
    """A DDP replica's GPU bytes from a world-size-1 plan: nothing is all-gathered (an NF4 base still
    dequantises one Linear weight at a time: kept), grads all-reduced in place (buckets ~ grads)."""
    return p["gpu_total"] - p["gathered"] + p["rows"].get("transformer.lora", {}).get("grads", 0)


def _largest_batch(name: str, s: Settings, gpu_bytes: int, planner, total=lambda p: p["gpu_total"],
                   limit: int = 64) -> int:
    """The largest batch per GPU (1..limit, doubling then bisecting) whose plan fits; 0: none."""
    def fits(b):
        return total(planner(name, Settings(**{**s.__dict__, "batch_size": b}))) <= gpu_bytes
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def lowbit_tables(name: str, rank: int = 16, gpu_gb: float = 24) -> str:
    """Markdown: (1) full fine-tune on 4 GPUs per OPTIMIZER, LoRA on 1 and 2 GPUs per BASE_DTYPE x
    OPTIMIZER, at 512 and 1024 px: the cheapest no-offload settings that fit `gpu_gb` and their
    GiB; (2) the seed plan's comparison on 4 x `gpu_gb`: bf16-base and NF4-base LoRA under DDP (a
    replica per GPU) and FSDP2, batch-1 GiB and the largest batch that fits, with and without AC."""
    planner, budget = memo_planner(), int(gpu_gb * GIB)
    head = (f"{name}: the cheapest settings without CPU offload that fit {gpu_gb:g} GB per GPU (per-GPU GiB "
            f"planned), batch 1/GPU, bf16-mixed; LoRA rank {rank} on the model's default targets. "
            f"Activations: {ATTENTION_NOTE}.")
    lines = [head, "", "| run | GPUs | BASE_DTYPE | OPTIMIZER | 512 px | 1024 px |", "|---|---:|---|---|---|---|"]
    cases = [("full fine-tune", 4, "", o) for o in lowbit.OPTIMIZERS]
    cases += [("LoRA", ws, b, o) for ws in (1, 2) for b in ("", "nf4") for o in ("adamw", "adamw8bit")]
    for run, ws, base, opt in cases:
        cells = []
        for res in (512, 1024):
            s = Settings(world_size=ws, resolution=res, lora_rank=rank if run == "LoRA" else 0, base_dtype=base,
                         optimizer=opt)
            cells.append(_fit_without_offload(name, s, budget, planner))
        lines.append(f"| {run} | {ws} | {base or 'bf16'} | {opt} | " + " | ".join(cells) + " |")
    lines += ["", f"LoRA rank {rank}, 512 px, 4 x {gpu_gb:g} GB: DDP (a replica per GPU: a world-size-1 plan without "
              "all-gathered units) vs FSDP2; per-GPU GiB at batch 1, and the largest batch per GPU that fits "
              "(without / with activation checkpointing).", "",
              "| layout | per-GPU GiB (batch 1) | base GiB | largest batch | largest batch (AC) |",
              "|---|---:|---:|---:|---:|"]
    for label, ddp, base in (("BF16 DDP", True, ""), ("NF4-base DDP", True, "nf4"),
                             ("BF16 FSDP2", False, ""), ("NF4-base FSDP2", False, "nf4")):
        s = Settings(world_size=1 if ddp else 4, resolution=512, lora_rank=rank, base_dtype=base)
        total = _ddp_total if ddp else (lambda p: p["gpu_total"])
        p = planner(name, s)
        batches = [_largest_batch(name, Settings(**{**s.__dict__, "activation_checkpointing": ac}), budget, planner,
                                  total) for ac in (False, True)]
        lines.append(f"| {label} | {total(p) / GIB:.2f} | {p['rows']['transformer']['params'] / GIB:.2f} | "
                     + " | ".join(str(b) for b in batches) + " |")
    return "\n".join(lines)


# docs/planner.md's FLUX.2 rows: (run, built-in name, settings, GPU memory in GB, world sizes tried)
FLUX2_ROWS = [(f"{model} LoRA r16, {base or 'bf16'} base", name, dict(lora_rank=16, base_dtype=base), gb, (1, 2, 4, 8))
              for model, name, gbs in (("[dev]", "flux2-dev", (24, 48, 80)), ("klein 4B", "flux2-klein-4b", (24,)),
                                       ("klein 9B", "flux2-klein-9b", (24,)))
              for base in ("nf4", "") for gb in gbs]
FLUX2_ROWS += [("[dev] full fine-tune", "flux2-dev", {}, 80, (8,)),
               ("klein 4B full fine-tune", "flux2-klein-4b", {}, 80, (1, 2, 4, 8)),
               ("klein 9B full fine-tune", "flux2-klein-9b", {}, 80, (1, 2, 4, 8))]


def flux2_table(planner=None) -> str:
    """Markdown: for each FLUX.2 run of FLUX2_ROWS at 1024 px with the family's references, bf16-mixed,
    batch 1, auto resharding, the fewest GPUs that fit (fewest_gpus) with the cheapest settings, and the fewest
    without CPU offload or an NF4 text encoder; each with its training and text-cache fill peaks in GiB."""
    planner = planner or memo_planner()
    lines = ["| run | GPU | fewest GPUs: settings (training / fill GiB) | without CPU offload or an NF4 text encoder |",
             "|---|---|---|---|"]
    for label, name, over, gb, worlds in FLUX2_ROWS:
        s = Settings(world_size=worlds[0], resolution=1024, reshard_after_forward=None, **over)
        cells = []
        for fit in ({}, dict(cpu_offload=False, nf4_text_encoder=False)):
            found = fewest_gpus(name, s, int(gb * GIB), worlds, planner, **fit)
            cells.append(f"none of {', '.join(map(str, worlds))}" if found is None else
                         f"{found[0].world_size}: {_setting_name(found[0], s.precision)} "
                         f"({found[1]['gpu_total'] / GIB:.2f} / {found[1]['fill']['total'] / GIB:.2f})")
        lines.append(f"| {label} | {gb:g} GB | " + " | ".join(cells) + " |")
    return "\n".join(lines)
