"""The lean path of the common small call: synchronous, on a group of plain links.

A collective of a few bytes costs its Python layers, not its bytes: argument
objects (Buf), a plan's closure, the group's queue check, the run wrapper, each
a few hundred nanoseconds, about as much again as the message itself takes.
For a synchronous call on contiguous numpy arrays (or CPU torch tensors whose
arrays accord keeps), `Lane` does the same work in one flat function per
collective: the checks the api makes, the call site, the stamp, the
flight-recorder entry, the deadlock check's bookkeeping, then the algorithm the
table picks, over a `Comm`, as the api's call would. Every failure goes through
the group's own error handling (`ProcessGroup._failed`), so a Desync, a lost
peer or a timeout reads the same.

A bfloat16 tensor goes as its bits (an int16 array) under its own dtype code, and
its reductions widen and narrow it as the api's do (halves.py).

Whatever the lane does not take (a non-contiguous or read-only array, a
tensor copied back after the call, a bad argument, an async call, a timedelta timeout, an open
coalescing block, ACCORD_DEBUG=DETAIL, a group spanning hosts, a queued async
call) it declines before it touches anything: it returns False and the api's
general path runs the call, raising its errors there.
"""
from time import monotonic as _monotonic, time as _now

import numpy as np

from .algorithms import Comm
from .algorithms import rooted, split
from .algorithms.table import entry
from .args import row_counts
from .buffers import BF16_CODE, Buf, already_in_place, as_buf, is_torch_tensor, sendable
from .debug.callsite import call_site
from .debug.groups import on_main_thread
from .debug.recorder import DONE, RUNNING, STATE, T_END, T_START
from .localcopy import copy_into
from .plans import reduce_moves, reduce_scatter_moves
from .reduceops import ReduceOp, check_op
from .transport.wire import NO_DTYPE, OP_CODES, Stamp

_BROADCAST, _ALL_REDUCE = OP_CODES["broadcast"], OP_CODES["all_reduce"]
_ALL_GATHER, _SCATTER, _BARRIER = OP_CODES["all_gather"], OP_CODES["scatter"], OP_CODES["barrier"]
_REDUCE_SCATTER, _ALL_TO_ALL = OP_CODES["reduce_scatter"], OP_CODES["all_to_all"]
_GATHER, _REDUCE = OP_CODES["gather"], OP_CODES["reduce"]
_EMPTY = np.empty(0, dtype=np.uint8)


def _plain(x, writable):
    """(flat array, (dtype number, name), shape) of a tensor the lane may take as it is:
    a contiguous numpy array, or a contiguous CPU torch tensor whose array accord keeps
    (buffers.py's cache); None for anything else, which the general path takes (or
    rejects with its error)."""
    if x.__class__ is np.ndarray:
        flags = x.flags
        if not flags.c_contiguous or writable and not flags.writeable:
            return None
        known = sendable(x.dtype)
        if known is None:
            return None
        return (x if x.ndim == 1 else x.reshape(-1)), known, x.shape
    if not is_torch_tensor(x):
        return None
    try:
        buf = as_buf(x, "tensor", writable)
    except (TypeError, ValueError):
        return None
    if buf._writeback is not None:
        return None                 # copied back after the call: the api's work
    # a bfloat16 tensor's array is its bits (int16); known says bfloat16, and the
    # reductions below reduce it as such
    return buf.arr, (buf.dtype_code, buf.dtype_name), buf.shape


def _root(g, src, group_src):
    """The group rank of a root given as a global rank or as group_src, None where the
    api would have to look closer (or raise)."""
    if group_src is not None:
        if src is None and group_src.__class__ is int and 0 <= group_src < g.size:
            return group_src
        return None
    ranks = g.ranks
    if src is None:
        return 0
    if src.__class__ is int and src in ranks:
        return ranks.index(src)
    return None


def _counts(flat, shape, sizes, n):
    """args.row_counts' element counts of n blocks of flat (of that shape), or None
    where it would raise, or where sizes is not a list of plain ints (the api
    converts other numbers; the lean path leaves those calls to it)."""
    if sizes is not None and (sizes.__class__ not in (list, tuple) or
                              any(k.__class__ is not int for k in sizes)):
        return None
    try:
        return row_counts(shape, flat.size, sizes, n, "", "")
    except ValueError:
        return None


def _root_blocks(g, root, items, known, writable, nbytes):
    """A rooted call's per-rank list (scatter's inputs, gather's outputs): on the root
    the plain arrays of known's dtype (each nbytes long, where nbytes is given), None
    off it; False where the api must look (or raise): anything else on the root, or
    anything but None off it (an empty list too: the api checks which it allows)."""
    if g.rank != root:
        return None if items is None else False
    if items.__class__ is not list or len(items) != g.size:
        return False
    blocks = []
    for x in items:
        b = _plain(x, writable)
        if b is None or b[1][0] != known[0] or nbytes is not None and b[0].nbytes != nbytes:
            return False
        blocks.append(b[0])
    return blocks


