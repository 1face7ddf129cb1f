"""reduce_scatter reads its input and writes only its output: the ring keeps its partial
sums in the output and in spare blocks, never in the caller's input, whatever the
world size, the size (several pieces of the ring included), the op, or where the
output lies (this rank's own block of the input, as sharded training passes it, or
over another rank's block). reduce leaves every non-root's input as it was too."""
import numpy as np
import pytest

from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(120)


def _inputs(rank, world, n, dtype):
    return (np.arange(n * world) % 97 + 10 * rank + 1).astype(dtype)


def _expected(world, n, dtype, op):
    import accord
    every = [_inputs(r, world, n, dtype) for r in range(world)]
    if op == accord.ReduceOp.MAX:
        return np.maximum.reduce(every)
    total = np.sum(every, axis=0, dtype=dtype)
    return total / world if op == accord.ReduceOp.AVG else total


def _tensor(rank, world, n, dtype, op_name):
    import accord
    op = accord.ReduceOp[op_name]
    x = _inputs(rank, world, n, dtype)
    before = x.copy()
    out = np.full(n, -1, dtype)
    accord.reduce_scatter_tensor(out, x, op=op)
    np.testing.assert_array_equal(x, before, err_msg="the input was written")
    np.testing.assert_allclose(out, _expected(world, n, dtype, op)[rank * n:(rank + 1) * n],
                               rtol=1e-6)
    # the uneven list form: each rank's block its own size
    sizes = [n + k for k in range(world)]
    ins = [(np.arange(s) % 13 + rank + k).astype(dtype) for k, s in enumerate(sizes)]
    copies = [b.copy() for b in ins]
    mine = np.empty(sizes[rank], dtype)
    accord.reduce_scatter(mine, ins, op=op)
    for b, c in zip(ins, copies):
        np.testing.assert_array_equal(b, c, err_msg="an input block was written")
    return mine.tolist()


@pytest.mark.parametrize("world,env", [(2, {}), (3, {}), (4, {}),     # 4: recursive halving
                                       (4, {"ACCORD_ALGORITHMS": "reduce_scatter=ring"}),
                                       (4, {"ACCORD_ALGORITHMS": "reduce_scatter=doubling"}),
                                       (4, {"ACCORD_ALGORITHMS": "reduce_scatter=slotted"})],
                         ids=["2", "3", "4", "4-ring", "4-doubling", "4-slotted"])
@pytest.mark.parametrize("n,dtype,op", [(3, np.float32, "SUM"), (70_000, np.float64, "AVG"),
                                        (1_200_000, np.float32, "SUM"),   # 2 pieces a block
                                        (5000, np.int32, "MAX"),
                                        (9000, np.float16, "SUM")])      # the 16-bit kernels
def test_the_input_is_only_read(world, env, n, dtype, op):
    res = run_ranks(world, _tensor, n, dtype, op, env=env)
    sizes = [n + k for k in range(world)]
    for rank, got in enumerate(res):
        every = [(np.arange(sizes[rank]) % 13 + r + rank).astype(dtype) for r in range(world)]
        want = (np.maximum.reduce(every) if op == "MAX" else
                np.sum(every, axis=0, dtype=dtype) / (world if op == "AVG" else 1))
        np.testing.assert_allclose(got, want, rtol=1e-6)


def _output_inside_the_input(rank, world, n, where):
    import accord
    x = _inputs(rank, world, n, np.float32)
    blocks = [x[k * n:(k + 1) * n] for k in range(world)]
    # in place (the own block, the convention sharded training uses), or over the next
    # rank's block, which the ring sends before anything is reduced
    out = blocks[rank] if where == "own" else blocks[(rank + 1) % world]
    accord.reduce_scatter_tensor(out, x)
    want = _expected(world, n, np.float32, accord.ReduceOp.SUM)[rank * n:(rank + 1) * n]
    np.testing.assert_array_equal(out, want)
    return "ok"


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("n", [5, 300_000])
@pytest.mark.parametrize("where", ["own", "another"])
def test_an_output_inside_the_input(world, n, where):
    assert run_ranks(world, _output_inside_the_input, n, where) == ["ok"] * world


def test_eight_ranks_halve_three_times():
    # the middle step reduces into the spare half the first one wrote
    for n, dtype, op in [(4, np.float64, "SUM"), (40_000, np.float32, "AVG")]:
        res = run_ranks(8, _tensor, n, dtype, op, timeout=90)
        assert len(res) == 8


def _reduce(rank, world, n, root):
    import accord
    x = (np.arange(n) % 11 + rank).astype(np.float32)
    before = x.copy()
    accord.reduce(x, dst=root)
    if rank == root:
        want = sum((np.arange(n) % 11 + r).astype(np.float32) for r in range(world))
        np.testing.assert_array_equal(x, want)
    else:
        # a leaf sends its input as it is; a rank that receives reduces into a new array
        np.testing.assert_array_equal(x, before, err_msg="a non-root's input was written")
    return "ok"


@pytest.mark.parametrize("world,root", [(2, 1), (3, 0), (4, 1), (5, 2)])
@pytest.mark.parametrize("n", [3, 1_200_000])
def test_reduce_leaves_every_non_roots_input_as_it_was(world, root, n):
    assert run_ranks(world, _reduce, n, root) == ["ok"] * world
