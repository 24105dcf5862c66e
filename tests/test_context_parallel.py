"""Context parallelism in train_flux_kontext.py (CONTEXT_PARALLEL): the sequence of each sample
split over the ranks of a CP group, Ulysses attention (diffusers' implementation), composed with
FSDP2 over dp x cp. CPU, gloo, the tiny Kontext model, fp32.

    python -m pytest tests/test_context_parallel.py -q

Runs (module-scoped, shared by the tests; side by side):
    ref      python, BATCH_SIZE=2                       (one process, no CP)
    cp       torchrun 2, CONTEXT_PARALLEL=2, BATCH_SIZE=2 (one DP group of 2 ranks: the same samples)
    resumed  the cp settings, RESUME=auto from a copy of cp's step-2 checkpoint to step 3, once cp is done
Both ref and cp keep an EMA and compute validation losses and samples, so every forward path
(training, validation, the FluxKontextPipeline samples) runs under CP.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from tests.conftest import (
    assert_kontext_resumed_bit_exact,
    kontext_run,
    launch_all_resuming,
    launch_kontext,
    load_export,
    read_metrics,
    run_ranks,
)

import fsdp_utils
import train_flux_kontext as tfk
from families import flux
from core.errors import ConfigError

COMMON = ["--batch_size=2", "--ema_decay=0.5", "--val_every=1", "--sample_every=3", "--save_every=2"]


@pytest.fixture(scope="module")
def runs(kontext_setup):
    root = kontext_setup["root"]
    dirs = {"ref": root / "cp_ref", "cp": root / "cp", "resumed": root / "cp_resumed"}
    done = launch_all_resuming(
        {"ref": kontext_run(kontext_setup, dirs["ref"], COMMON, ranks=1),
         "cp": kontext_run(kontext_setup, dirs["cp"], COMMON + ["--context_parallel=2"])},
        "cp", kontext_run(kontext_setup, dirs["resumed"], COMMON + ["--context_parallel=2", "--resume=auto"]))
    return {name: (str(folder), done[name].stdout) for name, folder in dirs.items()}


@pytest.mark.slow
def test_cp2_matches_one_process(runs):
    """Same losses (train and validation), grad norms and trained weights as one process, after 3
    AdamW steps at LR 1e-3 over two resolution buckets."""
    assert "context parallel: 1 data-parallel group(s) of 2 ranks" in runs["cp"][1]
    ref, cp = read_metrics(runs["ref"][0]), read_metrics(runs["cp"][0])
    assert len(ref) == len(cp) == 3
    for a, b in zip(ref, cp):
        for key in ("loss", "val_loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(a[key])), (key, a, b)
    # the EMA, trained for 3 steps
    w_ref, w_cp = load_export(runs["ref"][0]), load_export(runs["cp"][0])
    assert w_ref.keys() == w_cp.keys()
    # CP sums attention and grads in another order, and AdamW divides each element's update by its
    # own grad scale, so an element whose grad is near zero turns a rounding difference into a
    # visible one. Measured on an AMD EPYC (Zen 4): 3 of 132 k elements beyond rtol 1e-5 + atol 2e-6,
    # the largest 8.2e-6 (none on the machines before it). A wrong CP would move nearly every element
    # by ~LR (1e-3). So: every element within 2 % of one step's LR, all but 1 in 10^4 within 2e-6.
    tight = total = 0
    for k in w_ref:
        torch.testing.assert_close(w_cp[k], w_ref[k], rtol=1e-5, atol=2e-5, msg=k)
        tight += int(((w_cp[k] - w_ref[k]).abs() > 2e-6 + 1e-5 * w_ref[k].abs()).sum())
        total += w_ref[k].numel()
    assert tight <= total // 10_000, f"{tight} of {total} elements beyond rtol 1e-5, atol 2e-6"


@pytest.mark.slow
def test_cp_samples_match_one_process(runs):
    """The sample grid (FluxKontextPipeline under CP) shows the same images as one process's."""
    from PIL import Image
    import numpy as np
    a, b = (np.asarray(Image.open(os.path.join(runs[k][0], "samples", "step_000003.png")), dtype=np.int16)
            for k in ("ref", "cp"))
    assert a.shape == b.shape and np.abs(a - b).max() <= 2


@pytest.mark.slow
def test_cp_resume_is_bit_exact(runs):
    assert "(step 2)" in runs["resumed"][1]
    assert_kontext_resumed_bit_exact(runs["cp"][0], runs["resumed"][0], 3)


