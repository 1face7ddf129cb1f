"""The lean path of small synchronous calls (accord/lane.py) against the api's general path.

A rank on the lane and a rank on the general path must be the same call on the wire
(same stamp), so every test mixes the two: one rank passes plain contiguous numpy
arrays (the lane), the other the same call in a form the lane declines (a
non-contiguous view, async_op=True).
"""
import numpy as np
import pytest

import accord
from accord.world import resolve_group

from harness import run_ranks

pytestmark = pytest.mark.timeout(120)

HERE = "test_lane.py:"


def _general(x):
    """x's values in an array the lane declines (a strided view), and the view."""
    big = np.zeros(x.size * 2, x.dtype)
    v = big[::2]
    v[...] = x
    return v


def _spy_on_lane():
    """The list each call the lane is offered appends True (taken) or False to (this
    runs in a forked child: the patch dies with it)."""
    from accord import lane
    taken, run = [], lane.Lane._run

    def spy(self, *args):
        done = run(self, *args)
        taken.append(done)
        return done
    lane.Lane._run = spy
    return taken


def _mixed(rank, world, numel):
    lane_rank = 0 if numel % 2 else 1      # the lane on the root, then on a non-root
    on_lane = rank == lane_rank
    out = {}
    taken = _spy_on_lane()

    x = np.arange(numel, dtype=np.float32) + 10 * rank
    b = x.copy() if on_lane else _general(x)
    accord.broadcast(b, src=0)
    out["broadcast"] = np.array(b).tolist()

    r = x.copy() if on_lane else _general(x)
    if on_lane:
        accord.all_reduce(r, op=accord.ReduceOp.MAX)
    else:
        accord.all_reduce(r, op=accord.ReduceOp.MAX, async_op=True).wait()
    out["all_reduce"] = np.array(r).tolist()

    if on_lane:
        outs = [np.empty(numel, np.float32) for _ in range(world)]
        accord.all_gather(outs, x, timeout=30)     # a timeout of its own: still the lane
    else:
        outs = [_general(np.empty(numel, np.float32)) for _ in range(world)]
        accord.all_gather(outs, x)
    out["all_gather"] = [np.array(o).tolist() for o in outs]

    mine = np.empty(numel, np.float32)
    shards = [np.full(numel, 100 + p, np.float32) for p in range(world)] if rank == 0 else None
    if on_lane:
        accord.scatter(mine, shards, src=0)
    else:
        view = _general(mine)
        accord.scatter(view, shards, src=0, async_op=True).wait()
        mine = np.array(view)
    out["scatter"] = mine.tolist()

    if on_lane:
        accord.barrier()
    else:
        accord.barrier(async_op=True).wait()
    g = resolve_group(None)
    done = [e[1] for e in list(g.recorder.entries)[-5:]]
    out["recorded"] = done
    out["lane"] = taken
    return out


@pytest.mark.parametrize("world,numel,transport", [(2, 2, "shm"), (2, 3, "shm"), (2, 2, "tcp"),
                                                   (3, 2, "shm"), (4, 1000, "shm"),
                                                   (3, 3, "tcp")])
def test_lane_and_general_path_are_the_same_call(world, numel, transport):
    results = run_ranks(world, _mixed, numel, timeout=60, env={"ACCORD_TRANSPORT": transport})
    base = np.arange(numel, dtype=np.float32)
    for rank, out in enumerate(results):
        assert out["broadcast"] == base.tolist()
        assert out["all_reduce"] == (base + 10 * (world - 1)).tolist()
        assert out["all_gather"] == [(base + 10 * p).tolist() for p in range(world)]
        assert out["scatter"] == [100.0 + rank] * numel
        assert out["recorded"] == ["broadcast", "all_reduce", "all_gather", "scatter",
                                   "barrier"]
        lane_rank = 0 if numel % 2 else 1
        assert out["lane"] == ([True] * 5 if rank == lane_rank else []), out["lane"]