class Lane:
    """The lean path of one group (see the module's text); made with its links."""
    __slots__ = ("g", "_reducible")

    def __init__(self, g):
        self.g = g
        self._reducible = set()     # (op, dtype) pairs check_op accepted

    def _run(self, op, opname, root, known, redop, count, shape, timeout, move, a, b):
        """Run move(comm, group, a, b) as the group's next call; False (nothing done) if an
        earlier async call is still queued or the group cannot take calls now."""
        g = self.g
        if g._closed is not None or g.hier is not None:
            return False
        if timeout is None:
            timeout = g.timeout
        elif timeout.__class__ is not float and timeout.__class__ is not int or timeout <= 0:
            return False            # a timedelta, or a value the api rejects
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
                move(Comm(t, stamp, _monotonic() + timeout), g, a, b)
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
    def broadcast(self, tensor, src, group_src, timeout):
        g = self.g
        root = _root(g, src, group_src)
        if root is None:
            return False
        p = _plain(tensor, g.rank != root)
        if p is None:
            return False
        flat, known, shape = p
        return self._run(_BROADCAST, "broadcast", root, known, 0, flat.nbytes, shape, timeout,
                         _broadcast, flat, root)

    def _reducible_by(self, op, flat, known):
        """Whether op applies to flat's dtype, known[0] its code (what the api's check_op
        says, kept)."""
        key = (op, known[0])
        if key not in self._reducible:
            try:
                check_op(op, Buf(flat, flat.shape, None, known[0] == BF16_CODE))
            except TypeError:
                return False
            self._reducible.add(key)
        return True

    def all_reduce(self, tensor, op, timeout):
        p = _plain(tensor, True)
        if p is None or op.__class__ is not ReduceOp:
            return False
        flat, known, shape = p
        if not self._reducible_by(op, flat, known):
            return False
        return self._run(_ALL_REDUCE, "all_reduce", -1, known, int(op), flat.nbytes, shape,
                         timeout, _all_reduce, flat, (op, known[0] == BF16_CODE))

    def reduce(self, tensor, op, dst, group_dst, timeout):
        g = self.g
        root = _root(g, dst, group_dst)
        p = _plain(tensor, True)
        if root is None or p is None or op.__class__ is not ReduceOp:
            return False
        flat, known, shape = p
        if not self._reducible_by(op, flat, known):
            return False
        return self._run(_REDUCE, "reduce", root, known, int(op), flat.nbytes, shape, timeout,
                         _reduce, flat, (root, op, known[0] == BF16_CODE))

    def all_gather(self, outs, tensor, timeout):
        g = self.g
        p = _plain(tensor, False)
        if p is None or outs.__class__ is not list or len(outs) != g.size:
            return False
        flat, known, shape = p
        n = flat.nbytes
        blocks = []
        for o in outs:
            # every block this rank's size and dtype: uneven blocks take the api's path
            b = _plain(o, True)
            if b is None or b[1][0] != known[0] or b[0].nbytes != n:
                return False
            blocks.append(b[0])
        return self._run(_ALL_GATHER, "all_gather", -1, known, 0, n * g.size, shape, timeout,
                         _all_gather, blocks, flat)

    def all_gather_into_tensor(self, out, tensor, timeout):
        """all_gather into one output of group size x the input's elements (the call
        sharded training makes): the blocks are the output's consecutive views."""
        g = self.g
        p = _plain(tensor, False)
        if p is None:
            return False
        q = _plain(out, True)
        flat, known, shape = p
        n = flat.size
        if q is None or q[1][0] != known[0] or q[0].size != n * g.size:
            return False
        whole = q[0]
        blocks = [whole[i * n:(i + 1) * n] for i in range(g.size)]
        return self._run(_ALL_GATHER, "all_gather", -1, known, 0, flat.nbytes * g.size, shape,
                         timeout, _all_gather, blocks, flat)

    def reduce_scatter_tensor(self, out, tensor, op, timeout):
        """reduce_scatter of one input of group size x the output's elements (the call
        sharded training makes for its gradients)."""
        g = self.g
        p = _plain(out, True)
        if p is None or op.__class__ is not ReduceOp:
            return False
        q = _plain(tensor, False)
        flat, known, shape = p
        if q is None or q[1][0] != known[0] or q[0].size != flat.size * g.size or \
                not self._reducible_by(op, flat, known):
            return False
        whole = q[0]
        return self._run(_REDUCE_SCATTER, "reduce_scatter", -1, known, int(op), whole.nbytes,
                         shape, timeout, _reduce_scatter, flat,
                         (whole, op, known[0] == BF16_CODE))

    def scatter(self, tensor, ins, src, group_src, timeout):
        g = self.g
        root = _root(g, src, group_src)
        if root is None:
            return False
        p = _plain(tensor, True)
        if p is None:
            return False
        flat, known, shape = p
        blocks = _root_blocks(g, root, ins, known, False, flat.nbytes)
        if blocks is False:
            return False
        # the stamp's count is -1, as the api's: a scatter's shards may differ in size
        return self._run(_SCATTER, "scatter", root, known, 0, -1, shape, timeout, _scatter,
                         flat, (blocks, root))

    def gather(self, tensor, outs, dst, group_dst, timeout):
        g = self.g
        root = _root(g, dst, group_dst)
        if root is None:
            return False
        p = _plain(tensor, False)
        if p is None:
            return False
        flat, known, shape = p
        blocks = _root_blocks(g, root, outs, known, True, None)
        if blocks is False or blocks is not None and blocks[root].nbytes != flat.nbytes:
            return False
        # the stamp's count is -1, as the api's: the ranks' tensors may differ in size
        return self._run(_GATHER, "gather", root, known, 0, -1, shape, timeout, _gather,
                         flat, (blocks, root))

    def all_to_all_single(self, out, inp, out_sizes, in_sizes, timeout):
        """all_to_all_single of two plain tensors that do not overlap, split as the api
        splits them (equal, or by lists of ints): the blocks are views of each."""
        g = self.g
        p = _plain(out, True)
        q = _plain(inp, False)
        if p is None or q is None or p[1][0] != q[1][0]:
            return False
        flat, known, shape = p
        src = q[0]
        oc = _counts(flat, shape, out_sizes, g.size)
        ic = _counts(src, q[2], in_sizes, g.size)
        if oc is None or ic is None or oc[g.rank] != ic[g.rank] or \
                np.may_share_memory(flat, src):
            return False
        # the stamp's count is -1, as the api's: the blocks may differ in size
        return self._run(_ALL_TO_ALL, "all_to_all", -1, known, 0, -1, shape, timeout,
                         _all_to_all, split(flat, oc), split(src, ic))

    def all_to_all(self, outs, ins, timeout):
        """all_to_all of two lists of plain tensors, one per rank, of one dtype (each
        pair of blocks sized as its peer's; this rank's own pair alike)."""
        g = self.g
        n = g.size
        if outs.__class__ is not list or ins.__class__ is not list or len(outs) != n or \
                len(ins) != n:
            return False
        first = _plain(outs[0], True)
        if first is None:
            return False
        known, shape = first[1], first[2]
        out_blocks, in_blocks = [first[0]], []
        for o in outs[1:]:
            b = _plain(o, True)
            if b is None or b[1][0] != known[0]:
                return False
            out_blocks.append(b[0])
        for x in ins:
            b = _plain(x, False)
            if b is None or b[1][0] != known[0]:
                return False
            in_blocks.append(b[0])
        if out_blocks[g.rank].nbytes != in_blocks[g.rank].nbytes or \
                np.may_share_memory(out_blocks[g.rank], in_blocks[g.rank]):
            return False
        return self._run(_ALL_TO_ALL, "all_to_all", -1, known, 0, -1, shape, timeout,
                         _all_to_all, out_blocks, in_blocks)

    def barrier(self, timeout):
        return self._run(_BARRIER, "barrier", -1, None, 0, 0, None, timeout, _barrier, None,
                         None)


