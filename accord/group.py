"""ProcessGroup: one ordered stream of collectives among a set of ranks,
and point-to-point messages beside it.

Every rank issues the same sequence of collectives on a group (DESIGN
invariant 1), so a call's sequence number is known everywhere and messages
between two ranks match in FIFO order. Synchronous calls run on the caller's
thread when nothing is queued (a thread hand-off costs tens of µs); async
calls, and any call issued while async work is pending, go through the
group's single worker thread, which keeps the issue order, unless a thread
waits on one of them before the worker has begun it: the waiting thread then
runs it (and the queued calls before it) itself, in the same order.

Point-to-point operations are not part of that stream: they go to the
group's p2p engine (transport/p2p.py), which matches them by source and tag
on links of their own, so a posted receive never holds up a collective and a
collective never holds up a send.
"""
import collections
import concurrent.futures
import queue
import threading
import time

import numpy as np

from . import debug
from .debug import detail
from .algorithms import Comm
from .debug.callsite import call_site
from .debug.groups import on_main_thread
from .debug.recorder import DONE, ERROR, FAILED, RUNNING, STATE, T_END, T_START
from .lane import Lane
from .errors import AccordError, CommTimeout, Desync, GroupClosed
from .transport.p2p import Engine, Pending
from .transport.wire import OP_CODES, Stamp, decode_error, encode_error
from .work import Outcome, Work

_now, _monotonic = time.time, time.monotonic
_NO_STAMP = (-1, 0, 0, -1, "", None)     # a call that carries no tensor

# at destroy, how long to read peers' last messages before their goodbye: a call in
# which ranks disagree but each only sends leaves a message nobody read
GOODBYE_S = 0.5
_SENT = Outcome.settled()        # every send over within its isend call (it holds no state)


def _record_end(entry, exc):
    """A posted point-to-point operation is over (exc: its error, or None): its flight
    recorder entry says so (the engine's on_done, called with the entry)."""
    entry[T_END] = _now()
    if exc is None:
        entry[STATE] = DONE
    else:
        entry[STATE] = FAILED
        entry[ERROR] = f"{type(exc).__name__}: {exc}"


