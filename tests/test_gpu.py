"""The CUDA/NCCL path: what only a GPU runs. Every test here is skipped without CUDA (a GPU is lent
to few sessions of this project); tools/gpu_check.sh runs the longer acceptance check.

    python -m pytest tests/test_gpu.py -q        # on a machine with >= 1 CUDA GPU
"""
from __future__ import annotations

import os

import pytest
import torch

from core.dist import (agree, all_gather_objects, all_reduce, barrier, broadcast_from_rank0, comm_device,
                             mean_across_ranks)
from tests.conftest import launch, run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def _nccl_helpers(rank, world):
    import torch.distributed as dist
    assert dist.get_backend() == "nccl" and comm_device().type == "cuda"
    # CPU tensors in, as the scripts hand them over: the helpers move them to the GPU and back
    total = all_reduce(torch.tensor([float(rank + 1)]))
    assert total.device.type == "cpu" and total.item() == world * (world + 1) / 2
    assert agree(True, rank != 0, torch.tensor(True, device="cuda")) == (True, False, True)
    assert mean_across_ranks({"loss": float(rank)}) == {"loss": (world - 1) / 2}
    assert broadcast_from_rank0(rank) == 0
    assert all_gather_objects(rank) == list(range(world))
    barrier()


def test_nccl_init_and_every_collective_helper():
    run_ranks(_nccl_helpers, GPUS)


_KONTEXT_BASE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "kontext_base")
_KONTEXT_PAIRS = os.path.join(os.path.dirname(_KONTEXT_BASE), "kontext_blue", "train.jsonl")


@pytest.mark.parametrize("script, args", [
    ("train_dmd.py", ["--dfake_gen_update_ratio=1", "--ema_decay=0.9"]),
    ("train_dmd.py", [f"--model_path={_KONTEXT_BASE}", f"--data_path={_KONTEXT_PAIRS}", "--resolution=32",
                      "--dfake_gen_update_ratio=1", "--ema_decay=0.9", "--use_gan=1", "--denoising_steps=999,499"]),
    ("train_dmd.py", ["--parallelism=ddp", "--precision=bf16", "--dfake_gen_update_ratio=1", "--ema_decay=0.9"]),
    ("train_flux_kontext.py", ["--lora_rank=4", "--val_every=1"]),
    ("train_flux_kontext.py", ["--parallelism=ddp", "--lora_rank=4", "--val_every=1"]),
], ids=["dmd", "dmd-kontext-gan", "dmd-ddp-bf16", "kontext-lora", "kontext-ddp-lora"])
def test_two_steps_on_one_gpu(tmp_path, script, args):
    out = tmp_path / "out"
    launch(script, args + ["--max_steps=2", "--sample_every=2", "--save_every=1", "--log_every=1",
                           "--sample_steps=1" if script == "train_flux_kontext.py" else "--sample_count=2",
                           f"--output_dir={out}"],
           ranks=1)
    assert os.path.exists(out / "samples" / "step_000002.png")
    assert os.path.exists(out / "checkpoints" / "step_000002" / ".metadata")
    launch(script, args + ["--max_steps=3", "--resume=auto", "--sample_every=0", "--log_every=1",
                           f"--output_dir={out}"], ranks=1)


def test_nf4_weight_filled_from_a_host_tensor_lives_on_the_gpu():
    """The QLoRA load path on CUDA: the safetensors slice is on the host, the shard on the GPU;
    every inner tensor (codes, scales, code book) must end on the GPU and the layer must run."""
    pytest.importorskip("torchao")
    from parallel import lowbit
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(3072, 3072, bias=False, dtype=torch.bfloat16))
    model.requires_grad_(False)
    lowbit.quantize_base(model, 1)
    model.to_empty(device="cuda")
    full = torch.randn(3072, 3072, dtype=torch.bfloat16)  # on the host, as read from safetensors
    lowbit.fill_nf4(model[0].weight, full)
    lowbit.check_devices(model)
    assert lowbit.misplaced_inner_tensors(model[0].weight, torch.device("cuda")) == []
    x = torch.randn(4, 3072, device="cuda", dtype=torch.bfloat16)
    err = (model(x).float() - x.float() @ full.cuda().float().T).norm() / (x.float() @ full.cuda().float().T).norm()
    assert err < 0.15, err  # 4-bit weights


def test_attention_self_check_at_flux_width():
    from parallel import attention
    shape = attention.Shape("FLUX at 1024 px", 1, 512 + 2 * 4096, 512 + 2 * 4096, 24, 128)
    attention.sdpa_flags("native")
    lines = attention.self_check([(shape, attention.dispatcher_attend("native"))], "native", torch.bfloat16,
                                 torch.device("cuda"))
    assert "fwd+bwd" in lines[0]


def test_host_to_device_copies_are_pinned_and_exact():
    from data.prefetch import to_device
    ids = torch.randint(0, 49408, (4, 77))
    moved = to_device(ids, torch.device("cuda"))
    assert moved.device.type == "cuda" and torch.equal(moved.cpu(), ids)
