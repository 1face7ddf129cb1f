"""The message header every byte travels behind.

Each message is stamped with the collective it belongs to (DESIGN invariant 2):
a receiver that finds a stamp it did not expect raises Desync naming both
sides, instead of reading the bytes into the wrong place.

Header, 32 bytes, little-endian (HEADER, a struct.Struct of 8 fields):

    0 kind   u8   COLL, P2P, ABORT, BYE
    1 op     u8   index into OP_NAMES
    2 dtype  u8   numpy dtype number (NO_DTYPE: none)
    3 redop  u8   ReduceOp
    4 root   i32  group rank, -1 if none
    5 seq    i64  COLL: bits 0-39 the call's sequence number in its group,
                  bits 40-62 the call site id (debug.site_id); P2P: the tag;
                  ABORT/BYE: 0
    6 count  i64  call-wide byte count, -1 if not part of the signature
    7 length u64  payload bytes following the header

Only the seq bits take part in matching: two ranks may reach the same call
from different lines. The site id lets a Desync name the peer's file:line.
`header_problem` says what is impossible about a header read off a peer, so
a corrupted or hostile frame is an error before any byte is allocated.
"""
import struct

from ..errors import AccordError, CommTimeout, Desync, GroupClosed, PeerLost

# kind, op, dtype, redop, root, seq (+ site, or tag), count (call-wide size), length (payload)
HEADER = struct.Struct("<BBBBiqqQ")
HEADER_SIZE = HEADER.size

COLL, P2P, ABORT, BYE = 1, 2, 3, 4
KINDS = (COLL, P2P, ABORT, BYE)
NO_DTYPE = 255           # calls that carry no tensor (barrier)

OP_NAMES = ("none", "broadcast", "all_gather", "gather", "scatter", "reduce", "all_reduce",
            "reduce_scatter", "all_to_all", "barrier", "send", "signature", "broadcast_state")
OP_CODES = {name: i for i, name in enumerate(OP_NAMES)}
OP_SEND = OP_CODES["send"]       # the op of every tagged (point-to-point) message

SEQ_BITS = 40
SEQ_MASK = (1 << SEQ_BITS) - 1
SITE_MASK = (1 << 23) - 1

MAX_PAYLOAD = 1 << 40        # no single message is a terabyte
MAX_ABORT = 1 << 20          # an ABORT carries an error message
MAX_BYE = 1 << 12


class Stamp:
    """What a collective call is, as every rank of the group must agree.

    site/where/shape describe the call for messages only; they never take
    part in matching.
    """
    __slots__ = ("op", "seq", "root", "dtype", "redop", "count", "dtype_name", "site", "where",
                 "shape", "_seqf")

    def __init__(self, op, seq, root=-1, dtype=0, redop=0, count=-1, dtype_name="", shape=None,
                 site=0, where=""):
        self.op, self.seq, self.root, self.dtype = op, seq, root, dtype
        self.redop, self.count, self.dtype_name = redop, count, dtype_name
        self.site, self.where, self.shape = site, where, shape
        self._seqf = seq | site << SEQ_BITS       # seq < 2**40, site < 2**23 (debug.site_id)

    def header(self, length, kind=COLL):
        return HEADER.pack(kind, self.op, self.dtype, self.redop, self.root, self._seqf,
                           self.count, length)

    def pack_into(self, buf, offset, length, kind=COLL):
        """header(length, kind), written into buf at offset."""
        HEADER.pack_into(buf, offset, kind, self.op, self.dtype, self.redop, self.root,
                         self._seqf, self.count, length)

    def matches(self, h):
        return (h[1] == self.op and (h[5] ^ self._seqf) & SEQ_MASK == 0 and h[4] == self.root
                and h[2] == self.dtype and h[3] == self.redop and h[6] == self.count)

    def describe(self):
        text = describe(self.op, self.seq, self.root, self.dtype_name, self.count, self.shape)
        return f"{text} at {self.where}" if self.where else text


def header_seq(h):
    """The sequence number a COLL header carries (without its site id)."""
    return h[5] & SEQ_MASK


