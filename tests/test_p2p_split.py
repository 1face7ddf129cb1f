"""Large single-copy messages between real processes, copied by the receiver and the
waiting sender at once (transport/split_message.py): ping-pongs, windows of isends,
messages nobody has asked for yet, and collectives' single-copy sends, at sizes on
and off the claim units; every byte checked, and the senders' help counted."""
import os

import numpy as np
import pytest

from harness import run_ranks

pytestmark = pytest.mark.timeout(120)

SPLIT = {"ACCORD_TRANSPORT": "shm", "ACCORD_SHM_P2P_CMA": "1M", "ACCORD_SHM_CMA": "1M"}
SIZES = [1 << 20, (3 << 20) + 123, (8 << 20) - 5]


def _count_help():
    """[messages this process's sends helped copy, split messages it received]."""
    from accord.transport import split_message
    assist, receive = split_message.assist, split_message.receive
    counts = [0, 0]

    def assisting(link, seq, src, n):
        hit = assist(link, seq, src, n)
        counts[0] += bool(hit)
        return hit

    def receiving(*args):
        counts[1] += 1
        return receive(*args)
    split_message.assist, split_message.receive = assisting, receiving
    return counts


def _data(n, i):
    return np.random.default_rng(n * 31 + i).integers(0, 256, n, np.uint8)


def _pingpong(rank, world, sizes, rounds):
    import accord as dist
    helped = _count_help()
    ok = True
    for n in sizes:
        buf = np.empty(n, np.uint8)
        for i in range(rounds):
            if rank == 0:
                want = _data(n, i)
                dist.send(want, 1)
                dist.recv(buf, 1)
                ok &= np.array_equal(buf, want[::-1])
            else:
                dist.recv(buf, 0)
                ok &= np.array_equal(buf, _data(n, i))
                dist.send(np.ascontiguousarray(buf[::-1]), 0)
    return bool(ok), helped


def test_a_ping_pong_of_large_messages_arrives_whole_and_senders_help():
    out = run_ranks(2, _pingpong, SIZES, 10, env=SPLIT)
    assert [o[0] for o in out] == [True, True]
    if len(os.sched_getaffinity(0)) < 2:
        # two ranks on one core: receivers copy alone (the help would take the core)
        assert [o[1] for o in out] == [[0, 0], [0, 0]]
        return
    # 30 messages each way, all split; each sender spinning on its acknowledgement,
    # some of them at least were copied by both sides
    assert [o[1][1] for o in out] == [30, 30]
    assert out[0][1][0] + out[1][1][0] > 0


def test_split_off_the_receiver_copies_alone():
    out = run_ranks(2, _pingpong, SIZES[1:2], 4, env={**SPLIT, "ACCORD_SHM_SPLIT": "0"})
    assert out == [(True, [0, 0]), (True, [0, 0])]


def _window(rank, world, n, win, late):
    import time

    import accord as dist
    counts = _count_help()
    if rank == 0:
        ws = [dist.isend(_data(n, i), dst=1, tag=i) for i in range(win)]
        for w in ws:
            w.wait()
        return True, 0
    if late:
        time.sleep(0.3)             # every message waits (deferred, then stashed)
    got = [np.empty(n, np.uint8) for _ in range(win)]
    # posted in the reverse order of their tags: the later ones are stashed first
    ws = [dist.irecv(got[i], src=0, tag=i) for i in reversed(range(win))]
    for w in ws:
        w.wait()
    return all(np.array_equal(got[i], _data(n, i)) for i in range(win)), counts[1]


@pytest.mark.parametrize("late", [False, True], ids=["posted", "late"])
@pytest.mark.parametrize("n", [2 << 20, (5 << 20) + 17])
def test_a_window_of_isends_arrives_whole(n, late):
    # every message split where each rank has a core (all six, posted or stashed)
    split = 6 if len(os.sched_getaffinity(0)) >= 2 else 0
    assert run_ranks(2, _window, n, 6, late, env=SPLIT) == [(True, 0), (True, split)]


