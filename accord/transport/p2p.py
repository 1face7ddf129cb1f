"""Point-to-point messages: posted, matched and progressed beside the collectives.

Tagged messages are not part of a group's ordered stream of collectives. Each
member has a second set of links to its peers, the *p2p plane* (shared memory:
a second ring per ordered pair in the group's arena, with a doorbell of its
own; TCP: a second connection per pair), and one engine thread per group that
moves every posted send and receive on it.

Why a thread (gloo's choice) and not progress inside calls only (MPI's
default): a send completes once its bytes are out of the caller's buffer, even
while the receiver computes, and a rank that posted a receive drains its
peer's ring at once, so large messages both ways never hold each other up.
With progress inside calls only, a rank that posted `irecv` and went on
computing would hold its peer's large `send` until its next call. The thread
sleeps in the kernel (futex or poll) when nothing can move, so it costs no
core, and it starts at the group's first point-to-point call: a program that
never sends pays nothing.

Matching is MPI's: by (group, source, tag); receives are matched in the order
they were posted and messages in the order they arrived, so messages between
one sender and one receiver with one tag are never overtaken; a receive with
no source takes the first message with its tag from any peer and reports the
sender. Only the holder of the engine's lock touches the plane's links: the
engine thread, or a caller that finds the engine idle and moves them itself
(post() starts its operations at once, and isend/irecv with a peer start on the
caller's thread through start_now(), which for a small message is the whole of
it; a thread waiting on its operation
progresses the plane, spinning briefly and then sleeping on it as the engine
does), which saves the thread hand-off on small messages.

The medium (a TcpTransport or a plane-1 ShmTransport) supplies: `links`,
`tagged_send(peer, view, tag)`, `withdraw_send(record)`, `step_link(link)`,
`lost_peers()`, `arm(links)`, `sleep(token, timeout)` and `wake()`; see
transport/base.py.
"""
import os
import threading
import time

from ..errors import AccordError, CommTimeout, GroupClosed, PeerLost
from ..work import PENDING as _OUTCOME_PENDING, Outcome
from .matching import SPARE, Recv

_IDLE_S = 1.0            # the longest sleep with nothing to wait for
_LIVENESS_S = 0.5        # how often peers' deaths are looked for (shared memory)
_JOIN_S = 5.0            # how long close() waits for the engine thread
_POLL_S = 0.002          # a waiter that cannot take the engine's lock looks again after this
_PARK_S = 0.005          # the engine's nap while callers progress in its place


_TAKEN = Recv(-1, b"")       # the record of every receive taken at once: done, no error
_TAKEN.done = True


class Pending(Outcome):
    """One posted send or receive, from post() to its outcome (it is its own future:
    done(), result(), wait(); the sender's global rank for a receive)."""
    __slots__ = ("is_send", "peer", "view", "tag", "deadline", "timeout", "rec",
                 "finish", "_desc", "on_done", "entry", "over", "filled")

    def __init__(self, is_send, peer, view, tag, timeout, desc, finish=None, on_done=None,
                 entry=None):
        # Outcome's fields, set here rather than through its __init__: one call fewer
        # per operation (a halo exchange step, two of these, took 0.95-0.96x the time)
        self._state = _OUTCOME_PENDING
        self._value = self._event = self._callbacks = None
        self.is_send, self.peer, self.view, self.tag = is_send, peer, view, tag
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.rec = None          # the medium's send record, a Recv, or any-source rivals
        self.finish = finish     # run once the bytes are in (copy back a staged buffer)
        # "isend to rank 1 (tag 0, ...)", or (fn, *args) that makes it: a tuple, not a
        # closure, since an operation's cells would be so many more objects for the
        # garbage collector to count and scan while a window of them is outstanding
        self._desc = desc
        # on_done(entry, exc or None) once it is over: the flight recorder's entry
        self.on_done, self.entry = on_done, entry
        # settled (its outcome is set or about to be): what the engine reads on every
        # pass over its operations
        self.over = False
        self.filled = None       # (bytes in, since when): a receive filling past its deadline

    @property
    def desc(self):
        """What the operation is, for messages: "irecv from rank 2 (tag 5, 64 bytes, ...)"."""
        d = self._desc
        if d.__class__ is tuple:
            d = self._desc = d[0](*d[1:])
        elif d.__class__ is not str:
            d = self._desc = d()
        return d


