"""Broadcast: binomial tree (latency) or pipelined chain (bandwidth)."""
from . import even_counts, split

CHAIN_CHUNK = 1 << 20


def tree(c, arr, root):
    n = c.size
    if n == 2:
        # one edge: the common small call of two ranks, without the loops
        if c.rank == root:
            c.send(1 - root, arr)
        else:
            c.recv(root, arr)
        return
    vr = (c.rank - root) % n
    mask = 1
    while mask < n:
        if vr & mask:
            c.recv((vr - mask + root) % n, arr)
            break
        mask <<= 1
    mask >>= 1
    sends = []
    while mask > 0:
        if vr + mask < n:
            sends.append(((vr + mask + root) % n, arr))
        mask >>= 1
    if len(sends) == 1:
        c.send(sends[0][0], arr)
    elif sends:
        c.exchange(sends=sends)


def tree_pieces(c, pieces, root, before=None, after=None):
    """A list of small buffers down the binomial tree, one after the other: every rank
    is at most log2(n) hops from the root, where the chain puts the last n-1 away
    (broadcast_state's small buckets). before(i) / after(i): as chain_pieces'."""
    is_root = c.rank == root
    for i, p in enumerate(pieces):
        if before is not None and is_root:
            before(i)
        tree(c, p, root)
        if after is not None and not is_root:
            after(i)


def chain(c, arr, root, chunk_bytes=CHAIN_CHUNK):
    """root -> root+1 -> ... ; rank k forwards chunk i while it receives chunk i+1.

    The chunks stream through the rings even where single copy would take them: a
    single-copy chunk holds its sender until the next rank has read it, which stalls
    the pipeline (world 4, 1 MiB: 1.22x the time with single copy from 1 MiB)."""
    n = c.size
    pos = (c.rank - root) % n
    prev, nxt = (c.rank - 1) % n, (c.rank + 1) % n
    per = max(1, chunk_bytes // max(1, arr.itemsize))
    nchunks = max(1, -(-arr.size // per))
    chunks = split(arr, even_counts(arr.size, nchunks))
    if pos == 0:
        c.exchange(sends=[(nxt, ch) for ch in chunks], ring=True)
        return
    last = pos == n - 1
    for i, ch in enumerate(chunks):
        sends = [] if last or i == 0 else [(nxt, chunks[i - 1])]
        c.exchange(sends=sends, recvs=[(prev, ch)], ring=True)
    if not last:
        c.exchange(sends=[(nxt, chunks[-1])], ring=True)


def chain_pieces(c, pieces, root, before=None, after=None):
    """A chain over a list of buffers: rank k forwards piece i while it receives i+1.

    before(i): the root's work before piece i leaves; after(i): a receiver's once
    piece i is in (broadcast_state packs and unpacks its small tensors there)."""
    n = c.size
    pos = (c.rank - root) % n
    prev, nxt = (c.rank - 1) % n, (c.rank + 1) % n
    # one exchange per piece: a transport re-checks every pending message of an
    # exchange each time it makes progress, so hundreds at once cost quadratic time
    if pos == 0:
        for i, p in enumerate(pieces):
            if before is not None:
                before(i)
            c.send(nxt, p)
    elif pos == n - 1:
        for i, p in enumerate(pieces):
            c.recv(prev, p)
            if after is not None:
                after(i)
    else:
        for i, p in enumerate(pieces):
            c.exchange(sends=[(nxt, pieces[i - 1])] if i else [], recvs=[(prev, p)])
            if after is not None:
                after(i)
        c.exchange(sends=[(nxt, pieces[-1])])

