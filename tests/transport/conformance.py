"""One conformance suite for every transport (the contract of accord/transport/base.py).

Each check_* takes a maker: make(size) -> list of (collective plane, p2p plane)
per rank, all in this process (ranks are threads), and close(planes). A new
medium passes when every check passes with its maker (test_conformance.py).
"""
import threading
import time

import numpy as np

from accord.byte_stream import ByteStream
from accord.errors import AccordError, CommTimeout, Desync, GroupClosed, PeerLost
from accord.transport.matching import Recv
from accord.transport.p2p import Engine, Pending
from accord.transport.wire import OP_CODES, Stamp

BCAST, REDUCE = OP_CODES["broadcast"], OP_CODES["all_reduce"]


def stamp(seq, n, op=BCAST):
    return Stamp(op, seq, -1, 0, 0, n, "uint8")


def in_threads(*fns, timeout=30):
    """Run each fn() in a thread of its own; return their results (or raised errors)."""
    out = [None] * len(fns)

    def run(i, fn):
        try:
            out[i] = fn()
        except BaseException as e:        # the check inspects it
            out[i] = e
    ts = [threading.Thread(target=run, args=(i, fn), daemon=True) for i, fn in enumerate(fns)]
    for t in ts:
        t.start()
    end = time.monotonic() + timeout
    for t in ts:
        t.join(max(0.0, end - time.monotonic()))
    hung = [i for i, t in enumerate(ts) if t.is_alive()]
    assert not hung, f"ranks {hung} hung"
    return out


def ok(results):
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def payload(n, *seed):
    return np.random.default_rng([n, *seed]).integers(0, 256, n, dtype=np.uint8)


def ring_bytes(t):
    return getattr(t, "cap", 1 << 20)


# -- collective plane -------------------------------------------------------------------

def check_fifo(maker, size=3):
    """Messages of every awkward size, each ordered pair, both ways at once, in order."""
    planes = maker.make(size)
    try:
        cap = ring_bytes(planes[0][0])
        sizes = [0, 1, 31, 32, 33, cap - 1, cap + 1, 3 * cap] * 3

        def rank(r):
            t = planes[r][0]
            for i, n in enumerate(sizes):
                peers = [p for p in range(size) if p != r]
                got = {p: np.zeros(n, np.uint8) for p in peers}
                t.exchange([(p, memoryview(payload(n, r, p, i))) for p in peers],
                           [(p, memoryview(got[p])) for p in peers], stamp(i, n),
                           time.monotonic() + 20)
                for p in peers:
                    assert np.array_equal(got[p], payload(n, p, r, i)), (r, p, i, n)
            return True
        assert ok(in_threads(*[lambda r=r: rank(r) for r in range(size)], timeout=60))
    finally:
        maker.close(planes)


def check_same_peer_in_order(maker, size=3):
    """Several messages to each peer in one step, small ones around one that cannot go
    in one piece (it waits for room, or streams): each peer receives them in order,
    into the buffers posted for them in that order."""
    planes = maker.make(size)
    try:
        cap = ring_bytes(planes[0][0])
        orders = [[8, 3 * cap, 8, 0, 64], [3 * cap, 8], [8, 8, cap + 1], [0, 0, 5]]

        def rank(r):
            t = planes[r][0]
            peers = [p for p in range(size) if p != r]
            for i, sizes in enumerate(orders):
                sends = [(p, memoryview(payload(n, r, p, i, k)))
                         for k, n in enumerate(sizes) for p in peers]
                got = {(p, k): np.zeros(n, np.uint8) for k, n in enumerate(sizes) for p in peers}
                t.exchange(sends, [(p, memoryview(got[p, k])) for k, n in enumerate(sizes)
                                   for p in peers], stamp(i, 0), time.monotonic() + 20)
                for (p, k), buf in got.items():
                    assert np.array_equal(buf, payload(sizes[k], p, r, i, k)), (r, p, i, k)
            return True
        assert ok(in_threads(*[lambda r=r: rank(r) for r in range(size)], timeout=60))
    finally:
        maker.close(planes)


def check_same_peer_in_order_pair(maker):
    """check_same_peer_in_order between two ranks (on shared memory with a core each,
    the receiver spins for the last message it waits for)."""
    check_same_peer_in_order(maker, 2)


def cut(arr, seed):
    """arr's bytes as a ByteStream of views of uneven lengths (empty ones among them)."""
    mv = memoryview(arr).cast("B")
    rng = np.random.default_rng([len(mv), seed])
    edges = sorted(set([0, len(mv)] + rng.integers(0, len(mv) + 1, 6).tolist()))
    views = [mv[a:b] for a, b in zip(edges, edges[1:])]
    return ByteStream(views[:1] + [mv[0:0]] + views[1:])


