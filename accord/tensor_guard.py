"""A quick check that a list of torch tensors is still what it was: torch's own guard.

A repeated broadcast_state checks, tensor by tensor, that every tensor of the dict
still has the address, shape, dtype and contiguous layout its entry copies by
(flat_state.py). In Python that is four attribute reads a tensor, each a call into
torch: 77-87 µs for 300 tensors in one idle process, and 110-250 µs a call inside a
sync loop, where the copy of the state's megabytes has pushed the tensors' own
metadata out of the caches. torch.compile faces the same question before it reuses
a compiled graph, and answers it in C++ for all the inputs in one call: the guard
its compiled frames hold (torch._C._dynamo.guards.TensorGuards), which compares each
tensor's dtype, device, sizes, strides, requires_grad and dispatch keys with those
it was made from (17 µs for the same 300 tensors). The addresses are not among
them, so they are read as before, one map over the list (17 µs).

This is torch's private interface: the guard is made only where it exists and takes
the arguments it takes in torch 2.x, and it is an accelerator alone. `holds` says
True only when the guard accepts every tensor and every address is the same, which
implies what the Python check compares (a guard made from contiguous tensors accepts
only the same strides); where it says False the caller runs the Python check, so a
difference the guard sees and the Python check does not (requires_grad turned off,
a call under inference_mode where the entry was made outside it) costs the Python
check's time and changes no answer.
"""
from __future__ import annotations

import sys
from typing import Any, List, Optional, Sequence


def _guard_class():
    """torch's TensorGuards, or None (no torch imported, or a build without it)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        from torch._C._dynamo.guards import TensorGuards
    except Exception:       # another torch build, or none of it
        return None
    return TensorGuards


class Guard:
    """What `make` returns: torch's guard over the tensors and their addresses."""
    __slots__ = ("check", "addrs", "data_ptr")

    def __init__(self, check, addrs, data_ptr):
        self.check, self.addrs, self.data_ptr = check, addrs, data_ptr


def make(vals: Sequence[Any]) -> Optional[Guard]:
    """A Guard for vals (torch tensors, as a repeated sync's entry holds them), or None
    where torch's guard is not there, vals are not all torch tensors, or the guard
    does not accept the very tensors it was made from."""
    cls = _guard_class()
    if cls is None or not vals:
        return None
    torch = sys.modules["torch"]
    T = torch.Tensor
    try:
        if not all(isinstance(v, T) for v in vals):
            return None
        g = cls(*vals, dynamic_dims_sizes=[list(v.shape) for v in vals],
                dynamic_dims_strides=[list(v.stride()) for v in vals])
        addrs = list(map(T.data_ptr, vals))
        if g.check(*vals) is not True:
            return None
    except Exception:       # the guard's arguments differ in this torch
        return None
    return Guard(g.check, addrs, T.data_ptr)


def holds(guard: Guard, vals: List[Any]) -> bool:
    """True if every tensor of vals passes the guard and sits at the same address as
    when it was made; False says only that the caller must check the slow way."""
    try:
        return guard.check(*vals) is True and \
            list(map(guard.data_ptr, vals)) == guard.addrs
    except Exception:       # a value that is no tensor, a list of another length
        return False
