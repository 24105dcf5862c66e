"""parallel/ema.py: the EMA a script keeps (a full copy, or of a LoRA model's adapters only), its
update, and the weights samples and exports use. Sharded EMAs are checked end to end by the
scripts' tests (test_train_dmd.py, test_lora.py); here single-process, plain tensors.

    python -m pytest tests/test_ema.py -q
"""
from __future__ import annotations

import copy

import pytest
import torch

from families import MODELS
from parallel import ema as ema_lib
from parallel import lora
from tests.conftest import tiny_unet
from tests.numerics import assert_within, unit_roundoff, threads_as_started  # noqa: F401 (autouse)


def moved(ema: torch.Tensor, start: torch.Tensor, step: float, weight: float) -> None:
    """ema == start + weight·step after a lerp from start towards start + step, to fp32 rounding:
    start + step, the difference, the product, the sum and the reference each round once, by
    at most u·(|start| + step)."""
    assert_within(ema, start.double() + weight * step, 5 * unit_roundoff() * (start.double().abs() + step))


def test_no_decay_no_ema():
    assert ema_lib.build_ema(torch.nn.Linear(2, 2), 0.0, lambda: None) is None


def test_full_copy_starts_equal_and_moves_by_one_minus_decay():
    model = torch.nn.Linear(3, 2)
    ema = ema_lib.build_ema(model, 0.9, lambda: torch.nn.Linear(3, 2))
    assert not isinstance(ema, ema_lib.AdapterEMA) and not ema.training
    assert all(torch.equal(a, b) and not a.requires_grad for a, b in zip(ema.parameters(), model.parameters()))
    before = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema_lib.ema_update(ema, model, 0.9)
    for e, b in zip(ema.parameters(), before.parameters()):
        moved(e, b, 1.0, 0.1)
    with ema_lib.output_weights(model, ema) as out:
        assert out is ema


def test_lora_ema_holds_only_the_adapters_and_swaps_them_in():
    unet = tiny_unet()
    lora.add_lora(unet, lora.Lora(rank=2), MODELS["UNet2DConditionModel"])
    lora.init_lora(unet, seed=0)
    adapters = [p for p in unet.parameters() if p.requires_grad]
    ema = ema_lib.build_ema(unet, 0.75, lambda: None)
    assert isinstance(ema, ema_lib.AdapterEMA) and len(list(ema.parameters())) == len(adapters)
    trained = [p.detach().clone() for p in adapters]
    with torch.no_grad():
        for p in adapters:
            p.add_(2.0)
    ema_lib.ema_update(ema, unet, 0.75)  # asymmetric: decay and 1 - decay differ
    with ema_lib.output_weights(unet, ema) as out:
        assert out is unet
        for p, t in zip(adapters, trained):
            moved(p, t, 2.0, 0.25)  # 0.75 * t + 0.25 * (t + 2)
    for p, t in zip(adapters, trained):
        torch.testing.assert_close(p, t + 2.0)  # swapped back


def _sharded_ema(rank, world, lora_rank):
    """The update on FSDP2 shards, of a full copy or of the adapters only, against the
    hand-computed value."""
    import fsdp_utils
    from parallel.parallelize import parallelize
    from precision import get_precision
    from tests.conftest import TinyNet
    mesh = fsdp_utils.build_meshes(torch.device("cpu"))[0]

    def build():
        torch.manual_seed(0)
        model = tiny_unet() if lora_rank else TinyNet()
        if lora_rank:
            lora.add_lora(model, lora.Lora(rank=lora_rank), MODELS["UNet2DConditionModel"])
            lora.init_lora(model, seed=0)
        parallelize(model, mesh, get_precision("fp32").mp_policy(), verbose=False,
                    facts=MODELS.get(type(model).__name__))
        return model
    model = build()
    ema = ema_lib.build_ema(model, 0.9, build)
    assert isinstance(ema, ema_lib.AdapterEMA) == bool(lora_rank)
    start = [p.full_tensor().clone() for p in ema.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                fsdp_utils.local_tensor(p).add_(1.0)
    ema_lib.ema_update(ema, model, 0.9)
    for p, s in zip(ema.parameters(), start, strict=True):
        moved(p.full_tensor(), s, 1.0, 0.1)  # 0.9 * s + 0.1 * (s + 1); flipped: s + 0.9


@pytest.mark.slow
@pytest.mark.parametrize("lora_rank", [0, 2], ids=["full", "lora"])
def test_sharded_update_is_hand_computed(lora_rank):
    from tests.conftest import run_ranks
    run_ranks(_sharded_ema, 2, lora_rank)
