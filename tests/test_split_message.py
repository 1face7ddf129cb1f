"""transport/split_message.py: a large single-copy message copied by its receiver and
its sender at once.

The protocol's two sides run here in two threads of this process, over words in a
buffer of its own and against its own memory (process_vm_readv / writev take any
pid, this one's too; ctypes lets go of the GIL during the calls). The copies are
wrapped to record which bytes each side moved, and to hold one side back where a
test needs the other to get somewhere first. The same messages between real
processes are in test_p2p_split.py."""
import os
import threading
import time

import numpy as np
import pytest

from accord.errors import PeerLost
from accord.transport import cma, split_message as sm

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not cma.AVAILABLE, reason="no process_vm_readv")]

UNIT = sm.UNIT


class _Plane:
    """The transport attributes split_message uses."""

    def __init__(self, q):
        self.q = q
        self.dead = set()
        self.aborted = None

    def _check_abort(self):
        if self.aborted is not None:
            raise self.aborted

    def _dead_peers(self):
        return self.dead


class _Link:
    """One channel's words as both ends see them (in one process, the same words)."""

    def __init__(self, q=None):
        self.mem = bytearray(8192)
        self.t = _Plane(q if q is not None else memoryview(self.mem).cast("q"))
        self.i_coop = self.o_coop = sm.Words(0)
        self.i_want_ack_i = 8               # nobody sleeps: no wake-up
        self.peer_doorbell = 0
        self.wake_n = 1
        self.pid = os.getpid()
        self.peer = 1


class _Copies:
    """split_message's cma, recording [side, offset, length] per copy; hooks run
    before a side's copy (by its index)."""

    def __init__(self, src, dst):
        self.src, self.dst = src.ctypes.data, dst.ctypes.data
        self.calls = []
        self.before_read = self.before_write = None
        self.lock = threading.Lock()

    def read(self, pid, local, remote, n):
        # the receiver's copy: from the sender's src into its own dst
        self._copy("read", remote - self.src, local - self.dst, n, self.before_read)
        cma.read(pid, local, remote, n)

    def write(self, pid, local, remote, n):
        # the sender's copy: from its own src into the receiver's dst
        self._copy("write", local - self.src, remote - self.dst, n, self.before_write)
        cma.write(pid, local, remote, n)

    def _copy(self, side, src_off, dst_off, n, hook):
        """Record a copy (both ends at the same offset), then run the side's hook."""
        with self.lock:
            i = sum(1 for c in self.calls if c[0] == side)
            self.calls.append((side, src_off, n))
        assert dst_off == src_off
        if hook is not None:
            hook(i)

    def moved(self, side):
        return sum(n for s, _, n in self.calls if s == side)

    def read_once_writing(self, write_s=0.0):
        """Hold the receiver's first read until the sender starts a write; each of the
        sender's writes then takes write_s seconds more."""
        writing = threading.Event()
        self.before_read = lambda i: i == 0 and writing.wait(10)

        def write(i):
            writing.set()
            if write_s:
                time.sleep(write_s)
        self.before_write = write


@pytest.fixture
def message(monkeypatch):
    """(src, dst, copies) for a message of n bytes, split_message's cma recorded."""
    def make(n):
        src = np.random.default_rng(n).integers(0, 256, n, np.uint8)
        dst = np.zeros(n, np.uint8)
        copies = _Copies(src, dst)
        monkeypatch.setattr(sm, "cma", copies)
        return src, dst, copies
    return make


def _sender(link, seq, src, n, out, stop):
    """A sender waiting for its acknowledgement: it helps once asked, as check_acks does."""
    try:
        while not stop.is_set():
            if sm.asked(link, seq):
                out.append(sm.assist(link, seq, src.ctypes.data, n))
                return
            time.sleep(0)
    except BaseException as e:          # the test reads it
        out.append(e)


def _start_sender(link, seq, src, n):
    out, stop = [], threading.Event()
    th = threading.Thread(target=_sender, args=(link, seq, src, n, out, stop), daemon=True)
    th.start()
    return th, out, stop


@pytest.mark.parametrize("n", [2 * sm.MIN_UNITS * UNIT, 4 << 20, (4 << 20) + 123,
                               (9 << 20) - 7])
