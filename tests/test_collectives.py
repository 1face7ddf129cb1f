"""The collective grid (DESIGN "Testing"): every collective against a numpy reference.

World sizes 1-5, every root, sizes 0, 1, odd and large, every dtype family,
every reduce op where it is defined, uneven sizes, and each algorithm forced
at small sizes through ACCORD_ALGORITHMS. Each rank computes every other
rank's input from a seed, so it checks its own result in place; results that
must be bit-identical across ranks are hashed and compared in the parent.
"""
import hashlib

import numpy as np
import pytest

import accord as dist
from harness import run_ranks

pytestmark = pytest.mark.timeout(150)

DTYPES = ["bool", "int8", "uint8", "int32", "int64", "uint64", "float16", "float32", "float64",
          "complex64"]
SIZES = [0, 1, 7, 1001]
WORLDS = [1, 2, 3, 4, 5]
FORCED = {
    "default": {},
    "chain-ring": {"ACCORD_ALGORITHMS": "broadcast=chain,all_gather=ring,all_reduce=ring"},
    # recursive doubling at every world (over shared memory the one-step algorithms
    # take a small all_reduce and reduce_scatter where the group is not a power of two)
    "tree-direct-rd": {"ACCORD_ALGORITHMS":
                       "broadcast=tree,all_gather=direct,all_reduce=recursive_doubling,"
                       "reduce_scatter=doubling"},
    # a power of two of ranks beyond two (world 4 only): recursive doubling and halving
    "doubling": {"ACCORD_ALGORITHMS": "all_gather=doubling,all_reduce=halving_doubling"},
    # all_reduce and reduce_scatter in one step, at every world and size
    "one-step": {"ACCORD_ALGORITHMS": "all_reduce=gather_reduce,reduce_scatter=direct"},
    # the default transport between ranks of one host is shared memory; TCP too
    "tcp": {"ACCORD_TRANSPORT": "tcp"},
}
OPS = list(dist.ReduceOp)
REF_UFUNC = {
    dist.ReduceOp.SUM: np.add, dist.ReduceOp.AVG: np.add, dist.ReduceOp.PRODUCT: np.multiply,
    dist.ReduceOp.MIN: np.minimum, dist.ReduceOp.MAX: np.maximum,
    dist.ReduceOp.BAND: np.bitwise_and, dist.ReduceOp.BOR: np.bitwise_or,
    dist.ReduceOp.BXOR: np.bitwise_xor,
}


# -- deterministic data and references ------------------------------------------

