"""broadcast_state: make every rank's model state equal the source's, in a few collectives.

    accord.broadcast_state(model)                 # an nn.Module: its state_dict, in place
    accord.broadcast_state(state_dict, src=0)     # or any dict/list/tuple of arrays/tensors

How it goes, on every rank of the group:
1. Flatten the object into leaves with paths (``['fc1.weight']``, ``['opt'][0]``).
   numpy arrays and CPU torch tensors are tensor leaves; anything else is an
   object leaf.
2. Agree on the structure: each rank hashes its structure signature (paths,
   container kinds, dtypes, shapes) and one small all_gather compares the
   hashes and the bucket sizes. On any difference every rank learns every
   signature and raises `StateMismatch` naming the first differing path, so no
   rank hangs, no tensor is written and the group stays usable.
3. Object leaves travel in one object broadcast (pickled).
4. Tensor leaves are grouped by dtype into buckets of at most `bucket_bytes`
   (default 25 MiB); each bucket is one broadcast collective (one sequence
   number, one stamp). Inside it, tensors under 64 KiB are packed into one
   array; larger ones are sent from and received into the caller's memory
   directly, in pieces of about 4 MiB along a chain of ranks, so a rank forwards piece
   i while it receives piece i+1. Nothing large and contiguous is copied outside the
   transport; a large strided tensor goes through a contiguous temporary. The
   layout (which tensors are packed, where the pieces are cut) depends only on
   paths, shapes and dtypes, so ranks may hold the same tensor with different
   strides. At world 2 over shared memory every piece goes through the ring, the
   root copying one piece in while the other rank copies the previous one out;
   with more ranks, where every pair may, a bucket of 4 MiB or more is one split
   single copy (each receiver reads from the front of the root's tensors while
   the root writes into it from the back), a small one goes down the binomial
   tree, and the rest along the chain (algorithms/table.py).

A dict or OrderedDict synced again, or a module (its parameters and buffers, the
same objects every call), holding the same contiguous tensors unchanged, skips
step 1 and the layout planning: flat_state.py remembers them (weakly) and moves
the bytes by address, with the same buckets, pieces and stamps, so ranks may take
either path in one call. Step 2 runs on every call. Where every rank has such an
entry and every pair may copy between memories (shared memory with
cross-memory attach), each rank's word in the step-2 agreement also carries
where its tensors are, and a bucket is copied tensor to tensor with no packing
(where the root does not send ahead, below): at world 2 the receiver reads the front
of the bucket's bytes out of the root's tensors while the root writes the back into
the receiver's, cut where their costs meet (a few system calls for the whole bucket,
`copy_segments` in algorithms/segments.py); beyond two ranks, where the arena has no shared slots,
each receiver reads a bucket of 1 MiB or more itself, and a smaller one still goes
through the rings. Every rank holding an entry, the buckets move in the agreement's
own call.

A root holding an entry does not wait for the agreement before it sends over shared
memory (beyond two ranks through its shared slot where the arena holds them, at any
size; at two ranks through the ring, under half the single-copy threshold, from which
the state is copied by address as above), elsewhere for a small state (under 1 MiB, every
bucket going through the transport): its pieces follow its row in the same step
(through the transport, as one message gathered from its tensors), and each
receiver takes them once it holds every row, into its tensors where the structures
agree, into scratch where they do not (so nothing is written and the links stay clean). A sync
then costs the agreement's one round, not a second one in which the receivers wait
again for the root. Beyond two ranks over shared memory the root writes them once,
straight from its tensors, into its shared slot (transport/slots.py), in chunks of
the slot's room (a receiver's copy of one overlapping the root's of the next), and
each receiver copies them from there straight into its
own tensors, or leaves them unread where the structures differ.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import struct
from typing import Any, Optional, Union
import sys
import threading

import numpy as np

from . import api, flat_state, module_state, objects, plans
from .byte_stream import ByteStream
from .args import root_rank
from ._packing import Bucket, check_bucket_bytes, is_tensor, plan_buckets, tensor_view
from .algorithms.segments import (SEGMENTS_MIN_WIDE, copy_segments, segment_peers,
                                  segment_share, segments_applies, segments_worth)
from .algorithms.table import choose
from .buffers import BF16_CODE
from .errors import Desync
from .work import Work, completed_work
from ._types import Timeout
from .group import ProcessGroup
from .world import not_member, resolve_group


class StateMismatch(Desync, ValueError):
    """The ranks' states differ in structure (keys, lengths, dtypes or shapes)."""


def _is_module(obj):
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.nn.Module)


def fmt_path(path):
    return "".join(f"[{k!r}]" for k in path) or "<root>"


def _keys(d):
    keys = list(d.keys())
    try:
        return sorted(keys)
    except TypeError:
        return keys


class _Leaf:
    __slots__ = ("path", "value", "view", "code", "dtype", "error")

    def __init__(self, path, value):
        self.path, self.value = path, value
        self.view = self.code = self.dtype = self.error = None