@pytest.mark.slow
def test_cp_export_has_the_layout_of_a_non_cp_export(runs):
    """Same files, same tensor names, shapes and dtypes, same configs: CP leaves no trace."""
    ref, cp = (os.path.join(runs[k][0], "export") for k in ("ref", "cp"))
    files = sorted(os.path.relpath(os.path.join(d, f), ref) for d, _, fs in os.walk(ref) for f in fs)
    assert files == sorted(os.path.relpath(os.path.join(d, f), cp) for d, _, fs in os.walk(cp) for f in fs)
    w_ref, w_cp = load_export(runs["ref"][0]), load_export(runs["cp"][0])
    assert {k: (v.shape, v.dtype) for k, v in w_ref.items()} == {k: (v.shape, v.dtype) for k, v in w_cp.items()}
    for name in files:
        if name.endswith(".json"):
            with open(os.path.join(ref, name)) as f, open(os.path.join(cp, name)) as g:
                assert json.load(f) == json.load(g), name


@pytest.mark.slow
def test_cp_config_errors_before_any_work(kontext_setup, tmp_path):
    """World not divisible (a real 2-rank launch with CONTEXT_PARALLEL=3 fails in one line), and
    heads / text / image tokens not divisible (the shape check, before any model is built)."""
    proc = launch_kontext(kontext_setup, tmp_path / "bad", ["--context_parallel=3"], check=False)
    assert proc.returncode != 0
    errors = sorted({line for line in proc.stdout.splitlines() if line.startswith("error:")})
    expected = "error: CONTEXT_PARALLEL=3 x DP_REPLICATE=1 does not divide the world size 2"
    assert errors == [expected], proc.stdout[-2000:]
    assert "rank 0" not in proc.stdout.split(errors[0])[0]  # nothing started: the line comes first

    def shapes(*sizes):  # (target, (context,)): Kontext's context at the target's size
        return [(size, (size,)) for size in sizes]

    model = kontext_setup["model_path"]  # tiny transformer: 2 heads; T5 length 32; 64x64 -> 2 x 4 x 4 = 32 image tokens
    flux.check_context_parallel(model, 2, {"MAX_SEQUENCE_LENGTH": 32}, shapes((64, 64), (48, 96)))
    with pytest.raises(ConfigError, match="2 attention heads"):
        flux.check_context_parallel(model, 4, {"MAX_SEQUENCE_LENGTH": 32}, shapes((64, 64)))
    with pytest.raises(ConfigError, match="31 T5 tokens"):
        flux.check_context_parallel(model, 2, {"MAX_SEQUENCE_LENGTH": 31}, shapes((64, 64)))
    shipped = tfk.default_paths()[0]  # 4 heads: CP=4 passes the heads check; its VAE factor is 4
    flux.check_context_parallel(shipped, 4, {"MAX_SEQUENCE_LENGTH": 32}, shapes((64, 64)))
    with pytest.raises(ConfigError, match="the 40x56 bucket has 70 image tokens"):  # 2 x 5 x 7
        flux.check_context_parallel(shipped, 4, {"MAX_SEQUENCE_LENGTH": 32}, shapes((64, 64), (40, 56)))


def _mesh_layout(rank, world):
    fsdp_mesh, cp_mesh = fsdp_utils.build_meshes(torch.device("cpu"), dp_replicate=2, context_parallel=2)
    assert fsdp_mesh.mesh_dim_names == ("dp_replicate", "dp_shard_cp") and fsdp_mesh.mesh.tolist() == [[0, 1], [2, 3]]
    pair = rank // 2 * 2
    assert cp_mesh.mesh_dim_names == ("ring", "ulysses") and cp_mesh.mesh.tolist() == [[pair, pair + 1]]
    assert fsdp_utils.data_parallel_rank(2) == (rank // 2, 2)
    fsdp_mesh, cp_mesh = fsdp_utils.build_meshes(torch.device("cpu"), dp_replicate=1, context_parallel=2)
    assert fsdp_mesh.mesh_dim_names == ("dp_shard_cp",) and fsdp_mesh.mesh.tolist() == [0, 1, 2, 3]
    assert fsdp_utils.build_meshes(torch.device("cpu"), 2)[1] is None


@pytest.mark.slow
def test_hsdp_with_cp_mesh_layout():
    """4 ranks, DP_REPLICATE=2 x CONTEXT_PARALLEL=2: HSDP over (replicate, shard x cp), CP groups
    {0, 1} and {2, 3} (consecutive ranks), data-parallel rank = rank // 2."""
    run_ranks(_mesh_layout, 4)


def test_cp_needs_a_diffusers_with_context_parallelism(monkeypatch):
    import diffusers
    from parallel.context_parallel import check_diffusers_supports_it
    check_diffusers_supports_it()  # the installed diffusers has it
    monkeypatch.setattr(diffusers.FluxTransformer2DModel, "_cp_plan", None)  # as before diffusers 0.36
    with pytest.raises(ConfigError, match=r"CONTEXT_PARALLEL > 1 needs diffusers >= 0.36 .* is installed"):
        check_diffusers_supports_it()