def _large_all_gather(rank, world, numel):
    """An all_gather of numel float32 a rank, on the lane on rank 0 (its input being its
    own block of the output: in place) and on the general path elsewhere."""
    taken = _spy_on_lane()
    outs = [np.zeros(numel, np.float32) for _ in range(world)]
    outs[rank][...] = np.arange(numel, dtype=np.float32) * (rank + 1)
    if rank == 0:
        accord.all_gather(outs, outs[rank])
        # and a separate input: copied into its block
        again = [np.zeros(numel, np.float32) for _ in range(world)]
        accord.all_gather(again, outs[rank].copy())
    else:
        accord.all_gather(outs, _general(outs[rank]))
        again = [_general(np.zeros(numel, np.float32)) for _ in range(world)]
        accord.all_gather(again, outs[rank].copy())
    return ([float(o.sum(dtype=np.float64)) for o in outs],
            [float(np.array(o).sum(dtype=np.float64)) for o in again], taken)


@pytest.mark.parametrize("world,numel", [(2, 65536), (3, 300000)])
def test_lane_all_gather_of_any_size_in_place_or_not(world, numel):
    total = float(np.arange(numel, dtype=np.float64).sum())
    for rank, (got, again, taken) in enumerate(run_ranks(world, _large_all_gather, numel)):
        assert got == again == [total * (p + 1) for p in range(world)]
        assert taken == ([True, True] if rank == 0 else []), taken


def _into_tensor(rank, world, numel):
    """all_gather_into_tensor on the lane on rank 0 (a separate input, then its own block
    of the output: in place), on the general path elsewhere (a strided output)."""
    taken = _spy_on_lane()
    x = np.arange(numel, dtype=np.float32) * (rank + 1)
    if rank == 0:
        out = np.zeros(numel * world, np.float32)
        accord.all_gather_into_tensor(out, x)
        again = np.zeros(numel * world, np.float32)
        again[:numel] = x
        accord.all_gather_into_tensor(again, again[:numel])
    else:
        out = _general(np.zeros(numel * world, np.float32))
        accord.all_gather_into_tensor(out, x)
        again = _general(np.zeros(numel * world, np.float32))
        accord.all_gather_into_tensor(again, x)
    return np.array(out).tolist(), np.array(again).tolist(), taken


@pytest.mark.parametrize("world,numel", [(2, 3), (3, 5), (4, 70000)])
def test_all_gather_into_tensor_on_the_lane_beside_the_general_path(world, numel):
    want = np.concatenate([np.arange(numel, dtype=np.float32) * (p + 1)
                           for p in range(world)]).tolist()
    for rank, (out, again, taken) in enumerate(run_ranks(world, _into_tensor, numel)):
        assert out == want and again == want
        assert taken == ([True, True] if rank == 0 else []), taken


def _into_tensor_wrong_size(rank, world):
    taken = _spy_on_lane()
    try:
        accord.all_gather_into_tensor(np.zeros(5, np.float32), np.zeros(2, np.float32))
    except ValueError as e:
        err = str(e)
    out = np.zeros(2 * world, np.float32)
    accord.all_gather_into_tensor(out, np.full(2, rank, np.float32))
    return err, out.tolist(), taken


def test_all_gather_into_tensor_of_the_wrong_size_is_the_apis_error():
    for rank, (err, out, taken) in enumerate(run_ranks(2, _into_tensor_wrong_size)):
        assert "output_tensor: must hold group size (2) x input_tensor's 2 elements, " \
               "holds 5" in err, err
        assert out == [0.0, 0.0, 1.0, 1.0]
        assert taken == [True], taken        # the bad call declined before it ran


def _reduce_scatter_mixed(rank, world, numel, dtype, op_name):
    """reduce_scatter_tensor on the lane on rank 0 (twice: the input stays as it was),
    on the general path elsewhere (a strided output)."""
    taken = _spy_on_lane()
    op = getattr(accord.ReduceOp, op_name)
    x = (np.arange(numel * world) + 10 * rank).astype(dtype)
    before = x.copy()
    outs = []
    for _ in range(2):
        if rank == 0:
            out = np.zeros(numel, dtype)
            accord.reduce_scatter_tensor(out, x, op=op)
        else:
            out = _general(np.zeros(numel, dtype))
            accord.reduce_scatter_tensor(out, x, op=op)
        outs.append(np.array(out).tolist())
    return outs, bool(np.array_equal(x, before)), taken