def flatten(tree, writable=True):
    """(leaves, signature): leaves in a fixed order; signature = one entry per node."""
    leaves, sig = [], []

    def walk(node, path):
        if isinstance(node, dict):
            keys = _keys(node)
            sig.append((path, "dict", tuple(repr(k) for k in keys)))
            for k in keys:
                walk(node[k], path + (k,))
        elif isinstance(node, (list, tuple)):
            kind = "list" if isinstance(node, list) else type(node).__name__
            sig.append((path, kind, len(node)))
            for i, v in enumerate(node):
                walk(v, path + (i,))
        elif is_tensor(node):
            leaf = _Leaf(path, node)
            try:
                leaf.view, leaf.code, leaf.dtype = tensor_view(node, lambda: fmt_path(path),
                                                               writable)
            except (TypeError, ValueError) as e:
                leaf.error = str(e)
                leaf.dtype = "?"
            sig.append((path, "tensor", leaf.dtype, tuple(node.shape)))
            leaves.append(leaf)
        else:
            sig.append((path, "object"))
            leaves.append(_Leaf(path, node))

    walk(tree, ())
    return leaves, sig


def _describe(entry):
    kind = entry[1]
    if kind == "tensor":
        return f"a {entry[2]} tensor of shape {list(entry[3])}"
    if kind == "object":
        return "a non-tensor value"
    if kind == "dict":
        return f"a dict with {len(entry[2])} keys"
    return f"a {kind} of length {entry[2]}"


def first_difference(mine, src, rank, src_rank):
    """Describe the first node where signature `mine` (rank) differs from `src` (src_rank)."""
    for a, b in zip(mine, src):
        if a == b:
            continue
        path = a[0]
        where = "".join(f"[{k!r}]" for k in path)
        if a[1] == b[1] == "dict":
            ka, kb = list(a[2]), list(b[2])
            missing = [k for k in kb if k not in ka]
            extra = [k for k in ka if k not in kb]
            if missing:
                return (f"{where}[{missing[0]}]: missing on rank {rank}, present on "
                        f"src rank {src_rank}" + (f" ({len(missing)} keys missing)"
                                                  if len(missing) > 1 else ""))
            if extra:
                return (f"{where}[{extra[0]}]: present on rank {rank}, missing on src "
                        f"rank {src_rank}")
        if a[0] != b[0]:
            return (f"{fmt_path(b[0])}: rank {rank} has {fmt_path(a[0])} in its place")
        return (f"{fmt_path(path)}: rank {rank} has {_describe(a)}, src rank {src_rank} has "
                f"{_describe(b)}")
    if len(mine) != len(src):
        longer, who = (mine, rank) if len(mine) > len(src) else (src, src_rank)
        return f"{fmt_path(longer[min(len(mine), len(src))][0])}: only rank {who} has it"
    return None


_DIGESTS = {}          # structure signature (as a tuple) -> its digest, for the last few
_DIGESTS_MAX = 16


def _digest(sig):
    """16 bytes that every rank computes alike from an equal signature.

    repr() of a signature costs about 1.3 µs an entry; a model synced every step
    has the same structure each time, so its digest is looked up by the signature
    itself (a local, C-speed hash and compare) and computed only once."""
    key = tuple(sig)
    d = _DIGESTS.get(key)
    if d is None:
        if len(_DIGESTS) >= _DIGESTS_MAX:
            _DIGESTS.clear()
        d = _DIGESTS[key] = hashlib.blake2b(repr(sig).encode(), digest_size=16).digest()
    return d


_U1 = np.dtype(np.uint8)
_KEY = 25                # a rank's row in the agreement: error flag, structure digest and
                         # bucket_bytes (what every rank's must share with the root's), then
_HAS = _KEY + 16         # its flat_state entry's address word (or zeros), then _ENTRY
_AHEAD_N = _HAS + 1      # where it has an entry, or (the root) _AHEAD or _SLOTTED; with
_AHEAD_BYTES = _AHEAD_N + 4  # those, the number of pieces that follow (u32), and with
_AHEAD_SUM = _AHEAD_BYTES + 8  # _AHEAD the bytes of the one message they come in (u64)
_ROW = _AHEAD_SUM + 8    # and a checksum of their sizes (_layout_sum)
_TAIL = _ROW - _HAS
_NO_ADDRESS = bytes(16)
_ENTRY, _AHEAD, _SLOTTED = 1, 2, 3
# a root holding an entry sends its pieces right behind its row through its shared slot
# where it has one, at any size (False: on every receiver's ring; benchmarks/bench_ahead.py
# times the two in turn); on the rings when they come to less than AHEAD_MAX and number
# at most AHEAD_PIECES: see _goes_ahead
AHEAD_SLOT = True
AHEAD_MAX = SEGMENTS_MIN_WIDE
AHEAD_PIECES = 64
# two ranks over a medium that fills a ByteStream in place (shared memory) send ahead
# under half the single-copy threshold (at any size where single copy is off), the state
# one message through the ring, where it goes by address after the agreement from
# AHEAD_MAX (False; bench_ahead.py -n 2 times the two in turn); see _pair_by_address
AHEAD_PAIR = True
PAIR_BY_ADDRESS_SHARE = 0.5


