"""Subgroups: new_group with any subset in any order, rank translation, non-members,
several groups used alternately and nested, group_src / group_dst."""
import itertools

import numpy as np
import pytest

import accord as dist
from harness import run_ranks

pytestmark = pytest.mark.timeout(90)


def _ranks_and_members(rank, world):
    g = dist.new_group([3, 1])
    assert dist.get_process_group_ranks(g) == [1, 3]       # sorted, as in torch
    member = rank in (1, 3)
    assert dist.get_rank(g) == ({1: 0, 3: 1}[rank] if member else -1)
    assert dist.get_world_size(g) == (2 if member else -1)
    assert dist.get_rank() == rank and dist.get_world_size() == world
    assert dist.get_group_rank(g, 3) == 1 and dist.get_group_rank(g, 1) == 0
    assert dist.get_global_rank(g, 0) == 1 and dist.get_global_rank(g, 1) == 3
    with pytest.raises(ValueError, match="global_rank"):
        dist.get_group_rank(g, 0)
    with pytest.raises(ValueError, match="group_rank"):
        dist.get_global_rank(g, 2)
    assert dist.get_group_rank(None, 2) == 2 and dist.get_global_rank(None, 2) == 2

    # every collective on the group; non-members get None and their buffers stay as they were
    x = np.full(4, rank, np.int64)
    res = dist.broadcast(x, src=3, group=g)
    assert res is None
    assert x.tolist() == ([3] * 4 if member else [rank] * 4)
    x = np.full(2, rank + 1.0)
    assert dist.all_reduce(x, group=g) is None
    assert x.tolist() == ([6.0, 6.0] if member else [rank + 1.0] * 2)
    outs = [np.zeros(1, np.int32), np.zeros(1, np.int32)]
    assert dist.all_gather(outs, np.full(1, rank, np.int32), group=g) is None
    if member:
        assert [o.tolist() for o in outs] == [[1], [3]]
    else:
        assert all(not o.any() for o in outs)
    gl = [np.zeros(2, np.int16) for _ in range(2)] if rank == 3 else None
    assert dist.gather(np.full(2, rank, np.int16), gl, dst=3, group=g) is None
    if rank == 3:
        assert [o.tolist() for o in gl] == [[1, 1], [3, 3]]
    y = np.zeros(3, np.uint8)
    sl = [np.full(3, 10 + i, np.uint8) for i in range(2)] if rank == 1 else None
    assert dist.scatter(y, sl, src=1, group=g) is None
    assert y.tolist() == ([10 + dist.get_rank(g)] * 3 if member else [0] * 3)
    z = np.full(2, rank, np.int64)
    assert dist.reduce(z, dst=1, group=g, op=dist.ReduceOp.MAX) is None
    assert z.tolist() == ([3, 3] if rank == 1 else [rank] * 2)
    o = np.zeros(1, np.float32)
    assert dist.reduce_scatter_tensor(o, np.array([rank, 10 * rank], np.float32), group=g) is None
    if member:
        assert o.tolist() == [[4.0], [40.0]][dist.get_rank(g)]
    o = np.zeros(2, np.int64)
    assert dist.all_to_all_single(o, np.array([rank, rank * 100]), group=g) is None
    if member:
        assert o.tolist() == [1 * 100 ** dist.get_rank(g), 3 * 100 ** dist.get_rank(g)]
    assert dist.barrier(group=g) is None
    w = dist.all_reduce(np.ones(1), group=g, async_op=True)
    assert (w is None) == (not member)
    if member:
        w.wait()
    # point to point inside the group, with global ranks
    if rank == 1:
        dist.send(np.arange(5), dst=3, group=g)
    elif rank == 3:
        got = np.zeros(5, np.int64)
        assert dist.recv(got, src=1, group=g) == 1
        assert got.tolist() == list(range(5))
    else:
        assert dist.send(np.arange(5), dst=3, group=g) is None
    # the world still works after all that, in the same order everywhere
    x = np.array([rank])
    dist.all_reduce(x)
    assert x[0] == sum(range(world))
    return True


def test_group_of_3_and_1_on_world_4():
    run_ranks(4, _ranks_and_members, timeout=30)


def _every_subset(rank, world):
    """Every non-empty subset of the world, listed in a scrambled order, as a group."""
    rng = np.random.default_rng(7)
    checked = 0
    for k in range(1, world + 1):
        for subset in itertools.combinations(range(world), k):
            order = list(subset)
            rng.shuffle(order)
            g = dist.new_group(order)
            members = sorted(subset)
            if rank not in subset:
                assert dist.get_rank(g) == -1
                assert dist.broadcast(np.zeros(1), src=members[0], group=g) is None
                continue
            me = members.index(rank)
            assert dist.get_rank(g) == me and dist.get_world_size(g) == k
            for root in members:
                x = np.array([root * 10 + 1, k], np.int32) if rank == root else np.zeros(2, np.int32)
                dist.broadcast(x, src=root, group=g)
                assert x.tolist() == [root * 10 + 1, k], (subset, root)
            x = np.array([2.0 ** rank])
            dist.all_reduce(x, group=g)
            assert x[0] == sum(2.0 ** m for m in members), subset
            out = np.zeros(k, np.int64)
            dist.all_gather_into_tensor(out, np.array([rank]), group=g)
            assert out.tolist() == members
            for gr in range(k):
                y = np.zeros(1, np.int64)
                dist.scatter(y, [np.array([100 + i]) for i in range(k)] if me == gr else None,
                             group_src=gr, group=g)
                assert y[0] == 100 + me
            checked += 1
            dist.destroy_process_group(g)
    x = np.ones(1)
    dist.all_reduce(x)
    assert x[0] == world
    return checked