@pytest.mark.parametrize("world,numel,dtype,op_name", [(2, 3, "float32", "SUM"),
                                                       (3, 4, "int64", "MAX"),
                                                       (3, 5, "float64", "AVG"),
                                                       (4, 40000, "float32", "SUM")])
def test_reduce_scatter_tensor_on_the_lane_beside_the_general_path(world, numel, dtype,
                                                                   op_name):
    inputs = [(np.arange(numel * world) + 10 * r).astype(dtype) for r in range(world)]
    if op_name == "SUM":
        want = np.sum(inputs, axis=0, dtype=dtype)
    elif op_name == "MAX":
        want = np.max(inputs, axis=0)
    else:
        want = np.mean(inputs, axis=0)
    results = run_ranks(world, _reduce_scatter_mixed, numel, dtype, op_name)
    for rank, (outs, untouched, taken) in enumerate(results):
        mine = want[rank * numel:(rank + 1) * numel].tolist()
        assert outs == [mine, mine]
        assert untouched
        assert taken == ([True, True] if rank == 0 else []), taken


def _reduce_scatter_bad(rank, world):
    taken = _spy_on_lane()
    errors = []
    for out, inp, op in [(np.zeros(2, np.float32), np.zeros(5, np.float32), accord.ReduceOp.SUM),
                         (np.zeros(2, np.bool_), np.zeros(4, np.bool_), accord.ReduceOp.AVG)]:
        try:
            accord.reduce_scatter_tensor(out, inp, op=op)
        except (ValueError, TypeError) as e:
            errors.append(f"{type(e).__name__}: {e}")
    out = np.zeros(2, np.float32)
    accord.reduce_scatter_tensor(out, np.full(4, rank + 1, np.float32))
    return errors, out.tolist(), taken


def test_reduce_scatter_tensor_bad_input_is_the_apis_error():
    for errors, out, taken in run_ranks(2, _reduce_scatter_bad):
        assert len(errors) == 2, errors
        assert errors[0].startswith("ValueError: input: must hold group size (2) x "
                                    "output's 2 elements, holds 5"), errors[0]
        assert errors[1].startswith("TypeError: op: ReduceOp.AVG needs a floating or complex "
                                    "dtype, got bool"), errors[1]
        assert out == [3.0, 3.0]
        assert taken == [True], taken       # the bad calls declined before they ran


def _scatter_lane_result(rank, world):
    mine = np.zeros(3, np.int64)
    shards = [np.full(3, 7 * p, np.int64) for p in range(world)] if rank == 1 else None
    accord.scatter(mine, shards, src=1)
    return mine.tolist()


def test_scatter_on_the_lane_from_another_root():
    assert run_ranks(3, _scatter_lane_result) == [[0] * 3, [7] * 3, [14] * 3]


def _lane_desync(rank, world):
    x = np.ones(2, np.float32)
    try:
        if rank == 0:
            accord.broadcast(x, src=0)          # the lane
            accord.barrier()
        else:
            accord.all_reduce(_general(x), async_op=True).wait()     # the general path
    except accord.Desync as e:
        return str(e)
    return None


def test_desync_between_lane_and_general_path_names_both_lines():
    for kind, msg in run_ranks(2, _lane_desync, timeout=60, expect_fail=True):
        assert kind == "ok" and msg is not None, msg
        assert "broadcast #0" in msg and "all_reduce #0" in msg, msg
        assert msg.count(HERE) >= 2, msg