def _agree(g, root, digest, bucket_bytes, failed, timeout, explain, entry=None, then=None,
           into=None):
    """Raise StateMismatch on every rank unless every rank's structure equals root's.

    digest: this rank's structure digest; bucket_bytes: its bucket size (the layout
    depends on it, so it must agree too); failed: a leaf of this rank cannot be sent;
    explain() -> (signature, leaf errors, bucket_bytes), called only on a mismatch,
    to say where.
    entry: this rank's flat_state entry, when it has one: its address word goes with
    the digest where every pair of ranks may copy between memories, and a root may
    send its pieces with its row (_goes_ahead).
    then(c, verdict) -> bool: run in the same call once the structures agree (so
    moving the bytes costs no call of its own), verdict being _verdict's for the
    gathered table; whether it moved them.
    into() -> (pieces, after(i) or None, finish() or None): where a receiver takes
    a root's pieces that came with its row (a flat_state entry's, or the general
    path's buckets'), made only when they come.

    One all_gather of _ROW bytes a rank, made from its parts rather than through the
    api (whose argument checks cost more than the exchange at world 2), the call
    named broadcast_state. Returns (the gathered table, whether this call moved the
    state's bytes): from the table flat_state.tokens tells whether every rank sent
    its address word."""
    head = (b"\x01" if failed else b"\x00") + digest + struct.pack("<Q", bucket_bytes)
    table = bytearray(_ROW * g.size)
    moved = [False]
    verdict = [None]
    if g.hier is not None:
        out = np.frombuffer(table, np.uint8)
        api.all_gather_into_tensor(out, np.frombuffer(head + _NO_ADDRESS + bytes(_TAIL),
                                                      np.uint8),
                                   group=g, timeout=timeout)
    else:
        mv = memoryview(table)
        blocks = [mv[i * _ROW:(i + 1) * _ROW] for i in range(g.size)]
        total = len(table)
        forced = g.options.algorithms
        row = [None]

        def own():
            blocks[g.rank][:] = row[0]

        def body(c):
            if c is None:
                row[0] = head + _NO_ADDRESS + bytes(_TAIL)
                own()
                return
            p = _plan(c, entry if then is not None else None, root, head, forced)
            row[0] = p.row
            if p.ahead:
                _send_ahead(c, entry, p, blocks)
                moved[0] = True
                return
            choose("all_gather", total, c, forced)(c, blocks, row[0], own)
            how = table[root * _ROW + _HAS]
            if how == _SLOTTED:
                # the first chunk's position rides in the root's row; taken out, so that
                # a repeated sync's table (the verdict's key) is the same every call
                at = root * _ROW + _AHEAD_BYTES
                first = bytes(table[at:at + 16])
                table[at:at + 16] = bytes(16)
            v = verdict[0] = _verdict(table, root, g.size)
            if how == _SLOTTED:
                moved[0] = _take_slotted(c, root, table, into if v[0] else None, entry, first)
            elif how == _AHEAD:
                moved[0] = _take_ahead(c, root, table, into if v[0] else None,
                                       entry if then is not None else None)
            elif then is not None and v[0]:
                moved[0] = then(c, v)
        plans.run(g, "broadcast_state", body, False, timeout,
                  (-1, _U1.num, 0, total, "uint8", (_ROW,)))
    if (verdict[0] or _verdict(table, root, g.size))[0]:
        return bytes(table), moved[0]
    sig, errors, mine_bytes = explain()
    everyone = [None] * g.size
    objects.all_gather_object(everyone, (sig, errors, mine_bytes), group=g, timeout=timeout)
    src_rank = g.ranks[root]
    src_sig, _, src_bytes = everyone[root]
    problems = []
    for r, (s, errs, nbytes) in enumerate(everyone):
        if errs:
            problems.append(f"rank {g.ranks[r]}: {errs[0]}")
        elif r != root and s != src_sig:
            diff = first_difference(s, src_sig, g.ranks[r], src_rank)
            problems.append(diff or f"rank {g.ranks[r]}: structure differs")
        elif r != root and nbytes != src_bytes:
            problems.append(f"rank {g.ranks[r]}: bucket_bytes={nbytes}, src rank {src_rank}: "
                            f"bucket_bytes={src_bytes} (the buckets must be cut alike)")
    mine = next((p for p in problems if p.startswith(f"rank {g.global_rank}:") or
                 f"rank {g.global_rank} " in p), None)
    lines = "\n  ".join(problems)
    raise StateMismatch(f"broadcast_state on rank {g.global_rank}: cannot make the state equal "
                        f"src rank {src_rank}'s (no tensor was written)" +
                        (f"; this rank: {mine}" if mine else "") + f":\n  {lines}")


class _Plan:
    """What a call of broadcast_state on a flat_state entry does alike every time on one
    group's links, worked out once (building these on every call took 1-2 µs of a
    repeated sync of 10 small tensors at two ranks, then 25 µs in all): this
    rank's row of the agreement, and for a root that sends its pieces with it
    (_goes_ahead), how (ahead: _SLOTTED or _AHEAD, else 0) and, through the rings, its
    messages."""
    __slots__ = ("choices", "slot", "pair", "row", "ahead", "sends")