# -- the moves: what the api's plan bodies do, for plain arrays ------------------------
# (plain functions, not closures: a closure per call is what the lane saves)

def _broadcast(c, g, arr, root):
    entry("broadcast", arr.nbytes, c, g.options.algorithms).fn(c, arr, root)


def _all_reduce(c, g, arr, op_bf16):
    op, bf16 = op_bf16
    e = entry("all_reduce", arr.nbytes, c, g.options.algorithms)
    e.fn(c, arr, op, bf16, g.scratch(arr.dtype, e.scratch(arr.size, c.size, arr.itemsize)))


def _reduce(c, g, arr, root_op_bf16):
    root, op, bf16 = root_op_bf16
    reduce_moves(c, g, arr, root, op, bf16)


def _all_gather(c, g, blocks, mine):
    block = blocks[c.rank]
    in_place = already_in_place(mine, block)

    def own():
        if not in_place:
            copy_into(block, mine)
    entry("all_gather", mine.nbytes * c.size, c, g.options.algorithms).fn(c, blocks, mine, own)


def _reduce_scatter(c, g, out, whole_op_bf16):
    whole, op, bf16 = whole_op_bf16
    reduce_scatter_moves(c, g, split(whole, [out.size] * c.size), out, op, bf16, whole)


def _scatter(c, g, mine, shards):
    blocks, root = shards
    own = None
    if blocks is not None:
        def own():
            copy_into(mine, blocks[root])
    rooted.scatter(c, mine, blocks, root, own)


def _gather(c, g, mine, blocks_root):
    blocks, root = blocks_root
    if blocks is not None:
        copy_into(blocks[root], mine)
    rooted.gather(c, mine, blocks, root)


def _all_to_all(c, g, outs, ins):
    r = c.rank

    def own():
        copy_into(outs[r], ins[r])
    rooted.all_to_all(c, outs, ins, own)


def _barrier(c, g, a, b):
    rooted.barrier(c, _EMPTY)
