"""coalescing(): small collectives queued in a block, flushed as a few bucketed ones."""
import numpy as np
import pytest

from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(90)


def _seq():
    import accord.world
    return accord.world.default_group()._seq


def _all_reduce(rank, world):
    import accord
    f32 = [np.full(5 + i % 4, rank + i, np.float32) for i in range(100)]
    f64 = [np.full((2, 3), rank * 0.5, np.float64) for _ in range(10)]
    strided = np.full((4, 6), rank, np.int64)[:, ::2]
    before = _seq()
    with accord.coalescing() as c:
        works = [accord.all_reduce(t, async_op=True) for t in f32]
        for t in f64:
            assert accord.all_reduce(t) is None
        accord.all_reduce(strided, op=accord.ReduceOp.MAX)
        assert _seq() == before                       # nothing sent yet
        assert not any(w.is_completed() for w in works)
        assert (f32[0] == rank).all()
    used = _seq() - before
    assert all(w.wait() for w in works)
    tot = sum(range(world))
    for i, t in enumerate(f32):
        assert (t == tot + world * i).all(), (i, t)
    assert all((t == tot * 0.5).all() for t in f64)
    assert (strided == world - 1).all()
    assert c.calls == 111 and c.collectives == used
    return used


def test_all_reduce_coalesced():
    # one bucket per dtype; the MAX call is a different key: a run of its own
    assert run_ranks(3, _all_reduce) == [3, 3, 3]


def _mixed(rank, world):
    import accord
    a = np.full(3, rank + 1.0)
    b = np.full(3, rank + 1.0)
    big = np.full(300, float(rank))               # 2400 B >= bucket: alone, in place
    small = [np.full(2, rank, np.int32) for _ in range(6)]
    before = _seq()
    with accord.coalescing(bucket_bytes=1000):
        accord.all_reduce(a)
        accord.all_reduce(a)                      # same tensor again: a new run
        accord.broadcast(b, src=1)
        accord.broadcast(big, src=1)
        for t in small:
            accord.reduce(t, dst=2, op=accord.ReduceOp.SUM)
    used = _seq() - before
    s = sum(r + 1.0 for r in range(world))
    assert (a == s * world).all()                 # as if run one after the other
    assert (b == 2.0).all() and (big == 1.0).all()
    want = sum(range(world)) if rank == 2 else rank
    assert all((t == want).all() for t in small)   # non-dst inputs untouched
    return used


def test_runs_keep_the_plain_calls_meaning():
    # all_reduce(a) | all_reduce(a) | broadcast b + broadcast big | one reduce bucket
    assert run_ranks(3, _mixed) == [5, 5, 5]


def _torch(rank, world):
    import torch
    import accord
    ts = [torch.full((4,), float(rank + i), dtype=torch.bfloat16) for i in range(8)]
    fs = [torch.full((3,), float(rank)) for _ in range(8)]
    p = torch.nn.Parameter(torch.full((2,), float(rank)))
    with accord.coalescing() as c:
        for t in ts + fs:
            accord.all_reduce(t, op=accord.ReduceOp.AVG)
        accord.broadcast(p, src=0)
    mean = sum(range(world)) / world
    for i, t in enumerate(ts):
        assert t.dtype == torch.bfloat16
        assert t.float().tolist() == [float(torch.tensor(mean + i).bfloat16())] * 4
    assert all(f.tolist() == [mean] * 3 for f in fs)
    assert p.tolist() == [0.0, 0.0] and p.requires_grad
    return c.collectives


def test_torch_tensors_bf16_coalesced():
    pytest.importorskip("torch")
    assert run_ranks(2, _torch) == [3, 3]


def _raises(rank, world):
    import accord
    t = np.full(2, rank, np.float64)
    w = None
    try:
        with accord.coalescing():
            w = accord.all_reduce(t, async_op=True)
            raise KeyError("boom")
    except KeyError:
        pass
    assert (t == rank).all()
    with pytest.raises(RuntimeError, match="raised KeyError"):
        w.wait()
    accord.all_reduce(t)                          # the group still works
    return t.tolist()


def test_block_that_raises_sends_nothing():
    assert run_ranks(2, _raises) == [[1.0, 1.0]] * 2


def _other_group(rank, world):
    import accord
    sub = accord.new_group([0, 1])
    x = np.full(1, rank, np.int64)
    y = np.full(1, rank, np.int64)
    with accord.coalescing(sub):
        accord.all_reduce(x, group=sub)           # queued on sub (non-members: None)
        accord.all_reduce(y)                      # default group: runs at once
        assert y[0] == sum(range(world))
    return int(x[0])


def test_only_the_blocks_group_is_queued():
    assert run_ranks(3, _other_group) == [1, 1, 2]


