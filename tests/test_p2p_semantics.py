"""Point-to-point with MPI's semantics: receives posted before sends, many outstanding,
non-overtaking order, progress while the receiver computes, batch_isend_irecv, threads,
truncation and peers that die. Each pattern runs over shared memory and TCP."""
import os
import threading
import time

import numpy as np
import pytest

import accord as dist
from harness import run_ranks

pytestmark = pytest.mark.timeout(90)

TRANSPORTS = ["shm", "tcp"]


def _recvs_first(rank, world, n):
    # MPI's most common pattern: post every receive, then every send, then wait
    peers = [p for p in range(world) if p != rank]
    got = {p: np.zeros(n, np.int32) for p in peers}
    works = [dist.irecv(got[p], src=p, timeout=20) for p in peers]
    works += [dist.isend(np.full(n, rank * 100 + p, np.int32), dst=p, timeout=20) for p in peers]
    for w in works:
        assert w.wait() is True
    return {p: bool((got[p] == p * 100 + rank).all()) for p in peers}


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("n", [1, 300_000])
def test_receives_posted_before_sends(world, transport, n):
    out = run_ranks(world, _recvs_first, n, timeout=40, env={"ACCORD_TRANSPORT": transport})
    assert all(all(ok.values()) for ok in out), out


def _many_outstanding(rank, world):
    # 50 messages per peer on two tags, received in the order sent per (sender, tag),
    # posted in another order across tags, with collectives in between
    peers = [p for p in range(world) if p != rank]
    k = 50
    recvs = {}
    works = []
    for tag in (2, 1):
        for p in peers:
            for i in range(k):
                b = np.zeros(3, np.int64)
                recvs[p, tag, i] = b
                works.append(dist.irecv(b, src=p, tag=tag))
    x = np.array([rank])
    dist.all_reduce(x)              # a posted receive never blocks a collective
    assert x[0] == sum(range(world))
    for p in peers:
        for i in range(k):
            for tag in (1, 2):
                works.append(dist.isend(np.array([rank, tag, i]), dst=p, tag=tag))
    dist.barrier()                  # nor does a collective block the pending sends
    for w in works:
        w.wait()
    return all(recvs[p, t, i].tolist() == [p, t, i] for (p, t, i) in recvs)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_many_outstanding_in_order_beside_collectives(transport):
    assert all(run_ranks(3, _many_outstanding, timeout=60, env={"ACCORD_TRANSPORT": transport}))


def _any_source_reports_sender(rank, world):
    if rank == 0:
        works = [(dist.irecv(b := np.zeros(1, np.int64), tag=4), b) for _ in range(world - 1)]
        seen = sorted((w.wait(), w.result(), int(b[0]))[1:] for w, b in works)
        return seen
    dist.send(np.array([rank * 11]), dst=0, tag=4)
    return None


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_irecv_from_any_source_reports_each_sender(transport):
    out = run_ranks(4, _any_source_reports_sender, timeout=40, env={"ACCORD_TRANSPORT": transport})
    assert out[0] == [(1, 11), (2, 22), (3, 33)]


def _progress_while_receiver_computes(rank, world, flag):
    # rank 1 posts its receive and then waits outside accord until rank 0's send has
    # completed: only an engine that progresses by itself lets that happen
    n = 16 << 20
    if rank == 0:
        w = dist.isend(np.full(n, 5, np.uint8), dst=1, timeout=30)
        w.wait()
        with open(flag, "w") as f:
            f.write("sent")
        return "sent"
    buf = np.zeros(n, np.uint8)
    w = dist.irecv(buf, src=0, timeout=30)
    end = time.monotonic() + 30
    while not os.path.exists(flag):
        assert time.monotonic() < end, "rank 0's send never completed"
        time.sleep(0.01)
    w.wait()
    return bool((buf == 5).all())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_send_completes_while_the_receiver_is_outside_accord(transport, tmp_path):
    out = run_ranks(2, _progress_while_receiver_computes, str(tmp_path / "flag"), timeout=40,
                    env={"ACCORD_TRANSPORT": transport})
    assert out == ["sent", True]


def _both_ways_large(rank, world):
    n = 64 << 20
    other = 1 - rank
    mine = np.full(n, rank + 1, np.uint8)
    got = np.zeros(n, np.uint8)
    dist.send(mine, dst=other, timeout=40)      # both block-send 64 MiB at once
    dist.recv(got, src=other, timeout=40)
    ok = bool((got == other + 1).all())
    got[:] = 0
    ws = [dist.isend(mine, dst=other), dist.irecv(got, src=other)]
    for w in ws:
        w.wait()
    return ok and bool((got == other + 1).all())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_64_mib_both_ways_at_once(transport):
    assert run_ranks(2, _both_ways_large, timeout=60, env={"ACCORD_TRANSPORT": transport}) == \
        [True, True]


