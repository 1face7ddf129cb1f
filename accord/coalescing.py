"""coalescing(): many small collectives become a few bucketed ones.

    with accord.coalescing():                  # or: with accord.coalescing(group) as c:
        for p in params:
            accord.all_reduce(p.grad)          # queued, not sent
    # here: one all_reduce per dtype bucket has run; every p.grad holds the sum

Inside the block, `broadcast`, `all_reduce` and `reduce` on the block's group
are queued instead of run. At exit, each run of consecutive calls of the same
kind and key (same src / same op / same dst and op) is packed by dtype into
buckets of at most `bucket_bytes` (25 MiB) and sent as one collective per
bucket; a tensor of a bucket's size or more goes alone, in place. Calls with
async_op=True return a Work at once, which completes when its bucket has been
unpacked after the flush; calls with async_op=False return None, and the block
waits for everything at exit (a block holding such a call runs its buckets at
exit on the calling thread, one after the other, and raises the first error
there). Results are written in place exactly as the plain calls write them.

Rules: tensors are read and written at exit, not at the call (keep them alive
and unchanged until then, as with async_op=True). A call on a tensor already
queued in the same run starts a new run, so reusing a tensor gives the same
result as the plain calls. Other collectives issued inside the block run when
called, before the queued ones; every rank reorders identically. If the block
raises, nothing queued is sent and the Works report the exception.

The module also provides the public `accord.broadcast`, `accord.all_reduce`
and `accord.reduce`: the api functions, routed to the innermost active block
of their group (one integer test when no block is active).
"""
from __future__ import annotations

import concurrent.futures
import threading
from typing import Optional

from . import api
from .args import root_rank
from ._packing import check_bucket_bytes, plan_buckets, tensor_view
from .buffers import BF16_CODE
from .reduceops import ReduceOp, as_reduce_op, check_op
from .state import broadcast_bucket
from ._types import Tensor, Timeout
from .group import ProcessGroup
from .work import Work, completed_work
from .world import not_member, resolve_group

_active = 0                      # blocks open in any thread: the fast path tests this only
_local = threading.local()
_active_lock = threading.Lock()


def _stack():
    s = getattr(_local, "stack", None)
    if s is None:
        s = _local.stack = []
    return s


def _current(group):
    stack = _stack()
    if not stack:
        return None
    g = resolve_group(group)
    for c in reversed(stack):
        if c.group is g:
            return c
    return None


_OPS_OK = set()         # (op, dtype code) pairs check_op accepted: it depends on nothing else


def _check_op(op, view, code, dtype):
    if (op, code) not in _OPS_OK:
        check_op(op, _OpCheck(view, code, dtype))
        _OPS_OK.add((op, code))


class _OpCheck:
    """What check_op needs to know about a tensor, without copying it."""
    __slots__ = ("arr", "is_bf16", "dtype_name")

    def __init__(self, view, code, name):
        self.arr, self.is_bf16, self.dtype_name = view, code == BF16_CODE, name


def _new_future():
    f = concurrent.futures.Future()
    f.set_running_or_notify_cancel()
    return f


class _Pending:
    # future: made for a call that handed out a Work, or when a flush runs it on the
    # group's worker thread; a synchronous call run at the block's exit needs none
    __slots__ = ("tensor", "view", "code", "future", "desc")

    def __init__(self, tensor, view, code, desc, async_op):
        self.tensor, self.view, self.code, self.desc = tensor, view, code, desc
        self.future = _new_future() if async_op else None


class _Run:
    """Consecutive queued calls of one kind and key."""
    __slots__ = ("kind", "key", "items", "ptrs")

    def __init__(self, kind, key):
        self.kind, self.key, self.items, self.ptrs = kind, key, [], set()


