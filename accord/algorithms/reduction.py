"""Reduce, all-reduce and reduce-scatter.

Floating results are bit-identical on every rank: each element is reduced
once, in one rank's order, and then copied, never re-reduced elsewhere.

Bandwidth paths move data in pieces of at most PIECE_BYTES, received into a
scratch buffer of that size and reduced at once, so a rank's memory stays
within the user's buffers plus one piece, whatever the message size. Sender
and receiver cut the same pieces: both derive them from the block's length.
"""
import numpy as np

from ..buffers import already_in_place
from ..reduceops import ReduceOp, finish_avg, reduce_into
from . import even_counts, split

PIECE_BYTES = 4 << 20


def piece_elems(itemsize):
    return max(1, PIECE_BYTES // max(1, itemsize))


def _pieces(arr, per):
    return [arr[i:i + per] for i in range(0, arr.size, per)] or [arr]


def has_children(size, rank, root):
    """Whether rank receives from another in tree_reduce's binomial tree (a leaf only
    sends its input, and leaves it as it was)."""
    vr = (rank - root) % size
    return not vr & 1 and vr + 1 < size


def tree_reduce(c, acc, root, op, bf16, tmp, src=None):
    """Binomial reduce into acc on root; acc is scratch on the other ranks.

    src: where this rank's input is, when not in acc (only read): the first child's
    part is reduced as src op part into acc, and a leaf sends src itself.
    tmp: scratch of at least min(acc.size, piece_elems) elements."""
    n, vr = c.size, (c.rank - root) % c.size
    per = piece_elems(acc.itemsize)
    mask = 1
    while mask < n:
        if vr & mask:
            c.exchange(sends=[((vr - mask + root) % n, p)
                              for p in _pieces(acc if src is None else src, per)])
            return
        child = vr + mask
        if child < n:
            pieces = _pieces(acc, per)
            bases = [None] * len(pieces) if src is None else _pieces(src, per)
            for p, b in zip(pieces, bases):
                t = tmp[:p.size]
                c.recv((child + root) % n, t)
                reduce_into(op, p, t, bf16, b)
            src = None
        mask <<= 1
    if op == ReduceOp.AVG:
        finish_avg(acc, n, bf16)


def recursive_doubling(c, acc, op, bf16, tmp):
    n, r = c.size, c.rank
    p2 = 1 << (n.bit_length() - 1)
    extra = n - p2
    # fold the ranks beyond the largest power of two into their partners
    if r >= p2:
        c.send(r - p2, acc)
        c.recv(r - p2, acc)
        return
    if r < extra:
        c.recv(r + p2, tmp)
        reduce_into(op, acc, tmp, bf16)
    mask = 1
    while mask < p2:
        partner = r ^ mask
        c.swap(partner, acc, tmp)
        # both partners reduce (lower rank's part) op (higher rank's part): numpy's
        # complex64 multiply is not bit-commutative (a*b != b*a), so the operand order
        # must be the same on both sides for every rank to end with the same bits
        if r < partner:
            reduce_into(op, acc, tmp, bf16)
        else:
            reduce_into(op, tmp, acc, bf16)
            acc[...] = tmp
        mask <<= 1
    if op == ReduceOp.AVG:
        finish_avg(acc, n, bf16)
    if r < extra:
        c.send(r + p2, acc)


def _gather_fold(c, mine, give, out, op, bf16, tmp):
    """One step, then a fold in rank order: each peer p is sent give(p), and out gets
    x0 op x1 op ... where x_q is what rank q sent here (mine for this rank; only read,
    out may be it), the same operand order on every rank. tmp: scratch of (size - 1)
    x out.size elements, where the peers' parts land."""
    n, r, k = c.size, c.rank, out.size
    peers = [p for p in range(n) if p != r]
    parts = [mine] * n
    for j, p in enumerate(peers):
        parts[p] = tmp[j * k:(j + 1) * k]
    c.exchange(sends=[(p, give(p)) for p in peers], recvs=[(p, parts[p]) for p in peers])
    if r == 0:
        # the first op reads mine as its base, so out may be mine itself
        reduce_into(op, out, parts[1], bf16, base=mine)
        for p in range(2, n):
            reduce_into(op, out, parts[p], bf16)
        return
    acc = parts[0]                       # scratch: mine (maybe out) is read before out is
    for p in range(1, n):                # written
        reduce_into(op, acc, parts[p], bf16)
    out[...] = acc


def gather_reduce(c, acc, op, bf16, tmp):
    """All-reduce in one step: every rank sends its input to every other, then each
    reduces all of them in rank order ((x0 op x1) op x2 ...), so every rank ends with
    the same bits without a second step.

    For small messages where the group is not a power of two: recursive doubling
    folds the ranks beyond the largest power of two in and out again, two steps more
    (three for world 3 where this is one), and each step waits for a partner to be
    scheduled where ranks outnumber cores. tmp: scratch of (size - 1) * acc.size
    elements."""
    _gather_fold(c, acc, lambda p: acc, acc, op, bf16, tmp)
    if op == ReduceOp.AVG:
        finish_avg(acc, c.size, bf16)


def ring_reduce_scatter(c, blocks, op, bf16, tmp):
    """After it, rank r holds the full reduction in blocks[r] (not averaged).

    tmp: scratch of at least min(largest block, piece_elems) elements."""
    n, r = c.size, c.rank
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        _send_reduce(c, right, blocks[(r - s - 1) % n], left, blocks[(r - s - 2) % n],
                     op, bf16, tmp)


def ring_reduce_scatter_into(c, ins, out, op, bf16, tmp):
    """ring_reduce_scatter that leaves the input as it is: ins[k] is this rank's block
    for rank k (only read), out receives the full reduction of block `rank` (not
    averaged; it may be ins[rank] itself).

    The block a step sends is the one it reduced the step before, so only that one
    partial sum is kept: in out at the last step, in a spare block before it (two
    that take turns from four ranks up, one at three, none at two), each written as
    this rank's input block op the peer's part, piece by piece. Where the input was
    copied whole first, a reduce_scatter_tensor of 16 MiB a rank at world 2 spent
    4.8 of its 9.9 ms copying.

    tmp: scratch of at least min(largest block, piece_elems) elements."""
    n, r = c.size, c.rank
    per = piece_elems(out.itemsize)
    if n == 2 and ins[0].size <= per and ins[1].size <= per:
        # one piece each way: _send_reduce's one exchange, without its lists
        t = tmp[:out.size]
        c.swap(1 - r, ins[1 - r], t)
        reduce_into(op, out, t, bf16, None if already_in_place(out, ins[r]) else ins[r])
        return
    right, left = (r + 1) % n, (r - 1) % n
    spares = []
    give = ins[(r - 1) % n]
    for s in range(n - 1):
        k = (r - s - 2) % n
        if s == n - 2:
            keep = out
        else:
            if len(spares) < 2:
                spares.append(np.empty(max(b.size for b in ins), out.dtype))
            keep = spares[s % 2][:ins[k].size]
        _send_reduce(c, right, give, left, keep, op, bf16, tmp,
                     None if already_in_place(keep, ins[k]) else ins[k])
        give = keep


def direct_reduce_scatter_into(c, ins, out, op, bf16, tmp):
    """A small reduce-scatter in one step: each rank sends ins[p] to rank p and reduces
    the blocks it gets in rank order (x0 op x1 op ...), its own from ins[rank] (only
    read; out may be ins[rank] itself). Not averaged. Where the group is not a power of
    two recursive doubling's all-reduce of the whole input takes three steps at world 3
    (gather_reduce's reason), and every rank moves all n blocks where this moves one.

    tmp: scratch of (size - 1) * out.size elements."""
    _gather_fold(c, ins[c.rank], lambda p: ins[p], out, op, bf16, tmp)


def doubling_reduce_scatter_into(c, whole, out, op, bf16, tmp, spare):
    """A small reduce-scatter beyond two ranks as recursive doubling's all-reduce of the
    whole input, in spare (a copy; the input is only read), then this rank's block
    into out: log2(n) steps of one small message each, without the pieces and
    per-step lists of the halving or the ring. Not averaged.

    whole: this rank's input, n blocks of out's size; spare: whole's size; tmp: as
    much again."""
    spare[...] = whole
    # the caller averages this rank's block: the all-reduce only sums
    recursive_doubling(c, spare, ReduceOp.SUM if op == ReduceOp.AVG else op, bf16, tmp)
    m = out.size
    out[...] = spare[c.rank * m:(c.rank + 1) * m]


def halving_reduce_scatter_into(c, whole, out, op, bf16, tmp, spare):
    """Reduce-scatter by recursive halving (halving_doubling's first half), leaving the
    input as it is: log2(n) steps where the ring takes n - 1, each waiting for one
    partner, which counts where ranks outnumber cores. A power of two of ranks beyond
    two (halving_doubling_applies), blocks of one size.

    whole: this rank's input, n blocks of out's size (only read); out: the reduction
    of block `rank` (not averaged). The first step writes the half this rank keeps,
    input op the partner's part, into spare (at least half of whole's elements);
    later steps reduce into spare's part they keep, the last one into out.
    tmp: scratch of at least min(half of whole, piece_elems) elements."""
    for partner, given, dest, base in halving_steps(c.size, c.rank, whole, out, spare):
        _send_reduce(c, partner, given, partner, dest, op, bf16, tmp, base)


def halving_steps(n, r, whole, out, spare):
    """The steps of a reduce-scatter by recursive halving that leaves its input as it
    is, for rank r of n (a power of two): (partner, the half to give, where the kept
    half's reduction goes, what it is the partner's part op: the kept half's current
    values, or None where they are already in that place). The first step's kept
    half goes into spare, later ones stay where they are in it, the last goes into
    out. Each step's arrays are cut once the step before has run."""
    m = out.size
    b0, b1 = 0, n
    a0 = None                   # spare holds blocks a0.. (None: still the input's)
    mask = n >> 1
    while mask:
        mid = (b0 + b1) // 2
        keep, give = ((b0, mid), (mid, b1)) if not r & mask else ((mid, b1), (b0, mid))

        def current(lo, hi):
            return whole[lo * m:hi * m] if a0 is None else spare[(lo - a0) * m:(hi - a0) * m]
        if mask == 1:
            dest, base = out, current(*keep)
        elif a0 is None:
            dest, base = spare[:(keep[1] - keep[0]) * m], current(*keep)
        else:
            dest, base = current(*keep), None
        yield r ^ mask, current(*give), dest, base
        if a0 is None:
            a0 = keep[0]
        b0, b1 = keep
        mask >>= 1


def _send_reduce(c, to, give, frm, keep, op, bf16, tmp, base=None):
    """One reduce-scatter step: send `give` to rank `to` while receiving rank frm's part
    of `keep` and reducing it into keep, piece by piece through tmp (at least
    min(keep.size, piece_elems) elements). Both sides cut the same pieces.

    base: keep <- base op the peer's part instead (base only read, keep's own
    contents unused)."""
    per = piece_elems(tmp.itemsize)
    sp, rp = _pieces(give, per), _pieces(keep, per)
    bp = None if base is None else _pieces(base, per)
    for i in range(max(len(sp), len(rp))):
        t = tmp[:rp[i].size] if i < len(rp) else None
        c.exchange(sends=[(to, sp[i])] if i < len(sp) else (),
                   recvs=[(frm, t)] if t is not None else ())
        if t is not None:
            reduce_into(op, rp[i], t, bf16, None if bp is None else bp[i])


def ring_allreduce(c, acc, op, bf16, tmp):
    n = c.size
    blocks = split(acc, even_counts(acc.size, n))
    ring_reduce_scatter(c, blocks, op, bf16, tmp)
    if op == ReduceOp.AVG:
        finish_avg(blocks[c.rank], n, bf16)
    from .all_gather import ring
    ring(c, blocks)


def halving_doubling_applies(c, nbytes):
    """A power of two of ranks beyond two (at two, the ring is already one step each way)."""
    n = c.size
    return n > 2 and n & (n - 1) == 0


def halving_doubling(c, acc, op, bf16, tmp):
    """All-reduce in 2 log2(n) steps instead of the ring's 2(n - 1), moving the same bytes
    (Rabenseifner's): a reduce-scatter by recursive halving, each rank swapping half of
    its current range with the partner across that half and reducing the half it keeps,
    until it holds the reduction of block r; then an all-gather by recursive doubling.
    Fewer steps matter where ranks outnumber cores: each step waits for a partner to be
    scheduled. A power of two of ranks only (halving_doubling_applies).

    tmp: scratch of at least min(acc.size // 2 + 1, piece_elems) elements."""
    n, r = c.size, c.rank
    counts = even_counts(acc.size, n)
    starts = [0]
    for k in counts:
        starts.append(starts[-1] + k)
    b0, b1 = 0, n                   # the blocks this rank still reduces
    mask = n >> 1
    while mask:
        partner = r ^ mask
        mid = (b0 + b1) // 2
        keep, give = ((b0, mid), (mid, b1)) if not r & mask else ((mid, b1), (b0, mid))
        _send_reduce(c, partner, acc[starts[give[0]]:starts[give[1]]],
                     partner, acc[starts[keep[0]]:starts[keep[1]]], op, bf16, tmp)
        b0, b1 = keep
        mask >>= 1
    if op == ReduceOp.AVG:
        finish_avg(acc[starts[r]:starts[r + 1]], n, bf16)
    mask = 1
    while mask < n:
        partner = r ^ mask
        # the partner holds the range of the same size next to this one
        size = b1 - b0
        p0 = b0 + size if not r & mask else b0 - size
        c.exchange(sends=[(partner, acc[starts[b0]:starts[b1]])],
                   recvs=[(partner, acc[starts[p0]:starts[p0 + size]])])
        b0, b1 = min(b0, p0), max(b1, p0 + size)
        mask <<= 1
