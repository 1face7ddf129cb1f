"""The lean path of the common small call: synchronous, on a group of plain links.

A collective of a few bytes costs its Python layers, not its bytes: argument
objects (Buf), a plan's closure, the group's queue check, the run wrapper, each
a few hundred nanoseconds, about as much again as the message itself takes.
For a synchronous call with the group's own timeout on contiguous numpy arrays,
`Lane` does the same work in one flat function per collective: the checks the
api makes, the call site, the stamp, the flight-recorder entry, the deadlock
check's bookkeeping, then the algorithm the table picks, over a `Comm`, as the
api's call would. Every failure goes through the group's own error handling
(`ProcessGroup._failed`), so a Desync, a lost peer or a timeout reads the same.

Whatever the lane does not take (a torch tensor, a non-contiguous or read-only
array, a bad argument, an async call, a timeout of its own, an open
coalescing block, ACCORD_DEBUG=DETAIL, a group spanning hosts, a queued async
call) it declines before it touches anything: it returns False and the api's
general path runs the call, raising its errors there.
"""
from time import monotonic as _monotonic, time as _now

import numpy as np

from .algorithms import Comm
from .algorithms import rooted
from .algorithms.table import entry
from .buffers import _SENDABLE, as_buf, sendable
from .debug.callsite import call_site
from .debug.groups import on_main_thread
from .debug.recorder import DONE, RUNNING, STATE, T_END, T_START
from .reduceops import ReduceOp, check_op
from .transport.wire import NO_DTYPE, OP_CODES, Stamp

_BROADCAST, _ALL_REDUCE = OP_CODES["broadcast"], OP_CODES["all_reduce"]
_ALL_GATHER, _SCATTER, _BARRIER = OP_CODES["all_gather"], OP_CODES["scatter"], OP_CODES["barrier"]
_EMPTY = np.empty(0, dtype=np.uint8)


def _known(arr, writable):
    """(dtype number, name) of a plain contiguous array the lane may take, else None
    (the general path takes it, or raises what is wrong with it)."""
    if arr.__class__ is not np.ndarray:
        return None
    flags = arr.flags
    if not flags.c_contiguous or writable and not flags.writeable:
        return None
    return _SENDABLE.get(arr.dtype) or sendable(arr.dtype)


