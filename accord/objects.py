"""Collectives of picklable Python objects, streamed in bounded chunks.

Each object is pickled with protocol 5; the buffers of numpy arrays (and
anything else that offers a PickleBuffer) are kept out of band, not copied
into the pickle. An object's wire form is one "region":

    [int64 main_len, n_buffers, len_0 .. len_n-1] (padded to 64 bytes)
    main pickle (padded to 64) | buffer 0 (padded to 64) | buffer 1 | ...

Sizes travel first (one small collective). Then the regions move in chunks
of at most CHUNK_BYTES (64 MiB): a chunk that lies inside one buffer is sent
straight from it and received straight into the destination region; only
chunks that straddle pieces go through a bounded staging array. Receivers
unpickle with the out-of-band buffers pointing into the received region, so
the arrays inside an object are never copied a second time, and no message
or buffer is ever larger than a chunk: objects over 2 GiB work.

Every step is an ordinary collective on the group, so the group's order and
checks apply. Uneven pieces use the uneven-size variants; nothing is padded
across ranks.
"""
from __future__ import annotations

import bisect
import pickle
from typing import Any, List, Optional

import numpy as np

from . import api
from .args import check_len, root_rank
from ._types import Timeout
from .group import ProcessGroup
from .world import not_member, resolve_group

CHUNK_BYTES = 64 << 20       # the largest piece of an object any one collective moves
_ALIGN = 64


