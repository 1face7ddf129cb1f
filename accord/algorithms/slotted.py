"""Collectives through shared slots (comm.slots, transport/slots.py): each rank writes
a piece of its data once into its own slot and every rank that needs it copies it
straight out, instead of each byte going into and out of a ring once per peer.

Every step announces its pieces with one small stamped message per reader,
(position in the slot, length): ranks calling something else read each other's stamps
(a Desync), a length that is not what this rank's call expects is a Desync
before a byte is copied, and a lost writer fails the receive as on any step.
A rank never waits for its readers at the end of a call: its slot is the
transport's memory, not the caller's, and the next write to a piece waits
(rarely) for the readers of what it held.

Data larger than a piece goes in rounds of `room` bytes; with two pieces per
slot, the writer fills one while its readers empty the other.

all_reduce keeps halving_doubling's pairwise reduce-scatter (a step that waits
for one partner, not for every peer), but the partner reduces straight out of
the slot, and the reduced blocks are all-gathered through the slots in one step.
"""
import numpy as np

from ..reduceops import ReduceOp, finish_avg, reduce_into
from . import as_bytes, even_counts
from .reduction import halving_steps

# Where the copies saved outweigh a step that waits for every peer at once, with more
# ranks than cores, and up to where the others copy between memories once (single copy:
# one copy a byte where the slots take two). benchmarks/algorithms.py, the algorithms in
# turn, the time against the default's (lower is faster); every run, and the earlier
# ones whose untouched np.zeros inputs flattered the copies, in
# benchmarks/results/small-messages.md:
# - broadcast from 256 KiB: world 4 256 KiB 0.95x the chain's time, 1 MiB 0.59x; at
#   world 3, where a chain has one hop fewer to save, from 1 MiB (256 KiB 0.93x-1.34x,
#   1 MiB 0.88x-1.23x in runs; 0.51x and 0.40x in paired runs);
# - broadcast_list (broadcast_state's buckets) from 256 KiB at any world: the root
#   packs a buffer while the receivers unpack the one before (world 3, 602 KiB of 30
#   tensors: 0.29-0.41 ms against the chain's 0.41-0.51);
# - all_gather of blocks from 512 KiB to two pieces: world 4 against recursive
#   doubling, 512 KiB 0.96x, 1 MiB 0.64x, 1.5 MiB 0.53x, 2 MiB 0.53x-1.21x in three
#   runs, 4 MiB 1.01x and 1.66x, 16 MiB 1.97x and 2.01x; world 3 2 MiB 0.70x the
#   ring's, 16 MiB 1.05x;
# - all_reduce from 2 to 4 MiB: world 4 against halving_doubling, 512 KiB 1.60x, 1 MiB
#   0.70x, 4 MiB 0.64x, 8 MiB 1.10x, 16 MiB 1.77x; world 8 1 MiB 0.90x. That was the
#   first host; on a second of the same kind the slots took 1.4-2.0x halving_doubling's
#   time at 1 and 1.5 MiB and below MPICH's there (0.68-0.75x its bus bandwidth, where
#   halving_doubling had 0.89-1.42x), while at 2 MiB they took 0.56-0.97x its time in
#   six runs of seven and at 4 MiB 0.58-0.68x. Beginning at 2 MiB costs the first host
#   about 1.4x at 1 MiB, still faster than MPICH there (1.75x its bus bandwidth with the
#   slots); beginning at 1 MiB put the second behind MPICH.
BROADCAST_MIN = 256 << 10
BROADCAST_MIN_3 = 1 << 20
BLOCK_MIN = 512 << 10
BLOCK_ROUNDS_MAX = 2
ALL_REDUCE_MIN = 2 << 20
ALL_REDUCE_MAX = 4 << 20
# reduce_scatter alone (the all_reduce's halving, without its all-gather) from 1 MiB in
# all: on the second host, world 4, against halving through the rings (`accord bench
# --ops reduce_scatter`, each forced, two rounds), 1 MiB in all 0.89-1.05x its time,
# 1.5 MiB 0.80-0.92x, 2 MiB 0.66-0.72x, 4 MiB 0.70-0.75x
REDUCE_SCATTER_MIN = 1 << 20


def can_run(c, nbytes):
    """Shared memory beyond two ranks, with slots in its arena (what forcing these
    algorithms with ACCORD_ALGORITHMS needs, at any size)."""
    return c.slots is not None


def broadcast_applies(c, nbytes):
    """Shared memory beyond two ranks, with slots in its arena, and a message of at
    least BROADCAST_MIN (BROADCAST_MIN_3 at three ranks); the same answer on every
    rank: the arena's layout decides."""
    least = BROADCAST_MIN_3 if c.size == 3 else BROADCAST_MIN
    return nbytes >= least and c.slots is not None