class coalescing:
    """Context manager: queue small collectives of `group` and flush them bucketed at exit.

        with accord.coalescing():
            for p in params:
                accord.all_reduce(p.grad)      # queued
        # one all_reduce per dtype bucket has run; every p.grad holds the sum

    Inside the block, `broadcast`, `all_reduce` and `reduce` on the block's
    group are queued. At exit, each run of consecutive calls of the same kind
    and key (same src; same op; same dst and op) is packed by dtype into buckets
    and sent as one collective per bucket; a tensor of a bucket's size or more
    goes alone, in place. Other collectives inside the block run at once, after
    the queued calls before them are flushed. torch has a private
    `_coalescing_manager` for the same purpose; this is accord's public one.

    Args:
        group: the group whose calls are queued (default: the default group).
        bucket_bytes: largest bucket, in bytes (default 25 MiB).
        timeout: the timeout of each bucketed collective (default: the group's).

    After exit, `works` holds the Work of every bucketed collective and
    `wait()` waits for them all; `calls` and `collectives` count the queued
    calls and the collectives they became.

    Raises:
        RuntimeError: the block is entered twice; the queued calls fail with it
            when the block raises.
        ValueError: a bad bucket_bytes.
    """

    def __init__(self, group: Optional[ProcessGroup] = None, bucket_bytes: Optional[int] = None,
                 timeout: Timeout = None) -> None:
        self.group = resolve_group(group)
        self.bucket_bytes = check_bucket_bytes(bucket_bytes)
        self.timeout = timeout
        self.works = []
        self._flushed = []        # the futures of every flushed call: done once unpacked
        self._touched = set()     # the (address, size) of every tensor flushed so far
        self._runs = []
        self._must_wait = False
        self._open = False
        self.calls = 0            # calls queued
        self.collectives = 0      # collectives they became

    # -- the block ------------------------------------------------------------
    def __enter__(self):
        global _active
        if self._open:
            raise RuntimeError("coalescing: this block is already open")
        self._open = True
        _stack().append(self)
        with _active_lock:
            _active += 1
        return self

    def __exit__(self, exc_type, exc, tb):
        global _active
        stack = _stack()
        if stack and stack[-1] is self:
            stack.pop()
        elif self in stack:
            stack.remove(self)
        with _active_lock:
            _active -= 1
        self._open = False
        if exc_type is not None:
            err = RuntimeError(f"coalescing: the block raised {exc_type.__name__}; the queued "
                               f"collectives were not sent")
            _settle_all(self._runs, err)
            self._runs = []
            return False
        if self._must_wait:
            # exit waits for everything anyway: run the buckets here, in order
            self._run_queued()
            self.wait()
        else:
            self.flush()
        return False

    def wait(self, timeout: Timeout = None) -> None:
        """Wait until every flushed call's tensors are written (re-raises the first error)."""
        for f in self._flushed:
            Work(f, "coalesced call").wait(timeout)
        return True

    # -- queueing -----------------------------------------------------------------
    def _add(self, kind, key, tensor, view, code, async_op, desc):
        if not self._open:
            raise RuntimeError("coalescing: the block is closed")
        if not self.group.is_member:
            return not_member(self.group, kind)
        run = self._runs[-1] if self._runs else None
        # a torch tensor's address costs 0.06 µs, an array's interface dict 1 µs
        addr = view.__array_interface__["data"][0] if tensor is view else tensor.data_ptr()
        ptr = (addr, view.nbytes)
        if run is None or run.kind != kind or run.key != key or ptr in run.ptrs:
            run = _Run(kind, key)
            self._runs.append(run)
        run.ptrs.add(ptr)
        p = _Pending(tensor, view, code, desc, async_op)
        run.items.append(p)
        self.calls += 1
        if not async_op:
            self._must_wait = True
            return None
        return Work(p.future, f"{desc} (coalesced on group {self.group.name!r})")

    def broadcast(self, tensor: Tensor, src: Optional[int] = None, async_op: bool = False,
                  group_src: Optional[int] = None) -> Optional[Work]:
        """Queue a broadcast on the block's group (what `accord.broadcast` does in the block)."""
        g = self.group
        root = root_rank(g, src, group_src, "src")
        view, code, _ = tensor_view(tensor, "tensor")
        return self._add("broadcast", root, tensor, view, code, async_op, "broadcast")

    def all_reduce(self, tensor: Tensor, op: ReduceOp = ReduceOp.SUM,
                   async_op: bool = False) -> Optional[Work]:
        """Queue an all_reduce on the block's group."""
        op = as_reduce_op(op)
        view, code, dtype = tensor_view(tensor, "tensor")
        _check_op(op, view, code, dtype)
        return self._add("all_reduce", op, tensor, view, code, async_op, "all_reduce")

    def reduce(self, tensor: Tensor, dst: Optional[int] = None, op: ReduceOp = ReduceOp.SUM,
               async_op: bool = False, group_dst: Optional[int] = None) -> Optional[Work]:
        """Queue a reduce on the block's group."""
        g = self.group
        root = root_rank(g, dst, group_dst, "dst")
        op = as_reduce_op(op)
        view, code, dtype = tensor_view(tensor, "tensor")
        _check_op(op, view, code, dtype)
        return self._add("reduce", (root, op), tensor, view, code, async_op, "reduce")

    # -- flushing -------------------------------------------------------------------
    def flush(self) -> list:
        """Send everything queued so far (exit does this); returns the new Works."""
        g, runs, self._runs = self.group, self._runs, []
        new, touched = [], self._touched
        try:
            for run in runs:
                if run.ptrs & touched:
                    # a tensor sent before (by this flush or an earlier one) again: its
                    # result must land before we pack
                    self.wait()
                touched |= run.ptrs
                for p in run.items:
                    if p.future is None:
                        p.future = _new_future()
                    self._flushed.append(p.future)
                items = [(p.view, p.code, p) for p in run.items]
                for b in plan_buckets(items, self.bucket_bytes):
                    new.append(self._issue(g, run, b))
        except BaseException as exc:
            _settle_all(runs, exc)      # what was not sent fails with it
            raise
        finally:
            self.works.extend(new)
            self.collectives += len(new)
        # zero-size tensors need no bytes: done at once
        for run in runs:
            for p in run.items:
                if p.view.size == 0 and not p.future.done():
                    p.future.set_result(None)
        return new

    def _run_queued(self):
        """Every queued call's buckets as synchronous collectives on this thread, in
        order, each unpacked and settled before the next is packed (so a tensor queued
        in two runs needs no wait between them).

        What the worker thread and a Future per call cost is more than small buckets'
        transfers: 100 broadcasts of 256 B-4 KiB at world 2 took 1115-1214 µs a block
        flushed that way, 387-457 µs run here. On an error, every call not yet done
        fails with it (its Work too), and it is raised here."""
        g, runs, self._runs = self.group, self._runs, []
        planned = [(run, b) for run in runs for b in plan_buckets(
            [(p.view, p.code, p) for p in run.items], self.bucket_bytes)]
        try:
            self.wait()     # what flush() sent earlier may still write tensors packed here
            for run, b in planned:
                self.works.append(self._issue(g, run, b, False))
                self.collectives += 1
        except BaseException as exc:
            _settle_all(runs, exc)
            raise
        _settle_all(runs, None)           # zero-size calls: no bytes to move

    def _issue(self, g, run, b, async_op=True):
        """Bucket b of run as one collective: a Work settling the bucket's calls when it
        completes (async_op), or run now, unpacked and settled (a completed Work)."""
        kind, key = run.kind, run.key
        me = g.rank
        t = self.timeout
        if kind == "broadcast" and not b.direct:
            # small ones packed, large ones in place: one collective, like broadcast_state
            w = broadcast_bucket(g, key, b, async_op, t)
            if not async_op:
                _settle(b, None)
                return completed_work(kind)
            w.get_future().add_done_callback(lambda f, b=b: _settle(b, f.exception()))
            return w
        if b.direct:
            target = b.user[0].tensor          # the caller's tensor as it is (bfloat16 too)
            unpack = False
        else:
            b.allocate()
            target = b.array
            writes = kind == "all_reduce" or (kind == "broadcast" and me != key) or \
                (kind == "reduce" and me == key[0])
            if kind != "broadcast" or me == key:
                b.pack()
            unpack = writes
        if kind == "broadcast":
            w = api.broadcast(target, group=g, group_src=key, async_op=async_op, timeout=t)
        elif kind == "all_reduce":
            w = api.all_reduce(target, key, group=g, async_op=async_op, timeout=t)
        else:
            w = api.reduce(target, group=g, group_dst=key[0], op=key[1], async_op=async_op,
                           timeout=t)
        if not async_op:
            if unpack:
                b.unpack()
            _settle(b, None)
            return completed_work(kind)

        def done(f, b=b, unpack=unpack):
            exc = f.exception()
            if exc is None and unpack:
                try:
                    b.unpack()
                except BaseException as e:      # noqa: BLE001 - handed to the Works
                    exc = e
            _settle(b, exc)
        w.get_future().add_done_callback(done)
        return w


