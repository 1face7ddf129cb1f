"""The transport contract: what a group may ask of its links, written down once.

Two media implement it, `tcp.TcpTransport` (sockets) and `shm.ShmTransport`
(shared-memory rings); tests/transport/ runs one conformance suite against
both, and any later medium must pass it too. Everything both media share
lives beside this file: the receive records and matching rules
(matching.py), the error wording (reports.py), the wire format (wire.py) and
the point-to-point engine (p2p.py).

A group member holds two transports of one medium:

- the **collective plane** (`Transport`), driven by whichever thread runs the
  group's current collective, one call at a time, in issue order;
- the **point-to-point plane** (`Transport` plus `TaggedPlane`), driven only
  by the group's p2p engine thread (p2p.py), never by a collective.

They share nothing a call waits on: a posted receive or a blocked send on one
plane never holds up the other.

Errors. Every blocking method raises only accord's errors, never a bare
OSError: each medium maps OS errors at its edge (a failed socket or a
cross-memory copy that cannot be done is the peer's loss):

  PeerLost     a peer died, closed while needed, or sent a frame that cannot be
               genuine; "[reported by rank N]" when the peer aborted with a reason
  Desync       a stamp, tag size or byte count that does not match this rank's call
  CommTimeout  the deadline passed; the message names whom this rank waited for
  GroupClosed  after close() or abort()
  the exception handed to interrupt()

The first failure of a collective breaks the group (group.py calls abort() on
both planes); a point-to-point failure fails only the operations it concerns.
"""
from typing import Callable, Iterable, List, Optional, Protocol, Sequence, Tuple

Exchange = Sequence[Tuple[int, memoryview]]


class PeerMemory(Protocol):
    """Single copy between ranks' memories (shm with cross-memory attach): what the
    split-copy broadcasts of algorithms/single_copy.py need, nothing more. Every
    flag reads words all ranks share, so every rank reaches the same answer."""
    everywhere: bool        # every pair of the group may read and write each other
    min_bytes: int          # ACCORD_SHM_CMA: below this, copies go through the rings
    max_segments: int       # the most segments either side of read_segments / write_segments

    def usable(self, peer: int) -> bool: ...
    def address(self, view: memoryview) -> int: ...
    def segments(self, pairs) -> object:
        """(address, length) pairs as the segment array read_segments takes."""
    def read(self, peer: int, local: int, remote: int, n: int) -> None:
        """Copy n bytes from the peer's address remote to local; PeerLost on failure."""
    def write(self, peer: int, local: int, remote: int, n: int) -> None: ...
    def read_segments(self, peer: int, local, remote, n: int) -> None:
        """read() between scattered buffers: n bytes from the peer's segments `remote`
        into this rank's `local`, arrays of segments (segments()) of any counts, the
        bytes streaming from one side's segments into the other's in order; one
        system call. PeerLost on failure."""
    def write_segments(self, peer: int, local, remote, n: int) -> None: ...
    def post_claim(self, peer: int, value: int) -> None:
        """Publish this side's claim in a split copy with peer, then fence."""
    def peer_claim(self, peer: int) -> int: ...
    def disagree(self, text: str) -> Exception:
        """The Desync to raise when ranks' buffers do not match."""
    def peer_desc(self, peer: int) -> str: ...


class SharedSlots(Protocol):
    """A slot per rank in memory the whole group maps (shm, beyond two ranks): a rank
    writes a piece once and every peer copies it out, where a ring copies it in and
    out once per peer. What algorithms/slotted.py needs; the piece's position and
    length travel as stamped messages beside it."""
    room: int       # the bytes of one piece

    def claim(self, readers: Iterable[int], nbytes: int, stamp,
              deadline: float) -> Tuple[int, memoryview]:
        """A piece of nbytes (at most room) in this rank's slot for `readers`, once the
        readers of what its bytes held before have copied that out: (its position,
        its memory). Waiting raises what a blocked call raises (abort reason,
        PeerLost, CommTimeout, a Desync for a peer seen calling something else)."""
    def fill(self, mem: memoryview, src) -> None:
        """Write src (as many bytes) into mem, a piece claim() gave, the way that is
        fastest for memory peers read (shm: memcpy or streaming stores, timed)."""
    def gather(self, mem: memoryview, stream, lo: int) -> None:
        """fill() from a ByteStream's bytes lo..lo + len(mem)."""
    def piece(self, peer: int, start: int, nbytes: int) -> memoryview:
        """peer's piece at position `start`; Desync for an impossible one."""
    def release(self, peer: int, start: int, nbytes: int) -> None:
        """This rank is done copying peer's piece at `start` out."""
    def disagree(self, text: str) -> Exception:
        """The Desync to raise when a piece is not what this rank's call expects."""
    def peer_desc(self, peer: int) -> str: ...


