"""The flat plans: one collective's body over a group's own links, and its stamp.

A plan is a pair (run, stamp): run(c) moves the bytes of one call over a `Comm`
(c is None in a group of one, where nothing moves), and stamp is the tuple the
group turns into the call's wire `Stamp` (root, dtype code, reduce op, byte
count, dtype name, shape). `run()` hands a body to its group in issue order.

Both the api (a call on the user's group) and the hierarchy (one phase of a call
on a subgroup) build their calls from these, which is why they live below both:
the hierarchy never needs the api.
"""
import numpy as np

from .algorithms import rooted
from .algorithms.reduction import (has_children, piece_elems, ring_reduce_scatter_into,
                                   tree_reduce)
from .algorithms.table import ALGORITHMS, choose, entry
from .buffers import already_in_place
from .localcopy import copy_into
from .options import to_seconds
from .reduceops import ReduceOp, finish_avg
from .transport.wire import NO_DTYPE
from .work import completed_work

_EMPTY = np.empty(0, dtype=np.uint8)


def stamp(buf, root=-1, op=0, count=-1):
    """The stamp arguments of a call on buf (see ProcessGroup.submit)."""
    return (root, buf.dtype_code, int(op), count, buf.dtype_name, buf.shape)


def run(g, opname, body, async_op, timeout, stamp_args, call=None):
    """Run body(comm) as the next call of group g; a Work with async_op, else its result.

    stamp_args: (root, dtype code, reduce op, byte count, dtype name[, shape]), as stamp().
    call: (api function, root, {argument: tensor}) when the api makes the call, which
    ACCORD_DEBUG=DETAIL checks across ranks and logs (debug/detail.py)."""
    if timeout is not None:
        timeout = to_seconds(timeout, "timeout")
    if len(stamp_args) == 5:
        stamp_args += (None,)           # no shape to report
    if g.size == 1:
        # a group of one moves no bytes; run the local part on the caller's thread
        g.check_open()
        body(None)
        return completed_work(opname) if async_op else None
    return g.submit(opname, body, async_op, timeout, stamp_args, call)


def broadcast_run(g, buf, root, finish=False):
    """(body moving buf from root over g's own links, stamp arguments); finish: the
    body also writes the result back into a non-contiguous original (buf.finish)."""
    forced = g.options.algorithms
    nbytes = buf.nbytes

    def body(c):
        if c is not None:
            choose("broadcast", nbytes, c, forced)(c, buf.arr, root)
        if finish:
            buf.finish()
    return body, (root, buf.dtype_code, 0, nbytes, buf.dtype_name, buf.shape)


def reduce_run(g, buf, root, op, in_place=False):
    """(body reducing buf to root over g's links, stamp arguments); in_place: a
    non-root's buf may be used as scratch (it is overwritten afterwards anyway)."""
    def body(c):
        if c is not None:
            reduce_moves(c, g, buf.arr, root, op, buf.is_bf16, in_place)
    return body, stamp(buf, root, op, buf.nbytes)


def reduce_moves(c, g, arr, root, op, is_bf16, in_place=False):
    """Reduce arr (flat) to root over c, into the root's arr (the api's call and the
    lean path's); in_place: as reduce_run's.

    Non-root inputs stay untouched, as NCCL leaves them: a leaf of the tree sends
    its input as it is, a non-root that receives reduces it with its first child's
    part into a new array (never copying it first)."""
    tmp = g.scratch(arr.dtype, min(arr.size, piece_elems(arr.itemsize)))
    if c.rank != root and not in_place and has_children(c.size, c.rank, root):
        tree_reduce(c, np.empty_like(arr), root, op, is_bf16, tmp, src=arr)
    else:
        tree_reduce(c, arr, root, op, is_bf16, tmp)


def all_reduce_run(g, buf, op, finish=False):
    """(body all-reducing buf over g's own links, stamp arguments); finish: as in
    broadcast_run."""
    forced = g.options.algorithms

    def body(c):
        if c is not None:
            # the ring works piece by piece; recursive doubling (small messages) whole
            arr = buf.arr
            e = entry("all_reduce", buf.nbytes, c, forced)
            tmp = g.scratch(arr.dtype, e.scratch(arr.size, c.size, arr.itemsize))
            e.fn(c, arr, op, buf.is_bf16, tmp)
        if finish:
            buf.finish()
    return body, stamp(buf, -1, op, buf.nbytes)


def reduce_scatter_moves(c, g, ins, out, op, is_bf16, whole=None):
    """Reduce the per-rank blocks ins of g's input (only read) over c (None in a group
    of one) into out, this rank's result, averaged for AVG (the api's call and the
    lean path's). whole: the input as one array, where ins are its consecutive blocks.

    The algorithm table picks the ring, recursive halving (through the shared slots
    in all_reduce's slotted range) or (small, beyond two ranks) one direct step or
    recursive doubling by size and world (the same answer on every rank); all but the
    ring need the input
    as one array of equal blocks (one copy of it where a list of equal blocks came),
    so they run on every rank or on none: the block sizes, the size and the world
    are the same everywhere."""
    if c is not None and c.size == 2:
        # two ranks: always the ring (its one exchange), the other two need more ranks
        if np.may_share_memory(out, ins[1 - g.rank]):
            ins = [b.copy() for b in ins]       # see below
        tmp = g.scratch(out.dtype, min(max(ins[0].size, ins[1].size),
                                       piece_elems(out.itemsize)))
        ring_reduce_scatter_into(c, ins, out, op, is_bf16, tmp)
    elif c is not None:
        r = g.rank
        total = sum(b.nbytes for b in ins)
        e = entry("reduce_scatter", total, c, g.options.algorithms)
        algos = ALGORITHMS["reduce_scatter"]
        one_array = e is not algos["ring"] and all(b.size == out.size for b in ins)
        if any(k != r and np.may_share_memory(out, b) for k, b in enumerate(ins)):
            # out lies over another rank's input block, which is read after out is
            # first written: reduce a copy of the input instead
            whole = None
            ins = [b.copy() for b in ins]
        if not one_array:
            e = algos["ring"]
        elif whole is None and e is not algos["direct"]:
            whole = np.concatenate(ins)
        per = piece_elems(out.itemsize)
        if e is algos["direct"]:
            tmp, spare = g.scratch(out.dtype, (c.size - 1) * out.size), None
        elif e is algos["doubling"]:
            buf = g.scratch(out.dtype, 2 * whole.size)
            tmp, spare = buf[:whole.size], buf[whole.size:]
        elif e is algos["slotted"]:
            tmp, spare = None, g.scratch(out.dtype, whole.size // 2)
        elif one_array:
            half = whole.size // 2
            need = min(half, per)
            buf = g.scratch(out.dtype, need + half)
            tmp, spare = buf[:need], buf[need:need + half]
        else:
            tmp, spare = g.scratch(out.dtype, min(max(b.size for b in ins), per)), None
        e.fn(c, ins, whole, out, op, is_bf16, tmp, spare)
    elif not already_in_place(out, ins[g.rank]):
        copy_into(out, ins[g.rank])
    if op == ReduceOp.AVG:
        finish_avg(out, g.size, is_bf16)


def barrier_run(g):
    """(body of a barrier over g's links, stamp arguments: no dtype, no bytes)."""
    def body(c):
        if c is not None:
            rooted.barrier(c, _EMPTY)
    return body, (-1, NO_DTYPE, 0, 0, "", None)
