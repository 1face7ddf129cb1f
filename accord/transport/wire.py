"""The message header every byte travels behind.

Each message is stamped with the collective it belongs to (DESIGN invariant 2):
a receiver that finds a stamp it did not expect raises Desync naming both
sides, instead of reading the bytes into the wrong place.
"""
import struct

from ..errors import AccordError, CommTimeout, Desync, GroupClosed, PeerLost

# kind, op, dtype, redop, root, seq (or tag), count (call-wide size), length (payload)
HEADER = struct.Struct("<BBBBiqqQ")
HEADER_SIZE = HEADER.size

COLL, P2P, ABORT, BYE = 1, 2, 3, 4
NO_DTYPE = 255           # calls that carry no tensor (barrier)

OP_NAMES = ("none", "broadcast", "all_gather", "gather", "scatter", "reduce", "all_reduce",
            "reduce_scatter", "all_to_all", "barrier", "send")
OP_CODES = {name: i for i, name in enumerate(OP_NAMES)}


class Stamp:
    """What a collective call is, as every rank of the group must agree."""
    __slots__ = ("op", "seq", "root", "dtype", "redop", "count", "dtype_name")

    def __init__(self, op, seq, root=-1, dtype=0, redop=0, count=-1, dtype_name=""):
        self.op, self.seq, self.root, self.dtype = op, seq, root, dtype
        self.redop, self.count, self.dtype_name = redop, count, dtype_name

    def header(self, length, kind=COLL):
        return HEADER.pack(kind, self.op, self.dtype, self.redop, self.root, self.seq,
                           self.count, length)

    def matches(self, h):
        return (h[1] == self.op and h[5] == self.seq and h[4] == self.root
                and h[2] == self.dtype and h[3] == self.redop and h[6] == self.count)

    def describe(self):
        return describe(self.op, self.seq, self.root, self.dtype_name, self.count)


def describe(op, seq, root, dtype, count):
    name = OP_NAMES[op] if 0 <= op < len(OP_NAMES) else f"op#{op}"
    parts = [f"{name} #{seq}"]
    if root >= 0:
        parts.append(f"root {root}")
    if dtype:
        parts.append(str(dtype))
    if count > 0 or count == 0 and dtype:
        parts.append(f"{count} bytes")
    return ", ".join(parts)


def describe_header(h):
    from .._dtypes import dtype_name
    if h[0] == P2P:
        return f"send (tag {h[5]}, {h[7]} bytes)"
    return describe(h[1], h[5], h[4], "" if h[2] == NO_DTYPE else dtype_name(h[2]), h[6])


_ERROR_TYPES = {cls.__name__: cls for cls in (CommTimeout, PeerLost, Desync, GroupClosed,
                                               AccordError)}


def encode_error(exc):
    return f"{type(exc).__name__}\n{exc}".encode("utf-8", "replace")


def decode_error(payload, peer_desc):
    """An ABORT from a peer becomes the same error type here, saying who reported it."""
    name, _, msg = bytes(payload).decode("utf-8", "replace").partition("\n")
    cls = _ERROR_TYPES.get(name, AccordError)
    text = f"{msg} [reported by {peer_desc}]"
    return cls(text) if cls is not PeerLost else PeerLost(text)
