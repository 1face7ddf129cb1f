"""What a "tensor" may be: torch CPU tensors (bfloat16 included), non-contiguous numpy
arrays (results written back in place), bytearray and array.array buffers."""
import array
import hashlib
import zlib

import numpy as np
import pytest

import accord as dist
from harness import run_ranks

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.timeout(90)

TORCH_DTYPES = [torch.bool, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
                torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64]


def tdata(dtype, shape, *seed):
    g = torch.Generator().manual_seed(zlib.crc32(repr((str(dtype), tuple(shape), seed)).encode()))
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) < 0.5
    if not dtype.is_floating_point and not dtype.is_complex:
        info = torch.iinfo(dtype)
        return torch.randint(max(info.min, -1000), min(info.max, 1000) + 1, shape,
                             generator=g, dtype=torch.int64).to(dtype)
    return (torch.rand(shape, generator=g, dtype=torch.float64) * 4 - 2).to(dtype)


def tsame(got, want, what):
    assert isinstance(got, torch.Tensor), what
    assert got.dtype == want.dtype and got.shape == want.shape, \
        f"{what}: {got.dtype}{list(got.shape)} != {want.dtype}{list(want.shape)}"
    if got.dtype == torch.bfloat16:
        g, w = got.view(torch.int16), want.view(torch.int16)
    else:
        g, w = got, want
    if not torch.equal(g.contiguous(), w.contiguous()):
        raise AssertionError(f"{what}: got {got.reshape(-1)[:8].tolist()} "
                             f"want {want.reshape(-1)[:8].tolist()}")


def tdigest(t):
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return hashlib.sha1(t.contiguous().numpy().tobytes()).hexdigest()


# -- torch tensors through every collective ------------------------------------------------

def _torch_collectives(rank, world):
    hashes = []
    for dtype in TORCH_DTYPES:
        for n in (0, 1, 7, 1001):
            shp = (n,) if n < 1000 else (7, 143)
            for root in range(world):
                t = tdata(dtype, shp, 1, root) if rank == root else torch.zeros(shp, dtype=dtype)
                dist.broadcast(t, src=root)
                tsame(t, tdata(dtype, shp, 1, root), f"broadcast {dtype} n={n} root={root}")
            outs = [torch.zeros(n + r, dtype=dtype) for r in range(world)]
            dist.all_gather(outs, tdata(dtype, (n + rank,), 2, rank))
            for r in range(world):
                tsame(outs[r], tdata(dtype, (n + r,), 2, r), f"all_gather {dtype} n={n}")
            out = torch.zeros(world * n, dtype=dtype)
            dist.all_gather_into_tensor(out, tdata(dtype, (n,), 3, rank))
            tsame(out, torch.cat([tdata(dtype, (n,), 3, r) for r in range(world)]),
                  f"all_gather_into_tensor {dtype}")
            root = n % world
            x = torch.zeros(n + rank, dtype=dtype)
            dist.scatter(x, [tdata(dtype, (n + r,), 4, r) for r in range(world)]
                         if rank == root else None, src=root)
            tsame(x, tdata(dtype, (n + rank,), 4, rank), f"scatter {dtype}")
            gl = [torch.zeros(shp, dtype=dtype) for _ in range(world)] if rank == root else None
            dist.gather(tdata(dtype, shp, 5, rank), gl, dst=root)
            if rank == root:
                for r in range(world):
                    tsame(gl[r], tdata(dtype, shp, 5, r), f"gather {dtype}")
            inp = tdata(dtype, (world * n, 2), 6, rank)
            out = torch.zeros(world * n, 2, dtype=dtype)
            dist.all_to_all_single(out, inp)
            tsame(out, torch.cat([tdata(dtype, (world * n, 2), 6, j)[rank * n:(rank + 1) * n]
                                  for j in range(world)]), f"all_to_all_single {dtype}")
            # reductions
            ops = [dist.ReduceOp.SUM, dist.ReduceOp.MAX]
            if dtype.is_floating_point:
                ops.append(dist.ReduceOp.AVG)
            if dtype.is_complex:
                ops = [dist.ReduceOp.SUM, dist.ReduceOp.AVG]
            for op in ops:
                ins = [tdata(dtype, shp, 7, int(op), r) for r in range(world)]
                if dtype == torch.bool:
                    want = torch.stack(ins).any(0)
                elif op == dist.ReduceOp.MAX:
                    want = torch.stack(ins).amax(0)
                else:
                    acc = torch.stack(ins).to(torch.complex128 if dtype.is_complex else
                                              torch.float64 if dtype.is_floating_point else
                                              torch.int64).sum(0)
                    if op == dist.ReduceOp.AVG:
                        acc = acc / world
                    want = acc.to(dtype)
                x = ins[rank].clone()
                dist.all_reduce(x, op=op)
                what = f"all_reduce {op!r} {dtype} n={n}"
                if dtype.is_floating_point or dtype.is_complex:
                    tol = 0.05 * world if dtype in (torch.bfloat16, torch.float16) else 1e-5
                    assert x.dtype == dtype and x.shape == want.shape, what
                    assert torch.allclose(x.to(torch.complex128 if dtype.is_complex
                                               else torch.float64),
                                          want.to(torch.complex128 if dtype.is_complex
                                                  else torch.float64),
                                          rtol=tol, atol=tol), what
                else:
                    tsame(x, want, what)
                hashes.append(tdigest(x))
                x = ins[rank].clone()
                dist.reduce(x, dst=root, op=op)
                if rank != root:
                    tsame(x, ins[rank], "reduce changed a non-root input")
            out = torch.zeros(n, dtype=dtype)
            ins = [tdata(dtype, (world * n,), 8, r) for r in range(world)]
            if dtype.is_complex:
                dist.reduce_scatter_tensor(out, ins[rank])
                want = torch.stack(ins).to(torch.complex128).sum(0)
                assert torch.allclose(out.to(torch.complex128), want[rank * n:(rank + 1) * n],
                                      atol=1e-5), "reduce_scatter_tensor complex64"
                continue
            else:
                dist.reduce_scatter_tensor(out, ins[rank], op=dist.ReduceOp.MAX)
                want = torch.stack(ins).any(0) if dtype == torch.bool else torch.stack(ins).amax(0)
            tsame(out, want[rank * n:(rank + 1) * n], f"reduce_scatter_tensor {dtype}")
    # 0-d tensors, and a tensor that requires grad (its data is written in place)
    t = torch.tensor(float(rank + 1), dtype=torch.bfloat16)
    dist.all_reduce(t)
    assert t.item() == world * (world + 1) / 2
    p = torch.nn.Parameter(torch.full((3,), float(rank)))
    dist.broadcast(p, src=world - 1)
    assert p.requires_grad and p.tolist() == [float(world - 1)] * 3
    return hashes


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_torch_tensors(world):
    results = run_ranks(world, _torch_collectives, timeout=60)
    for r in range(1, world):
        assert results[r] == results[0], f"all_reduce results differ on rank {r}"


