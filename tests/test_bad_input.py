"""Bad arguments: ValueError / TypeError naming the argument, raised on the calling rank
before any byte moves, and nothing else breaks.

Each bad call is made by one rank only (and then by every rank); right after it, every
rank runs the same collectives correctly and checks their data. A bad call that had
sent a byte, or advanced the group's sequence number on one rank only, would make
those follow-up calls fail with Desync, hang, or read the stray bytes.
"""
import array

import numpy as np
import pytest

import accord as dist
from harness import run_ranks

pytestmark = pytest.mark.timeout(90)

W = 3          # world size of these tests
R = dist.ReduceOp


def z(n=4, dtype=np.float32):
    return np.zeros(n, dtype)


def readonly(n=4):
    a = np.zeros(n, np.float32)
    a.flags.writeable = False
    return a


def cases(rank):
    """(name, exception, text the message must contain, call); the call runs on one rank."""
    root = rank               # the caller acts as root where a root is needed
    other = (rank + 1) % W
    return [
        # roots and ranks
        ("src outside the world", ValueError, "src", lambda: dist.broadcast(z(), src=W)),
        ("negative src", ValueError, "src", lambda: dist.broadcast(z(), src=-1)),
        ("src not an int", TypeError, "src", lambda: dist.broadcast(z(), src="0")),
        ("src a float", TypeError, "src", lambda: dist.broadcast(z(), src=0.0)),
        ("group_src outside", ValueError, "group_src",
         lambda: dist.broadcast(z(), group_src=W)),
        ("src and group_src", ValueError, "src",
         lambda: dist.broadcast(z(), src=0, group_src=0)),
        ("dst outside", ValueError, "dst", lambda: dist.reduce(z(), dst=W + 2)),
        ("gather dst outside", ValueError, "dst", lambda: dist.gather(z(), None, dst=99)),
        ("scatter src outside", ValueError, "src", lambda: dist.scatter(z(), None, src=W)),
        # tensors of the wrong kind
        ("tensor a list", TypeError, "tensor", lambda: dist.all_reduce([1.0, 2.0])),
        ("tensor a str", TypeError, "tensor", lambda: dist.broadcast("abc", src=root)),
        ("tensor None", TypeError, "tensor", lambda: dist.all_reduce(None)),
        ("object array", TypeError, "tensor",
         lambda: dist.all_reduce(np.array([object()] * 3))),
        ("read-only output", ValueError, "tensor", lambda: dist.all_reduce(readonly())),
        ("read-only broadcast target", ValueError, "tensor",
         lambda: dist.broadcast(readonly(), src=other)),
        ("bytes as output", ValueError, "tensor", lambda: dist.all_reduce(b"abcd")),
        ("read-only reduce", ValueError, "tensor", lambda: dist.reduce(readonly(), dst=root)),
        ("read-only scatter target", ValueError, "tensor",
         lambda: dist.scatter(readonly(), [z() for _ in range(W)], src=root)),
        # reduce ops
        ("unknown op", ValueError, "op", lambda: dist.all_reduce(z(), op="median")),
        ("op not an op", ValueError, "op", lambda: dist.all_reduce(z(), op=42)),
        ("AVG on int", TypeError, "AVG",
         lambda: dist.all_reduce(z(dtype=np.int32), op=R.AVG)),
        ("AVG on bool", TypeError, "AVG",
         lambda: dist.all_reduce(z(dtype=bool), op=R.AVG)),
        ("BAND on float", TypeError, "BAND", lambda: dist.all_reduce(z(), op=R.BAND)),
        ("BXOR on complex", TypeError, "BXOR",
         lambda: dist.reduce(z(dtype=np.complex64), dst=root, op=R.BXOR)),
        ("MIN on complex", TypeError, "MIN",
         lambda: dist.all_reduce(z(dtype=np.complex64), op=R.MIN)),
        ("MAX on complex reduce_scatter", TypeError, "MAX",
         lambda: dist.reduce_scatter_tensor(z(1, np.complex64), z(W, np.complex64),
                                            op=R.MAX)),
        ("datetime sum", TypeError, "datetime64",
         lambda: dist.all_reduce(np.zeros(2, "datetime64[s]"))),
        # lists
        ("all_gather list too short", ValueError, "tensor_list",
         lambda: dist.all_gather([z()] * (W - 1), z())),
        ("all_gather list too long", ValueError, "tensor_list",
         lambda: dist.all_gather([z() for _ in range(W + 1)], z())),
        ("all_gather not a list", TypeError, "tensor_list",
         lambda: dist.all_gather(z(W * 4), z())),
        ("all_gather own slot wrong size", ValueError, "tensor_list",
         lambda: dist.all_gather([z(5) for _ in range(W)], z())),
        ("all_gather dtype mismatch", TypeError, "tensor_list",
         lambda: dist.all_gather([z(dtype=np.float64) for _ in range(W)], z())),
        ("all_gather read-only output", ValueError, "tensor_list",
         lambda: dist.all_gather([readonly() for _ in range(W)], z())),
        ("all_gather_into_tensor wrong size", ValueError, "output_tensor",
         lambda: dist.all_gather_into_tensor(z(4 * W + 1), z())),
        ("all_gather_into_tensor dtype", TypeError, "output_tensor",
         lambda: dist.all_gather_into_tensor(z(4 * W, np.int32), z())),
        ("all_gather_into_tensor read-only", ValueError, "output_tensor",
         lambda: dist.all_gather_into_tensor(readonly(4 * W), z())),
        ("gather root without list", ValueError, "gather_list",
         lambda: dist.gather(z(), None, dst=root)),
        ("gather list on a non-root", ValueError, "gather_list",
         lambda: dist.gather(z(), [z() for _ in range(W)], dst=other)),
        ("gather list too short", ValueError, "gather_list",
         lambda: dist.gather(z(), [z()], dst=root)),
        ("gather own slot wrong size", ValueError, "gather_list",
         lambda: dist.gather(z(), [z(3) for _ in range(W)], dst=root)),
        ("gather dtype mismatch", TypeError, "gather_list",
         lambda: dist.gather(z(), [z(dtype=np.int8) for _ in range(W)], dst=root)),
        ("scatter root without list", ValueError, "scatter_list",
         lambda: dist.scatter(z(), None, src=root)),
        ("scatter list on a non-root", ValueError, "scatter_list",
         lambda: dist.scatter(z(), [z() for _ in range(W)], src=other)),
        ("scatter list too long", ValueError, "scatter_list",
         lambda: dist.scatter(z(), [z() for _ in range(W + 2)], src=root)),
        ("scatter own piece wrong size", ValueError, "scatter_list",
         lambda: dist.scatter(z(), [z(2) for _ in range(W)], src=root)),
        ("scatter dtype mismatch", TypeError, "scatter_list",
         lambda: dist.scatter(z(), [z(dtype=np.uint8) for _ in range(W)], src=root)),
        ("reduce_scatter list length", ValueError, "input_list",
         lambda: dist.reduce_scatter(z(), [z()])),
        ("reduce_scatter own block size", ValueError, "input_list",
         lambda: dist.reduce_scatter(z(), [z(5) for _ in range(W)])),
        ("reduce_scatter dtype", TypeError, "input_list",
         lambda: dist.reduce_scatter(z(), [z(dtype=np.float16) for _ in range(W)])),
        ("reduce_scatter_tensor size", ValueError, "input",
         lambda: dist.reduce_scatter_tensor(z(), z(4 * W - 1))),
        ("reduce_scatter_tensor dtype", TypeError, "input",
         lambda: dist.reduce_scatter_tensor(z(), z(4 * W, np.int64))),
        ("reduce_scatter_tensor read-only", ValueError, "output",
         lambda: dist.reduce_scatter_tensor(readonly(), z(4 * W))),
        ("all_to_all output list length", ValueError, "output_tensor_list",
         lambda: dist.all_to_all([z()], [z() for _ in range(W)])),
        ("all_to_all input list length", ValueError, "input_tensor_list",
         lambda: dist.all_to_all([z() for _ in range(W)], [z()])),
        ("all_to_all dtype", TypeError, "input_tensor_list",
         lambda: dist.all_to_all([z() for _ in range(W)], [z(dtype=np.int32)] * W)),
        ("all_to_all own block size", ValueError, "output_tensor_list",
         lambda: dist.all_to_all([z(3)] * W, [z()] * W)),
        ("all_to_all_single split count", ValueError, "output_split_sizes",
         lambda: dist.all_to_all_single(z(W), z(W), output_split_sizes=[1] * (W + 1),
                                        input_split_sizes=[1] * W)),
        ("all_to_all_single split sum", ValueError, "input_split_sizes",
         lambda: dist.all_to_all_single(z(W), z(W), output_split_sizes=[1] * W,
                                        input_split_sizes=[2] * W)),
        ("all_to_all_single negative split", ValueError, "input_split_sizes",
         lambda: dist.all_to_all_single(z(W), z(W), input_split_sizes=[-1, 2, 2],
                                        output_split_sizes=[1] * W)),
        ("all_to_all_single not divisible", ValueError, "input",
         lambda: dist.all_to_all_single(z(W), z(W + 1))),
        ("all_to_all_single dtype", TypeError, "input",
         lambda: dist.all_to_all_single(z(W), z(W, np.int16))),
        # groups
        ("new_group rank outside the world", ValueError, "ranks",
         lambda: dist.new_group([0, W])),
        ("new_group negative rank", ValueError, "ranks", lambda: dist.new_group([-1, 0])),
        ("new_group duplicates", ValueError, "ranks", lambda: dist.new_group([0, 1, 1])),
        ("new_group not ints", TypeError, "ranks", lambda: dist.new_group(["a", "b"])),
        ("new_group empty", ValueError, "ranks", lambda: dist.new_group([])),
        ("group not a group", TypeError, "group", lambda: dist.all_reduce(z(), group="world")),
        ("group an int", TypeError, "group", lambda: dist.barrier(group=0)),
        # timeouts
        ("negative timeout", ValueError, "timeout",
         lambda: dist.all_reduce(z(), timeout=-1)),
        ("timeout a str", TypeError, "timeout", lambda: dist.barrier(timeout="5")),
        # objects
        ("broadcast_object_list not a list", TypeError, "object_list",
         lambda: dist.broadcast_object_list((1, 2), src=root)),
        ("all_gather_object list length", ValueError, "object_list",
         lambda: dist.all_gather_object([None], 5)),
        ("gather_object root without list", (ValueError, TypeError), "object_gather_list",
         lambda: dist.gather_object(5, None, dst=root)),
        ("gather_object list length", ValueError, "object_gather_list",
         lambda: dist.gather_object(5, [None], dst=root)),
        ("scatter_object_list empty output", ValueError, "scatter_object_output_list",
         lambda: dist.scatter_object_list([], [1] * W, src=root)),
        ("scatter_object_list input length", ValueError, "scatter_object_input_list",
         lambda: dist.scatter_object_list([None], [1], src=root)),
        ("broadcast_object_list src outside", ValueError, "src",
         lambda: dist.broadcast_object_list([1], src=W)),
        # buffers
        ("array.array read-only? no: bytes output", ValueError, "tensor",
         lambda: dist.broadcast(bytes(4), src=other)),
        ("scatter into memoryview of bytes", ValueError, "tensor",
         lambda: dist.scatter(memoryview(bytes(4)), None, src=other)),
    ]


