"""Tolerances from floating-point error analysis, for the tests that check numbers.

One correctly rounded operation on a value v errs by at most u·|v|, u the dtype's unit roundoff (half
its eps). A sum of n terms in any order errs by at most gamma(n)·Σ|terms| (Higham, Accuracy and
Stability of Numerical Algorithms, ch. 3-4): a bound for every kernel's order of summation, so for
every thread count and vector width. A test builds its bound from these and from the tensors it
compares, elementwise where the error varies by element, instead of an rtol that one machine passes.
"""
from __future__ import annotations

import os

import pytest
import torch


def _threads() -> int:
    """OMP_NUM_THREADS where set (torch starts on at most one thread per core, so 3 on 2 cores would
    not reach the tests), else the count torch started with: this module is imported while the
    tests are collected, before any test can change it."""
    want = os.environ.get("OMP_NUM_THREADS", "")
    return int(want) if want.isdigit() and int(want) > 0 else torch.get_num_threads()


THREADS = _threads()


@pytest.fixture(autouse=True)
def threads_as_started():
    """Each test of a module that imports this fixture runs on THREADS intra-op threads, whatever
    an earlier test in the session set (test_export.py runs on one): .ci/run's
    passes at OMP_NUM_THREADS=1 and 3 then test those counts (kernels split sums by thread, so
    their rounding)."""
    torch.set_num_threads(THREADS)
    yield


def unit_roundoff(dtype: torch.dtype = torch.float32) -> float:
    """u: the largest relative error of one rounding to `dtype` (2^-24 for fp32, 2^-53 for fp64)."""
    return torch.finfo(dtype).eps / 2


def gamma(n: int, dtype: torch.dtype = torch.float32) -> float:
    """n·u / (1 − n·u): the relative error bound of n roundings in a row (a sum of n + 1 terms in
    any order, a dot product of length n)."""
    nu = n * unit_roundoff(dtype)
    assert nu < 1, (n, dtype)
    return nu / (1 - nu)


def assert_within(actual, expected, bound, what: str = "") -> None:
    """|actual − expected| <= bound elementwise, compared in float64; `bound` is a number or a
    tensor that broadcasts against them. The failure names the worst element and its bound."""
    actual, expected = torch.as_tensor(actual).double(), torch.as_tensor(expected).double()
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    bound = torch.as_tensor(bound, dtype=torch.float64).expand(actual.shape)
    err = (actual - expected).abs()
    excess = err - bound
    if not bool((excess <= 0).all()) or not bool(torch.isfinite(actual).all()):
        i = int(excess.nan_to_num(float("inf")).flatten().argmax())
        idx = tuple(int(v) for v in torch.unravel_index(torch.tensor(i), actual.shape)) if actual.ndim else ()
        raise AssertionError(f"{what}: {int((excess > 0).sum())} of {err.numel()} elements beyond the bound; "
                             f"worst at {idx}: |{actual.flatten()[i]:.9g} - {expected.flatten()[i]:.9g}| = "
                             f"{err.flatten()[i]:.3g} > {bound.flatten()[i]:.3g}")