def _batch(rank, world):
    right, left = (rank + 1) % world, (rank - 1) % world
    got_l = np.zeros(1000, np.float32)
    got_r = np.zeros(1000, np.float32)
    ops = [dist.P2POp(dist.irecv, got_l, left, tag=1),     # receives listed first
           dist.P2POp(dist.irecv, got_r, right, tag=2),
           dist.P2POp(dist.isend, np.full(1000, rank, np.float32), right, tag=1),
           dist.P2POp(dist.isend, np.full(1000, -rank, np.float32), left, tag=2)]
    works = dist.batch_isend_irecv(ops)
    assert len(works) == 4 and all(isinstance(w, dist.Work) for w in works)
    for w in works:
        w.wait()
    return bool((got_l == left).all() and (got_r == -right).all())


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_batch_isend_irecv_ring(world, transport):
    assert all(run_ranks(world, _batch, timeout=40, env={"ACCORD_TRANSPORT": transport}))


def _batch_bad(rank, world):
    peer = 1 - rank
    x = np.zeros(4)
    errors = []
    for bad in ([], [dist.P2POp(dist.isend, x, peer), "not an op"],
                [dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, x, 7)],
                [dist.P2POp(dist.isend, x, peer, tag="t")]):
        try:
            dist.batch_isend_irecv(bad)
        except (ValueError, TypeError) as e:
            errors.append(type(e).__name__)
    try:
        dist.P2POp(dist.send, x, peer)
    except ValueError as e:
        errors.append("op" if "accord.isend or accord.irecv" in str(e) else str(e))
    # nothing of the bad batches was posted: a good exchange matches exactly
    got = np.zeros(4)
    for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, got, peer),
                                     dist.P2POp(dist.isend, np.full(4, rank + 1.0), peer)]):
        w.wait()
    return errors, got.tolist()


def test_batch_isend_irecv_checks_every_op_before_posting():
    out = run_ranks(2, _batch_bad, timeout=30)
    for rank, (errors, got) in enumerate(out):
        assert errors == ["ValueError", "ValueError", "ValueError", "TypeError", "op"]
        assert got == [2.0 - rank] * 4


def _threads(rank, world):
    # rank 0 serves every other rank from a thread of its own, while its main thread
    # runs collectives on the same group
    if rank == 0:
        results = {}

        def serve(peer):
            buf = np.zeros(100, np.int64)
            for i in range(20):
                dist.recv(buf, src=peer, tag=i)
                results[peer, i] = int(buf[0])
                dist.send(buf * 2, dst=peer, tag=i)
        ts = [threading.Thread(target=serve, args=(p,)) for p in range(1, world)]
        for t in ts:
            t.start()
        for i in range(10):
            y = np.array([i])
            dist.all_reduce(y)
        for t in ts:
            t.join(30)
        return sorted(results.items()) == sorted(((p, i), p * 1000 + i)
                                                 for p in range(1, world) for i in range(20))
    out = np.zeros(100, np.int64)
    for i in range(20):
        dist.send(np.full(100, rank * 1000 + i, np.int64), dst=0, tag=i)
        dist.recv(out, src=0, tag=i)
        assert (out == 2 * (rank * 1000 + i)).all()
    for i in range(10):
        y = np.array([i])
        dist.all_reduce(y)
        assert y[0] == i * world
    return True


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_threads_doing_p2p_beside_collectives(transport):
    assert all(run_ranks(4, _threads, timeout=60, env={"ACCORD_TRANSPORT": transport}))


def _truncated(rank, world):
    if rank == 0:
        w = dist.isend(np.arange(16, dtype=np.float64), dst=1, tag=3)
        w.wait()                       # the sender is released
        dist.send(np.arange(4, dtype=np.float64), dst=1, tag=3)
        out = None
    else:
        small = np.zeros(8)
        try:
            dist.recv(small, src=0, tag=3)
            out = "no error"
        except dist.Desync as e:
            out = str(e)
        ok = np.zeros(4)
        dist.recv(ok, src=0, tag=3)    # the next message on the tag is intact
        assert ok.tolist() == [0, 1, 2, 3]
    x = np.array([1.0])
    dist.all_reduce(x)                 # the group's collectives stay usable
    assert x[0] == world
    return out


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_truncation_is_the_receivers_error(transport):
    out = run_ranks(2, _truncated, timeout=30, env={"ACCORD_TRANSPORT": transport})
    assert "128 bytes" in out[1] and "holds 64 bytes" in out[1] and "truncated" in out[1]