def check_streams(maker, size=3):
    """A message given as a ByteStream goes out as its views back to back and is
    received whole; one received into a ByteStream fills its views in turn; both at
    once; through exchange() (several peers, and one peer each way) and send1/recv1,
    at sizes that go in one piece, that wait for room and that stream through a ring."""
    planes = maker.make(size)
    try:
        cap = ring_bytes(planes[0][0])
        sizes = [0, 1, 100, 4096, cap - 1, cap + 1, 3 * cap]

        def rank(r):
            t = planes[r][0]
            peers = [p for p in range(size) if p != r]
            seq = 0
            for n in sizes:
                for how in ("send", "recv", "both"):
                    seq += 1
                    out = {p: payload(n, r, p, seq) for p in peers}
                    got = {p: np.zeros(n, np.uint8) for p in peers}
                    sends = [(p, cut(out[p], 1) if how != "recv" else memoryview(out[p]))
                             for p in peers]
                    recvs = [(p, cut(got[p], 2) if how != "send" else memoryview(got[p]))
                             for p in peers]
                    t.exchange(sends, recvs, stamp(seq, n), time.monotonic() + 20)
                    for p in peers:
                        assert np.array_equal(got[p], payload(n, p, r, seq)), (r, p, n, how)
                # one message each way with the next rank, through send1/recv1
                seq += 1
                right, left = (r + 1) % size, (r - 1) % size
                got = np.zeros(n, np.uint8)
                if r % 2 == 0:
                    t.send1(right, cut(payload(n, r, seq), 3), stamp(seq, n),
                            time.monotonic() + 20)
                    t.recv1(left, cut(got, 4), stamp(seq, n), time.monotonic() + 20)
                else:
                    t.recv1(left, cut(got, 4), stamp(seq, n), time.monotonic() + 20)
                    t.send1(right, cut(payload(n, r, seq), 3), stamp(seq, n),
                            time.monotonic() + 20)
                assert np.array_equal(got, payload(n, left, seq)), (r, n, "send1/recv1")
            return True
        assert ok(in_threads(*[lambda r=r: rank(r) for r in range(size)], timeout=60))
    finally:
        maker.close(planes)


def check_stream_of_many_views(maker):
    """A ByteStream of more views than one system call takes (1500 of 3 bytes, and a
    few empty), each way between two ranks, into a stream of other cuts."""
    planes = maker.make(2)
    try:
        n = 4500

        def views(arr, k):
            mv = memoryview(arr).cast("B")
            out = [mv[i:i + k] for i in range(0, len(mv), k)]
            return ByteStream(out[:10] + [mv[0:0]] * 5 + out[10:])

        def rank(r):
            t = planes[r][0]
            got = np.zeros(n, np.uint8)
            sends = [(1 - r, views(payload(n, r), 3))]
            t.exchange(sends, [(1 - r, views(got, 7))], stamp(1, n), time.monotonic() + 20)
            return bool(np.array_equal(got, payload(n, 1 - r)))
        assert ok(in_threads(lambda: rank(0), lambda: rank(1))) == [True, True]
    finally:
        maker.close(planes)


def check_streams_pair(maker):
    """check_streams between two ranks (on shared memory, the one-piece path's spin)."""
    check_streams(maker, 2)


def check_both_ways_full(maker):
    """One exchange sending three rings' worth each way between two ranks."""
    planes = maker.make(2)
    try:
        n = 3 * ring_bytes(planes[0][0])

        def rank(r):
            got = np.zeros(n, np.uint8)
            planes[r][0].exchange([(1 - r, memoryview(payload(n, r)))], [(1 - r, memoryview(got))],
                                  stamp(0, n), time.monotonic() + 20)
            return bool(np.array_equal(got, payload(n, 1 - r)))
        assert ok(in_threads(lambda: rank(0), lambda: rank(1))) == [True, True]
    finally:
        maker.close(planes)


def check_stamps(maker):
    """Different ops in one step: a Desync on both ranks, naming both calls."""
    planes = maker.make(2)
    try:
        def rank(r):
            buf = np.zeros(8, np.uint8)
            planes[r][0].exchange([(1 - r, memoryview(np.ones(8, np.uint8)))],
                                  [(1 - r, memoryview(buf))],
                                  stamp(0, 8, BCAST if r == 0 else REDUCE),
                                  time.monotonic() + 10)
        out = in_threads(lambda: rank(0), lambda: rank(1))
        for e in out:
            assert isinstance(e, Desync), e
            assert "broadcast" in str(e) and "all_reduce" in str(e), e
    finally:
        maker.close(planes)


