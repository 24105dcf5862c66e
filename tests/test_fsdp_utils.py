"""fsdp_utils.py: 2-rank FSDP/HSDP (with activation checkpointing, prefetch, CPU offload, bf16) vs
one process, sharding to half per rank, block detection, mesh checks.

    python -m pytest tests/test_fsdp_utils.py -q
"""
from __future__ import annotations


import os

import pytest
import torch

from tests.conftest import TinyNet, make_data, run_ranks

import fsdp_utils
from core import launch
from core.dist import mean_across_ranks
from core.errors import ConfigError
from components.optim import adamw
from data.batches import rank_slice
from parallel import memory
from parallel.parallelize import parallelize


# ----------------------------------------------------------------------------------------------
# a tiny model with a repeated block class

def train_reference(steps=5, global_batch=8, clip=0.5):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    losses, norms = [], []
    for x, y in make_data(steps, global_batch):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _parity(rank, world, dp_replicate, ac, prefetch, mode="fp32", offload=False, tol=1e-5):
    from precision import get_precision
    ref_losses, ref_norms, ref_params = train_reference()
    torch.manual_seed(0)
    model = TinyNet()
    mesh = fsdp_utils.build_meshes(torch.device("cpu"), dp_replicate)[0]
    sharding = fsdp_utils.Sharding(activation_checkpointing=ac, prefetch=prefetch, cpu_offload=offload)
    blocks = parallelize(model, mesh, get_precision(mode).mp_policy(), sharding, block_classes=["Block"], verbose=False)
    assert len(blocks) == 3
    fsdp_utils.assert_sharded(model, mesh)
    # the scripts' optimizer: fused AdamW over the DTensor shards, against torch's default on one process
    opt = adamw(model.parameters(), lr=1e-2, weight_decay=0.01)
    assert opt.defaults["fused"]
    for i, (x, y) in enumerate(make_data(5, 8)):
        x, y = rank_slice(x, rank, world), rank_slice(y, rank, world)
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        norm = fsdp_utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        mean_loss = mean_across_ranks({"loss": float(loss)})["loss"]
        assert abs(mean_loss - ref_losses[i]) < tol * max(1, abs(ref_losses[i])), (i, mean_loss, ref_losses[i])
        assert abs(float(norm) - ref_norms[i]) < tol * max(1, ref_norms[i]), (i, float(norm), ref_norms[i])
    for k, v in model.state_dict().items():
        assert v.dtype == torch.float32  # master weights stay fp32 in every mode tested here
        # Adam moves each weight by at most ~lr per step, so bf16 noise can flip a few of 5 updates
        atol = tol / 10 if mode == "fp32" else 5 * 1e-2
        torch.testing.assert_close(v.full_tensor(), ref_params[k], rtol=tol, atol=atol)
    report = memory.memory_report({"m": model}, {"m": opt})
    assert "rss_peak" in report
    if dp_replicate == 1 and not ac:
        _frozen_model_reshards_after_no_grad_forwards(mesh)


def _frozen_model_reshards_after_no_grad_forwards(mesh):
    """A frozen model (DMD2's teacher) only ever runs no-grad forwards: with Sharding(frozen=True)
    every unit and the root are sharded again after each, while a trainable model's last unit and
    root stay gathered for the backward that a frozen model never runs."""
    from torch.distributed.tensor import DTensor

    from precision import Precision
    for frozen in (True, False):
        model = TinyNet().requires_grad_(False)
        parallelize(model, mesh, Precision.frozen_mp_policy(torch.float32), fsdp_utils.Sharding(frozen=frozen),
                    block_classes=["Block"], verbose=False)
        with torch.no_grad():
            model(torch.randn(2, 8))
        gathered = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
        assert (gathered == []) == frozen, (frozen, gathered)


@pytest.mark.slow
@pytest.mark.parametrize("dp_replicate,ac,prefetch", [(1, False, 0), (2, False, 0), (1, True, 1)],
                         ids=["fsdp", "hsdp", "fsdp-ac-prefetch"])
def test_two_rank_parity_with_one_process(dp_replicate, ac, prefetch):
    run_ranks(_parity, 2, dp_replicate, ac, prefetch)


@pytest.mark.slow
def test_bf16_mixed_with_offload_and_checkpointing_tracks_fp32():
    # bf16 compute against an fp32 reference: agreement to bf16 precision, fp32 master weights
    run_ranks(_parity, 2, 1, True, 0, "bf16-mixed", True, 3e-2)