def _pad(n):
    return -(-n // _ALIGN) * _ALIGN


class _Region:
    """An object's wire form as pieces at offsets (sender), or one array (receiver)."""

    def __init__(self, offsets, pieces, size):
        self.offsets, self.pieces, self.size = offsets, pieces, size

    @classmethod
    def of(cls, obj):
        bufs = []
        main = pickle.dumps(obj, protocol=5, buffer_callback=bufs.append)
        raws = []
        for b in bufs:
            try:
                raws.append(b.raw())
            except BufferError:          # not contiguous: take a contiguous copy
                raws.append(memoryview(bytes(memoryview(b))))
        header = np.array([len(main), len(raws)] + [r.nbytes for r in raws], np.int64)
        offsets, pieces = [0], [memoryview(header.view(np.uint8))]
        off = _pad(header.nbytes)
        for p in [memoryview(main)] + raws:
            offsets.append(off)
            pieces.append(p.cast("B") if p.format != "B" or p.ndim != 1 else p)
            off += _pad(p.nbytes)
        return cls(offsets, pieces, off)

    @classmethod
    def empty(cls, size):
        return cls([0], [np.empty(int(size), np.uint8)], int(size))

    def load(self):
        arr = self.pieces[0]
        head = arr[:16].view(np.int64)
        main_len, n = int(head[0]), int(head[1])
        lens = arr[16:16 + 8 * n].view(np.int64).tolist()
        off = _pad(16 + 8 * n)
        main = memoryview(arr[off:off + main_len])
        off += _pad(main_len)
        buffers = []
        for ln in lens:
            buffers.append(memoryview(arr[off:off + ln]))
            off += _pad(ln)
        return pickle.loads(main, buffers=buffers)

    # -- chunks ----------------------------------------------------------------
    def view(self, start, n, writable):
        """The bytes [start, start+n) as a numpy view if they lie in one piece, else None."""
        i = bisect.bisect_right(self.offsets, start) - 1
        p, off = self.pieces[i], self.offsets[i]
        plen = p.nbytes if isinstance(p, memoryview) else p.size
        if start + n > off + plen or (writable and isinstance(p, memoryview) and p.readonly):
            return None
        return np.frombuffer(p, np.uint8, n, start - off) if isinstance(p, memoryview) \
            else p[start - off:start - off + n]

    def read(self, start, dst):
        """Copy the bytes [start, start+len(dst)) into dst (padding left as it is)."""
        end = start + dst.size
        i = max(0, bisect.bisect_right(self.offsets, start) - 1)
        while i < len(self.pieces) and self.offsets[i] < end:
            p, off = self.pieces[i], self.offsets[i]
            src = np.frombuffer(p, np.uint8) if isinstance(p, memoryview) else p
            lo, hi = max(start, off), min(end, off + src.size)
            if lo < hi:
                dst[lo - start:hi - start] = src[lo - off:hi - off]
            i += 1

    def write(self, start, src):
        arr = self.pieces[0]
        arr[start:start + src.size] = src


def _chunk(region, start, n, writable, staging):
    """A chunk of region to send: in place where it lies in one piece, else staged."""
    v = region.view(start, n, writable)
    if v is None:
        v = staging[:n]
        region.read(start, v)
    return v


def _staging(total):
    return np.empty(min(total, CHUNK_BYTES), np.uint8)


def broadcast_object_list(object_list: List[Any], src: Optional[int] = None,
                          group: Optional[ProcessGroup] = None, device: Any = None,
                          group_src: Optional[int] = None, timeout: Timeout = None) -> None:
    """Copy the root's list of picklable objects into every rank's `object_list`, in place.

    Objects travel pickled (protocol 5, large buffers out of band) in bounded
    chunks, so an object of any size streams without a second copy of it in
    memory. Only CPU: `device` is accepted and ignored.

    Args:
        object_list: on the root, the objects; elsewhere a list of the same
            length, whose items are replaced.
        src: the root's global rank (default 0).
        group: the group to run on (default: the default group); a non-member
            returns None at once.
        device: ignored (torch uses it to pick a staging device).
        group_src: the root as a rank of `group` instead of src.
        timeout: seconds (or a timedelta) for this call only (not in torch).

    Raises:
        TypeError, ValueError: bad arguments, before any byte moves.
        accord.Desync, accord.PeerLost, accord.CommTimeout, accord.GroupClosed: as
            the tensor collectives.
        pickle.PicklingError (or what pickling raises): an object that cannot be
            pickled, on the rank that holds it.
    """
    g = resolve_group(group)
    if not g.is_member:
        return not_member(g, "broadcast_object_list")
    if not isinstance(object_list, list):
        raise TypeError(f"object_list: expected a list, got {type(object_list).__name__}")
    root = root_rank(g, src, group_src, "src")
    is_root = g.rank == root
    if is_root:
        regions = [_Region.of(o) for o in object_list]
        sizes = np.array([r.size for r in regions], dtype=np.int64)
    else:
        sizes = np.zeros(len(object_list), dtype=np.int64)
    api.broadcast(sizes, group=g, group_src=root, timeout=timeout)
    if not is_root:
        regions = [_Region.empty(n) for n in sizes.tolist()]
    starts = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    total = starts[-1]
    staging = None
    pos = 0
    while pos < total:
        n = min(CHUNK_BYTES, total - pos)
        i = bisect.bisect_right(starts, pos) - 1
        if pos + n <= starts[i + 1]:                 # inside object i
            if is_root:
                staging = staging if staging is not None else _staging(total)
                buf = _chunk(regions[i], pos - starts[i], n, True, staging)
            else:
                buf = regions[i].view(pos - starts[i], n, True)
            api.broadcast(buf, group=g, group_src=root, timeout=timeout)
        else:                                        # spans objects: stage
            staging = staging if staging is not None else _staging(total)
            buf = staging[:n]
            if is_root:
                _read_across(regions, starts, pos, buf)
            api.broadcast(buf, group=g, group_src=root, timeout=timeout)
            if not is_root:
                _write_across(regions, starts, pos, buf)
        pos += n
    if not is_root:
        for i, r in enumerate(regions):
            object_list[i] = r.load()


def _across(starts, pos, n):
    i = bisect.bisect_right(starts, pos) - 1
    while pos < starts[-1] and n > 0:
        while starts[i + 1] <= pos:
            i += 1
        take = min(n, starts[i + 1] - pos)
        yield i, pos - starts[i], take
        pos += take
        n -= take


def _read_across(regions, starts, pos, buf):
    done = 0
    for i, off, take in _across(starts, pos, buf.size):
        regions[i].read(off, buf[done:done + take])
        done += take


def _write_across(regions, starts, pos, buf):
    done = 0
    for i, off, take in _across(starts, pos, buf.size):
        regions[i].write(off, buf[done:done + take])
        done += take


def _rounds(sizes):
    return max(1, -(-int(max(sizes)) // CHUNK_BYTES))


def _piece(size, k):
    lo = min(size, k * CHUNK_BYTES)
    return lo, min(size, lo + CHUNK_BYTES) - lo


def _all_sizes(g, size, timeout):
    sizes = np.zeros(g.size, dtype=np.int64)
    api.all_gather_into_tensor(sizes, np.array([size], dtype=np.int64), group=g,
                               timeout=timeout)
    return sizes.tolist()


def all_gather_object(object_list: List[Any], obj: Any, group: Optional[ProcessGroup] = None,
                      timeout: Timeout = None) -> None:
    """Every rank's picklable `obj`, into every rank's `object_list` (one item per rank).

    Objects travel pickled (protocol 5, large buffers out of band) in bounded
    chunks, so an object of any size streams without a second copy of it in
    memory.

    Args:
        object_list: a list of the group's size; item r becomes rank r's obj.
        obj: this rank's object.
        group: the group to run on (default: the default group); a non-member
            returns None at once.
        timeout: seconds (or a timedelta) for this call only (not in torch).

    Raises:
        TypeError, ValueError: bad arguments, before any byte moves.
        accord.Desync, accord.PeerLost, accord.CommTimeout, accord.GroupClosed: as
            the tensor collectives.
        pickle.PicklingError (or what pickling raises): an object that cannot be
            pickled, on the rank that holds it.
    """
    g = resolve_group(group)
    if not g.is_member:
        return not_member(g, "all_gather_object")
    check_len(g, object_list, "object_list")
    mine = _Region.of(obj)
    sizes = _all_sizes(g, mine.size, timeout)
    outs = [_Region.empty(n) for n in sizes]
    for k in range(_rounds(sizes)):
        blocks = []
        for n, out in zip(sizes, outs):
            lo, m = _piece(n, k)
            blocks.append(out.pieces[0][lo:lo + m])
        lo, m = _piece(mine.size, k)
        mine.read(lo, blocks[g.rank])
        api.all_gather(blocks, blocks[g.rank], group=g, timeout=timeout)
    for i, o in enumerate(outs):
        object_list[i] = o.load()


def gather_object(obj: Any, object_gather_list: Optional[List[Any]] = None,
                  dst: Optional[int] = None, group: Optional[ProcessGroup] = None,
                  group_dst: Optional[int] = None, timeout: Timeout = None) -> None:
    """Every rank's picklable `obj`, into the root's `object_gather_list`.

    Objects travel pickled (protocol 5, large buffers out of band) in bounded
    chunks, so an object of any size streams without a second copy of it in
    memory.

    Args:
        obj: this rank's object.
        object_gather_list: on the root, a list of the group's size (item r
            becomes rank r's obj); None elsewhere.
        dst: the root's global rank (default 0).
        group: the group to run on (default: the default group); a non-member
            returns None at once.
        group_dst: the root as a rank of `group` instead of dst.
        timeout: seconds (or a timedelta) for this call only (not in torch).

    Raises:
        TypeError, ValueError: bad arguments, before any byte moves.
        accord.Desync, accord.PeerLost, accord.CommTimeout, accord.GroupClosed: as
            the tensor collectives.
        pickle.PicklingError (or what pickling raises): an object that cannot be
            pickled, on the rank that holds it.
    """
    g = resolve_group(group)
    if not g.is_member:
        return not_member(g, "gather_object")
    root = root_rank(g, dst, group_dst, "dst")
    is_root = g.rank == root
    if is_root:
        check_len(g, object_gather_list, "object_gather_list")
    mine = _Region.of(obj)
    sizes = _all_sizes(g, mine.size, timeout)     # everyone learns how many rounds
    outs = [_Region.empty(n) for n in sizes] if is_root else None
    staging = None
    for k in range(_rounds(sizes)):
        lo, m = _piece(mine.size, k)
        if is_root:
            blocks = []
            for n, out in zip(sizes, outs):
                blo, bm = _piece(n, k)
                blocks.append(out.pieces[0][blo:blo + bm])
            mine_chunk = blocks[g.rank]
            mine.read(lo, mine_chunk)
        else:
            blocks = None
            staging = staging if staging is not None else _staging(mine.size)
            mine_chunk = _chunk(mine, lo, m, False, staging)
        api.gather(mine_chunk, blocks, group=g, group_dst=root, timeout=timeout)
    if is_root:
        for i, o in enumerate(outs):
            object_gather_list[i] = o.load()


def scatter_object_list(scatter_object_output_list: List[Any],
                        scatter_object_input_list: Optional[List[Any]] = None,
                        src: Optional[int] = None, group: Optional[ProcessGroup] = None,
                        group_src: Optional[int] = None, timeout: Timeout = None) -> None:
    """The root's `scatter_object_input_list[r]` into rank r's `scatter_object_output_list[0]`.

    Objects travel pickled (protocol 5, large buffers out of band) in bounded
    chunks, so an object of any size streams without a second copy of it in
    memory.

    Args:
        scatter_object_output_list: a list of at least one item; item 0 is
            replaced by this rank's object.
        scatter_object_input_list: on the root, one object per rank; None
            elsewhere.
        src: the root's global rank (default 0).
        group: the group to run on (default: the default group); a non-member
            returns None at once.
        group_src: the root as a rank of `group` instead of src.
        timeout: seconds (or a timedelta) for this call only (not in torch).

    Raises:
        TypeError, ValueError: bad arguments, before any byte moves.
        accord.Desync, accord.PeerLost, accord.CommTimeout, accord.GroupClosed: as
            the tensor collectives.
        pickle.PicklingError (or what pickling raises): an object that cannot be
            pickled, on the rank that holds it.
    """
    g = resolve_group(group)
    if not g.is_member:
        return not_member(g, "scatter_object_list")
    if not isinstance(scatter_object_output_list, list) or len(scatter_object_output_list) < 1:
        raise ValueError("scatter_object_output_list: expected a list with at least one element")
    root = root_rank(g, src, group_src, "src")
    is_root = g.rank == root
    if is_root:
        check_len(g, scatter_object_input_list, "scatter_object_input_list")
        ins = [_Region.of(o) for o in scatter_object_input_list]
        biggest = max(r.size for r in ins)
        size_list = [np.array([r.size, biggest], np.int64) for r in ins]
    head = np.zeros(2, np.int64)
    api.scatter(head, size_list if is_root else None, group=g, group_src=root, timeout=timeout)
    size, biggest = head.tolist()
    out = _Region.empty(size)
    stagings = [None] * g.size
    for k in range(_rounds([biggest])):
        lo, m = _piece(size, k)
        chunk = out.pieces[0][lo:lo + m]
        parts = None
        if is_root:
            parts = []
            for r, region in enumerate(ins):
                rlo, rm = _piece(region.size, k)
                if stagings[r] is None:
                    stagings[r] = _staging(region.size)
                # writable: api.scatter's list check asks for writable buffers today
                parts.append(_chunk(region, rlo, rm, True, stagings[r]))
        api.scatter(chunk, parts, group=g, group_src=root, timeout=timeout)
    scatter_object_output_list[0] = out.load()
