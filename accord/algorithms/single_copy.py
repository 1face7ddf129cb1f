"""Broadcasts that copy straight between ranks' memories (over comm.peer_memory).

On one host a rank may read and write a peer's memory (process_vm_readv /
writev, transport/shm.py's ShmPeerMemory). A plain single-copy read leaves
the root idle and pays per 4 KiB page (about half memcpy's speed on ordinary
tensor memory), so these split the copy between the root and each receiver:
both cores copy at once. Every `applies` gives the same answer on every rank
of the group (they read flags all ranks share), so all take the same path.
"""
import bisect
import struct

import numpy as np

from . import as_bytes

COOP_MIN = 4 << 20          # a broadcast this large splits its copy between the root and
                            # each receiver (more than two ranks: split_copy)
COOP_MIN_PAIR = 1 << 20     # ... and between two ranks (each copies one half at once: 1.7x
                            # the single-copy read at 1 and 2 MiB in 10 paired rounds;
                            # benchmarks/results/small-messages.md)
SPLIT_CHUNK = 512 << 10     # what each side of a split copy claims at a time
_PAGE = 4096
_NOTHING = memoryview(b"")


def broadcast_applies(c, nbytes):
    pm = c.peer_memory
    if pm is None:
        return False
    if c.size == 2:
        # each side copies its half itself: only a single-copy threshold (ACCORD_SHM_CMA)
        # above the whole message, or single copy turned off, says no
        return nbytes >= COOP_MIN_PAIR and pm.min_bytes <= nbytes and pm.usable(1 - c.rank)
    return nbytes >= COOP_MIN and pm.min_bytes <= nbytes and pm.everywhere