def check_deadline(maker):
    """A silent peer: CommTimeout within the deadline and a half, naming the peer."""
    planes = maker.make(2)
    try:
        t0 = time.monotonic()
        e = in_threads(lambda: planes[0][0].exchange(
            [], [(1, memoryview(bytearray(4)))], stamp(0, 4), time.monotonic() + 0.3))[0]
        assert isinstance(e, CommTimeout) and "rank 1" in str(e), e
        assert time.monotonic() - t0 < 0.3 + 1.5
    finally:
        maker.close(planes)


def check_interrupt(maker):
    """interrupt(exc) from another thread ends a blocked exchange with exc."""
    planes = maker.make(2)
    try:
        t = planes[0][0]
        why = Desync("a cycle of waits (test)")

        def later():
            time.sleep(0.2)
            t.interrupt(why)
        e = in_threads(lambda: t.exchange([], [(1, memoryview(bytearray(4)))], stamp(0, 4),
                                          time.monotonic() + 20), later)[0]
        assert e is why
    finally:
        maker.close(planes)


def check_abort(maker):
    """A peer's abort(exc) reaches a rank waiting on it as exc's type, with who said so."""
    planes = maker.make(2)
    try:
        def waiter():
            planes[0][0].exchange([], [(1, memoryview(bytearray(4)))], stamp(0, 4),
                                  time.monotonic() + 20)

        def aborter():
            time.sleep(0.2)
            planes[1][0].abort(Desync("rank 1: the shapes differ (test)"))
        e = in_threads(waiter, aborter)[0]
        assert isinstance(e, Desync) and "the shapes differ" in str(e) and \
            "reported by rank 1" in str(e), e
    finally:
        maker.close(planes)


def check_goodbye(maker):
    """A peer that closes while needed: PeerLost saying it left."""
    planes = maker.make(2)
    try:
        def waiter():
            planes[0][0].exchange([], [(1, memoryview(bytearray(4)))], stamp(0, 4),
                                  time.monotonic() + 20)

        def leaver():
            time.sleep(0.2)
            maker.close([planes[1]])
        e = in_threads(waiter, leaver)[0]
        assert isinstance(e, PeerLost) and "left the group" in str(e), e
    finally:
        maker.close([planes[0]])


def check_closed(maker):
    """After close(): GroupClosed from every call; close() twice is fine."""
    planes = maker.make(2)
    maker.close(planes)
    maker.close(planes)
    for t, _ in planes:
        try:
            t.exchange([], [(1, memoryview(bytearray(4)))], stamp(0, 4), time.monotonic() + 5)
        except GroupClosed:
            continue
        raise AssertionError("exchange after close did not raise GroupClosed")


def check_os_errors(maker):
    """An OS error at the medium's edge surfaces as accord's error, never a bare OSError."""
    planes = maker.make(2)
    try:
        undo = maker.fault(planes[0][0], 1)
        try:
            n = 4 << 20
            out = in_threads(
                lambda: planes[0][0].exchange([], [(1, memoryview(np.zeros(n, np.uint8)))],
                                              stamp(0, n), time.monotonic() + 10),
                lambda: planes[1][0].exchange([(0, memoryview(np.ones(n, np.uint8)))], [],
                                              stamp(0, n), time.monotonic() + 3))
        finally:
            undo()
        assert isinstance(out[0], AccordError), out[0]
        assert not isinstance(out[1], OSError) or isinstance(out[1], AccordError), out[1]
    finally:
        maker.close(planes)


# -- point-to-point plane (through the engine, as a group drives it) ----------------------

def engines(planes):
    return [Engine(p2p, "conformance", list(range(len(planes))), f"rank {r}")
            for r, (_, p2p) in enumerate(planes)]


def post(engine, is_send, peer, buf, tag, timeout=20.0):
    op = Pending(is_send, peer, memoryview(buf).cast("B"), tag, timeout,
                 f"{'send' if is_send else 'recv'} tag {tag}")
    engine.post([op])
    return op          # its own future (result, exception)