def _bf16_known_values(rank, world):
    # 1 + 2^-8 is not a bfloat16: results must be rounded as torch rounds them
    x = torch.tensor([1.0, 256.0, -3.5, 1e38, float("inf")], dtype=torch.bfloat16)
    y = x.clone() * (rank + 1)
    dist.all_reduce(y)
    want = (x.to(torch.float32) * sum(range(1, world + 1))).to(torch.bfloat16)
    tsame(y, want, "bf16 all_reduce")
    z = torch.tensor([0.00390625 * rank], dtype=torch.bfloat16)    # 2^-8 * rank
    dist.all_reduce(z, op=dist.ReduceOp.MAX)
    tsame(z, torch.tensor([0.00390625 * (world - 1)], dtype=torch.bfloat16), "bf16 max")
    return True


def test_bfloat16_rounding_matches_torch():
    run_ranks(2, _bf16_known_values, timeout=30)


# -- non-contiguous numpy arrays and torch tensors: results written back --------------------

def _noncontiguous(rank, world):
    root = world - 1
    # broadcast into every other element; the gaps stay untouched
    base = np.full(20, -1, np.int32)
    if rank == root:
        base[::2] = np.arange(10)
    dist.broadcast(base[::2], src=root)
    assert base[::2].tolist() == list(range(10)), base
    if rank != root:
        assert (base[1::2] == -1).all(), base
    # all_reduce into a transposed 2-d array
    m = (np.arange(12, dtype=np.float64).reshape(3, 4) * (rank + 1)).T
    assert not m.flags.c_contiguous
    dist.all_reduce(m)
    assert np.array_equal(m, (np.arange(12.0).reshape(3, 4) * world * (world + 1) / 2).T)
    # all_gather from a strided input into transposed outputs
    src = np.arange(40, dtype=np.int64).reshape(5, 8) + 100 * rank
    outs = [np.zeros((4, 5), np.int64).T for _ in range(world)]
    dist.all_gather(outs, src[:, ::2])
    for r in range(world):
        assert np.array_equal(outs[r], (np.arange(40).reshape(5, 8) + 100 * r)[:, ::2])
    # all_gather_into_tensor into a strided output
    big = np.zeros(world * 6, np.int16)
    dist.all_gather_into_tensor(big[::2], np.full(3, rank, np.int16))
    assert big[::2].tolist() == [r for r in range(world) for _ in range(3)]
    assert (big[1::2] == 0).all()
    # reduce: the root's result written back; a non-root strided input stays
    v = np.arange(10, dtype=np.float32)[::-1] + rank
    keep = v.copy()
    dist.reduce(v, dst=0)
    if rank == 0:
        assert np.array_equal(v, world * np.arange(10, dtype=np.float32)[::-1] + sum(range(world)))
    else:
        assert np.array_equal(v, keep)
    # scatter / gather with strided pieces
    s = np.zeros((4, 2), np.uint8)
    dist.scatter(s.T, [np.full((2, 4), r + 1, np.uint8)[:, ::-1] for r in range(world)]
                 if rank == root else None, src=root)
    assert (s == rank + 1).all()
    gl = [np.zeros((6, 2), np.float32)[::2] for _ in range(world)] if rank == 0 else None
    dist.gather(np.full((2, 3), rank, np.float32).T, gl, dst=0)
    if rank == 0:
        for r in range(world):
            assert (gl[r] == r).all()
    # reduce_scatter_tensor and all_to_all_single with strided outputs
    o = np.zeros(6, np.int32)
    dist.reduce_scatter_tensor(o[::2], np.arange(3 * world, dtype=np.int32)[::-1].copy())
    assert o[::2].tolist() == [world * (3 * world - 1 - i) for i in range(3 * rank, 3 * rank + 3)]
    o = np.zeros((world, 2), np.int64)
    dist.all_to_all_single(o.T.T[:, ::-1], np.arange(2 * world).reshape(world, 2) + 10 * rank)
    assert o[:, ::-1].tolist() == [[10 * j + 2 * rank, 10 * j + 2 * rank + 1]
                                   for j in range(world)]
    # torch tensors: t[::2] and t.T written back
    t = torch.zeros(10, dtype=torch.float32)
    if rank == root:
        t[::2] = torch.arange(5, dtype=torch.float32)
    dist.broadcast(t[::2], src=root)
    assert t[::2].tolist() == [0, 1, 2, 3, 4] and t[1::2].abs().sum() == 0
    tt = (torch.arange(6, dtype=torch.bfloat16).reshape(2, 3) + rank).T
    dist.all_reduce(tt)
    assert tt.tolist() == ((torch.arange(6.0).reshape(2, 3) * world
                            + sum(range(world))).T).tolist()
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_noncontiguous_inputs_and_outputs(world):
    run_ranks(world, _noncontiguous, timeout=30)


