"""Shared slots: a piece written once and copied out by every peer (shared memory).

A pairwise ring copies a byte twice for each reader (into the ring, out of
it), so a rank that gives one block to three peers copies it six times. In a
group of more than two ranks each rank also owns a slot in the arena: a
control page and two pieces of `room` bytes. It writes a piece there once and
each peer copies it straight out. At world 4 an all-gather then costs each
rank five copies of a block instead of seven, and a broadcast's root one
instead of three; with four ranks on two cores the wall time is the sum of
every rank's copying.

That a piece is there, its number and its length travel as a small stamped
message on the rings (algorithms/slotted.py sends it), so a rank calling
something else is still a Desync, and a lost or aborted writer is found the
way any receive finds it. The slot adds only the writer's side of the flow
control: a piece is written again (two pieces later) once every reader of
what it last held says it is done, by raising its own word in the writer's
control page. Each word has one writer, so no atomic instruction is needed;
a writer that must wait sleeps on its doorbell like every waiter
(ShmTransport.await_words: aborts, lost readers, the deadline, interrupts).
"""
import collections
from typing import Iterable, Tuple

from . import futex
from .shared_write import SharedWriter

_PAGE = 4096        # the control page before a slot's bytes (shm.py's layout)
_WANT = 0           # i64, the writer's: wake me once a reader's word reaches this
_DONE = 64          # + 64 * reader, i64, that reader's: where the last piece it copied
                    # out of this slot ended
_LIVE_MAX = 64      # pieces remembered before those copied out are looked for


class ShmSlots:
    """This rank's slot and its view of its peers' (transport/base.py's SharedSlots).

    A slot's two pieces' worth of memory is a ring of bytes: a piece of any size
    up to `room` goes where the last one ended (or at the ring's start, if it would
    cross the end), so many small pieces may wait for their readers at once and a
    root broadcasting small messages runs ahead of its receivers as it does on the
    rings. Positions are byte counters that only grow; a reader's word holds the
    end of the last piece it copied out of this slot (a reader takes a writer's
    pieces in the order they were written)."""

    def __init__(self, t, room):
        """t: the ShmTransport of the collective plane; room: its arena's piece size."""
        self._t = t
        self.room = room
        self._cap = 2 * self.room
        self._base = [t.slot_offset(r) for r in range(t.size)]
        self._head = 0                                  # where the next piece may start
        self._live = collections.deque()                # (start, end, readers) not yet
                                                        # known to be copied out
        me = self._base[t.rank]
        self._want_i = (me + _WANT) // 8
        self._done = [(me + _DONE + 64 * r) // 8 for r in range(t.size)]
        self._writer = SharedWriter()

    def claim(self, readers: Iterable[int], nbytes: int, stamp,
              deadline: float) -> Tuple[int, memoryview]:
        """A piece of nbytes (at most `room`) in this rank's slot, for `readers` to copy
        out: (its position, its memory), once the readers of every earlier piece
        whose bytes it reuses have copied that out. The position goes to the readers
        with the length. stamp: the call's (a peer found calling something else
        while this rank waits is a Desync)."""
        if not 0 <= nbytes <= self.room:
            raise ValueError(f"a piece of a shared slot holds 0 to {self.room} bytes, "
                             f"not {nbytes}")
        cap = self._cap
        start = self._head
        pos = start % cap
        if not nbytes:                          # nothing to protect, nothing to wait for
            off = self._base[self._t.rank] + _PAGE + pos
            return start, self._t.mem[off:off]
        if pos + nbytes > cap:                  # a piece is one contiguous range
            start += cap - pos
            pos = 0
        end = start + nbytes
        need = {}
        live = self._live
        if len(live) > _LIVE_MAX:
            self._forget_released()
        while live and live[0][0] < end - cap:
            _, e, rs = live.popleft()
            for r in rs:
                need[r] = e                     # later pieces end later: the last one counts
        if need:
            self._t.await_words([(r, self._done[r], e) for r, e in need.items()], self._want_i,
                                deadline, "copy earlier pieces out of this rank's shared slot",
                                stamp)
        live.append((start, end, tuple(readers)))
        self._head = end
        off = self._base[self._t.rank] + _PAGE + pos
        return start, self._t.mem[off:off + nbytes]

    def fill(self, mem: memoryview, src) -> None:
        """mem[:] = src, for a piece claim() gave: by memcpy, or by streaming stores
        where those wrote a byte clearly faster in this rank's latest tries
        (shared_write.py)."""
        self._writer.copy(mem, src)

    def gather(self, mem: memoryview, stream, lo: int) -> None:
        """fill() from a ByteStream: its bytes lo..lo + len(mem) (broadcast_state's
        tensors, gathered straight into the piece)."""
        self._writer.gather(mem, stream, lo)

    def _forget_released(self):
        """Drop the oldest pieces every reader has copied out: tiny pieces (a rank's
        small block in an uneven all_gather) would otherwise pile up for a whole
        lap of the slot before their bytes are wanted again."""
        q, live = self._t.q, self._live
        while live and all(q[self._done[r]] >= live[0][1] for r in live[0][2]):
            live.popleft()

    def piece(self, peer: int, start: int, nbytes: int) -> memoryview:
        """The nbytes of peer's piece at position `start`, to copy out (then release())."""
        pos = start % self._cap
        if not 0 <= nbytes <= self.room or start < 0 or pos + nbytes > self._cap:
            raise self.disagree(f"{self._t.peer_desc(peer)} announced a piece of {nbytes} bytes "
                                f"at {start} in its shared slot, which holds {self._cap}")
        off = self._base[peer] + _PAGE + pos
        return self._t.mem[off:off + nbytes]

    def release(self, peer: int, start: int, nbytes: int) -> None:
        """Say that this rank has copied peer's piece at `start` out; wake the peer if it
        waits for that to write there again."""
        t = self._t
        q = t.q
        base = self._base[peer]
        end = start + nbytes
        q[(base + _DONE + 64 * t.rank) // 8] = end
        futex.fence()
        want = q[(base + _WANT) // 8]
        if want and end >= want:
            futex.add_and_wake(t.links[peer].peer_doorbell)

    def peer_desc(self, peer: int) -> str:
        return self._t.peer_desc(peer)

    def disagree(self, text: str) -> Exception:
        """The Desync to raise when a peer's piece is not what this rank's call expects."""
        return self._t.mismatch(text)
