"""What a row may take: its disk (its checkpoints and export by the scripts' own arithmetic, against the free
space of --out; models halved until every row fits), the planner's GPU memory, and the time of one
deadline."""
from __future__ import annotations

import json
import os
import shutil
import time

from tools.gpu.folders import (
    flux2_parts, flux2_skeleton, flux_parts, flux_skeleton, qwen_parts, qwen_skeleton, sd15_folder, tiny_default,
    transformer_weights)


GIB = 2**30
GB = 10**9  # disks as they are sold and df -H shows them (checkpoint.py's messages too)
HEADROOM = 2 * GB  # beside a row's checkpoints and export: logs, samples, the compile cache, profiler traces
CALL_S = 540  # the whole check, wheels included (gpu_check.sh sets GPU_CHECK_T0): 9 of the device tool's 10 minutes
END_RESERVE_S = 15  # kept back from the deadline: the table, stopping the tests, removing the work folder


# ----------------------------------------------------------------------------------------------
# disk: each row's checkpoints and export against the free space of --out


def disk_usage(path: str) -> tuple[str, int, int]:
    """(the existing folder measured, free bytes, total bytes) of `path`'s filesystem."""
    while not os.path.exists(path):
        path = os.path.dirname(path)
    usage = shutil.disk_usage(path)
    return path, usage.free, usage.total


def row_bytes(row: dict, folder: str) -> tuple[int, int]:
    """(one checkpoint, the export) of `row` on the model folder `folder`, in bytes. The trained
    models are built on meta as tools/memory_plan.py builds them (the roles of families.pipelines, the
    precision mode's storage dtype, LoRA adapters), with the row's optimizer, and counted by the
    scripts' own disk preflight arithmetic (checkpoint.checkpoint_bytes, export_bytes; frozen parts
    count where `folder` has their weights). Needs only the trained models' config.json. No row sets
    EMA_DECAY, so no EMA is counted."""
    import torch

    from checkpoint import checkpoint_bytes
    from components.export import export_bytes
    from parallel import lora as lora_lib
    from components import optim
    from precision import get_precision, parse_dtype
    from tools import memory_plan
    s = row["settings"]
    extra = s.get("extra", {})
    lora = lora_lib.Lora(s.get("lora_rank", 0), float(extra.get("lora_alpha", 0)))
    _, _, parts = memory_plan.build_components(folder, get_precision(s["precision"]), build=False, lora=lora,
                                               script=row["script"])
    trained, subfolder = {}, ""
    for part in (p for p in parts if p.holding.trained):
        model = torch.nn.Module.to(memory_plan.meta_model(os.path.join(folder, part.spec.subfolder)), part.dtype)
        # under DDP a model computed wider than it is stored is stored in its compute dtype (docs/gpu.md)
        if (extra.get("parallelism") == "ddp" and part.name == "fake_score"
                and fake_score_fp32(extra)):
            model = torch.nn.Module.to(model, torch.float32)
        if part.lora:
            with torch.device("meta"):
                lora_lib.add_lora(model, part.lora)
        trained[part.name], subfolder = model, subfolder or part.spec.subfolder
    optimizers = {k: optim.make_optimizer(s.get("optimizer", "adamw"), [p for p in m.parameters() if p.requires_grad],
                                           lr=1e-4, betas=(0.9, 0.999)) for k, m in trained.items()}
    export = export_bytes(folder, subfolder, next(iter(trained.values())), parse_dtype(s["export_dtype"]),
                          lora=bool(lora))
    return checkpoint_bytes(trained, optimizers), export


def peak_disk(one: int, export: int, resume: bool) -> int:
    """A row's most bytes on disk: its checkpoint and export; with a resume also the second
    checkpoint, written before the first is pruned (KEEP_LAST=1), and the new export written beside
    the old one (components.export swaps it in at the end)."""
    return max(2 * one + export, one + 2 * export) if resume else one + export


