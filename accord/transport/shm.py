"""Shared-memory links between the ranks of a group on one host.

One arena per group, created by the group's first rank under an unguessable
name (mode 0600) and unlinked as soon as every rank has mapped it, so nothing
stays in /dev/shm after an exit, an exception or a SIGKILL. Inside it:

- per rank: a doorbell word (a futex peers bump to wake the rank), its pid,
  a "departed" flag (it closed the group on purpose) and room for an abort
  message; one arena-wide word names the first rank that aborted;
- per ordered pair of ranks: a single-producer single-consumer byte ring.
  `head` is written only by the producer, `tail` and `acked` only by the
  consumer, so no atomic read-modify-write is needed on the data path;
- beyond two ranks, per rank: a shared slot, written by its rank and read by
  every peer (slots.py; algorithms/slotted.py's collectives use it).

Messages are the TCP transport's: a 32-byte stamped header, then the payload,
streamed through the ring in chunks (the producer publishes each chunk as it
is written, the consumer copies it out at once: a message larger than the
ring is pipelined through it). A message of up to _INLINE bytes that fits the
ring in one contiguous piece is written whole and taken whole instead, by the
optional C helper (ring_core.c, chosen in ring_helper.py) where it was built.
Such a message that would reach past REWIND (the first megabyte) of an empty
ring starts the ring over: a pad header to the ring's end, the message at
offset 0 (pad and message published at once). A link's traffic then cycles through its ring's
first megabyte, which stays in cache, not through all of it (4 MiB each way per
pair: 48 MiB at world 4, more than this kind of machine's last-level cache).
A large message to a peer that may read this
process's memory goes single-copy instead: the header carries the address of
the sender's buffer, the receiver copies straight out of it with
process_vm_readv and bumps `acked`; the send completes on that ack. Meanwhile
the sender, waiting for that ack, writes the back of the message into the
receiver's buffer where the receiver asks it to (split_message.py).

Waiting: spin briefly (yielding the core), then sleep on the rank's doorbell
with FUTEX_WAIT, in bounded slices, checking between them that every peer is
still alive (pidfd) and that nobody aborted. Before sleeping a rank raises a
flag on each ring it waits on (`want_data` as a consumer, `want_space` as a
producer); a writer bumps the sleeper's doorbell (FUTEX_WAKE_OP: atomic add
+ wake) only when it finds that flag up. Both sides put a full fence between
their store and their load of the other side's word, and the sleeper passes
FUTEX_WAIT the doorbell value it read before raising its flags, so a wake-up
is never lost. A rank whose single-copy send is being copied out spins
(yielding) up to SPIN_ACK_US first, where every rank has a core.

Headers read off a ring are checked (wire.header_problem) before they are
routed, and messages nobody awaits yet wait in a stash that grows as their
bytes arrive. A collective send blocked on a full ring looks at the peer's
next message, so two ranks that both only send (both "roots") meet each
other's stamps instead of waiting for the timeout.

Single copy between ranks' memories is offered to algorithms as a capability
(`peer_memory`, a ShmPeerMemory): the broadcasts that split their copy between
the root and each receiver live in algorithms/single_copy.py, chosen in
algorithms/table.py like any other. `exchange(meanwhile=)` runs local work (a
root's own block) after the sends are posted, while peers copy;
`exchange(ring=True)` streams through the ring even where single copy would
apply, so both cores copy.

Each ordered pair also has a second ring, the point-to-point plane (plane 1,
with a doorbell of its own), which transport/p2p.py's engine thread drives.
"""
import collections
import mmap
import os
import secrets
import select
import struct
import time

import numpy as np

from ..byte_stream import ByteStream
from ..errors import AccordError, CommTimeout, GroupClosed
from ..options import SHM_P2P_CMA_DEFAULT
from . import cma, cma_threshold, futex, ring_helper, shared_write, split_message
from .matching import SPARE, Recv, Stash, StashMatching, complete, route
from .reports import Reports
from .waiting import usable_cores, wait_policy
from .wire import (COLL, HEADER, HEADER_SIZE, OP_SEND, P2P, decode_error,
                   encode_error, header_problem, header_seq)

_fence_enter, _fence_leave = futex.fence_ops()     # a full memory barrier, inlined

SHM_DIR = "/dev/shm"
_MAGIC = 0x3130726f63636161          # b"aaccor01"
_PAGE = 4096
_MADV_POPULATE_WRITE = 23            # linux/mman.h; not in Python 3.11's mmap module
_RANK_BLOCK = 4096
# rank block: byte offsets
_R_DOORBELL = 0                      # i32: bumped by peers (in the kernel)
_R_P2P_DOORBELL = 64                 # i32: the same for the point-to-point plane's engine
_R_PID = 128                         # i64
_R_DEPARTED = 136                    # i64: 1 after close()
_R_PROBE_ADDR = 144                  # i64: where peers test process_vm_readv
_R_PROBE_VAL = 152                   # 8 bytes they must find there
_R_ASLEEP = 160                      # i64: 1 while this rank's collective call sleeps on its
                                     # doorbell (p2p_cma_crowded reads how many run)
_R_ABORT_LEN = 192                   # i64
_R_ABORT_MSG = 256                   # up to _RANK_BLOCK - 256 bytes
# arena header
_H_MAGIC, _H_NRANKS, _H_CAP, _H_PCAP, _H_SLOT, _H_ABORT = 0, 8, 16, 24, 32, 64
# channel control page; the ring follows it
_C_HEAD, _C_TAIL, _C_ACKED, _C_CMA_OK = 0, 64, 128, 192
# what a sleeper waits for (0: nothing), so writers wake it only once that is there
_C_WANT_DATA = 256                   # consumer-written: wake me when head >= this
_C_WANT_SPACE = 320                  # producer-written: wake me when tail >= this
_C_WANT_ACK = 384                    # producer-written: wake me when acked >= this
_C_SPLIT = 448                       # writer's claim in a two-rank split copy (_split_copy)

_CMA_FLAG = 0x40                     # header kind bit: the payload is a _DESC, not bytes
_DESC = struct.Struct("<QQ")         # sender's buffer address, ack sequence number
_DESC_MSG = HEADER_SIZE + _DESC.size

SLOT_ROOM_MAX = 1 << 20              # a shared slot's piece (slots.py): a 1 MiB block goes in
                                     # one; four ranks' slots (8 MiB) stay in the cache
SLOT_ROOM_MIN = 64 << 10             # smaller pieces would not pay: no slots in such an arena
CHAN_MAX = 4 << 20                   # a ring larger than this only costs cache
CHAN_MIN = 16 << 10
P2P_CHAN_MIN = 4 << 10
_CHUNK = 256 << 10                   # publish (and copy out) streams in pieces this big
_INLINE = 1 << 20                    # messages up to this size are written in one go, and
                                     # their receiver spins for them (against the earlier
                                     # 64 KiB, paired rounds on an AMD EPYC guest at world 2:
                                     # 0.60-0.74x the time at 256 KiB, 0.84-0.97x at 1 MiB)
_PAD = 0x20                          # header kind: the ring is empty from here to its end,
                                     # the next message starts at offset 0 (_Link.rewind)
REWIND = (1 << 20) + 2 * HEADER_SIZE  # a one-piece message that would reach past this
                                     # offset of an empty ring starts over at its beginning
_SLICE_S = 0.25                      # longest single futex sleep
DEFER_S = 0.002                      # longest a tagged single-copy message nobody asked
                                     # for waits in the ring (Link._defer)
_LIVENESS_S = 0.5                    # how often a sleeper checks that its peers live