def _follow_up(rank, i, root):
    """Correct calls on every rank; their data proves nothing stray moved before."""
    t = 10                                                   # fail fast if a rank is stuck
    x = np.array([i, rank], np.int64) if rank == root else np.zeros(2, np.int64)
    dist.broadcast(x, src=root, timeout=t)
    assert x.tolist() == [i, root], f"after case {i}: broadcast got {x}"
    y = np.full(4, float(rank + i), np.float32)
    dist.all_reduce(y, timeout=t)
    assert (y == W * i + sum(range(W))).all(), f"after case {i}: all_reduce got {y}"
    outs = [np.zeros(4, np.float32) for _ in range(W)]
    dist.all_gather(outs, np.full(4, rank * i, np.float32), timeout=t)
    assert [o[0] for o in outs] == [r * i for r in range(W)], f"after case {i}: all_gather"
    gl = [np.zeros(4, np.float32) for _ in range(W)] if rank == root else None
    dist.gather(np.full(4, rank + 1, np.float32), gl, dst=root, timeout=t)
    if rank == root:
        assert [o[0] for o in gl] == [r + 1 for r in range(W)], f"after case {i}: gather"
    s = np.zeros(4, np.float32)
    dist.scatter(s, [np.full(4, r + i, np.float32) for r in range(W)] if rank == root else None,
                 src=root, timeout=t)
    assert (s == rank + i).all(), f"after case {i}: scatter"
    o = np.zeros(W, np.float32)
    dist.all_to_all_single(o, np.arange(W, dtype=np.float32) + 10 * rank, timeout=t)
    assert o.tolist() == [10 * j + rank for j in range(W)], f"after case {i}: all_to_all_single"
    objs = [None] * W
    dist.all_gather_object(objs, {"rank": rank, "case": i})
    assert objs == [{"rank": r, "case": i} for r in range(W)]


