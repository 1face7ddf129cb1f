"""The errors a transport raises, worded the same whatever the wire.

Mixin for transports with `rank`, `describe_rank`, `op_desc` (the call in
progress), `history` and `site_text` (set by the group) and `medium` (what
a corrupt header says cannot be trusted).
"""
from ..errors import CommTimeout, Desync, GroupClosed, PeerLost
from .wire import desync_text


class Reports:
    medium = "link"
    broken = None
    # the collective running now, (op name, seq, group name), set by the group: what
    # op_desc says, formatted only when an error needs it
    current = None
    _fixed_desc = ""

    @property
    def op_desc(self):
        """The call in progress, for messages ("" if none)."""
        c = self.current
        if c is not None:
            return f"{c[0]} #{c[1]} (group {c[2]!r})"
        return self._fixed_desc

    @op_desc.setter
    def op_desc(self, text):
        self._fixed_desc = text

    def _check_usable(self):
        """After close(): GroupClosed, before any byte is touched."""
        if self.broken is not None and isinstance(self.broken, GroupClosed):
            raise self.broken

    def peer_desc(self, peer):
        return self.describe_rank(peer)

    def _here(self):
        me = self.describe_rank(self.rank)
        return f"{me}: {self.op_desc}" if self.op_desc else me

    def peer_lost(self, peer, why):
        return PeerLost(f"{self._here()}: peer {self.peer_desc(peer)} {why} "
                        f"(did that process exit or crash?)", peer=peer)

    def desync(self, peer, stamp, h, detail=""):
        return Desync(f"{self._here()}: " + desync_text(stamp, self.peer_desc(peer), h, detail,
                                                         self.history, self.site_text))

    def mismatch(self, text):
        """A Desync saying `text` about this rank's call (what its peers' buffers or
        pieces show), prefixed with the rank and the call."""
        return Desync(f"{self._here()}: {text}")

    def corrupt(self, peer, h, problem):
        return PeerLost(f"{self._here()}: {self.peer_desc(peer)} sent a corrupt message header "
                        f"({problem}; header {tuple(h)}); the {self.medium} cannot be trusted",
                        peer=peer)

    def p2p_size_mismatch(self, peer, h, r):
        why = ("message truncated" if h[7] > r.length else
               "a receive takes a message of exactly its buffer's size")
        return Desync(f"{self._here()}: {self.peer_desc(peer)} sent a message of {h[7]} bytes "
                      f"with tag {h[5]}, but the receive buffer holds {r.length} bytes ({why}; "
                      f"the message is dropped)")

    def _timeout(self, recvs, sends):
        waiting = sorted({self.peer_desc(r.peer) for r in recvs if not r.done})
        sending = sorted({self.peer_desc(s.peer) for s in sends if not s.done})
        parts = []
        if waiting:
            parts.append("waiting for data from " + ", ".join(waiting))
        if sending:
            parts.append("waiting to send to " + ", ".join(sending))
        return CommTimeout(f"{self._here()}: Timed out {'; '.join(parts)} "
                           f"(is a rank stuck elsewhere, or calling a different collective?)")
