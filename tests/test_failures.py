"""Failures reach every rank as errors that say who and what, never as hangs."""
import os
import signal
import time

import numpy as np
import pytest

import accord as dist
from harness import run_ranks, timed as _timed

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(params=["tcp", "shm"])
def transport(request):
    """Run over both transports: what a user sees must not depend on the wire."""
    return {"ACCORD_TRANSPORT": request.param}


def _exit_before_allreduce(rank, world, how):
    dist.barrier()
    if rank == world - 1:
        time.sleep(0.3)      # let the others leave the barrier first
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(3)          # no goodbye: a crash as far as the peers can tell
    x = np.ones(1 << 16, np.float32)
    first = _timed(lambda: dist.all_reduce(x))
    later = _timed(lambda: dist.barrier())
    return first, later


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_dead_peer_raises_peer_lost_naming_it_quickly(how, transport):
    out = run_ranks(3, _exit_before_allreduce, how, timeout=60, env=transport, expect_fail=True)
    assert out[2][0] == "died"
    for rank in (0, 1):
        kind, (first, later) = out[rank]
        assert kind == "ok"
        name, msg, took = first
        assert name == "PeerLost", first
        assert "rank 2" in msg and "all_reduce" in msg
        assert took < 10, f"PeerLost took {took:.1f}s (timeout is 60s)"
        # the group is broken now: later calls fail at once
        assert later[0] == "GroupClosed", later
        assert later[2] < 1.0


def _killed_mid_collective(rank, world):
    x = np.ones(8 << 20, np.float32)
    dist.barrier()
    if rank == 1:
        # die while the others are inside a large all_reduce with this rank
        import threading
        threading.Timer(0.05, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
        while True:
            dist.all_reduce(x)
    return _timed(lambda: [dist.all_reduce(x) for _ in range(1000)])


def test_sigkill_inside_a_collective(transport):
    out = run_ranks(3, _killed_mid_collective, timeout=60, env=transport, expect_fail=True)
    assert out[1][0] == "died"
    for rank in (0, 2):
        kind, (name, msg, took) = out[rank]
        assert kind == "ok" and name == "PeerLost", out[rank]
        assert "rank 1" in msg
        assert took < 10


def _killed_mid_state_sync(rank, world, victim):
    # buckets over 4 MiB: over shared memory the root writes into receivers' memory
    # and they read out of its (the split single copy)
    state = {f"w{i}": np.full(1 << 20, rank, np.float32) for i in range(12)}
    dist.barrier()
    if rank == victim:
        import threading
        threading.Timer(0.05, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
        while True:
            dist.broadcast_state(state, src=0)
    return _timed(lambda: [dist.broadcast_state(state, src=0) for _ in range(1000)])


@pytest.mark.parametrize("victim", [0, 2], ids=["root", "receiver"])
def test_sigkill_inside_broadcast_state(transport, victim):
    out = run_ranks(3, _killed_mid_state_sync, victim, timeout=60, env=transport,
                    expect_fail=True)
    assert out[victim][0] == "died"
    for rank in {0, 1, 2} - {victim}:
        kind, (name, msg, took) = out[rank]
        assert kind == "ok" and name == "PeerLost", out[rank]
        assert f"rank {victim}" in msg, msg
        assert took < 10


def _different_collectives(rank, world):
    x = np.arange(4, dtype=np.float32)
    if rank == 0:
        dist.broadcast(x, src=0)
    else:
        first = _timed(lambda: dist.all_reduce(x))
        return first
    return _timed(lambda: dist.barrier())


def test_different_collectives_raise_desync_on_both_ranks(transport):
    out = run_ranks(2, _different_collectives, timeout=30, env=transport, expect_fail=True)
    name1, msg1, _ = out[1][1]
    assert name1 == "Desync", out[1]
    assert "all_reduce #0" in msg1 and "broadcast #0" in msg1 and "rank 0" in msg1
    name0, msg0, took = out[0][1]
    assert name0 == "Desync", out[0]
    # rank 0 either reads rank 1's all_reduce message itself or rank 1's report of it
    assert "reported by rank 1" in msg0 or ("barrier #1" in msg0 and "all_reduce #0" in msg0)
    assert took < 5


def _different_sizes(rank, world):
    x = np.ones(10 + rank, np.float64)
    return _timed(lambda: dist.all_reduce(x))


def test_different_sizes_raise_desync(transport):
    out = run_ranks(2, _different_sizes, timeout=30, env=transport, expect_fail=True)
    for rank in (0, 1):
        name, msg, took = out[rank][1]
        assert name == "Desync", out[rank]
        assert "all_reduce #0" in msg
        assert "80 bytes" in msg or "88 bytes" in msg
        assert took < 5


def _slow_peer(rank, world):
    x = np.ones(4, np.float32)
    if rank == 1:
        time.sleep(2.0)
        # rank 0's data may already be here, so this all_reduce can still succeed;
        # the next call must then report rank 0's timeout
        return _timed(lambda: (dist.all_reduce(x), dist.barrier())), None
    first = _timed(lambda: dist.all_reduce(x, timeout=0.5))
    later = _timed(lambda: dist.all_reduce(x))
    return first, later


def test_per_call_timeout_names_the_peer_and_breaks_the_group(transport):
    out = run_ranks(2, _slow_peer, timeout=30, env=transport, expect_fail=True)
    (name, msg, took), later = out[0][1]
    assert name == "CommTimeout", out[0]
    assert "rank 1" in msg and "all_reduce #0" in msg
    assert 0.4 < took < 2.0
    assert later[0] == "GroupClosed" and "CommTimeout" in later[1]
    # the slow rank learns why instead of waiting for its own timeout
    name1, msg1, took1 = out[1][1][0]
    assert name1 == "CommTimeout" and "reported by rank 0" in msg1
    assert took1 < 5


def _timeout_is_also_a_timeout_error(rank, world):
    if rank == 0:
        try:
            dist.barrier(timeout=0.3)
        except TimeoutError as e:
            return isinstance(e, dist.AccordError)
        return "no error"
    time.sleep(1.0)
    return None


def test_comm_timeout_is_a_timeout_error(transport):
    out = run_ranks(2, _timeout_is_also_a_timeout_error, timeout=30, env=transport,
                    expect_fail=True)
    assert out[0] == ("ok", True)