def broadcast(c, arr, root):
    """Two ranks: the receiver reads the first half out of the root while the root
    writes the second half straight into the receiver's buffer. More: the root writes
    into each receiver from the back while each reads from the front (split_copy).

    The ranks first swap their buffers' addresses (stamped messages: ranks that
    disagree on the root or the size read each other's stamps, a Desync, not a
    wait), then each copies its half itself, then both say done: neither returns
    while the other may still copy out of or into its buffer.
    """
    mv = memoryview(arr.reshape(-1).view("u1"))
    if c.size != 2:
        return split_copy(c, [mv], root)
    pm = c.peer_memory
    n = arr.nbytes
    peer = 1 - c.rank
    half = (n // 2) & ~(_PAGE - 1)
    here = pm.address(mv)
    where = bytearray(8)
    c.exchange(sends=[(peer, struct.pack("<Q", here))], recvs=[(peer, where)])
    there = int.from_bytes(where, "little")
    if c.rank == root:
        pm.write(peer, here + half, there + half, n - half)
    else:
        pm.read(peer, here, there, half)
    c.exchange(sends=[(peer, _NOTHING)], recvs=[(peer, memoryview(bytearray(0)))])


def list_applies(c, nbytes):
    pm = c.peer_memory
    return pm is not None and pm.everywhere and nbytes >= COOP_MIN and pm.min_bytes <= nbytes


def broadcast_list(c, bufs, root, before=None, after=None):
    """A broadcast of a list of buffers (a bucket's tensors) by split copies.

    before(i) / after(i): the root's work before buffer i leaves, a receiver's once it
    is in (here all of them around the one copy; the ring and the chain interleave
    them with the pieces, so packing and unpacking overlap the transfer)."""
    if before is not None and c.rank == root:
        for i in range(len(bufs)):
            before(i)
    split_copy(c, [as_bytes(b) for b in bufs], root)
    if after is not None and c.rank != root:
        for i in range(len(bufs)):
            after(i)


def ring_list_applies(c, nbytes):
    return c.size == 2 and c.peer_memory is not None


def ring_list(c, bufs, root, before=None, after=None):
    """Two ranks, every buffer through the shared ring (never single copy): the root
    copies piece i in while the receiver copies piece i-1 out, so both cores copy.
    before(i) / after(i): as broadcast_list's, run between the pieces."""
    peer = 1 - c.rank
    # one exchange per buffer: a send completes once its bytes are in the ring
    if c.rank == root:
        for i, b in enumerate(bufs):
            if before is not None:
                before(i)
            c.exchange(sends=[(peer, b)], ring=True)
    else:
        for i, b in enumerate(bufs):
            c.exchange(recvs=[(root, b)])
            if after is not None:
                after(i)


def split_copy(c, views, root):
    """Single copies shared between the root and each receiver: a receiver reads
    chunks out of the root's buffers from the front while the root writes chunks
    into that receiver's from the back, until they meet (at world 2, 4 KiB-page
    tensors: ~6 ms for 50 MiB, against ~10 ms through the ring, where both cores
    copy everything once each). Meeting wherever the two happen to be balances a
    slower side; with several receivers the root takes a chunk from each in turn.

    Claims need no atomic instruction: each side publishes the chunk it takes,
    fences, then reads the other's claim, and steps back only once the other
    has moved past that chunk, so every chunk is copied at least once (a chunk
    at the meeting point may be copied by both, with the same bytes).

    The root and each receiver swap (address, length) lists first: ranks that
    disagree on the root read each other's stamps there (a Desync), and lists whose
    lengths differ are a Desync on both before a byte is copied, since each copies
    into the other's memory. A last exchange both ways: neither returns while the
    other may still touch its buffers."""
    pm = c.peer_memory
    total = sum(len(v) for v in views)
    me_root = c.rank == root
    peers = [p for p in range(c.size) if p != c.rank] if me_root else [root]
    nchunks = -(-total // SPLIT_CHUNK)
    # this side's claims start at its end of each range; a peer reads them only after
    # the exchange below, whose ring writes come after these stores
    for p in peers:
        pm.post_claim(p, nchunks if me_root else 0)
    mine = np.array([(pm.address(v) if len(v) else 0, len(v)) for v in views], np.uint64)
    theirs = {p: np.empty_like(mine) for p in peers}
    c.exchange(sends=[(p, memoryview(mine).cast("B")) for p in peers],
               recvs=[(p, memoryview(theirs[p]).cast("B")) for p in peers])
    for p in peers:
        if not np.array_equal(mine[:, 1], theirs[p][:, 1]):
            i = int(np.flatnonzero(mine[:, 1] != theirs[p][:, 1])[0])
            raise pm.disagree(f"ranks disagree on the buffers of this broadcast: buffer {i} "
                              f"holds {int(mine[i, 1])} bytes here and {int(theirs[p][i, 1])} "
                              f"on {pm.peer_desc(p)}")
    here = mine[:, 0].tolist()
    starts = [0]
    for n in mine[:, 1].tolist():
        starts.append(starts[-1] + n)
    copy = pm.write if me_root else pm.read
    # per peer: [peer, its buffers' addresses, the next chunk this side takes]
    todo = [[p, theirs[p][:, 0].tolist(), nchunks - 1 if me_root else 0] for p in peers]
    while todo:
        for job in list(todo):
            p, there, k = job
            if me_root:
                pm.post_claim(p, k)
                # the receiver's claim is one past the highest chunk it took
                done = k < 0 or pm.peer_claim(p) >= k + 2
            else:
                pm.post_claim(p, k + 1)
                # the root's claim is the lowest chunk it took
                done = k >= nchunks or pm.peer_claim(p) < k
            if done:
                todo.remove(job)
                continue
            lo, hi = k * SPLIT_CHUNK, min((k + 1) * SPLIT_CHUNK, total)
            b = bisect.bisect_right(starts, lo) - 1
            while lo < hi:
                end = min(hi, starts[b + 1])
                if end > lo:
                    off = lo - starts[b]
                    copy(p, here[b] + off, there[b] + off, end - lo)
                lo = end
                b += 1
            job[2] = k - 1 if me_root else k + 1
    c.exchange(sends=[(p, _NOTHING) for p in peers],
               recvs=[(p, memoryview(bytearray(0))) for p in peers])
