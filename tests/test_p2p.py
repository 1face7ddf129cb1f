"""Point to point: send/recv/isend/irecv, tags (matched out of order), sizes, dtypes."""
import numpy as np
import pytest

import accord as dist
from harness import run_ranks

pytestmark = pytest.mark.timeout(60)

DTYPES = ["bool", "int8", "uint8", "int32", "int64", "uint64", "float16", "float32", "float64",
          "complex64"]


def payload(dtype, n, *seed):
    """Random bytes of n elements (floats may be any bit pattern: compared as bytes)."""
    rng = np.random.default_rng([n, *seed])
    if dtype == "bool":
        return rng.random(n) < 0.5
    return rng.integers(0, 256, size=n * np.dtype(dtype).itemsize, dtype=np.uint8).view(dtype)


def _pairs(rank, world):
    # every ordered pair, every dtype, sizes 0 / 1 / odd / 1 MiB+ (more than a socket buffer)
    for src in range(world):
        for dst in range(world):
            if src == dst:
                continue
            for dtype in DTYPES:
                for n in (0, 1, 7, 1001):
                    if rank == src:
                        dist.send(payload(dtype, n, src, dst), dst=dst, tag=n)
                    elif rank == dst:
                        x = np.zeros(n, dtype)
                        assert dist.recv(x, src=src, tag=n) == src
                        assert x.tobytes() == payload(dtype, n, src, dst).tobytes(), \
                            (src, dst, dtype, n)
    n = (1 << 18) + 5
    if rank == 0:
        dist.send(payload("float32", n, 9), dst=world - 1)
    elif rank == world - 1:
        x = np.zeros(n, np.float32)
        dist.recv(x, src=0)
        assert x.tobytes() == payload("float32", n, 9).tobytes()
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_send_recv_every_pair(world):
    run_ranks(world, _pairs, timeout=40)


def _tags(rank, world):
    if rank == 0:
        dist.send(np.array([1, 1, 1]), dst=1, tag=1)
        dist.send(np.array([2, 2]), dst=1, tag=2)
        # large messages too, so the first one cannot simply sit in a socket buffer
        dist.isend(np.full(1 << 19, 3, np.int32), dst=1, tag=3)
        w = dist.isend(np.full(1 << 19, 4, np.int32), dst=1, tag=4)
        w.wait()
    elif rank == 1:
        b = np.zeros(2, np.int64)
        a = np.zeros(3, np.int64)
        dist.recv(b, src=0, tag=2)          # tag 2 first, though tag 1 was sent first
        dist.recv(a, src=0, tag=1)
        assert a.tolist() == [1, 1, 1] and b.tolist() == [2, 2]
        d = np.zeros(1 << 19, np.int32)
        c = np.zeros(1 << 19, np.int32)
        wd = dist.irecv(d, src=0, tag=4)
        wc = dist.irecv(c, src=0, tag=3)
        wd.wait()
        wc.wait()
        assert (c == 3).all() and (d == 4).all()
    # tags do not leak between ranks: every rank then does a collective
    x = np.array([rank])
    dist.all_reduce(x)
    assert x[0] == sum(range(world))
    return True


def test_out_of_order_tags():
    run_ranks(3, _tags, timeout=30)


def _ring(rank, world):
    # everyone isends a large buffer right and irecvs from the left at the same time
    n = (1 << 19) + 3
    right, left = (rank + 1) % world, (rank - 1) % world
    got = np.zeros(n, np.float64)
    # (a per-call timeout, so that a deadlock fails in seconds, not at the test's deadline)
    ws = dist.isend(np.full(n, float(rank)), dst=right, tag=7, timeout=10)
    wr = dist.irecv(got, src=left, tag=7, timeout=10)
    assert ws.wait() is True and wr.wait() is True
    assert (got == left).all()
    assert wr.is_completed() and wr.exception() is None
    # sync send/recv in an order that works only if sends of small messages do not block
    small = np.zeros(4, np.int16)
    dist.send(np.full(4, rank, np.int16), dst=right)
    dist.recv(small, src=left)
    assert (small == left).all()
    # p2p interleaved with collectives on the same group
    for i in range(5):
        if rank % 2 == 0 and rank + 1 < world:
            dist.send(np.array([i, rank]), dst=rank + 1, tag=i)
        elif rank % 2 == 1:
            v = np.zeros(2, np.int64)
            dist.recv(v, src=rank - 1, tag=i)
            assert v.tolist() == [i, rank - 1]
        y = np.array([i])
        dist.broadcast(y, src=i % world)
        assert y[0] == i
    return True


@pytest.mark.parametrize("transport", ["auto", "tcp"])
@pytest.mark.parametrize("world", [2, 3, 5])
def test_ring_of_isend_irecv(world, transport):
    run_ranks(world, _ring, timeout=40, env={"ACCORD_TRANSPORT": transport})


def _bad_p2p(rank, world):
    x = np.zeros(3)
    with pytest.raises(ValueError, match="dst"):
        dist.send(x, dst=rank)
    with pytest.raises(ValueError, match="dst"):
        dist.send(x, dst=world)
    with pytest.raises(ValueError, match="src"):
        dist.recv(x, src=-1)
    with pytest.raises(TypeError, match="tag"):
        dist.send(x, dst=(rank + 1) % world, tag="a")
    with pytest.raises(ValueError, match="tensor"):
        ro = np.zeros(3)
        ro.flags.writeable = False
        dist.recv(ro, src=(rank + 1) % world)
    # nothing moved: a real exchange still works
    if rank == 0:
        dist.send(np.arange(3.0), dst=1, tag=5)
    elif rank == 1:
        dist.recv(x, src=0, tag=5)
        assert x.tolist() == [0.0, 1.0, 2.0]
    dist.barrier()
    return True


def test_bad_p2p_arguments():
    run_ranks(2, _bad_p2p, timeout=30)


def _any_source(rank, world, transport):
    n = 1000
    if rank == 0:
        got = {}
        for _ in range(world - 1):
            buf = np.zeros(n, np.int64)
            src = dist.recv(buf, tag=5)
            got[src] = buf.copy()
        # a tagged message from a known source still matches by tag, not by arrival
        w = dist.irecv(np.zeros(n, np.int64), tag=9)
        return sorted(got), all((got[s] == s).all() for s in got), w.wait(), w.result()
    dist.send(np.full(n, rank, np.int64), dst=0, tag=5)
    if rank == world - 1:
        dist.send(np.full(n, 7, np.int64), dst=0, tag=9)
    return None


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_recv_from_any_source_returns_the_sender(transport):
    out = run_ranks(4, _any_source, transport, timeout=60, env={"ACCORD_TRANSPORT": transport})
    srcs, data_ok, waited, sender = out[0]
    assert srcs == [1, 2, 3] and data_ok and waited is True and sender == 3
