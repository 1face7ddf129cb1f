"""algorithms/segments.py: how a repeated broadcast_state's tensors are cut into the
segments of process_vm_readv / writev calls, run here against this process's own
memory (the system calls take any pid, this one's too).

Two "ranks" are two sets of arrays carved out of two big buffers, so that the gaps
between tensors are known: every byte of the root's tensors must arrive in the
receiver's, each once, and no byte of the receiver's buffer outside its tensors may
be written (the reader may read across a gap, the writer must not write one)."""
import os
import zlib

import numpy as np
import pytest

from accord.algorithms import segments
from accord.transport import cma

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not cma.AVAILABLE, reason="no process_vm_readv")]

PAGE = segments._PAGE


class _OwnMemory:
    """The PeerMemory methods segments.py and copy_segments use, over this process."""

    def __init__(self, max_segments=cma.IOV_MAX):
        self.max_segments = max_segments
        self.calls = []

    address = staticmethod(cma.address)
    segments = staticmethod(cma.iovecs)

    def read_segments(self, peer, local, remote, n):
        self.calls.append(("read", _pairs(local), _pairs(remote)))
        cma.read_segments(os.getpid(), local, remote, n)

    def write_segments(self, peer, local, remote, n):
        self.calls.append(("write", _pairs(local), _pairs(remote)))
        cma.write_segments(os.getpid(), local, remote, n)


def _pairs(iovecs):
    return [(v.iov_base, v.iov_len) for v in iovecs]


def _carve(buf, lengths, gaps, order):
    """Arrays of `lengths` bytes inside buf, placed in `order` (a permutation: the
    stream's i-th tensor is the order[i]-th in memory) with gaps[j] bytes before the
    j-th in memory; their (address, length) rows in stream order."""
    base = buf.ctypes.data
    at, where = 0, {}
    for j, i in enumerate(order):
        at += gaps[j]
        where[i] = at
        at += lengths[i]
    assert at <= buf.nbytes
    views = [buf[where[i]:where[i] + n] for i, n in enumerate(lengths)]
    rows = np.array([(base + where[i], n) for i, n in enumerate(lengths)], np.uint64)
    return views, rows.reshape(-1, 2)


