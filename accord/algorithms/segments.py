"""Scattered buffers copied straight between ranks' memories: a repeated broadcast_state.

A repeated sync of a dict of tensors knows every rank's tensor addresses
(flat_state.py's tables, read once per token), so the bytes can go from each root
tensor into the receiver's with process_vm_readv / writev over lists of segments,
no packing (transport/cma.py). The kernel pins the remote side's pages segment by
segment: about 0.6 µs a remote segment on the 2-vCPU development VM, as long as
copying 4-6 KiB, while local segments cost nothing measurable. Two things follow:

- A rank that reads may read past its segments where two of them are close: small
  tensors sit a few bytes apart in the allocator's heap, so the peer's segments,
  sorted by address, are merged into one wherever the gap between two lies within
  the pages they touch (no page is read that holds none of their bytes, so every
  byte read is mapped), the gap's bytes read into scratch and dropped. A rank that
  writes cannot (the gap is another object's memory) and merges only segments that
  touch.
- At two ranks the receiver reads the front of the stream while the root writes the
  back, and the cut is where their costs meet, a remote segment counted as
  SEGMENT_COST bytes, rather than at half the bytes: a state's small tensors come
  first, and with a byte split one side paid for most of the segments.

Both ranks compute the same cut from the same two tables (each holds its own and
the peer's), so every byte is copied once.
"""
import mmap

import numpy as np

SEGMENTS_MIN_WIDE = 1 << 20    # beyond two ranks, copy_segments from this many bytes
# a remote segment's fixed cost in the kernel, as bytes of copying: 4 MiB read in 1 and
# in 300 segments took 446 and 638 µs (process_vm_readv, 2-vCPU AMD EPYC guest): 0.64
# µs a segment, 6 KB at that 9.4 GB/s
SEGMENT_COST = 6 << 10
_PAGE = mmap.PAGESIZE
_GAP_MAX = 2 * _PAGE        # the widest gap _may_join allows a reader, whose bytes land in
                            # a scratch buffer of this size
_NOTHING = memoryview(b"")


def segments_applies(c):
    """Whether copy_segments may run on c: every pair of the group copies between
    memories and single copy is not turned off (the same answer on every rank)."""
    pm = c.peer_memory
    return pm is not None and pm.everywhere and pm.min_bytes < 1 << 62


def segments_worth(size, total):
    """Whether a `total`-byte stream goes by copy_segments on a group of `size` where
    it applies. Two ranks: always (no packing, both cores copy). More: its receivers'
    acknowledgements are one more wait on every rank, which on oversubscribed cores
    costs more than packing below about a megabyte (world 3 on 2 cores, 10-81 small
    tensors: the tree through the rings was faster up to 1.5 MiB, the copy by
    address at 5.5 MiB)."""
    return size == 2 or total >= SEGMENTS_MIN_WIDE


def segment_peers(size, rank, root):
    """The peers this rank copies with in copy_segments: at two ranks each other (both
    copy); with more, a receiver the root (it reads the whole stream) and the root none
    (it waits for the receivers to say they are done)."""
    if size == 2:
        return [1 - rank]
    return [] if rank == root else [root]


def segment_share(pm, size, rank, root, mine, theirs):
    """The segment batches this rank copies with its peer (segment_peers) for one
    stream: mine and theirs are the two ranks' (address, length) rows of it, in stream
    order, with the same lengths (uint64 arrays). Built once per peer layout, then
    reused: [(local, remote, nbytes, scratch)] for read_segments / write_segments
    (scratch: the buffer the gaps' bytes are read into, kept alive with the batch)."""
    total = int(mine[:, 1].sum())
    if size == 2:
        root_rows, recv_rows = (mine, theirs) if rank == root else (theirs, mine)
        cut = _pair_cut(root_rows, recv_rows, total)
        lo, hi = (cut, total) if rank == root else (0, cut)
    else:
        lo, hi = (0, total) if rank != root else (0, 0)
    return _batches(pm, mine, theirs, lo, hi, reading=rank != root)


def _rows_in(mine, theirs, lo, hi):
    """(here, there): [(address, length)] of bytes lo..hi of the stream, on this rank
    and the peer, a row cut where lo or hi falls inside it."""
    here, there = [], []
    if hi <= lo:
        return here, there
    lens = mine[:, 1]
    ends = np.cumsum(lens, dtype=np.uint64)
    starts = ends - lens
    for i in np.flatnonzero((ends > lo) & (starts < hi) & (lens > 0)).tolist():
        a, b = max(lo, int(starts[i])), min(hi, int(ends[i]))
        off = a - int(starts[i])
        here.append((int(mine[i, 0]) + off, b - a))
        there.append((int(theirs[i, 0]) + off, b - a))
    return here, there


def _may_join(end, start, reading):
    """Whether a remote segment starting at `start` may continue one ending at `end` in
    one remote segment: it touches it, or (a reader) the gap lies within the pages the
    two touch, so that no byte is read from a page neither holds."""
    if start == end:
        return True
    return reading and start > end and start // _PAGE <= (end - 1) // _PAGE + 1


