"""Object collectives, streamed in bounded chunks with out-of-band buffers."""
import numpy as np
import pytest

from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(180)


def _payload(rank):
    f = np.asfortranarray(np.arange(12.0).reshape(3, 4) + rank)
    ro = np.arange(50, dtype=np.int16) * rank
    ro.flags.writeable = False
    return {"rank": rank, "text": "x" * (rank * 37), "arr": np.arange(1000 + rank, dtype=np.float64),
            "fortran": f, "strided": np.arange(40.0)[::3] + rank, "ro": ro,
            "nested": [None, (rank, b"\x00" * rank), np.zeros(0, np.int8)],
            "big_ints": np.full(333, rank, np.int32)}


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], np.ndarray):
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
            assert a[k].dtype == b[k].dtype
        elif k == "nested":
            assert a[k][:2] == b[k][:2] and b[k][2].size == 0
        else:
            assert a[k] == b[k], k


def _all_four(rank, world, chunk):
    import accord
    import accord.objects
    if chunk:
        accord.objects.CHUNK_BYTES = chunk
    # broadcast_object_list from rank 1, with several objects of different sizes
    objs = [_payload(1), "hello", None, np.arange(7)] if rank == 1 else [None] * 4
    accord.broadcast_object_list(objs, src=1)
    _same(objs[0], _payload(1))
    assert objs[1:3] == ["hello", None] and objs[3].tolist() == list(range(7))
    # numpy arrays inside arrive as views of the received bytes, not second copies
    if rank != 1:
        assert not objs[0]["arr"].flags.owndata and objs[0]["arr"].flags.writeable
        assert objs[0]["arr"].ctypes.data % 64 == objs[0]["big_ints"].ctypes.data % 64
    # all_gather_object
    got = [None] * world
    accord.all_gather_object(got, _payload(rank))
    for r in range(world):
        _same(got[r], _payload(r))
    # gather_object to the last rank
    gl = [None] * world if rank == world - 1 else None
    accord.gather_object(_payload(rank), gl, dst=world - 1)
    if rank == world - 1:
        for r in range(world):
            _same(gl[r], _payload(r))
    # scatter_object_list from rank 0
    out = [None]
    accord.scatter_object_list(out, [_payload(10 + r) for r in range(world)] if rank == 0
                               else None, src=0)
    _same(out[0], _payload(10 + rank))
    return True


@pytest.mark.parametrize("chunk", [None, 100, 4096])
def test_object_collectives_chunked(chunk):
    assert run_ranks(3, _all_four, chunk) == [True] * 3


def _big(rank, world, nbytes):
    import accord
    if rank == 0:
        a = np.full(nbytes, 7, np.uint8)
        a[[0, 12345, nbytes // 2, nbytes - 1]] = [1, 2, 3, 4]
        objs = [{"blob": a, "note": "big"}]
    else:
        objs = [None]
    accord.broadcast_object_list(objs, src=0)
    if rank == 0:
        return True
    b = objs[0]["blob"]
    assert b.size == nbytes and objs[0]["note"] == "big"
    assert b[[0, 12345, nbytes // 2, nbytes - 1]].tolist() == [1, 2, 3, 4]
    assert int(np.count_nonzero(b == 7)) == nbytes - 4
    return True


def test_object_over_2gib():
    """A 2 GiB + 4 KiB array inside an object: no message beyond a chunk, no int32 sizes."""
    assert run_ranks(2, _big, (2 << 30) + 4096, timeout=150) == [True, True]