def header_site(h):
    return (h[5] >> SEQ_BITS) & SITE_MASK if h[0] == COLL else 0


def describe(op, seq, root, dtype, count, shape=None):
    name = OP_NAMES[op] if 0 <= op < len(OP_NAMES) else f"op#{op}"
    parts = [f"{name} #{seq}"]
    if root >= 0:
        parts.append(f"root {root}")
    if dtype:
        parts.append(str(dtype) + (str(list(shape)) if shape is not None else ""))
    if count > 0 or count == 0 and dtype:
        parts.append(f"{count} bytes")
    return ", ".join(parts)


def describe_header(h, site_text=None):
    """A peer's call as its header tells it; site_text(site id) -> 'file:line' or None."""
    from .._dtypes import dtype_name
    if h[0] == P2P:
        return f"send (tag {h[5]}, {h[7]} bytes)"
    text = describe(h[1], header_seq(h), h[4], "" if h[2] == NO_DTYPE else dtype_name(h[2]), h[6])
    site = header_site(h)
    if site and site_text is not None:
        where = site_text(site)
        text += f" at {where}" if where else f" (call site #{site:06x})"
    return text


def desync_text(stamp, peer_desc, h, detail="", history=None, site_text=None):
    """What a mismatching stamp means, naming both sides' calls.

    history(seq) -> this rank's own call at an earlier seq (its flight
    recorder), or None; site_text(site id) -> 'file:line' or None.
    """
    theirs = describe_header(h, site_text)
    seq = header_seq(h) if h[0] == COLL else None
    mine = stamp.describe()
    extra = f"; {detail}" if detail else ""
    if seq is not None and seq < stamp.seq:
        past = history(seq) if history is not None else None
        was = f" (this rank called {past})" if past else ""
        return (f"ranks disagree at call #{seq}: {peer_desc} called {theirs}, a message this rank "
                f"never read: it completed its call #{seq} without it{was}, and is now in "
                f"{mine}{extra}")
    if seq is not None and seq > stamp.seq:
        return (f"ranks disagree: this rank called {mine}, but {peer_desc} is already at call "
                f"#{seq} ({theirs}): it completed #{stamp.seq} with a different signature or "
                f"skipped it{extra}")
    return f"ranks disagree: this rank called {mine}, but {peer_desc} called {theirs}{extra}"


def header_problem(h):
    """Why a header read off a peer cannot be genuine, or None.

    Checked before routing, so a corrupt or hostile frame never makes this
    rank allocate, or write, what it claims.
    """
    kind, op, length = h[0], h[1], h[7]
    if kind not in KINDS:
        return f"unknown message kind {kind}"
    if kind == COLL:
        if not 0 < op < len(OP_NAMES) or op == OP_CODES["send"]:
            return f"unknown collective code {op}"
        if h[5] < 0 or h[6] < -1 or h[4] < -1:
            return "negative sequence number, count or root"
        if length > MAX_PAYLOAD:
            return f"impossible payload length {length}"
        return None
    if kind == P2P:
        return f"impossible payload length {length}" if length > MAX_PAYLOAD else None
    if kind == ABORT:
        return f"oversized abort message ({length} bytes)" if length > MAX_ABORT else None
    return f"oversized goodbye ({length} bytes)" if length > MAX_BYE else None


_ERROR_TYPES = {cls.__name__: cls for cls in (CommTimeout, PeerLost, Desync, GroupClosed,
                                               AccordError)}


def abort_header(length):
    return HEADER.pack(ABORT, 0, 0, 0, -1, 0, -1, length)


def encode_error(exc):
    return f"{type(exc).__name__}\n{exc}".encode("utf-8", "replace")[:MAX_ABORT]


def decode_error(payload, peer_desc):
    """An ABORT from a peer becomes the same error type here, saying who reported it."""
    name, _, msg = bytes(payload).decode("utf-8", "replace").partition("\n")
    cls = _ERROR_TYPES.get(name, AccordError)
    text = f"{msg} [reported by {peer_desc}]"
    return cls(text) if cls is not PeerLost else PeerLost(text)