def _settle_all(runs, exc):
    """Settle every call of runs whose Work is not done yet."""
    for run in runs:
        for p in run.items:
            f = p.future
            if f is not None and not f.done():
                if exc is None:
                    f.set_result(None)
                else:
                    f.set_exception(exc)


def _settle(bucket, exc):
    for p in bucket.user:
        if p.future is None or p.future.done():
            continue
        if exc is None:
            p.future.set_result(None)
        else:
            p.future.set_exception(exc)


# -- the public functions, routed through an open block ---------------------------

def broadcast(tensor: Tensor, src: Optional[int] = None, group: Optional[ProcessGroup] = None,
              async_op: bool = False, group_src: Optional[int] = None,
              timeout: Timeout = None) -> Optional[Work]:
    """Copy the root's `tensor` into every rank's `tensor`, in place.

    Inside a `coalescing()` block of its group the call is queued, and sent with
    the block's other calls as a few bucketed collectives.

    Args:
        tensor: the data on the root (only read there; it may be read-only), and
            where it lands on the other ranks (same size and dtype on every rank).
        src: the root's global rank (default 0).
        group: the group to run on (default: the default group). On a rank that is
            not a member the call does nothing and returns None, as in torch.
        async_op: return a `Work` at once instead of waiting for the result.
        group_src: the root as a rank of `group` instead of src (as torch 2.6+).
        timeout: seconds (or a timedelta) for this call only; default: the group's
            timeout (`ACCORD_TIMEOUT`, 1800 s). Not in torch.

    Returns:
        None, or a `Work` with `async_op=True` (None on a non-member). Inside a
        `coalescing()` block of its group the call is queued and, with
        `async_op=True`, its Work completes when the block flushes.

    Raises:
        ValueError, TypeError: bad arguments, raised on the calling rank before any
            byte moves.
        accord.Desync: the ranks of the group called different collectives, or the
            same one with different roots, dtypes or sizes (raised on every rank
            involved).
        accord.PeerLost: a rank of the group died or left.
        accord.CommTimeout: the call did not complete within its timeout.
        accord.GroupClosed: the group was destroyed or broken by an earlier error.
    """
    if _active:
        c = _current(group)
        if c is not None:
            return c.broadcast(tensor, src, async_op, group_src)
    return api.broadcast(tensor, src, group, async_op, group_src, timeout)