class Transport(Protocol):
    """The links of one member of a group to every other member.

    Thread safety: one blocking call at a time (the group's issue order, or the
    p2p engine, guarantees it); interrupt() and, on the point-to-point plane,
    wake() may be called from any thread.
    """
    rank: int                           # this member's rank in the group
    size: int
    medium: str                         # "connection" | "shared memory": error messages
    peer_memory: Optional[PeerMemory]   # single copy between memories, or None
    slots: Optional[SharedSlots]        # a shared slot per rank, or None
    # whether one step moving a small message to and from every peer costs about what a
    # pairwise step does (shared memory: every ring is written and watched at once;
    # sockets: each peer's message costs its own system calls and wake-ups)
    fans_out: bool
    # whether a ByteStream receive is filled in place, slice by slice as the bytes come
    # (shm), rather than through a contiguous stand-in copied out at the end (sockets)
    scatters: bool
    p2p: Optional["Transport"]          # shm: the point-to-point plane of the same arena
    links: dict                         # peer -> the medium's link to it
    choices: dict                       # the algorithm table's memo for these links

    # what the group hands over (group.py) so that errors can name calls and sites
    history: Optional[Callable[[int], Optional[str]]]      # seq -> this rank's call then
    site_text: Optional[Callable[[int], Optional[str]]]    # call site id -> "file:line"
    reason_of: Optional[Callable[[int], Optional[Exception]]]  # peer -> its abort reason
    # the point-to-point plane's: peer -> what it was doing as it last published ("" if
    # unknown), appended to a point-to-point timeout's message
    peer_text: Optional[Callable[[int], str]]
    op_desc: str                        # the call in progress, for messages
    current: Optional[tuple]            # (op, seq, group name) of the running collective
    active: Optional[tuple]             # (recvs, sends) being waited on, for reports
    interrupted: Optional[BaseException]  # set by interrupt(); the group clears it per call
    hosts: Optional[list]               # TCP over several hosts: each member's host (hierarchy)

    def exchange(self, sends: Exchange, recvs: Exchange, stamp, deadline: float,
                 meanwhile: Optional[Callable[[], None]] = None, ring: bool = False) -> None:
        """Move every (peer, view) send and receive of one step of a collective,
        each message stamped with `stamp`; return when all are done.

        A view may be a ByteStream (byte_stream.py), here and in send1/recv1: one
        message made of its views back to back, gathered from them as it goes out
        and scattered into them as it comes in, at no copy beyond a plain view's
        where the medium can (the shared ring's one-piece messages, a socket's
        sendmsg); a stream never goes by single copy.

        meanwhile(): local work run once the sends are posted, while peers copy
        (a medium that cannot overlap runs it first). ring: stream through the
        shared ring even where single copy would apply (shm only).
        A message whose stamp does not match is a Desync naming both calls; a
        send that cannot move while a peer sends this call a mismatching stamp
        (both "roots") is a Desync too, not a wait for the deadline."""

    def send1(self, peer: int, view: memoryview, stamp, deadline: float,
              meanwhile: Optional[Callable[[], None]] = None) -> None:
        """exchange(((peer, view),), (), stamp, deadline, meanwhile): the one-message
        step of small calls (a binomial tree's edge), which a medium may take a
        shorter way."""

    def recv1(self, peer: int, view: memoryview, stamp, deadline: float) -> None:
        """exchange((), ((peer, view),), stamp, deadline)."""

    def interrupt(self, exc: BaseException) -> None:
        """End the blocked call with exc within one wait slice (another thread
        proved it can never complete: debug/deadlock.py)."""

    def abort(self, exc: BaseException) -> None:
        """Tell every peer why this group is broken, then hang up. Idempotent."""

    def close(self, grace: float = 0.0) -> List[Tuple[int, tuple]]:
        """Say goodbye and release the links; with grace > 0 first read peers'
        last messages (at most grace seconds) and return the collective headers
        no call of this rank read, (peer, header) each, for the Desync at destroy.
        A forked child's close() leaves the parent's links working."""


