"""Mismatched calls raise a Desync on every involved rank that names each side's call."""
import time

import numpy as np
import pytest

import accord as dist
from harness import run_ranks

pytestmark = pytest.mark.timeout(120)
HERE = "test_desync.py:"


@pytest.fixture(params=["tcp", "shm"])
def env(request):
    """Every test runs over both transports: the messages must not depend on the wire."""
    return {"ACCORD_TRANSPORT": request.param}


def _timed(fn):
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:
        return type(e).__name__, str(e), time.monotonic() - t0
    return "ok", "", time.monotonic() - t0


def _errors(out):
    res = []
    for kind, payload in out:
        assert kind == "ok", payload
        res.append(payload)
    return res


def _different_ops(rank, world):
    x = np.arange(4, dtype=np.float32)
    if rank == 0:
        return _timed(lambda: (dist.all_reduce(x), dist.barrier()))
    return _timed(lambda: (dist.broadcast(x, src=1), dist.barrier()))


def test_different_ops_name_both_calls_and_lines(env):
    for name, msg, took in _errors(run_ranks(2, _different_ops, timeout=30, env=env,
                                             expect_fail=True)):
        assert name == "Desync", msg
        assert "all_reduce #0" in msg and "broadcast #0" in msg
        assert msg.count(HERE) >= 2, msg
        assert took < 5


def _different_dtypes(rank, world):
    x = np.ones(4, np.float32 if rank == 0 else np.int32)      # same byte count
    return _timed(lambda: (dist.all_reduce(x), dist.barrier()))


def test_different_dtypes(env):
    for name, msg, took in _errors(run_ranks(2, _different_dtypes, timeout=30, env=env,
                                             expect_fail=True)):
        assert name == "Desync", msg
        assert "float32" in msg and "int32" in msg and "all_reduce #0" in msg


def _different_roots(rank, world):
    x = np.full(4, rank, np.float32)
    # every rank thinks it is the root: each only sends, nothing is read in the call
    first = _timed(lambda: dist.broadcast(x, src=rank))
    second = _timed(lambda: dist.barrier())
    return first, second


def test_different_roots_both_roots_send_only(env):
    for rank, (first, second) in enumerate(_errors(run_ranks(2, _different_roots, timeout=30,
                                                             env=env, expect_fail=True))):
        # the first message either side reads is the other's broadcast: Desync at once
        errs = [e for e in (first, second) if e[0] != "ok"]
        assert errs and errs[0][0] == "Desync", (first, second)
        msg = errs[0][1]
        assert "broadcast #0" in msg and "root 1" in msg or "root rank 1" in msg, msg
        assert "root 0" in msg or "root rank 0" in msg, msg
        assert HERE in msg
        assert errs[0][2] < 5


def _large_different_roots(rank, world):
    # larger than any socket buffer or ring: both "roots" block sending to each other
    x = np.full(16 << 20, rank, np.uint8)
    return _timed(lambda: dist.broadcast(x, src=rank, timeout=20))


def test_large_broadcast_with_two_roots_is_a_desync_not_a_timeout(env):
    for name, msg, took in _errors(run_ranks(2, _large_different_roots, timeout=40, env=env,
                                             expect_fail=True)):
        assert name == "Desync", msg
        assert "root 0" in msg or "root rank 0" in msg, msg
        assert "root 1" in msg or "root rank 1" in msg, msg
        assert took < 5, took


def _roots_three(rank, world):
    x = np.full(4, rank, np.float32)
    src = 2 if rank == 2 else 0
    return _timed(lambda: (dist.broadcast(x, src=src), dist.all_reduce(x), dist.barrier()))


def test_different_roots_three_ranks_every_rank_raises(env):
    res = _errors(run_ranks(3, _roots_three, timeout=30, env=env, expect_fail=True))
    for name, msg, took in res:
        assert name == "Desync", msg
        assert took < 5
    assert any("root 2" in m or "root rank 2" in m for _, m, _ in res)


def _forgot_group(rank, world):
    g = dist.new_group([0, 1])
    x = np.ones(4, np.float32)
    if rank == 0:
        return _timed(lambda: (dist.broadcast(x, src=0, group=g), dist.barrier()))
    return _timed(lambda: (dist.broadcast(x, src=0), dist.barrier()))   # forgot group=g


def test_forgotten_group_is_a_desync_on_both_ranks(env):
    for name, msg, took in _errors(run_ranks(2, _forgot_group, timeout=30, env=env,
                                             expect_fail=True)):
        assert name == "Desync", msg
        assert "broadcast #0" in msg and "barrier #0" in msg
        assert took < 5


def _skipper(rank, world):
    x = np.ones(4, np.float32)
    dist.barrier()
    if rank == world - 1:
        time.sleep(3.0)        # "forgot" the all_reduce; the others time out
        return _timed(lambda: dist.barrier())
    return _timed(lambda: dist.all_reduce(x, timeout=1.0))


def test_stuck_rank_report_names_who_never_entered(env):
    res = _errors(run_ranks(3, _skipper, timeout=30, env=env, expect_fail=True))
    for rank in (0, 1):
        name, msg, took = res[rank]
        assert name == "CommTimeout", msg
        assert "rank 2 never entered all_reduce #1" in msg, msg
        assert "ranks 0, 1 are waiting in it" in msg or "ranks 0\u20131" in msg, msg
        assert "last completed barrier #0" in msg
        assert took < 4
    name, msg, _ = res[2]
    assert name == "CommTimeout" and "reported by" in msg and "never entered" in msg


def _cross_groups(rank, world):
    g = dist.new_group([0, 1])
    x = np.ones(4, np.float32)
    if rank == 0:
        out = _timed(lambda: (dist.all_reduce(x, group=g, timeout=1.5), dist.all_reduce(x)))
    else:
        out = _timed(lambda: (dist.all_reduce(x, timeout=1.5), dist.all_reduce(x, group=g)))
    time.sleep(1.0)     # leave no earlier than the other rank's timeout
    return out


def test_collectives_in_different_group_orders_are_explained(env):
    for name, msg, took in _errors(run_ranks(2, _cross_groups, timeout=30, env=env,
                                             expect_fail=True)):
        assert name == "CommTimeout", msg
        assert "busy in all_reduce #0" in msg and "in group" in msg, msg
