"""Ray's collective vocabulary in accord's terms: reduce ops, options, tensor lists.

ray.util.collective hands a backend its tensors wrapped in lists (one entry
per GPU of the process, in the multi-GPU calls) and its parameters in option
objects (AllReduceOptions and the rest; its module-level functions sometimes
pass the option class itself rather than an instance). Nothing here moves a
byte: each function turns one argument into what accord's collectives take,
or raises the ValueError/TypeError that names it.
"""
from __future__ import annotations

import ctypes
import datetime
import warnings
from typing import Any, List, Optional

import numpy as np

from ..reduceops import ReduceOp

# ray.util.collective.types.ReduceOp's members, by name (Ray has no AVG or bitwise ops)
_OPS = {name: ReduceOp[name] for name in ("SUM", "PRODUCT", "MIN", "MAX")}


def reduce_op(options: Any) -> ReduceOp:
    """accord's ReduceOp for the options' `reduceOp` (Ray's ReduceOp; SUM when absent)."""
    op = getattr(options, "reduceOp", None)
    if op is None:
        return ReduceOp.SUM
    name = getattr(op, "name", None)
    if name not in _OPS:
        raise ValueError(f"reduceOp: expected ray.util.collective.types.ReduceOp SUM, PRODUCT, "
                         f"MIN or MAX, got {op!r}")
    return _OPS[name]


def timeout_s(options: Any) -> Optional[float]:
    """The options' `timeout_ms` in seconds, None when unset (Ray's default is -1 ms).

    A timedelta or a number of milliseconds; RecvOptions spells the field
    `unset_timeout_ms` in Ray 2.60, so that name is read too.
    """
    value = getattr(options, "timeout_ms", None)
    if value is None:
        value = getattr(options, "unset_timeout_ms", None)
    if value is None:
        return None
    if isinstance(value, datetime.timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = value / 1000.0
    else:
        raise TypeError(f"timeout_ms: expected a datetime.timedelta or milliseconds, got "
                        f"{type(value).__name__}")
    return seconds if seconds > 0 else None


def one_tensor(tensors: Any, what: str) -> Any:
    """The process's single tensor out of Ray's one-entry list (or a bare tensor)."""
    if not isinstance(tensors, (list, tuple)):
        return tensors
    if len(tensors) != 1:
        raise ValueError(f"{what}: backend ACCORD takes one tensor per process (CPU memory), "
                         f"got a list of {len(tensors)} (the multi-GPU calls need NCCL)")
    return tensors[0]


def one_list(tensor_lists: Any, what: str) -> List[Any]:
    """The process's single tensor list out of Ray's list of lists."""
    if isinstance(tensor_lists, (list, tuple)) and len(tensor_lists) == 1 \
            and isinstance(tensor_lists[0], (list, tuple)):
        return list(tensor_lists[0])
    if isinstance(tensor_lists, (list, tuple)) and all(
            not isinstance(t, (list, tuple)) for t in tensor_lists):
        return list(tensor_lists)
    raise ValueError(f"{what}: backend ACCORD takes one list of tensors per process, got "
                     f"{len(tensor_lists) if isinstance(tensor_lists, (list, tuple)) else 'no'} "
                     f"lists")


def first_elements(tensor: Any, n: int) -> Any:
    """A view of tensor's first n elements (Send/RecvOptions.n_elements), or tensor itself
    for n == 0."""
    if not n:
        return tensor
    if n < 0:
        raise ValueError(f"n_elements: must be >= 0, got {n}")
    torch_like = hasattr(tensor, "is_contiguous")
    contiguous = tensor.is_contiguous() if torch_like else tensor.flags.c_contiguous
    total = tensor.numel() if torch_like else tensor.size
    if not contiguous:
        raise ValueError("n_elements: the tensor is not contiguous, so its first elements are "
                         "not one block of memory")
    if n > total:
        raise ValueError(f"n_elements: {n} is more than the tensor's {total} elements")
    return tensor.reshape(-1)[:n]


_warned_read_only = False


def writable(tensor: Any) -> Any:
    """tensor, or a writable alias of it when it is a read-only numpy view of one of Ray's
    own buffers.

    Ray deserialises a numpy argument of an actor method as a read-only view of
    its object store (or of the call's inline buffer), and Ray's programs, its
    own tests included, then run in-place collectives on it: gloo writes
    through (torch.from_numpy ignores the flag), and so does ACCORD, with a
    warning once per process, since the object store's copy changes with it.
    Any other read-only array is left as it is, for accord to refuse with a
    ValueError.
    """
    global _warned_read_only
    if not isinstance(tensor, np.ndarray) or tensor.flags.writeable \
            or not tensor.flags.c_contiguous or not _ray_buffer(tensor):
        return tensor
    if not _warned_read_only:
        _warned_read_only = True
        warnings.warn("backend ACCORD: writing into a read-only array that Ray deserialised "
                      "from its object store (as Ray's gloo backend does); the stored object "
                      "changes too, and actors passed the same object share one array: pass "
                      "np.array(x) to keep it intact", stacklevel=5)
    raw = (ctypes.c_byte * tensor.nbytes).from_address(tensor.ctypes.data)
    return np.frombuffer(raw, dtype=tensor.dtype).reshape(tensor.shape)


def _ray_buffer(array: np.ndarray) -> bool:
    """True when array's memory is a buffer of Ray's (its base chain ends in ray._raylet)."""
    base = array
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    return type(base).__module__ == "ray._raylet"