def _collectives(rank, world, n):
    import accord as dist
    counts = _count_help()
    ok = []
    mine = _data(n, rank)
    # all_to_all_single: a single-copy message to every peer at once
    out = np.empty(world * n, np.uint8)
    dist.all_to_all_single(out, np.concatenate([_data(n, rank * 10 + p) for p in range(world)]))
    ok.append(all(np.array_equal(out[p * n:(p + 1) * n], _data(n, p * 10 + rank))
                  for p in range(world)))
    # scatter from rank 1 and gather to rank 0
    got = np.empty(n, np.uint8)
    dist.scatter(got, [_data(n, 100 + p) for p in range(world)] if rank == 1 else None, src=1)
    ok.append(np.array_equal(got, _data(n, 100 + rank)))
    bufs = [np.empty(n, np.uint8) for _ in range(world)] if rank == 0 else None
    dist.gather(mine, bufs, dst=0)
    if rank == 0:
        ok.append(all(np.array_equal(bufs[p], _data(n, p)) for p in range(world)))
    return ok, counts[1]


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_single_copy_sends(world):
    n = (2 << 20) + 4096 + 3
    out = run_ranks(world, _collectives, n, env=SPLIT)
    assert all(all(o[0]) for o in out), out
    # some went single-copy, split, where every rank has a core; with more ranks than
    # cores the receivers copy alone (the help would take a core another rank needs)
    split = sum(o[1] for o in out)
    if world <= len(os.sched_getaffinity(0)):
        assert split > 0
    else:
        assert split == 0


@pytest.mark.parametrize("op", ["pingpong", "window"])
def test_the_benchmark_runs_every_way(op):
    """benchmarks/p2p_split.py: ring, alone and split each deliver the bytes (the
    script fails where a block's do not) and report a time."""
    import re
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-m", "accord", "run", "-n", "2",
                          os.path.join(root, "benchmarks", "p2p_split.py"), "--sizes", "1M,3M",
                          "--rounds", "1", "--calls", "2", "--op", op],
                         capture_output=True, text=True, timeout=100, cwd=root)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    for n in (1 << 20, 3 << 20):
        for way in ("ring", "alone", "split"):
            assert re.search(rf"^\[rank 0\] {n} {way} \d+ \d+$", out.stdout, re.M), out.stdout


def _sender_dies_writing(rank, world, n):
    import signal
    import time
    import types

    import accord as dist
    from accord.transport import cma, split_message
    if rank == 0:
        # the sender dies inside its first write into the receiver's buffer, its busy
        # word up, once the receiver has copied everything and closed the message
        from accord.world import default_group

        def die_writing(*args):
            t = default_group().p2p.t
            word = t.links[1].o_coop.recv
            while t.q[word] & split_message.MASK != split_message.CLOSED:
                time.sleep(0.001)
            os.kill(os.getpid(), signal.SIGKILL)
        split_message.cma = types.SimpleNamespace(read=cma.read, write=die_writing)
        dist.send(_data(n, 0), 1)
        return "sent"
    # the receiver's first read waits, so that the sender is surely asked meanwhile
    first = [True]

    def slow_read(*args):
        if first[0]:
            first[0] = False
            time.sleep(0.3)
        cma.read(*args)
    split_message.cma = types.SimpleNamespace(read=slow_read, write=cma.write)
    got = np.empty(n, np.uint8)
    dist.recv(got, 0)
    whole = bool(np.array_equal(got, _data(n, 0)))
    # the next call that needs the dead rank says so
    try:
        dist.recv(got, 0)
    except dist.PeerLost as e:
        return whole, "PeerLost", str(e)
    return whole, "ok", ""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                    reason="two ranks on one core: the receiver copies alone, no sender writes")
def test_a_sender_killed_inside_its_write_leaves_the_receive_whole():
    out = run_ranks(2, _sender_dies_writing, 8 << 20, env=SPLIT, expect_fail=True,
                    timeout=60)
    assert out[0][0] == "died", out[0]
    kind, (whole, name, text) = out[1]
    assert (kind, whole, name) == ("ok", True, "PeerLost"), out[1]
    assert "rank 0" in text, text