def _plan(c, e, root, head, forced):
    """The _Plan of this rank's call on c (e: its flat_state entry, or None on the
    general path: a row without an address word, never ahead). An entry's plan is kept
    with it per root and reused while the call runs on the same links (the links'
    `choices` memo, which lives as long as they do, names them), unless algorithms are
    forced or AHEAD_SLOT or AHEAD_PAIR changed (benchmarks set them between rounds);
    head: the row's first _KEY bytes (error flag, digest, bucket_bytes)."""
    if e is not None and not forced:
        p = e.plans.get(root)
        if p is not None and p.choices is c.choices and p.slot is AHEAD_SLOT and \
                p.pair is AHEAD_PAIR and p.row[:_KEY] == head:
            return p
    p = _Plan()
    p.choices = c.choices
    p.slot, p.pair = AHEAD_SLOT, AHEAD_PAIR     # what it was worked out for
    p.ahead, p.sends = 0, None
    if e is None:
        p.row = head + _NO_ADDRESS + bytes(_TAIL)
        return p
    word = e.word if segments_applies(c) else _NO_ADDRESS
    pieces, _, layout = e.stream()
    if c.rank == root and _goes_ahead(c, e, forced):
        if _slotted_ahead(c, len(pieces)):
            p.ahead = _SLOTTED
            p.row = head + word + bytes([_SLOTTED]) + struct.pack("<I", len(pieces)) + \
                bytes(16)
        else:
            # every piece in one message, gathered from the tensors as it is written out
            p.ahead = _AHEAD
            stream = e.byte_stream()
            p.row = head + word + bytes([_AHEAD]) + \
                struct.pack("<IQ", len(pieces), len(stream)) + _layout_sum(layout)
            peers = [q for q in range(c.size) if q != c.rank]
            p.sends = [(q, p.row) for q in peers] + [(q, stream) for q in peers]
    else:
        p.row = head + word + bytes([_ENTRY]) + bytes(_TAIL - 1)
    if not forced:
        if len(e.plans) >= 8:
            e.plans.clear()
        e.plans[root] = p
    return p


def _goes_ahead(c, e, forced):
    """Whether the root, holding entry e, sends its pieces right behind its row, before
    it knows that the others agree, no algorithm forced: where the group has shared
    slots (beyond two ranks over shared memory), a state of any size; two ranks over
    shared memory (AHEAD_PAIR), through the ring, a state under the single-copy
    threshold, or of any size where single copy is off (_pair_by_address); else a small
    state (under AHEAD_MAX, in at most AHEAD_PIECES pieces), through the transport.
    At world 2 the copy by address waits for the agreement's round first, and for 10
    or 30 small tensors (238 and 602 KiB) the rings behind the row took 0.75-0.85x its
    time (paired runs; benchmarks/results/small-messages.md).

    The receivers wait for the rows anyway; taking the pieces in the same wake-up saves
    the round in which the root, having read every row, sends, and each receiver wakes
    again to take them (a world of 3 on 2 cores, 10 tensors of 238 KiB in all:
    0.65-0.86x the time in paired runs). A receiver whose structure differs takes the
    pieces into scratch and drops them, so no tensor is written on a mismatch."""
    if forced:
        return False
    pieces, _, _ = e.stream()
    if _slotted_ahead(c, len(pieces)):
        # written once into the root's slot, whatever the number of receivers, and
        # copied out by each: at worlds 3, 4 and 8 faster than the copy by address at
        # every size measured, 81 tensors (1.5 MiB) to 100 (50 MiB)
        return True
    if AHEAD_PAIR and c.size == 2 and c.scatters and not _pair_by_address(c, e):
        # one message gathered from the root's tensors and scattered into the
        # receiver's as it streams through the ring, both copying at once
        return True
    return len(pieces) <= AHEAD_PIECES and e.nbytes < AHEAD_MAX


def _pair_by_address(c, e):
    """Whether two ranks copy entry e's state by address once the rows are in, rather
    than through the ring behind the root's row: where single copy runs between them
    (segments_applies) and the state is of half the single-copy threshold or more
    (PAIR_BY_ADDRESS_SHARE of it: 2 MiB where the threshold is 4 MiB, 512 KiB where the
    group's probe found single copy faster from 1 MiB; an ACCORD_SHM_CMA raised above
    its default raises this with it).

    A state the ring cannot hold whole keeps the root copying into it until the
    receiver has copied most of it out, so the root no longer finishes first and runs
    ahead into its next call, and both copies, in and out, are on the path; by address
    each rank copies its share, once. On two 2-vCPU hosts, ring / by address: 300 small
    tensors (5.5 MB) 1.17-1.28x in step and 0.95-1.50x back to back (8 of 9 runs slower
    on the ring, one even), 100 tensors of 16 and 50 MiB 1.02-1.41x in step and
    1.04-1.24x back to back; on the other host 1.01x or more in six of seven runs at 300
    tensors, 1.05-1.44x at 16 and 50 MiB. Since the reader joins neighbouring tensors
    and the cut follows the costs (algorithms/segments.py), on the third host:
    200 small tensors (3.7 MB) 1.21-1.32x, 3 of 1 MiB 1.09x and 1.47x, 12 of 256 KiB
    1.25x and 1.30x, 2 of 1.25 MiB 1.26x; even from 1.5 to 2.3 MB (60-120 small tensors
    0.84-1.11x, 1-2 tensors of 1.5-2 MiB 0.96-1.04x); the ring faster at 1.15 MB (60
    small tensors, 0.88-0.96x) (benchmarks/results/small-messages.md)."""
    if not segments_applies(c):
        return False
    return e.nbytes >= c.peer_memory.min_bytes * PAIR_BY_ADDRESS_SHARE


def _slotted_ahead(c, npieces):
    """Whether a root sending ahead writes into its shared slot (_send_ahead): the group
    has slots, and the pieces' sizes fit in the first chunk."""
    s = c.slots if AHEAD_SLOT else None
    return s is not None and 8 * npieces <= s.room


