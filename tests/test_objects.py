"""The four object collectives: every world size and root, nested objects with numpy
arrays inside, objects of different sizes on different ranks, subgroups."""
import numpy as np
import pytest

import accord as dist
from harness import run_ranks

pytestmark = pytest.mark.timeout(90)


def obj(rank, case):
    """A nested object whose size depends on (rank, case)."""
    k = (rank * 7 + case) % 5
    return {
        "rank": rank, "case": case,
        "text": "é" * (k * 13) + str(case),
        "ints": list(range(k * 50)),
        "nested": {"t": (rank, None, b"\x00\xff" * k), "s": {case, -rank},
                   "deep": [[{"x": 1.5 * rank}], []]},
        "arr": np.arange(k * 101 + rank, dtype=np.float64) * case,
        "i8": np.full((k, 3), rank - case, np.int8),
        "zero_d": np.array(rank + 0.25, np.float32),
        "empty": np.zeros((0, 4), np.uint64),
        "strided": (np.arange(30, dtype=np.int32) + case)[::3],
        "fortran": np.asfortranarray(np.arange(6, dtype=np.complex64).reshape(2, 3) * rank),
        "bools": np.arange(k + 1) % 2 == 0,
    }


def deep_eq(a, b, path="obj"):
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray), f"{path}: {type(b)}"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {b.dtype}{b.shape}"
        assert np.array_equal(a, b), f"{path}: {b!r} != {a!r}"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{path}: keys"
        for k in a:
            deep_eq(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{path}: {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            deep_eq(x, y, f"{path}[{i}]")
    else:
        assert type(a) is type(b) and a == b, f"{path}: {b!r} != {a!r}"


def _objects(rank, world):
    case = 0
    for root in range(world):
        case += 1
        # broadcast_object_list: several objects of different sizes, root's list wins
        n = root + 2
        lst = [obj(root, case + i) for i in range(n)] if rank == root else [None] * n
        assert dist.broadcast_object_list(lst, src=root) is None
        for i in range(n):
            deep_eq(obj(root, case + i), lst[i], f"broadcast_object_list root={root} [{i}]")
        # a list of plain values; an empty list
        lst = ["a" * root, 3, None] if rank == root else [0, 0, 0]
        dist.broadcast_object_list(lst, src=root)
        assert lst == ["a" * root, 3, None]
        empty = []
        dist.broadcast_object_list(empty, src=root)
        assert empty == []
        # gather_object to every root
        out = [None] * world if rank == root else None
        assert dist.gather_object(obj(rank, case), out, dst=root) is None
        if rank == root:
            for r in range(world):
                deep_eq(obj(r, case), out[r], f"gather_object dst={root} [{r}]")
        # scatter_object_list from every root; only element 0 of the output is written
        outl = ["untouched", "keep"]
        ins = [obj(r, case + 100) for r in range(world)] if rank == root else None
        assert dist.scatter_object_list(outl, ins, src=root) is None
        deep_eq(obj(rank, case + 100), outl[0], f"scatter_object_list src={root}")
        assert outl[1] == "keep"
    # all_gather_object: a different object (and size) on every rank
    for c in range(3):
        got = [None] * world
        assert dist.all_gather_object(got, obj(rank, 50 + c)) is None
        for r in range(world):
            deep_eq(obj(r, 50 + c), got[r], f"all_gather_object [{r}]")
    # a bigger payload: a 2 MiB array from one rank, small objects from the others
    big = np.arange(1 << 18, dtype=np.float64) if rank == world - 1 else None
    got = [None] * world
    dist.all_gather_object(got, {"r": rank, "big": big})
    assert got[-1]["big"].tobytes() == np.arange(1 << 18, dtype=np.float64).tobytes()
    assert [g["r"] for g in got] == list(range(world))
    # object collectives keep the group's order with tensor collectives between them
    x = np.array([rank])
    dist.all_reduce(x)
    assert x[0] == sum(range(world))
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_object_collectives(world):
    run_ranks(world, _objects, timeout=60)


def _objects_on_subgroup(rank, world):
    g = dist.new_group([3, 0, 2])
    member = rank in (0, 2, 3)
    sentinel = ["s0", "s1", "s2"]
    lst = list(sentinel)
    if rank == 2:
        lst = [obj(2, 1), "x", {"y": np.ones(3)}]
    res = dist.broadcast_object_list(lst, src=2, group=g)
    assert res is None
    if member:
        deep_eq(obj(2, 1), lst[0])
        assert lst[1] == "x" and np.array_equal(lst[2]["y"], np.ones(3))
    else:
        assert lst == sentinel
    got = [None] * 3
    dist.all_gather_object(got, obj(rank, 2), group=g)
    if member:
        for i, r in enumerate([0, 2, 3]):
            deep_eq(obj(r, 2), got[i])
    else:
        assert got == [None] * 3
    out = [None] * 3 if rank == 3 else None
    dist.gather_object(("from", rank), out, dst=3, group=g)
    if rank == 3:
        assert out == [("from", 0), ("from", 2), ("from", 3)]
    outl = [None]
    dist.scatter_object_list(outl, [f"to {i}" for i in range(3)] if rank == 0 else None,
                             src=0, group=g)
    assert outl == ([f"to {dist.get_rank(g)}"] if member else [None])
    # group_src / group_dst
    lst = ["mine"] if dist.get_rank(g) == 1 else [None]
    dist.broadcast_object_list(lst, group=g, group_src=1)
    assert lst == (["mine"] if member else [None])
    out = [None] * 3 if dist.get_rank(g) == 0 else None
    dist.gather_object(rank * 10, out, group=g, group_dst=0)
    if rank == 0:
        assert out == [0, 20, 30]
    x = np.array([1])
    dist.all_reduce(x)
    assert x[0] == world
    return True


def test_object_collectives_on_a_subgroup():
    run_ranks(4, _objects_on_subgroup, timeout=30)
