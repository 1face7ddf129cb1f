"""Collective algorithms: plain functions over a `Comm`, which they never look inside.

A `Comm` is one call's view of its group: this rank, the group size, and
send/recv/exchange of byte buffers, every message stamped with the call.
"""
import numpy as np


def as_bytes(x):
    if isinstance(x, np.ndarray):
        return memoryview(x.reshape(-1).view(np.uint8))
    return x


_NONE = {}


class Comm:
    __slots__ = ("rank", "size", "_t", "_stamp", "_deadline")

    def __init__(self, transport, stamp, deadline):
        self.rank, self.size = transport.rank, transport.size
        self._t, self._stamp, self._deadline = transport, stamp, deadline

    def exchange(self, sends=(), recvs=(), meanwhile=None):
        """meanwhile(): local work (a copy) that may run while the messages move.

        A transport that can overlap them (`overlaps` true: shared memory, where a
        peer copies the data out itself) runs it once the sends are posted; any
        other runs it first.
        """
        t = self._t
        if meanwhile is not None and not getattr(t, "overlaps", False):
            meanwhile()
            meanwhile = None
        sends = [(p, as_bytes(b)) for p, b in sends]
        recvs = [(p, as_bytes(b)) for p, b in recvs]
        if meanwhile is None:
            t.exchange(sends, recvs, self._stamp, self._deadline)
        else:
            t.exchange(sends, recvs, self._stamp, self._deadline, meanwhile)

    def collective(self, name):
        """The transport's whole-collective fast path for `name` (shm), or None:
        fn(comm, ...) -> True if it ran, False if it does not apply here."""
        return getattr(self._t, "collectives", _NONE).get(name)

    def send(self, peer, buf):
        self.exchange(sends=[(peer, buf)])

    def recv(self, peer, buf):
        self.exchange(recvs=[(peer, buf)])


def split(arr, counts):
    """Consecutive views of arr with the given element counts."""
    out, off = [], 0
    for c in counts:
        out.append(arr[off:off + c])
        off += c
    return out


def even_counts(total, n):
    """n nearly equal element counts summing to total."""
    q, r = divmod(total, n)
    return [q + (1 if i < r else 0) for i in range(n)]
