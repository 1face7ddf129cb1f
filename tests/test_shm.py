"""The shared-memory transport: the collective grid over it, streaming through a
small arena, single-copy on and off, 8 ranks on 2 cores, point-to-point,
mixed-host layouts, and cleanup of /dev/shm after exits, errors and SIGKILL."""
import os
import signal
import time

import numpy as np
import pytest

import accord as dist
from harness import run_ranks, shm_in_threads, spy_algorithms

pytestmark = pytest.mark.timeout(240)

SHM = {"ACCORD_TRANSPORT": "shm"}
# 16 KiB rings, no single-copy: every message above that streams through the ring
SMALL_ARENA = {**SHM, "ACCORD_SHM_ARENA": "64K", "ACCORD_SHM_CMA": "0"}
# single-copy from 4 KiB up
CMA_EARLY = {**SHM, "ACCORD_SHM_CMA": "4K"}


def _transport():
    from accord import world
    return world.default_group().transport


def _data(rank, n, dtype, salt=0):
    return ((np.arange(n) % 997) * (rank + 1) + rank + salt).astype(dtype)


def _grid(rank, world, sizes):
    """Every collective against a numpy reference; returns the transport's class name."""
    name = type(_transport()).__name__
    for n in sizes:
        for dt in (np.float32, np.int64):
            everyone = [_data(r, n, dt) for r in range(world)]
            for root in range(world):
                x = everyone[root].copy() if rank == root else np.zeros(n, dt)
                dist.broadcast(x, src=root)
                assert np.array_equal(x, everyone[root]), ("broadcast", n, root)
            x = everyone[rank].copy()
            dist.all_reduce(x)
            assert np.array_equal(x, np.sum(everyone, axis=0, dtype=dt)), ("all_reduce", n)
            x = everyone[rank].copy()
            dist.all_reduce(x, op=dist.ReduceOp.MAX)
            assert np.array_equal(x, np.max(everyone, axis=0)), ("all_reduce max", n)
            outs = [np.zeros(n, dt) for _ in range(world)]
            dist.all_gather(outs, everyone[rank])
            assert all(np.array_equal(o, e) for o, e in zip(outs, everyone)), ("all_gather", n)
            out = np.zeros(n * world, dt)
            dist.all_gather_into_tensor(out, everyone[rank])
            assert np.array_equal(out, np.concatenate(everyone)), ("all_gather_into", n)
            big = [_data(r, n * world, dt, 3) for r in range(world)]
            out = np.zeros(n, dt)
            dist.reduce_scatter_tensor(out, big[rank])
            assert np.array_equal(out, np.sum(big, axis=0, dtype=dt)[rank * n:(rank + 1) * n]), \
                ("reduce_scatter", n)
            root = world - 1
            x = everyone[rank].copy()
            dist.reduce(x, dst=root)
            if rank == root:
                assert np.array_equal(x, np.sum(everyone, axis=0, dtype=dt)), ("reduce", n)
            gl = [np.zeros(n, dt) for _ in range(world)] if rank == 0 else None
            dist.gather(everyone[rank], gl, dst=0)
            if rank == 0:
                assert all(np.array_equal(o, e) for o, e in zip(gl, everyone)), ("gather", n)
            pieces = [_data(r, n, dt, 7) for r in range(world)]
            x = np.zeros(n, dt)
            dist.scatter(x, pieces if rank == root else None, src=root)
            assert np.array_equal(x, pieces[rank]), ("scatter", n)
            src = [_data(r, n * world, dt, 11) for r in range(world)]
            out = np.zeros(n * world, dt)
            dist.all_to_all_single(out, src[rank])
            want = np.concatenate([src[p][rank * n:(rank + 1) * n] for p in range(world)])
            assert np.array_equal(out, want), ("all_to_all_single", n)
            dist.barrier()
    return name


SIZES = [0, 1, 7, 300_001]      # the last is 1.2 MB: larger than a small arena's rings


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_grid_over_shm(world):
    names = run_ranks(world, _grid, SIZES, env=SHM, timeout=150)
    assert set(names) == ({"ShmTransport"} if world > 1 else {names[0]})