class Engine:
    """The point-to-point side of one group member: a p2p plane and its thread."""

    def __init__(self, transport, group_name, ranks, here):
        self.t = transport
        self.ranks = ranks               # group rank -> global rank (receives report it)
        self.here = here                 # "rank 3", for messages
        transport.op_desc = f"point-to-point (group {group_name!r})"
        self.group_name = group_name
        self._lock = threading.Lock()        # guards _inbox, _thread, _closed, _waiting
        # while a caller progresses the plane in wait(), the engine thread stays off
        # the doorbell (two sleepers there cost a wake-up each per message)
        self._idle = threading.Condition(self._lock)
        self._waiting = 0
        # held by whoever moves the plane's links: the engine thread, or a caller
        # progressing inline while the engine is idle (no thread hand-off then)
        self._busy = threading.Lock()
        self.spin_s = transport.spin_s       # how long a blocking caller progresses itself
        self.yields, self.yield_s = transport.yields, transport.yield_s  # and sleeps
        self._inbox = []
        self._thread = None
        self._closed = None              # why no more posts are taken
        self._ops = []                   # whoever holds _busy, from here down
        self._new = []                   # the ops being started
        self._gone = {}                  # peer -> why its link is unusable
        # the engine thread sleeps on the plane (armed then, under _busy), and the
        # peers whose next byte wakes it: see _unwatched
        self._asleep = False
        self._watching = set()
        self._last_check = 0.0
        self._pid = os.getpid()
        # [(operation, since)]: the operations threads block on in wait(), for the
        # positions a stuck-rank report reads (a rank waiting here is not in a collective)
        self.waited = []

    # -- any thread ------------------------------------------------------------------
    def post(self, ops):
        """Hand operations to the engine (in order); each tells its own outcome.

        Where the engine is idle, the caller starts them itself: a small send is
        written and a message already here is taken without a thread hand-off."""
        with self._lock:
            if self._closed is not None:
                raise self._closed
            self._inbox.extend(ops)
            fresh = self._thread is None
        started = self._busy.acquire(blocking=False)
        unwatched = False
        if started:
            try:
                self._turn()
                unwatched = self._unwatched(ops)
            finally:
                self._busy.release()
        if fresh:
            self._start_thread()
        elif unwatched or any(self._needs_wake(op, started) for op in ops):
            self._kick()

    def _start_thread(self):
        """Start the engine thread, once (the group's first point-to-point call)."""
        with self._lock:
            if self._thread is not None or self._closed is not None:
                return
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name=f"accord-p2p-{self.group_name}")
            self._thread.start()

    def try_now(self, is_send, peer, view, tag, spin_s, make_op):
        """A blocking send or receive with peer given, done on the caller's thread if
        the plane is idle: no thread hand-off, no Pending, for the common case of a
        small message in a ping-pong or a halo exchange.

        Where nothing else is posted on this group, the operation starts at once and
        the caller moves its link for up to spin_s. Returns (record, None) when it is
        done there (a receive's record may carry its error: a size mismatch), or
        (None, op) when it must wait: then make_op built the Pending (see _adopt), which
        the engine has adopted, started as it is, before anyone else could touch the
        link (the caller waits on op). (None, None): the plane is busy or
        closed; nothing was started, post the operation. Raises the link's failure
        (PeerLost ...), which the engine then knows as well."""
        if self._thread is None:
            self._start_thread()     # it drains what peers send, whoever waits for it
        if not self._busy.acquire(blocking=False):
            return None, None
        try:
            if self._ops or self._inbox or self._closed is not None or peer in self._gone:
                return None, None
            t = self.t
            link = t.links[peer]
            if is_send:
                rec = t.tagged_send(peer, view, tag)
            elif t.take_now(peer, view, tag, spin_s):
                return _TAKEN, None
            else:
                rec = Recv(peer, view, tag=tag)
                if not (link.stash and link.take_stashed(rec)):
                    link.posted.append(rec)
                if len(view) <= t.wait_now_max:
                    spin_s = 0.0             # take_now spun for it already
            if not rec.done:
                # a single-copy send completes when the peer has copied it out: with a
                # core each, spin through that copy (yielding) rather than sleep
                acking = is_send and t.awaits_copy(rec)
                end = time.perf_counter() + (t.spin_ack_s if acking else spin_s)
                while True:
                    try:
                        moved = t.step_link(link, SPARE)
                    except AccordError as e:
                        # the link failed after our message was through (a peer that
                        # exits once it has read it): that is the link's end, not ours
                        self._lose(peer, e)
                        if rec.done:
                            break
                        raise
                    if rec.done or not moved and time.perf_counter() >= end:
                        break
                    if acking and not moved:
                        os.sched_yield()
            if rec.done:
                return rec, None
            op = self._adopt(make_op, rec)
        finally:
            self._busy.release()
        self._kick()
        return None, op

    def start_now(self, is_send, peer, view, tag, make_op):
        """An isend or irecv with peer given, started on the caller's thread: no thread
        hand-off, and no Pending where it is over at once (a small send written into
        the ring, a receive whose message is here already).

        Unlike try_now it never waits, and it needs only that nothing posted before
        it waits to be started (operations under way are no obstacle: a window of
        receives posts each one straight on its link, in order). Returns (record,
        None) when it is done (a receive's record may carry its error), (None, op)
        when it is under way (make_op built the Pending, see _adopt, which the engine
        adopted, started as it is), or (None, None) where it could not start: post
        the operation. Sends and receives reach the link in the order of the calls,
        as post() would start them."""
        if self._thread is None:
            self._start_thread()     # it drains what peers send, whoever waits for it
        if not self._busy.acquire(blocking=False):
            return None, None
        try:
            if self._inbox or self._closed is not None or peer in self._gone:
                return None, None
            t = self.t
            link = t.links[peer]
            if is_send:
                rec = t.tagged_send(peer, view, tag)
            elif t.take_now(peer, view, tag):
                return _TAKEN, None
            else:
                rec = Recv(peer, view, tag=tag)
                if link.stash and link.take_stashed(rec):
                    return rec, None
                link.posted.append(rec)
            if not rec.done:
                # one step of its link: a send's first bytes out, what came in for the
                # posted receives read. Not the whole ring: a window of 64 irecvs at 64
                # KiB, each stepping a link whose later messages were in already, copied
                # those into the stash, and each next irecv copied its message out of
                # it again (9.2-10.1 µs a message against 5.6-6.0 reading only what the
                # posted receives take). The engine thread still drains what nobody
                # posts for (it wakes once half a ring waits), so a sender never waits
                # on a receiver that is only sending.
                try:
                    t.step_link(link, drain=False)
                except AccordError as e:
                    self._lose(peer, e)
                    if not rec.done:
                        return None, None        # post() fails it with the link's error
            if rec.done:
                return rec, None
            op = self._adopt(make_op, rec)
            wake = self._needs_wake(op, True) or self._unwatched((op,))
        finally:
            self._busy.release()
        if wake:
            self._kick()
        return None, op

    def _adopt(self, make_op, rec):
        """(Under _busy.) The Pending for an operation a caller started (rec: its
        record), taken on by the engine as it is. make_op: (fn, *args), fn(*args)
        building it: a tuple where a closure would hold a cell for each argument,
        made on every call and seldom used (most operations are over at once)."""
        op = make_op[0](*make_op[1:])
        op.rec = rec
        self._ops.append(op)
        return op

    def take_any(self, view, tag, spin_s):
        """A receive from any peer with tag into view, done on the caller's thread where
        nothing else is posted on this group: a message already here (in a link's
        stash first, where it waits longest, else whole at the head of a ring) is
        taken, spinning up to spin_s for one to come. Returns its record (its peer
        the sender; it may carry an error: a stashed message of another size), or None:
        nothing taken and nothing changed, so post the receive (the engine then
        matches it as any other)."""
        if self._thread is None:
            self._start_thread()     # it drains what peers send, whoever waits for it
        if not self._busy.acquire(blocking=False):
            return None
        try:
            if self._ops or self._inbox or self._closed is not None:
                return None
            t = self.t
            links = [(p, link) for p, link in t.links.items() if p not in self._gone]
            for p, link in links:
                if link.stash:
                    r = Recv(p, view, tag=tag)
                    if link.take_stashed(r):
                        return r
            end = time.perf_counter() + spin_s
            while True:
                for p, link in links:
                    if t.take_now(p, view, tag):
                        r = Recv(p, view, tag=tag)
                        r.done = True
                        return r
                if time.perf_counter() >= end:
                    return None
        finally:
            self._busy.release()

    def _kick(self):
        """Make the engine thread (or the caller progressing in its place) look now."""
        self.t.wake()
        with self._lock:
            self._idle.notify()

    def _unwatched(self, ops):
        """(Under _busy, by a caller that just started ops.) Whether the engine thread
        must be woken for them. It may sleep armed from before a receive of ops was
        posted, on a link whose next message would not wake it: a medium may ask to be
        woken only once much is waiting where nothing was awaited (shm: half the ring),
        so a small message for that receive would wait for the end of the engine's
        sleep (a slice, 250 ms), with nobody else moving the link unless its caller
        waits through Engine.wait. The plane's watch() makes such a link's next byte
        wake the sleeper, without waking it now: a wake-up per posted receive cost a
        thread switch each (a ping-pong of irecv().wait() took 3x accord's blocking
        recv). Only where bytes came before the link was watched is the engine to be
        woken (once: it then arms for the receive, and is marked awake until it sleeps
        again)."""
        if not self._asleep:
            return False
        t, watching, gone = self.t, self._watching, self._gone
        for op in ops:
            if op.is_send or op.over:
                continue
            for p in (t.links if op.peer is None else (op.peer,)):
                if p in watching or p in gone:
                    continue
                if not t.watch(t.links[p]):
                    self._asleep = False
                    return True
                watching.add(p)
        return False

    def _rewatch(self):
        """(Under _busy, by a caller leaving Engine.wait.) Its sleeps armed and disarmed
        the links' flags, the sleeping engine's with them: raise them again for the
        engine (what remains posted, a ring filling up); whether it must be woken
        instead (a send waits for room or an acknowledgement, which only its own arm()
        asks for, or bytes came already)."""
        if not self._asleep or self._closed is not None:
            return False
        if any(op.is_send and not op.over for op in self._ops):
            self._asleep = False
            return True
        t = self.t
        if t.wakes_on_any_byte:
            return False
        for p, link in t.links.items():
            if p not in self._gone and not t.watch(link):
                self._asleep = False
                return True
        self._watching = self._awaited()
        return False

    def _awaited(self):
        """The peers whose next byte an armed sleep wakes for: those a receive waits on."""
        return {p for p, link in self.t.links.items()
                if link.posted or link.incoming is not None}

    @staticmethod
    def _needs_wake(op, started):
        """Whether the sleeping engine (or waiter) must hear of op now. A receive it
        started itself need not, where the sleeper waits for bytes on its link
        (where it may not: _unwatched); a send it must (nobody waits for room in its
        ring yet), as must a deadline sooner than the sleeper would look."""
        if op.over:
            return False
        return op.is_send or not started or op.timeout < _IDLE_S

    def wait(self, future, timeout=None):
        """Block until future (an operation posted here, or another Outcome its
        completion settles) is done, or timeout seconds pass; True if done.

        The waiting thread moves the links itself while nobody else does (MPI's
        progress inside calls): it spins a little where it has a core to spare, then
        sleeps on the plane as the engine would, so the reply to its message needs
        no hand-off from the engine thread. Meanwhile it serves every operation of
        the group, other threads' too; the engine thread takes over when it leaves."""
        if not future.done() and self._busy.acquire(blocking=False):
            # one pass first, as the loop below would begin: what is here already (a
            # halo exchange's receives, their messages in) ends the wait without the
            # bookkeeping of a wait that may block (a step of that exchange at world 2,
            # 8 bytes, took 0.93-0.95x the time)
            try:
                self._turn()
            finally:
                self._busy.release()
            if future.done():
                return True
        end = None if timeout is None else time.monotonic() + timeout
        spin_end = time.perf_counter() + self.spin_s
        mark = (future, time.time()) if future.__class__ is Pending else None
        with self._lock:
            self._waiting += 1
            if mark is not None:
                self.waited.append(mark)
        try:
            return self._wait(future, end, spin_end)
        finally:
            with self._lock:
                self._waiting -= 1
                if mark is not None:
                    self.waited.remove(mark)
                if not self._waiting and (self._ops or self._inbox):
                    self._idle.notify()     # the engine thread's turn again

    def _wait(self, future, end, spin_end):
        t = self.t
        while not future.done():
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                return False
            if not self._busy.acquire(blocking=False):
                # the engine thread is mid-turn, or another caller waits in here: it
                # serves this operation too; look again shortly
                future.wait(_POLL_S if left is None else min(_POLL_S, left))
                continue
            try:
                if future.__class__ is Pending and time.perf_counter() < spin_end:
                    self._take_spinning(future, spin_end, end)
                armed = False
                # where ranks share cores: yield the core (to the peer, maybe) and look
                # again, before a sleep makes every message of the peers a wake-up
                yields, yield_end = self.yields, time.perf_counter() + self.yield_s
                yielding = yields > 0 or self.yield_s > 0
                while not future.done():
                    if yielding:
                        if yields > 0 or time.perf_counter() < yield_end:
                            yields -= 1
                            os.sched_yield()
                            self._turn()
                            continue
                        yielding = False
                    if armed and time.perf_counter() < spin_end:
                        # spinning: move the links without raising their flags, so that
                        # the peer's next message wakes no sleeper (the engine thread,
                        # woken for it, would take a core from this one)
                        self._turn()
                        continue
                    token, wait = self._cycle()
                    armed = True
                    if future.done() or token is None:
                        if token is not None:
                            t.disarm(token)
                        continue
                    if time.perf_counter() < spin_end:
                        t.disarm(token)
                        continue
                    left = None if end is None else end - time.monotonic()
                    if left is not None and left <= 0:
                        t.disarm(token)
                        return False
                    t.sleep(token, wait if left is None else min(wait, left))
                    t.disarm(token)
            finally:
                try:
                    rewake = self._rewatch()
                finally:
                    self._busy.release()
                if rewake:
                    self._kick()
        return True

    def _take_spinning(self, op, spin_end, end=None):
        """(Under _busy, by a caller in wait().) Where op is a receive from one peer and
        the only operation the engine holds, with nothing before it on its link: spin
        for its message on the link itself until spin_end, as a blocking recv does
        (the medium's take_now, one word read per turn in the ring helper), and settle
        op if it came. A pass of _turn over every link and operation per look left
        the reply to a ping-pong's isend unseen for microseconds of Python (an
        irecv().wait() ping-pong: 0.47-0.90x the time with this). Otherwise, or if it
        does not come, nothing changes and wait() goes on the general way. end: the
        wait's own time.monotonic() limit, if any."""
        rec = op.rec
        if op.is_send or op.over or rec.__class__ is not Recv or self._inbox or \
                len(self._ops) != 1 or self._ops[0] is not op or op.peer in self._gone:
            return
        link = self.t.links[op.peer]
        posted = link.posted
        if len(posted) != 1 or posted[0] is not rec or link.incoming is not None or \
                link.stash:
            return
        left = spin_end - time.perf_counter()
        if end is not None:
            left = min(left, end - time.monotonic())
        if left <= 0:
            return
        # take_now takes only what comes before anything posted: the receive steps
        # aside while it looks, and goes back where it was unless its message came
        posted.pop()
        taken = False
        try:
            taken = self.t.take_now(op.peer, rec.dest, op.tag, left)
        except AccordError:
            pass            # the link failed: the general path's step meets it and says so
        finally:
            if not taken:
                posted.append(rec)
        if taken:
            rec.done = True
            self._collect()

    def close(self, exc=None):
        """Stop the engine: what is still posted fails with exc (GroupClosed by default).
        The caller then closes or aborts the plane itself."""
        with self._lock:
            if self._closed is None:
                self._closed = exc if exc is not None else GroupClosed(
                    f"{self.here}: group {self.group_name!r} is destroyed")
            self._idle.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread() and \
                os.getpid() == self._pid:
            self.t.wake()
            thread.join(_JOIN_S)

    # -- the engine thread -----------------------------------------------------------
    def _run(self):
        try:
            self._loop()
        except BaseException as e:      # a fault here must not leave anyone waiting
            err = e if isinstance(e, AccordError) else AccordError(
                f"{self.here}: the point-to-point engine of group {self.group_name!r} "
                f"failed: {type(e).__name__}: {e}")
            with self._lock:
                if self._closed is None:
                    self._closed = err
                new, self._inbox = self._inbox, []
            for op in self._ops + self._new + new:
                self._fail(op, err)
            self._ops = self._new = []

    def _turn(self):
        """One pass (under _busy): start what was posted, move every link, finish what
        is done. Returns (closing error or None, whether anything happened)."""
        with self._lock:
            new, self._inbox = self._inbox, []
            closing = self._closed
        if closing is not None:
            for op in self._ops + new:
                self._fail(op, closing)
            self._ops = []
            return closing, True
        self._new = new
        for op in new:
            self._start(op)
        self._new = []
        moved = self._step()
        if self._ops:
            self._collect()
        return None, moved or bool(new)

    def _cycle(self):
        """One round under _busy: a turn, then, if nothing moved, the liveness and
        deadline checks and arm(). Returns (token, seconds to sleep), token None
        when there is more to do at once."""
        closing, busy = self._turn()
        if closing is not None or busy:
            return None, 0.0
        t = self.t
        now = time.monotonic()
        if now - self._last_check >= _LIVENESS_S:
            self._last_check = now
            self._check_lost()
        wait = self._expire(now)
        token = t.arm([link for p, link in t.links.items() if p not in self._gone])
        if self._step():             # it came in while we said what we wait for
            t.disarm(token)
            self._collect()
            return None, 0.0
        return token, wait

    def _loop(self):
        t = self.t
        token = None
        while True:
            with self._lock:
                # parked while callers progress in wait(); with nothing left to do it
                # stays parked a moment more (a ping-pong's next wait comes at once)
                while self._waiting and self._closed is None:
                    self._idle.wait(_PARK_S)
            with self._busy:
                self._asleep = False
                if token is not None:
                    t.disarm(token)
                if self._closed is not None:
                    self._turn()         # fails what is left
                    return
                token, wait = self._cycle()
                if token is not None and not t.wakes_on_any_byte:
                    # what this sleep wakes for at the next byte: the links a receive
                    # waits on (see _unwatched)
                    self._watching = self._awaited()
                    self._asleep = True
            if token is not None:
                t.sleep(token, wait)
                # awake again (it re-arms before it sleeps next): no kick needed meanwhile,
                # parked or not
                self._asleep = False

    def _start(self, op):
        t = self.t
        links = t.links
        if op.is_send:
            if op.peer in self._gone:
                return self._fail(op, self._gone[op.peer])
            op.rec = t.tagged_send(op.peer, op.view, op.tag)
        elif op.peer is None:
            # any source: a message already here comes first, else one receive per link,
            # and the first link to match one withdraws the others
            for peer, link in links.items():
                r = Recv(peer, op.view, tag=op.tag)
                if link.stash and link.take_stashed(r):
                    op.rec = r
                    break
            else:
                rivals = [Recv(p, op.view, tag=op.tag) for p in links if p not in self._gone]
                if not rivals:
                    return self._fail(op, self._no_peer_left(op))
                for r in rivals:
                    r.rivals = rivals
                    links[r.peer].posted.append(r)
                op.rec = rivals
        else:
            r = Recv(op.peer, op.view, tag=op.tag)
            link = links[op.peer]
            if not (link.stash and link.take_stashed(r)):
                if op.peer in self._gone:
                    return self._fail(op, self._gone[op.peer])
                link.posted.append(r)
            op.rec = r
        self._ops.append(op)

    def _step(self):
        t = self.t
        moved = False
        for peer, link in t.links.items():
            if peer in self._gone:
                continue
            try:
                if t.step_link(link, SPARE):
                    moved = True
            except AccordError as e:
                self._lose(peer, e)
                moved = True
        return moved

    def _collect(self):
        keep = []
        for op in self._ops:
            if op.over:
                continue
            rec = op.rec
            if op.is_send:
                if rec.done:
                    self._succeed(op, None)
                    continue
            else:
                r = rec
                if rec.__class__ is list:
                    r = next((x for x in rec if x.won), None)
                    if r is None:
                        if all(x.done for x in rec):       # every rival's peer is gone
                            self._fail(op, self._no_peer_left(op))
                        else:
                            keep.append(op)
                        continue
                if r.done:
                    if r.error is not None:
                        self._fail(op, r.error)
                    else:
                        self._succeed(op, self.ranks[r.peer])
                    continue
            keep.append(op)
        self._ops = keep

    def _succeed(self, op, value):
        op.over = True
        try:
            if op.finish is not None:
                op.finish()
        except BaseException as e:
            return self._fail(op, e)
        if op.on_done is not None:
            op.on_done(op.entry, None)
        op.set_result(value)

    def _fail(self, op, exc):
        if op.done():
            return
        op.over = True
        if op.on_done is not None:
            op.on_done(op.entry, exc)
        op.set_exception(exc)

    def _lose(self, peer, exc):
        """peer's link is unusable (it died, left or aborted): fail what needs it.

        Receives from other peers are not disturbed; an any-source receive goes on
        with the peers that remain."""
        self._gone[peer] = exc
        link = self.t.links[peer]
        for op in self._ops:
            if op.over:
                continue
            if op.rec.__class__ is list:
                for r in op.rec:
                    if r.peer == peer and not r.done:
                        r.done = True
            elif op.peer == peer and not op.rec.done:
                self._fail(op, exc)
        link.posted.clear()
        link.sends.clear()
        if link.unacked:
            link.unacked.clear()

    def _check_lost(self):
        for peer, exc in self.t.lost_peers().items():
            if peer in self._gone:
                continue
            try:        # what it sent before it went still counts
                self.t.step_link(self.t.links[peer])
            except AccordError as e:
                exc = e
            self._lose(peer, exc)

    def _expire(self, now):
        """Fail what is past its deadline; return the seconds to the next deadline."""
        nearest = _IDLE_S
        for op in self._ops:
            if op.over:
                continue
            left = op.deadline - now
            if left > 0:
                nearest = min(nearest, left)
                continue
            if op.is_send:
                # under way: its bytes still go out (the stream must stay whole); the
                # caller hears of the timeout now
                self.t.withdraw_send(op.rec)
                why = (f"{self.t.peer_desc(op.peer)} did not take the message (is it "
                       f"receiving from this rank with the same tag and group?)")
            else:
                rivals = op.rec if op.rec.__class__ is list else [op.rec]
                filling = next((r for r in rivals if self._filling(r)), None)
                if filling is not None:
                    # its bytes are coming in: let it finish while they keep coming,
                    # but not when they stopped (a sender stopped, or cut off by a
                    # network that drops packets: nothing else would ever end it)
                    stalled = self._stalled(op, filling, now)
                    if stalled.__class__ is float:
                        nearest = min(nearest, stalled)
                        continue
                    self._fail(op, stalled)
                    # the rest of that message can no longer be told from what follows
                    self._lose(filling.peer, stalled)
                    continue
                for r in rivals:
                    r.done = True
                    try:
                        self.t.links[r.peer].posted.remove(r)
                    except ValueError:
                        pass
                src = (self.t.peer_desc(op.peer) if op.peer is not None else "any rank")
                why = (f"no message with tag {op.tag} arrived from {src} (is it sending to "
                       f"this rank with the same tag and group?)")
            self._fail(op, CommTimeout(f"{self.here}: {op.desc}: Timed out after "
                                       f"{op.timeout:g} s: {why}{self._peer_text(op.peer)}"))
        return nearest

    def _peer_text(self, peer):
        """What the peer an operation timed out on was doing, as it last published it
        (the medium's `peer_text` hook: its group's positions), or "": a peer that is
        itself stuck on a third rank names that rank (error paths only)."""
        hook = getattr(self.t, "peer_text", None)
        if hook is None or peer is None:
            return ""
        try:
            return hook(peer)
        except Exception:           # a report that cannot be made must not hide the timeout
            return ""

    def _filling(self, r):
        inc = self.t.links[r.peer].incoming
        return inc is not None and inc[3] is r

    def _stalled(self, op, r, now):
        """While receive r's message (being filled, op past its deadline) still arrives,
        the seconds until it is looked at again; the CommTimeout once no byte of it
        came for op's whole timeout."""
        got = self.t.links[r.peer].incoming[2]
        seen = op.filled
        if seen is None or seen[0] != got:
            op.filled = (got, now)
            return float(op.timeout)
        if now - seen[1] < op.timeout:
            return max(0.001, seen[1] + op.timeout - now)
        total = len(op.view)
        return CommTimeout(f"{self.here}: {op.desc}: Timed out after {op.timeout:g} s: the "
                           f"message from {self.t.peer_desc(r.peer)} stopped arriving after "
                           f"{got} of {total} bytes (nothing more came for {op.timeout:g} s: "
                           f"is that rank stopped, or the network between them dropping "
                           f"packets?); point-to-point with it is over")

    def _no_peer_left(self, op):
        why = "; ".join(f"{self.t.peer_desc(p)}: {e}" for p, e in sorted(self._gone.items()))
        return PeerLost(f"{self.here}: {op.desc}: no peer is left that could send it "
                        f"({why})")