def _waited_one_by_one(rank, world):
    # irecv(...).wait() while the reply is on its way: a receive waited on alone looks
    # for its message on its own link, and must still match by tag and size
    other = 1 - rank
    got = np.zeros(1, np.int64)
    for i in range(300):
        if rank == 0:
            dist.isend(np.array([i], np.int64), dst=other).wait()
            dist.irecv(got, src=other).wait()
            assert got[0] == i + 1000, (i, got)
        else:
            dist.irecv(got, src=other).wait()
            dist.isend(got + 1000, dst=other).wait()
    if rank == 0:
        dist.recv(got, src=other)                     # rank 1 waits: the next come at once
        dist.isend(np.arange(2, dtype=np.int64), dst=other).wait()        # too long
        dist.isend(np.array([7], np.int64), dst=other, tag=5).wait()      # another tag first
        dist.isend(np.array([8], np.int64), dst=other).wait()
        return None
    w = dist.irecv(got, src=other)
    dist.send(got, dst=other)
    try:
        w.wait()
        err = "no error"
    except dist.Desync as e:
        err = str(e)
    dist.irecv(got, src=other).wait()
    eight = int(got[0])
    dist.irecv(got, src=other, tag=5).wait()
    return err, eight, int(got[0])


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_receives_waited_one_by_one_match_by_tag_and_size(transport):
    out = run_ranks(2, _waited_one_by_one, timeout=60, env={"ACCORD_TRANSPORT": transport})
    err, eight, seven = out[1]
    assert "16 bytes" in err and "holds 8 bytes" in err, err
    assert (eight, seven) == (8, 7)


def _bad_peers(rank, world):
    x = np.zeros(2)
    errs = []
    for call in (lambda: dist.isend(x, dst=world),
                 lambda: dist.irecv(x, src=-3),
                 lambda: dist.isend(x, dst=rank),
                 lambda: dist.irecv(x, src=(rank + 1) % world, tag=1.5),
                 lambda: dist.isend(x, dst=(rank + 1) % world, tag=1 << 70)):
        try:
            call()
            errs.append("none")
        except (ValueError, TypeError) as e:
            errs.append(type(e).__name__)
    sub = dist.new_group([0, 1])
    none = dist.isend(x, dst=0, group=sub) if rank == 2 else "member"
    return errs, none


def test_bad_peers_and_tags_fail_before_posting():
    out = run_ranks(3, _bad_peers, timeout=30)
    for rank, (errs, none) in enumerate(out):
        assert errs == ["ValueError", "ValueError", "ValueError", "TypeError", "ValueError"]
        assert none == (None if rank == 2 else "member")


def _peer_dies(rank, world):
    if rank == 2:
        time.sleep(0.3)
        os._exit(1)                    # dies with receives posted from it
    other = 1 - rank
    from_dead = dist.irecv(np.zeros(10), src=2)
    from_live = dist.irecv(got := np.zeros(10), src=other, tag=8)
    t0 = time.monotonic()
    try:
        from_dead.wait()
        dead = "no error"
    except dist.PeerLost as e:
        dead = ("PeerLost", "rank 2" in str(e), time.monotonic() - t0 < 10)
    dist.send(np.full(10, rank + 1.0), dst=other, tag=8)
    from_live.wait()
    return dead, got.tolist() == [other + 1.0] * 10


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_dead_peer_fails_only_its_receives(transport):
    out = run_ranks(3, _peer_dies, timeout=40, env={"ACCORD_TRANSPORT": transport},
                    expect_fail=True)
    for kind, payload in out[:2]:
        assert kind == "ok", payload
        assert payload == (("PeerLost", True, True), True)


def _unposted_large_send(rank, world, flag):
    # rank 1 has posted nothing for the large message and waits outside accord: its
    # engine may hold the single-copy message back a moment for a receive, but not
    # for ever, so rank 0's send completes (the message is kept until it is asked for)
    n = 16 << 20
    tiny = np.zeros(1, np.int32)
    if rank == 0:
        dist.send(tiny, dst=1)                    # both engines are running now
        w = dist.isend(np.full(n, 7, np.uint8), dst=1, tag=3, timeout=30)
        w.wait()
        with open(flag, "w") as f:
            f.write("sent")
        return "sent"
    dist.recv(tiny, src=0)
    end = time.monotonic() + 30
    while not os.path.exists(flag):
        assert time.monotonic() < end, "rank 0's send never completed"
        time.sleep(0.01)
    buf = np.zeros(n, np.uint8)
    dist.recv(buf, src=0, tag=3, timeout=30)
    return bool((buf == 7).all())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_large_send_completes_before_its_receive_is_posted(transport, tmp_path):
    out = run_ranks(2, _unposted_large_send, str(tmp_path / "flag"), timeout=40,
                    env={"ACCORD_TRANSPORT": transport})
    assert out == ["sent", True]