class TaggedPlane(Protocol):
    """What the point-to-point engine (p2p.py) needs of its plane, besides
    `links` (each with `posted`, `stash`, `sends`, `unacked`, `incoming` and
    `take_stashed(recv)`). All but wake() run under the engine's lock (its
    thread, or a caller progressing inline while the engine is idle)."""
    spin_s: float       # how long a blocking caller may move the links itself first
    # whether sleep() wakes at any byte from any peer; False where arm() asks to be
    # woken for a link with no receive posted only once much has come (shm: half
    # its ring), so a receive posted during a sleep must have watch() called for its
    # link (or wake the sleeper to re-arm)
    wakes_on_any_byte: bool
    spin_ack_s: float   # ... when its send waits for the peer to copy it out (single copy)
    wait_now_max: int   # the largest message take_now(wait_s) waits for (-1: none)
    yields: int         # where ranks share cores: sched_yield()s a waiting caller makes
    yield_s: float      # ... and for at least this long, before it sleeps (0: none)

    def tagged_send(self, peer: int, view: memoryview, tag: int):
        """Queue (or write at once) a tagged message; the record's `done` turns
        true once the bytes are out of view (delivered, or where the peer finds them)."""

    def take_now(self, peer: int, view: memoryview, tag: int, wait_s: float = 0.0) -> bool:
        """A receive from peer with tag into view, done at once if its message is
        the next one on the link and already all there (nothing posted or stashed
        before it); False changes nothing (a medium may always say False). wait_s:
        a medium that can watch the link cheaply may wait that long for it."""

    def awaits_copy(self, record) -> bool:
        """Whether a send completes only once the peer has copied it out of this
        process's memory (single copy), rather than once it is written."""

    def withdraw_send(self, record) -> bool:
        """Take back a send none of whose bytes left; False if it is under way."""

    def step_link(self, link, drain: bool = True) -> bool:
        """Write what is queued, read everything the peer sent (into posted receives
        or the stash); True if a byte moved. Raises the link's failure. drain=False
        reads only while receives are posted on the link (what lies before their
        messages is stashed), leaving later messages where they are for the
        receives about to be posted. drain=matching.SPARE reads what drain=True
        must for no sender to wait on this rank, and may leave a message nobody
        asked for where it is once all of it is in and the link has room (shared
        memory: under half a ring); a socket reads everything, as with True."""

    def lost_peers(self) -> dict:
        """{peer: error} for peers found dead, departed or aborted without reading
        from them (shared memory; sockets report it by reading)."""

    def arm(self, links: Iterable) -> object:
        """Before sleeping: say what is awaited on each link; returns a token for
        sleep(). A byte that arrives after arm() wakes sleep(), never lost."""

    def watch(self, link) -> bool:
        """(Only where wakes_on_any_byte is False, while a sleeper is armed.) Make the
        next byte on link wake the sleeper, as arm() would for a receive posted on it;
        False if bytes came already, which only a wake-up makes sure are seen."""

    def sleep(self, token: object, timeout: float) -> None:
        """Sleep until a link can move, wake() is called, or timeout seconds pass.
        Two threads may sleep at once (the engine, and a caller waiting on its own
        operation); a wake-up reaches both."""

    def disarm(self, token: object) -> None:
        """After sleeping (under the engine's lock): lower what arm() raised."""

    def wake(self) -> None:
        """From any thread: end the engine's sleep (work was posted)."""