class ProcessGroup:
    """A group of ranks that run collectives together, as torch's ProcessGroup.

    Made by `init_process_group()` (the default group), `new_group()` and
    `new_subgroups()`; pass it as `group=` to any collective. Its calls run in
    issue order, one at a time; with `async_op=True` they run in the order they
    were issued, on a worker thread. `rank` is this process's rank in the
    group (-1 on a non-member), `size` its number of ranks, `ranks` the
    members' global ranks. Use `accord.get_rank(group)` and friends rather
    than the attributes, as in torch.
    """

    def __init__(self, name, ranks, global_rank, transport=None, timeout=1800.0, options=None):
        self.name = name
        self.ranks = list(ranks)                   # global ranks, sorted
        self.global_rank = global_rank
        self.rank = self.ranks.index(global_rank) if global_rank in self.ranks else -1
        self.size = len(self.ranks)
        self.options = options
        self.store = None                          # where positions are published (debug/)
        self.recorder = debug.Recorder()
        self._transport = None
        self.transport = transport
        self.timeout = timeout
        self._seq = 0
        self._issue_lock = threading.Lock()
        self._pending = 0
        # async calls not yet run, in issue order (and None: the worker is to stop),
        # taken under _items_lock by the worker thread or by a thread waiting on the last
        # of them (run_queued); _running: one of them is running. _wakes: a token per
        # call queued or left over, which the worker blocks on (a C queue: a Condition's
        # wait and notify in Python cost more than the calls they hand over)
        self._items = collections.deque()
        self._items_lock = threading.Lock()
        self._running = False
        self._wakes = None
        self._worker = None
        self._closed = None
        self.lane = None
        self._scratch = None
        self._scratch_views = {}     # (dtype, numel) -> its view of _scratch
        # the main thread is blocked until a call of this group completes (0 or 1): what
        # the deadlock check (debug/deadlock.py) needs to know the rank cannot move on by itself
        self.waiters = 0
        self.hier = None             # per-host subgroups of a group spanning hosts
        self.p2p = None              # the point-to-point engine (attach_p2p)

    def scratch(self, dtype, numel):
        """A reusable receive buffer for reductions (one call runs at a time per group).

        Reused rather than allocated per call: a fresh multi-MiB array costs its page
        faults again on every call."""
        key = (dtype, numel)
        view = self._scratch_views.get(key)
        if view is not None:
            return view          # a small call's view costs more to cut than to look up
        dtype = np.dtype(dtype)
        nbytes = numel * dtype.itemsize
        if self._scratch is None or self._scratch.size < nbytes:
            self._scratch = np.empty(max(nbytes, 64), dtype=np.uint8)
            self._scratch_views.clear()      # views of the old buffer
        view = self._scratch[:nbytes].view(dtype)
        if len(self._scratch_views) < 64:
            self._scratch_views[key] = view
        return view

    @property
    def transport(self):
        return self._transport

    @transport.setter
    def transport(self, t):
        self._transport = t
        # the lean path of small synchronous calls (lane.py), where the group runs them
        # itself: not under ACCORD_DEBUG=DETAIL, which checks each call's arguments first
        self.lane = Lane(self) if t is not None and self.size > 1 and \
            self.options is not None and self.options.debug != "DETAIL" else None
        if t is not None:
            # what a Desync message needs: this rank's past calls, call sites' text
            t.history = self._history
            t.site_text = self._site_text
            t.reason_of = self._abort_reason
            debug.register(self)

    def attach_p2p(self, plane):
        """Give the group its point-to-point plane (a transport of its own)."""
        plane.history = self._history
        plane.site_text = self._site_text
        plane.reason_of = self._abort_reason
        plane.peer_text = lambda peer: debug.peer_text(self, peer)
        self.p2p = Engine(plane, self.name, self.ranks, f"rank {self.global_rank}")

    def p2p_op(self, opname, is_send, peer, view, tag, timeout=None, finish=None, entry=None):
        """A point-to-point operation ready for post_p2p (peer: group rank or None).
        entry: its flight-recorder entry, if p2p_entry() made it already."""
        timeout = self.timeout if timeout is None else timeout
        if entry is None:
            entry = self.p2p_entry(opname, peer, len(view))
        # its description is made only for a message (most operations never need one)
        return Pending(is_send, peer, view, tag, timeout,
                       (self.p2p_text, opname, is_send, peer, tag, len(view)), finish,
                       _record_end, entry)

    def p2p_text(self, opname, is_send, peer, tag, nbytes):
        """'isend to rank 1 (tag 0, 8 bytes, group 'default')': a point-to-point
        operation in messages (peer: group rank, or None for any source)."""
        if peer is None:
            text = f"{opname} from any rank"
        else:
            text = f"{opname} {'to' if is_send else 'from'} {self.describe_rank(peer)}"
        return text + f" (tag {tag}, {nbytes} bytes, group {self.name!r})"

    def p2p_entry(self, opname, peer, nbytes):
        """The flight recorder's entry of a point-to-point call, running from now."""
        # call_site(3): the search for the user's frame starts past this method and
        # the group method that called it, both accord's
        entry = self.recorder.add(None, opname, -1 if peer is None else self.ranks[peer], "",
                                  nbytes, None, call_site(3)[1])
        entry[T_START] = _now()
        entry[STATE] = RUNNING
        return entry

    def p2p_blocking(self, opname, is_send, peer, view, tag, timeout=None, finish=None):
        """A blocking send or receive (peer: group rank, or None for any source); the
        sender's global rank for a receive, None for a send.

        Where this group has nothing else posted, it runs on the caller's thread
        (the engine's try_now, or take_any for a receive from any rank); otherwise,
        or once it has to wait longer than a short spin, it is the engine's like any
        posted operation."""
        self.check_open()
        eng = self.p2p
        if eng is None:
            op = self.p2p_op(opname, is_send, peer, view, tag, timeout, finish)
            self.post_p2p([op])          # raises: no other rank in the group
        entry = self.p2p_entry(opname, peer, len(view))
        op = None
        try:
            if peer is None:
                rec = eng.take_any(view, tag, eng.spin_s)
            else:
                rec, op = eng.try_now(is_send, peer, view, tag, eng.spin_s, (
                    self.p2p_op, opname, is_send, peer, view, tag, timeout, finish, entry))
        except AccordError as e:
            self._p2p_failed(entry, e)
            raise
        if rec is not None:
            value, err = self._p2p_over(entry, is_send, rec, finish,
                                        peer if peer is not None else rec.peer)
            if err is not None:
                raise err
            return value
        if op is None:
            op = self.p2p_op(opname, is_send, peer, view, tag, timeout, finish, entry)
            self.post_p2p([op])
        eng.wait(op)
        return op.result()

    def p2p_start(self, opname, is_send, peer, view, tag, timeout=None, finish=None):
        """An isend or irecv (peer: group rank, or None for any source), started: the
        Outcome that tells its end (the sender's global rank for a receive).

        Where the engine lets the caller start it (Engine.start_now, take_any), a
        small send written into the ring or a receive whose message was here is over
        within the call, with no Pending and no hand-off to the engine's thread."""
        eng = self.p2p
        if eng is None:
            op = self.p2p_op(opname, is_send, peer, view, tag, timeout, finish)
            self.post_p2p([op])          # raises: no other rank in the group
        if self._closed is not None:
            raise self._closed_error()
        entry = self.p2p_entry(opname, peer, len(view))
        op = None
        try:
            if peer is None:
                rec = eng.take_any(view, tag, 0.0)
            else:
                rec, op = eng.start_now(is_send, peer, view, tag, (
                    self.p2p_op, opname, is_send, peer, view, tag, timeout, finish, entry))
        except AccordError as e:
            self._p2p_failed(entry, e)
            raise
        if op is not None:
            return op
        if rec is None:
            op = self.p2p_op(opname, is_send, peer, view, tag, timeout, finish, entry)
            self.post_p2p([op])
            return op
        value, err = self._p2p_over(entry, is_send, rec, finish,
                                    peer if peer is not None else rec.peer)
        if err is not None:
            return Outcome.settled(exc=err)
        return _SENT if is_send else Outcome.settled(value)

    def _p2p_failed(self, entry, exc):
        """The link failed under the engine's try_now, start_now or take_any: recorded in
        the flight recorder's entry; a broken group raises why instead."""
        entry[STATE] = FAILED
        entry[ERROR] = f"{type(exc).__name__}: {exc}"
        self.check_open()

    def _p2p_over(self, entry, is_send, rec, finish, sender):
        """An operation over on the caller's thread (rec: its record; sender: the group
        rank a receive took its message from): (its value, its error or None), the
        flight recorder's entry closed either way."""
        entry[T_END] = _now()
        err = None if is_send else rec.error
        if err is None and finish is not None:
            try:
                finish()
            except BaseException as e:      # as the engine's _succeed: the op's error
                err = e
        if err is not None:
            entry[STATE] = FAILED
            entry[ERROR] = f"{type(err).__name__}: {err}"
            return None, err
        entry[STATE] = DONE
        return (None if is_send else self.ranks[sender]), None

    def post_p2p(self, ops):
        """Start point-to-point operations (in order); each one's future tells its end."""
        self.check_open()
        if self.p2p is None:
            raise ValueError(f"group {self.name!r} has no other rank to exchange messages with")
        try:
            self.p2p.post(ops)
        except AccordError:
            self.check_open()        # a broken group says why
            raise

    def _abort_key(self, group_rank):
        return f"{self.name}/abort/{group_rank}"

    def _abort_reason(self, peer):
        """Why a peer that hung up mid-message aborted, from the store (or None).

        A rank that aborts while a message to some peer is half sent cannot frame
        an ABORT on that link; it leaves its reason in the store first."""
        store = self.store
        if store is None:
            return None
        try:
            key = self._abort_key(peer)
            if not store.check([key]):
                return None
            return decode_error(store.get(key), self.describe_rank(peer))
        except Exception:            # the store may be gone with the job: no reason then
            return None

    def _history(self, seq):
        e = self.recorder.find(seq)
        return debug.describe_entry(e) if e is not None else None

    def _site_text(self, site):
        return debug.site_text(site) or debug.published_site_text(self, site)

    # -- identity ----------------------------------------------------------
    @property
    def is_member(self):
        return self.rank >= 0

    def renumber(self, new_rank_of, global_rank):
        """Describe the members by their ranks in a new world (accord.shrink or admit
        replaced the default group, and every member of this group is in the new one).

        new_rank_of: old global rank -> new global rank (it keeps their order, so
        group ranks and links stay as they are); global_rank: this process's new one.
        The list is changed in place: the p2p engine reports senders from it."""
        self.ranks[:] = [new_rank_of[r] for r in self.ranks]
        self.global_rank = global_rank
        if self.hier is not None:
            for sub in self.hier.subgroups:
                sub.renumber(new_rank_of, global_rank)

    def describe_rank(self, group_rank):
        return f"rank {self.ranks[group_rank]}"

    def __repr__(self):
        state = "closed" if self._closed else ("member" if self.is_member else "non-member")
        return (f"<accord.ProcessGroup {self.name!r} ranks={self.ranks} rank={self.rank} "
                f"seq={self._seq} {state}>")

    def group_rank_of(self, global_rank, arg):
        try:
            return self.ranks.index(global_rank)
        except ValueError:
            raise ValueError(f"{arg}={global_rank} is not a rank of group {self.name!r} "
                             f"(its ranks are {self.ranks})") from None

    # -- running collectives -----------------------------------------------
    def check_open(self):
        if self._closed is not None:
            raise self._closed_error()

    def _closed_error(self):
        cause = self._closed
        if isinstance(cause, GroupClosed):
            return GroupClosed(f"rank {self.global_rank}: group {self.name!r} is destroyed")
        return GroupClosed(f"rank {self.global_rank}: group {self.name!r} is broken by an "
                           f"earlier error: {type(cause).__name__}: {cause}")

    def submit(self, opname, body, async_op, timeout=None, stamp_args=None, call=None):
        """Run body(comm) in issue order. stamp_args: (root, dtype code, reduce op, byte
        count, dtype name, shape). call: the api call's name, root and tensors, for
        ACCORD_DEBUG=DETAIL.

        Every call of an 8-byte collective pays for what is here, so it is written
        flat: a handful of attribute reads, one lock, one Stamp, one recorder entry."""
        if self._closed is not None:
            raise self._closed_error()
        if timeout is None:
            timeout = self.timeout
        site, where = call_site()
        # the deadlock check trusts "blocked" only for programs that issue from one thread
        main = on_main_thread()
        root, dtype, redop, count, dtype_name, shape = stamp_args or _NO_STAMP
        with self._issue_lock:
            seq = self._seq
            self._seq = seq + 1
            stamp = Stamp(OP_CODES[opname], seq, root, dtype, redop, count, dtype_name, shape,
                          site, where)
            entry = self.recorder.add(seq, opname, root if root < 0 else self.ranks[root],
                                      dtype_name, count, shape, where)
            if self.options is not None and self.options.debug == "DETAIL":
                body = detail.wrap(self, call, stamp, body)
            if not async_op and self._pending == 0:
                self.waiters += main
                try:
                    return self._execute(opname, body, stamp, timeout, entry)
                finally:
                    self.waiters -= main
            self._pending += 1
            fut = concurrent.futures.Future()
            if self._worker is None:
                self._wakes = queue.SimpleQueue()
                self._worker = threading.Thread(target=self._work, name=f"accord-{self.name}",
                                                daemon=True)
                self._worker.start()
            with self._items_lock:
                self._items.append((opname, body, stamp, timeout, fut, entry))
            self._wakes.put(True)
        if async_op:
            return Work(fut, f"{opname} #{seq} on group {self.name!r}", self)
        self.waiters += main
        try:
            return fut.result()
        finally:
            self.waiters -= main

    def _work(self):
        lock, items, wakes = self._items_lock, self._items, self._wakes
        while True:
            wakes.get()
            with lock:
                if self._running or not items:
                    continue            # taken by a waiting thread, which wakes us if need be
                item = items.popleft()
                if item is None:
                    return
                self._running = True
            self._run_item(item)
            # the call's closure holds its tensors: held here until the next call came,
            # an async op's buffers (up to its whole size) outlived its Work's wait()
            del item

    def run_queued(self, fut):
        """Run the queued async calls, in order, on this thread until fut (the last of
        them) is done, while the worker thread runs none: a thread about to block on the
        Work of the call it issued last runs it itself, as a synchronous call would run.
        Handing the call to the worker and its result back cost two thread wake-ups (an
        8-byte all_reduce with async_op=True, then wait(): 100 µs at two ranks where the
        call itself ran in 20). Where calls were issued after fut's, the worker keeps
        them all, as it runs a window of them back to back while the caller waits on
        each in turn (eight 8-byte all_reduces issued, then waited: 42.7-61.2 µs a call
        that way, 51.3-69.5 with the waiting thread taking each in turn and the worker
        woken for the rest every time). Returns when fut is done, or where the worker
        holds or is to hold the calls (the caller then waits for fut as before)."""
        lock, items = self._items_lock, self._items
        while not fut.done():
            with lock:
                last = items[-1] if items else None
                if self._running or last is None or last[4] is not fut:
                    return
                item = items.popleft()
                self._running = True
            self._run_item(item)

    def _run_item(self, item):
        """Run one queued async call and settle its future (on the worker thread or in
        run_queued; _running is set for it)."""
        opname, body, stamp, timeout, fut, entry = item
        try:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(self._execute(opname, body, stamp, timeout, entry))
                except BaseException as e:      # delivered through the Work
                    fut.set_exception(e)
        finally:
            with self._items_lock:
                self._running = False
                more = bool(self._items)
            if more:
                self._wakes.put(True)   # what the worker skipped while this one ran
            with self._issue_lock:
                self._pending -= 1

    def _execute(self, opname, body, stamp, timeout, entry):
        rec = self.recorder
        if self._closed is not None:
            entry[STATE] = FAILED
            raise self._closed_error()
        t = self.transport
        t.current = (opname, stamp.seq, self.name)
        t.interrupted = None         # meant for an earlier call, if it finished after all
        entry[T_START] = _now()
        entry[STATE] = RUNNING
        rec.current = entry
        try:
            result = body(Comm(t, stamp, _monotonic() + timeout))
        except BaseException as e:
            raise self._failed(e, entry)
        else:
            entry[T_END] = _now()
            entry[STATE] = DONE
            rec.last_done = entry
            return result
        finally:
            rec.current = None
            t.current = None

    def _failed(self, e, entry):
        """What a call that raised e raises: a communication error breaks the group
        and reaches the peers (the deadlock another thread named is the cause where
        there is one); anything else only fails the call."""
        entry[STATE] = FAILED
        if not isinstance(e, AccordError):
            entry[ERROR] = f"{type(e).__name__}: {e}"
            return e
        t = self.transport
        if t.interrupted is not None:
            # the deadlock named by another thread is the cause; a peer that left
            # because it heard the same story first is its echo
            e, t.interrupted = t.interrupted, None
        entry[ERROR] = f"{type(e).__name__}: {e}"
        e = self._explain(e, entry)
        self._break(e)
        debug.on_error(self, e)
        return e

    def _explain(self, e, entry):
        """A local timeout grows the stuck-rank table (reported ones already carry it)."""
        if type(e) is CommTimeout and "[reported by" not in str(e) and entry[debug.SEQ] is not None:
            report = debug.stuck_report(self, entry)
            if report:
                new = CommTimeout(f"{e}{report}")
                new.__cause__ = e.__cause__
                new.__traceback__ = e.__traceback__
                return new
        return e

    @property
    def broken_by(self):
        """The error that broke or closed the group, None while it is usable."""
        return self._closed

    def revoke(self, exc):
        """Break the group on purpose (ULFM's revoke): peers blocked in it hear exc.
        A group whose transports were never made is only marked closed."""
        if self.transport is None:
            if self._closed is None:
                self._closed = exc
            return
        self._break(exc)

    def _break(self, exc):
        """A failed collective leaves the stream inconsistent: stop the group everywhere."""
        if self._closed is None:
            self._closed = exc
            if self.store is not None:
                try:
                    self.store.set(self._abort_key(self.rank), encode_error(exc))
                except Exception:
                    pass
            self.transport.abort(exc)
            if self.p2p is not None:
                self.p2p.close(self._closed_error())
                self.p2p.t.abort(exc)
            if self.hier is not None:
                self.hier.break_all(exc)

    # -- shutdown ----------------------------------------------------------
    def destroy(self, check=True):
        """Leave the group; check: name collective messages no call read (a Desync)."""
        debug.unregister(self)
        if self._worker is not None:
            with self._items_lock:
                self._items.append(None)
            self._wakes.put(True)
            if self._worker is not threading.current_thread():
                self._worker.join(timeout=self.timeout)
            self._worker = None
        if self.hier is not None:
            self.hier.destroy()
        if self.p2p is not None:
            self.p2p.close(GroupClosed(f"rank {self.global_rank}: group {self.name!r} was "
                                       f"destroyed with this operation still posted"))
            self.p2p.t.close(0.0)
        left = []
        if self.transport is not None:
            left = self.transport.close(GOODBYE_S if check and self._closed is None else 0.0) or []
        if self._closed is None:
            self._closed = GroupClosed("destroyed")
        if left:
            raise self._unread(left)

    def _unread(self, left):
        """The Desync for collective messages peers sent that no call of this rank read."""
        from .transport.wire import describe_header, header_seq
        lines = []
        skipped = False     # a peer made a call this rank never made (vs. one it made unread)
        for peer, h in left:
            seq = header_seq(h)
            past = self._history(seq)
            skipped = skipped or seq >= self._seq
            mine = (f"this rank called {past}" if past else
                    f"this rank made {self._seq} call{'s' if self._seq != 1 else ''} on it")
            lines.append(f"{self.describe_rank(peer)} sent {describe_header(h, self._site_text)}"
                         f", which no call of this rank read ({mine})")
        if skipped:
            hint = (f"rank {self.global_rank} skipped a collective its peers made (a call "
                    "under a condition on the rank, an early return or a caught exception?)")
        else:
            hint = ("this rank made that call but nothing in it read the message: did two "
                    "ranks each think they were the root?")
        return Desync(f"rank {self.global_rank}: destroying group {self.name!r}: ranks disagree: "
                      + "; ".join(lines) + ". Every rank must make the same collective calls in "
                      f"the same order; {hint}")