def all_reduce(tensor: Tensor, op: ReduceOp = ReduceOp.SUM, group: Optional[ProcessGroup] = None,
               async_op: bool = False, timeout: Timeout = None) -> Optional[Work]:
    """Reduce `tensor` over every rank of the group; every rank gets the result, in place.

    Inside a `coalescing()` block of its group the call is queued, and sent with
    the block's other calls as a few bucketed collectives.

    Args:
        tensor: this rank's input, overwritten with the result.
        op: a `ReduceOp` (SUM, PRODUCT, MIN, MAX, BAND, BOR, BXOR, AVG); AVG is
            supported for every dtype the sum is (gloo has no AVG).
        group: the group to run on (default: the default group). On a rank that is
            not a member the call does nothing and returns None, as in torch.
        async_op: return a `Work` at once instead of waiting for the result.
        timeout: seconds (or a timedelta) for this call only; default: the group's
            timeout (`ACCORD_TIMEOUT`, 1800 s). Not in torch.

    Returns:
        None, or a `Work` with `async_op=True` (None on a non-member). Inside a
        `coalescing()` block of its group the call is queued and, with
        `async_op=True`, its Work completes when the block flushes.

    Raises:
        ValueError, TypeError: bad arguments, raised on the calling rank before any
            byte moves.
        accord.Desync: the ranks of the group called different collectives, or the
            same one with different roots, dtypes or sizes (raised on every rank
            involved).
        accord.PeerLost: a rank of the group died or left.
        accord.CommTimeout: the call did not complete within its timeout.
        accord.GroupClosed: the group was destroyed or broken by an earlier error.
    """
    if _active:
        c = _current(group)
        if c is not None:
            return c.all_reduce(tensor, op, async_op)
    return api.all_reduce(tensor, op, group, async_op, timeout)


def reduce(tensor: Tensor, dst: Optional[int] = None, op: ReduceOp = ReduceOp.SUM,
           group: Optional[ProcessGroup] = None, async_op: bool = False,
           group_dst: Optional[int] = None, timeout: Timeout = None) -> Optional[Work]:
    """Reduce `tensor` over every rank of the group into the root's `tensor`.

    Inside a `coalescing()` block of its group the call is queued, and sent with
    the block's other calls as a few bucketed collectives.

    Args:
        tensor: this rank's input; on the root, overwritten with the result
            (elsewhere, as torch, its contents afterwards are unspecified).
        dst: the root's global rank (default 0).
        op: a `ReduceOp`.
        group: the group to run on (default: the default group). On a rank that is
            not a member the call does nothing and returns None, as in torch.
        async_op: return a `Work` at once instead of waiting for the result.
        group_dst: the root as a rank of `group` instead of dst.
        timeout: seconds (or a timedelta) for this call only; default: the group's
            timeout (`ACCORD_TIMEOUT`, 1800 s). Not in torch.

    Returns:
        None, or a `Work` with `async_op=True` (None on a non-member). Inside a
        `coalescing()` block of its group the call is queued and, with
        `async_op=True`, its Work completes when the block flushes.

    Raises:
        ValueError, TypeError: bad arguments, raised on the calling rank before any
            byte moves.
        accord.Desync: the ranks of the group called different collectives, or the
            same one with different roots, dtypes or sizes (raised on every rank
            involved).
        accord.PeerLost: a rank of the group died or left.
        accord.CommTimeout: the call did not complete within its timeout.
        accord.GroupClosed: the group was destroyed or broken by an earlier error.
    """
    if _active:
        c = _current(group)
        if c is not None:
            return c.reduce(tensor, dst, op, async_op, group_dst)
    return api.reduce(tensor, dst, op, group, async_op, group_dst, timeout)


