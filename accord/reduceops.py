"""ReduceOp and the numpy kernels behind it.

Every kernel writes into its first argument (`acc = acc op other`), so
reductions never allocate beyond the receive buffer the algorithm owns.
"""
import enum
import warnings

import numpy as np

from .halves import bf16_combine, bf16_divide, f16_combine, f16_divide


class ReduceOp(enum.IntEnum):
    """How all_reduce, reduce and reduce_scatter combine the ranks' values, as torch's ReduceOp.

    SUM, PRODUCT, MIN, MAX, the bitwise BAND, BOR, BXOR (integer and bool
    tensors) and AVG (the sum divided by the group size, for every dtype; gloo
    has no AVG). On bool tensors SUM is a logical or and PRODUCT a logical
    and. torch's PREMUL_SUM exists only through the torch backend
    (`accord.torch`).
    """
    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    BAND = 4
    BOR = 5
    BXOR = 6
    AVG = 7

    def __repr__(self):
        return f"ReduceOp.{self.name}"


_UFUNCS = {
    ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.PRODUCT: np.multiply,
    ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum,
    ReduceOp.BAND: np.bitwise_and, ReduceOp.BOR: np.bitwise_or, ReduceOp.BXOR: np.bitwise_xor,
}
_BOOL_UFUNCS = {ReduceOp.SUM: np.logical_or, ReduceOp.PRODUCT: np.logical_and}


def as_reduce_op(op):
    """Accept accord's ReduceOp, torch's ReduceOp (by name) or a name string."""
    if isinstance(op, ReduceOp):
        return op
    name = getattr(op, "name", None) or (op if isinstance(op, str) else None)
    if name is None:
        name = str(op).rsplit(".", 1)[-1]
    try:
        return ReduceOp[name.upper()]
    except KeyError:
        raise ValueError(f"op: unsupported reduce operation {op!r}; expected one of "
                         f"{', '.join(o.name for o in ReduceOp)}") from None


def check_op(op, buf, name="op"):
    """Reject op/dtype pairs that have no meaning, before any byte moves."""
    kind = "f" if buf.is_bf16 else buf.arr.dtype.kind
    if op == ReduceOp.AVG and kind not in "fc":
        raise TypeError(f"{name}: ReduceOp.AVG needs a floating or complex dtype, got "
                        f"{buf.dtype_name} (an integer average would be truncated; use SUM "
                        f"and divide)")
    if op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR) and kind not in "biu":
        raise TypeError(f"{name}: {op.name} needs an integer or bool dtype, got {buf.dtype_name}")
    if op in (ReduceOp.MIN, ReduceOp.MAX) and kind == "c":
        raise TypeError(f"{name}: {op.name} is undefined for complex dtype {buf.dtype_name}")
    if kind not in "biufc":
        raise TypeError(f"{name}: cannot reduce dtype {buf.dtype_name}")


def quiet_overflow():
    """Ignore numpy's RuntimeWarning from these kernels.

    A reduction that overflows (inf) or has no value (inf - inf: NaN) gives that
    result, as torch's and gloo's do; numpy's warning about it is not the program's
    business. A warnings filter on this module costs nothing until a warning is
    raised, where np.errstate would cost a microsecond on every call. It is made
    at import and again whenever a group connects (world.connect): a filter made
    inside a warnings.catch_warnings() block (pytest collects tests in one) is gone
    when the block ends. Where the program turns warnings into errors (python -W
    error, pytest's filterwarnings = error, any filter made after this one) numpy
    raises once its ufunc has written the whole result, so the kernels drop that
    exception rather than fail the collective on the ranks whose numbers overflowed.
    Making the same filter again replaces it (no duplicates pile up)."""
    warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"accord\.reduceops$")


quiet_overflow()


_F16 = np.dtype(np.float16)


def reduce_into(op, acc, other, is_bf16=False, base=None):
    """acc <- acc op other (same dtype, same length); is_bf16: both are bfloat16 bit
    patterns. 16-bit floats go through accord/halves.py.

    base: acc <- base op other instead (base only read), in one pass where numpy
    computes it (the 16-bit kernels work in place: base is copied into acc first)."""
    if acc.size == 0:
        return
    if base is not None and (is_bf16 or acc.dtype == _F16):
        acc[...] = base
        base = None
    if is_bf16:
        bf16_combine(_UFUNCS[op], acc, other)
        return
    if acc.dtype == _F16 and f16_combine(_UFUNCS[op], acc, other):
        return
    if base is None:
        base = acc
    try:
        if acc.dtype.kind == "b" and op in _BOOL_UFUNCS:
            _BOOL_UFUNCS[op](base, other, out=acc)
            return
        _UFUNCS[op](base, other, out=acc)
    except RuntimeWarning:
        pass


def finish_avg(acc, n, is_bf16=False):
    """AVG = SUM / n, divided once at the end so floats stay exact where SUM is."""
    if acc.size == 0:
        return
    if is_bf16:
        bf16_divide(acc, n)
        return
    if acc.dtype == _F16 and f16_divide(acc, n):
        return
    try:
        np.divide(acc, acc.dtype.type(n), out=acc)
    except RuntimeWarning:          # inf / n: see quiet_overflow
        pass
