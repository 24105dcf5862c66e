"""What a row may take: its disk (its checkpoints and export by the scripts' own arithmetic, against the free
space of --out; models halved until every row fits), the planner's GPU memory, and the time of one
deadline."""
from __future__ import annotations

import json
import os
import shutil
import time

import families
from tools.gpu.folders import default_size, parts_folder, skeleton, tiny_default, trained_subfolder, trained_weights


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
                                               fake_lora=bool(lora) and fake_lora(extra), script=row["script"])
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


def folder_bytes(name: str, folder: str) -> int:
    """What writing a skeleton's trained model takes: its parameters in fp32, as save_pretrained writes them."""
    from tools import memory_plan
    model = memory_plan.meta_model(os.path.join(folder, trained_subfolder(name)))
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def smaller_blocks(blocks):
    """Half the blocks of each kind, one of each at least (FLUX 19+38 -> 9+19 -> 4+9 -> 2+4 -> 1+2 -> 1+1: a LoRA
    row targets modules of both kinds; Qwen-Image-Edit 4 -> 2 -> 1); None past that, or for a model built whole
    (()) or a tiny one."""
    if not isinstance(blocks, tuple):
        return None
    half = tuple(max(n // 2, 1) for n in blocks)
    return half if half != blocks else None


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


def build(runs: list[dict], work: str, out: str, tiny: bool, blocks: dict[str, tuple[int, ...]]
          ) -> tuple[dict, dict, dict]:
    """Model folders for the rows, each row sized to the disk (row["size"]: its family's block counts at real width,
    `blocks`[family] or its default, halved where the disk is short; () for a family built whole; "tiny"; None:
    not run). Returns ({(family, size): folder}, {run: peak disk bytes at its size; not run: at its smallest}, the
    disk as measured)."""
    folders, parts = {}, {}  # parts: per family, its folder but the trained model at real width
    for name in (s.name for s in families.SPECS if any(r["family"] == s.name for r in runs)):  # in NAMES' order
        if tiny:
            folders[name, "tiny"] = tiny_default(name)
        else:
            parts[name] = parts_folder(name, work)
    for r in runs:
        r["size"] = "tiny" if tiny else tuple(blocks.get(r["family"], default_size(r["family"], False)))

    def folder(name, size):
        if (name, size) not in folders:
            folders[name, size] = skeleton(name, work, size, parts.get(name)) if size else parts[name]
        return folders[name, size]

    needs = {}

    def need(row, size):
        if (row["run"], size) not in needs:
            one, export = row_bytes(row, folder(row["family"], size))
            needs[row["run"], size] = peak_disk(one, export, row["resume"])
        return needs[row["run"], size]

    same_disk = os.stat(disk_usage(work)[0]).st_dev == os.stat(disk_usage(out)[0]).st_dev
    unwritten = {}  # a trained model still to write costs its fp32 bytes where the runs write too

    def folder_cost(model):
        name, size = model
        if not isinstance(size, tuple) or not size or not same_disk:
            return 0
        if model not in unwritten:
            sub = os.path.join(folder(name, size), trained_subfolder(name))
            written = any(n.endswith(".safetensors") for n in os.listdir(sub))
            unwritten[model] = 0 if written else folder_bytes(name, folder(name, size))
        return unwritten[model]

    def smallest(size):
        while smaller_blocks(size) is not None:
            size = smaller_blocks(size)
        return size

    def smaller(row, model):  # the same family with fewer blocks
        half = smaller_blocks(model[1])
        return (model[0], half) if half else None

    path, free, total = disk_usage(out)
    keyed = [{**r, "size": (r["family"], r["size"])} for r in runs]  # fit_to_disk's sizes: (family, size)
    choice = fit_to_disk(keyed, free, lambda r, model: need(r, model[1]), folder_cost, smaller)
    peaks = {r["run"]: need(r, choice[r["run"]][1] if choice[r["run"]] else smallest(r["size"])) for r in runs}
    to_write = sum(folder_cost(z) for z in set(choice.values()) if z is not None)
    for r in runs:
        r["size"] = choice[r["run"]] and choice[r["run"]][1]
    for (name, size), f in list(folders.items()):
        if isinstance(size, tuple) and size:
            if (name, size) in choice.values():
                trained_weights(name, f)
            else:  # a size tried and not taken: its config and links only
                shutil.rmtree(f)
                del folders[name, size]
    return folders, peaks, {"path": path, "free": free, "total": total, "to_write": to_write}


# ----------------------------------------------------------------------------------------------
# GPU memory: the planner's total for each row


def fake_score_fp32(extra: dict) -> bool:
    """A DMD2 row's FAKE_SCORE_FP32: its own, or train_dmd.py's default (the planner's Settings mirrors it)."""
    from tools import memory_plan
    return bool(int(extra.get("fake_score_fp32", memory_plan.Settings.fake_score_fp32)))


def fake_lora(extra: dict) -> bool:
    """A DMD2 row's FAKE_LORA: the fake score trained as adapters too (with a LORA_RANK)."""
    return bool(int(extra.get("fake_lora", 0)))


def planned_bytes(model: str, world: int, s: dict, script: str, gpu_gb: float) -> int:
    """The planner's GPU total for a row, with the scripts' RESHARD_AFTER_FORWARD=auto on a GPU of `gpu_gb` (a video
    row: its NUM_FRAMES, else the family's frames)."""
    from tools import memory_plan
    extra = s.get("extra", {})
    settings = memory_plan.Settings(world_size=world, precision=s["precision"], batch_size=s["batch_size"],
                                    resolution=s["resolution"], activation_checkpointing=s.get("ac", False),
                                    lora_rank=s.get("lora_rank", 0), base_dtype=s.get("base_dtype", ""),
                                    optimizer=s.get("optimizer", "adamw"), script=script,
                                    fake_score_fp32=fake_score_fp32(extra), fake_lora=fake_lora(extra),
                                    frames=int(extra["num_frames"]) if "num_frames" in extra else None,
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
