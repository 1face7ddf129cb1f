"""Reductions of 16-bit floats (accord/halves.py): for bfloat16 the optional C helper and
the numpy path give torch's bits for one bfloat16 operation, and the same bits as each
other; for float16 the helper gives numpy's values (and torch's)."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from accord import halves
from accord.reduceops import ReduceOp, finish_avg, reduce_into

pytestmark = pytest.mark.timeout(120)

torch = pytest.importorskip("torch")

_SPECIAL = [0x0000, 0x8000, 0x3F80, 0xBF80, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F7F, 0xFF7F,
            0x0001, 0x8001, 0x007F, 0x0080, 0x3F81, 0x4B00, 0x5F00, 0x1F00]


def _bits(n, seed):
    """n bfloat16 bit patterns: every special value, then random patterns, then values
    near one another (sums that round, ties included)."""
    rng = np.random.default_rng(seed)
    out = rng.integers(0, 1 << 16, n, dtype=np.uint32).astype(np.uint16)
    out[:min(n, len(_SPECIAL))] = _SPECIAL[:n]
    near = rng.integers(0x3F00, 0x4100, n // 3, dtype=np.uint32).astype(np.uint16)
    out[n - len(near):] = near
    return out.view(np.int16)


def _torch(bits):
    return torch.from_numpy(bits.copy()).view(torch.bfloat16)


def _same_as_torch(got, want, what):
    """Bit for bit where torch's result is a number; where it is NaN ours is NaN and
    0x7FC0 (torch itself writes NaN as 0x7FC0 or 0xFFFF, path by path)."""
    want_bits = want.view(torch.int16).numpy().view(np.uint16)
    got_bits = got.view(np.uint16)
    nan = torch.isnan(want.float()).numpy()
    np.testing.assert_array_equal(got_bits[~nan], want_bits[~nan], err_msg=what)
    assert (got_bits[nan] == 0x7FC0).all(), what


@pytest.fixture(params=["helper", "numpy"])
def way(request, monkeypatch):
    if request.param == "helper":
        if not halves.built():
            pytest.skip("the helper is not built here")
        monkeypatch.setattr(halves, "_HELPED", True)
    else:
        monkeypatch.setattr(halves, "_HELPED", False)
    return request.param


@pytest.mark.parametrize("n", [1, 5, halves.CHUNK - 1, halves.CHUNK, halves.CHUNK + 7, 3 * halves.CHUNK + 1])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX])
def test_a_reduction_is_torchs_one_bfloat16_operation(way, op, n):
    a, b = _bits(n, 1), _bits(n, 2)
    ta, tb = _torch(a), _torch(b)
    want = {ReduceOp.SUM: lambda: ta + tb, ReduceOp.PRODUCT: lambda: ta * tb,
            ReduceOp.MIN: lambda: torch.minimum(ta, tb),
            ReduceOp.MAX: lambda: torch.maximum(ta, tb)}[op]()
    got = a.copy()
    reduce_into(op, got, b, is_bf16=True)
    _same_as_torch(got, want, f"{op.name} of {n} ({way})")
    np.testing.assert_array_equal(b, _bits(n, 2))          # other is left as it was


@pytest.mark.parametrize("n", [1, halves.CHUNK + 3])
@pytest.mark.parametrize("world", [2, 3, 7])
def test_avg_divides_once_as_torch_does(way, world, n):
    a = _bits(n, 3)
    got = a.copy()
    finish_avg(got, world, is_bf16=True)
    _same_as_torch(got, _torch(a) / world, f"/ {world} ({way})")


def test_the_helper_and_numpy_give_the_same_bits(monkeypatch):
    if not halves.built():
        pytest.skip("the helper is not built here")
    n = 5 * halves.CHUNK + 11
    a, b = _bits(n, 4), _bits(n, 5)
    out = {}
    for name, helped in (("helper", True), ("numpy", False)):
        monkeypatch.setattr(halves, "_HELPED", helped)
        x = a.copy()
        for op in (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.SUM):
            reduce_into(op, x, b, is_bf16=True)
        finish_avg(x, 3, is_bf16=True)
        out[name] = x
    np.testing.assert_array_equal(out["helper"], out["numpy"])


def test_strided_halves_are_reduced_too(way):
    a, b = _bits(2000, 6), _bits(2000, 7)
    got = a.copy()
    reduce_into(ReduceOp.SUM, got[::2], b[1::2], is_bf16=True)
    finish_avg(got[::2], 2, is_bf16=True)
    _same_as_torch(got[::2], (_torch(a[::2]) + _torch(b[1::2])) / 2, f"strided ({way})")
    np.testing.assert_array_equal(got[1::2], a[1::2])      # the other half untouched


def _halves(n, seed):
    """n float16 values: zeros, subnormals, the largest finite, inf, NaN, then random bit
    patterns, then values near one another (sums that round, ties included)."""
    rng = np.random.default_rng(seed)
    out = rng.integers(0, 1 << 16, n, dtype=np.uint32).astype(np.uint16)
    special = [0x0000, 0x8000, 0x0001, 0x83FF, 0x0400, 0x7BFF, 0xFBFF, 0x7C00, 0xFC00,
               0x7E00, 0x3C00, 0x3C01, 0x1400, 0x6800]
    out[:min(n, len(special))] = special[:n]
    near = rng.integers(0x3800, 0x4400, n // 3, dtype=np.uint32).astype(np.uint16)
    out[n - len(near):] = near
    return out.view(np.float16)


def _same_values(got, want, what):
    """Bit for bit where want is a number (signed zeros included); NaN where it is NaN."""
    nan = np.isnan(want)
    np.testing.assert_array_equal(got.view(np.uint16)[~nan], want.view(np.uint16)[~nan],
                                  err_msg=what)
    assert np.isnan(got[nan]).all(), what


@pytest.mark.parametrize("n", [1, 7, 8, 9, 4099])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX])
def test_a_float16_reduction_gives_numpys_values(way, op, n):
    a, b = _halves(n, 8), _halves(n, 9)
    ufunc = {ReduceOp.SUM: np.add, ReduceOp.PRODUCT: np.multiply,
             ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum}[op]
    with np.errstate(all="ignore"):
        want = ufunc(a, b)
    got = a.copy()
    reduce_into(op, got, b)
    _same_values(got, want, f"{op.name} of {n} ({way})")
    t = {ReduceOp.SUM: torch.add, ReduceOp.PRODUCT: torch.mul, ReduceOp.MIN: torch.minimum,
         ReduceOp.MAX: torch.maximum}[op](torch.from_numpy(a), torch.from_numpy(b))
    _same_values(got, t.numpy(), f"{op.name} of {n} ({way}) against torch")


@pytest.mark.parametrize("world", [2, 3, 7])
def test_a_float16_avg_divides_as_numpy_does(way, world):
    a = _halves(1001, 10)
    with np.errstate(all="ignore"):
        want = a / np.float16(world)
    got = a.copy()
    finish_avg(got, world)
    _same_values(got, want, f"/ {world} ({way})")


def test_the_helper_takes_float16_where_the_cpu_converts_halves(monkeypatch):
    if not halves.built():
        pytest.skip("the helper is not built here")
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    if " f16c" in flags and " avx" in flags:
        assert halves.f16_in_helper()
    monkeypatch.setattr(halves, "_HELPED", True)
    x = np.ones(4, np.float16)
    assert halves.f16_combine(np.add, x, x) == halves.f16_in_helper()
    assert not halves.f16_combine(np.minimum, x, x)         # MIN and MAX: numpy's


def test_a_sum_that_overflows_is_inf_without_a_warning(way, recwarn):
    big = np.full(4, 0x7F7F, np.uint16).view(np.int16)     # bfloat16's largest finite
    x = big.copy()
    reduce_into(ReduceOp.SUM, x, big, is_bf16=True)
    assert (x.view(np.uint16) == 0x7F80).all()               # +inf
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_the_helper_refuses_buffers_that_differ():
    if not halves.built():
        pytest.skip("the helper is not built here")
    with pytest.raises(ValueError, match="acc holds 8 bytes, other 6"):
        halves._bf16_reduce(np.zeros(4, np.int16), np.zeros(3, np.int16), 0)
    with pytest.raises(ValueError, match="op 2"):
        halves._bf16_reduce(np.zeros(4, np.int16), np.zeros(4, np.int16), 2)


def test_accord_bf16_helper_0_turns_the_helper_off():
    code = "from accord import halves; print(halves.helped(), halves._HELPED)"
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, ACCORD_HALF_HELPER="0"), timeout=60)
    on = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        env={k: v for k, v in os.environ.items() if k != "ACCORD_HALF_HELPER"},
                        timeout=60)
    assert off.stdout.split() == ["False", "False"], off.stderr
    assert on.stdout.split() == [str(halves.built())] * 2, on.stderr


def test_built_wherever_a_c_compiler_was_found():
    """`pip install` builds the helper where it finds a C compiler (make test installs
    with the machine's gcc): a build that silently fell back would go unnoticed."""
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler on this machine: numpy reduces bfloat16")
    assert halves.built(), "a C compiler is here, yet accord/halves_core.c is not built"