def folder_bytes(folder: str) -> int:
    """What writing a skeleton's transformer takes: its parameters in fp32, as save_pretrained writes them."""
    from tools import memory_plan
    model = memory_plan.meta_model(os.path.join(folder, "transformer"))
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def smaller_blocks(blocks: tuple[int, int]) -> tuple[int, int] | None:
    """Half the FLUX blocks of each kind, one of each at least (19+38 -> 9+19 -> 4+9 -> 2+4 -> 1+2 -> 1+1:
    a LoRA row targets modules of both kinds); None past 1+1."""
    half = (max(blocks[0] // 2, 1), max(blocks[1] // 2, 1))
    return half if half != blocks else None


def smaller_qwen_blocks(blocks: int) -> int | None:
    """Half the Qwen-Image-Edit blocks (4 -> 2 -> 1); None past 1."""
    return blocks // 2 or None


def smaller_size(size):
    """The next smaller model of a row (smaller_qwen_blocks, smaller_blocks; a FLUX.2 size ("klein", D, S)
    halves as FLUX does); None: no smaller one."""
    if isinstance(size, int):
        return smaller_qwen_blocks(size)
    if isinstance(size, tuple) and size[0] == "klein":
        half = smaller_blocks(size[1:])
        return ("klein", *half) if half else None
    return smaller_blocks(size) if isinstance(size, tuple) else None


def fit_to_disk(rows: list[dict], free: int, need, folder_cost, smaller) -> dict:
    """{run: model size} where every row's peak bytes `need(row, size)` fit `free` less HEADROOM and
    less the model folders the chosen sizes still need written (`folder_cost(size)`, 0 for one on
    disk): the rows run one after the other and each deletes its output once checked, so each must
    fit alone. The row furthest over gets `smaller(row, size)` (None: no smaller model, not run)
    until every row fits."""
    choice = {r["run"]: r["size"] for r in rows}
    while True:
        room = free - HEADROOM - sum(folder_cost(z) for z in set(choice.values()) if z is not None)
        over = [(excess, i) for i, r in enumerate(rows) if choice[r["run"]] is not None
                for excess in [need(r, choice[r["run"]]) - room] if excess > 0]
        if not over:
            return choice
        row = rows[max(over)[1]]
        choice[row["run"]] = smaller(row, choice[row["run"]])


def build(runs: list[dict], work: str, out: str, tiny: bool, blocks: tuple[int, int],
          qwen_blocks: int = 4, flux2_blocks: tuple[int, int] = (2, 4)) -> tuple[dict, dict, dict]:
    """Model folders for the rows, each row sized to the disk (row["size"]: FLUX blocks as a tuple,
    FLUX.2 klein's as ("klein", D, S), Qwen-Image-Edit blocks as an int, else a name; None: not run). Returns
    ({size: folder}, {run: peak disk bytes at its size; not run: at its smallest}, the disk as measured)."""
    folders = {}
    if any(r["kind"] == "sd15" for r in runs):
        folders["tiny_sd15" if tiny else "sd15"] = sd15_folder(work, tiny)
    parts = {}  # per transformer family: its folder's other parts at real width (a tiny run: its tiny folder)
    for kind, parts_of in (("flux", flux_parts), ("qwen", qwen_parts), ("flux2", flux2_parts)):
        if any(r["kind"] == kind for r in runs):
            if tiny:
                folders["tiny_" + kind] = tiny_default(kind)
            else:
                parts[kind] = parts_of(work)
    sizes = {"sd15": "sd15", "qwen": qwen_blocks, "flux2": ("klein", *flux2_blocks), "flux": blocks}
    for r in runs:
        r["size"] = "tiny_" + r["kind"] if tiny else sizes[r["kind"]]

    def folder(size):
        if size not in folders:
            folders[size] = (qwen_skeleton(work, size, parts.get("qwen")) if isinstance(size, int)
                             else flux2_skeleton(work, size[1:], parts.get("flux2")) if size[0] == "klein"
                             else flux_skeleton(work, size, parts.get("flux")))
        return folders[size]

    needs = {}

    def need(row, size):
        if (row["run"], size) not in needs:
            one, export = row_bytes(row, folder(size))
            needs[row["run"], size] = peak_disk(one, export, row["resume"])
        return needs[row["run"], size]

    same_disk = os.stat(disk_usage(work)[0]).st_dev == os.stat(disk_usage(out)[0]).st_dev
    unwritten = {}  # a transformer still to write costs its fp32 bytes where the runs write too

    def folder_cost(size):
        if not isinstance(size, (tuple, int)) or not same_disk:
            return 0
        if size not in unwritten:
            written = any(n.endswith(".safetensors") for n in os.listdir(os.path.join(folder(size), "transformer")))
            unwritten[size] = 0 if written else folder_bytes(folder(size))
        return unwritten[size]

    def smaller(row, size):
        return smaller_size(size)

    def smallest(row, size):
        while smaller(row, size) is not None:
            size = smaller(row, size)
        return size

    path, free, total = disk_usage(out)
    choice = fit_to_disk(runs, free, need, folder_cost, smaller)
    peaks = {r["run"]: need(r, choice[r["run"]] or smallest(r, r["size"])) for r in runs}
    to_write = sum(folder_cost(z) for z in set(choice.values()) if z is not None)
    for r in runs:
        r["size"] = choice[r["run"]]
    for size, f in list(folders.items()):
        if isinstance(size, (tuple, int)):
            if size in choice.values():
                transformer_weights(f)
            else:  # a size tried and not taken: its config and links only
                shutil.rmtree(f)
                del folders[size]
    return folders, peaks, {"path": path, "free": free, "total": total, "to_write": to_write}


# ----------------------------------------------------------------------------------------------
# GPU memory: the planner's total for each row


def fake_score_fp32(extra: dict) -> bool:
    """A DMD2 row's FAKE_SCORE_FP32: its own, or train_dmd.py's default (the planner's Settings mirrors it)."""
    from tools import memory_plan
    return bool(int(extra.get("fake_score_fp32", memory_plan.Settings.fake_score_fp32)))


def planned_bytes(model: str, world: int, s: dict, script: str, gpu_gb: float) -> int:
    """The planner's GPU total for a row, with the scripts' RESHARD_AFTER_FORWARD=auto on a GPU of `gpu_gb`."""
    from tools import memory_plan
    extra = s.get("extra", {})
    settings = memory_plan.Settings(world_size=world, precision=s["precision"], batch_size=s["batch_size"],
                                    resolution=s["resolution"], activation_checkpointing=s.get("ac", False),
                                    lora_rank=s.get("lora_rank", 0), base_dtype=s.get("base_dtype", ""),
                                    optimizer=s.get("optimizer", "adamw"), script=script,
                                    fake_score_fp32=fake_score_fp32(extra),
                                    fp8=extra.get("fp8", ""), reshard_after_forward=None, gpu_memory_gb=gpu_gb)
    return memory_plan.plan(model, settings)["gpu_total"]


def plan_all(jobs: list[tuple[str, tuple]], path: str) -> None:
    """In a background process (the planner takes seconds per row at real width, all CPU): each
    row's planned GiB, or the planner's error, one JSON line each in `path`."""
    from components.warnings import quiet_known_warnings
    quiet_known_warnings()
    for name, args in jobs:
        try:
            value = planned_bytes(*args) / GIB
        except Exception as e:  # noqa: BLE001 - a planner gap is a table cell, not the end of the check
            value = f"planner: {type(e).__name__}"
        with open(path, "a") as f:
            f.write(json.dumps({"run": name, "planned": value}) + "\n")


# ----------------------------------------------------------------------------------------------
# time: one deadline, and rows started only where their expected seconds fit


class Deadline:
    """The seconds left, and whether a row expected to take `expect_s` fits them: its expectation
    times how long the rows so far took against theirs (at least half), with END_RESERVE_S kept."""

    def __init__(self, seconds: float, start: float):
        self.seconds, self.end = seconds, start + seconds
        self.taken = self.expected = 0.0

    def left(self) -> float:
        return self.end - time.monotonic() - END_RESERVE_S

    def scale(self) -> float:
        return max(0.5, self.taken / self.expected) if self.expected else 1.0

    def fits(self, expect_s: float) -> bool:
        return expect_s * self.scale() <= self.left()

    def record(self, expect_s: float, took_s: float) -> None:
        self.expected, self.taken = self.expected + expect_s, self.taken + took_s