def _send_ahead(c, e, p, blocks):
    """The root's side of an agreement it sends its pieces with: its row, then the
    pieces, to every receiver, in one step with reading their rows (p: its _Plan).
    Through the transport (_AHEAD) the pieces are one message gathered straight from
    the tensors, their count, bytes and sizes' checksum in the row: two messages a
    receiver, where a message for the sizes and one per piece took 1.05x the time of
    a sync of 10 small tensors at two ranks and 1.1x that of 30 (paired rounds).

    Where the group has shared slots (shared memory beyond two ranks), the sizes and
    the pieces' bytes are written there once, straight from the tensors, in chunks of
    at most the slot's room, each announced by its position alone (_SLOTTED): each
    receiver copies its tensors straight out of them, where the rings would take a
    packed copy, then one copy per receiver into its ring, then one out of it and an
    unpacked one on every receiver (world 3 on 2 cores, 10 tensors of 238 KiB in all:
    benchmarks/results/small-messages.md). The first chunk's position goes in the row
    (its last 16 bytes), so a receiver takes one message fewer: the row waits for that
    chunk, whose room was freed by earlier calls alone (a later chunk, which may wait
    for receivers to copy out this call's first, goes after the row)."""
    row = p.row
    blocks[c.rank][:] = row
    recvs = [(q, blocks[q]) for q in range(c.size) if q != c.rank]
    if p.ahead == _AHEAD:
        c.exchange(sends=p.sends, recvs=recvs)
        return
    layout = e.stream()[2]
    peers = [q for q, _ in recvs]
    s = c.slots
    full = len(layout) + e.nbytes
    stream = e.byte_stream()
    lo, k = 0, len(layout)
    while True:                 # chunk by chunk: one, holding just the sizes, at least
        hi = min(full, lo + s.room)
        at, mem = c.claim(peers, hi - lo)
        if lo == 0:
            mem[:k] = layout
            s.gather(mem[k:], stream, 0)
        else:
            s.gather(mem, stream, lo - k)
        del mem
        where = struct.pack("<qq", at, hi - lo)
        if lo == 0:
            where = row[:_AHEAD_BYTES] + where
        c.exchange(sends=[(q, where) for q in peers], recvs=recvs if hi == full else ())
        if hi == full:
            return
        lo = hi


_SUMS = {}              # piece sizes (bytes) -> _layout_sum, for the last few


def _layout_sum(layout):
    """8 bytes naming a root's piece sizes (uint64 bytes, in order): what a receiver
    compares its own with before it takes the root's pieces into its buffers. A
    repeated sync's sizes are the same bytes object every call (flat_state's
    entry), so the sum is looked up, not computed."""
    s = _SUMS.get(layout)
    if s is None:
        if len(_SUMS) >= 16:
            _SUMS.clear()
        s = _SUMS[layout] = hashlib.blake2b(layout, digest_size=8).digest()
    return s


_SCRATCH_MAX = 1 << 20


def _scratch(nbytes):
    """Somewhere to read and drop a message of nbytes: one buffer of at most
    _SCRATCH_MAX, as often as it takes (a ByteStream of the same view, each piece
    overwriting the last), so a rank whose structure differs from the root's does not
    allocate the root's whole state (two ranks send a state of any size ahead)."""
    piece = memoryview(bytearray(min(nbytes, _SCRATCH_MAX)))
    whole, rest = divmod(nbytes, len(piece)) if nbytes else (0, 0)
    return ByteStream([piece] * whole + ([piece[:rest]] if rest else []))


def _take_ahead(c, root, table, into, entry):
    """A receiver's side: the root's pieces, which follow its row as one message (their
    sizes in the row as a checksum). into: as _agree's, or None where the structures
    differ (the message goes into scratch and is dropped, so the links stay clean for
    the StateMismatch exchange that follows); entry: this rank's flat_state entry,
    whose tensors take the message straight (scattered into them), where into() is
    its; whether this rank's state was written."""
    at = root * _ROW
    n, total = struct.unpack_from("<IQ", table, at + _AHEAD_N)
    want = bytes(table[at + _AHEAD_SUM:at + _ROW])
    if into is not None:
        after = finish = None
        if entry is not None:
            pieces, _, layout = entry.stream()
            dest = entry.byte_stream()
        else:
            pieces, after, finish = into()
            pieces = [memoryview(p).cast("B") for p in pieces]
            layout = np.array([len(p) for p in pieces], np.uint64).tobytes()
            dest = ByteStream(pieces)
        if len(pieces) == n and len(dest) == total and _layout_sum(layout) == want:
            c.exchange(recvs=((root, dest),))
            if after is not None:
                for i in range(n):
                    after(i)
            if finish is not None:
                finish()
            return True
    c.exchange(recvs=((root, _scratch(total)),))
    if into is not None:
        # equal digests and bucket sizes cut equal pieces; anything else is a bug
        raise Desync(f"broadcast_state: src rank's pieces ({n}, {total} bytes) do not match "
                     f"this rank's layout for the same structure")
    return False


