"""precision.py: the mode table, dtype names, the FSDP2 policies and the dtype audit (no model
training, a second).

    python -m pytest tests/test_precision.py -q
"""

import pytest
import torch


import precision


def test_modes_decide_storage_compute_and_reduction():
    table = {name: (p.param_dtype, p.compute_dtype, p.reduce_dtype) for name, p in precision.MODES.items()}
    assert table == {"fp32": (torch.float32,) * 3,
                     "bf16-mixed": (torch.float32, torch.bfloat16, torch.float32),
                     "bf16": (torch.bfloat16,) * 3}
    policy = precision.get_precision("bf16-mixed").mp_policy()
    assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) == (torch.bfloat16, torch.float32,
                                                                              torch.float32)
    frozen = precision.Precision.frozen_mp_policy(torch.float16)  # stored = computed, no reduction to do
    assert (frozen.param_dtype, frozen.reduce_dtype, frozen.output_dtype) == (torch.float16, torch.float16,
                                                                              torch.float32)
    with pytest.raises(ValueError, match="not a precision mode"):
        precision.get_precision("fp8")


def test_dtype_names_and_overrides():
    assert precision.parse_dtype("BF16") is torch.bfloat16 and precision.parse_dtype("float16") is torch.float16
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        precision.parse_dtype("int8")
    assert precision.dtype_name(torch.bfloat16) == "bf16"
    mixed = precision.get_precision("bf16-mixed")
    assert mixed.frozen_dtype() is torch.bfloat16 and mixed.frozen_dtype("fp32") is torch.float32


def test_audit_reads_the_module_and_export_check_catches_strays():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2).to(torch.bfloat16))
    model[0].requires_grad_(False)
    row = precision.component_row("m", model, torch.bfloat16)
    assert row == {"component": "m", "params": 30, "local_params": 30, "storage": "bf16/fp32", "compute": "bf16",
                   "trainable": "yes", "sharded": "no"}
    table = precision.format_audit([row])
    assert table.splitlines()[0].split() == ["component", "params", "local_params", "storage", "compute",
                                             "trainable", "sharded"]
    sd = {"a": torch.zeros(2, dtype=torch.bfloat16), "steps": torch.zeros(1, dtype=torch.long)}
    assert precision.check_state_dict_dtypes(sd, torch.bfloat16) == {"bf16": 1, "torch.int64": 1}
    with pytest.raises(ValueError, match="tensor 'b' is fp32, expected bf16"):
        precision.check_state_dict_dtypes({**sd, "b": torch.zeros(1)}, torch.bfloat16, where="export")


def test_tf32_switch_sets_cublas_and_cudnn():
    """TF32 (both scripts' setting, default on): strict IEEE fp32 when off. The flags are CUDA's
    (they change nothing on CPU), so they can be read back here."""
    import torch
    from precision import apply_tf32
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    try:
        apply_tf32(True)
        assert matmul.fp32_precision == cudnn.fp32_precision == "tf32"
        apply_tf32(False)
        assert matmul.fp32_precision == cudnn.fp32_precision == "ieee"
    finally:
        matmul.fp32_precision = cudnn.fp32_precision = "none"  # torch's defaults, for the other tests


def test_bf16_on_a_cpu_without_native_bf16_warns(tmp_path):
    import torch
    from precision import cpu_bf16_warning, get_precision
    avx2, amx = tmp_path / "avx2", tmp_path / "amx"
    avx2.write_text("flags : fpu sse avx avx2 fma\n")
    amx.write_text("flags : fpu avx2 avx512f amx_bf16 amx_tile\n")
    cpu = torch.device("cpu")
    assert "no native support" in cpu_bf16_warning(get_precision("bf16-mixed"), cpu, str(avx2))
    assert cpu_bf16_warning(get_precision("bf16-mixed"), cpu, str(amx)) is None
    assert cpu_bf16_warning(get_precision("fp32"), cpu, str(avx2)) is None
    assert cpu_bf16_warning(get_precision("bf16"), torch.device("cuda", 0), str(avx2)) is None


def test_adapter_policy_reduces_in_fp32_in_every_mode():
    for name in ("fp32", "bf16-mixed", "bf16"):
        p = precision.get_precision(name).adapter_mp_policy()
        assert p.reduce_dtype == torch.float32 and p.output_dtype == torch.float32, name
        assert p.param_dtype == precision.get_precision(name).compute_dtype, name


def _adapter_grads_reduced_in_fp32(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    adapter = torch.nn.Linear(64, 64, bias=False)  # fp32 storage, as LoRA adapters are
    fully_shard(adapter, mesh=init_device_mesh("cpu", (world,)),
                mp_policy=precision.get_precision("bf16-mixed").adapter_mp_policy())
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))  # other data on each rank
    adapter(x).square().sum().backward()
    grad = adapter.weight.grad.to_local()
    # each rank's grad is bf16 (the compute dtype); their mean taken in fp32 needs more than bf16's
    # 8 bits of mantissa, a mean taken in bf16 never does
    assert grad.dtype == torch.float32
    assert not torch.equal(grad.to(torch.bfloat16).float(), grad), "adapter grads were reduced in bf16"


@pytest.mark.slow
def test_adapter_grads_are_reduced_in_fp32_across_ranks():
    from tests.conftest import run_ranks
    run_ranks(_adapter_grads_reduced_in_fp32, 2)