def list_applies(c, nbytes):
    """As broadcast_applies, from BROADCAST_MIN at any size of group."""
    return nbytes >= BROADCAST_MIN and c.slots is not None


def all_gather_applies(c, nbytes):
    """As broadcast_applies, for an all-gather of nbytes in all whose blocks average
    BLOCK_MIN to BLOCK_ROUNDS_MAX pieces of the slots' room."""
    s = c.slots
    return s is not None and BLOCK_MIN * c.size <= nbytes <= BLOCK_ROUNDS_MAX * s.room * c.size


def _announce(start, nbytes):
    return np.array((start, nbytes), np.int64)


def _check(s, peer, got, want):
    """The position a peer announced for its piece, once its length is the one this
    rank's call expects (a Desync otherwise)."""
    if int(got[1]) != want:
        raise s.disagree(f"{s.peer_desc(peer)} put {int(got[1])} bytes in its shared slot "
                         f"where this rank's call expects {want} (do the ranks pass the "
                         f"same sizes?)")
    return int(got[0])


def all_gather(c, blocks, mine=None, meanwhile=None):
    """Every rank writes its block into its slot; every rank copies every other's out.
    Blocks may differ in size (each rank expects each peer's block's own size).

    mine: the source of this rank's block; meanwhile (which copies it into
    blocks[rank]) runs while the peers' announcements arrive."""
    s = c.slots
    n, r = c.size, c.rank
    room = s.room
    outs = [as_bytes(b) for b in blocks]
    src = outs[r] if mine is None else as_bytes(mine)
    # each rank starts with its right neighbour's block: four ranks do not all read
    # rank 0's slot at once
    peers = [(r + k) % n for k in range(1, n)]
    theirs = np.empty((n, 2), np.int64)
    rounds = max(1, -(-max(len(o) for o in outs) // room))
    for k in range(rounds):
        lo, hi = k * room, (k + 1) * room
        part = src[lo:hi]
        at, mem = c.claim(peers, len(part))
        s.fill(mem, part)
        c.exchange(sends=[(p, _announce(at, len(part))) for p in peers],
                   recvs=[(p, theirs[p]) for p in peers],
                   meanwhile=meanwhile if k == 0 else None)
        for p in peers:
            dest = outs[p][lo:hi]
            got = _check(s, p, theirs[p], len(dest))
            if len(dest):
                dest[:] = s.piece(p, got, len(dest))
            s.release(p, got, len(dest))


def broadcast(c, arr, root):
    """The root writes each piece once; every other rank copies it out (one copy on
    each side, where a chain copies the message in and out on every rank)."""
    s = c.slots
    buf = as_bytes(arr)
    n, room = len(buf), s.room
    rounds = max(1, -(-n // room))
    if c.rank == root:
        peers = [(root + k) % c.size for k in range(1, c.size)]
        for k in range(rounds):
            part = buf[k * room:(k + 1) * room]
            at, mem = c.claim(peers, len(part))
            s.fill(mem, part)
            c.exchange(sends=[(p, _announce(at, len(part))) for p in peers])
        return
    got = np.empty(2, np.int64)
    for k in range(rounds):
        dest = buf[k * room:(k + 1) * room]
        c.recv(root, got)
        at = _check(s, root, got, len(dest))
        if len(dest):
            dest[:] = s.piece(root, at, len(dest))
        s.release(root, at, len(dest))


LIST_FLUSH = 64 << 10        # a piece of a list broadcast goes once a buffer ends past this


def list_pieces(lengths, room, flush=LIST_FLUSH):
    """The lengths of the pieces a list broadcast of buffers of these lengths is cut
    into: buffers fill pieces of up to `room` bytes one after the other, and a piece
    goes as soon as a buffer ends with `flush` bytes or more in it, so the receivers
    copy one buffer out (and unpack it) while the root packs the next. The root and
    the receivers cut the same pieces from the same lengths."""
    pieces, cur = [], 0
    for n in lengths:
        while n:
            k = min(n, room - cur)
            cur += k
            n -= k
            if cur == room:
                pieces.append(cur)
                cur = 0
        if cur >= flush:
            pieces.append(cur)
            cur = 0
    if cur:
        pieces.append(cur)
    return pieces


def broadcast_list(c, bufs, root, before=None, after=None):
    """A broadcast of a list of buffers (a bucket's tensors) through the root's slot,
    in the pieces list_pieces cuts: many small buffers share a piece, a large one
    spans several.

    before(i) / after(i): the root's work before buffer i is copied in (packing it),
    a receiver's once buffer i is all in (unpacking it)."""
    s = c.slots
    views = [as_bytes(b) for b in bufs]
    plan = list_pieces([len(v) for v in views], s.room)
    is_root = c.rank == root
    peers = [(root + k) % c.size for k in range(1, c.size)] if is_root else ()
    got = np.empty(2, np.int64)
    i, off = 0, 0                       # the buffer being copied, and how far
    hook = before if is_root else after

    def skip_empty(i):
        while i < len(views) and not len(views[i]):
            if hook is not None:
                hook(i)
            i += 1
        return i
    i = skip_empty(i)
    for want in plan:
        if is_root:
            start, mem = c.claim(peers, want)
        else:
            c.recv(root, got)
            start = _check(s, root, got, want)
            mem = s.piece(root, start, want)
        fill = 0
        while fill < want:
            v = views[i]
            if is_root and off == 0 and hook is not None:
                hook(i)
            k = min(len(v) - off, want - fill)
            if is_root:
                mem[fill:fill + k] = v[off:off + k]
            else:
                v[off:off + k] = mem[fill:fill + k]
            fill += k
            off += k
            if off == len(v):
                if not is_root and hook is not None:
                    hook(i)
                i, off = skip_empty(i + 1), 0
        del mem
        if is_root:
            c.exchange(sends=[(p, _announce(start, want)) for p in peers])
        else:
            s.release(root, start, want)
    skip_empty(i)


def reduce_scatter(c, whole, out, op, bf16, spare):
    """all_reduce's reduce-scatter on its own, leaving the input as it is
    (reduction.halving_reduce_scatter_into's steps and buffers, with each half a rank
    gives written once into its slot and reduced by the partner straight out of it).

    whole: this rank's input, n blocks of out's size (only read); out: the reduction
    of block `rank`, not averaged; spare: at least half of whole's elements."""
    got = np.empty(2, np.int64)
    for partner, given, dest, base in halving_steps(c.size, c.rank, whole, out, spare):
        _swap_reduce(c, partner, given, dest, op, bf16, got, base)


def _swap_reduce(c, partner, given, kept, op, bf16, got, base=None):
    """One halving step through the slots: `given` written piece by piece into this
    rank's slot for the partner, whose matching pieces are reduced straight out of its
    slot into `kept` (as base op piece where base is given). got: a 2-element int64
    scratch for the announcements."""
    s = c.slots
    per = max(1, s.room // max(1, kept.itemsize))
    # both sides cut the same pieces: each derives them from the lengths
    for i in range(0, max(given.size, kept.size, 1), per):
        gp, kp = given[i:i + per], kept[i:i + per]
        pos, mem = c.claim((partner,), gp.nbytes)
        s.fill(mem, as_bytes(gp))
        c.swap(partner, _announce(pos, gp.nbytes), got)
        at = _check(s, partner, got, kp.nbytes)
        if kp.size:
            reduce_into(op, kp, np.frombuffer(s.piece(partner, at, kp.nbytes), kp.dtype),
                        bf16, None if base is None else base[i:i + per])
        s.release(partner, at, kp.nbytes)


def all_reduce_applies(c, nbytes):
    """A power of two of ranks beyond two with slots (halving_doubling's shape), from
    ALL_REDUCE_MIN to ALL_REDUCE_MAX bytes."""
    return ALL_REDUCE_MIN <= nbytes <= ALL_REDUCE_MAX and all_reduce_can_run(c, nbytes)


def reduce_scatter_applies(c, nbytes):
    """As all_reduce_applies, from REDUCE_SCATTER_MIN bytes in all."""
    return REDUCE_SCATTER_MIN <= nbytes <= ALL_REDUCE_MAX and all_reduce_can_run(c, nbytes)


def all_reduce_can_run(c, nbytes):
    n = c.size
    return n & (n - 1) == 0 and c.slots is not None


def all_reduce(c, acc, op, bf16, tmp=None):
    """halving_doubling's reduce-scatter, each half a rank gives written once into its
    slot and reduced by the partner straight out of it (no receive buffer, no copy
    into one); then every rank's reduced block through the slots (all_gather above:
    one step, each block written once, where doubling copies it in and out of a ring
    at every step). tmp: unused."""
    n, r = c.size, c.rank
    flat = acc.reshape(-1)
    counts = even_counts(flat.size, n)
    starts = [0]
    for k in counts:
        starts.append(starts[-1] + k)
    got = np.empty(2, np.int64)
    b0, b1 = 0, n
    mask = n >> 1
    while mask:
        mid = (b0 + b1) // 2
        keep, give = ((b0, mid), (mid, b1)) if not r & mask else ((mid, b1), (b0, mid))
        _swap_reduce(c, r ^ mask, flat[starts[give[0]]:starts[give[1]]],
                     flat[starts[keep[0]]:starts[keep[1]]], op, bf16, got)
        b0, b1 = keep
        mask >>= 1
    blocks = [flat[starts[i]:starts[i + 1]] for i in range(n)]
    if op == ReduceOp.AVG:
        finish_avg(blocks[r], n, bf16)
    all_gather(c, blocks)