@pytest.mark.parametrize("env", [SMALL_ARENA, CMA_EARLY], ids=["stream-small-arena", "cma-4k"])
def test_grid_streaming_and_single_copy(env):
    names = run_ranks(3, _grid, [1, 5000, 300_001], env=env, timeout=150)
    assert set(names) == {"ShmTransport"}


def test_eight_ranks_on_two_cores():
    t0 = time.monotonic()
    names = run_ranks(8, _grid, [0, 7, 40_001], env=SHM, timeout=200)
    assert set(names) == {"ShmTransport"}
    assert time.monotonic() - t0 < 180


def _p2p(rank, world):
    peer = 1 - rank
    # out-of-order tags: the first message waits in the stash
    if rank == 0:
        dist.send(np.arange(5, dtype=np.int32), dst=1, tag=1)
        dist.send(np.arange(3, dtype=np.int32), dst=1, tag=2)
    else:
        b = np.zeros(3, np.int32)
        a = np.zeros(5, np.int32)
        dist.recv(b, src=0, tag=2)
        dist.recv(a, src=0, tag=1)
        assert np.array_equal(a, np.arange(5)) and np.array_equal(b, np.arange(3))
    # both ranks send large messages to each other at once (must not deadlock)
    for n in (3 << 20, 100_003):
        mine = np.full(n, rank + 1, np.uint8)
        theirs = np.zeros(n, np.uint8)
        ws = dist.isend(mine, dst=peer)
        wr = dist.irecv(theirs, src=peer)
        ws.wait()
        wr.wait()
        assert (theirs == peer + 1).all()
        # and with blocking calls in the same order on both sides
        theirs[:] = 0
        w = dist.isend(mine, dst=peer)
        dist.recv(theirs, src=peer)
        w.wait()
        assert (theirs == peer + 1).all()
    # a collective message overtakes an awaited point-to-point one (the root of a
    # broadcast sends without waiting; rank 1 meets it while it waits for tag 9)
    x = np.full(4, rank + 1.0, np.float32)
    if rank == 1:
        got = np.zeros(2, np.float64)
        w = dist.irecv(got, src=0, tag=9)
        dist.broadcast(x, src=0)
        w.wait()
        assert np.array_equal(got, [1.5, 2.5])
    else:
        dist.broadcast(x, src=0)
        dist.send(np.array([1.5, 2.5]), dst=1, tag=9)
    assert np.array_equal(x, [1, 1, 1, 1])
    return True


@pytest.mark.parametrize("env", [SHM, SMALL_ARENA, CMA_EARLY], ids=["default", "small", "cma"])
def test_point_to_point(env):
    assert run_ranks(2, _p2p, env=env, timeout=90) == [True, True]


