"""Reductions of 16-bit floats: bfloat16, which numpy lacks, and float16, which numpy
computes one element at a time (5.5 ns an element for a sum on the development VM,
17x float32's).

A bfloat16 tensor travels as its 16-bit patterns (an int16 array, buffers.py).
Reducing two of them widens each element to float32 (its 16 bits become the
top half, exactly), combines them in float32, and narrows the result rounding to
nearest even, a NaN becoming 0x7FC0: what torch does for one bfloat16 operation,
so a sum of two ranks' tensors is torch's sum, bit for bit.

A float16 sum, product or quotient computed in float32 and rounded to nearest
even once is the correctly rounded float16 result (float32's 24 bits are at
least twice float16's 11 plus two, so the double rounding never differs), which
is also what numpy computes: the same values either way, NaN staying NaN.

Two ways:
- the optional C helper (accord/halves_core.c, built by `pip install` where a C
  compiler is found) for sums, products and AVG's division: one pass over the
  elements with the GIL released (bfloat16 on any CPU, float16 where the CPU
  converts halves itself, F16C on x86); ACCORD_HALF_HELPER=0 turns it off;
- numpy otherwise, and always for MIN and MAX: for bfloat16 in chunks of CHUNK
  elements through scratch arrays of that size, every step writing in place, with
  the helper's bits (whole-tensor temporaries cost more than the arithmetic: a 16
  MiB tensor made eight 32 MiB arrays, each page of them faulted in and zeroed,
  0.24 s for one sum); float16 with its own ufuncs.
"""
import os

import numpy as np

try:
    from .halves_core import (bf16_divide as _bf16_divide, bf16_reduce as _bf16_reduce,
                              f16_divide as _f16_divide, f16_reduce as _f16_reduce)
except ImportError:          # not built here: numpy reduces
    _bf16_divide = _bf16_reduce = _f16_divide = _f16_reduce = None

CHUNK = 8192                 # bfloat16 elements a numpy pass takes: its three scratch
                             # arrays (32 KiB each) stay in the cache
_NAN = 0x7FC0
_HELPED_UFUNCS = {np.add: 0, np.multiply: 1}


def built():
    """Whether the helper was compiled into this installation."""
    return _bf16_reduce is not None


def f16_in_helper():
    """Whether the helper reduces float16 here (built, and the CPU converts halves)."""
    return _f16_reduce is not None


def helped():
    """Whether sums, products and averages go through the helper: built and not off."""
    return built() and os.environ.get("ACCORD_HALF_HELPER", "1").strip() != "0"


_HELPED = helped()


def _narrow(u, f, t, out):
    """out (16-bit) <- the float32 values f (whose bits are u) rounded to nearest even;
    t: scratch of u's length."""
    np.right_shift(u, 16, out=t)
    np.bitwise_and(t, 1, out=t)
    np.add(t, u, out=t)
    np.add(t, 0x7FFF, out=t)
    np.right_shift(t, 16, out=t)
    np.copyto(out, t, casting="unsafe")
    nan = np.isnan(f)
    if nan.any():
        out[nan] = _NAN


def bf16_combine(ufunc, acc, other):
    """acc <- acc ufunc other, elementwise, both bfloat16 bit patterns of one length
    (int16 or uint16 arrays); ufunc: a numpy binary ufunc on float32."""
    code = _HELPED_UFUNCS.get(ufunc) if _HELPED else None
    if code is not None and acc.flags.c_contiguous and other.flags.c_contiguous:
        _bf16_reduce(acc, other, code)
        return
    _numpy(lambda fa, fb: ufunc(fa, fb, out=fa), acc, other)


def bf16_divide(acc, n):
    """acc <- acc / n, elementwise over bfloat16 bit patterns (AVG's last step)."""
    if _HELPED and acc.flags.c_contiguous:
        _bf16_divide(acc, n)
        return
    d = np.float32(n)
    _numpy(lambda fa, fb: np.divide(fa, d, out=fa), acc, None)


def f16_combine(ufunc, acc, other):
    """acc <- acc ufunc other for float16 arrays, through the helper where it reduces
    float16 and ufunc is a sum or a product; False (nothing done) otherwise, for numpy."""
    code = _HELPED_UFUNCS.get(ufunc) if _HELPED else None
    if code is None or _f16_reduce is None or not (acc.flags.c_contiguous and
                                                   other.flags.c_contiguous):
        return False
    _f16_reduce(acc, other, code)
    return True


def f16_divide(acc, n):
    """acc <- acc / n for a float16 array through the helper; False where it cannot."""
    if not _HELPED or _f16_divide is None or not acc.flags.c_contiguous:
        return False
    _f16_divide(acc, n)
    return True


def _numpy(step, acc, other):
    a16 = acc.reshape(-1).view(np.uint16)
    b16 = None if other is None else other.reshape(-1).view(np.uint16)
    size = a16.size
    k = min(size, CHUNK)
    ua, ub, t = np.empty(k, np.uint32), np.empty(k, np.uint32), np.empty(k, np.uint32)
    # float32 overflow is what bfloat16 arithmetic does (inf), as in torch: no warning
    with np.errstate(all="ignore"):
        for lo in range(0, size, k):
            hi = min(size, lo + k)
            m = hi - lo
            u, v, w = ua[:m], ub[:m], t[:m]
            np.left_shift(a16[lo:hi], 16, out=u, dtype=np.uint32)
            f = u.view(np.float32)
            if b16 is not None:
                np.left_shift(b16[lo:hi], 16, out=v, dtype=np.uint32)
            step(f, v.view(np.float32))
            _narrow(u, f, w, a16[lo:hi])