def _take_slotted(c, root, table, into, entry, first):
    """A receiver's side of _send_ahead through the root's slot: the position of each
    chunk (the first's, `first`, came in the root's row; the others' as messages), the
    first holding the pieces' sizes, then the pieces' bytes; copied into this rank's
    tensors (straight, with its flat_state entry; else into()'s pieces, then its
    finish()) where the structures agree (into is not None), else left unread. Every
    chunk is released either way; whether this rank's state was written."""
    n = struct.unpack_from("<I", table, root * _ROW + _AHEAD_N)[0]
    s = c.slots
    where = first
    dest, finish = None, None
    full, pos = None, 0             # the chunks' bytes in all (sizes, then the pieces)
    while full is None or pos < full:
        if full is not None:
            where = bytearray(16)
            c.recv(root, where)
        at, nbytes = struct.unpack("<qq", where)
        want = nbytes if full is None else min(s.room, full - pos)
        if nbytes != want or (full is None and nbytes < 8 * n):
            raise s.disagree(f"{s.peer_desc(root)} put {nbytes} bytes in its shared slot "
                             f"for broadcast_state's chunk of {want} ({n} pieces)")
        mem = s.piece(root, at, nbytes)
        try:
            skip = 0
            if full is None:
                sizes = mem[:8 * n].tobytes()
                if into is not None and entry is not None and sizes == entry.stream()[2]:
                    # a repeated sync: the sizes are this rank's own, read no further
                    full = 8 * n + entry.nbytes
                    dest = entry.byte_stream()
                else:
                    sizes = np.frombuffer(sizes, np.uint64).tolist()
                    full = 8 * n + sum(sizes)
                if nbytes != min(s.room, full):
                    raise s.disagree(f"{s.peer_desc(root)} put {nbytes} bytes in its "
                                     f"shared slot for broadcast_state's {full} in chunks "
                                     f"of {s.room}")
                if into is not None and dest is None:
                    dest, finish = _slotted_dest(into, entry, mem[:8 * n], sizes)
                skip = 8 * n
            if dest is not None:
                dest.scatter(mem[skip:], pos + skip - 8 * n, pos + nbytes - 8 * n)
        finally:
            del mem
            s.release(root, at, nbytes)
        pos += nbytes
    if dest is None:
        return False
    if finish is not None:
        finish()
    return True


def _slotted_dest(into, entry, layout, sizes):
    """(ByteStream, finish() or None): where a receiver copies the root's slotted chunks
    (its flat_state entry's tensors, else into()'s pieces; finish() runs into()'s
    after(i) for every piece, then its finish(), once all are in); Desync where their
    sizes are not the root's (equal digests and bucket sizes cut equal pieces: a bug)."""
    if entry is not None:
        if layout == entry.stream()[2]:
            return entry.byte_stream(), None
        pieces, after, finish = (), None, None      # the Desync below
    else:
        pieces, after, finish = into()
    views = [memoryview(p).cast("B") for p in pieces]
    if [len(v) for v in views] != sizes:
        raise Desync(f"broadcast_state: src rank's pieces ({len(sizes)}) do not match "
                     f"this rank's layout for the same structure")
    if after is None:
        return ByteStream(views), finish

    def finish_all():
        for i in range(len(views)):
            after(i)
        if finish is not None:
            finish()
    return ByteStream(views), finish_all


def _agreed(table, root, size):
    key = table[root * _ROW:root * _ROW + _KEY]
    return key[0] == 0 and all(table[r * _ROW:r * _ROW + _KEY] == key for r in range(size))


_VERDICTS = {}          # (root, agreement table) -> _verdict's answer, for the last few
_VERDICTS_MAX = 16


def _verdict(table, root, size):
    """(whether the structures agree, whether every rank holds a flat_state entry, every
    rank's address word or None) for a gathered agreement table.

    A dict synced again brings the same table every call (the same digests, entries
    and tokens), so the answer is looked up by the table's bytes: one hash of a few
    dozen bytes instead of reading them row by row (3.5 µs at world 2)."""
    key = (root, bytes(table))
    v = _VERDICTS.get(key)
    if v is None:
        if len(_VERDICTS) >= _VERDICTS_MAX:
            _VERDICTS.clear()
        has_all = all(table[r * _ROW + _HAS] for r in range(size))
        v = _VERDICTS[key] = (_agreed(table, root, size), has_all,
                              flat_state.tokens(table, _ROW, _KEY) if has_all else None)
    return v


def _replace(tree, path, value):
    """Put value at path, mutating dicts/lists and rebuilding tuples; return the new tree."""
    if not path:
        return value
    k, rest = path[0], path[1:]
    child = _replace(tree[k], rest, value)
    if isinstance(tree, (dict, list)):
        tree[k] = child
        return tree
    items = list(tree)
    items[k] = child
    return type(tree)(*items) if hasattr(tree, "_fields") else type(tree)(items)