def shape_of(n):
    """Sizes map to shapes: 1001 elements become a 2-d 7 x 143 array."""
    return (7, n // 7) if n > 7 and n % 7 == 0 else (n,)


def data(dtype, shape, *seed):
    """The same array on every rank for the same (dtype, shape, seed)."""
    dt = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    rng = np.random.default_rng([DTYPES.index(dt.name) if dt.name in DTYPES else 99,
                                 n, *seed])
    if dt.kind == "b":
        a = rng.random(n) < 0.5
    elif dt.kind in "iu":
        info = np.iinfo(dt)
        a = rng.integers(info.min, info.max, size=n, dtype=dt, endpoint=True)
    elif dt.kind == "f":
        a = rng.uniform(-2, 2, n).astype(dt)
    else:
        a = (rng.uniform(-2, 2, n) + 1j * rng.uniform(-2, 2, n)).astype(dt)
    return a.reshape(shape)


def ops_for(dtype):
    kind = np.dtype(dtype).kind
    out = [dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT]
    if kind != "c":
        out += [dist.ReduceOp.MIN, dist.ReduceOp.MAX]
    if kind in "biu":
        out += [dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR]
    if kind in "fc":
        out.append(dist.ReduceOp.AVG)
    return out


def reference(op, arrays):
    acc = arrays[0].copy()
    for a in arrays[1:]:
        REF_UFUNC[op](acc, a, out=acc)
    if op == dist.ReduceOp.AVG:
        acc = (acc / acc.dtype.type(len(arrays))).astype(acc.dtype)
    return acc


def same(got, want, what):
    assert isinstance(got, np.ndarray), what
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    if got.tobytes() != want.tobytes():
        bad = np.flatnonzero(got.reshape(-1) != want.reshape(-1))[:5]
        raise AssertionError(f"{what}: bytes differ at {bad.tolist()}: got "
                             f"{got.reshape(-1)[bad].tolist()} want {want.reshape(-1)[bad].tolist()}")


def close(got, want, what, world):
    assert got.dtype == want.dtype and got.shape == want.shape, what
    kind = got.dtype.kind
    if kind not in "fc":
        same(got, want, what)
        return
    tol = 3e-2 * world if got.dtype == np.float16 else 1e-5 * world
    if not np.allclose(got, want, rtol=tol, atol=tol):
        bad = np.flatnonzero(~np.isclose(got, want, rtol=tol, atol=tol).reshape(-1))[:5]
        raise AssertionError(f"{what}: not close at {bad.tolist()}: got "
                             f"{got.reshape(-1)[bad].tolist()} want {want.reshape(-1)[bad].tolist()}")


def digest(arr):
    return hashlib.sha1(np.ascontiguousarray(arr).view(np.uint8).tobytes()).hexdigest()


def params(worlds=WORLDS, forced=FORCED):
    return [pytest.param(w, f, id=f"w{w}-{f}") for f in forced for w in worlds
            if (f != "tcp" or w in (2, 3, 5)) and (f != "doubling" or w == 4)]


# -- broadcast and all_gather -------------------------------------------------------

def _bcast_allgather(rank, world):
    for di, dtype in enumerate(DTYPES):
        for n in SIZES:
            shp = shape_of(n)
            for root in range(world):
                x = data(dtype, shp, 1, root) if rank == root else np.zeros(shp, dtype)
                assert dist.broadcast(x, src=root) is None
                same(x, data(dtype, shp, 1, root), f"broadcast {dtype} n={n} root={root}")
            # 0-d arrays
            root = (di + n) % world
            x = data(dtype, (), 2, root) if rank == root else np.zeros((), dtype)
            dist.broadcast(x, root)
            same(x, data(dtype, (), 2, root), f"broadcast 0-d {dtype} root={root}")
            # all_gather, even sizes
            mine = data(dtype, shp, 3, rank)
            outs = [np.zeros(shp, dtype) for _ in range(world)]
            assert dist.all_gather(outs, mine) is None
            for r in range(world):
                same(outs[r], data(dtype, shp, 3, r), f"all_gather {dtype} n={n} block {r}")
            same(mine, data(dtype, shp, 3, rank), "all_gather input changed")
            # all_gather, uneven first dimension: rank r contributes n + r rows of 3
            mine = data(dtype, (n + rank, 3), 4, rank)
            outs = [np.zeros((n + r, 3), dtype) for r in range(world)]
            dist.all_gather(outs, mine)
            for r in range(world):
                same(outs[r], data(dtype, (n + r, 3), 4, r), f"uneven all_gather {dtype} {r}")
            # all_gather_into_tensor, flat and 2-d outputs
            mine = data(dtype, (n,), 5, rank)
            out = np.zeros(world * n, dtype)
            assert dist.all_gather_into_tensor(out, mine) is None
            same(out, np.concatenate([data(dtype, (n,), 5, r) for r in range(world)]),
                 f"all_gather_into_tensor {dtype} n={n}")
            out2 = np.zeros((world, n), dtype)
            dist.all_gather_into_tensor(out2, mine)
            same(out2.reshape(-1), out, f"all_gather_into_tensor 2-d {dtype} n={n}")
            # 0-d inputs into a 1-d output
            out = np.zeros(world, dtype)
            dist.all_gather_into_tensor(out, data(dtype, (), 6, rank))
            same(out, np.array([data(dtype, (), 6, r) for r in range(world)], dtype),
                 f"all_gather_into_tensor 0-d {dtype}")
    return True


@pytest.mark.parametrize("world, forced", params())
def test_broadcast_and_all_gather(world, forced):
    run_ranks(world, _bcast_allgather, env=FORCED[forced], timeout=60)


# -- reductions -----------------------------------------------------------------------

def _reductions(rank, world, full):
    """full=False (an all_reduce algorithm forced): only all_reduce depends on it."""
    hashes = []
    for dtype in DTYPES:
        for n in SIZES:
            shp = shape_of(n)
            for op in ops_for(dtype):
                case = OPS.index(op)
                ins = [data(dtype, shp, 10, case, r) for r in range(world)]
                want = reference(op, ins)
                # all_reduce: close to the reference, and (checked in the parent)
                # bit-identical on every rank
                x = ins[rank].copy()
                assert dist.all_reduce(x, op=op) is None
                close(x, want, f"all_reduce {op!r} {dtype} n={n}", world)
                hashes.append((dtype, n, op.name, digest(x)))
                if not full:
                    continue
                # reduce to every root (one root for sizes 1 and 1001, to keep the grid
                # affordable); the other ranks' inputs stay as they were
                for root in (range(world) if n in (0, 7) else [case % world]):
                    x = ins[rank].copy()
                    assert dist.reduce(x, dst=root, op=op) is None
                    if rank == root:
                        close(x, want, f"reduce {op!r} {dtype} n={n} root={root}", world)
                    else:
                        same(x, ins[rank], f"reduce {op!r} root={root}: non-root input changed")
                # reduce_scatter_tensor: rank r gets block r of the reduction
                ins = [data(dtype, (world * n,), 11, case, r) for r in range(world)]
                want = reference(op, ins)
                out = np.zeros(n, dtype)
                assert dist.reduce_scatter_tensor(out, ins[rank], op=op) is None
                close(out, want[rank * n:(rank + 1) * n],
                      f"reduce_scatter_tensor {op!r} {dtype} n={n}", world)
                # reduce_scatter with a list of 2-d blocks
                if n in (1, 1001):
                    continue
                lists = [[data(dtype, (n, 2), 12, case, r, j) for j in range(world)]
                         for r in range(world)]
                out = np.zeros((n, 2), dtype)
                assert dist.reduce_scatter(out, lists[rank], op=op) is None
                close(out, reference(op, [lists[r][rank] for r in range(world)]),
                      f"reduce_scatter {op!r} {dtype} n={n}", world)
        # 0-d all_reduce
        ins = [data(dtype, (), 13, r) for r in range(world)]
        x = ins[rank].copy()
        dist.all_reduce(x, op=dist.ReduceOp.MAX if dtype != "complex64" else dist.ReduceOp.SUM)
        close(x, reference(dist.ReduceOp.MAX if dtype != "complex64" else dist.ReduceOp.SUM,
                           ins), f"0-d all_reduce {dtype}", world)
    # integers and bool have no AVG: a TypeError naming AVG, and nothing moves
    for dtype in ["bool", "int8", "uint8", "int32", "int64", "uint64"]:
        x = np.ones(4, dtype)
        for call in (lambda: dist.all_reduce(x, op=dist.ReduceOp.AVG),
                     lambda: dist.reduce(x, 0, op=dist.ReduceOp.AVG),
                     lambda: dist.reduce_scatter_tensor(np.ones(1, dtype),
                                                        np.ones(world, dtype),
                                                        op=dist.ReduceOp.AVG)):
            with pytest.raises(TypeError, match="AVG"):
                call()
        same(x, np.ones(4, dtype), "input touched by a rejected AVG")
    x = np.full(3, rank + 1, np.int64)
    dist.all_reduce(x)
    same(x, np.full(3, world * (world + 1) // 2, np.int64), "all_reduce after rejected AVG")
    return hashes


@pytest.mark.parametrize("world, forced", params())
def test_reductions(world, forced):
    results = run_ranks(world, _reductions, forced in ("default", "tcp", "one-step", "tree-direct-rd"),
                        env=FORCED[forced],
                        timeout=90)
    for r in range(1, world):
        for a, b in zip(results[0], results[r]):
            assert a == b, f"all_reduce result differs between rank 0 and rank {r}: {a} vs {b}"


# -- gather, scatter, all_to_all, barrier ------------------------------------------------

def _rooted(rank, world):
    for dtype in DTYPES:
        for n in SIZES:
            shp = shape_of(n)
            for root in (range(world) if n in (0, 7) else [(n + DTYPES.index(dtype)) % world]):
                # gather, even
                mine = data(dtype, shp, 20, root, rank)
                outs = [np.zeros(shp, dtype) for _ in range(world)] if rank == root else None
                assert dist.gather(mine, outs, dst=root) is None
                if rank == root:
                    for r in range(world):
                        same(outs[r], data(dtype, shp, 20, root, r), f"gather {dtype} {n} {r}")
                # gather, uneven first dimension
                mine = data(dtype, (n + rank, 2), 21, root, rank)
                outs = ([np.zeros((n + r, 2), dtype) for r in range(world)]
                        if rank == root else None)
                dist.gather(mine, gather_list=outs, dst=root)
                if rank == root:
                    for r in range(world):
                        same(outs[r], data(dtype, (n + r, 2), 21, root, r),
                             f"uneven gather {dtype} {n} root={root} {r}")
                # scatter, even
                ins = ([data(dtype, shp, 22, root, r) for r in range(world)]
                       if rank == root else None)
                x = np.zeros(shp, dtype)
                assert dist.scatter(x, ins, src=root) is None
                same(x, data(dtype, shp, 22, root, rank), f"scatter {dtype} {n} root={root}")
                # scatter, uneven
                ins = ([data(dtype, (n + 2 * r,), 23, root, r) for r in range(world)]
                       if rank == root else None)
                x = np.zeros(n + 2 * rank, dtype)
                dist.scatter(x, scatter_list=ins, src=root)
                same(x, data(dtype, (n + 2 * rank,), 23, root, rank), f"uneven scatter {dtype}")
            # all_to_all with per-pair sizes: rank i sends f(i, j) rows to rank j
            f = lambda i, j: (n + 3 * i + j) % (n + 3) if n else (i + 2 * j) % 3
            ins = [data(dtype, (f(rank, j), 2), 24, rank, j) for j in range(world)]
            outs = [np.zeros((f(j, rank), 2), dtype) for j in range(world)]
            assert dist.all_to_all(outs, ins) is None
            for j in range(world):
                same(outs[j], data(dtype, (f(j, rank), 2), 24, j, rank), f"all_to_all {dtype} {j}")
            # all_to_all_single, even
            inp = data(dtype, (world * n, 3), 25, rank)
            out = np.zeros((world * n, 3), dtype)
            assert dist.all_to_all_single(out, inp) is None
            want = np.concatenate([data(dtype, (world * n, 3), 25, j)[rank * n:(rank + 1) * n]
                                   for j in range(world)])
            same(out, want, f"all_to_all_single {dtype} n={n}")
            # all_to_all_single, uneven split sizes
            insp = [f(rank, j) for j in range(world)]
            outsp = [f(j, rank) for j in range(world)]
            inp = data(dtype, (sum(insp), 3), 26, rank)
            out = np.zeros((sum(outsp), 3), dtype)
            dist.all_to_all_single(out, inp, output_split_sizes=outsp, input_split_sizes=insp)
            parts = []
            for j in range(world):
                src = data(dtype, (sum(f(j, k) for k in range(world)), 3), 26, j)
                off = sum(f(j, k) for k in range(rank))
                parts.append(src[off:off + f(j, rank)])
            same(out, np.concatenate(parts), f"uneven all_to_all_single {dtype} n={n}")
        assert dist.barrier() is None
    return True


@pytest.mark.parametrize("world, transport", [(w, "auto") for w in WORLDS] + [(3, "tcp")])
def test_gather_scatter_all_to_all(world, transport):
    run_ranks(world, _rooted, timeout=60, env={"ACCORD_TRANSPORT": transport})


def _barrier(rank, world):
    import time
    if rank == world - 1:
        time.sleep(0.4)
    t0 = time.monotonic()
    dist.barrier()
    waited = time.monotonic() - t0
    if rank != world - 1:
        assert waited > 0.3, f"barrier returned after {waited:.3f} s, before the late rank came"
    return True


@pytest.mark.parametrize("world", [2, 5])
def test_barrier_waits_for_every_rank(world):
    run_ranks(world, _barrier, timeout=30)


# -- large messages: the bandwidth algorithms --------------------------------------------

def _large(rank, world):
    hashes = []
    # broadcast of 3 MiB + a few bytes (chain: several chunks, the last one short)
    for dtype, n in (("float32", (3 << 20) // 4 + 3), ("uint8", (1 << 20) + 1)):
        for root in sorted({0, world - 1}):
            x = data(dtype, (n,), 30, root) if rank == root else np.zeros(n, dtype)
            dist.broadcast(x, root)
            same(x, data(dtype, (n,), 30, root), f"large broadcast {dtype} root={root}")
    # all_reduce above 64 KiB: float (bit-identical across ranks) and int (exact)
    for dtype, n, op in (("float32", 300_001, dist.ReduceOp.SUM),
                         ("float64", 70_000, dist.ReduceOp.AVG),
                         ("int64", 100_003, dist.ReduceOp.SUM),
                         ("uint8", 1 << 17, dist.ReduceOp.BXOR),
                         ("float16", 50_001, dist.ReduceOp.MAX)):
        ins = [data(dtype, (n,), 31, r) for r in range(world)]
        x = ins[rank].copy()
        dist.all_reduce(x, op=op)
        close(x, reference(op, ins), f"large all_reduce {op!r} {dtype}", world)
        hashes.append(digest(x))
        for root in sorted({0, world - 1}):
            x = ins[rank].copy()
            dist.reduce(x, root, op=op)
            if rank == root:
                close(x, reference(op, ins), f"large reduce {dtype}", world)
            else:
                same(x, ins[rank], "large reduce changed a non-root input")
    # reduce_scatter_tensor, 1 MiB of float32 per rank
    n = (1 << 18) + 1
    ins = [data("float32", (world * n,), 32, r) for r in range(world)]
    out = np.zeros(n, np.float32)
    dist.reduce_scatter_tensor(out, ins[rank])
    close(out, reference(dist.ReduceOp.SUM, ins)[rank * n:(rank + 1) * n],
          "large reduce_scatter_tensor", world)
    # all_gather ring: uneven blocks of ~200 KiB
    mine = data("int32", (50_000 + 7 * rank,), 33, rank)
    outs = [np.zeros(50_000 + 7 * r, np.int32) for r in range(world)]
    dist.all_gather(outs, mine)
    for r in range(world):
        same(outs[r], data("int32", (50_000 + 7 * r,), 33, r), f"large all_gather {r}")
    # gather, scatter, all_to_all_single of 1 MiB blocks (more than a socket buffer)
    n = (1 << 18) + 3
    mine = data("float32", (n,), 34, rank)
    outs = [np.zeros(n, np.float32) for _ in range(world)] if rank == 0 else None
    dist.gather(mine, outs, dst=0)
    if rank == 0:
        for r in range(world):
            same(outs[r], data("float32", (n,), 34, r), "large gather")
    x = np.zeros(n, np.float32)
    dist.scatter(x, [data("float32", (n,), 35, r) for r in range(world)]
                 if rank == world - 1 else None, src=world - 1)
    same(x, data("float32", (n,), 35, rank), "large scatter")
    inp = data("int64", (world * 150_001,), 36, rank)
    out = np.zeros(world * 150_001, np.int64)
    dist.all_to_all_single(out, inp)
    want = np.concatenate([data("int64", (world * 150_001,), 36, j)[rank * 150_001:
                                                                      (rank + 1) * 150_001]
                           for j in range(world)])
    same(out, want, "large all_to_all_single")
    return hashes


@pytest.mark.parametrize("world, forced", params(worlds=[2, 3, 5]) + [
    pytest.param(4, "default", id="w4-default")])
def test_large_messages(world, forced):
    results = run_ranks(world, _large, env=FORCED[forced], timeout=120)
    for r in range(1, world):
        assert results[r] == results[0], f"large all_reduce differs on rank {r}"


def test_algorithm_table_picks_the_bandwidth_paths_for_large_messages():
    from types import SimpleNamespace

    from accord.algorithms import all_gather, broadcast, reduction, single_copy, slotted
    from accord.algorithms.table import ALGORITHMS, choose, entry
    tcp4 = SimpleNamespace(rank=0, size=4, peer_memory=None, slots=None, fans_out=False,
                           choices={})
    assert choose("broadcast", 256 << 10, tcp4, {}) is broadcast.chain
    assert choose("broadcast", 8, tcp4, {}) is broadcast.tree
    # a power of two of ranks halves and doubles (log2(n) steps a phase); others ring
    assert choose("all_reduce", 64 << 10, tcp4, {}) is reduction.halving_doubling
    assert choose("all_reduce", 8, tcp4, {}) is reduction.recursive_doubling
    assert choose("all_gather", 64 << 10, tcp4, {}) is all_gather.doubling
    tcp3 = SimpleNamespace(rank=0, size=3, peer_memory=None, slots=None, fans_out=False,
                           choices={})
    assert choose("all_reduce", 64 << 10, tcp3, {}) is reduction.ring_allreduce
    assert choose("all_gather", 64 << 10, tcp3, {}) is all_gather.ring
    assert choose("all_gather", 64 << 10, tcp4, {"all_gather": "ring"}) is all_gather.ring
    assert choose("all_gather", 64 << 10, SimpleNamespace(rank=0, size=2, peer_memory=None,
                                                          slots=None, fans_out=False,
                                                          choices={}), {}) \
        is all_gather.direct
    assert choose("all_reduce", 8, tcp4, {"all_reduce": "ring"}) is reduction.ring_allreduce
    with pytest.raises(ValueError, match="all_reduce"):
        choose("all_reduce", 8, tcp4, {"all_reduce": "nope"})
    # a choice is kept for the links it was made for, asked again or not
    assert tcp4.choices[("broadcast", 8)].fn is broadcast.tree
    assert choose("broadcast", 8, tcp4, {}) is broadcast.tree
    # single copy where the peers' memory allows it; forcing it elsewhere changes nothing
    pm = SimpleNamespace(min_bytes=1 << 20, everywhere=True, usable=lambda p: True)
    slots = SimpleNamespace(room=1 << 20)
    shm4 = SimpleNamespace(rank=0, size=4, peer_memory=pm, slots=slots, fans_out=True,
                           choices={})
    assert choose("broadcast", 16 << 20, shm4, {}) is single_copy.broadcast
    # shared slots beyond two ranks: broadcasts from 256 KiB up to single copy's size,
    # all-gathers of blocks from 512 KiB to two pieces, all-reduces from 2 to 4 MiB;
    # forced, at any size
    assert choose("broadcast", 1 << 20, shm4, {}) is slotted.broadcast
    assert choose("broadcast", 200 << 10, shm4, {}) is broadcast.tree
    assert choose("all_gather", 4 << 20, shm4, {}) is slotted.all_gather
    assert choose("all_gather", 1 << 20, shm4, {}) is all_gather.doubling
    assert choose("all_gather", 8 << 20, shm4, {}) is slotted.all_gather
    assert choose("all_gather", (8 << 20) + 4, shm4, {}) is all_gather.doubling
    assert choose("all_gather", 64 << 20, shm4, {"all_gather": "slotted"}) is \
        slotted.all_gather
    assert choose("all_gather", 8, shm4, {"all_gather": "slotted"}) is slotted.all_gather
    assert choose("broadcast", 1 << 20, tcp4, {"broadcast": "slotted"}) is broadcast.chain
    assert choose("broadcast_list", 1 << 20, shm4, {}) is slotted.broadcast_list
    assert choose("broadcast_list", 16 << 20, shm4, {}) is single_copy.broadcast_list
    assert choose("all_reduce", 2 << 20, shm4, {}) is slotted.all_reduce
    assert choose("all_reduce", (2 << 20) - 4, shm4, {}) is reduction.halving_doubling
    assert choose("all_reduce", 512 << 10, shm4, {}) is reduction.halving_doubling
    assert choose("all_reduce", 4 << 20, shm4, {}) is slotted.all_reduce
    assert choose("all_reduce", 16 << 20, shm4, {}) is reduction.halving_doubling
    shm3 = SimpleNamespace(rank=0, size=3, peer_memory=pm, slots=slots, fans_out=True,
                           choices={})
    assert choose("all_reduce", 1 << 20, shm3, {}) is reduction.ring_allreduce
    # three ranks: a broadcast through the slots from 1 MiB, a list from 256 KiB
    assert choose("broadcast", 512 << 10, shm3, {}) is broadcast.chain
    assert choose("broadcast", 1 << 20, shm3, {}) is slotted.broadcast
    assert choose("broadcast_list", 512 << 10, shm3, {}) is slotted.broadcast_list
    # slotted cannot run a call this small: the default runs it
    assert choose("all_reduce", 8, shm3, {"all_reduce": "slotted"}) is \
        reduction.gather_reduce
    # the one-step algorithms run where forced, at any size and world
    assert choose("all_reduce", 64 << 10, tcp4, {"all_reduce": "gather_reduce"}) is \
        reduction.gather_reduce
    rs = ALGORITHMS["reduce_scatter"]
    assert entry("reduce_scatter", 8, shm3, {}) is rs["direct"]
    assert entry("reduce_scatter", 8, shm3, {"reduce_scatter": "doubling"}) is rs["doubling"]
    # reduce_scatter alone takes the slots from 1 MiB in all, before all_reduce does
    assert entry("reduce_scatter", 1 << 20, shm4, {}) is rs["slotted"]
    assert entry("reduce_scatter", (1 << 20) - 4, shm4, {}) is rs["halving"]
    assert entry("reduce_scatter", (4 << 20) + 4, shm4, {}) is rs["halving"]
    assert choose("broadcast", 16 << 20, tcp4, {"broadcast": "single_copy"}) is broadcast.chain
    assert choose("broadcast_list", 16 << 20, shm4, {}) is single_copy.broadcast_list
    # forcing broadcast sends lists down the chain too
    assert choose("broadcast_list", 16 << 20, shm4, {"broadcast": "tree"}) is \
        broadcast.chain_pieces
    # a small list goes down the tree (log2(n) hops), a large one down the chain
    assert choose("broadcast_list", 200 << 10, tcp4, {}) is broadcast.tree_pieces
    assert choose("broadcast_list", 1 << 20, tcp4, {}) is broadcast.chain_pieces


def test_the_one_step_algorithms_where_the_table_chooses_them():
    # a small all_reduce or reduce_scatter of a group that is not a power of two, over
    # shared memory: one step (moving at most 48 KiB in all); over TCP and at world 4
    # as before
    from types import SimpleNamespace

    from accord.algorithms import reduction, table

    def links(size, fans_out):
        return SimpleNamespace(rank=0, size=size, peer_memory=None, slots=None,
                               fans_out=fans_out, choices={})
    shm3, tcp3, shm4 = links(3, True), links(3, False), links(4, True)
    assert table.choose("all_reduce", 8, shm3, {}) is reduction.gather_reduce
    assert table.choose("all_reduce", 8 << 10, shm3, {}) is reduction.gather_reduce
    assert table.choose("all_reduce", (8 << 10) + 4, shm3, {}) is \
        reduction.recursive_doubling
    assert table.choose("all_reduce", 8, tcp3, {}) is reduction.recursive_doubling
    assert table.choose("all_reduce", 8, shm4, {}) is reduction.recursive_doubling
    rs = table.ALGORITHMS["reduce_scatter"]
    assert table.entry("reduce_scatter", 24 << 10, shm3, {}) is rs["direct"]
    assert table.entry("reduce_scatter", (24 << 10) + 4, shm3, {}) is rs["ring"]
    assert table.entry("reduce_scatter", 8, tcp3, {}) is rs["doubling"]
    assert table.entry("reduce_scatter", 8, shm4, {}) is rs["doubling"]


def _gather_in_place(rank, world):
    n = 5000
    out = np.zeros(n * world, np.float32)
    mine = out[rank * n:(rank + 1) * n]
    mine[:] = np.arange(n) + 1000 * rank
    dist.all_gather_into_tensor(out, mine)         # the input is this rank's own block
    want = np.concatenate([np.arange(n) + 1000 * r for r in range(world)]).astype(np.float32)
    return bool(np.array_equal(out, want))


@pytest.mark.parametrize("world", [2, 3])
def test_all_gather_into_tensor_in_place(world):
    assert run_ranks(world, _gather_in_place, timeout=60) == [True] * world
