"""Buffers taken as one stream of bytes, copied range by range.

broadcast_state's root writes a repeated state into its shared slot in pieces of
at most the slot's room, cut where the room ends rather than where a tensor does;
each receiver copies every piece back out into its own buffers, which may cut the
same stream elsewhere (its own tensors, or the general path's packed arrays).
"""
import bisect
from typing import Callable, List, Optional


class ByteStream:
    """Byte views, in order, as one stream: gather() copies a range of the stream into
    a contiguous buffer, scatter() a contiguous buffer into a range of the stream."""
    __slots__ = ("views", "ends", "after", "_due")

    def __init__(self, views: List[memoryview], after: Optional[Callable[[int], None]] = None):
        """views: byte memoryviews (format "B"); after(i): run once scatter() has written
        the last byte of view i (a receiver unpacking a packed array), views in order."""
        self.views = views
        ends, n = [], 0
        for v in views:
            n += len(v)
            ends.append(n)
        self.ends = ends
        self.after = after
        self._due = 0

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
        if lo == 0 and hi == self.nbytes:       # the whole stream: no view is cut
            at = 0
            for v in views:
                n = len(v)
                mem[at:at + n] = v
                at += n
            return
        for i, off, at, k in self._spans(lo, hi):
            mem[at:at + k] = views[i][off:off + k]

    def scatter(self, mem: memoryview, lo: int, hi: int) -> None:
        """Copy mem[0:hi - lo] into stream bytes lo..hi (ranges in increasing order, when
        `after` is given: it runs for every view that ends at or before hi)."""
        views = self.views
        if lo == 0 and hi == self.nbytes and self.after is None:
            at = 0
            for v in views:
                n = len(v)
                v[:] = mem[at:at + n]
                at += n
            return
        for i, off, at, k in self._spans(lo, hi):
            views[i][off:off + k] = mem[at:at + k]
        after = self.after
        if after is not None:
            ends = self.ends
            while self._due < len(ends) and ends[self._due] <= hi:
                after(self._due)
                self._due += 1