def _step_copies(mesh, after_forward):
    """One bf16-mixed step of TinyNet on `mesh` with RESHARD_AFTER_FORWARD = `after_forward`: (loss,
    the parameters after AdamW, the aten copies the step dispatched, whether its blocks stayed gathered
    between forward and backward)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from precision import get_precision

    class Copies(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Copies.n += func is torch.ops.aten.copy_.default
            return func(*args, **(kwargs or {}))
    torch.manual_seed(0)
    model = TinyNet()
    blocks = parallelize(model, mesh, get_precision("bf16-mixed").mp_policy(),
                         fsdp_utils.Sharding(reshard_after_forward=after_forward), block_classes=["Block"],
                         verbose=False)
    opt = adamw(model.parameters(), lr=1e-2)
    x, y = make_data(1, 4)[0]
    with Copies():
        loss = ((model(x) - y) ** 2).mean()
        gathered = [b._get_fsdp_state()._fsdp_param_group.is_unsharded for b in blocks[:-1]]
        loss.backward()
    opt.step()
    return loss.detach(), [p.full_tensor() for p in model.parameters()], Copies.n, all(gathered)


def _auto_reshard(rank, world):
    """RESHARD_AFTER_FORWARD=auto: resharded across the ranks of a shard group; where each rank's
    shard group is itself (HSDP with DP_REPLICATE = world: the world-size-1 path of FSDP2), reshard-free,
    with the same loss and weights bit for bit and fewer copies (each cast-copy made once)."""
    from precision import get_precision
    flat = fsdp_utils.build_meshes(torch.device("cpu"))[0]
    policy = get_precision("bf16-mixed").mp_policy()
    assert fsdp_utils.auto_reshard(TinyNet(), flat, policy)[0] is True
    replicas = fsdp_utils.build_meshes(torch.device("cpu"), dp_replicate=world)[0]
    assert fsdp_utils.shard_group_size(replicas) == 1
    keep, why = fsdp_utils.auto_reshard(TinyNet(), replicas, policy)
    assert keep is False and why.startswith("reshard-free"), why
    assert fsdp_utils.auto_reshard(TinyNet(), replicas, policy, cpu_offload=True)[0] is True
    on, off = _step_copies(replicas, True), _step_copies(replicas, None)
    assert torch.equal(on[0], off[0]) and all(torch.equal(a, b) for a, b in zip(on[1], off[1], strict=True))
    assert not on[3] and off[3], "auto kept the blocks gathered from forward to backward"
    assert off[2] < on[2], (off[2], on[2])
    # NF4 on one-rank shard groups stays out of FSDP2, whose world-size-1 path copies one inner tensor of three
    from parallel import lowbit
    from precision import Precision
    m = torch.nn.Sequential(torch.nn.Linear(128, 256, bias=False)).requires_grad_(False).to(torch.bfloat16)
    lowbit.quantize_base(m, shards=1)
    x = torch.randn(2, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = m(x)
        parallelize(m, replicas, Precision.frozen_mp_policy(torch.bfloat16), fsdp_utils.Sharding(frozen=True),
                    block_classes=["Linear"], verbose=False)
        assert fsdp_utils.unsharded_on_one_rank(m, replicas) == {m[0].weight}
        assert torch.equal(m(x), ref)


@pytest.mark.slow
def test_auto_reshard_keeps_the_gathered_copy_only_where_nothing_is_sharded():
    run_ranks(_auto_reshard, 2)


def test_reshard_free_only_where_the_copy_is_small_and_not_offloaded():
    gib = 2**30
    assert fsdp_utils.reshard_free_fits(2, False, gib, 80 * gib)[0] is True
    assert fsdp_utils.reshard_free_fits(1, False, gib, 80 * gib)[0] is False
    assert fsdp_utils.reshard_free_fits(1, False, 9 * gib, 80 * gib)[0] is True  # over 10 %
    assert fsdp_utils.reshard_free_fits(1, True, gib, 80 * gib)[0] is True  # CPU offload: least GPU memory
    assert [fsdp_utils.parse_reshard(v) for v in ("auto", "1", "0", True, "false")] == [None, True, False, True, False]
    with pytest.raises(ConfigError, match="RESHARD_AFTER_FORWARD='sometimes'"):
        fsdp_utils.parse_reshard("sometimes")


def _sharded_bytes(rank, world):
    from precision import get_precision
    model = TinyNet(d=32)
    full = sum(p.numel() for p in model.parameters())
    mesh = fsdp_utils.build_meshes(torch.device("cpu"))[0]
    parallelize(model, mesh, get_precision("bf16-mixed").mp_policy(), verbose=False)
    local = memory.local_state_bytes({"m": model}, {})["params"]
    # the largest repeated class was detected, and each rank stores about half, in fp32
    assert abs(local - full * 4 / 2) <= full * 4 * 0.02, (local, full)


@pytest.mark.slow
def test_detected_blocks_shard_half_per_rank():
    run_ranks(_sharded_bytes, 2)


# ----------------------------------------------------------------------------------------------
# block detection, settings

def test_find_block_classes():
    m = TinyNet()
    assert fsdp_utils.find_block_classes(m, ["Block"])[0] == ["Block"]
    names, why = fsdp_utils.find_block_classes(m)
    assert names == ["Block"] and "largest repeated" in why
    m._no_split_modules = ["Block", "Missing"]
    assert fsdp_utils.find_block_classes(m) == (["Block"], "TinyNet._no_split_modules")
    with pytest.raises(ConfigError, match="not found"):
        fsdp_utils.find_block_classes(m, ["BasicTransformerBlock"])


def test_dp_replicate_must_divide_world():
    fsdp_utils.check_dp_replicate(2, 4)
    with pytest.raises(ConfigError, match="DP_REPLICATE=3 does not divide the world size 2"):
        fsdp_utils.check_dp_replicate(3, 2)


def test_gpu_index_fits_how_the_scheduler_exposes_gpus():
    assert [launch.gpu_index(r, 8, 8) for r in range(8)] == list(range(8))  # torchrun: all GPUs to each rank
    assert [launch.gpu_index(r, 8, 1) for r in range(8)] == [0] * 8  # one visible GPU per rank (SLURM, k8s)
    with pytest.raises(ConfigError, match="LOCAL_RANK=3 of LOCAL_WORLD_SIZE=4 ranks on this node, but 2 GPUs"):
        launch.gpu_index(3, 4, 2)  # two ranks would share a GPU
    # torchrun's workers all see the same GPUs: 4 ranks on a 1-GPU node is refused up front
    with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE=4 ranks on this node but 1 GPU"):
        launch.gpu_index(1, 4, 1, same_devices=True)
    assert launch.gpu_index(0, 1, 1, same_devices=True) == 0


def test_ranks_sharing_a_gpu_are_named():
    """Every rank's (host, GPU UUID) in rank order: a UUID on two ranks is one line naming them and
    the host; distinct UUIDs, or CPU ranks (no UUID), pass."""
    a, b = "GPU-1111", "GPU-2222"
    assert launch.shared_gpus([("n1", a), ("n1", b), ("n2", "GPU-3333"), ("n2", "GPU-4444")]) is None
    assert launch.shared_gpus([("n1", ""), ("n1", ""), ("n2", "")]) is None
    line = launch.shared_gpus([("n1", a), ("n2", b), ("n2", "GPU-5"), ("n2", b)])
    assert line.startswith(f"ranks 1, 3 share one GPU on n2 ({b})") and "\n" not in line
    line = launch.shared_gpus([("n1", a), ("n1", a), ("n2", b), ("n2", b)])
    assert "ranks 0, 1 share one GPU on n1" in line and "and 1 more GPU(s) shared" in line


def test_cpu_threads_share_the_cpus_this_process_may_use(monkeypatch):
    """The affinity's CPUs (a SLURM task's or container's share), not the host's count, shared by
    the node's ranks; an srun-started rank bound to its own CPUs keeps them."""
    monkeypatch.setattr(os, "cpu_count", lambda: 128)  # the host: not what this process may use
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # torchrun's default
    assert launch.cpu_threads(8) == 2 and launch.cpu_threads(32) == 1
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert launch.cpu_threads(4) == 4
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "16")  # srun bound this task to its 16 CPUs
    assert launch.cpu_threads(8, per_task=True) == 16 and launch.cpu_threads(8) == 2
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "2")  # 16 CPUs visible but 2 per task: not bound, shared
    assert launch.cpu_threads(8, per_task=True) == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "6")
    assert launch.cpu_threads(8) == 6