def _layout(rng, n, small_first=True):
    lengths = rng.integers(1, 3000, n)
    if small_first:         # a state's packed small tensors come first
        lengths = np.sort(lengths)
        lengths[-n // 5:] = rng.integers(20_000, 200_000, n // 5)
    return [int(x) for x in lengths]


def _gaps(rng, n, kind):
    if kind == "touching":
        return [0] * n
    if kind == "heap":      # an allocator's headers, and now and then a page or more
        return [int(rng.choice([16, 48, 112, 5000, 3 * PAGE])) for _ in range(n)]
    return [int(rng.integers(0, 3 * PAGE)) for _ in range(n)]


def _copy(lengths, root_gaps, recv_gaps, root_order, recv_order, max_segments):
    """Both ranks' shares, computed as each rank computes its own, then copied."""
    room = sum(lengths) + sum(root_gaps) + sum(recv_gaps) + PAGE
    root_buf = np.random.default_rng(1).integers(0, 256, room, np.uint8)
    recv_buf = np.full(room, 0xEE, np.uint8)
    src, root_rows = _carve(root_buf, lengths, root_gaps, root_order)
    dst, recv_rows = _carve(recv_buf, lengths, recv_gaps, recv_order)
    outside = np.ones(room, bool)
    for v in dst:
        start = v.ctypes.data - recv_buf.ctypes.data
        outside[start:start + v.nbytes] = False
    pm = _OwnMemory(max_segments)
    total = sum(lengths)
    shares = {}
    for rank in (0, 1):     # root 0, receiver 1
        mine, theirs = (root_rows, recv_rows) if rank == 0 else (recv_rows, root_rows)
        shares[rank] = segments.segment_share(pm, 2, rank, 0, mine, theirs)
    for rank, batches in shares.items():
        for local, remote, n, _ in batches:
            (pm.write_segments if rank == 0 else pm.read_segments)(1 - rank, local, remote, n)
    scratch = {cma.address(memoryview(b[3])) for b in shares[1] if b[3] is not None}
    # the bytes that went into tensors, each side (the reader's minus those it dropped)
    copied = sum(n for op, local, _ in pm.calls for a, n in local if a not in scratch)
    return src, dst, recv_buf, outside, pm, total, copied, root_rows, recv_rows


@pytest.mark.parametrize("kind", ["touching", "heap", "random"])
@pytest.mark.parametrize("shuffled", [False, True])
@pytest.mark.parametrize("max_segments", [1024, 7])
def test_every_byte_arrives_once_and_nothing_outside_the_tensors_is_written(kind, shuffled,
                                                                             max_segments):
    rng = np.random.default_rng(zlib.crc32(repr((kind, shuffled, max_segments)).encode()))
    n = 300
    lengths = _layout(rng, n)
    orders = [rng.permutation(n) if shuffled else np.arange(n) for _ in range(2)]
    src, dst, recv_buf, outside, pm, total, copied, _, _ = _copy(
        lengths, _gaps(rng, n, kind), _gaps(rng, n, kind), orders[0], orders[1],
        max_segments)
    for i, (a, b) in enumerate(zip(src, dst)):
        np.testing.assert_array_equal(b, a, err_msg=f"tensor {i}")
    assert (recv_buf[outside] == 0xEE).all(), "a byte between the receiver's tensors changed"
    for _, local, remote in pm.calls:
        assert len(local) <= max_segments and len(remote) <= max_segments
    assert copied == total      # each byte once, the reader's dropped gaps aside


def test_the_reader_reads_across_small_gaps_in_one_segment_and_the_writer_does_not():
    n = 200
    lengths = [100] * n
    heap = [16] * n         # every tensor 16 bytes after the last: one run of pages
    _, _, _, _, pm, _, _, _, _ = _copy(lengths, heap, heap, np.arange(n), np.arange(n), 1024)
    ops = {op: remote for op, _, remote in pm.calls}
    assert len(ops["read"]) == 1, ops["read"]
    assert len(ops["write"]) > 1, ops["write"]
    # no written segment spans a gap: each is one tensor's bytes or less
    assert all(length <= 100 for _, length in ops["write"])


def test_the_reader_does_not_read_a_page_that_holds_none_of_its_bytes():
    rng = np.random.default_rng(3)
    n = 300
    lengths = [int(x) for x in rng.integers(1, 200, n)]
    gaps = [int(x) for x in rng.integers(0, 3 * PAGE, n)]
    _, _, _, _, pm, _, _, root_rows, _ = _copy(lengths, gaps, gaps, np.arange(n),
                                               np.arange(n), 1024)
    held = set()
    for a, length in root_rows.tolist():
        held |= set(range(a // PAGE, (a + length - 1) // PAGE + 1))
    spans = [seg for op, _, remote in pm.calls if op == "read" for seg in remote]
    inside = sum(1 for a, _ in root_rows.tolist()
                 if any(s <= a < s + length for s, length in spans))
    assert len(spans) < inside      # some tensors were read in one segment with others
    for addr, length in spans:
        pages = set(range(addr // PAGE, (addr + length - 1) // PAGE + 1))
        assert pages <= held, (addr, length, sorted(pages - held))


def test_two_ranks_cut_where_their_costs_meet_not_at_half_the_bytes():
    # 400 small tensors then 10 large: by bytes the receiver's half holds every small
    # one; the reader joins its small ones (they touch), while the writer's are apart
    lengths = [64] * 400 + [100_000] * 10
    n = len(lengths)
    root_gaps = [0] * n
    recv_gaps = [PAGE] * n
    _, _, _, _, pm, total, _, root_rows, recv_rows = _copy(
        lengths, root_gaps, recv_gaps, np.arange(n), np.arange(n), 1024)
    cut = segments._pair_cut(root_rows, recv_rows, total)
    # both ranks reach the same cut, whichever holds which table
    assert segments.segment_share(pm, 2, 0, 0, root_rows, recv_rows)[0][2] == total - cut
    assert segments.segment_share(pm, 2, 1, 0, recv_rows, root_rows)[0][2] >= cut

    def worst(c):
        r, w, _, _ = _costs(root_rows, recv_rows, total, c)
        return max(r, w)
    assert worst(cut) < worst(total // 2)
    assert abs(_costs(root_rows, recv_rows, total, cut)[0] -
               _costs(root_rows, recv_rows, total, cut)[1]) <= 2 * segments.SEGMENT_COST + \
        max(lengths)


def _remote_count(there, reading):
    """How many remote segments `there` ([(address, length)]) makes once joined: the
    exact count, where the cut itself estimates (segments._segment_costs)."""
    count, end = 0, None
    for a, n in sorted(there):
        if end is None or not segments._may_join(end, a, reading):
            count += 1
        end = a + n
    return count


def _costs(root_rows, recv_rows, total, cut):
    _, there = segments._rows_in(recv_rows, root_rows, 0, cut)
    _, there_w = segments._rows_in(root_rows, recv_rows, cut, total)
    a = _remote_count(there, True)
    b = _remote_count(there_w, False)
    return cut + segments.SEGMENT_COST * a, total - cut + segments.SEGMENT_COST * b, a, b


def test_more_than_two_ranks_each_receiver_reads_the_whole_stream_and_the_root_none():
    rng = np.random.default_rng(5)
    lengths = _layout(rng, 50)
    buf = np.zeros(sum(lengths) + 50 * 64, np.uint8)
    _, rows = _carve(buf, lengths, [64] * 50, np.arange(50))
    pm = _OwnMemory()
    assert segments.segment_peers(3, 0, 0) == [] and segments.segment_peers(3, 2, 0) == [0]
    assert segments.segment_share(pm, 3, 0, 0, rows, rows) == []
    got = segments.segment_share(pm, 3, 2, 0, rows, rows)
    assert sum(n for _, _, n, _ in got) >= sum(lengths)


def test_the_benchmark_runs_and_prints_every_way():
    import re
    import subprocess
    import sys
    torch = pytest.importorskip("torch")
    assert torch
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-m", "accord", "run", "-n", "2",
                          os.path.join(root, "benchmarks", "bench_segments.py"),
                          "--rounds", "1", "--calls", "3"],
                         capture_output=True, text=True, timeout=50, cwd=root,
                         env=dict(os.environ, ACCORD_SHM_CMA="4M"))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    for way in ("accord", "no guard", "before", "one broadcast"):
        assert re.search(rf"{way} +\d+ ", out.stdout), (way, out.stdout)
