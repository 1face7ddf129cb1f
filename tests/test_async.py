"""async_op=True: Work handles, issue order, waiting with a timeout, errors through Work."""
import concurrent.futures
import datetime
import threading
import time

import numpy as np
import pytest

import accord as dist
from harness import run_ranks

pytestmark = pytest.mark.timeout(60)


def _many_outstanding(rank, world):
    done = []
    lock = threading.Lock()
    works, checks = [], []

    def track(i, w):
        fut = w.get_future()
        assert isinstance(fut, concurrent.futures.Future)
        fut.add_done_callback(lambda f, i=i: (lock.acquire(), done.append(i), lock.release()))
        works.append(w)

    n = 100_003                               # big enough to take a while on 2 cores
    for i in range(12):
        kind = i % 4
        if kind == 0:
            x = np.full(n, rank + i, np.int64)
            track(i, dist.all_reduce(x, async_op=True))
            checks.append((x, np.full(n, sum(range(world)) + world * i, np.int64)))
        elif kind == 1:
            root = i % world
            x = np.arange(n, dtype=np.float32) + i if rank == root else np.zeros(n, np.float32)
            track(i, dist.broadcast(x, src=root, async_op=True))
            checks.append((x, np.arange(n, dtype=np.float32) + i))
        elif kind == 2:
            out = np.zeros(world * 5, np.int32)
            track(i, dist.all_gather_into_tensor(out, np.full(5, rank * i, np.int32),
                                                 async_op=True))
            checks.append((out, np.repeat(np.arange(world, dtype=np.int32) * i, 5)))
        else:
            track(i, dist.barrier(async_op=True))
    # a synchronous call issued now waits its turn behind all of them
    y = np.array([rank], np.int64)
    dist.all_reduce(y)
    assert y[0] == sum(range(world))
    assert all(w.is_completed() for w in works), "sync call returned before earlier async work"
    for w in works:
        assert w.wait() is True and w.exception() is None
    assert done == sorted(done), f"async work completed out of issue order: {done}"
    for got, want in checks:
        assert np.array_equal(got, want)
    return True


@pytest.mark.parametrize("world", [1, 2, 4])
def test_outstanding_async_ops_complete_in_issue_order(world):
    run_ranks(world, _many_outstanding, timeout=40)


def _waited_last_first(rank, world):
    # the last Work waited on first: the waiting thread runs every queued call before
    # it, in issue order (where the worker thread has not taken them), as the worker would
    order = []
    works, outs = [], []
    for i in range(6):
        x = np.full(1000, rank * 10 + i, np.int64)
        w = dist.all_reduce(x, async_op=True)
        w.get_future().add_done_callback(lambda f, i=i: order.append(i))
        works.append(w)
        outs.append(x)
    for w in reversed(works):
        assert w.wait() is True
    want = [sum(r * 10 + i for r in range(world)) for i in range(6)]
    got = [int(x[0]) for x in outs]
    bad = None
    # ranks disagree on the op: the Work waited on carries the Desync, raised by wait()
    w = (dist.all_gather_into_tensor(np.zeros(8), np.zeros(4), async_op=True, timeout=10)
         if rank == 0 else dist.all_reduce(np.zeros(4), async_op=True, timeout=10))
    try:
        w.wait()
    except dist.Desync as e:
        bad = type(e).__name__
    return order, got == want, bad


def test_async_calls_waited_last_first_run_in_issue_order():
    out = run_ranks(2, _waited_last_first, timeout=40, expect_fail=True)
    for kind, payload in out:
        assert kind == "ok", payload
        order, right, bad = payload
        assert order == list(range(6)) and right, payload
        assert bad == "Desync", payload


def _wait_timeout(rank, world):
    x = np.full(3, rank, np.int64)
    if rank != 0:
        time.sleep(0.8)                       # rank 0's broadcast cannot finish before
    w = dist.broadcast(x, src=1, async_op=True)
    if rank == 0:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            w.wait(timeout=0.2)
        assert 0.15 < time.monotonic() - t0 < 0.7
        assert not w.is_completed()
        with pytest.raises(TimeoutError):
            w.wait(timeout=datetime.timedelta(milliseconds=50))
        # a Work.wait timeout only stops waiting: the operation goes on and completes
    assert w.wait(timeout=datetime.timedelta(seconds=20)) is True
    assert w.is_completed() and w.exception() is None
    assert x.tolist() == [1, 1, 1]
    assert w.get_future().result() is None
    x = np.array([1.5])
    dist.all_reduce(x)
    assert x[0] == 1.5 * world
    return True


def test_wait_with_timeout():
    run_ranks(3, _wait_timeout, timeout=30)


def _error_through_work(rank, world):
    g = dist.new_group([0, 1])
    if rank in (0, 1):
        # the two ranks disagree about the collective: both Works must carry the error
        if rank == 0:
            w = dist.all_gather_into_tensor(np.zeros(8), np.zeros(4), group=g, async_op=True,
                                            timeout=10)
        else:
            w = dist.all_reduce(np.zeros(4), group=g, async_op=True, timeout=10)
        exc = w.exception(timeout=15)
        assert isinstance(exc, dist.AccordError), repr(exc)
        with pytest.raises(dist.AccordError):
            w.wait()
        assert w.is_completed()
    # the world group is untouched by the broken subgroup
    x = np.array([rank])
    dist.all_reduce(x)
    assert x[0] == sum(range(world))
    return True