def _segment_costs(rows, reading):
    """SEGMENT_COST for each row of rows (a peer's (address, length) rows) that starts
    a remote segment of its own, 0 for one that joins the row before it in address
    order (as _may_join, over all the rows: an estimate for a share of them) and for an
    empty row."""
    n = len(rows)
    out = np.full(n, SEGMENT_COST, np.int64)
    out[rows[:, 1] == 0] = 0
    if n < 2:
        return out
    order = np.argsort(rows[:, 0], kind="stable")
    addr = rows[order, 0].astype(np.int64)
    ends = addr + rows[order, 1].astype(np.int64)
    prev, nxt = ends[:-1], addr[1:]
    joins = nxt == prev
    if reading:
        joins |= (nxt > prev) & (nxt - prev <= _GAP_MAX) & \
            (nxt // _PAGE <= (prev - 1) // _PAGE + 1)
    out[order[1:][joins]] = 0
    return out


def _pair_cut(root_rows, recv_rows, total):
    """Where two ranks cut a stream: the receiver reads bytes 0..cut out of the root
    (root_rows' addresses, joined as a reader joins them), the root writes cut..total
    into the receiver (recv_rows'), each side's cost its bytes plus SEGMENT_COST a
    remote segment (_segment_costs' estimate); the cut is where the two meet, found
    over the rows' boundaries, then within the row it falls in. O(n log n) in rows
    (100 000 tensors in one bucket take tens of milliseconds, once per token)."""
    if total == 0:
        return 0
    lens = root_rows[:, 1].astype(np.int64)
    bounds = np.concatenate(([0], np.cumsum(lens)))
    read = np.concatenate(([0], np.cumsum(_segment_costs(root_rows, True))))
    write = _segment_costs(recv_rows, False)
    write_after = np.concatenate((np.cumsum(write[::-1])[::-1], [0]))
    # at boundary k the receiver reads rows 0..k-1, the root writes rows k..
    recv_cost = bounds + read
    root_cost = (total - bounds) + write_after
    k = int(np.argmax(recv_cost >= root_cost))      # the first boundary where they cross
    if k == 0:
        return 0
    # the cut falls inside row k - 1: both sides pay its segment, the bytes move one
    # for one
    a0, b0 = int(bounds[k - 1]), int(bounds[k])
    a = int(read[k]) if b0 > a0 else int(read[k - 1])
    b = int(write_after[k - 1])
    cut = (total + b - a) // 2
    return int(min(max(cut, a0), b0))


def _batches(pm, mine, theirs, lo, hi, reading):
    """[(local, remote, nbytes, scratch)]: bytes lo..hi as iovec arrays of at most
    pm.max_segments each side, the remote side joined (_may_join) after sorting the
    pairs by remote address (one call copies its segments in any order), local
    segments that touch joined too."""
    here, there = _rows_in(mine, theirs, lo, hi)
    out = []
    if not here:
        return out
    scratch = bytearray(_GAP_MAX) if reading else None
    junk = pm.address(memoryview(scratch)) if reading else 0
    cap = pm.max_segments
    local, remote, nbytes = [], [], 0

    def flush():
        out.append((pm.segments(local), pm.segments(remote), nbytes, scratch))

    for (la, n), (ra, _) in sorted(zip(here, there), key=lambda p: p[1][0]):
        if remote and _may_join(remote[-1][0] + remote[-1][1], ra, reading) and \
                len(local) + 2 <= cap and ra - remote[-1][0] - remote[-1][1] <= _GAP_MAX:
            end = remote[-1][0] + remote[-1][1]
            if ra > end:        # the gap's bytes, read and dropped
                local.append((junk, ra - end))
                nbytes += ra - end
            remote[-1] = (remote[-1][0], ra + n - remote[-1][0])
        else:
            if remote and (len(remote) == cap or len(local) + 1 > cap):
                flush()
                local, remote, nbytes = [], [], 0
            remote.append((ra, n))
        if local and local[-1][0] + local[-1][1] == la and local[-1][0] != junk:
            local[-1] = (local[-1][0], local[-1][1] + n)
        else:
            local.append((la, n))
        nbytes += n
    flush()
    return out


def copy_segments(c, root, batches):
    """Move a stream of scattered buffers from root to every rank by address.

    batches: {peer: segment_share's batches with that peer}; the receivers read, the
    root writes (two ranks), one system call per batch. Every rank already checked
    that all ranks' layouts match (broadcast_state's agreement), and both sides'
    buffers are held by their calls until the last message: at world 2 both say done
    to each other; beyond it each receiver tells the root, which returns only once no
    receiver still reads its memory."""
    pm = c.peer_memory
    me_root = c.rank == root
    copy = pm.write_segments if me_root else pm.read_segments
    for p, bl in batches.items():
        for local, remote, n, _ in bl:
            copy(p, local, remote, n)
    if c.size == 2:
        peer = 1 - c.rank
        c.exchange(sends=[(peer, _NOTHING)], recvs=[(peer, memoryview(bytearray(0)))])
    elif me_root:
        c.exchange(recvs=[(p, memoryview(bytearray(0))) for p in range(c.size) if p != root])
    else:
        c.exchange(sends=[(root, _NOTHING)])