class Lane:
    """The lean path of one group (see the module's text); made with its links."""
    __slots__ = ("g", "_reducible")

    def __init__(self, g):
        self.g = g
        self._reducible = set()     # (op, dtype) pairs check_op accepted

    def _run(self, op, opname, root, known, redop, count, shape, move, a, b):
        """Run move(comm, group, a, b) as the group's next call; False (nothing done) if an
        earlier async call is still queued or the group cannot take calls now."""
        g = self.g
        if g._closed is not None or g.hier is not None:
            return False
        # from the api's frame (3 up: _run, the lane's method, the api): always accord's
        site, where = call_site(3)
        main = on_main_thread()
        with g._issue_lock:
            if g._pending:
                return False        # issue order: behind the queued calls, as submit does
            seq = g._seq
            g._seq = seq + 1
            if known is None:
                code, dtype_name = NO_DTYPE, ""
            else:
                code, dtype_name = known
            stamp = Stamp(op, seq, root, code, redop, count, dtype_name, shape, site, where)
            rec = g.recorder
            e = rec.add(seq, opname, root if root < 0 else g.ranks[root], dtype_name, count,
                        shape, where)
            t = g._transport
            g.waiters += main
            t.current = (opname, seq, g.name)
            t.interrupted = None
            e[T_START] = _now()
            e[STATE] = RUNNING
            rec.current = e
            try:
                move(Comm(t, stamp, _monotonic() + g.timeout), g, a, b)
            except BaseException as exc:
                raise g._failed(exc, e)
            else:
                e[T_END] = _now()
                e[STATE] = DONE
                rec.last_done = e
            finally:
                rec.current = None
                t.current = None
                g.waiters -= main
        return True

    # -- the collectives: True once done, False to leave the call to the api ---------
    def broadcast(self, tensor, src):
        g = self.g
        ranks = g.ranks
        if src.__class__ is not int or src not in ranks:
            return False
        root = ranks.index(src)
        known = _known(tensor, g.rank != root)
        if known is None:
            return False
        flat = tensor if tensor.ndim == 1 else tensor.reshape(-1)
        return self._run(_BROADCAST, "broadcast", root, known, 0, flat.nbytes, tensor.shape,
                         _broadcast, flat, root)

    def all_reduce(self, tensor, op):
        g = self.g
        known = _known(tensor, True)
        if known is None or op.__class__ is not ReduceOp:
            return False
        key = (op, tensor.dtype)
        if key not in self._reducible:
            try:
                check_op(op, as_buf(tensor, "tensor"))
            except TypeError:
                return False
            self._reducible.add(key)
        flat = tensor if tensor.ndim == 1 else tensor.reshape(-1)
        return self._run(_ALL_REDUCE, "all_reduce", -1, known, int(op), flat.nbytes,
                         tensor.shape, _all_reduce, flat, op)

    def all_gather(self, outs, tensor):
        g = self.g
        known = _known(tensor, False)
        if known is None or outs.__class__ is not list or len(outs) != g.size:
            return False
        n = tensor.nbytes
        blocks = []
        for o in outs:
            # every block this rank's size and dtype: uneven blocks take the api's path
            if _known(o, True) is not known or o.nbytes != n:
                return False
            blocks.append(o if o.ndim == 1 else o.reshape(-1))
        flat = tensor if tensor.ndim == 1 else tensor.reshape(-1)
        if n * g.size >= 64 << 10:
            return False            # the api's in-place check matters from there
        return self._run(_ALL_GATHER, "all_gather", -1, known, 0, n * g.size, tensor.shape,
                         _all_gather, blocks, flat)

    def scatter(self, tensor, ins, src):
        g = self.g
        ranks = g.ranks
        if src.__class__ is not int or src not in ranks:
            return False
        root = ranks.index(src)
        known = _known(tensor, True)
        if known is None:
            return False
        n = tensor.nbytes
        blocks = None
        if g.rank == root:
            if ins.__class__ is not list or len(ins) != g.size:
                return False
            blocks = []
            for b in ins:
                if _known(b, False) is not known or b.nbytes != n:
                    return False
                blocks.append(b if b.ndim == 1 else b.reshape(-1))
        elif ins is not None and len(ins):
            return False
        flat = tensor if tensor.ndim == 1 else tensor.reshape(-1)
        # the stamp's count is -1, as the api's: a scatter's shards may differ in size
        return self._run(_SCATTER, "scatter", root, known, 0, -1, tensor.shape, _scatter, flat,
                         (blocks, root))

    def barrier(self):
        return self._run(_BARRIER, "barrier", -1, None, 0, 0, None, _barrier, None, None)


# -- the moves: what the api's plan bodies do, for plain arrays ------------------------
# (plain functions, not closures: a closure per call is what the lane saves)

def _broadcast(c, g, arr, root):
    entry("broadcast", arr.nbytes, c, g.options.algorithms).fn(c, arr, root)


def _all_reduce(c, g, arr, op):
    e = entry("all_reduce", arr.nbytes, c, g.options.algorithms)
    e.fn(c, arr, op, False, g.scratch(arr.dtype, e.scratch(arr.size, c.size, arr.itemsize)))


def _all_gather(c, g, blocks, mine):
    def own():
        blocks[c.rank][...] = mine
    entry("all_gather", mine.nbytes * c.size, c, g.options.algorithms).fn(c, blocks, mine, own)


def _scatter(c, g, mine, shards):
    blocks, root = shards
    own = None
    if blocks is not None:
        def own():
            mine[...] = blocks[root]
    rooted.scatter(c, mine, blocks, root, own)


def _barrier(c, g, a, b):
    rooted.barrier(c, _EMPTY)
