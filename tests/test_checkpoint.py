"""Sharded checkpoints: bit-exact resume (sync and async), 2 ranks -> 1 rank, a save killed midway,
keep-last pruning, two runs in one OUTPUT_DIR (refused; beside each other with RESUME=new, neither
pruning nor resuming the other's), resume unpickling nothing but tensors and plain types, export to
a diffusers folder.

    python -m pytest tests/test_checkpoint.py -q
"""
from __future__ import annotations

import json
import os
import re

import pytest
import torch

from tests.conftest import TinyNet, finish, launch, make_data, run_ranks, start, tiny_unet

import checkpoint
import fsdp_utils
from core.errors import ConfigError
from components.export import export_model, export_pipeline
from data.batches import rank_slice
from families import MODELS
from parallel.parallelize import parallelize
from precision import get_precision


def build(seed, mesh):
    torch.manual_seed(seed)
    model = TinyNet()
    parallelize(model, mesh, get_precision("fp32").mp_policy(), block_classes=["Block"], verbose=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    return model, opt, sched


def train(model, opt, sched, data, start, stop, rank, world):
    for x, y in data[start:stop]:
        x, y = rank_slice(x, rank, world), rank_slice(y, rank, world)
        # a dropout-like use of the global RNG: resume must restore per-rank RNG state too
        noise = 1e-3 * torch.randn_like(x)
        ((model(x + noise) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()


def full(model):
    return {k: v.full_tensor() for k, v in model.state_dict().items()}


def _resume(rank, world, out, async_save):
    mesh = fsdp_utils.build_meshes(torch.device("cpu"))[0]
    data = make_data(6, 8)
    torch.manual_seed(100 + rank)
    straight = build(0, mesh)
    train(*straight, data, 0, 6, rank, world)
    expected = full(straight[0])

    torch.manual_seed(100 + rank)
    model, opt, sched = build(0, mesh)
    train(model, opt, sched, data, 0, 3, rank, world)
    ck = checkpoint.Checkpointer(out, {"m": model}, {"m": (model, opt)}, {"m": sched}, {"LR": 1e-2},
                                 keep_last=2, async_save=async_save)
    ck.write(3, {"samples_seen": 24})
    ck.wait()
    torch.manual_seed(12345)  # scramble the RNG: resume must put it back
    del model, opt, sched
    model, opt, sched = build(7, mesh)  # different init: everything must come from the checkpoint
    path = checkpoint.resolve_resume("auto", out)
    assert path.endswith("step_000003")
    ck = checkpoint.Checkpointer(out, {"m": model}, {"m": (model, opt)}, {"m": sched}, {})
    meta = ck.load(path)
    assert meta["step"] == 3 and meta["samples_seen"] == 24
    train(model, opt, sched, data, 3, 6, rank, world)
    for k, v in full(model).items():
        assert torch.equal(v, expected[k]), k


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_resume_is_bit_exact(tmp_path, async_save):
    run_ranks(_resume, 2, str(tmp_path), async_save)


def _save_two_ranks(rank, world, out):
    mesh = fsdp_utils.build_meshes(torch.device("cpu"))[0]
    model, opt, sched = build(0, mesh)
    train(model, opt, sched, make_data(2, 8), 0, 2, rank, world)
    checkpoint.Checkpointer(out, {"m": model}, {"m": (model, opt)}, {"m": sched}, {}).write(2, {})
    weights, exp_avg = full(model), {}
    for k, st in opt.state.items():
        exp_avg[len(exp_avg)] = st["exp_avg"].full_tensor()
    if rank == 0:
        torch.save((weights, exp_avg), os.path.join(out, "expected.pt"))


def _load_one_rank(rank, world, out):
    mesh = fsdp_utils.build_meshes(torch.device("cpu"))[0]
    model, opt, sched = build(5, mesh)
    ck = checkpoint.Checkpointer(out, {"m": model}, {"m": (model, opt)}, {"m": sched}, {})
    meta = ck.load(checkpoint.resolve_resume("auto", out))
    assert meta["world_size"] == 2 and sched.last_epoch == 2
    weights, exp_avg = torch.load(os.path.join(out, "expected.pt"))
    for k, v in full(model).items():
        assert torch.equal(v, weights[k]), k
    for i, st in enumerate(opt.state.values()):
        assert torch.equal(st["exp_avg"].full_tensor(), exp_avg[i])


@pytest.mark.slow
def test_saved_on_two_ranks_resumes_on_one(tmp_path):
    run_ranks(_save_two_ranks, 2, str(tmp_path))
    run_ranks(_load_one_rank, 1, str(tmp_path))


# a save killed midway: the child saves step 2, then dies inside the save of step 4
KILL_SCRIPT = r"""
import os, sys, torch
import fsdp_utils, checkpoint
import torch.distributed.checkpoint.filesystem as fs
from tests.test_checkpoint import build, train
from tests.conftest import make_data
dist = fsdp_utils.init_distributed()
mesh = fsdp_utils.build_meshes(dist.device)[0]
model, opt, sched = build(0, mesh)
train(model, opt, sched, make_data(2, 8), 0, 2, 0, 1)
ck = checkpoint.Checkpointer({out!r}, {{"m": model}}, {{"m": (model, opt)}}, {{"m": sched}}, {{}}, keep_last=1)
ck.write(2, {{}})
torch.save({{k: v.full_tensor() for k, v in model.state_dict().items()}}, {out!r} + "/at2.pt")
def die(*a, **k):
    os._exit(9)
setattr(fs.FileSystemWriter, {where!r}, die)
train(model, opt, sched, make_data(4, 8), 2, 4, 0, 1)
ck.write(4, {{}})
"""


def _load_after_kill(rank, world, out):
    mesh = fsdp_utils.build_meshes(torch.device("cpu"))[0]
    model, opt, sched = build(3, mesh)
    path = checkpoint.resolve_resume("auto", out)
    assert path.endswith("step_000002"), path
    checkpoint.Checkpointer(out, {"m": model}, {"m": (model, opt)}, {"m": sched}, {}).load(path)
    expected = torch.load(os.path.join(out, "at2.pt"))
    for k, v in full(model).items():
        assert torch.equal(v, expected[k]), k


@pytest.mark.slow
@pytest.mark.parametrize("where", ["write_data", "finish"])
def test_killed_save_leaves_previous_checkpoint(tmp_path, where):
    out = str(tmp_path)
    script = tmp_path / "kill.py"
    script.write_text(KILL_SCRIPT.format(out=out, where=where))
    rc, log = finish(start(str(script), ranks=1), 300)
    assert rc == 9, log[-2000:]
    names = sorted(os.listdir(os.path.join(out, "checkpoints")))
    assert names == ["step_000002", "step_000004.partial"], names
    run_ranks(_load_after_kill, 1, out)


def test_the_checkpointer_decides_when_to_save(tmp_path):
    """SAVE_EVERY multiples, the last step, and a stop (written before save() returns); a step is
    never written twice, and a resumed step counts as written."""
    written = []
    ck = checkpoint.Checkpointer(str(tmp_path), {}, {}, {}, {}, save_every=2, last_step=7)
    ck.write = lambda step, state: written.append(step) or f"step_{step}"
    for step in range(1, 8):
        ck.save(step, {}, stopping=step == 3)
    assert written == [2, 3, 4, 6, 7]
    ck.save(7, {}, stopping=True)  # a stop at the last step: already written
    assert written == [2, 3, 4, 6, 7]
    never = checkpoint.Checkpointer(str(tmp_path), {}, {}, {}, {}, save_every=0, last_step=3)
    never.write = lambda step, state: written.append(-step)
    never.saved_step = 3  # as after resuming from step 3
    never.save(3, {}, stopping=True)
    assert [s for s in written if s < 0] == []
    assert [never.due(s) for s in (1, 2, 3, 4)] == [False, False, False, False]


def test_keep_last_prunes_oldest(tmp_path):
    def fake(step, complete=True):
        d = tmp_path / "checkpoints" / (f"step_{step:06d}" + ("" if complete else ".partial"))
        d.mkdir(parents=True)
        (d / "trainer_state.json").write_text("{}")  # naming no run: written before checkpoints did
        if complete:
            (d / ".metadata").write_text("x")
    for s in (1, 2, 3):
        fake(s)
    fake(0, complete=False)
    ck = checkpoint.Checkpointer.__new__(checkpoint.Checkpointer)
    ck.root, ck.keep_last, ck.run_id = str(tmp_path / "checkpoints"), 2, checkpoint.LEGACY
    ck._prune()
    assert [s for s, _ in checkpoint.list_checkpoints(str(tmp_path))] == [2, 3]
    assert sorted(os.listdir(ck.root)) == ["step_000002", "step_000003"]
    with pytest.raises(ConfigError, match="not a complete checkpoint"):
        checkpoint.resolve_resume(str(tmp_path / "nowhere"), str(tmp_path))
    assert checkpoint.resolve_resume("", str(tmp_path / "elsewhere")) is None


def _export(rank, world, src, out, dtype_name):
    from diffusers import UNet2DConditionModel
    from precision import parse_dtype
    mesh = fsdp_utils.build_meshes(torch.device("cpu"))[0]
    model = UNet2DConditionModel.from_pretrained(os.path.join(src, "unet"))
    with torch.no_grad():  # "training" changed the weights
        for p in model.parameters():
            p.add_(0.01)
    parallelize(model, mesh, get_precision("fp32").mp_policy(), verbose=False, facts=MODELS["UNet2DConditionModel"])
    trained = full(model)
    export_pipeline(src, out, {"unet": model}, parse_dtype(dtype_name))
    if rank == 0:
        dtype = parse_dtype(dtype_name)
        loaded = UNet2DConditionModel.from_pretrained(os.path.join(out, "unet"), torch_dtype=dtype)
        for k, v in loaded.state_dict().items():
            assert v.dtype == dtype and torch.equal(v, trained[k].to(dtype)), k
        other = os.path.join(out, "other")  # a frozen part: its own folder of hard links, no symlink into src
        assert not os.path.islink(other) and all(os.path.samefile(os.path.join(other, f), os.path.join(src, "other", f))
                                                 for f in os.listdir(os.path.join(src, "other")))
        assert json.load(open(os.path.join(out, "model_index.json")))["unet"][1] == "UNet2DConditionModel"


@pytest.mark.slow
@pytest.mark.parametrize("dtype_name", ["fp32", "bf16"])
def test_export_loads_with_from_pretrained_and_equals_trained(tmp_path, dtype_name):
    src = tmp_path / "src"
    tiny_unet().save_pretrained(src / "unet")
    (src / "other").mkdir()
    (src / "other" / "config.json").write_text("{}")
    (src / "model_index.json").write_text(
        json.dumps({"_class_name": "X", "unet": ["diffusers", "UNet2DConditionModel"]})
    )
    run_ranks(_export, 2, str(src), str(tmp_path / "export"), dtype_name)


def test_export_shards_large_models(tmp_path):
    unet = tiny_unet()
    export_model(unet, str(tmp_path / "u"), torch.float32, max_shard_bytes=1_000_000)
    index = json.load(open(tmp_path / "u" / "diffusion_pytorch_model.safetensors.index.json"))
    assert len(set(index["weight_map"].values())) > 1
    from diffusers import UNet2DConditionModel
    loaded = UNet2DConditionModel.from_pretrained(str(tmp_path / "u"))
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, unet.state_dict()[k])


def _resume_is_rank0s(rank, world, root):
    """RESUME=auto is rank 0's newest checkpoint on every rank, even where another rank's listing
    differs (here: rank 1 lists an OUTPUT_DIR with a newer checkpoint); a bad path fails on all."""
    for step in (2, 4):
        folder = os.path.join(root, f"out{rank}", "checkpoints", f"step_{step:06d}")
        if rank == 1 or step == 2:
            os.makedirs(folder, exist_ok=True)
            for name in (".metadata", "trainer_state.json"):
                open(os.path.join(folder, name), "w").close()
    got = checkpoint.resolve_resume("auto", os.path.join(root, f"out{rank}"))
    assert got == os.path.join(root, "out0", "checkpoints", "step_000002"), got
    with pytest.raises(ConfigError, match="not a complete checkpoint"):
        checkpoint.resolve_resume(os.path.join(root, "nowhere"), root)


@pytest.mark.slow
def test_resume_auto_is_decided_by_rank0(tmp_path):
    run_ranks(_resume_is_rank0s, 2, str(tmp_path))


def test_scheduler_state_with_tensor_lrs_survives_json():
    """torchao's optimizers keep `lr` a tensor, so their LR scheduler's LRs are tensors: the state
    is written as plain floats and read back as tensors of the same values (the resume then steps
    on with the same LRs as an unbroken run; before, the JSON held "tensor(0.0010)" strings)."""
    import json

    import checkpoint

    def make():
        p = torch.nn.Parameter(torch.zeros(2))
        opt = torch.optim.SGD([p], lr=torch.tensor(1e-3))
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / 4)
    opt, sched = make()
    for _ in range(2):
        opt.step()
        sched.step()
    state = json.loads(json.dumps(checkpoint.scheduler_state(sched)))
    assert all(isinstance(v, float) for v in state["base_lrs"] + state["_last_lr"])
    opt2, sched2 = make()
    checkpoint.load_scheduler_state(sched2, state)
    assert all(torch.is_tensor(v) for v in sched2.base_lrs)
    sched.step()
    sched2.step()
    assert torch.equal(torch.as_tensor(opt.param_groups[0]["lr"]), torch.as_tensor(opt2.param_groups[0]["lr"]))


# ----------------------------------------------------------------------------------------------
# two runs in one OUTPUT_DIR; what resume unpickles


def tiny_checkpointer(out, seed: int = 0, keep_last: int = 2) -> checkpoint.Checkpointer:
    """A Checkpointer of an unsharded TinyNet and its AdamW in this process (no process group)."""
    torch.manual_seed(seed)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()  # optimizer states (and param_groups, DCP's non-tensor entries) to save
    return checkpoint.Checkpointer(str(out), {"m": model}, {"m": (model, opt)}, {}, {}, keep_last=keep_last)


def names(out) -> list[str]:
    return sorted(os.listdir(os.path.join(out, "checkpoints")))


def test_a_fresh_run_into_a_used_output_dir_is_refused(tmp_path):
    """RESUME="" where OUTPUT_DIR holds checkpoints (complete, or a crashed save's .partial) stops in
    one line naming RESUME=auto and a new OUTPUT_DIR; RESUME=new starts fresh beside them."""
    assert checkpoint.resolve_resume("", str(tmp_path)) is None  # nothing there: fresh
    (tmp_path / "checkpoints" / "step_000003.partial").mkdir(parents=True)
    for held in ("step_000003.partial", "step_000002"):
        if held == "step_000002":
            tiny_checkpointer(tmp_path).write(2, {})
        with pytest.raises(ConfigError) as e:
            checkpoint.resolve_resume("", str(tmp_path))
        message = str(e.value)
        assert "\n" not in message and "--resume=auto" in message and "new OUTPUT_DIR" in message, message
        assert held in message and "--resume=new" in message, message
        assert checkpoint.resolve_resume("new", str(tmp_path)) is None
    assert checkpoint.resolve_resume("auto", str(tmp_path)).endswith("step_000002")


@pytest.mark.slow
def test_a_script_refuses_a_used_output_dir_before_any_work(tmp_path):
    """train_dmd.py on 2 ranks, fresh, into an OUTPUT_DIR holding a checkpoint: it stops before a
    model is built, in one line (rank 0 decides, every rank stops; none waits)."""
    tiny_checkpointer(tmp_path).write(2, {})
    result = launch("train_dmd.py", [f"--output_dir={tmp_path}", "--max_steps=1"], check=False, timeout=240)
    assert result.returncode != 0, result.stdout[-3000:]  # the ranks' 2 (a setting's error), the launcher's 1
    lines = [line for line in result.stdout.splitlines() if "holds checkpoints of an earlier run" in line]
    assert lines and "--resume=auto" in lines[0] and "new OUTPUT_DIR" in lines[0], result.stdout[-3000:]
    assert "components (" not in result.stdout, result.stdout[-3000:]
    # no traceback but torchrun's own report of a failed rank (FSDP_TESTS_TORCHRUN=1), its ChildFailedError's
    raised = re.findall(r"^Traceback \(most recent call last\):\n(?:[ \t].*\n)*(.*)", result.stdout, re.M)
    assert all(e.startswith("torch.distributed.elastic.multiprocessing.errors.ChildFailedError") for e in raised), \
        result.stdout[-3000:]


def test_runs_beside_each_other_prune_and_resume_only_their_own(tmp_path):
    """Run A saves steps 2, 4, 6; run B (RESUME=new) beside it saves 2..8 with KEEP_LAST=1: B's steps
    that A holds go to step_N-<B's id>, B prunes only its own, A's stay byte for byte. RESUME=auto
    takes the run that saved last (B at 8); A resumed by path stays run A, its step 8 goes beside
    B's and its pruning leaves B's alone; then RESUME=auto is A's step 8."""
    out = str(tmp_path)
    a = tiny_checkpointer(out, seed=0, keep_last=3)
    for step in (2, 4, 6):
        a.write(step, {})
    a_files = {p: open(p, "rb").read() for _, p in checkpoint.list_checkpoints(out)
               for p in [os.path.join(p, "trainer_state.json"), os.path.join(p, ".metadata")]}
    assert checkpoint.resolve_resume("new", out) is None
    b = tiny_checkpointer(out, seed=1, keep_last=1)
    assert b.run_id != a.run_id
    for step in (2, 4, 6, 8):
        assert b.write(step, {}).endswith(f"-{b.run_id}") == (step < 8)
    assert names(out) == ["step_000002", "step_000004", "step_000006", "step_000008"]  # B's 6 beside A's: pruned
    assert {p: open(p, "rb").read() for p in a_files} == a_files  # A's untouched
    assert [s for s, _ in checkpoint.list_checkpoints(out, a.run_id)] == [2, 4, 6]
    assert checkpoint.list_checkpoints(out, b.run_id) == [(8, os.path.join(out, "checkpoints", "step_000008"))]
    assert checkpoint.resolve_resume("auto", out).endswith("step_000008")

    a2 = tiny_checkpointer(out, seed=2, keep_last=2)
    assert a2.load(os.path.join(out, "checkpoints", "step_000006"))["run_id"] == a.run_id == a2.run_id
    a2.write(8, {})  # step_000008 is B's: A's goes beside it; A keeps 2 of its own
    assert names(out) == ["step_000006", "step_000008", f"step_000008-{a.run_id}"]
    assert checkpoint.run_of(os.path.join(out, "checkpoints", "step_000008")) == b.run_id
    assert checkpoint.resolve_resume("auto", out).endswith(f"step_000008-{a.run_id}")


def test_rng_states_are_tensors_and_plain_types(tmp_path):
    """The RNG file loads with weights_only=True and puts every generator back; a file in the earlier
    format (numpy's state as an array) still loads; a pickle that would run code is refused in one line."""
    import pickle
    import random

    import numpy as np
    torch.manual_seed(5)
    np.random.seed(5)
    random.seed(5)
    np.random.standard_normal()  # a cached Gaussian in numpy's state
    random.gauss(0, 1)  # and in Python's
    path, old = str(tmp_path / "rank_0.pt"), str(tmp_path / "old.pt")
    torch.save(checkpoint.rng_state(), path)
    torch.save({"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}, old)
    draws = (torch.rand(3), np.random.standard_normal(3), [random.gauss(0, 1) for _ in range(3)])
    for file in (path, old):
        torch.manual_seed(0)
        np.random.seed(0)
        random.seed(0)
        checkpoint.set_rng_state(checkpoint.load_rng_state(file))
        again = (torch.rand(3), np.random.standard_normal(3), [random.gauss(0, 1) for _ in range(3)])
        assert torch.equal(draws[0], again[0]) and np.array_equal(draws[1], again[1]) and draws[2] == again[2]
    torch.load(path, weights_only=True)  # no allowance needed: tensors and plain types only

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "ran"),))
    with open(tmp_path / "evil.pt", "wb") as f:
        pickle.dump({"torch": Evil()}, f)
    with pytest.raises(checkpoint.RunError) as e:
        checkpoint.load_rng_state(str(tmp_path / "evil.pt"))
    assert "\n" not in str(e.value) and "evil.pt" in str(e.value)
    assert not os.path.exists(tmp_path / "ran")


class NotPlain:
    """A non-tensor checkpoint entry that only an unrestricted unpickler would rebuild."""


def test_dcp_non_tensor_entries_load_weights_only(tmp_path):
    """Optimizer param_groups (DCP's pickled non-tensor entries) load through weights_only=True, and
    the resumed optimizer equals the saved one; an entry needing more than plain types is refused."""
    import torch.distributed.checkpoint as dcp
    ck = tiny_checkpointer(tmp_path)
    ck.write(1, {})
    saved = ck.optimizers["m"][1].state_dict()
    again = tiny_checkpointer(tmp_path, seed=3)
    again.load(os.path.join(tmp_path, "checkpoints", "step_000001"))
    loaded = again.optimizers["m"][1].state_dict()
    assert saved["param_groups"] == loaded["param_groups"]
    for i, state in saved["state"].items():
        assert all(torch.equal(v, loaded["state"][i][k]) for k, v in state.items()), i
    dcp.save({"x": NotPlain()}, checkpoint_id=str(tmp_path / "odd"))
    with pytest.raises(checkpoint.RunError) as e:
        checkpoint._dcp_load({"x": NotPlain()}, str(tmp_path / "odd"))
    assert "\n" not in str(e.value) and "NotPlain" in str(e.value), str(e.value)