def test_every_subset_in_any_order():
    counts = run_ranks(4, _every_subset, timeout=60)
    assert counts == [8, 8, 8, 8]           # each rank is in 8 of the 15 subsets


def _alternate_and_nested(rank, world):
    a = dist.new_group([0, 1, 2])
    b = dist.new_group([4, 3, 2, 1])
    inner = dist.new_group([3, 1])          # nested inside b
    for i in range(6):
        if rank in (0, 1, 2):
            x = np.array([rank + i])
            dist.all_reduce(x, group=a)
            assert x[0] == 3 + 3 * i
        if rank in (1, 2, 3, 4):
            y = np.zeros(2, np.int64) if rank != 4 - i % 4 else np.array([i, 4 - i % 4])
            dist.broadcast(y, src=4 - i % 4, group=b)
            assert y.tolist() == [i, 4 - i % 4]
            if rank in (1, 3):
                # nested: the inner pair does its own collective between b's
                z = np.array([rank * (i + 1)])
                w = dist.all_reduce(z, group=inner, async_op=i % 2 == 0)
                if w is not None:
                    w.wait()
                assert z[0] == 4 * (i + 1)
            out = [np.zeros(1, np.int64) for _ in range(4)]
            dist.all_gather(out, np.array([rank * i]), group=b)
            assert [o[0] for o in out] == [m * i for m in (1, 2, 3, 4)]
        if i % 3 == 2:
            dist.barrier()
    # group_src / group_dst name ranks within the group
    if rank in (1, 2, 3, 4):
        me = dist.get_rank(b)
        x = np.array([me]) if me == 2 else np.zeros(1, np.int64)
        dist.broadcast(x, group=b, group_src=2)     # global rank 3
        assert x[0] == 2
        gl = [np.zeros(1, np.int64) for _ in range(4)] if rank == 1 else None
        dist.gather(np.array([rank]), gl, group=b, group_dst=0)
        if rank == 1:
            assert [o[0] for o in gl] == [1, 2, 3, 4]
        z = np.array([rank])
        dist.reduce(z, group=b, group_dst=3)         # global rank 4
        assert z[0] == (10 if rank == 4 else rank)
        y = np.zeros(1, np.int64)
        dist.scatter(y, [np.array([50 + i]) for i in range(4)] if me == 1 else None,
                     group=b, group_src=1)
        assert y[0] == 50 + me
        with pytest.raises(ValueError, match="src"):
            dist.broadcast(x, src=3, group=b, group_src=2)
        with pytest.raises(ValueError, match="group_src"):
            dist.broadcast(x, group=b, group_src=4)
        if me == 0:
            dist.send(np.array([7]), group=b, group_dst=3)
        elif me == 3:
            r = np.zeros(1, np.int64)
            dist.recv(r, group=b, group_src=0)
            assert r[0] == 7
    # subgroups from new_subgroups are not the caller's concern here: world 5 is not
    # divisible, so it must refuse
    with pytest.raises(ValueError, match="group_size"):
        dist.new_subgroups(2)
    x = np.ones(1)
    dist.all_reduce(x)
    assert x[0] == world
    return True


def test_two_groups_alternately_and_nested():
    run_ranks(5, _alternate_and_nested, timeout=40)


def _subgroups(rank, world):
    mine, groups = dist.new_subgroups(2)
    assert len(groups) == 2 and dist.get_process_group_ranks(mine) == [rank // 2 * 2,
                                                                        rank // 2 * 2 + 1]
    x = np.array([rank])
    dist.all_reduce(x, group=mine)
    assert x[0] == 4 * (rank // 2) + 1
    # a single-rank group is a group too
    solo = [dist.new_group([r]) for r in range(world)]
    y = np.array([rank, 1])
    dist.all_reduce(y, group=solo[rank])
    dist.broadcast(y, src=rank, group=solo[rank])
    out = np.zeros(2, np.int64)
    dist.all_gather_into_tensor(out, y, group=solo[rank])
    assert y.tolist() == [rank, 1] and out.tolist() == [rank, 1]
    assert dist.all_reduce(y, group=solo[(rank + 1) % world]) is None
    return True


def test_new_subgroups_and_single_rank_groups():
    run_ranks(4, _subgroups, timeout=30)