def _bad_input(rank, world):
    x = np.ones(2, np.float32)
    x.flags.writeable = False
    errors = []
    for call in (lambda: accord.broadcast(x, src=0 if rank else 1),     # read-only receiver
                 lambda: accord.broadcast(np.ones(2, np.float32), src=5),
                 lambda: accord.all_reduce(np.ones(2, np.complex64), op=accord.ReduceOp.MAX),
                 lambda: accord.all_gather([np.empty(2, np.float32)], np.ones(2, np.float32))):
        try:
            call()
        except (ValueError, TypeError) as e:
            errors.append(f"{type(e).__name__}: {e}")
    # nothing moved: the group still works, on the lane
    y = np.full(2, rank + 1.0, np.float32)
    accord.all_reduce(y)
    return errors, y.tolist()


def test_bad_input_is_the_general_paths_error_and_nothing_breaks():
    for errors, y in run_ranks(2, _bad_input):
        assert len(errors) == 4, errors
        assert "read-only" in errors[0]
        assert "src=5" in errors[1]
        assert "MAX is undefined for complex" in errors[2]
        assert "expected 2 tensors" in errors[3]
        assert y == [3.0, 3.0]


def _order_behind_async(rank, world):
    a = np.full(1000, rank + 1.0, np.float32)
    w = accord.all_reduce(a, async_op=True)
    b = np.full(2, 5.0 * rank, np.float32)
    accord.broadcast(b, src=1)       # queued behind the async call, not beside it
    w.wait()
    return a[0], b.tolist()


def test_a_sync_call_after_an_async_one_keeps_issue_order():
    for total, b in run_ranks(2, _order_behind_async):
        assert total == 3.0 and b == [5.0, 5.0]


def _lane_state(rank, world):
    return resolve_group(None).lane is not None


def test_no_lane_under_debug_detail():
    assert run_ranks(2, _lane_state, env={"ACCORD_DEBUG": "DETAIL"}) == [False, False]
    assert run_ranks(2, _lane_state) == [True, True]


def _lost_peer(rank, world):
    import os
    import time
    x = np.ones(2, np.float32)
    accord.barrier()
    if rank == 1:
        os._exit(0)
    time.sleep(0.5)
    t0 = time.monotonic()
    try:
        accord.all_reduce(x)
    except accord.PeerLost as e:
        return str(e), time.monotonic() - t0
    return None, 0


def test_a_lost_peer_on_the_lane_is_peer_lost_naming_the_call():
    kind, payload = run_ranks(2, _lost_peer, timeout=60, expect_fail=True)[0]
    assert kind == "ok", payload
    msg, took = payload
    assert msg is not None and "all_reduce #1" in msg and "rank 1" in msg, msg
    assert took < 10


def _torch_mixed(rank, world):
    import torch
    taken = _spy_on_lane()
    on_lane = rank == 0
    x = torch.arange(3, dtype=torch.float64) + rank
    if not on_lane:
        x = torch.zeros(6, dtype=torch.float64)[::2].copy_(x)       # a strided view
    accord.all_reduce(x)
    y = torch.full((2, 2), float(rank), dtype=torch.int32)
    accord.broadcast(y, src=1)
    z = torch.ones(2, dtype=torch.bfloat16) * (rank + 1)            # bfloat16 ...
    if not on_lane:
        z = torch.zeros(4, dtype=torch.bfloat16)[::2].copy_(z)     # ... strided: the api's
    accord.all_reduce(z)
    w = torch.tensor([1.0, 3.0], dtype=torch.bfloat16) * (rank + 1)
    accord.all_reduce(w, op=accord.ReduceOp.AVG)                  # on the lane on both
    return x.tolist(), y.tolist(), z.tolist(), w.tolist(), taken


def test_torch_tensors_on_the_lane_beside_the_general_path():
    pytest.importorskip("torch")
    res = run_ranks(2, _torch_mixed)
    for rank, (x, y, z, w, taken) in enumerate(res):
        assert x == [1.0, 3.0, 5.0]
        assert y == [[1, 1], [1, 1]]
        assert z == [3.0, 3.0]
        assert w == [1.5, 4.5]
        # rank 0: every call on the lane (its bfloat16 ones too); rank 1: its strided views
        # went the api's way, its broadcast and its contiguous bfloat16 AVG the lane's
        assert taken == ([True] * 4 if rank == 0 else [True, True]), taken


