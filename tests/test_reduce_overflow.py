"""A reduction that overflows (inf) or has no value (NaN) gives that result, as torch
and gloo do: no RuntimeWarning from accord's kernels, and a program that turns
warnings into errors (python -W error, pytest's filterwarnings = error) gets the
result too, not a collective that fails on the ranks whose numbers overflowed."""
import subprocess
import sys
import warnings

import numpy as np
import pytest

from accord.reduceops import ReduceOp, finish_avg, reduce_into
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(60)


_OVERFLOWS = """
import numpy as np
from accord.reduceops import ReduceOp, finish_avg, reduce_into
for dtype in (np.float16, np.float32, np.float64):
    for op in (ReduceOp.SUM, ReduceOp.PRODUCT):
        big = np.full(70_000, np.finfo(dtype).max, dtype)
        big[::3] = 1                                  # some elements do not overflow
        acc = big.copy()
        reduce_into(op, acc, big)
        assert np.isinf(acc[1::3]).all() and np.isinf(acc[2::3]).all()
        assert (acc[::3] == (2 if op == ReduceOp.SUM else 1)).all()
    nan = np.full(3, np.inf, dtype)
    acc = -nan
    reduce_into(ReduceOp.SUM, acc, nan)
    finish_avg(acc, 2)
    assert np.isnan(acc).all()
print("done")
"""


def test_an_overflowing_reduction_is_inf_without_a_warning():
    # a program of its own: what it prints is what a user sees
    out = subprocess.run([sys.executable, "-c", _OVERFLOWS], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "done", out.stderr
    assert "Warning" not in out.stderr, out.stderr


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_with_warnings_as_errors_the_result_is_written_and_nothing_raised(dtype):
    big = np.full(70_000, np.finfo(dtype).max, dtype)
    nan_maker = np.full(5, np.inf, dtype)
    acc, nans = big.copy(), -nan_maker
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reduce_into(ReduceOp.SUM, acc, big)           # overflow
        reduce_into(ReduceOp.SUM, nans, nan_maker)    # inf - inf: invalid
        finish_avg(acc, 3)
    assert np.isinf(acc).all()
    assert np.isnan(nans).all()


def _overflow_everywhere(rank, world):
    import accord
    warnings.simplefilter("error")                    # as python -W error
    x = np.full(1000, np.finfo(np.float16).max, np.float16)
    accord.all_reduce(x)                              # small: on every rank
    y = np.full(1 << 18, np.finfo(np.float32).max, np.float32)
    accord.all_reduce(y, op=accord.ReduceOp.AVG)      # 1 MiB: reduced block by block
    return bool(np.isinf(x).all()), bool(np.isinf(y).all())


def test_an_all_reduce_that_overflows_under_w_error_is_inf_on_every_rank():
    assert run_ranks(2, _overflow_everywhere) == [(True, True)] * 2
