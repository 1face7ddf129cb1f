"""Collective algorithms: plain functions over a `Comm`, which they never look inside.

A `Comm` is one call's view of its group: this rank, the group size, and
send/recv/swap/exchange of byte buffers, every message stamped with the call.
"""
import numpy as np

from ..buffers import byte_view


def as_bytes(x):
    if isinstance(x, np.ndarray):
        return byte_view(x)
    return x


def _view(x):
    # as_bytes for the one-message steps of small calls, a call less
    try:
        return memoryview(x).cast("B")
    except (TypeError, ValueError, BufferError):
        return as_bytes(x)


class Comm:
    """rank, size, peer_memory and slots (transport/base.py's PeerMemory and
    SharedSlots, or None), fans_out, scatters, choices
    (the algorithm table's memo for these links), and the moves: exchange, send,
    recv."""
    __slots__ = ("rank", "size", "choices", "_t", "_stamp", "_deadline")

    def __init__(self, transport, stamp, deadline):
        self.rank, self.size = transport.rank, transport.size
        self.choices = transport.choices
        self._t, self._stamp, self._deadline = transport, stamp, deadline

    @property
    def peer_memory(self):
        """The transport's access to peers' memory (None where it has none): asked
        for only by the algorithms that copy between memories, not on every call."""
        return self._t.peer_memory

    @property
    def fans_out(self):
        """Whether one step moving a small message to and from every peer costs about
        what a pairwise step does (transport/base.py)."""
        return self._t.fans_out

    @property
    def scatters(self):
        """Whether the transport fills a ByteStream receive in place (transport/base.py)."""
        return self._t.scatters

    @property
    def slots(self):
        """The transport's shared slots (transport/base.py's SharedSlots), or None."""
        return self._t.slots

    def claim(self, readers, nbytes):
        """slots.claim for this call: a piece of nbytes of this rank's shared slot for
        `readers`, (its position, its memory)."""
        return self._t.slots.claim(readers, nbytes, self._stamp, self._deadline)

    @property
    def deadline(self):
        """The time.monotonic() by which the call must be done (phases on subgroups
        run within what is left of it)."""
        return self._deadline

    def restamped(self, stamp):
        """The same links and deadline with every message stamped `stamp`: an extra
        round of the call that its peers check as a call of its own (the signature
        exchange of ACCORD_DEBUG=DETAIL)."""
        return Comm(self._t, stamp, self._deadline)

    def exchange(self, sends=(), recvs=(), meanwhile=None, ring=False):
        """Move every (peer, buffer) send and receive of one step; return when done.

        meanwhile(): local work (a copy) run once the sends are posted, while the
        messages move (a transport that cannot overlap them runs it first).
        ring: stream through the shared ring even where single copy would apply.
        """
        if sends:
            sends = [(p, as_bytes(b)) for p, b in sends]
        if recvs:
            recvs = [(p, as_bytes(b)) for p, b in recvs]
        self._t.exchange(sends, recvs, self._stamp, self._deadline, meanwhile, ring)

    def swap(self, peer, out, into, meanwhile=None):
        """exchange(sends=[(peer, out)], recvs=[(peer, into)], meanwhile): the step of
        pairwise algorithms, without the lists."""
        self._t.exchange(((peer, _view(out)),), ((peer, _view(into)),), self._stamp,
                         self._deadline, meanwhile)

    def send(self, peer, buf, meanwhile=None):
        """One message to peer; meanwhile: as exchange's."""
        self._t.send1(peer, _view(buf), self._stamp, self._deadline, meanwhile)

    def recv(self, peer, buf):
        self._t.recv1(peer, _view(buf), self._stamp, self._deadline)


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