def _all_to_all_mixed(rank, world, rows, uneven):
    """all_to_all_single and all_to_all on the lane on rank 0 (twice: the input stays
    as it was) and on the general path elsewhere (strided outputs, async_op=True);
    uneven: splits of rows of 2 int64 that differ by pair."""
    taken = _spy_on_lane()
    if uneven:
        # counts[r][p]: rows from rank r to rank p (none from rank 1 to rank 0 at world 2)
        counts = [[1, 2], [0, 3]] if world == 2 else \
            [[r + p + 1 for p in range(world)] for r in range(world)]
        send = counts[rank]
        recv = [counts[q][rank] for q in range(world)]
    else:
        send = recv = [rows // world] * world
    inp = np.concatenate([np.full((k, 2), 100 * rank + p, np.int64)
                          for p, k in enumerate(send)])
    before = inp.copy()
    results = []
    for _ in range(2):
        sizes = (recv, send) if uneven else (None, None)
        if rank == 0:
            out = np.full((sum(recv), 2), -1, np.int64)
            accord.all_to_all_single(out, inp, *sizes)
        else:
            out = _general(np.full(sum(recv) * 2, -1, np.int64)).reshape(sum(recv), 2)
            accord.all_to_all_single(out, inp, *sizes, async_op=True).wait()
        results.append(np.array(out)[:, 0].tolist())
    ins = [np.full(3 + p, 10 * rank + p, np.float64) for p in range(world)]
    if rank == 0:
        outs = [np.zeros(3 + rank, np.float64) for _ in range(world)]
        accord.all_to_all(outs, ins)
    else:
        outs = [_general(np.zeros(3 + rank, np.float64)) for _ in range(world)]
        accord.all_to_all(outs, ins, async_op=True).wait()
    lists = [np.array(o).tolist() for o in outs]
    g = resolve_group(None)
    recorded = [e[1] for e in list(g.recorder.entries)[-3:]]
    return results, bool(np.array_equal(inp, before)), lists, recorded, recv, taken


@pytest.mark.parametrize("world,rows,uneven", [(2, 2, False), (2, 0, True), (3, 6, False),
                                               (3, 0, True), (4, 8000, False)])
def test_all_to_all_on_the_lane_beside_the_general_path(world, rows, uneven):
    for rank, (results, untouched, lists, recorded, recv, taken) in enumerate(
            run_ranks(world, _all_to_all_mixed, rows, uneven)):
        want = [100 * q + rank for q, k in enumerate(recv) for _ in range(k)]
        assert results == [want, want]
        assert untouched
        assert lists == [[10.0 * q + rank] * (3 + rank) for q in range(world)]
        assert recorded == ["all_to_all"] * 3
        assert taken == ([True] * 3 if rank == 0 else []), taken


def _all_to_all_bad(rank, world):
    taken = _spy_on_lane()
    errors = []
    x = np.zeros(4, np.float32)
    for call in (lambda: accord.all_to_all_single(np.zeros(3, np.float32), x),
                 lambda: accord.all_to_all_single(np.zeros(4, np.float64), x),
                 lambda: accord.all_to_all_single(np.zeros(4, np.float32), x, [1, 3], [3, 1]),
                 lambda: accord.all_to_all_single(np.zeros(4, np.float32), x, [2, 2.0]),
                 lambda: accord.all_to_all([np.zeros(2, np.float32)] * 2,
                                           [np.zeros(3, np.float32)] * 2)):
        try:
            call()
            errors.append("no error")
        except (ValueError, TypeError) as e:
            errors.append(f"{type(e).__name__}: {e}")
    out = np.zeros(4, np.float32)
    accord.all_to_all_single(out, np.full(4, rank + 1, np.float32))
    return errors, out.tolist(), taken


def test_all_to_all_bad_input_is_the_apis_error():
    for rank, (errors, out, taken) in enumerate(run_ranks(2, _all_to_all_bad)):
        assert errors[0].startswith("ValueError: output: first dimension 3 is not divisible"), \
            errors[0]
        assert errors[1].startswith("TypeError:"), errors[1]
        assert errors[2].startswith("ValueError: output_split_sizes/input_split_sizes: this "
                                    f"rank keeps {[3, 1][rank]} elements"), errors[2]
        # a float split size is what torch would take too (the api's int()): the lane
        # declines it and the api runs the call
        assert errors[3] == "no error", errors[3]
        assert errors[4].startswith("ValueError:"), errors[4]
        assert out == [1.0, 1.0, 2.0, 2.0]
        assert taken == [True], taken       # the bad calls declined before they ran


def _gather_mixed(rank, world, root):
    """gather on the lane on even ranks, on the general path on odd ones (a strided
    input, or async_op=True on the root), the blocks of different sizes."""
    taken = _spy_on_lane()
    mine = np.arange(2 + rank, dtype=np.int32) + 10 * rank
    on_lane = rank % 2 == 0
    outs = None
    if rank == root:
        outs = [np.full(2 + p, -1, np.int32) for p in range(world)]
        if on_lane:
            accord.gather(mine, outs, dst=root)
        else:
            accord.gather(mine, outs, dst=root, async_op=True).wait()
    else:
        accord.gather(mine if on_lane else _general(mine), dst=root)
    got = [o.tolist() for o in outs] if outs is not None else None
    errors = []
    if rank == root:
        try:                          # the root's own block of the wrong size
            accord.gather(mine, [np.zeros(9, np.int32)] * world, dst=root)
        except ValueError as e:
            errors.append(str(e))
    return got, errors, taken


@pytest.mark.parametrize("world,root", [(2, 0), (3, 1), (4, 2)])
def test_gather_on_the_lane_beside_the_general_path(world, root):
    for rank, (got, errors, taken) in enumerate(run_ranks(world, _gather_mixed, root)):
        if rank == root:
            assert got == [(np.arange(2 + p) + 10 * p).tolist() for p in range(world)]
            assert len(errors) == 1 and "gather_list" in errors[0], errors
        else:
            assert got is None
        assert taken == ([True] if rank % 2 == 0 else []), taken


def _reduce_mixed(rank, world, root, dtype, op_name, numel):
    """reduce on the lane on even ranks (twice), on the general path on odd ones (a
    strided tensor); the inputs of non-roots stay as they were."""
    taken = _spy_on_lane()
    op = getattr(accord.ReduceOp, op_name)
    results, untouched = [], True
    for _ in range(2):
        x = (np.arange(numel) % 7 + 3 * rank).astype(dtype)
        before = x.copy()
        t = x if rank % 2 == 0 else _general(x)
        accord.reduce(t, dst=root, op=op)
        results.append(np.array(t).tolist())
        if rank != root:
            untouched &= bool(np.array_equal(np.array(t), before))
    return results, untouched, taken


@pytest.mark.parametrize("world,root,dtype,op_name,numel", [(2, 0, "float32", "SUM", 3),
                                                           (3, 2, "int64", "MAX", 5),
                                                           (4, 1, "float64", "AVG", 40000)])
def test_reduce_on_the_lane_beside_the_general_path(world, root, dtype, op_name, numel):
    inputs = [(np.arange(numel) % 7 + 3 * r).astype(dtype) for r in range(world)]
    want = {"SUM": lambda: np.sum(inputs, axis=0, dtype=dtype),
            "MAX": lambda: np.max(inputs, axis=0),
            "AVG": lambda: np.mean(inputs, axis=0)}[op_name]().tolist()
    for rank, (results, untouched, taken) in enumerate(
            run_ranks(world, _reduce_mixed, root, dtype, op_name, numel)):
        if rank == root:
            assert results == [want, want]
        assert untouched
        assert taken == ([True, True] if rank % 2 == 0 else []), taken