# -- plain buffers ------------------------------------------------------------------------

def _buffers(rank, world):
    b = bytearray(b"hello accord" if rank == 0 else bytes(12))
    dist.broadcast(b, src=0)
    assert b == bytearray(b"hello accord")
    a = array.array("i", [rank, 2 * rank, -rank])
    dist.all_reduce(a)
    s = sum(range(world))
    assert a.tolist() == [s, 2 * s, -s]
    d = array.array("d", [rank + 0.5] * 5)
    dist.all_reduce(d, op=dist.ReduceOp.MAX)
    assert d.tolist() == [world - 0.5] * 5
    outs = [bytearray(3) for _ in range(world)]
    dist.all_gather(outs, bytes([rank] * 3))               # read-only input is fine
    assert [list(o) for o in outs] == [[r] * 3 for r in range(world)]
    mv = memoryview(bytearray(4 * world))
    dist.all_gather_into_tensor(mv, array.array("B", [rank, rank, 7, 7]))
    assert list(mv) == [v for r in range(world) for v in (r, r, 7, 7)]
    # the uint16 buffer in a byte-array: sizes are counted in its own elements
    out = array.array("H", [0] * 2)
    dist.scatter(out, [array.array("H", [r, 1000 + r]) for r in range(world)]
                 if rank == 0 else None, src=0)
    assert out.tolist() == [rank, 1000 + rank]
    # a root only reads: read-only sources (bytes, read-only arrays) are fine there
    got = bytearray(2)
    dist.scatter(got, [bytes([r, r + 1]) for r in range(world)] if rank == 0 else None, src=0)
    assert list(got) == [rank, rank + 1]
    ro = np.arange(3.0)
    ro.flags.writeable = False
    got = np.zeros(3)
    dist.scatter(got, [ro + r for r in range(world)] if rank == world - 1 else None,
                 src=world - 1)
    assert got.tolist() == (np.arange(3.0) + rank).tolist()
    src = ro if rank == 0 else np.zeros(3)
    dist.broadcast(src, src=0)
    assert src.tolist() == [0.0, 1.0, 2.0]
    dist.broadcast(b"xyz" if rank == world - 1 else bytearray(3), src=world - 1)
    if world > 1:
        if rank == 0:
            dist.send(array.array("q", [1, 2, 3]), dst=1)
        elif rank == 1:
            got = array.array("q", [0, 0, 0])
            dist.recv(got, src=0)
            assert got.tolist() == [1, 2, 3]
    return True


@pytest.mark.parametrize("world", [1, 3])
def test_buffer_protocol_objects(world):
    run_ranks(world, _buffers, timeout=30)