def _bad_calls(rank, world, everyone):
    assert world == W
    names = [c[0] for c in cases(0)]
    for i, name in enumerate(names):
        caller = i % W
        if everyone or rank == caller:
            _, exc, text, call = cases(rank)[i]
            with pytest.raises(exc) as info:
                call()
            assert text in str(info.value), \
                f"case {name!r}: message does not name {text!r}: {info.value}"
        _follow_up(rank, i, caller)
    return len(names)


@pytest.mark.parametrize("everyone", [False, True], ids=["one-rank", "every-rank"])
def test_bad_call_raises_on_the_caller_and_nothing_else_breaks(everyone):
    counts = run_ranks(W, _bad_calls, everyone, timeout=60)
    assert counts[0] > 70


def _subgroup_bad_calls(rank, world):
    g = dist.new_group([2, 0])
    if rank in (0, 2):
        with pytest.raises(ValueError, match="src"):
            dist.broadcast(z(), src=1, group=g)               # rank 1 is not in g
        with pytest.raises(ValueError, match="dst"):
            dist.reduce(z(), dst=1, group=g)
        with pytest.raises(ValueError, match="tensor_list"):
            dist.all_gather([z()] * 3, z(), group=g)         # the world's size, not g's
        with pytest.raises(ValueError, match="group_dst"):
            dist.gather(z(), None, group=g, group_dst=2)
        if rank == 2:
            with pytest.raises(ValueError, match="dst"):
                dist.send(z(), dst=1, group=g)
        x = np.array([rank], np.int64)
        dist.all_reduce(x, group=g, timeout=10)
        assert x[0] == 2
        dist.broadcast(x, src=2, group=g, timeout=10)
        assert x[0] == 2
    else:
        # a non-member gets None from anything, bad arguments included
        assert dist.broadcast(z(), src=1, group=g) is None
        assert dist.all_gather([z()] * 7, z(), group=g) is None
    y = np.array([1.0])
    dist.all_reduce(y, timeout=10)
    assert y[0] == world
    return True


def test_bad_calls_on_a_subgroup():
    run_ranks(W, _subgroup_bad_calls, timeout=30)


def _array_array(rank, world):
    a = array.array("d", [0.0] * 4)
    with pytest.raises(TypeError, match="tensor_list"):
        dist.all_gather([array.array("f", [0.0] * 4) for _ in range(W)], a)
    with pytest.raises(ValueError, match="output_tensor"):
        dist.all_gather_into_tensor(bytearray(5), bytearray(2))
    dist.all_gather_into_tensor(bytearray(2 * W), bytearray(2), timeout=10)
    return True


def test_bad_buffers():
    run_ranks(W, _array_array, timeout=30)