def _count_stashes():
    """From now on in this rank's process, the kind of every Stash made, in a list."""
    from accord.transport import matching
    made = []
    real = matching.Stash.__init__

    def counting(self, h, kind="stash"):
        made.append(kind)
        real(self, h, kind)
    matching.Stash.__init__ = counting
    return made


def _window_of_large_messages(rank, world):
    # osu_bw's pattern: a window of isends, matched by irecvs posted one by one. A
    # single-copy message that comes in before its irecv waits in the ring for it
    # (its bytes are still in the sender's memory) instead of being copied into a
    # stash and out again: count the stashed messages
    made = _count_stashes()
    n, win = 1 << 20, 16
    if rank == 0:
        data = np.arange(n // 4, dtype=np.float32)
        ws = [dist.isend(data, dst=1, tag=5) for _ in range(win)]
        for w in ws:
            w.wait()
        return None
    got = [np.zeros(n // 4, np.float32) for _ in range(win)]
    ws = [dist.irecv(g, src=0, tag=5) for g in got]
    for w in ws:
        w.wait()
    want = np.arange(n // 4, dtype=np.float32)
    return all(np.array_equal(g, want) for g in got), made.count("stash")


def test_a_window_of_single_copy_messages_is_not_stashed():
    # 1 MiB messages go single-copy only from a threshold that low (8 MiB by default)
    out = run_ranks(2, _window_of_large_messages, timeout=40,
                    env={"ACCORD_TRANSPORT": "shm", "ACCORD_SHM_P2P_CMA": "1M"})
    assert out[1] == (True, 0)


def _unasked_small_messages(rank, world):
    # rank 0's three small messages reach rank 1 while it waits for rank 2's: its wait
    # steps every link, but a whole message nobody asked for, in a ring with room,
    # stays there for its receive (no stash: no copy in and out again). Receiving the
    # third first then stashes the two before it, and every message arrives intact
    made = _count_stashes()
    # (every rank stays until the end: a peer that has left gets its ring read whole,
    # since what it sent before it went still counts)
    if rank == 0:
        for tag in (1, 2, 3):
            dist.send(np.full(16, tag, np.int32), dst=1, tag=tag)
        dist.barrier()
        dist.barrier()
        return None
    if rank == 2:
        dist.barrier()
        time.sleep(0.3)             # rank 1 waits for this meanwhile, stepping its links
        dist.send(np.full(4, 9, np.int32), dst=1, tag=7)
        dist.barrier()
        return None
    dist.barrier()                  # rank 0's messages are in rank 1's ring now
    got = np.zeros(4, np.int32)
    dist.recv(got, src=2, tag=7)
    before = made.count("stash")
    out = {}
    for tag in (3, 2, 1):
        buf = np.zeros(16, np.int32)
        dist.recv(buf, src=0, tag=tag)
        out[tag] = bool((buf == tag).all())
    dist.barrier()
    return bool((got == 9).all()), before, out, made.count("stash")


def test_a_small_message_nobody_asked_for_waits_in_the_ring():
    out = run_ranks(3, _unasked_small_messages, timeout=40, env={"ACCORD_TRANSPORT": "shm"})
    assert out[1] == (True, 0, {3: True, 2: True, 1: True}, 2)


def _ring_filling_up(rank, world):
    # rank 0 sends more than half of rank 1's ring, in whole messages, while rank 1
    # waits for rank 2's: the sends complete without any receive posted for them
    # (the ring is drained into the stash once it fills), and arrive in order
    n, count = 64 << 10, 24
    if rank == 0:
        ws = [dist.isend(np.full(n // 4, i, np.int32), dst=1, tag=4, timeout=20)
              for i in range(count)]
        for w in ws:
            w.wait()
        dist.send(np.ones(1, np.int32), dst=2, tag=8)
        return "sent"
    if rank == 2:
        dist.recv(np.zeros(1, np.int32), src=0, tag=8)
        dist.send(np.full(4, 9, np.int32), dst=1, tag=7)
        return None
    got = np.zeros(4, np.int32)
    dist.recv(got, src=2, tag=7, timeout=20)
    ok = []
    for i in range(count):
        buf = np.zeros(n // 4, np.int32)
        dist.recv(buf, src=0, tag=4)
        ok.append(bool((buf == i).all()))
    return all(ok)


def test_a_ring_filling_up_is_drained_so_the_sender_goes_on():
    out = run_ranks(3, _ring_filling_up, timeout=40, env={"ACCORD_TRANSPORT": "shm"})
    assert out[:2] == ["sent", True]