def broadcast_state(obj: Any, src: Optional[int] = None, group: Optional[ProcessGroup] = None,
                    async_op: bool = False, bucket_bytes: Optional[int] = None,
                    group_src: Optional[int] = None,
                    timeout: Timeout = None) -> Union[Any, Work, None]:
    """Make obj equal src's obj on every rank of the group, in place (not in torch).

    The tensors are packed into dtype buckets, so a model of thousands of
    tensors costs a few collectives; memory layout need not agree (a tensor may
    be contiguous on one rank and a transposed view on another). torch's
    equivalent is a loop of broadcasts (or DDP's private _sync_module_states).

    Args:
        obj: a torch nn.Module (its state_dict), a state_dict, or any nested
            dict/list/tuple of numpy arrays and CPU torch tensors; other leaves
            are objects and travel pickled.
        src: the root's global rank (default 0).
        group: the group to run on (default: the default group); a non-member
            returns None at once.
        async_op: return a Work that completes once every tensor is written
            (the structure check and the object leaves are done before it
            returns).
        bucket_bytes: largest bucket, in bytes (default 25 MiB); every rank must
            pass the same (a StateMismatch otherwise).
        group_src: the root as a rank of `group` instead of src.
        timeout: seconds (or a timedelta) for each collective it makes.

    Returns:
        obj (a rebuilt tuple where obj is a tuple holding object leaves), or a
        Work with async_op=True.

    Raises:
        StateMismatch: (a Desync and a ValueError) on every rank, when the
            structures (or bucket_bytes) differ; it names the first differing
            path, and no rank's tensors were written.
        accord.PeerLost, accord.CommTimeout, accord.GroupClosed: as the
            collectives.
    """
    g = resolve_group(group)
    if not g.is_member:
        return not_member(g, "broadcast_state")
    root = root_rank(g, src, group_src, "src")
    bucket_bytes = check_bucket_bytes(bucket_bytes)
    is_root = g.rank == root
    module = obj if _is_module(obj) else None
    # a module's own parameters and buffers (keep_vars: the same tensor objects every
    # call, where state_dict() makes new ones), so that a module synced again is
    # remembered as a dict is (flat_state.py); the bytes are the same either way. A
    # module shaped as at its last sync gives them without state_dict() (module_state.py)
    fast = not async_op and g.size > 1
    items = module_state.lookup(module) if module is not None and fast else None
    e = tree = None
    if items is not None:
        e, _ = flat_state.lookup_items(g, items[0], items[1], bucket_bytes, is_root, obj)
    if e is None:
        tree = module.state_dict(keep_vars=True) if module is not None else obj
        if type(tree) in flat_state.FLAT_TYPES and fast:
            # the same dict of the same tensors as last time (flat_state.py)
            e, _ = flat_state.lookup(g, tree, bucket_bytes, is_root, obj)
    if e is not None:
        def explain():
            t = tree if tree is not None else module.state_dict(keep_vars=True)
            return _explain(flatten(t, writable=not is_root), bucket_bytes)
        _, moved = _agree(g, root, e.digest, bucket_bytes, False, timeout, explain,
                          e, lambda c, verdict: _move_all(c, root, e, verdict,
                                                          g.options.algorithms),
                          lambda: e.stream()[:2] + (None,))
        if not moved:
            # some rank took the general path (its dict is new to it): a call per
            # bucket, as that rank makes them
            for b in e.buckets:
                _broadcast_flat(g, root, b, timeout)
        return obj
    leaves, sig = flatten(tree, writable=not is_root)
    if g.size == 1:
        return completed_work("broadcast_state") if async_op else obj
    digest = _digest(sig)

    def buckets():
        return plan_buckets(((l.view, l.code, None) for l in leaves if l.view is not None),
                            bucket_bytes, direct_ok=False)
    _, moved = _agree(g, root, digest, bucket_bytes, any(l.error for l in leaves), timeout,
                      lambda: _explain((leaves, sig), bucket_bytes),
                      into=lambda: _receive_into(buckets()))
    if flat_state.remember(g, tree, bucket_bytes, is_root, leaves, digest, SMALL_BYTES,
                           _cuts, lambda n, size: _cuts(n, size, PACKED_PIECE_BYTES),
                           obj) is not None and module is not None:
        module_state.remember(module, tree)
    if moved:
        # the root sent its pieces with its row, and this rank took them into its tensors
        # (a root never does that from here, nor with object leaves: see _goes_ahead)
        return completed_work("broadcast_state") if async_op else obj

    others = [l for l in leaves if l.view is None]
    if others:
        values = [l.value for l in others] if is_root else [None] * len(others)
        objects.broadcast_object_list(values, group=g, group_src=root, timeout=timeout)
        if not is_root:
            for leaf, v in zip(others, values):
                tree = _replace(tree, leaf.path, v)
            if module is not None:
                module.load_state_dict(tree)
            else:
                obj = tree

    works = [broadcast_bucket(g, root, b, async_op, timeout) for b in buckets()]
    if async_op:
        return _when_all(works, "broadcast_state")
    return obj


def _explain(flattened, bucket_bytes):
    leaves, sig = flattened
    return sig, [l.error for l in leaves if l.error], bucket_bytes


def _broadcast_flat(g, root, bucket, timeout):
    """broadcast_bucket for a flat_state entry, as a call of its own (where some rank
    holds no entry for its dict: that rank's general path makes this call)."""
    def body(c):
        if c is not None:
            _stream_bucket(c, root, bucket, g.options.algorithms)
    return plans.run(g, "broadcast", body, False, timeout,
                     (root, bucket.code, 0, bucket.total, bucket.name, None))


def _stream_bucket(c, root, bucket, forced):
    """A flat_state entry's bucket over c through the transport (the broadcast_list
    algorithm), from and into the tensors' memory.

    The packed pieces are packed (root) and unpacked (receivers) one at a time between
    the pieces' transfers, so at world 2 the root packs piece i+1 while the receiver
    copies piece i out of the ring, and unpacks it while the root writes the next."""
    hook = flat_state.piece_copier(bucket.segments) if bucket.segments else None
    fn = choose("broadcast_list", bucket.total, c, forced)
    if c.rank == root:
        fn(c, bucket.pieces, root, before=hook)
    else:
        fn(c, bucket.pieces, root, after=hook)


def _copy_bucket(c, root, e, i, words):
    """Bucket i of entry e, every rank holding an entry and free to copy between
    memories: no packing, each receiver's tensors copied straight from the root's
    (at world 2 the root writes a share of them), a few system calls for the bucket."""
    pm = c.peer_memory
    copy_segments(c, root, e.batches(
        c, root, i, words, segment_peers(c.size, c.rank, root),
        lambda mine, theirs: segment_share(pm, c.size, c.rank, root, mine, theirs)))


