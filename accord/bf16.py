"""bfloat16 arithmetic for the reductions: numpy has no bfloat16 type.

A bfloat16 tensor travels as its 16-bit patterns (an int16 array, buffers.py).
Reducing two of them widens each element to float32 (its 16 bits become the
top half, exactly), combines them in float32, and narrows the result rounding to
nearest even, a NaN becoming 0x7FC0: what torch does for one bfloat16 operation,
so a sum of two ranks' tensors is torch's sum, bit for bit.

Two ways, with the same bits:
- the optional C helper (accord/bf16_core.c, built by `pip install` where a C
  compiler is found) for sums, products and AVG's division, one pass over the
  elements with the GIL released; ACCORD_BF16_HELPER=0 turns it off;
- numpy otherwise (and always for MIN and MAX), in chunks of CHUNK elements
  through scratch arrays of that size, every step writing in place: whole-tensor
  temporaries cost more than the arithmetic (a 16 MiB tensor made eight 32 MiB
  arrays, each page of them faulted in and zeroed, 0.24 s for one sum on the
  development VM).
"""
import os

import numpy as np

try:
    from .bf16_core import divide as _c_divide, reduce as _c_reduce
except ImportError:          # not built here: numpy reduces
    _c_divide = _c_reduce = None

CHUNK = 8192                 # elements a numpy pass takes: its three scratch arrays
                             # (32 KiB each) stay in the cache
_NAN = 0x7FC0
_HELPED_UFUNCS = {np.add: 0, np.multiply: 1}


def built():
    """Whether the helper was compiled into this installation."""
    return _c_reduce is not None


def helped():
    """Whether sums, products and averages go through the helper: built and not off."""
    return _c_reduce is not None and os.environ.get("ACCORD_BF16_HELPER", "1").strip() != "0"


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


def combine(ufunc, acc, other):
    """acc <- acc ufunc other, elementwise, both bfloat16 bit patterns of one length
    (int16 or uint16 arrays); ufunc: a numpy binary ufunc on float32."""
    code = _HELPED_UFUNCS.get(ufunc) if _HELPED else None
    if code is not None and acc.flags.c_contiguous and other.flags.c_contiguous:
        _c_reduce(acc, other, code)
        return
    _numpy(lambda fa, fb: ufunc(fa, fb, out=fa), acc, other)


def divide(acc, n):
    """acc <- acc / n, elementwise over bfloat16 bit patterns (AVG's last step)."""
    if _HELPED and acc.flags.c_contiguous:
        _c_divide(acc, n)
        return
    d = np.float32(n)
    _numpy(lambda fa, fb: np.divide(fa, d, out=fa), acc, None)


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