def _async_and_subgroups(rank, world):
    xs = [np.full(1000 + i, rank + i, np.float64) for i in range(6)]
    works = [dist.all_reduce(x, async_op=True) for x in xs]
    b = np.arange(70_000, dtype=np.float32) if rank == 0 else np.zeros(70_000, np.float32)
    wb = dist.broadcast(b, src=0, async_op=True)
    for w in works:
        w.wait()
    wb.wait()
    for i, x in enumerate(xs):
        assert (x == sum(r + i for r in range(world))).all()
    assert np.array_equal(b, np.arange(70_000, dtype=np.float32))
    evens = dist.new_group([r for r in range(world) if r % 2 == 0])
    odds = dist.new_group([r for r in range(world) if r % 2 == 1])
    mine = evens if rank % 2 == 0 else odds
    assert type(mine.transport).__name__ == "ShmTransport"
    y = np.full(3, rank, np.int64)
    dist.all_reduce(y, group=mine)
    assert (y == sum(r for r in range(world) if r % 2 == rank % 2)).all()
    sub, _ = dist.new_subgroups(2)
    z = np.full(5, rank, np.int64)
    w = dist.all_reduce(z, group=sub, async_op=True)
    w.wait()
    assert (z == (rank // 2) * 4 + 1).all()
    dist.barrier()
    return True


def test_async_ops_and_subgroups():
    assert run_ranks(4, _async_and_subgroups, env=SHM, timeout=90) == [True] * 4


# -- layouts over several (simulated) hosts ----------------------------------------

def _mixed(rank, world, layout, transport):
    os.environ["ACCORD_HOST_ID"] = layout[rank]
    os.environ["ACCORD_TRANSPORT"] = transport
    dist.init_process_group()
    try:
        default_kind = type(_transport()).__name__
        _grid(rank, world, [0, 7, 20_001])
        hosts = sorted(set(layout))
        groups = {h: dist.new_group([r for r in range(world) if layout[r] == h]) for h in hosts}
        g = groups[layout[rank]]
        x = np.full(9, rank, np.int64)
        dist.all_reduce(x, group=g)
        members = [r for r in range(world) if layout[r] == layout[rank]]
        assert (x == sum(members)).all()
        return default_kind, type(g.transport).__name__
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("layout", [["a", "a", "b", "b"], ["a", "a", "a", "b"],
                                    ["a", "b", "c", "a"]])
def test_mixed_host_layouts(layout):
    out = run_ranks(4, _mixed, layout, "auto", init=False, timeout=120)
    for rank, (default_kind, local_kind) in enumerate(out):
        assert default_kind == "TcpTransport"
        alone = layout.count(layout[rank]) == 1
        assert local_kind == ("TcpTransport" if alone else "ShmTransport")


def test_one_host_auto_picks_shm_and_tcp_forces_tcp():
    out = run_ranks(2, _mixed, ["h", "h"], "auto", init=False, timeout=60)
    assert out == [("ShmTransport", "ShmTransport")] * 2
    out = run_ranks(2, _mixed, ["h", "h"], "tcp", init=False, timeout=60)
    assert out == [("TcpTransport", "TcpTransport")] * 2


def _forced_shm_across_hosts(rank, world):
    os.environ["ACCORD_HOST_ID"] = f"host{rank % 2}"
    os.environ["ACCORD_TRANSPORT"] = "shm"
    try:
        dist.init_process_group()
    except ValueError as e:
        return str(e)
    dist.destroy_process_group()
    return "no error"


def test_forced_shm_across_hosts_is_a_clear_error():
    for msg in run_ranks(2, _forced_shm_across_hosts, init=False, timeout=60):
        assert "ACCORD_TRANSPORT=shm" in msg and "spans 2 hosts" in msg, msg


# -- cleanup and failures ------------------------------------------------------------

def _arena_path(rank, world, how):
    t = _transport()
    path = t.arena_path
    assert not os.path.exists(path), "the arena must be unlinked once every rank attached"
    x = np.ones(1 << 18, np.float32)
    dist.all_reduce(x)
    if how == "raise" and rank == 1:
        raise RuntimeError("boom")
    if how == "kill" and rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if how in ("raise", "kill"):
        t0 = time.monotonic()
        try:
            dist.all_reduce(x)
        except dist.PeerLost as e:
            return path, "PeerLost", str(e), time.monotonic() - t0
        return path, "ok", "", 0
    return path, "ok", "", 0


@pytest.mark.parametrize("how", ["normal", "raise", "kill"])
def test_no_dev_shm_leftovers(how):
    out = run_ranks(3, _arena_path, how, env=SHM, timeout=60, expect_fail=True)
    paths = {p[1][0] for p in out if p[0] == "ok"}
    assert len(paths) == 1
    path = paths.pop()
    assert path.startswith("/dev/shm/accord-") and len(os.path.basename(path)) > 30
    assert not os.path.exists(path)
    if how != "normal":
        for rank in (0, 2):
            kind, (_, err, msg, took) = out[rank]
            assert kind == "ok" and err == "PeerLost", out[rank]
            assert "rank 1" in msg and "all_reduce" in msg
            assert took < 6, f"PeerLost after {took:.1f}s"


def _killed_mid_stream(rank, world):
    x = np.ones(16 << 20, np.float32)       # 64 MiB: the kill lands mid-transfer
    dist.barrier()
    if rank == 2:
        import threading
        threading.Timer(0.02, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    t0 = time.monotonic()
    try:
        for _ in range(50):
            dist.all_reduce(x)
    except dist.PeerLost as e:
        return "PeerLost", str(e), time.monotonic() - t0
    return "ok", "", time.monotonic() - t0


@pytest.mark.parametrize("env", [SHM, SMALL_ARENA], ids=["default", "small"])
def test_sigkill_mid_collective_gives_peer_lost(env):
    out = run_ranks(3, _killed_mid_stream, env=env, timeout=60, expect_fail=True)
    assert out[2][0] == "died"
    for rank in (0, 1):
        kind, (err, msg, took) = out[rank]
        assert kind == "ok" and err == "PeerLost", out[rank]
        assert "rank 2" in msg
        assert took < 8


def test_a_crash_is_reported_before_a_departure_it_caused():
    # In-process ranks (threads). Rank 2 crashed; rank 1, which got its own PeerLost
    # from that, has already left the group; rank 0 still waits on rank 1 when its
    # liveness check runs. The crash is the cause: rank 0 names rank 2, not only that
    # rank 1 left (a three-rank SIGKILL test once got "rank 1 left the group" in CI).
    from accord.transport import shm
    from accord.transport.matching import Recv
    from accord.transport.wire import Stamp
    with shm_in_threads("crash-first", 3, arena_bytes=8 << 20) as (t0, t1, _):
        t1.q[(t1.rank_offset(1) + shm._R_DEPARTED) // 8] = 1      # rank 1 has left
        t0._dead_peers = lambda: {2}                              # rank 2's process is gone
        stamp = Stamp(2, 1, 0, 0, 0, 8, "uint8")
        waiting = Recv(1, memoryview(bytearray(8)), stamp=stamp)
        with pytest.raises(dist.PeerLost) as e:
            t0._check_peers([waiting], [], ())
        assert "rank 2" in str(e.value) and "died" in str(e.value), str(e.value)
        # with no crash, the departure is what rank 0 reports
        t0._dead_peers = lambda: set()
        with pytest.raises(dist.PeerLost, match="rank 1 left the group"):
            t0._check_peers([waiting], [], ())


def _desync(rank, world):
    x = np.zeros(4, np.float32)
    try:
        if rank == 0:
            dist.broadcast(x, src=0)
            dist.barrier()
        else:
            dist.all_reduce(x)
    except dist.Desync as e:
        return str(e)
    return "no error"


def test_desync_over_shm_names_both_sides():
    out = run_ranks(2, _desync, env=SHM, timeout=30)
    assert "broadcast" in out[1] and "all_reduce" in out[1], out[1]
    # rank 0 meets rank 1's all_reduce message itself, or hears of the desync from it
    assert "reported by rank 1" in out[0] or "all_reduce" in out[0], out[0]


def _timeout(rank, world):
    x = np.zeros(4, np.float32)
    if rank == 1:
        time.sleep(3)
        return "slept"
    t0 = time.monotonic()
    try:
        dist.all_reduce(x, timeout=1.0)
    except dist.CommTimeout as e:
        return str(e), time.monotonic() - t0
    return "no error"


def test_timeout_names_the_peer():
    out = run_ranks(2, _timeout, env=SHM, timeout=30, expect_fail=True)
    msg, took = out[0][1]
    assert "rank 1" in msg and 0.9 < took < 3


def test_arena_file_is_private(monkeypatch):
    """Mode 0600 and an unguessable name, checked on the file before it is unlinked."""
    from accord.transport import shm
    seen = []
    real = shm._unlink

    def spy(path):
        if os.path.exists(path):
            seen.append((path, os.stat(path).st_mode & 0o777))
        real(path)
    monkeypatch.setattr(shm, "_unlink", spy)
    with shm_in_threads("t", 2, arena_bytes=1 << 20) as members:
        assert None not in members
        path, mode = seen[0]
        assert mode == 0o600 and not os.path.exists(path)


def test_arena_size_is_bounded():
    from accord.transport.shm import (CHAN_MIN, P2P_CHAN_MIN, SLOT_ROOM_MAX, SLOT_ROOM_MIN,
                                      arena_layout, p2p_cap)
    for size in (2, 4, 8, 16):
        cap, room, total = arena_layout(size, 64 << 20)
        assert total <= 64 << 20 and cap >= CHAN_MIN and p2p_cap(cap) >= P2P_CHAN_MIN
        # shared slots beyond two ranks, at most an eighth of the arena in all
        assert room == (0 if size == 2 else min(SLOT_ROOM_MAX, (4 << 20) // size))
    # a small arena: both rings of each pair (collectives', point-to-point's) still fit,
    # and no slots where a piece would be smaller than SLOT_ROOM_MIN
    cap, room, total = arena_layout(2, 128 << 10)
    assert CHAN_MIN <= cap < 64 << 10 and total <= 128 << 10 and room == 0
    assert arena_layout(4, 4 << 20)[1] == SLOT_ROOM_MIN and arena_layout(4, 2 << 20)[1] == 0


def _no_room(rank, world):
    from accord.transport import shm
    if rank == 1:
        def refuse(path):
            raise OSError(28, "No space left on device (simulated)")
        shm._attach = refuse
    os.environ["ACCORD_TRANSPORT"] = os.environ["WANT_TRANSPORT"]
    try:
        dist.init_process_group()
    except OSError as e:
        return "error", str(e)
    try:
        x = np.full(3, rank + 1, np.int64)
        dist.all_reduce(x)
        return type(_transport()).__name__, int(x[0])
    finally:
        dist.destroy_process_group()


def test_auto_falls_back_to_tcp_together_when_shm_fails_on_one_rank():
    out = run_ranks(3, _no_room, env={"WANT_TRANSPORT": "auto"}, init=False, timeout=60)
    assert out == [("TcpTransport", 6)] * 3
    out = run_ranks(3, _no_room, env={"WANT_TRANSPORT": "shm"}, init=False, timeout=60)
    assert all(kind == "error" and "rank 1" in msg and "No space" in msg for kind, msg in out), out


def _fork_child_exits(rank, world):
    x = np.full(4, rank + 1, np.int64)
    dist.all_reduce(x)
    pid = os.fork()
    if pid == 0:
        # a child that leaves through atexit (accord's hook closes the groups it inherited)
        import atexit
        atexit._run_exitfuncs()
        os._exit(0)
    os.waitpid(pid, 0)
    if rank == 0:
        time.sleep(1.5)     # rank 1 sleeps meanwhile, checking on its peers
    dist.all_reduce(x)
    return int(x[0])


def test_forked_child_exit_does_not_leave_the_parents_group():
    assert run_ranks(2, _fork_child_exits, env=SHM, timeout=60) == [6, 6]


def _ring_of_isends(rank, world, n):
    right, left = (rank + 1) % world, (rank - 1) % world
    got = np.zeros(n, np.float64)
    ws = dist.isend(np.full(n, float(rank)), dst=right, tag=7, timeout=20)
    wr = dist.irecv(got, src=left, tag=7, timeout=20)
    ws.wait()
    wr.wait()
    assert (got == left).all()
    # blocking sends first, then receives: works because a waiting sender reads its peers
    dist.send(np.full(n, float(rank)), dst=right)
    dist.recv(got, src=left)
    assert (got == left).all()
    return True


@pytest.mark.parametrize("env", [SHM, SMALL_ARENA, CMA_EARLY], ids=["default", "small", "cma"])
def test_ring_of_large_isends(env):
    assert run_ranks(3, _ring_of_isends, (1 << 19) + 3, env=env, timeout=60) == [True] * 3


# -- headers from peers are checked before they are believed ------------------------------

def _corrupt_header(rank, world, what):
    from accord.transport.wire import HEADER, P2P
    t = _transport().p2p         # the point-to-point plane's rings, which recv reads
    if rank == 0:
        payload = b""
        if what == "huge":
            # claims half a terabyte of payload that never comes
            header = HEADER.pack(P2P, 10, 0, 0, -1, 5, -1, 1 << 39)
        elif what == "pad":
            # a pad (the rest of the ring is empty) that stops short of the ring's end
            payload = bytes(100)
            header = HEADER.pack(0x20, 0, 0, 0, -1, 0, -1, len(payload))
        else:
            header = HEADER.pack(77, 0, 0, 0, -1, 0, -1, 0)       # no such message kind
        assert t.links[1].write_inline(header, payload, len(payload))
        time.sleep(1.5)
        return None
    import resource
    got = np.zeros(4, np.int32)
    t0 = time.monotonic()
    try:
        dist.recv(got, src=0, tag=1, timeout=1.0)
    except dist.AccordError as e:
        err = type(e).__name__, str(e)
    else:
        err = "ok", ""
    return err, time.monotonic() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


@pytest.mark.parametrize("what", ["huge", "kind", "pad"])
def test_corrupt_headers_are_errors_not_allocations(what):
    out = run_ranks(2, _corrupt_header, what, env=SHM, timeout=30)
    (name, msg), took, maxrss_kib = out[1]
    if what == "huge":
        # the message waits in the stash, which holds only what actually arrived
        assert name == "CommTimeout", msg
        assert maxrss_kib < 1 << 20, f"{maxrss_kib} KiB"
    else:
        assert name == "PeerLost" and "corrupt message header" in msg, msg
        assert ("unknown message kind 77" if what == "kind" else
                "a ring pad that does not reach the ring's end") in msg and "rank 0" in msg
        assert took < 1.0


# -- single-copy broadcasts (algorithms/single_copy.py) ---------------------------------------

def _pair_broadcast(rank, world):
    from accord.algorithms.single_copy import COOP_MIN
    with spy_algorithms("broadcast") as names:
        for nbytes in (COOP_MIN, 3 * COOP_MIN + 5, 1000):
            for root in (0, 1):
                want = (np.arange(nbytes) % 251).astype(np.uint8)
                x = want.copy() if rank == root else np.zeros(nbytes, np.uint8)
                dist.broadcast(x, src=root)
                assert np.array_equal(x, want), (nbytes, root)
                assert (x[:nbytes // 2] == want[:nbytes // 2]).all()
        # a view into a larger array, with an offset that is not page-aligned
        base = np.zeros(COOP_MIN + 4099, np.uint8)
        view = base[3:-7]
        if rank == 0:
            view[:] = 7
        dist.broadcast(view, src=0)
        assert (view == 7).all() and base[:3].sum() == 0 and base[-7:].sum() == 0
        # both ranks think they are the root: each reads the other's stamp (without the
        # fast path, both only send until messages this large fill the rings; then each
        # finds the other's stamp at the head of its incoming ring)
        x = np.zeros(COOP_MIN, np.uint8)
        t0 = time.monotonic()
        with pytest.raises(dist.Desync, match="root"):
            dist.broadcast(x, src=rank, timeout=10)
        assert time.monotonic() - t0 < 5
    return [name == "single_copy" for name in names]


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("env", [SHM, {**SHM, "ACCORD_SHM_CMA": "0"}], ids=["cma", "no-cma"])
def test_large_broadcast_splits_the_copy(env, world):
    # world 2: the receiver reads one half while the root writes the other; more ranks:
    # the root writes into each receiver from the back while each reads from the front
    out = run_ranks(world, _pair_broadcast, env=env, timeout=90)
    for ran in out:
        # both ranks take the same path: both halves of the copy, or the plain one
        want = [True] * 4 if env.get("ACCORD_SHM_CMA") != "0" else [False] * 4
        assert ran[:7] == want + [False, False] + want[:1], ran


def _pair_broadcast_from_a_mib(rank, world):
    from accord.algorithms.single_copy import COOP_MIN_PAIR
    with spy_algorithms("broadcast") as names:
        for nbytes in (COOP_MIN_PAIR - 1, COOP_MIN_PAIR, COOP_MIN_PAIR + 4096 + 3):
            for root in (0, 1):
                want = (np.arange(nbytes) % 253).astype(np.uint8)
                x = want.copy() if rank == root else np.zeros(nbytes, np.uint8)
                dist.broadcast(x, src=root)
                assert np.array_equal(x, want), (nbytes, root)
    return list(names), dist.world.default_group().transport.cma_min


def test_two_ranks_split_a_broadcast_from_a_mib():
    # from COOP_MIN_PAIR two ranks each copy a half (below it: the plain path) where the
    # single-copy threshold allows it; unset, the threshold is measured (1 or 4 MiB)
    for env in ({**SHM, "ACCORD_SHM_CMA": "1M"}, SHM, {**SHM, "ACCORD_SHM_CMA": "2M"}):
        out = run_ranks(2, _pair_broadcast_from_a_mib, env=env, timeout=60)
        assert out[0][1] == out[1][1], out
        if "ACCORD_SHM_CMA" in env:
            assert out[0][1] == {"1M": 1 << 20, "2M": 2 << 20}[env["ACCORD_SHM_CMA"]]
        split = out[0][1] <= 1 << 20
        for names, _ in out:
            assert [n == "single_copy" for n in names] == \
                [False, False] + [split] * 4, (env, names)


# -- receiving from any source over shared memory (small, single-copy, streamed) -------------

def _any_source(rank, world, n):
    if rank == 0:
        got = {}
        for _ in range(world - 1):
            buf = np.zeros(n, np.int32)
            peer = dist.recv(buf, tag=5, timeout=20)
            assert (buf == peer).all(), (peer, buf[:4])
            got[peer] = True
        # a message that arrived before the receive was posted (it waits in the stash)
        dist.barrier()
        buf = np.zeros(n, np.int32)
        peer = dist.recv(buf, tag=6, timeout=20)
        assert peer == world - 1 and (buf == 100).all()
        return sorted(got)
    if rank == 2:
        time.sleep(0.2)         # rank 1's message comes first; neither may land twice
    dist.send(np.full(n, rank, np.int32), dst=0, tag=5)
    if rank == world - 1:
        dist.send(np.full(n, 100, np.int32), dst=0, tag=6)
    dist.barrier()
    return None


@pytest.mark.parametrize("env,n", [(SHM, 3), (SHM, 300_001), (SMALL_ARENA, 300_001)],
                         ids=["small", "cma", "streamed"])
def test_receive_from_any_source(env, n):
    out = run_ranks(3, _any_source, n, env=env, timeout=60)
    assert out[0] == [1, 2]


def test_point_to_point_has_its_own_single_copy_threshold():
    from accord.options import Options
    assert Options.from_env({}).shm_cma_min is None     # measured per group (1 or 4 MiB)
    assert Options.from_env({}).shm_p2p_cma_min is None  # the transport's default
    # ACCORD_SHM_CMA alone sets both; ACCORD_SHM_P2P_CMA only point-to-point's
    both = Options.from_env({"ACCORD_SHM_CMA": "4K"})
    assert (both.shm_cma_min, both.shm_p2p_cma_min) == (4 << 10, 4 << 10)
    off = Options.from_env({"ACCORD_SHM_CMA": "0"})
    assert (off.shm_cma_min, off.shm_p2p_cma_min) == (0, 0)
    own = Options.from_env({"ACCORD_SHM_CMA": "4K", "ACCORD_SHM_P2P_CMA": "2M"})
    assert (own.shm_cma_min, own.shm_p2p_cma_min) == (4 << 10, 2 << 20)
    with pytest.raises(ValueError, match="ACCORD_SHM_P2P_CMA must be a byte count"):
        Options.from_env({"ACCORD_SHM_P2P_CMA": "lots"})


def test_how_a_rank_waits_depends_on_ranks_per_core():
    from accord.transport.waiting import SPIN_ACK_US, SPIN_US, YIELD_US, YIELDS, wait_policy
    # a core each: spin, then sleep
    assert wait_policy(2, 2) == (SPIN_US * 1e-6, SPIN_ACK_US * 1e-6, 0, 0.0)
    assert wait_policy(8, 16) == (SPIN_US * 1e-6, SPIN_ACK_US * 1e-6, 0, 0.0)
    # some core holds a rank alone: yield a few times and for a while (its core would
    # go idle if it slept)
    assert wait_policy(3, 2) == (0.0, 0.0, YIELDS, YIELD_US * 1e-6)
    assert wait_policy(7, 4) == (0.0, 0.0, YIELDS, YIELD_US * 1e-6)
    # every core shared: yield a few times only, and leave the core to its other rank
    assert wait_policy(4, 2) == (0.0, 0.0, YIELDS, 0.0)
    assert wait_policy(8, 2) == (0.0, 0.0, YIELDS, 0.0)


def _wait_for_slow_peer(rank, world, pause):
    # three ranks on two cores: the waiters yield for a while, then must sleep
    os.sched_setaffinity(0, {0, 1})
    dist.init_process_group()
    window = _transport()._yield_s
    x = np.full(4, rank + 1.0)
    dist.barrier()
    if rank == 1:
        time.sleep(pause)
    c0, t0 = time.process_time(), time.monotonic()
    dist.all_reduce(x)
    cpu, wall = time.process_time() - c0, time.monotonic() - t0
    dist.destroy_process_group()
    return window, x.tolist(), cpu, wall


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or not {0, 1} <= os.sched_getaffinity(0),
                    reason="needs CPUs 0 and 1")
def test_three_ranks_on_two_cores_wait_for_a_slow_peer_asleep():
    pause = 0.5
    res = run_ranks(3, _wait_for_slow_peer, pause, env=SHM, init=False, timeout=60)
    for rank, (window, x, cpu, wall) in enumerate(res):
        assert window > 0, "3 ranks on 2 cores: the yield window should apply"
        assert x == [6.0] * 4
        if rank != 1:
            assert wall > pause / 2             # it did wait for rank 1
            # the window is microseconds: a waiter that kept spinning through the
            # pause would burn most of it
            assert cpu < pause / 5, f"rank {rank} burned {cpu:.3f} s of CPU waiting"


def test_point_to_point_single_copy_while_crowded_depends_on_ranks_per_core():
    from accord.transport.shm import SHM_P2P_CMA_DEFAULT, p2p_cma_crowded
    from accord.transport.wire import HEADER_SIZE
    pcap = 1 << 20
    # a core each, however many run: the ring up to 8 MiB (both processes copy at once)
    assert p2p_cma_crowded(2, pcap, 2) is None
    assert p2p_cma_crowded(4, pcap, 8) is None
    # more ranks than cores: while more run than there are cores, what does not fit
    # whole in the ring goes single-copy
    for size in (3, 4, 8):
        k = p2p_cma_crowded(size, pcap, 2)
        assert k == pcap - HEADER_SIZE + 1
        assert k - 1 + HEADER_SIZE == pcap          # the largest message that fits whole
    assert p2p_cma_crowded(4, 64 << 20, 2) == SHM_P2P_CMA_DEFAULT    # never above 8 MiB


def test_a_rank_asleep_in_a_collective_does_not_count_as_running():
    """A collective call's sleep is written in its rank block; the point-to-point plane
    counts the ranks that run (_crowded) from those words, against its cores."""
    import threading

    from accord.transport.shm import p2p_cma_crowded
    from accord.transport.waiting import usable_cores
    with shm_in_threads("crowd", 4, arena_bytes=8 << 20) as members:
        p = members[0].p2p
        want = p2p_cma_crowded(4, p.cap, usable_cores())
        assert p.crowded_cma_min == (1 << 62 if want is None else want)
        p.ncpu = 2                      # as on a machine of two cores
        assert p._crowded()             # four running
        sleepers = []
        for t in members[2:]:
            expected = t.i32[t._doorbell_i]
            sleepers.append(threading.Thread(target=t._doze, args=(expected, 0.6)))
        for th in sleepers:
            th.start()
        time.sleep(0.2)
        crowded_while_asleep = p._crowded()         # two running, on two cores
        for th in sleepers:
            th.join()
        assert not crowded_while_asleep
        assert p._crowded()             # awake again: four running
        members[1].p2p.ncpu = 4         # a core for each of the four running
        assert not members[1].p2p._crowded()