def test_receiver_alone_copies_everything_in_two_reads(message, n):
    src, dst, copies = message(n)
    link = _Link()
    sm.receive(link, dst.ctypes.data, src.ctypes.data, n, 5)
    assert np.array_equal(dst, src)
    # the front half, then (no sender came) all the rest at once
    assert [c[0] for c in copies.calls] == ["read", "read"]
    assert copies.calls[0][1:] == (0, (sm.units(n) + 1) // 2 * UNIT)
    assert link.t.q[link.i_coop.recv] == 5 << sm.SHIFT | sm.CLOSED


@pytest.mark.parametrize("n", [4 << 20, (8 << 20) + 4097, 3 * UNIT * sm.MIN_UNITS + 1])
def test_a_sender_there_from_the_start_writes_the_back_half(message, n):
    src, dst, copies = message(n)
    link = _Link()
    # the receiver reads its half only once the sender is writing the other
    copies.read_once_writing()
    th, out, stop = _start_sender(link, 9, src, n)
    sm.receive(link, dst.ctypes.data, src.ctypes.data, n, 9)
    th.join(10)
    assert out == [True]
    assert np.array_equal(dst, src)
    half = (sm.units(n) + 1) // 2 * UNIT
    assert copies.calls[0] == ("read", 0, half)
    first = next(c for c in copies.calls if c[0] == "write")
    assert first[1] >= half and first[1] + first[2] == n
    assert copies.moved("read") + copies.moved("write") >= n


@pytest.mark.parametrize("began_s, first_from", [(0.0, (4 << 20, (4 << 20) + 8 * UNIT)),
                                                  (10.0, (6 << 20, (6 << 20) + 1))])
def test_the_sender_claims_by_where_the_receiver_should_be(message, began_s, first_from):
    """A receiver that asked just now has copied little of its front half: the sender
    takes all the back half in one write. One that asked long ago should be at its
    half's end: the sender takes half of the back half, then (the receiver not
    moving here) half of what is left, down to the receiver's claim."""
    n = 8 << 20
    src, dst, copies = message(n)
    link = _Link()
    q, w, total = link.t.q, link.o_coop, sm.units(n)
    q[w.dest] = dst.ctypes.data
    q[w.start] = time.monotonic_ns() - int(began_s * 1e9)
    q[w.recv] = 1 << sm.SHIFT | total // 2
    assert sm.assist(link, 1, src.ctypes.data, n) is True
    writes = [c for c in copies.calls if c[0] == "write"]
    lo, hi = first_from
    assert lo <= writes[0][1] < hi
    assert writes[0][1] + writes[0][2] == n
    # down to the receiver's claim, nothing below it
    assert min(off for _, off, _ in writes) == n // 2
    assert np.array_equal(dst[n // 2:], src[n // 2:]) and not dst[:n // 2].any()
    assert q[w.done] == 1 << sm.SHIFT | total // 2


@pytest.mark.parametrize("n", [6 << 20, (5 << 20) + 99])
def test_a_slow_sender_and_a_fast_receiver_cover_every_byte(message, n):
    src, dst, copies = message(n)
    link = _Link()
    copies.read_once_writing(0.002)
    th, out, stop = _start_sender(link, 3, src, n)
    sm.receive(link, dst.ctypes.data, src.ctypes.data, n, 3)
    th.join(10)
    assert np.array_equal(dst, src)
    assert copies.moved("write") > 0
    # every byte by one side at least
    seen = np.zeros(n, bool)
    for _, off, k in copies.calls:
        seen[off:off + k] = True
    assert seen.all()


def test_no_sender_write_after_the_receive_returns(message):
    """The sender is inside a write when the receiver has copied everything: the
    receive waits for that write, and the sender writes nothing after."""
    n = 4 << 20
    src, dst, copies = message(n)
    link = _Link()
    copies.read_once_writing(0.2)      # the receiver meanwhile copies all of it itself
    th, out, stop = _start_sender(link, 4, src, n)
    sm.receive(link, dst.ctypes.data, src.ctypes.data, n, 4)
    assert np.array_equal(dst, src)
    # the receive is over: the buffer is the caller's again
    dst[:] = 0
    th.join(10)
    assert out == [True]
    assert not dst.any(), "the sender wrote into the buffer after the receive returned"
    assert link.t.q[link.o_coop.busy] == 0


def test_a_sender_that_comes_after_the_receive_writes_nothing(message):
    n = 4 << 20
    src, dst, copies = message(n)
    link = _Link()
    sm.receive(link, dst.ctypes.data, src.ctypes.data, n, 6)
    assert not sm.asked(link, 6)
    assert sm.assist(link, 6, src.ctypes.data, n) is False
    assert copies.moved("write") == 0


class _ScriptedRecv:
    """An arena view whose receiver word reads as scripted, in turn (then the last)."""

    def __init__(self, q, index, values):
        self.q, self.index, self.values = q, index, list(values)

    def __getitem__(self, i):
        if i == self.index:
            return self.values.pop(0) if len(self.values) > 1 else self.values[0]
        return self.q[i]

    def __setitem__(self, i, v):
        self.q[i] = v


def test_a_sender_whose_receiver_moved_on_writes_nothing(message):
    """Between the sender's look (message 7 asks) and its write, the receiver finished
    message 7 and asked for help with message 8 (a window of isends): the sender sees
    the number change after raising BUSY and writes nothing into message 8's buffer."""
    n = 4 << 20
    src, dst, copies = message(n)
    link = _Link()
    recv = link.o_coop.recv
    link.t.q = _ScriptedRecv(link.t.q, recv, [7 << sm.SHIFT | 32, 7 << sm.SHIFT | 32,
                                              8 << sm.SHIFT | 32])
    assert sm.asked(link, 7)
    assert sm.assist(link, 7, src.ctypes.data, n) is False
    assert copies.calls == []
    assert link.t.q[link.o_coop.busy] == 0


def test_a_sender_that_died_inside_a_write_ends_the_wait(message):
    """Its busy word stays up for ever; once it is known dead nothing more can be
    written, and the receiver, which copied everything the sender had not said it
    wrote, has the whole message."""
    n = 2 << 20
    src, dst, copies = message(n)
    link = _Link()
    link.t.q[link.i_coop.busy] = 2          # a sender inside a write, never to finish
    threading.Timer(0.05, link.t.dead.add, (1,)).start()
    sm.receive(link, dst.ctypes.data, src.ctypes.data, n, 2)
    assert np.array_equal(dst, src)
    assert 1 in link.t.dead                  # it did wait for the death


def test_an_aborted_sender_is_still_waited_for(message):
    """A sender whose group aborted may still be inside its write: the receive waits
    for the write to end (the caller reports the abort after)."""
    n = 2 << 20
    src, dst, copies = message(n)
    link = _Link()
    q, busy = link.t.q, link.i_coop.busy
    q[busy] = 2
    link.t.aborted = PeerLost("rank 1 aborted: boom")
    done = threading.Event()
    threading.Timer(0.1, lambda: (done.set(), q.__setitem__(busy, 0))).start()
    sm.receive(link, dst.ctypes.data, src.ctypes.data, n, 2)
    assert done.is_set()
    assert np.array_equal(dst, src)


def test_applies():
    assert not sm.applies(2 * sm.MIN_UNITS * UNIT - 1)
    assert sm.applies(2 * sm.MIN_UNITS * UNIT)
    assert sm.applies(1 << 30)
    assert not sm.applies(sm.CLOSED * UNIT)


def test_a_claim_the_sender_never_wrote_is_copied_by_the_receiver(message):
    """The sender stored its claim on the back half, then saw the receiver close and
    wrote nothing (or has not written yet): the receiver copies those bytes itself,
    going by what the sender says it wrote, not by what it claimed."""
    n = 4 << 20
    src, dst, copies = message(n)
    link = _Link()
    total = sm.units(n)
    link.t.q[link.i_coop.claim] = 11 << sm.SHIFT | total // 2
    sm.receive(link, dst.ctypes.data, src.ctypes.data, n, 11)
    assert np.array_equal(dst, src)
    assert copies.moved("read") == n


def test_the_sender_writes_only_above_where_the_receiver_got_to(message):
    """The receiver's claim moved on (from half to three quarters) between the
    sender's look and its write: the sender writes only the last quarter."""
    n = 4 << 20
    src, dst, copies = message(n)
    link = _Link()
    total = sm.units(n)
    q = link.t.q
    q[link.o_coop.dest] = dst.ctypes.data
    q[link.o_coop.start] = time.monotonic_ns()
    link.t.q = _ScriptedRecv(q, link.o_coop.recv, [12 << sm.SHIFT | total // 2] * 2 +
                             [12 << sm.SHIFT | total * 3 // 4])
    assert sm.asked(link, 12)
    assert sm.assist(link, 12, src.ctypes.data, n) is True
    assert copies.calls == [("write", n * 3 // 4, n // 4)]
