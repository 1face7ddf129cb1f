"""Matching incoming messages to posted receives, shared by every transport.

A link keeps the receives posted on it (`posted`, in order) and the messages
that arrived before anyone asked for them (`stash`: point-to-point messages
with another tag, or collective messages that overtook an awaited
point-to-point one). An any-source receive is posted on every link as a set
of rivals; the first link that matches one withdraws the others.
"""
from .wire import ABORT, BYE, COLL, P2P, decode_error, header_problem

STASH_STEP = 1 << 20    # a stashed message's buffer grows as its bytes arrive, never on faith
# step_link(link, SPARE) (transport/base.py): read what the posted receives take, and
# beyond them only what a sender still waits on; a whole message nobody asked for yet
# may stay on the link for its receive instead of being copied into the stash and out
SPARE = "spare"


class Stash:
    """Where a message goes that no receive took: kind "stash" (kept for a later
    receive), "drop" (its receive failed: read and forgotten), "abort" or "bye" (a
    peer's last words). Its buffer grows with the bytes that actually arrive,
    never on the header's word."""
    __slots__ = ("length", "buf", "kind")

    def __init__(self, h, kind="stash"):
        self.length, self.kind = h[7], kind
        self.buf = bytearray(min(self.length, STASH_STEP))

    def view(self):
        return memoryview(self.buf)

    def grow(self, view):
        """Room for more bytes (doubling, up to the length); returns the new view."""
        view.release()
        have = len(self.buf)
        self.buf.extend(bytes(min(self.length - have, max(have, STASH_STEP))))
        return memoryview(self.buf)


def route(link, h):
    """(destination view, owner) of a message whose header h was just read off link:
    the awaited collective receive, a tagged receive, or a Stash. A header that
    cannot be genuine is PeerLost, one that is not this rank's call a Desync."""
    kind, length = h[0], h[7]
    head = link.posted[0] if link.posted else None
    t = link.t
    if kind == COLL and head is not None and head.stamp is not None:
        # the common case: the awaited message; a match vouches for the header
        if head.stamp.matches(h) and length == head.length:
            return head.dest, head
        problem = header_problem(h)
        if problem is not None:
            raise t.corrupt(link.peer, h, problem)
        if not head.stamp.matches(h):
            raise t.desync(link.peer, head.stamp, h)
        raise t.desync(link.peer, head.stamp, h,
                       f"it sent {length} bytes where this rank expects {head.length}")
    problem = header_problem(h)
    if problem is not None:
        raise t.corrupt(link.peer, h, problem)
    if kind == ABORT or kind == BYE:
        st = Stash(h, "abort" if kind == ABORT else "bye")
        return st.view(), st
    if kind == P2P:
        r = match_tagged(link, h)
        if r is not None:
            if r == "drop":
                st = Stash(h, "drop")
                return st.view(), st
            return r.dest, r
    st = Stash(h)
    return st.view(), st


def complete(link, h, owner):
    """A message is all in: finish its receive, keep it, or act on last words."""
    if owner.__class__ is Stash:
        if owner.kind == "abort":
            link.eof = True
            raise decode_error(owner.buf, link.t.peer_desc(link.peer))
        if owner.kind == "bye":
            link.departed = True
        elif owner.kind == "stash":
            link.stashed(h, memoryview(owner.buf))
        return
    owner.done = True
    link.posted.remove(owner)


class Recv:
    """A receive posted on one link: into dest, matching a stamp (collective) or a tag."""
    __slots__ = ("peer", "stamp", "dest", "tag", "done", "length", "rivals", "won", "error")

    def __init__(self, peer, dest, stamp=None, tag=None):
        self.peer, self.dest, self.stamp, self.tag = peer, dest, stamp, tag
        self.done, self.length = False, len(dest)
        self.rivals = None          # an any-source receive: the same receive on every link
        self.won = False
        self.error = None           # done, but failed (a tagged message of another size)

    def claim(self, links):
        """This receive takes a message: withdraw its rivals before any byte lands."""
        self.won = True
        rivals, self.rivals = self.rivals, None
        for o in rivals or ():
            if o is not self and not o.done:
                o.done, o.rivals = True, None
                try:
                    links[o.peer].posted.remove(o)
                except ValueError:
                    pass


def match_tagged(link, h):
    """The receive posted on link that the tagged message h goes to, or None.

    Receives match in the order they were posted (MPI's non-overtaking rule).
    A receive whose buffer is not the message's size takes it and fails: the
    message is dropped (returns "drop") and the receive is done with its error.
    """
    for r in link.posted:
        if r.tag is not None and r.tag == h[5]:
            if r.rivals:
                r.claim(link.t.links)
            if h[7] == r.length:
                return r
            r.error = link.t.p2p_size_mismatch(link.peer, h, r)
            r.done = True
            link.posted.remove(r)
            return "drop"
    return None


class StashMatching:
    """Mixin for links with `posted`, `stash`, `peer` and `t` (the transport)."""

    def take_stashed(self, r):
        """Satisfy a receive from the stash; True if it was there."""
        for i, (h, data) in enumerate(self.stash):
            if r.tag is not None:
                if h[0] != P2P or h[5] != r.tag:
                    continue
                if r.rivals:
                    r.claim(self.t.links)
                del self.stash[i]
                r.done = True
                if len(data) != r.length:
                    # the message is consumed by the receive it matched, which fails
                    r.error = self.t.p2p_size_mismatch(self.peer, h, r)
                elif r.length:
                    r.dest[:] = data
                return True
            else:
                if h[0] != COLL:
                    continue
                if not r.stamp.matches(h) or len(data) != r.length:
                    raise self.t.desync(self.peer, r.stamp, h)
            if r.rivals:
                r.claim(self.t.links)
            r.dest[:] = data
            del self.stash[i]
            r.done = True
            return True
        return False

    def stashed(self, h, data):
        """Keep a message nobody asked for yet; a receive posted while it streamed in
        takes it now."""
        self.stash.append((h, data))
        for r in list(self.posted):
            if self.take_stashed(r):
                self.posted.remove(r)
                break
