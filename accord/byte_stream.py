"""Buffers taken as one stream of bytes, copied range by range.

broadcast_state's root writes a repeated state into its shared slot in pieces of
at most the slot's room, cut where the room ends rather than where a tensor does;
each receiver copies every piece back out into its own buffers, which may cut the
same stream elsewhere (its own tensors, or the general path's packed arrays).

A ByteStream is also a message of its own: the transports' exchange(), send1()
and recv1() take one wherever they take a byte view (transport/base.py), sending
its views back to back as one message (gathered as they are written out) and
filling them in turn from one (scattered as it is read, slice by slice:
`stream[lo:hi] = data`), so that tensors travel with no packed copy of them on
either side. A path of a medium that can only fill one buffer receives into a
contiguous stand-in first (staged()).
"""
import bisect
from typing import List

from . import localcopy

# the optional C helper (accord/copy_core.c), unless off with ACCORD_COPY_HELPER=0: each
# view a range crosses costs a memcpy, not two slices and an assignment in Python
_views_copy = localcopy.views_copy if localcopy.helper_on() else None


class ByteStream:
    """Byte views, in order, as one stream: gather() copies a range of the stream into
    a contiguous buffer, scatter() a contiguous buffer into a range of the stream;
    len() is its byte count."""
    __slots__ = ("views", "ends")
    contiguous = False          # as memoryview's: never one buffer (no single copy)

    def __init__(self, views: List[memoryview]):
        """views: byte memoryviews (format "B"), in stream order."""
        self.views = views
        ends, n = [], 0
        for v in views:
            n += len(v)
            ends.append(n)
        self.ends = ends

    def __len__(self) -> int:
        return self.ends[-1] if self.ends else 0

    @property
    def nbytes(self) -> int:
        return len(self)

    def __setitem__(self, key: slice, data) -> None:
        """stream[lo:hi] = data: scatter(data, lo, hi), so that code filling a buffer
        slice by slice (a ring's reader, a stash's) fills a stream alike."""
        lo, hi, step = key.indices(len(self))
        if step != 1 or len(data) != hi - lo:
            raise ValueError(f"a ByteStream takes a contiguous slice of its own length "
                             f"({hi - lo} bytes), not {len(data)} bytes")
        self.scatter(data, lo, hi)

    def _spans(self, lo, hi):
        """(view index, offset in the view, offset in the buffer, length) for stream[lo:hi]."""
        ends, views = self.ends, self.views
        i = bisect.bisect_right(ends, lo)
        at = lo
        while at < hi:
            k = min(ends[i], hi) - at
            yield i, at - (ends[i] - len(views[i])), at - lo, k
            at += k
            i += 1

    def _first(self, lo):
        """(index of the view holding stream byte lo, lo's offset in it)."""
        i = bisect.bisect_right(self.ends, lo)
        return i, lo - (self.ends[i] - len(self.views[i]))

    def gather(self, mem: memoryview, lo: int, hi: int, streaming: bool = False) -> None:
        """Copy stream bytes lo..hi into mem[0:hi - lo]; streaming: with streaming stores
        (the copy helper's; a shared slot's writer asks for them where it timed them
        faster: transport/shared_write.py; without the helper it never does)."""
        views = self.views
        if _views_copy is not None:
            if hi > lo:
                i, off = self._first(lo)
                _views_copy(views, i, off, mem, hi - lo, False, streaming)
            return
        # the whole stream (a state within one chunk): no view is cut, and a plain loop
        # saves the spans' generator (world 3, 10 and 30 tensors: 0.85-0.9x the sync's
        # time in four rounds against it)
        if lo == 0 and hi == self.nbytes:
            at = 0
            for v in views:
                n = len(v)
                mem[at:at + n] = v
                at += n
            return
        for i, off, at, k in self._spans(lo, hi):
            mem[at:at + k] = views[i][off:off + k]

    def scatter(self, mem: memoryview, lo: int, hi: int) -> None:
        """Copy mem[0:hi - lo] into stream bytes lo..hi."""
        views = self.views
        if _views_copy is not None:
            if hi > lo:
                i, off = self._first(lo)
                _views_copy(views, i, off, mem, hi - lo, True)
            return
        if lo == 0 and hi == self.nbytes:       # the whole stream: no view is cut
            at = 0
            for v in views:
                n = len(v)
                v[:] = mem[at:at + n]
                at += n
            return
        for i, off, at, k in self._spans(lo, hi):
            views[i][off:off + k] = mem[at:at + k]


def staged(recvs):
    """(recvs, finish): the (peer, buffer) receives with each ByteStream swapped for a
    contiguous buffer of its size, and finish() scattering those into their streams
    once every receive is done (None where there was no ByteStream): how a medium's
    path that fills one buffer at a time takes a scattered message."""
    later = None
    for peer, buf in recvs:
        if buf.__class__ is ByteStream:
            later = []
            break
    if later is None:
        return recvs, None
    out = []
    for peer, buf in recvs:
        if buf.__class__ is ByteStream:
            stand_in = memoryview(bytearray(len(buf)))
            later.append((buf, stand_in))
            buf = stand_in
        out.append((peer, buf))

    def finish():
        for stream, stand_in in later:
            stream.scatter(stand_in, 0, len(stream))
    return out, finish
