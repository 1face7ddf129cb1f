"""Async collectives progress on the group's worker while the caller computes."""
import time

import numpy as np
import pytest

from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(60)


def _compute_while_pending(rank, world):
    import accord
    x = np.full(1 << 18, rank + 1.0, np.float32)            # 1 MiB
    if rank == 1:
        time.sleep(1.0)                                       # the peer is late
    w = accord.all_reduce(x, async_op=True)
    a = np.random.default_rng(0).standard_normal((128, 128))
    done_while_pending = 0
    while not w.is_completed():
        a = np.tanh(a @ a.T / 128)                            # the caller keeps working
        done_while_pending += 1
    w.wait()
    assert (x == 3.0).all()
    return done_while_pending


def test_caller_computes_while_async_all_reduce_waits_for_a_late_peer():
    counts = run_ranks(2, _compute_while_pending)
    assert counts[0] > 0          # rank 0 was never blocked by the call it issued


def _progress_without_wait(rank, world):
    import accord
    data = np.arange(1 << 20, dtype=np.float64) * (rank == 0)   # 8 MiB
    works = [accord.broadcast(data, src=0, async_op=True),
             accord.all_reduce(np.ones(4), async_op=True)]
    a = np.eye(64)
    deadline = time.monotonic() + 20
    while not all(w.is_completed() for w in works):       # no wait(): the worker moves bytes
        a = a @ a
        assert time.monotonic() < deadline, "async work made no progress without wait()"
    assert all(w.wait() for w in works)
    assert data[-1] == (1 << 20) - 1
    return True


def test_async_work_completes_without_wait():
    assert run_ranks(3, _progress_without_wait) == [True] * 3


def _sync_after_async(rank, world):
    import accord
    big = np.full(1 << 20, rank, np.float32)
    small = np.full(3, rank, np.int64)
    w = accord.all_reduce(big, async_op=True)
    accord.broadcast(small, src=1)           # queued behind the async one, same order everywhere
    assert w.is_completed()                  # issue order: the async one finished first
    assert (big == sum(range(world))).all() and (small == 1).all()
    return True


def test_sync_call_waits_behind_pending_async_in_issue_order():
    assert run_ranks(3, _sync_after_async) == [True] * 3