def _layouts(rank, world):
    import accord
    strided = rank % 2 == 1                       # ranks disagree on every tensor's layout

    def arr(shape, value):
        a = np.empty(shape[::-1]).T if strided else np.empty(shape)
        a[...] = value
        return a
    big_b = arr((40, 30), rank)                   # 9600 B >= bucket: a bucket of its own
    big_r = arr((30, 40), rank + 1.0)
    small = [arr((3, 4), rank * 10 + i) for i in range(4)]
    with accord.coalescing(bucket_bytes=4096) as c:
        accord.broadcast(big_b, src=1)
        for t in small:
            accord.broadcast(t, src=1)
        accord.all_reduce(big_r)
    assert (big_b == 1).all() and all((t == 10 + i).all() for i, t in enumerate(small))
    assert (big_r == sum(r + 1.0 for r in range(world))).all()
    return c.collectives


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_contiguous_and_strided_ranks_share_buckets(transport):
    # big broadcast | small broadcasts | big all_reduce, whatever each rank's layout
    assert run_ranks(3, _layouts, env={"ACCORD_TRANSPORT": transport}) == [3, 3, 3]


def _sync_block_fails(rank, world):
    import accord
    a = np.full(4 + rank, rank, np.float32)         # ranks disagree on the size
    b = np.full(2, rank, np.float64)
    with pytest.raises(accord.Desync) as info:
        with accord.coalescing():
            accord.all_reduce(a)                     # synchronous: exit runs the block
            w = accord.all_reduce(b, async_op=True)  # float64: the next bucket
    assert "ranks disagree" in str(info.value) and "all_reduce" in str(info.value)
    # the bucket after the failed one is not sent: its Work fails with the same error
    with pytest.raises(accord.Desync):
        w.wait()
    assert (a == rank).all() and (b == rank).all()
    return type(info.value).__name__


def test_failing_bucket_raises_from_the_block_on_every_rank():
    assert run_ranks(2, _sync_block_fails) == ["Desync", "Desync"]


def _after_exit(rank, world):
    import accord
    ts = [np.full(3, rank * 10 + i, np.int64) for i in range(5)]
    with accord.coalescing() as c:
        for t in ts:
            accord.broadcast(t, src=1)
        accord.all_reduce(ts[0])                     # the same tensor again: a new run
    # a synchronous block is done at exit: its Works are complete
    assert all(w.is_completed() for w in c.works)
    return [t.tolist() for t in ts], c.collectives


def test_synchronous_block_is_complete_at_exit():
    # the broadcast bucket, then the all_reduce of ts[0] (10 on both ranks: 20)
    want = ([[20] * 3] + [[10 + i] * 3 for i in range(1, 5)], 2)
    assert run_ranks(2, _after_exit) == [want, want]


def _empty_async_in_failing_block(rank, world):
    import accord
    a = np.full(4 + rank, rank, np.float32)          # ranks disagree on the size
    with pytest.raises(accord.Desync):
        with accord.coalescing():
            w = accord.all_reduce(np.empty(0, np.float32), async_op=True)   # no bytes
            accord.all_reduce(a)
    # the zero-size call's Work is settled too, with the block's error: no wait hangs
    with pytest.raises(accord.Desync):
        w.wait(timeout=10)
    return True


def test_zero_size_call_fails_with_the_block():
    assert run_ranks(2, _empty_async_in_failing_block) == [True, True]


def _bad_ops(rank, world):
    import accord
    f = np.ones(3, np.float32)
    i = np.ones(3, np.int64)
    with accord.coalescing() as c:
        accord.all_reduce(f, op=accord.ReduceOp.AVG)           # accepted: float
        with pytest.raises(TypeError, match="AVG needs a floating"):
            accord.all_reduce(i, op=accord.ReduceOp.AVG)       # the same op, an int dtype
        with pytest.raises(TypeError, match="BAND needs an integer"):
            accord.reduce(f, dst=0, op=accord.ReduceOp.BAND)
        accord.all_reduce(i, op=accord.ReduceOp.BAND)          # accepted: int
    assert c.calls == 2
    return f.tolist(), i.tolist()


def test_bad_op_dtype_pairs_raise_at_the_call_every_time():
    assert run_ranks(2, _bad_ops) == [([1.0] * 3, [1] * 3)] * 2


def _flushed_by_hand(rank, world):
    import accord
    a = np.full(4, rank + 1.0)
    with accord.coalescing() as c:
        accord.all_reduce(a, async_op=True)
        c.flush()                                    # sent now, on the worker thread
        accord.all_reduce(a)                         # the same tensor, run at exit
    return a.tolist()


def test_exit_waits_for_a_flush_by_hand_before_packing_its_tensors():
    # (1 + 2) summed twice over two ranks: 6, had the second packed after the first
    assert run_ranks(2, _flushed_by_hand) == [[6.0] * 4] * 2


def _flushed_twice(rank, world):
    import accord
    a = np.full(4, rank + 1.0)
    with accord.coalescing() as c:
        accord.all_reduce(a, async_op=True)
        c.flush()
        w = accord.all_reduce(a, async_op=True)      # the same tensor, flushed at exit
    w.wait()
    return a.tolist()


def test_a_second_flush_waits_for_the_first_before_packing_its_tensors():
    assert run_ranks(2, _flushed_twice) == [[6.0] * 4] * 2
