"""Buffers taken as one stream of bytes, copied range by range.

broadcast_state's root writes a repeated state into its shared slot in pieces of
at most the slot's room, cut where the room ends rather than where a tensor does;
each receiver copies every piece back out into its own buffers, which may cut the
same stream elsewhere (its own tensors, or the general path's packed arrays).
"""
import bisect
from typing import List


class ByteStream:
    """Byte views, in order, as one stream: gather() copies a range of the stream into
    a contiguous buffer, scatter() a contiguous buffer into a range of the stream."""
    __slots__ = ("views", "ends")

    def __init__(self, views: List[memoryview]):
        """views: byte memoryviews (format "B"), in stream order."""
        self.views = views
        ends, n = [], 0
        for v in views:
            n += len(v)
            ends.append(n)
        self.ends = ends

    @property
    def nbytes(self) -> int:
        return self.ends[-1] if self.ends else 0

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

    def gather(self, mem: memoryview, lo: int, hi: int) -> None:
        """Copy stream bytes lo..hi into mem[0:hi - lo]."""
        views = self.views
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
        if lo == 0 and hi == self.nbytes:       # the whole stream: no view is cut
            at = 0
            for v in views:
                n = len(v)
                v[:] = mem[at:at + n]
                at += n
            return
        for i, off, at, k in self._spans(lo, hi):
            views[i][off:off + k] = mem[at:at + k]
