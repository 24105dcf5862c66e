"""The table: the plain reference, one line per row, each DMD2 row against the plain-eager time of its network
calls, each FP8 row beside its bf16 twin."""
from __future__ import annotations

from tools.gpu.budget import GB, HEADROOM


def _fmt(v, spec: str) -> str:
    return "-" if v is None or v != v else format(v, spec)


DMD_GOAL = 1.2  # the default DMD2 step against the plain-eager time of its network calls (dmd_network_ms)


def table(rows: list[dict], refs: dict, header: list[str]) -> str:
    lines = header + ["", "plain reference (bf16 weights, forward + backward, no FSDP, no optimizer; AdamW and VAE "
                          "apart; the UNet's channels_last row: NHWC conv inputs, as CHANNELS_LAST runs it):", "",
                      "| model | fwd+bwd ms | fwd ms (no grad) | model TFLOP | MFU | fused AdamW ms | VAE encode ms |",
                      "|---|---:|---:|---:|---:|---:|---:|"]
    for key, r in refs.items():
        if "error" in r:
            lines.append(f"| {key} | {r['error']} | | | | | |")
            continue
        lines.append(f"| {key} | {r['fwd_bwd_ms']:.1f} | {r['fwd_ms']:.1f} | {r['model_tflop']:.2f} | "
                     f"{_fmt(100 * r['mfu'], '.1f')} % | {r['adamw_ms']:.1f} | {r['vae_ms']:.1f} |")
        if "cl_fwd_bwd_ms" in r:
            lines.append(f"| {key}, channels_last | {r['cl_fwd_bwd_ms']:.1f} | - | {r['model_tflop']:.2f} | "
                         f"{_fmt(100 * r['cl_mfu'], '.1f')} % | - | - |")
    lines += ["", "| run | model | step ms | x plain fwd+bwd | x plain fwd+bwd+AdamW+VAE | MFU | HFU | "
                  "model TFLOP/step | peak alloc GiB | peak reserved GiB | planned GiB | error % | "
                  "disk GB need / free | s / expected | warm-up s (not timed) | compile s | train | resume/export |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        ref = refs.get(r.get("ref", ""), {})
        plain = ref.get("fwd_bwd_ms")
        whole = plain + ref["adamw_ms"] + ref["vae_ms"] if plain and r.get("full") else None
        err = 100 * (r["reserved_gib"] - r["planned_gib"]) / r["planned_gib"] if r["planned_gib"] > 0 else None
        ratio, ratio_whole = (r["step_ms"] / plain if plain else None), (r["step_ms"] / whole if whole else None)
        lines.append(f"| {r['run']} | {r['model']} | {_fmt(r['step_ms'], '.0f')} | {_fmt(ratio, '.2f')} | "
                     f"{_fmt(ratio_whole, '.2f')} | {_fmt(100 * r['mfu'], '.1f')} | {_fmt(100 * r['hfu'], '.1f')} | "
                     f"{_fmt(r['model_tflop'], '.2f')} | {_fmt(r['allocated_gib'], '.2f')} | "
                     f"{_fmt(r['reserved_gib'], '.2f')} | {_fmt(r['planned_gib'], '.2f')} | {_fmt(err, '+.1f')} | "
                     f"{_fmt(r['disk_need_gb'], '.3g')} / {_fmt(r['disk_free_gb'], '.1f')} | "
                     f"{_fmt(r['wall_s'], '.0f')} / {r['expect_s']:.0f} | {_fmt(r.get('warmup_s'), '.1f')} | "
                     f"{_fmt(r.get('compile_s'), '.1f')} | {r['status']} | {r['resume_export']} |")
    return "\n".join(lines + dmd_bound_lines(rows, refs) + fp8_lines(rows))


def dmd_bound_lines(rows: list[dict], refs: dict) -> list[str]:
    """The DMD2 UNet rows against the plain-eager time of the same network calls (dmd_network_ms, from
    the plain rows at the row's batch), the ratio and the goal: the default step <= DMD_GOAL x."""
    lines = []
    for r in rows:
        ref = refs.get(r.get("ref", ""), {})
        if not r.get("ratio") or "fwd_ms" not in ref or not r.get("timed_steps"):
            continue
        if "frozen_fwd_bwd_ms" in ref and len(r.get("step_indices", [])) == len(r["timed_steps"]):  # FLUX.2
            ms, gen = dmd_flow_network_ms(ref, r["timed_steps"], r["step_indices"], int(r["ratio"]),
                                          r.get("ac", False), r.get("lora_generator", False), r.get("cfg_pair", False),
                                          r.get("lora_fake", False), r.get("decoupled", False))
        elif r.get("flow"):
            continue  # a flow row without the plain calls of its backward simulation and teacher: no bound
        else:
            ms, gen = dmd_network_ms(ref, r["timed_steps"], int(r["ratio"]), r.get("ac", False))
        n, ratio = len(r["timed_steps"]), r["step_ms"] / ms
        lines.append(f"| {r['run']} | {gen} + {n - gen} | {ms:.0f} | {_fmt(r['step_ms'], '.0f')} | {ratio:.2f} | "
                     f"{'met' if ratio <= DMD_GOAL else 'not met'} |")
    if not lines:
        return []
    return ["", f"DMD2 against its network calls at plain-eager speed (goal: the default step <= {DMD_GOAL} x): "
                "a fake-score step = F + P (the generator without grad, the fake score forward + backward), a "
                "generator step = 2 P + 3 F (generator and fake score forward + backward, the teacher's CFG pair, "
                "the DM loss's fake forward); P = plain fwd+bwd (+ F with AC's recomputation), F = plain fwd "
                "without grad, at the row's batch; the timed steps' own mix of generator and fake-score steps "
                "(flow rows with the teacher's CFG pair timed, FLUX.2 and Wan: dmd_flow_network_ms, with the "
                "backward simulation's forwards at each step's logged σ index, the references' VAE encode, the "
                "teacher's true-CFG pair and a LoRA generator's and fake score's frozen-weight backward)", "",
            "| run | generator + fake-score steps timed | network calls ms/step | step ms | ratio | goal |",
            "|---|---:|---:|---:|---:|---|", *lines]


def dmd_network_ms(plain: dict, steps: list[int], ratio: int, ac: bool) -> tuple[float, int]:
    """(ms per step, generator steps) of the network calls of DMD2 `steps` at plain-eager speed, from
    the plain reference's forward without grad F and forward + backward P at the row's batch (plain
    eager, no FSDP, no optimizer, no text encoder). A fake-score step runs the generator without
    grad and the fake score forward + backward: F + P (1.33 P at F = P / 3). A generator step (steps
    where dm.should_update_generator(step - 1, ratio), as train_dmd.py's loop decides) adds the
    generator's own forward + backward, the teacher's CFG pair and the fake score's DM-loss forward,
    and needs no generator forward without grad: 2 P + 3 F. With activation checkpointing every
    forward + backward recomputes its forward: P + F in place of P. The mean over `steps`."""
    from algorithms.dmd2 import should_update_generator
    f, p = plain["fwd_ms"], plain["fwd_bwd_ms"] + (plain["fwd_ms"] if ac else 0.0)
    gen = sum(should_update_generator(step - 1, ratio) for step in steps)
    total = gen * (2 * p + 3 * f) + (len(steps) - gen) * (f + p)
    return total / max(len(steps), 1), gen


def dmd_flow_network_ms(plain: dict, steps: list[int], indices: list[int], ratio: int, ac: bool,
                        lora_generator: bool, cfg_pair: bool, lora_fake: bool = False,
                        decoupled: bool = False) -> tuple[float, int]:
    """(ms per step, generator steps) of the network calls of a flow teacher's DMD2 `steps` (algorithms/dmd2_flow.py)
    at plain-eager speed. Every step encodes its references (V: the plain VAE encode) and runs the generator's
    backward simulation to the step's σ index k (`indices`, the logged step_index: k forwards without grad, F). A
    fake-score step then makes G's images without grad (F) and trains the fake score (P); a generator step makes
    them with grad (P_G: plain forward + backward, or with a LoRA generator the frozen weights' forward + backward,
    which computes no weight gradients), runs the teacher (true CFG: the pair as one batch of 2B, F2; else F) and
    the fake score's DM-loss forward (F), and trains the fake score (P; a LoRA fake score, FAKE_LORA: its frozen
    weights' forward + backward, as P_G); DMD_LOSS=decoupled's generator step also runs the conditional teacher at
    the CA term's τ and at the DM term's σ (+ 2 F; dmd2_flow.decoupled_loss):
        fake-score step  V + (k + 1) F + P
        generator step   V + k F + P_G + F2 + F + P  (decoupled: + 2 F)
    With activation checkpointing every forward + backward recomputes its forward: + F. The mean over `steps`."""
    from algorithms.dmd2 import should_update_generator
    f, v, redo = plain["fwd_ms"], plain["vae_ms"], plain["fwd_ms"] if ac else 0.0
    p = (plain["frozen_fwd_bwd_ms"] if lora_fake else plain["fwd_bwd_ms"]) + redo
    p_gen = (plain["frozen_fwd_bwd_ms"] if lora_generator else plain["fwd_bwd_ms"]) + redo
    teacher = (plain["fwd_pair_ms"] if cfg_pair else f) + (2 * f if decoupled else 0.0)
    total, gen = 0.0, 0
    for step, k in zip(steps, indices):
        if should_update_generator(step - 1, ratio):
            total, gen = total + v + k * f + p_gen + teacher + f + p, gen + 1
        else:
            total += v + (k + 1) * f + p
    return total / max(len(steps), 1), gen


FP8_GOAL = 1.25  # FP8's speed-up over the bf16 step of the same row (the Kontext 1024 px full fine-tune)


def fp8_lines(rows: list[dict]) -> list[str]:
    """Each FP8 row beside its bf16 twin (the same name without _fp8_<recipe>: same seed, data and noise): the
    speed-up (bf16 step / FP8 step; FP8_GOAL for the Kontext rows), MFU (a compiled row's from its eager twin's
    model FLOPs, which are the same: eager MFU x eager step / this step), and every step's loss side by side."""
    by_name = {r["run"]: r for r in rows}
    groups = {}
    for r in rows:
        base, _, recipe = r["run"].partition("_fp8_")
        if recipe and base in by_name:
            groups.setdefault(base, []).append((recipe, r))
    if not groups:
        return []
    lines = ["", f"FP8 against bf16 (same seed, data and noise; goal for the Kontext full fine-tune: >= {FP8_GOAL} x "
                 "the bf16 step; MFU against each op's own peak, float8 matmuls against the float8 peak; a compiled "
                 "row's MFU from its eager twin's model FLOPs):", "",
             "| run | step ms | bf16 step ms | speed-up | goal | MFU | bf16 MFU | largest loss difference, relative |",
             "|---|---:|---:|---:|---|---:|---:|---:|"]
    tables = []

    def mfu(r):
        if r["mfu"] == r["mfu"] or "_compile" not in r["run"]:
            return r["mfu"]
        eager = by_name.get(r["run"].replace("_compile", "", 1), {})
        return eager.get("mfu", float("nan")) * eager.get("step_ms", float("nan")) / r["step_ms"]

    for base, members in groups.items():
        bf16 = by_name[base]
        for recipe, r in members:
            speed = bf16["step_ms"] / r["step_ms"]
            pairs = list(zip(bf16.get("losses", []), r.get("losses", [])))
            diff = max((abs(a - b) / max(abs(a), 1e-12) for a, b in pairs), default=float("nan"))
            goal = ("met" if speed >= FP8_GOAL else "not met") if r["run"].startswith("kontext") else "-"
            lines.append(f"| {r['run']} | {_fmt(r['step_ms'], '.0f')} | {_fmt(bf16['step_ms'], '.0f')} | "
                         f"{_fmt(speed, '.2f')} | {goal if speed == speed else '-'} | {_fmt(100 * mfu(r), '.1f')} % | "
                         f"{_fmt(100 * mfu(bf16), '.1f')} % | {_fmt(diff, '.2e')} ({len(pairs)} steps) |")
        recipes = [recipe for recipe, _ in members]
        losses = [bf16.get("losses", [])] + [r.get("losses", []) for _, r in members]
        tables += ["", f"{base}: loss per step", "",
                   "| step | bf16 | " + " | ".join(f"fp8 {x}" for x in recipes) + " |",
                   "|---:|" + "---:|" * (1 + len(recipes))]
        for i in range(max(map(len, losses))):
            cells = " | ".join(_fmt(x[i] if i < len(x) else None, ".5f") for x in losses)
            tables.append(f"| {i + 1} | {cells} |")
    return lines + tables


def disk_line(disk: dict) -> str:
    return (f"disk: {disk['path']}: {disk['free'] / GB:.1f} GB free of {disk['total'] / GB:.1f} GB when the rows "
            f"were sized; model folders then written {disk['to_write'] / GB:.1f} GB; each row's need kept under "
            f"the free space less {HEADROOM / GB:.0f} GB")