def test_error_is_delivered_through_work():
    run_ranks(3, _error_through_work, timeout=40)


def _async_everything(rank, world):
    """Every collective with async_op=True returns a Work whose wait() puts data in place."""
    ws = []
    a = np.array([rank + 1.0])
    ws.append(dist.all_reduce(a, op=dist.ReduceOp.PRODUCT, async_op=True))
    b = np.zeros(2, np.int8) if rank else np.array([5, 6], np.int8)
    ws.append(dist.broadcast(b, 0, async_op=True))
    outs = [np.zeros(r + 1, np.int16) for r in range(world)]
    ws.append(dist.all_gather(outs, np.full(rank + 1, rank, np.int16), async_op=True))
    gl = [np.zeros(1) for _ in range(world)] if rank == 0 else None
    ws.append(dist.gather(np.array([rank * 2.0]), gl, dst=0, async_op=True))
    s = np.zeros(1, np.uint64)
    ws.append(dist.scatter(s, [np.array([r], np.uint64) for r in range(world)]
                           if rank == world - 1 else None, src=world - 1, async_op=True))
    r_ = np.array([rank], np.int32)
    ws.append(dist.reduce(r_, dst=0, async_op=True))
    rs = np.zeros(1, np.float64)
    ws.append(dist.reduce_scatter(rs, [np.array([float(j)]) for j in range(world)],
                                  async_op=True))
    rst = np.zeros(1, np.float64)
    ws.append(dist.reduce_scatter_tensor(rst, np.arange(world, dtype=np.float64),
                                         op=dist.ReduceOp.AVG, async_op=True))
    a2 = [np.zeros(1, np.int64) for _ in range(world)]
    ws.append(dist.all_to_all(a2, [np.array([10 * rank + j]) for j in range(world)],
                              async_op=True))
    a2s = np.zeros(world, np.int64)
    ws.append(dist.all_to_all_single(a2s, np.arange(world) + 10 * rank, async_op=True))
    ws.append(dist.barrier(async_op=True))
    for w in ws:
        assert isinstance(w, dist.Work)
        assert w.wait() is True
    import math
    assert a[0] == math.factorial(world)
    assert b.tolist() == [5, 6]
    assert [o.tolist() for o in outs] == [[r] * (r + 1) for r in range(world)]
    if rank == 0:
        assert [g[0] for g in gl] == [2.0 * r for r in range(world)]
        assert r_[0] == sum(range(world))
    else:
        assert r_[0] == rank
    assert s[0] == rank
    assert rs[0] == world * rank and rst[0] == rank
    assert [v[0] for v in a2] == [10 * j + rank for j in range(world)]
    assert a2s.tolist() == [10 * j + rank for j in range(world)]
    return True


@pytest.mark.parametrize("world", [1, 3])
def test_every_collective_async(world):
    run_ranks(world, _async_everything, timeout=30)


def _threads(rank, world):
    """Two threads issuing on two different groups do not block each other."""
    g = dist.new_group(list(range(world)))
    res = {}

    def worker(name, group, n):
        x = np.full(n, rank, np.int64)
        for _ in range(20):
            dist.all_reduce(x, group=group)
            x //= world
        res[name] = x

    t = threading.Thread(target=worker, args=("g", g, 1000))
    t.start()
    worker("world", None, 50_000)
    t.join(20)
    assert not t.is_alive()
    want = sum(range(world)) // world
    assert (res["g"] == want).all() and (res["world"] == want).all()
    return True


def test_two_groups_from_two_threads():
    run_ranks(3, _threads, timeout=40)


def _op_timeout_through_work(rank, world):
    g = dist.new_group([0, 1])
    if rank == 0:
        # rank 1 never joins: the operation's own CommTimeout must come through wait()
        # as it is (naming the peer), not be mistaken for wait()'s own timeout
        w = dist.all_reduce(np.zeros(4), group=g, async_op=True, timeout=0.5)
        with pytest.raises(dist.CommTimeout) as info:
            w.wait()
        assert "rank 1" in str(info.value) and "within None" not in str(info.value), \
            str(info.value)
        assert isinstance(w.exception(), dist.CommTimeout)
    x = np.array([rank])
    dist.all_reduce(x)
    assert x[0] == sum(range(world))
    return True


def test_operation_timeout_is_reraised_by_wait():
    run_ranks(2, _op_timeout_through_work, timeout=30)


def _per_call_timeout(rank, world):
    g = dist.new_group([0, 1])
    h = dist.new_group([0, 1])
    if rank == 0:
        # rank 1 never joins these: each call fails after its own timeout, not the group's
        t0 = time.monotonic()
        with pytest.raises(dist.CommTimeout):
            dist.broadcast(np.zeros(3), src=1, group=g, timeout=0.5)
        assert 0.4 < time.monotonic() - t0 < 5
        t0 = time.monotonic()
        with pytest.raises(dist.CommTimeout):
            dist.recv(np.zeros(3), src=1, group=h, timeout=datetime.timedelta(seconds=0.5))
        assert 0.4 < time.monotonic() - t0 < 5
    x = np.array([rank + 1])
    dist.all_reduce(x)
    assert x[0] == world * (world + 1) // 2
    return True


def test_per_call_timeout():
    run_ranks(2, _per_call_timeout, timeout=30)

