"""ByteStream: buffers taken as one stream, copied range by range, whatever the cuts."""
import numpy as np
import pytest

from accord import byte_stream
from accord.byte_stream import ByteStream

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(params=["helper", "python"], autouse=True)
def copies(request, monkeypatch):
    """Every test twice: the C helper's copies (where it was built) and Python's."""
    if request.param == "helper":
        if byte_stream._views_copy is None:
            pytest.skip("the C helper is not built here (or ACCORD_COPY_HELPER=0)")
    else:
        monkeypatch.setattr(byte_stream, "_views_copy", None)
    return request.param


def _views(sizes, fill=None):
    bufs = [bytearray(n) if fill is None else bytearray(fill(i, n)) for i, n in enumerate(sizes)]
    return bufs, [memoryview(b) for b in bufs]


@pytest.mark.parametrize("sizes", [[5, 0, 17, 1, 0, 64, 3], [100], [0, 0, 9], []],
                         ids=["cut-and-empty", "one", "leading-empty", "none"])
@pytest.mark.parametrize("chunk", [1, 7, 64, 1 << 20])
@pytest.mark.parametrize("streaming", [False, True], ids=["memcpy", "streaming"])
def test_chunks_of_any_size_gather_and_scatter_the_whole_stream(sizes, chunk, streaming):
    rng = np.random.default_rng(len(sizes) * 1000 + chunk)
    src_bufs, src = _views(sizes, lambda i, n: rng.integers(0, 256, n, dtype=np.uint8).tobytes())
    dst_bufs, dst = _views(sizes)
    total = sum(sizes)
    gathered, scattered = ByteStream(src), ByteStream(dst)
    assert gathered.nbytes == total
    whole = bytearray()
    for lo in range(0, total, chunk):
        hi = min(total, lo + chunk)
        piece = memoryview(bytearray(hi - lo))
        gathered.gather(piece, lo, hi, streaming=streaming)
        whole += piece
        scattered.scatter(piece, lo, hi)
    assert bytes(whole) == b"".join(src_bufs)
    assert dst_bufs == src_bufs


def test_a_streaming_gather_lands_at_any_alignment():
    # streaming stores start at a 16-byte boundary: the bytes before it, the 64-byte
    # blocks and the tail each come from the right views
    rng = np.random.default_rng(5)
    src_bufs, src = _views([3, 200, 1, 77, 500],
                           lambda i, n: rng.integers(0, 256, n, dtype=np.uint8).tobytes())
    s = ByteStream(src)
    want = b"".join(src_bufs)
    for off in range(17):
        for lo in (0, 2, 150):
            mem = bytearray(len(want) + 32)
            s.gather(memoryview(mem)[off:off + len(want) - lo], lo, len(want), streaming=True)
            assert mem[off:off + len(want) - lo] == want[lo:], (off, lo)
            assert mem[:off] == bytes(off) and not any(mem[off + len(want) - lo:])


def test_a_range_inside_one_view_and_across_three():
    _, src = _views([4, 4, 4], lambda i, n: bytes([i * 10 + k for k in range(n)]))
    s = ByteStream(src)
    out = memoryview(bytearray(2))
    s.gather(out, 1, 3)
    assert bytes(out) == bytes([1, 2])
    out = memoryview(bytearray(6))
    s.gather(out, 3, 9)
    assert bytes(out) == bytes([3, 10, 11, 12, 13, 20])
    bufs, dst = _views([4, 4, 4])
    ByteStream(dst).scatter(memoryview(bytes([7, 8, 9, 10, 11, 12])), 3, 9)
    assert bufs == [bytearray([0, 0, 0, 7]), bytearray([8, 9, 10, 11]), bytearray([12, 0, 0, 0])]


def test_slice_assignment_scatters_and_len_is_the_byte_count():
    bufs, dst = _views([3, 0, 5])
    s = ByteStream(dst)
    assert len(s) == 8 and not s.contiguous
    s[2:6] = memoryview(bytes([1, 2, 3, 4]))
    assert bufs == [bytearray([0, 0, 1]), bytearray(), bytearray([2, 3, 4, 0, 0])]
    s[:] = bytes(range(10, 18))
    assert bufs == [bytearray([10, 11, 12]), bytearray(), bytearray([13, 14, 15, 16, 17])]
    with pytest.raises(ValueError, match="its own length"):
        s[0:4] = bytes(3)


def test_staged_swaps_only_streams_for_stand_ins_and_scatters_them_after():
    from accord.byte_stream import staged
    plain = memoryview(bytearray(2))
    assert staged([(1, plain)]) == ([(1, plain)], None)
    bufs, dst = _views([2, 3])
    recvs, finish = staged([(0, plain), (2, ByteStream(dst))])
    assert recvs[0] == (0, plain) and recvs[1][0] == 2 and len(recvs[1][1]) == 5
    recvs[1][1][:] = bytes([1, 2, 3, 4, 5])
    assert bufs == [bytearray(2), bytearray(3)]        # nothing until finish()
    finish()
    assert bufs == [bytearray([1, 2]), bytearray([3, 4, 5])]


def test_a_range_past_the_stream_or_a_short_buffer_is_refused():
    _, src = _views([4, 4], lambda i, n: bytes(n))
    s = ByteStream(src)
    with pytest.raises((ValueError, IndexError)):
        s.gather(memoryview(bytearray(2)), 3, 7)        # 4 bytes into a buffer of 2
    with pytest.raises((ValueError, IndexError)):
        s.gather(memoryview(bytearray(6)), 4, 10)       # past the stream's 8 bytes