def arena_layout(size, arena_bytes):
    """(ring capacity, slot room, total bytes) of the arena of a group of `size` ranks.

    Each ordered pair has two rings: one for collectives (`cap` bytes) and one
    for point-to-point messages (p2p_cap(cap), a quarter of it: tagged messages
    larger than it stream through it in pieces while both sides copy, and those of
    the single-copy threshold up, 8 MiB by default, go single-copy). Beyond two
    ranks each rank also has a shared slot of two pieces of `room` bytes
    (slots.py), set aside first: at most an eighth of the arena in all."""
    room = slot_room(size, arena_bytes)
    nchan = size * (size - 1)
    fixed = _PAGE + size * _RANK_BLOCK + 2 * nchan * _PAGE + slots_bytes(size, room)
    per = max(0, arena_bytes - fixed) // max(1, nchan)
    cap = (per * 4 // 5) // _PAGE * _PAGE
    cap = max(CHAN_MIN, min(CHAN_MAX, cap))
    return cap, room, arena_layout_total(size, cap, room)


def slot_room(size, arena_bytes):
    """The bytes of one piece of a rank's shared slot; 0 (no slots) at two ranks,
    where a pairwise ring already copies each byte once on each side, or in an
    arena too small to spare SLOT_ROOM_MIN."""
    if size <= 2:
        return 0
    room = min(SLOT_ROOM_MAX, arena_bytes // (8 * 2 * size) // _PAGE * _PAGE)
    return room if room >= SLOT_ROOM_MIN else 0


def slots_bytes(size, room):
    """The arena bytes of every rank's slot: a control page and two pieces each."""
    return size * (_PAGE + 2 * room) if room else 0


def p2p_cap(cap):
    """The point-to-point ring's capacity beside a collective ring of `cap` bytes."""
    return max(P2P_CHAN_MIN, cap // 4 // _PAGE * _PAGE)


def p2p_cma_crowded(size, pcap, ncpu):
    """Where ACCORD_SHM_P2P_CMA and ACCORD_SHM_CMA are unset: the smallest point-to-point
    message sent single-copy, below SHM_P2P_CMA_DEFAULT (8 MiB), while more of the
    group's ranks run than there are cores (ShmTransport._crowded); None where the
    group's ranks never outnumber the `ncpu` cores. `pcap`: a ring's bytes.

    A message that does not fit whole in its ring streams through it only while sender
    and receiver both run; with more ranks running than cores each waits for the
    other's turn on a core, where single-copy the receiver copies it all whenever it
    runs. A halo exchange at world 4 on two cores (every rank running) took 0.68-0.77x
    the time single-copy at 1 MiB, 0.44x at 2 MiB and 0.35-0.39x at 4 MiB, and 1.5-4x
    as long at 256-512 KiB, which fit (world 3, 1 MiB: 0.72x). A ping-pong between two
    of four ranks while the other two sleep in a barrier (a core each, in effect) took
    2.2-2.5x the time single-copy at 1-2 MiB and 1.6x at 4 MiB: there the ring stays."""
    if size <= ncpu:
        return None
    return min(SHM_P2P_CMA_DEFAULT, pcap - HEADER_SIZE + 1)


class _Send:
    __slots__ = ("peer", "parts", "part", "off", "done", "seq", "keep", "gathering", "addr",
                 "nbytes", "helped")

    def __init__(self, peer, parts, seq=0, keep=None, addr=0, nbytes=0):
        self.peer, self.parts, self.seq, self.keep = peer, parts, seq, keep
        self.part = self.off = 0
        self.done = False
        self.gathering = None   # a ByteStream part's [streams, timed, seconds] (push)
        # a single-copy send: its buffer's address and length, and whether this rank
        # has helped its receiver copy it (split_message.py)
        self.addr, self.nbytes = addr, nbytes
        self.helped = False


_SENT = _Send(-1, ())          # the record of every send written at once: done
_SENT.done = True


class _Link(StashMatching):
    """This rank's two rings with one peer, and the state of the messages on them."""

    def __init__(self, t, peer):
        self.t, self.peer = t, peer
        me = t.rank
        out_c, in_c = t.chan_offset(me, peer), t.chan_offset(peer, me)
        self.cap = t.cap
        self.rewind = min(t.cap, REWIND)
        self.o_head_i, self.o_tail_i = (out_c + _C_HEAD) // 8, (out_c + _C_TAIL) // 8
        self.o_acked_i, self.o_cma_ok_i = (out_c + _C_ACKED) // 8, (out_c + _C_CMA_OK) // 8
        self.i_head_i, self.i_tail_i = (in_c + _C_HEAD) // 8, (in_c + _C_TAIL) // 8
        self.i_acked_i, self.i_cma_ok_i = (in_c + _C_ACKED) // 8, (in_c + _C_CMA_OK) // 8
        self.o_want_data_i, self.o_want_space_i = (out_c + _C_WANT_DATA) // 8, \
            (out_c + _C_WANT_SPACE) // 8
        self.i_want_data_i, self.i_want_space_i = (in_c + _C_WANT_DATA) // 8, \
            (in_c + _C_WANT_SPACE) // 8
        self.o_want_ack_i, self.i_want_ack_i = (out_c + _C_WANT_ACK) // 8, \
            (in_c + _C_WANT_ACK) // 8
        self.o_split_i, self.i_split_i = (out_c + _C_SPLIT) // 8, (in_c + _C_SPLIT) // 8
        # the words of a single-copy message copied by both ends (split_message.py),
        # as its sender (out) and as its receiver (in)
        self.o_coop = split_message.Words(out_c)
        self.i_coop = split_message.Words(in_c)
        self.o_ring = t.mem[out_c + _PAGE:out_c + _PAGE + t.cap]
        self.i_ring = t.mem[in_c + _PAGE:in_c + _PAGE + t.cap]
        q = t.q
        self.o_head = q[self.o_head_i]
        self.i_tail = q[self.i_tail_i]
        pb = t.rank_offset(peer)
        self.peer_doorbell = t.base + pb + t.bell
        # a p2p doorbell may have two sleepers (the engine thread and a caller
        # waiting on its own operation): wake both, the one holding the lock works
        self.wake_n = 1 if t.plane == 0 else futex.WAKE_ALL
        self.peer_departed_i = (pb + _R_DEPARTED) // 8
        self.pid = q[(pb + _R_PID) // 8]
        self.cma_out = False            # the peer may read this process's memory
        self.cma_in = False             # this process may read (and write) the peer's
        self.cma_seq = 0
        self.posted = collections.deque()
        self.stash = collections.deque()
        self.incoming = None            # [header, dest, offset, owner] being filled
        self.sends = collections.deque()
        self.unacked = collections.deque()
        self.deferred = None            # since when an unasked-for single-copy message waits
        self.departed = False           # the peer said BYE in the ring: it left on purpose
        self.eof = False                # the peer's ABORT was read: nothing follows it
        # the C helper's view of the same words (ring_helper.py), or None: pure Python
        self.fast = ring_helper.ring_link(
            t._arena.mm, t.base, t.base + out_c + _PAGE, t.base + in_c + _PAGE, t.cap,
            self.o_head_i, self.o_tail_i, self.o_want_data_i, self.i_head_i, self.i_tail_i,
            self.i_want_space_i, self.i_want_ack_i, self.i_acked_i, self.peer_doorbell,
            self.wake_n, self.rewind) if ring_helper.wanted() else None
        # how a large write into the ring goes (memcpy or streaming stores, timed:
        # shared_write.py), the helper's one-piece put and push()'s chunks alike; made
        # with the first one; a message gathered from many buffers has its own
        # (_new_gatherer)
        self.writer = None
        self.gatherer = None

    def poke_data(self, rendezvous=False):
        """New data is in our outgoing ring: wake the peer if it sleeps waiting for it.

        rendezvous: a single-copy descriptor went out, which its receiver must act
        on (copy, ack) before this send completes: wake a sleeping peer whatever
        amount of data it asked to be woken for."""
        _fence_enter()
        _fence_leave()
        w = self.t.q[self.o_want_data_i]
        if w and (rendezvous or self.o_head >= w):
            futex.add_and_wake(self.peer_doorbell, self.wake_n)

    def poke_space(self):
        """Room (or an ack) in the peer's ring to us: wake it if it sleeps waiting for that."""
        _fence_enter()
        _fence_leave()
        q = self.t.q
        w, a = q[self.i_want_space_i], q[self.i_want_ack_i]
        if w and self.i_tail >= w or a and q[self.i_acked_i] >= a:
            futex.add_and_wake(self.peer_doorbell, self.wake_n)

    def want_data(self):
        """The head to sleep for: any byte, or a good piece of the message being read."""
        inc = self.incoming
        need = len(inc[1]) - inc[2] if inc is not None else 1
        return self.i_tail + max(1, min(need, self.cap // 2))

    def want_space(self):
        """The tail to sleep for: room for the rest of the first send, or half the ring."""
        s = self.sends[0]
        rest = sum(len(p) for p in s.parts[s.part:]) - s.off
        return self.o_head - self.cap + max(1, min(rest, self.cap // 2))

    # -- writing -------------------------------------------------------------
    def push(self):
        """Write queued sends into the ring; True if any byte moved."""
        q, cap, ring = self.t.q, self.cap, self.o_ring
        moved = False
        rendezvous = False
        while self.sends:
            head = self.o_head
            free = cap - (head - q[self.o_tail_i])
            if free <= 0:
                break
            budget = min(free, _CHUNK)
            wrote = 0
            while self.sends and wrote < budget:
                s = self.sends[0]
                part = s.parts[s.part]
                k = min(len(part) - s.off, budget - wrote)
                pos = (head + wrote) % cap
                first = min(k, cap - pos)
                if part.__class__ is ByteStream:
                    self._gather_chunk(s, part, ring, pos, first, k)
                else:
                    w = self.writer or self._new_writer()
                    w.copy(ring[pos:pos + first], part[s.off:s.off + first])
                    if first < k:
                        w.copy(ring[0:k - first], part[s.off + first:s.off + k])
                s.off += k
                wrote += k
                if s.off == len(part):
                    s.part += 1
                    s.off = 0
                    s.gathering = None
                    if s.part == len(s.parts):
                        self.sends.popleft()
                        if s.seq:
                            self.unacked.append(s)
                            rendezvous = True
                        else:
                            s.done = True
            self.o_head = head + wrote
            q[self.o_head_i] = self.o_head
            moved = True
            self.poke_data(rendezvous)
        return moved

    def _gather_chunk(self, s, part, ring, pos, first, k):
        """Gather part's bytes s.off..s.off + k into the ring at pos (first of them before
        its end, the rest from its start): a ByteStream written in chunks goes by one
        method, chosen at its first chunk, and its copies' time is summed over them
        and recorded as one (the gatherer's samples are whole messages; see
        _new_gatherer)."""
        g = s.gathering
        if g is None:
            w = self.gatherer or self._new_gatherer()
            g = s.gathering = [*w.choose(len(part)), 0.0]
        streams, timed = g[0], g[1]
        t0 = time.perf_counter() if timed else 0.0
        part.gather(ring[pos:pos + first], s.off, s.off + first, streams)
        if first < k:
            part.gather(ring[0:k - first], s.off + first, s.off + k, streams)
        if timed:
            g[2] += time.perf_counter() - t0
            if s.off + k == len(part):
                self.gatherer.record(streams, g[2] / len(part))

    def _new_gatherer(self):
        """This ring's SharedWriter for messages gathered from many buffers (ByteStreams:
        broadcast_state's tensors at two ranks), made with the first one.

        Apart from the contiguous messages' writer, and timed a whole message at a
        time: a byte of a gather costs more where its views are small, so a chunk's
        time tells of which tensors it held (with the contiguous writer and a chunk's
        time, 300 small tensors took up to 1.4x as long), while a state synced again
        is the same views every call. Its memcpy is most of the time the faster; in
        stretches where every line it writes is held by the reader's cache, the root's
        gather of 81 small tensors (1.5 MB) took 13x its calm time and a sync 257-577 µs
        by memcpy, 200-263 by streaming stores, where calm runs took 120-220 by memcpy
        (benchmarks/results/small-messages.md)."""
        self.gatherer = self._shared_writer()
        return self.gatherer

    def _new_writer(self):
        """This ring's SharedWriter (shared_write.py): how its large writes go, memcpy or
        streaming stores, timed; made with the first one."""
        self.writer = self._shared_writer()
        return self.writer

    def _shared_writer(self):
        """A SharedWriter for this ring: streaming where the copy helper streams and the
        ring helper, if in use, writes with it too."""
        streams = shared_write.available() and (self.fast is None or ring_helper.streams())
        return shared_write.SharedWriter(streams=streams)

    def _put_timed(self, header, buf, n):
        """The helper's put of a large message, by memcpy or streaming stores as this
        ring's SharedWriter chooses (its gatherer for a ByteStream), the put timed where
        it asks (shared_write.py)."""
        if buf.__class__ is ByteStream:
            w = self.gatherer or self._new_gatherer()
        else:
            w = self.writer or self._new_writer()
        stream, timed = w.choose(n)
        if not timed:
            return self.fast.put(self.o_head, header, 0, buf, stream)
        t0 = time.perf_counter()
        head = self.fast.put(self.o_head, header, 0, buf, stream)
        if head >= 0:
            w.record(stream, (time.perf_counter() - t0) / n)
        return head

    def write_inline(self, header, buf, n):
        """A message that fits in one contiguous piece: write, publish, wake (one of
        MIN_BYTES or more as this ring's SharedWriter chooses: shared_write.py; a
        ByteStream as its gatherer does).

        header: its bytes, or a Stamp (packed straight into the ring)."""
        if self.fast is not None and header.__class__ is not bytes:
            if n < shared_write.MIN_BYTES:
                head = self.fast.put(self.o_head, header, 0, buf)
            else:
                head = self._put_timed(header, buf, n)
            if head < 0:
                return False
            self.o_head = head
            return True
        head, cap, ring = self.o_head, self.cap, self.o_ring
        pos = head % cap
        size = HEADER_SIZE + n
        tail = self.t.q[self.o_tail_i]
        if pos + size > self.rewind and head == tail and size <= pos and \
                cap - pos >= HEADER_SIZE:
            # the ring is empty: start over at its beginning (see rewind)
            HEADER.pack_into(ring, pos, _PAD, 0, 0, 0, -1, 0, -1, cap - pos - HEADER_SIZE)
            head += cap - pos
            pos = 0
        end = pos + size
        if end > cap or head + size - tail > cap:
            return False
        if header.__class__ is bytes:
            ring[pos:pos + HEADER_SIZE] = header
        else:
            header.pack_into(ring, pos, n)
        if n >= shared_write.MIN_BYTES:
            # memcpy or streaming stores, timed
            if buf.__class__ is ByteStream:
                (self.gatherer or self._new_gatherer()).gather(ring[pos + HEADER_SIZE:end],
                                                               buf, 0)
            else:
                (self.writer or self._new_writer()).copy(ring[pos + HEADER_SIZE:end], buf)
        elif n:
            if buf.__class__ is ByteStream:
                buf.gather(ring[pos + HEADER_SIZE:end], 0, n)
            else:
                ring[pos + HEADER_SIZE:end] = buf
        self.o_head = head = head + HEADER_SIZE + n
        self.t.q[self.o_head_i] = head
        self.poke_data()
        return True

    def take_inline(self, stamp, dest):
        """The awaited collective message, if it is the next one in the ring and all
        there in one piece: copy it out and free its room; False otherwise (nothing
        is consumed, and the general path sorts out whatever is there).

        The small-message lane: no receive record, no routing. Only a message that
        matches `stamp` and dest's size is taken, so a Desync, a peer's last words or
        a message that wraps around the ring are the general path's to report."""
        return self._take_whole(dest, COLL, stamp, None)

    def take_tagged(self, view, tag):
        """The tagged message a receive of view (posted now, from this peer) would
        take, if it is the next one in the ring, all there in one piece, and nothing
        stashed or posted before it could claim it: copied out, True. False leaves
        the ring as it was (the general path routes what is there)."""
        return self._take_whole(view, P2P, None, tag)

    def _take_whole(self, dest, kind, stamp, tag):
        """take_inline/take_tagged: the next message, if it is of `kind`, dest's size,
        matching stamp (collective) or tag (tagged), and all there in one piece."""
        if self.posted or self.incoming is not None or self.stash:
            return False
        if self.fast is not None:
            tail = self.fast.take(self.i_tail, stamp, tag, dest, 0.0)
            if tail < 0:
                return False
            self.i_tail = tail
            return True
        q, n, cap = self.t.q, len(dest), self.cap
        tail = self.i_tail
        avail = q[self.i_head_i] - tail
        pos = tail % cap
        if avail >= HEADER_SIZE and pos + HEADER_SIZE <= cap and self.i_ring[pos] == _PAD:
            if HEADER.unpack_from(self.i_ring, pos)[7] != cap - pos - HEADER_SIZE:
                return False                # the general path names the corrupt header
            avail -= cap - pos
            tail += cap - pos
            pos = 0
        if avail < HEADER_SIZE + n:
            return False
        start = pos + HEADER_SIZE
        if start + n > cap:
            return False
        h = HEADER.unpack_from(self.i_ring, pos)
        if h[0] != kind or h[7] != n or \
                (not stamp.matches(h) if stamp is not None else h[5] != tag):
            return False
        if n:
            dest[:] = self.i_ring[start:start + n]      # a ByteStream scatters it
        self.i_tail = tail = tail + HEADER_SIZE + n
        q[self.i_tail_i] = tail
        self.poke_space()
        return True

    def check_acks(self):
        """Complete the single-copy sends the peer acknowledged; help the peer copy the
        next one where it asks (split_message.py). True if anything moved."""
        acked = self.t.q[self.o_acked_i]
        moved = False
        while self.unacked and self.unacked[0].seq <= acked:
            s = self.unacked.popleft()
            s.done = True
            s.keep = None
            moved = True
        if self.unacked and self.cma_in:
            s = self.unacked[0]
            if not s.helped and split_message.asked(self, s.seq):
                s.helped = True
                try:
                    moved = split_message.assist(self, s.seq, s.addr, s.nbytes) or moved
                except OSError as e:
                    self.t._check_abort()
                    raise self.t.peer_lost(self.peer, f"could not be written to "
                                           f"({e.strerror or e})") from None
        return moved

    # -- reading -------------------------------------------------------------
    def next_header(self):
        """The header of the next message in the ring (past a pad), or None while it
        is not all there; nothing is consumed."""
        avail = self.t.q[self.i_head_i] - self.i_tail
        if avail < HEADER_SIZE:
            return None
        h = HEADER.unpack(bytes(self._peek(HEADER_SIZE)))
        if h[0] != _PAD:
            return h
        if avail < HEADER_SIZE + h[7] + HEADER_SIZE:
            return None
        return HEADER.unpack_from(self.i_ring, 0)

    def _peek(self, n):
        pos = self.i_tail % self.cap
        if pos + n <= self.cap:
            return self.i_ring[pos:pos + n]
        return bytes(self.i_ring[pos:]) + bytes(self.i_ring[:n - (self.cap - pos)])

    def _publish_tail(self):
        self.t.q[self.i_tail_i] = self.i_tail
        self.poke_space()

    def advance(self, drain=False):
        """Route incoming messages to posted receives; True if any byte moved.

        Stops once nothing is posted (the next message stays in the ring)
        unless drain is set, when it reads everything the peer has sent (SPARE:
        all but whole tagged messages nobody asked for, while the ring has room).
        """
        q = self.t.q
        moved = False
        consumed = False
        try:
            while True:
                if self.incoming is None:
                    if not self.posted and not drain:
                        return moved
                    avail = q[self.i_head_i] - self.i_tail
                    if avail < HEADER_SIZE:
                        return moved
                    pos = self.i_tail % self.cap
                    if pos + HEADER_SIZE <= self.cap:
                        h = HEADER.unpack_from(self.i_ring, pos)
                    else:
                        h = HEADER.unpack(self._peek(HEADER_SIZE))
                    kind = h[0]
                    n = h[7]
                    if drain is SPARE and kind == P2P and not self.posted and \
                            HEADER_SIZE + n <= avail < self.cap >> 1:
                        # nobody asked for it yet: stashed, it would be allocated and
                        # copied twice more (into the stash, out of it). Its sender is
                        # done with it (it is all here) and the ring is under half full,
                        # so it waits in place for its receive, as a sleeping engine
                        # lets it (_wanted); a ring filling up is drained as before.
                        # A halo exchange at world 4 (a neighbour a step ahead: 0.4-0.75
                        # messages stashed a step) took 0.86x the time this way
                        return moved
                    if kind == _PAD:
                        if pos + HEADER_SIZE + n != self.cap or avail < HEADER_SIZE + n:
                            raise self.t.corrupt(self.peer, h, "a ring pad that does not "
                                                 "reach the ring's end")
                        self.i_tail += HEADER_SIZE + n
                        consumed = moved = True
                        continue
                    if (kind == COLL or kind == P2P) and avail >= HEADER_SIZE + n and \
                            pos + HEADER_SIZE + n <= self.cap:
                        # the whole message is there in one piece: the common small case
                        # (a tagged one too: a halo exchange step at world 2, 8 bytes,
                        # 0.94-0.96x the time this way, rather than by the stream's loop)
                        dest, owner = route(self, h)
                        start = pos + HEADER_SIZE
                        if owner.__class__ is Stash:
                            # its bytes are all here: the stash takes exactly them
                            dest.release()
                            owner.buf = bytearray(self.i_ring[start:start + n])
                        elif n:
                            dest[:] = self.i_ring[start:start + n]
                        self.i_tail += HEADER_SIZE + n
                        consumed = moved = True
                        complete(self, h, owner)
                        continue
                    if kind & _CMA_FLAG:
                        if kind & ~_CMA_FLAG not in (COLL, P2P):
                            raise self.t.corrupt(self.peer, h, f"unknown message kind {kind}")
                        if avail < _DESC_MSG:
                            return moved
                        h = (kind & ~_CMA_FLAG,) + h[1:]
                        if h[0] == P2P and not self.posted and self._defer(h):
                            return moved
                        addr, seq = _DESC.unpack(bytes(self._peek(_DESC_MSG))[HEADER_SIZE:])
                        self._undefer()
                        dest, owner = route(self, h)
                        self.i_tail += _DESC_MSG
                        consumed = moved = True
                        try:
                            if owner.__class__ is Stash:
                                self._cma_into_stash(owner, dest, addr, seq)
                            elif dest.__class__ is ByteStream:
                                # a scattered receive of a message sent in one piece
                                whole = bytearray(len(dest))
                                if whole:
                                    cma.read(self.pid, cma.address(memoryview(whole)), addr,
                                             len(whole))
                                dest[:] = whole
                            elif len(dest):
                                self._copy_in(cma.address(dest), addr, len(dest), seq)
                        except OSError as e:
                            # a sender that aborted (another peer died, say) and exited
                            # is gone for that reason: report it, not the missing process
                            self.t._check_abort()
                            raise self.t.peer_lost(self.peer, f"could not be read from "
                                                   f"({e.strerror or e})") from None
                        # a sender that failed and aborted may have dropped its buffer:
                        # what we read from it after that is not data
                        self.t._check_abort()
                        q[self.i_acked_i] = seq
                        # the sender may sleep until this ack: tell it now, not after
                        # whatever else this call goes on to read
                        self.poke_space()
                        complete(self, h, owner)
                        continue
                    dest, owner = route(self, h)
                    self.i_tail += HEADER_SIZE
                    consumed = moved = True
                    self.incoming = [h, dest, 0, owner]
                inc = self.incoming
                dest, off, owner = inc[1], inc[2], inc[3]
                need = len(dest) - off
                if not need and owner.__class__ is Stash and off < owner.length:
                    # a stashed message grows only as its bytes come in
                    dest = inc[1] = owner.grow(dest)
                    need = len(dest) - off
                if need:
                    avail = q[self.i_head_i] - self.i_tail
                    if not avail:
                        return moved
                    k = min(avail, need, _CHUNK)
                    pos = self.i_tail % self.cap
                    first = min(k, self.cap - pos)
                    dest[off:off + first] = self.i_ring[pos:pos + first]
                    if first < k:
                        dest[off + first:off + k] = self.i_ring[0:k - first]
                    self.i_tail += k
                    inc[2] = off = off + k
                    moved = True
                    if k == _CHUNK:
                        # a stream: free the ring piece by piece, so the writer keeps going
                        self._publish_tail()
                        consumed = False
                    else:
                        consumed = True
                    if k < need or owner.__class__ is Stash and off < owner.length:
                        continue
                self.incoming = None
                complete(self, inc[0], owner)
        finally:
            if consumed:
                self._publish_tail()

    def _defer(self, h):
        """Whether to leave a tagged single-copy message nobody asked for yet in the
        ring for now, rather than copy it into a stash and again out of it.

        Its bytes wait in the sender's memory, and a window of irecvs posted one by
        one, each a moment after its isend's descriptor came in, would otherwise
        stash most of them. It is left there DEFER_S at most: a sender must not
        wait for ever on a receiver busy elsewhere (in a collective, say, or in a
        large send of its own to a third rank). And not at all while this rank's own
        send to the same peer waits for it (two ranks that both block in a large
        send to each other), nor once anything is posted on the link (a receive for
        a message behind it must get there)."""
        if header_problem(h) is not None or self.awaits_peer():
            return False
        now = time.monotonic()
        if self.deferred is None:
            self.deferred = now
            return True
        if now - self.deferred < DEFER_S:
            return True
        self._undefer()
        return False

    def awaits_peer(self):
        """Whether a send of ours to this peer is not through yet: queued, or copied
        out by the peer without its ack being seen (the ack word is read, not the
        records, which are collected later)."""
        return bool(self.sends) or bool(self.unacked) and \
            self.t.q[self.o_acked_i] < self.unacked[-1].seq

    def _undefer(self):
        self.deferred = None

    def _cma_into_stash(self, owner, dest, addr, seq):
        """Copy a single-copy message nobody awaits yet into the stash, in one read.

        Its bytes already sit in the sender's memory (it waits for our ack), so the
        stash need not grow as they arrive: one buffer of the whole length, whose
        pages the kernel provides only as the read fills them (np.empty does not
        zero them, as bytearray would). A length that cannot be had is the peer's
        error, as any impossible header."""
        dest.release()
        if owner.length:
            try:
                buf = np.empty(owner.length, np.uint8)
            except MemoryError:
                raise self.t.peer_lost(self.peer, f"announced a message of {owner.length} "
                                                  f"bytes, more than this process can hold") \
                    from None
            self._copy_in(buf.ctypes.data, addr, owner.length, seq)
            owner.buf = buf

    def _copy_in(self, dest, addr, n, seq):
        """Copy single-copy message seq's n bytes from the sender's addr to this
        process's dest: with the waiting sender writing the back where the group
        splits such messages (split_message.py), else by the receiver alone."""
        if self.t.split and self.cma_out and split_message.applies(n):
            split_message.receive(self, dest, addr, n, seq)
        else:
            cma.read(self.pid, dest, addr, n)

    def has_input(self):
        return self.t.q[self.i_head_i] != self.i_tail


class ShmTransport(Reports):
    """The shared-memory links of one group member to every other member."""
    medium = "shared memory"
    hosts = None                # one host, by construction
    fans_out = True             # (transport/base.py)
    scatters = True
    # the engine's sleep wakes for a link no receive waits on only at half its ring
    # (arm()): see transport/p2p.py's Engine._unwatched
    wakes_on_any_byte = False

    def __init__(self, rank, size, arena, describe_rank, cma_min=4 << 20, plane=0):
        """plane 0: the collectives' rings; 1: the point-to-point rings and doorbell
        (the p2p engine's), over the same arena, which plane 0 owns."""
        self.rank, self.size = rank, size
        self.plane = plane
        self.describe_rank = describe_rank
        self.broken = None
        self.op_desc = ""                        # the call in progress, for error messages
        self.choices = {}                        # algorithms/table.py's memo
        self.history = None                      # seq -> this rank's call then (set by the group)
        self.site_text = None                    # site id -> "file:line" (set by the group)
        self.active = None                       # (recvs, sends) being progressed, for reports
        self.interrupted = None                  # an error another thread found (interrupt)
        self._arena = arena
        self.mem, self.q, self.i32, self.base = arena.mem, arena.q, arena.i32, arena.base
        self.cap = arena.cap if plane == 0 else p2p_cap(arena.cap)
        self.cma_min = cma_min if cma_min > 0 else 1 << 62
        self.crowded_cma_min = 1 << 62           # p2p_cma_crowded's, where connect_shm sets it
        me = self.rank_offset(rank)
        self.bell = _R_DOORBELL if plane == 0 else _R_P2P_DOORBELL
        self._doorbell_i = (me + self.bell) // 4
        self._doorbell = self.base + me + self.bell
        self.arena_path = ""
        self._pidfds = {}
        self._pid = os.getpid()
        ncpu = self.ncpu = usable_cores()
        self._spin_s, self._spin_ack_s, self._yields, self._yield_s = wait_policy(size, ncpu)
        # every rank's _R_ASLEEP word; this rank's, set by the collective plane's sleeps
        self._asleep_words = [(self.rank_offset(r) + _R_ASLEEP) // 8 for r in range(size)]
        self._asleep_i = self._asleep_words[rank] if plane == 0 else None
        # a receiver asks the sender to copy half of a single-copy message only where
        # every rank has a core: with more ranks than cores the help takes a core
        # another rank's copy needs (world 4 on two cores, ACCORD_SHM_SPLIT=0 against
        # the split in eight paired rounds: all_gather of 16 MiB 0.95x the time,
        # broadcast and scatter 1.00-1.02x; benchmarks/results/small-messages.md)
        self.split = size <= ncpu and split_message.wanted()
        self.links = {p: _Link(self, p) for p in range(size) if p != rank}
        self.spin_s = self._spin_s if plane else 0.0     # transport/p2p.py's callers
        self.spin_ack_s = self._spin_ack_s if plane else 0.0
        # where ranks share cores, a p2p caller yields its core this many times (and for
        # at least yield_s) before it sleeps
        self.yields, self.yield_s = (self._yields, self._yield_s) if plane else (0, 0.0)
        self.wait_now_max = _INLINE if self.spin_s else -1     # take_now(wait_s) spins
        self._last_check = time.monotonic()
        self.cma_everywhere = False              # set by read_cma_flags
        self._peer_memory = None
        self._slots = None

    # -- layout ----------------------------------------------------------------
    def rank_offset(self, r):
        return _PAGE + r * _RANK_BLOCK

    def chan_offset(self, src, dst):
        n = self.size
        idx = src * (n - 1) + (dst if dst < src else dst - 1)
        base = _PAGE + n * _RANK_BLOCK
        if self.plane == 0:
            return base + idx * (_PAGE + self.cap)
        return base + n * (n - 1) * (_PAGE + self._arena.cap) + idx * (_PAGE + self.cap)

    def slot_offset(self, r):
        """Where rank r's shared slot starts (slots.py): after every ring of both planes."""
        n, arena = self.size, self._arena
        return _PAGE + n * _RANK_BLOCK + n * (n - 1) * (2 * _PAGE + arena.cap +
                                                         p2p_cap(arena.cap)) + \
            slots_bytes(r, arena.room)

    def setup_peers(self):
        """After every rank has written its block: pids, pidfds, cross-memory checks."""
        for p, link in self.links.items():
            link.pid = self.q[(self.rank_offset(p) + _R_PID) // 8]
            try:
                self._pidfds[p] = os.pidfd_open(link.pid)
            except (AttributeError, OSError):
                pass
            pb = self.rank_offset(p)
            ok = cma.probe(link.pid, self.q[(pb + _R_PROBE_ADDR) // 8],
                           bytes(self.mem[pb + _R_PROBE_VAL:pb + _R_PROBE_VAL + 8]))
            # consumer-written: "I (this rank) can read the producer p"
            self.q[link.i_cma_ok_i] = 1 if ok else 2

    def read_cma_flags(self):
        for link in self.links.values():
            link.cma_out = self.q[link.o_cma_ok_i] == 1
            link.cma_in = self.q[link.i_cma_ok_i] == 1
        # every channel's flag is in the arena: all ranks reach the same answer, which
        # collectives that pick single copy for the whole group need
        self.cma_everywhere = all(
            self.q[(self.chan_offset(a, b) + _C_CMA_OK) // 8] == 1
            for a in range(self.size) for b in range(self.size) if a != b)

    def populate(self):
        """Map this rank's rings (both ways, to every peer) into its page tables now.

        The arena's pages exist (posix_fallocate), but each process faults every
        page in on first touch: on the AMD EPYC guest a cold 1 MiB swap took
        1.4-2.1 ms and a warm one 0.2-0.3 ms, until 4 MiB had gone round each ring.
        That slowed a program's first calls, and it made the single-copy probe
        (cma_threshold.py) compare cold rings with single copy. One madvise
        (MADV_POPULATE_WRITE, Linux 5.14) maps them in bulk, about a third of
        the faults' time; where the kernel lacks it, the pages fault in as before.
        """
        for peer in self.links:
            for c in (self.chan_offset(self.rank, peer), self.chan_offset(peer, self.rank)):
                if not self._map_in(c, _PAGE + self.cap):
                    return

    def _map_in(self, offset, n):
        """MADV_POPULATE_WRITE over n bytes of the arena from offset; False where the
        kernel cannot (the pages then fault in on first touch)."""
        try:
            self._arena.mm.madvise(_MADV_POPULATE_WRITE, offset, n)
            return True
        except (OSError, ValueError, AttributeError):
            return False

    # -- the interface ---------------------------------------------------------------
    def _send(self, peer, header, buf, ring=False):
        link = self.links[peer]
        n = len(buf)
        if (n >= self.cma_min or n >= self.crowded_cma_min and self._crowded()) and \
                link.cma_out and not ring and getattr(buf, "contiguous", True):
            link.cma_seq += 1
            addr = cma.address(buf)
            s = _Send(peer, [_cma_header(header) + _DESC.pack(addr, link.cma_seq)],
                      seq=link.cma_seq, keep=buf, addr=addr, nbytes=n)
        else:
            if not link.sends and n <= _INLINE and link.write_inline(header, buf, n):
                return _SENT
            s = _Send(peer, [header, buf] if n else [header])
        link.sends.append(s)
        return s

    @property
    def peer_memory(self):
        """Access to peers' memory (algorithms/single_copy.py); its flags say which
        pairs may copy straight between their memories."""
        if self._peer_memory is None:
            self._peer_memory = ShmPeerMemory(self)
        return self._peer_memory

    @property
    def slots(self):
        """Each rank's shared slot (slots.py), or None: at two ranks, in an arena too
        small for them, and on the point-to-point plane. Made on first use, when
        every slot this rank writes or reads is mapped into it at once (as populate()
        does for the rings), not page by page during the first calls."""
        if self._slots is None:
            room = self._arena.room if self._arena is not None else 0
            if self.plane or not room:
                return None
            from .slots import ShmSlots
            self._map_in(self.slot_offset(0), slots_bytes(self.size, room))
            self._slots = ShmSlots(self, room)
        return self._slots

    def exchange(self, sends, recvs, stamp, deadline, meanwhile=None, ring=False):
        """Move every (peer, buffer) send and receive; return when all are done.

        meanwhile(): local work run once the sends are posted (peers read
        single-copy messages themselves, so it overlaps their copies).
        ring: send through the ring even where single-copy would apply.
        """
        self._check_usable()
        # small sends are copied into the ring, not read by the peers from this process:
        # the local work overlaps only the peers' own copies, so it runs once this
        # rank's sends are in (and before it waits for theirs)
        local = meanwhile is not None and all([len(b) <= _INLINE and len(b) < self.cma_min
                                               for _, b in sends])
        if meanwhile is None or local:
            if len(sends) <= 1 and len(recvs) <= 1:
                # the small-message lane: a step with one message each way at most goes
                # without records when it fits its ring in one piece; what it cannot do
                # (nothing consumed) the general path below does, errors included
                if sends and self._send_inline(sends[0][0], sends[0][1], stamp):
                    sends = ()
                if local:
                    meanwhile()
                    meanwhile = None
                if recvs and self._recv_inline(recvs[0][0], recvs[0][1], stamp):
                    recvs = ()
            else:
                # the same lane for a step with several peers (direct all_gather, a
                # tree's root): each message that fits goes or comes at once; the rest,
                # and everything after a message to or from the same peer that could
                # not, take the general path (a link's messages stay in order)
                sends = self._sends_inline(sends, stamp)
                if local:
                    meanwhile()
                    meanwhile = None
                recvs = self._recvs_inline(recvs, stamp, not sends)
            if not sends and recvs and self._yields:
                recvs = self._yield_for(recvs, stamp)
            if not sends and not recvs:
                return
        self._exchange_queued(sends, recvs, stamp, deadline, meanwhile, ring)

    def send1(self, peer, view, stamp, deadline, meanwhile=None):
        """exchange(((peer, view),), (), stamp, deadline, meanwhile), the one step of a
        small call: written into the ring at once where it fits, with no list built."""
        n = len(view)
        link = self.links[peer]
        if self.broken is None and n <= _INLINE and n < self.cma_min and not link.sends \
                and link.write_inline(stamp, view, n):
            if meanwhile is not None:
                meanwhile()
            return
        self._check_usable()
        self._exchange_queued(((peer, view),), (), stamp, deadline, meanwhile, False)

    def recv1(self, peer, view, stamp, deadline):
        """exchange((), ((peer, view),), stamp, deadline), taken straight off the ring
        where the message is there (or arrives within the spin)."""
        if self.broken is None and self._recv_inline(peer, view, stamp):
            return
        self._check_usable()
        self._exchange_queued((), ((peer, view),), stamp, deadline, None, False)

    def _exchange_queued(self, sends, recvs, stamp, deadline, meanwhile, ring):
        """exchange() past the small-message lane: receive records, queued sends, and
        the progress loop."""
        links = self.links
        posted = []
        for peer, buf in recvs:
            r = Recv(peer, buf, stamp=stamp)
            link = links[peer]
            if not (link.stash and link.take_stashed(r)):
                link.posted.append(r)
                posted.append(r)
        outgoing = [self._send(peer, stamp.header(len(buf)), buf, ring) for peer, buf in sends]
        if meanwhile is not None:
            self._step(posted, outgoing, ())
            meanwhile()
        self._progress(posted, outgoing, deadline, stamp=stamp)

    def _send_inline(self, peer, buf, stamp):
        """Write a small send into its ring at once; False if it must queue (it is
        large, other sends wait before it, or the ring has no room in one piece)."""
        n = len(buf)
        link = self.links[peer]
        return n <= _INLINE and n < self.cma_min and not link.sends and \
            link.write_inline(stamp, buf, n)

    @staticmethod
    def _each_inline(items, move):
        """move(peer, buf) for each (peer, buf) in turn, skipped for a peer one of whose
        earlier items stayed (a link's messages keep their order); those that stay."""
        left = []
        for peer, buf in items:
            if left and any(p == peer for p, _ in left) or not move(peer, buf):
                left.append((peer, buf))
        return left

    def _sends_inline(self, sends, stamp):
        """_send_inline for each send in turn; the sends left to queue, in order."""
        return self._each_inline(sends, lambda peer, buf: self._send_inline(peer, buf, stamp))

    def _recvs_inline(self, recvs, stamp, spin):
        """_recv_inline for each receive in turn, without spinning (the general path
        watches every peer at once); spin: then spin for the last one left, if only
        one is. Returns the receives left to post, in order."""
        left = self._each_inline(recvs, lambda peer, buf:
                                 self._recv_inline(peer, buf, stamp, False))
        if spin and len(left) == 1 and self._spin_s and \
                self._recv_inline(left[0][0], left[0][1], stamp):
            return []
        return left

    def _yield_for(self, recvs, stamp):
        """More ranks than cores, every send of the step gone: hand the core over
        YIELDS times (and for YIELD_US where some core has a rank to itself), taking
        each awaited message off its ring as it comes (the cheap look of the lane,
        where the general path's loop would build records and look at every link); the
        receives still missing after that, for the general path."""
        end = time.perf_counter() + self._yield_s
        n = 0
        while True:
            os.sched_yield()
            n += 1
            recvs = self._recvs_inline(recvs, stamp, False)
            if not recvs or n >= self._yields and time.perf_counter() >= end:
                return recvs

    def _recv_inline(self, peer, dest, stamp, spin=True):
        """Take a small awaited message straight off its ring, spinning for it briefly
        where every rank has a core (and spin is true); False leaves the ring as it
        was."""
        link = self.links[peer]
        n = len(dest)
        spin_s = self._spin_s if spin and n <= _INLINE else 0.0
        if link.fast is not None:
            # one call: the take, the spin for it where there is one, the take again
            if link.posted or link.incoming is not None or link.stash:
                return False
            tail = link.fast.take(link.i_tail, stamp, 0, dest, spin_s)
            if tail < 0:
                return False
            link.i_tail = tail
            return True
        if link._take_whole(dest, COLL, stamp, None):      # take_inline, a call less
            return True
        if not spin_s:
            return False
        # spin while nothing at all is past the tail: bytes short of the whole message
        # are a message coming in pieces, or another one first, which only the general
        # path takes (as ring_core.c's take)
        q, i, tail = self.q, link.i_head_i, link.i_tail
        if q[i] != tail:
            return False
        end = time.perf_counter() + self._spin_s
        while q[i] == tail and time.perf_counter() < end:
            pass
        return link._take_whole(dest, COLL, stamp, None)

    # -- progress ------------------------------------------------------------------
    def _step(self, recvs, sends, drain):
        links = self.links
        moved = False
        for s in sends:
            if not s.done:
                link = links[s.peer]
                if link.sends and link.push():
                    moved = True
                if link.unacked and link.check_acks():
                    moved = True
        for r in recvs:
            if not r.done and links[r.peer].advance():
                moved = True
        for p in drain:
            if links[p].advance(drain=True):
                moved = True
        return moved

    def _progress(self, recvs, sends, deadline, drain=(), stamp=None):
        i32, q, links = self.i32, self.q, self.links
        spins = 0
        flags = None
        self.active = (recvs, sends)
        try:
            while True:
                moved = self._step(recvs, sends, drain)
                if all(s.done for s in sends) and all(r.done for r in recvs):
                    return
                if moved:
                    spins = 0
                    if flags:
                        for i in flags:
                            q[i] = 0
                        flags = None
                    continue
                # spin a little where every rank has a core, then sleep
                if spins == 0:
                    acking = self._spin_ack_s and any(s.seq and not s.done for s in sends)
                    spin_end = time.perf_counter() + (self._spin_ack_s if acking
                                                      else self._spin_s)
                    yield_end = spin_end + self._yield_s
                    spins = 1
                    continue
                now = time.perf_counter()
                if now < spin_end:
                    spins += 1
                    if acking:
                        os.sched_yield()      # the long spin gives way to anyone runnable
                    continue
                if spins <= self._yields or now < yield_end:
                    # more ranks than cores: hand the core to a peer (which may be the one
                    # we wait for) a few times before paying for a sleep and a wake-up
                    spins += 1
                    os.sched_yield()
                    continue
                if flags is None:
                    if q[_H_ABORT // 8]:
                        # what a rank sent before it aborted comes first, as over TCP
                        self._step(recvs, sends, drain)
                        if all(s.done for s in sends) and all(r.done for r in recvs):
                            return
                        self._check_abort()
                    if stamp is not None:
                        self._check_blocked_sends(sends, stamp)
                    # say what we wait for, then look once more before sleeping: a writer
                    # either sees the flag (and wakes us) or we see its data
                    expected = i32[self._doorbell_i]
                    flags = []
                    for peer in {r.peer for r in recvs if not r.done}.union(drain):
                        link = links[peer]
                        q[link.i_want_data_i] = link.want_data()
                        flags.append(link.i_want_data_i)
                    for peer in {s.peer for s in sends if not s.done}:
                        link = links[peer]
                        if link.sends:
                            q[link.o_want_space_i] = link.want_space()
                            flags.append(link.o_want_space_i)
                        if link.unacked:
                            q[link.o_want_ack_i] = link.unacked[-1].seq
                            flags.append(link.o_want_ack_i)
                    futex.fence()
                    continue
                now = time.monotonic()
                if now >= deadline:
                    raise self._timeout(recvs, sends)
                self._doze(expected, min(deadline - now, _SLICE_S))
                for i in flags:
                    q[i] = 0
                flags = None
                spins = 0
                if self.interrupted is not None:
                    exc, self.interrupted = self.interrupted, None
                    raise exc
                if time.monotonic() - self._last_check >= _LIVENESS_S:
                    self._check_peers(recvs, sends, drain)
        except BaseException:
            for r in recvs:
                if not r.done:
                    try:
                        self.links[r.peer].posted.remove(r)
                    except ValueError:
                        pass
            raise
        finally:
            if flags and self.q is not None:
                for i in flags:
                    q[i] = 0

    def await_words(self, words, want_i, deadline, what, stamp=None):
        """Wait until each word of `words` ((peer, int64 index in the arena, value),
        each written by that peer) reaches its value: the shared slots' flow control
        (slots.py). Spins, yields and sleeps like _progress; before sleeping it
        stores the lowest value awaited at want_i, where the peers look before
        waking this rank.

        Raises the abort reason of an aborted rank, PeerLost for a peer of `words`
        that died or left without writing its word, CommTimeout at the deadline
        (saying `what` the peers have not done), or what interrupt() handed in; with
        `stamp` (the call's), a Desync for a peer whose next message shows that it
        calls something else (ranks that all believe they are a broadcast's root
        fill their slots and wait for each other, as they would on full rings)."""
        q = self.q
        waiting = [w for w in words if q[w[1]] < w[2]]
        if not waiting:
            return
        spin_end = time.perf_counter() + self._spin_s
        yield_end = spin_end + self._yield_s
        yields = 0
        try:
            while True:
                waiting = [w for w in waiting if q[w[1]] < w[2]]
                if not waiting:
                    return
                now = time.perf_counter()
                if now < spin_end:
                    continue
                if yields < self._yields or now < yield_end:
                    yields += 1
                    os.sched_yield()
                    continue
                self._check_abort()
                if stamp is not None:
                    self._check_incoming(stamp)
                expected = self.i32[self._doorbell_i]
                q[want_i] = min(v for _, _, v in waiting)
                futex.fence()
                if all(q[i] >= v for _, i, v in waiting):
                    return
                now = time.monotonic()
                if now >= deadline:
                    names = ", ".join(sorted({self.peer_desc(p) for p, _, _ in waiting}))
                    raise CommTimeout(f"{self._here()}: Timed out waiting for {names} to "
                                      f"{what} (is a rank stuck elsewhere, or calling a "
                                      f"different collective?)")
                self._doze(expected, min(deadline - now, _SLICE_S))
                q[want_i] = 0
                if self.interrupted is not None:
                    exc, self.interrupted = self.interrupted, None
                    raise exc
                if time.monotonic() - self._last_check >= _LIVENESS_S:
                    self._last_check = time.monotonic()
                    # a rank that aborted, or one calling something else, says why before
                    # its departure would say only that it left (as in _check_peers)
                    self._check_abort()
                    if stamp is not None:
                        self._check_incoming(stamp)
                    dead = self._dead_peers()
                    # a crash before a departure (as in _check_peers)
                    for p, i, v in sorted(waiting, key=lambda w: w[0] not in dead):
                        if q[i] >= v:
                            continue
                        if p in dead or q[self.links[p].peer_departed_i] == 1:
                            raise self._gone(p, p not in dead)
                yields = 0
                yield_end = time.perf_counter() + self._yield_s
        finally:
            if self.q is not None:
                q[want_i] = 0

    def _check_blocked_sends(self, sends, stamp):
        """A collective send waiting for ring space: does any peer send us something
        this call can never take? Ranks that each believe they are a root only send;
        once their messages fill the rings they would wait for each other until the
        timeout. A stamp of this call or an earlier one that does not match ours is
        a Desync, named now."""
        if all(s.done for s in sends):
            return
        self._check_incoming(stamp)

    def _check_incoming(self, stamp):
        """A Desync for the first peer whose next collective message is of this call or
        an earlier one but does not match `stamp` (it calls something else)."""
        # any peer, not only the one we send to: three "roots" send in a ring
        for link in self.links.values():
            if link.incoming is not None or link.posted:
                continue
            h = link.next_header()
            if h is None or h[0] & ~_CMA_FLAG != COLL:
                continue
            h = (COLL,) + h[1:]
            if header_problem(h) is None and header_seq(h) <= stamp.seq and \
                    not stamp.matches(h):
                raise self.desync(link.peer, stamp, h)

    def _check_abort(self):
        who = self.q[_H_ABORT // 8]
        if who and who - 1 != self.rank:
            who -= 1
            pb = self.rank_offset(who)
            n = self.q[(pb + _R_ABORT_LEN) // 8]
            msg = bytes(self.mem[pb + _R_ABORT_MSG:pb + _R_ABORT_MSG + n])
            raise decode_error(msg, self.peer_desc(who))

    def _dead_peers(self):
        dead = set()
        if self._pidfds:
            p = select.poll()
            fds = {}
            for peer, fd in self._pidfds.items():
                p.register(fd, select.POLLIN)
                fds[fd] = peer
            for fd, _ in p.poll(0):
                dead.add(fds[fd])
        for peer, link in self.links.items():
            if peer not in self._pidfds:
                try:
                    os.kill(link.pid, 0)
                except ProcessLookupError:
                    dead.add(peer)
                except OSError:
                    pass
        return dead

    def _check_peers(self, recvs, sends, drain):
        self._last_check = time.monotonic()
        if self.q[_H_ABORT // 8]:
            self._step(recvs, sends, drain)
            if all(s.done for s in sends) and all(r.done for r in recvs):
                return
            self._check_abort()
        dead = self._dead_peers()
        needed = {r.peer for r in recvs if not r.done} | {s.peer for s in sends if not s.done} \
            | set(drain)
        gone = []
        for peer, link in self.links.items():
            departed = self.q[link.peer_departed_i] == 1 or link.departed
            if departed or peer in dead:
                gone.append((departed, peer))
        # a crash before a departure: a peer that left while this rank needed it most
        # often left over that crash (its own PeerLost), and the crash is the cause to
        # report (seen in CI: rank 2 SIGKILLed mid all_reduce, rank 0 said only that
        # rank 1 had left)
        for departed, peer in sorted(gone):
            if peer in needed:
                # its last words may still be in the ring
                self._step(recvs, sends, drain)
                if all(s.done for s in sends if s.peer == peer) and \
                        all(r.done for r in recvs if r.peer == peer) and peer not in drain:
                    continue
                raise self._gone(peer, departed)
            if not departed:
                raise self._gone(peer, False)

    def _gone(self, peer, departed):
        """The PeerLost for a peer that left the group on purpose (departed) or whose
        process is gone."""
        if departed:
            return self.peer_lost(peer, "left the group (destroyed it or exited) while this "
                                        "rank still needed it")
        return self.peer_lost(peer, "died (its process is gone)")

    def interrupt(self, exc):
        """End the call sleeping here with exc: another thread proved it can never
        complete. The sleeper wakes within a futex slice and raises it."""
        self.interrupted = exc

    # -- the point-to-point plane (driven by transport/p2p.py's engine thread) ------
    def tagged_send(self, peer, view, tag):
        """Queue (or write at once) a tagged message; the record is done once it is out."""
        link = self.links[peer]
        n = len(view)
        if link.fast is not None and n <= _INLINE and n < self.cma_min and not link.sends:
            head = link.fast.put(link.o_head, None, tag, view)
            if head >= 0:
                link.o_head = head
                return _SENT
        return self._send(peer, HEADER.pack(P2P, OP_SEND, 0, 0, -1, tag, -1, n), view)

    def awaits_copy(self, record):
        """A single-copy send (its record carries an ack number) waits for the peer."""
        return bool(record.seq)

    def take_now(self, peer, view, tag, wait_s=0.0):
        """A receive of view from peer with tag, satisfied straight off the ring if the
        message is there, next and small; False changes nothing.

        wait_s: spin up to this long on the ring's head for the message to be all
        there (a ping-pong's reply is on its way): one word read per turn, where the
        general path would route every byte that comes in."""
        link = self.links[peer]
        n = len(view)
        if link.fast is not None:
            if link.posted or link.incoming is not None or link.stash:
                return False
            tail = link.fast.take(link.i_tail, None, tag, view,
                                  float(wait_s) if n <= _INLINE else 0.0)
            if tail < 0:
                return False
            link.i_tail = tail
            return True
        if link.take_tagged(view, tag):
            return True
        if not wait_s or n > _INLINE:
            return False
        q, i, want = self.q, link.i_head_i, link.i_tail + HEADER_SIZE + n
        end = time.perf_counter() + wait_s
        while q[i] < want and time.perf_counter() < end:
            pass
        return link.take_tagged(view, tag)

    def withdraw_send(self, s):
        """Take back a send no byte of which is in the ring yet; False if under way."""
        link = self.links[s.peer]
        if s.part or s.off or s not in link.sends:
            return False
        link.sends.remove(s)
        return True

    def step_link(self, link, drain=True):
        """Write what is queued, collect acks, read everything the peer sent (drain
        False: only what the posted receives take; SPARE: see transport/base.py)."""
        moved = bool(link.sends) and link.push()
        if link.unacked and link.check_acks():
            moved = True
        return link.advance(drain=drain) or moved

    def lost_peers(self):
        """{peer: why} for peers that died, left the group or aborted: the engine reads
        what they left in the ring, then fails what still waits on them."""
        out = {}
        dead = self._dead_peers()
        for peer, link in self.links.items():
            pb = self.rank_offset(peer)
            if self.q[(pb + _R_ABORT_LEN) // 8]:
                n = self.q[(pb + _R_ABORT_LEN) // 8]
                msg = bytes(self.mem[pb + _R_ABORT_MSG:pb + _R_ABORT_MSG + n])
                out[peer] = decode_error(msg, self.peer_desc(peer))
            elif self.q[link.peer_departed_i] == 1 or link.departed:
                out[peer] = self._gone(peer, True)
            elif peer in dead:
                out[peer] = self._gone(peer, False)
        return out

    def arm(self, links):
        """Say what the engine waits for on each link before it sleeps; returns the
        token for sleep() and disarm(): the doorbell value the futex must be passed
        (so a wake-up is never lost) and the flags raised."""
        q = self.q
        expected = self.i32[self._doorbell_i]
        flags = []
        for link in links:
            # nothing awaited from a peer: a small message may wait in the ring for its
            # receive (its send is complete once it is there), so only a ring filling
            # up (a stream its sender cannot finish alone) needs the engine. Senders
            # doing blocking ping-pongs then never pay for waking an engine that has
            # nothing to do with their messages.
            q[link.i_want_data_i] = self._wanted(link)
            flags.append(link.i_want_data_i)
            if link.sends:
                q[link.o_want_space_i] = link.want_space()
                flags.append(link.o_want_space_i)
            if link.unacked:
                q[link.o_want_ack_i] = link.unacked[0].seq
                flags.append(link.o_want_ack_i)
        futex.fence()
        return expected, flags

    def _wanted(self, link):
        """The head a sleeper waits for on link: a piece of an awaited message, or half
        the ring where nothing is awaited."""
        if link.posted or link.incoming is not None:
            return link.want_data()
        return link.i_tail + self.cap // 2

    def watch(self, link):
        """While the engine sleeps: raise link's flag again as arm() would now, for a
        receive posted since it armed (then the link's next byte wakes the sleeper) or
        after a waiting caller's own sleeps lowered it. False where what it asks for is
        there already (the sender may have looked at the flag before it was raised):
        the sleeper must be woken."""
        want = self.q[link.i_want_data_i] = self._wanted(link)
        futex.fence()
        return self.q[link.i_head_i] < want

    def sleep(self, token, timeout):
        """Sleep on the doorbell (at most a slice: liveness is checked between; and
        no longer than a message left in the ring for its receive may wait)."""
        if timeout > 0:
            deferring = any(link.deferred is not None for link in self.links.values())
            self._doze(token[0], min(timeout, DEFER_S if deferring else _SLICE_S))


    def disarm(self, token):
        """Lower the flags arm() raised (by the holder of the engine's lock only:
        another sleeper may still count on them)."""
        q = self.q
        if q is not None:
            for i in token[1]:
                q[i] = 0

    def wake(self):
        """Wake sleep() from another thread (new work was posted): every sleeper."""
        futex.add_and_wake(self._doorbell, futex.WAKE_ALL)

    def _crowded(self):
        """Whether more of the group's ranks run than this process has cores: a rank
        whose collective call sleeps on its doorbell does not count (one in a
        point-to-point wait or outside accord does)."""
        q = self.q
        running = 0
        for i in self._asleep_words:
            if not q[i]:
                running += 1
        return running > self.ncpu

    def _doze(self, expected, timeout):
        """Sleep on this rank's doorbell while it holds expected (an OS error there
        is said in accord's words: nothing else can be done with this arena). A
        collective call's sleep is written in the rank block for _crowded."""
        asleep = self._asleep_i
        try:
            if asleep is not None:
                self.q[asleep] = 1
            futex.wait(self._doorbell, expected, timeout)
        except OSError as e:
            raise AccordError(f"{self._here()}: sleeping on the shared-memory doorbell "
                              f"failed ({e.strerror or e})") from None
        finally:
            if asleep is not None and self.q is not None:
                self.q[asleep] = 0

    # -- shutdown ----------------------------------------------------------------------
    def abort(self, exc):
        """Tell every peer why this group is broken."""
        if self.broken is not None:
            return
        self.broken = exc
        if self._arena is None or os.getpid() != self._pid:
            return
        if self.plane:
            # the reason lives in the rank block, which the collective plane writes
            for link in self.links.values():
                futex.add_and_wake(link.peer_doorbell)
            return
        msg = encode_error(exc)[:_RANK_BLOCK - _R_ABORT_MSG]
        me = self.rank_offset(self.rank)
        self.mem[me + _R_ABORT_MSG:me + _R_ABORT_MSG + len(msg)] = msg
        self.q[(me + _R_ABORT_LEN) // 8] = len(msg)
        futex.fence()
        if not self.q[_H_ABORT // 8]:
            self.q[_H_ABORT // 8] = self.rank + 1
        self._wake_peers()

    def _wake_peers(self):
        """Ring both doorbells of every peer: its collective call and its p2p engine
        each look at the abort words and departed flags when they wake."""
        for p in self.links:
            pb = self.base + self.rank_offset(p)
            futex.add_and_wake(pb + _R_DOORBELL)
            futex.add_and_wake(pb + _R_P2P_DOORBELL, futex.WAKE_ALL)

    def close(self, grace=0.0):
        if self._arena is None:
            return []
        if os.getpid() != self._pid or self.plane:
            # a forked child leaving (its atexit hooks run close): the arena and the
            # "departed" flag belong to the parent, which is still a member; the p2p
            # plane leaves both to the collective plane, which closes after it
            if self.plane and os.getpid() == self._pid:
                for fd in self._pidfds.values():
                    os.close(fd)
                self._pidfds = {}
            self._arena = None
            self.links = {}
            if self.broken is None:
                self.broken = GroupClosed("the group was destroyed")
            return []
        me = self.rank_offset(self.rank)
        self.q[(me + _R_DEPARTED) // 8] = 1
        self._wake_peers()
        left = self._leftovers(grace) if self.broken is None and grace > 0 else []
        for fd in self._pidfds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._pidfds = {}
        self.links = {}
        self.mem = self.q = self.i32 = None
        arena, self._arena = self._arena, None
        arena.close()
        if self.broken is None:
            self.broken = GroupClosed("the group was destroyed")
        return left

    def _leftovers(self, grace):
        """Collective messages no call of this rank read, seen by reading each peer's
        ring until it departs (for at most `grace` seconds); see TcpTransport."""
        end = time.monotonic() + grace
        pending = dict(self.links)
        while pending:
            for peer, link in list(pending.items()):
                gone = self.q[link.peer_departed_i] == 1
                try:
                    link.advance(drain=True)
                except Exception:       # its abort: nothing more worth reading
                    gone = True
                if gone and not link.has_input():
                    del pending[peer]
            if not pending or time.monotonic() >= end:
                break
            time.sleep(0.002)
        if self.q[_H_ABORT // 8]:
            return []           # a rank aborted: it reported the story already
        return [(peer, h) for peer, link in self.links.items()
                for h, _ in link.stash if h[0] == COLL]


class ShmPeerMemory:
    """The single-copy capability of a shared-memory group (transport/base.py's
    PeerMemory): reading and writing peers' memory with process_vm_readv/writev,
    and the two words per ordered pair a split copy claims its chunks with."""

    def __init__(self, t):
        self._t = t

    @property
    def everywhere(self):
        """Every pair of the group may read and write each other (all ranks agree)."""
        return self._t.cma_everywhere

    @property
    def min_bytes(self):
        return self._t.cma_min

    def usable(self, peer):
        link = self._t.links[peer]
        return link.cma_out and link.cma_in

    address = staticmethod(cma.address)
    segments = staticmethod(cma.iovecs)
    max_segments = cma.IOV_MAX

    def read(self, peer, local, remote, n):
        self._copy("read from", cma.read, peer, local, remote, n)

    def write(self, peer, local, remote, n):
        self._copy("written to", cma.write, peer, local, remote, n)

    def read_segments(self, peer, local, remote, n):
        self._copy("read from", cma.read_segments, peer, local, remote, n)

    def write_segments(self, peer, local, remote, n):
        self._copy("written to", cma.write_segments, peer, local, remote, n)

    def _copy(self, verb, fn, peer, *args):
        t = self._t
        try:
            fn(t.links[peer].pid, *args)
        except OSError as e:
            # a peer that aborted (another rank died, say) and exited is gone for that
            # reason: report it, not the missing process
            t._check_abort()
            raise t.peer_lost(peer, f"could not be {verb} ({e.strerror or e})") from None

    def post_claim(self, peer, value):
        """Publish this side's claim in a split copy with peer (then a full fence)."""
        self._t.q[self._t.links[peer].o_split_i] = value
        futex.fence()

    def peer_claim(self, peer):
        return self._t.q[self._t.links[peer].i_split_i]

    def disagree(self, text):
        """The Desync for ranks whose buffers do not match, worded by the transport."""
        return self._t.mismatch(text)

    def peer_desc(self, peer):
        return self._t.peer_desc(peer)


def _cma_header(header):
    return bytes([header[0] | _CMA_FLAG]) + bytes(header[1:])


class Arena:
    """A mapped arena: byte, int64 and int32 views and its base address."""

    def __init__(self, mm, cap, room=0):
        import ctypes
        self.mm, self.cap, self.room = mm, cap, room
        self.mem = memoryview(mm)
        self.q = self.mem.cast("q")
        self.i32 = self.mem.cast("i")
        self._anchor = ctypes.c_char.from_buffer(mm)
        self.base = ctypes.addressof(self._anchor)
        self._probe = ctypes.create_string_buffer(8)     # peers test cross-memory reads here

    def close(self):
        self._anchor = None
        for v in (self.q, self.i32, self.mem):
            try:
                v.release()
            except (ValueError, BufferError):
                pass
        try:
            self.mm.close()
        except BufferError:        # a view still exists somewhere: the GC unmaps it later
            pass


def _unlink(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class ShmUnavailable(OSError):
    """Shared memory could not be set up for the group (every member raises it)."""


def _text(v):
    return v.decode() if isinstance(v, (bytes, bytearray)) else str(v)


def _barrier(store, key, rank, size, status="ok"):
    """Every member posts its status; all wait for all; any failure fails everyone."""
    store.set(f"{key}/{rank}", status)
    keys = [f"{key}/{r}" for r in range(size)]
    store.wait(keys)
    bad = [(r, _text(store.get(k))) for r, k in enumerate(keys)]
    bad = [(r, v[1:]) for r, v in bad if v != "ok"]
    if bad:
        raise ShmUnavailable("shared memory could not be set up: " +
                             "; ".join(f"group rank {r}: {why}" for r, why in bad))


def _create(path, total):
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        try:
            os.posix_fallocate(fd, 0, total)     # fail now, not with SIGBUS later
        except OSError as e:
            raise OSError(e.errno, f"cannot reserve {total} bytes in {SHM_DIR} for the "
                                   f"group's arena: {e.strerror}") from None
        return mmap.mmap(fd, total)
    except BaseException:
        _unlink(path)
        raise
    finally:
        os.close(fd)


def _attach(path):
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def connect_shm(store, prefix, rank, size, describe_rank, deadline, arena_bytes=64 << 20,
                cma_min=None, p2p_cma_min=None):
    """Create (group rank 0) or attach the group's arena; return a ShmTransport.

    cma_min: the smallest collective message sent single-copy (0: none; None:
    measured between ranks 0 and 1 now, cma_threshold.py); p2p_cma_min: the same
    for point-to-point messages (None: cma_min, or 8 MiB where that is measured, and
    p2p_cma_crowded's size then while more ranks run than there are cores).

    The arena takes at most arena_bytes, and at most a quarter of the free
    space in /dev/shm. Raises ShmUnavailable (an OSError) on every member
    when any member could not set it up, so callers can fall back together.
    """
    key = f"{prefix}/shm"
    path = name = None
    mm = None
    try:
        if rank == 0:
            try:
                st = os.statvfs(SHM_DIR)
                arena_bytes = min(arena_bytes, st.f_bavail * st.f_frsize // 4)
            except OSError:
                pass
            cap, room, total = arena_layout(size, arena_bytes)
            name = f"accord-{secrets.token_hex(16)}"
            path = os.path.join(SHM_DIR, name)
            mm = _create(path, total)
            head = memoryview(mm).cast("q")
            head[_H_NRANKS // 8] = size
            head[_H_CAP // 8] = cap
            head[_H_PCAP // 8] = p2p_cap(cap)
            head[_H_SLOT // 8] = room
            head[_H_MAGIC // 8] = _MAGIC
            head.release()
            store.set(f"{key}/name", name)
        else:
            name = _text(store.get(f"{key}/name"))
            if name.startswith("!"):
                raise ShmUnavailable(f"group rank 0 could not create the shared-memory arena: "
                                     f"{name[1:]}")
            path = os.path.join(SHM_DIR, name)
            mm = _attach(path)
        q = memoryview(mm).cast("q")
        ok = q[_H_MAGIC // 8] == _MAGIC and q[_H_NRANKS // 8] == size
        cap, room = q[_H_CAP // 8], q[_H_SLOT // 8]
        q.release()
        if not ok or arena_layout_total(size, cap, room) != len(mm):
            raise ShmUnavailable(f"the arena of group {prefix!r} does not have this rank's "
                                 f"layout")
    except ShmUnavailable as e:
        _fail(store, key, rank, e, path if rank == 0 else None)
        raise
    except OSError as e:
        _fail(store, key, rank, e, path if rank == 0 else None)
        raise ShmUnavailable(f"{describe_rank(rank)}: shared memory unavailable: {e}") from None
    measure = cma_min is None
    crowded = None
    if measure:
        cma_min = cma_threshold.HIGH        # until the probe has spoken
    if p2p_cma_min is None:
        if measure:
            p2p_cma_min = SHM_P2P_CMA_DEFAULT
            crowded = p2p_cma_crowded(size, p2p_cap(cap), usable_cores())
        else:
            p2p_cma_min = cma_min
    try:
        arena = Arena(mm, cap, room)
        t = ShmTransport(rank, size, arena, describe_rank, cma_min)
        t.p2p = ShmTransport(rank, size, arena, describe_rank, p2p_cma_min, plane=1)
        if crowded is not None:
            t.p2p.crowded_cma_min = crowded
        t.arena_path = path                                 # for tests and messages
        me = t.rank_offset(rank)
        arena.q[(me + _R_PID) // 8] = os.getpid()
        import ctypes
        val = secrets.token_bytes(8)
        ctypes.memmove(arena._probe, val, 8)
        arena.q[(me + _R_PROBE_ADDR) // 8] = ctypes.addressof(arena._probe)
        arena.mem[me + _R_PROBE_VAL:me + _R_PROBE_VAL + 8] = val
        if store.add(f"{key}/attached", 1) == size:
            _unlink(path)
        _barrier(store, f"{key}/ready", rank, size)
        _unlink(path)           # every rank: whoever survives removes the name
        path = None
        t.setup_peers()
        t.p2p.setup_peers()
        t.populate()
        t.p2p.populate()
        _barrier(store, f"{key}/probed", rank, size)
        t.read_cma_flags()
        t.p2p.read_cma_flags()
        if measure:
            t.cma_min = cma_threshold.choose(t, store, key, rank, deadline)
        return t
    except BaseException:
        if path is not None:
            _unlink(path)
        raise


def arena_layout_total(size, cap, room=0):
    nchan = size * (size - 1)
    return _PAGE + size * _RANK_BLOCK + nchan * (2 * _PAGE + cap + p2p_cap(cap)) + \
        slots_bytes(size, room)


def _fail(store, key, rank, exc, path):
    """Tell the others why this rank cannot join, so nobody waits for it."""
    if path is not None:
        _unlink(path)
    why = f"!{exc}"
    try:
        if rank == 0:
            store.set(f"{key}/name", why)
        else:
            store.set(f"{key}/ready/{rank}", why)
    except Exception:
        pass