def check_tagged(maker):
    """Receives posted in another order than the sends, before them; any source; a
    message larger than the ring; truncation fails the receive only."""
    planes = maker.make(3)
    es = engines(planes)
    try:
        big = 3 * ring_bytes(planes[0][1]) + 5
        got = {t: np.zeros(n, np.uint8) for t, n in ((1, 10), (2, big), (3, 7))}
        futs = [post(es[1], False, 0, got[t], t) for t in (3, 1, 2)]
        anyf = post(es[1], False, None, any_buf := np.zeros(4, np.uint8), 9)
        short = post(es[1], False, 0, np.zeros(2, np.uint8), 5)
        sends = [post(es[0], True, 1, payload(n, t), t) for t, n in ((1, 10), (2, big), (3, 7))]
        sends.append(post(es[2], True, 1, np.full(4, 2, np.uint8), 9))
        sends.append(post(es[0], True, 1, np.zeros(8, np.uint8), 5))
        for f in futs + sends:
            assert f.result(30) in (0, None)
        assert anyf.result(30) == 2 and (any_buf == 2).all()
        e = short.exception(30)
        assert isinstance(e, Desync) and "8 bytes" in str(e) and "holds 2 bytes" in str(e), e
        for t, n in ((1, 10), (2, big), (3, 7)):
            assert np.array_equal(got[t], payload(n, t)), t
    finally:
        for e in es:
            e.close()
        maker.close(planes)


def check_tagged_peer_lost(maker):
    """A peer that leaves fails the receives posted from it, not those from others."""
    planes = maker.make(3)
    es = engines(planes)
    try:
        from_1 = post(es[0], False, 1, np.zeros(4, np.uint8), 0)
        from_2 = post(es[0], False, 2, got := np.zeros(4, np.uint8), 0)
        time.sleep(0.1)
        es[1].close()
        maker.close([planes[1]])
        e = from_1.exception(10)
        assert isinstance(e, PeerLost) and "rank 1" in str(e), e
        post(es[2], True, 0, np.full(4, 7, np.uint8), 0).result(10)
        assert from_2.result(10) == 2 and (got == 7).all()
    finally:
        for e in es:
            e.close()
        maker.close([planes[0], planes[2]])


def check_take_now(maker):
    """take_now takes the next small tagged message off the link at once (shared
    memory) or says False (a medium may always); with nothing there it gives up
    after wait_s, and a False leaves the link as it was (a message of another tag
    stays for its own receive)."""
    planes = maker.make(2)
    a, b = planes[0][1], planes[1][1]
    try:
        got = np.zeros(16, np.uint8)
        assert b.take_now(0, memoryview(got), 4, 0.02) is False
        other, want = payload(16, 5), payload(16, 4)
        for tag, data in ((5, other), (4, want)):
            rec = a.tagged_send(1, memoryview(data), tag)
            end = time.monotonic() + 10
            while not rec.done and time.monotonic() < end:
                a.step_link(a.links[1])
            assert rec.done
        assert b.take_now(0, memoryview(got), 4, 0.02) is False     # tag 5 comes first
        if b.medium == "shared memory":
            assert b.take_now(0, memoryview(got), 5, 0.02) is True
            assert np.array_equal(got, other)
            assert b.take_now(0, memoryview(got), 4, 0.02) is True
            assert np.array_equal(got, want)
        else:
            assert b.take_now(0, memoryview(got), 5, 0.02) is False
    finally:
        maker.close(planes)


def check_step_without_drain(maker):
    """step_link(link, drain=False) reads what the posted receives take and leaves the
    messages behind it where they are (the receives for them are about to be
    posted: a window of irecvs); step_link(link) reads everything, the rest into
    the stash."""
    planes = maker.make(2)
    a, b = planes[0][1], planes[1][1]
    try:
        sent = {tag: payload(64, tag) for tag in (1, 2, 3)}     # all three fit in a ring
        for tag in (1, 2, 3):
            a.tagged_send(1, memoryview(sent[tag]), tag)
        end = time.monotonic() + 10
        while a.links[1].sends and time.monotonic() < end:  # written out (a single-copy
            a.step_link(a.links[1])                         # one is done once read)
        assert not a.links[1].sends
        link = b.links[0]
        got = np.zeros(64, np.uint8)
        first = Recv(0, memoryview(got), tag=1)
        link.posted.append(first)
        end = time.monotonic() + 10
        while not first.done and time.monotonic() < end:
            b.step_link(link, drain=False)
        assert first.done and np.array_equal(got, sent[1])
        for _ in range(3):
            b.step_link(link, drain=False)
        assert not link.stash                       # tags 2 and 3 left unread
        end = time.monotonic() + 10
        while len(link.stash) < 2 and time.monotonic() < end:
            b.step_link(link)
        assert len(link.stash) == 2
        second = Recv(0, memoryview(got), tag=3)
        assert link.take_stashed(second) and np.array_equal(got, sent[3])
    finally:
        maker.close(planes)


CHECKS = [check_fifo, check_same_peer_in_order, check_same_peer_in_order_pair,
          check_streams, check_streams_pair, check_stream_of_many_views,
          check_both_ways_full, check_stamps, check_deadline, check_interrupt,
          check_abort, check_goodbye, check_closed, check_os_errors, check_tagged,
          check_tagged_peer_lost, check_take_now, check_step_without_drain]