def _accumulation_comms(rank, world, mode):
    """Grad accumulation over 4 micro-batches: the cross-replica all-reduces (HSDP) or DDP's bucket
    all-reduces happen once per step with gradient_sync, four times without; same gradients."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from precision import get_precision
    data = make_data(1, 8 * world)[0]
    grads, calls = {}, {}
    for synced in (False, True):
        torch.manual_seed(0)
        model = TinyNet()
        if mode == "hsdp":
            mesh = fsdp_utils.build_meshes(torch.device("cpu"), 2)[0]
            parallelize(model, mesh, get_precision("fp32").mp_policy(), block_classes=["Block"], verbose=False)
            wrapped = model
        else:
            wrapped = fsdp_utils.apply_ddp(model, torch.device("cpu"), verbose=False)
        count = [0]
        real = dist.all_reduce

        def counting(*args, **kwargs):
            count[0] += 1
            return real(*args, **kwargs)

        def counting_hook(state, bucket):
            count[0] += 1
            return allreduce_hook(state, bucket)
        if mode == "ddp":
            wrapped.register_comm_hook(None, counting_hook)
        dist.all_reduce = counting
        try:
            x, y = (t[rank * 8:(rank + 1) * 8] for t in data)
            for m in range(4):
                with fsdp_utils.gradient_sync(wrapped, last_micro_batch=m == 3 or not synced):
                    loss = torch.nn.functional.mse_loss(wrapped(x[2 * m:2 * m + 2]), y[2 * m:2 * m + 2]) / 4
                    loss.backward()
        finally:
            dist.all_reduce = real
        calls[synced] = count[0]
        grads[synced] = [(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                         for p in model.parameters()]
    assert calls[True] * 4 == calls[False] and calls[True] > 0, calls
    for a, b in zip(grads[False], grads[True]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("mode, world", [("hsdp", 4), ("ddp", 2)])
def test_accumulation_communicates_once_per_step_where_it_can(mode, world):
    run_ranks(_accumulation_comms, world, mode)