def _move_all(c, root, e, verdict, forced):
    """Inside the agreement's call, where every rank holds an entry for its dict (the
    same answer on every rank: verdict, _verdict's, comes from the table they all
    hold): every bucket, by address where it goes that way, else through the
    transport; whether it moved them.

    One call instead of one per bucket: a call's own costs (its stamp, its records),
    no round of its own (in paired runs at world 3 on 2 cores, no faster or slower
    than a call per bucket; what saves a round is _goes_ahead)."""
    _, has_all, words = verdict
    if not has_all:
        return False
    for i, b in enumerate(e.buckets):
        if words is not None and segments_worth(c.size, b.total):
            _copy_bucket(c, root, e, i, words)
        else:
            _stream_bucket(c, root, b, forced)
    return True


SMALL_BYTES = 64 << 10     # tensors below this are packed; larger ones move in place
PIECE_BYTES = 4 << 20      # large tensors move in pieces of about this size (a chain pipelines)
PACKED_PIECE_BYTES = 256 << 10   # ... the packed small ones in these: a repeated sync packs
                                 # and unpacks piece by piece while the others move


def broadcast_bucket(g, root, bucket, async_op, timeout):
    """One broadcast collective for a dtype bucket: its small tensors packed into one
    array, its large ones sent and received in place (strided ones through a
    temporary), piece by piece."""
    pieces, finish = _bucket_pieces(bucket, g.rank == root)
    total = sum(p.nbytes for p in pieces)
    name = "bfloat16" if bucket.code == BF16_CODE else bucket.views[0].dtype.name

    # shm: at world 2 the ring with both cores copying, beyond it single copy split
    # between the root and each receiver; else a tree or a chain (algorithms/table.py)
    forced = g.options.algorithms

    def body(c):
        if c is not None:
            choose("broadcast_list", total, c, forced)(c, pieces, root)
        finish()
    # stamped as one broadcast of `total` bytes: every rank's layout is the same
    return plans.run(g, "broadcast", body, async_op, timeout,
                     (root, bucket.code, 0, total, name, None))


def _bucket_pieces(bucket, is_root):
    """(pieces, finish()): the arrays a bucket moves as, in order (its small tensors
    packed into one array, cut in PACKED_PIECE_BYTES pieces, then its large ones in
    PIECE_BYTES pieces, a strided one through a contiguous temporary), and what a
    receiver runs once they are in (unpack, copy the temporaries back)."""
    pieces, staged = [], []
    if not bucket.direct and all(v.nbytes < SMALL_BYTES for v in bucket.views):
        # every tensor packed (a coalescing block's small calls): the bucket as planned
        small, views = bucket, ()
    else:
        small, views = Bucket(bucket.code), bucket.views
    for v in views:
        # size alone decides packed or in place: another rank may hold this tensor with
        # other strides, and its pieces must line up with ours
        if v.nbytes < SMALL_BYTES:
            small.add(v)
            continue
        if not v.flags.c_contiguous:
            v, dst = _stage(v, is_root)
            if dst is not None:
                staged.append((dst, v))
        pieces.extend(_pieces(v.reshape(-1)))
    if small.views:
        small.allocate()
        if is_root:
            small.pack()
        pieces[:0] = _pieces(small.flat(), PACKED_PIECE_BYTES)

    def finish():
        if small.views and not is_root:
            small.unpack()
        for dst, tmp in staged:
            np.copyto(dst, tmp)
    return pieces, finish


def _receive_into(buckets):
    """_agree's into() for the general path: every bucket's pieces in order, and one
    finish() for them all."""
    pieces, finishes = [], []
    for b in buckets:
        p, f = _bucket_pieces(b, False)
        pieces += p
        finishes.append(f)

    def finish():
        for f in finishes:
            f()
    return pieces, None, finish


def _stage(view, is_root):
    """(contiguous stand-in for a strided view, view to copy it back into or None).

    The root sends a C-order copy; a receiver receives into a temporary and copies it
    back, so the caller's own tensor is the one written."""
    if is_root:
        return np.ascontiguousarray(view), None
    return np.empty(view.shape, view.dtype), view


def _pieces(flat, piece_bytes=PIECE_BYTES):
    """flat in pieces of about piece_bytes, without a small tail piece."""
    size = flat.itemsize
    return [flat[a // size:b // size] for a, b in _cuts(flat.nbytes, size, piece_bytes)]


def _cuts(nbytes, itemsize, piece_bytes=PIECE_BYTES):
    """(start, end) byte ranges of _pieces: whole elements, about piece_bytes each."""
    per = max(1, piece_bytes // itemsize)
    n = nbytes // itemsize
    cuts = list(range(0, n, per))
    if len(cuts) > 1 and n - cuts[-1] < per // 2:
        cuts.pop()
    cuts.append(n)
    return [(a * itemsize, b * itemsize) for a, b in zip(cuts, cuts[1:])]


def _when_all(works, desc):
    """A Work done when every work is done (the first error wins)."""
    fut = concurrent.futures.Future()
    fut.set_running_or_notify_cancel()
    left = [len(works)]
    lock = threading.Lock()

    def done(f):
        exc = f.exception()
        with lock:
            if fut.done():
                return
            if exc is not None:
                fut.set_exception(exc)
                return
            left[0] -= 1
            if left[0] == 0:
                fut.set_result(None)

    if not works:
        fut.set_result(None)
    for w in works:
        w.get_future().add_done_callback(done)
    return Work(fut, desc)
