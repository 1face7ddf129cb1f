"""TCP links: one connection per peer pair per group, progressed without threads.

All sockets are non-blocking. `exchange()` moves a set of sends and receives
concurrently (a ring step sends right while it receives from the left, so two
ranks that send large messages to each other never deadlock), sleeping in
poll() when nothing can move. Messages arrive in FIFO order per link; a
message that is not the one awaited is a Desync, except point-to-point
messages (and collective messages that overtake an awaited point-to-point
one), which wait in the link's stash until a matching receive is posted.
"""
import collections
import errno
import os
import select
import socket
import time

from ..byte_stream import ByteStream, staged
from ..errors import GroupClosed, PeerLost
from .matching import Recv, Stash, StashMatching, complete, route
from .reports import Reports
from .waiting import usable_cores, wait_policy
from .wire import (ABORT, BYE, COLL, HEADER, HEADER_SIZE, OP_SEND, P2P, abort_header,
                   decode_error, encode_error, header_problem, header_seq)

_RBUF = 1 << 16          # reads of small messages land here first: one syscall per message
_POLL_SLICE_MS = 1000
# a collective's wait spins (where it has a core) only while none of its messages is
# larger: larger ones stall mostly on the sockets' flow control, not on a peer's
# wake-up (two ranks over loopback, benchmarks/tcp_spin.py: not spinning made the 1 MiB
# broadcast and scatter 1.30x and 1.16x slower; spinning for 4 and 16 MiB as well gave
# 0.91-1.04x the time, no steady gain for the core it keeps busy)
SPIN_BYTES = 1 << 20
_IDLE_MASK = select.POLLRDHUP | select.POLLERR | select.POLLHUP
_EOF_ERRNOS = (errno.ECONNRESET, errno.EPIPE, errno.ENOTCONN, errno.ECONNABORTED, errno.ETIMEDOUT)
_IOV_MAX = 1024         # the most buffers one sendmsg takes (Linux): a longer ByteStream goes on
                        # in the next call, as a partly written message does



class _Send:
    __slots__ = ("peer", "parts", "done")

    def __init__(self, peer, header, payload):
        self.peer = peer
        if payload.__class__ is ByteStream:         # sendmsg gathers it
            self.parts = [memoryview(header)] + [v for v in payload.views if len(v)]
        else:
            self.parts = [memoryview(header), payload] if len(payload) else \
                [memoryview(header)]
        self.done = False


class Link(StashMatching):
    """One peer's connection: a small read buffer, a stash, the message in flight."""
    unacked = ()                            # sends wait for no ack over a socket

    def __init__(self, sock, peer, transport):
        self.sock, self.peer, self.t = sock, peer, transport
        self.fd = sock.fileno()
        # a TLS socket (accord/tls.py) may hold decrypted bytes that poll() cannot see
        self.tls = hasattr(sock, "pending")
        self.rbuf = bytearray(_RBUF)
        self.rview = memoryview(self.rbuf)
        self.rstart = self.rend = 0
        self.posted = collections.deque()   # _Recv in the order they were posted
        self.stash = collections.deque()    # (header, bytes) read before being asked for
        self.incoming = None                # (header, dest view, offset, owner) being filled
        self.sends = collections.deque()    # _Send in order
        self.send_partial = False
        self.eof = False
        self.departed = False               # the peer said BYE: it left on purpose

    # -- reading -----------------------------------------------------------
    def _fill_rbuf(self):
        """Read what the socket has into rbuf; False when it would block."""
        if self.rstart == self.rend:
            self.rstart = self.rend = 0
        elif self.rend == _RBUF:
            n = self.rend - self.rstart
            self.rbuf[:n] = self.rbuf[self.rstart:self.rend]
            self.rstart, self.rend = 0, n
        try:
            n = self.sock.recv_into(self.rview[self.rend:])
        except BlockingIOError:
            return False
        except OSError as e:
            self._os_error(e)
        if n == 0:
            self._lost("closed the connection")
        self.rend += n
        return True

    def _os_error(self, e):
        """A socket call failed: the peer's loss, said in accord's words (an OSError
        never leaves the transport)."""
        if e.errno in _EOF_ERRNOS:
            self._lost(f"reset the connection ({e.strerror})")
        self.eof = True
        raise self.t.peer_lost(self.peer, f"is unreachable: the connection failed "
                                          f"({e.strerror or e})") from e

    def _lost(self, why):
        self.eof = True
        # a peer that aborted sent its reason before hanging up: report that, not the hang-up
        reason = self._last_words()
        if reason is not None:
            raise reason
        if self.departed:
            why = "left the group (destroyed it or exited) while this rank still needed it"
        else:
            reason = self.t.reason_of(self.peer) if self.t.reason_of else None
            if reason is not None:
                raise reason
            # a peer that hangs up mid-message could not frame an ABORT: it may be reacting to
            # another peer's death or abort, which is the story worth telling
            other = self.t.first_cause(self)
            if other is not None:
                raise other
        raise self.t.peer_lost(self.peer, why)

    def _last_words(self, limit=64 << 20):
        """Look through what the peer sent before it hung up for an ABORT."""
        data = bytearray(self.rview[self.rstart:self.rend])
        while len(data) < limit:
            try:
                chunk = self.sock.recv(1 << 20, socket.MSG_DONTWAIT)
            except OSError:
                break
            if not chunk:
                break
            data += chunk
        pos = 0
        if self.incoming is not None:
            h, dest, off, owner = self.incoming
            pos = len(dest) - off
        while pos + HEADER_SIZE <= len(data):
            h = HEADER.unpack_from(data, pos)
            pos += HEADER_SIZE
            if header_problem(h) is not None:
                return None
            if h[0] == ABORT:
                return decode_error(data[pos:pos + h[7]], self.t.peer_desc(self.peer))
            if h[0] == BYE:
                self.departed = True
            pos += h[7]
        return None

    def peek_header(self):
        """The next message's header without consuming it (None: not all here yet)."""
        if self.incoming is not None:
            return None
        if self.rend - self.rstart < HEADER_SIZE:
            self._fill_rbuf()
            if self.rend - self.rstart < HEADER_SIZE:
                return None
        return HEADER.unpack_from(self.rbuf, self.rstart)

    def advance(self, drain=False):
        """Route incoming messages to posted receives; True if any byte moved.

        Stops once nothing is posted (the next message stays in the socket)
        unless drain is set, when it reads everything the peer has sent.
        """
        moved = False
        while True:
            if self.incoming is None:
                if not self.posted and not drain:
                    return moved
                if self.rend - self.rstart < HEADER_SIZE:
                    if not self._fill_rbuf():
                        return moved
                    moved = True
                    continue
                h = HEADER.unpack_from(self.rbuf, self.rstart)
                self.rstart += HEADER_SIZE
                dest, owner = route(self, h)
                self.incoming = (h, dest, 0, owner)
            h, dest, off, owner = self.incoming
            need = len(dest) - off
            have = self.rend - self.rstart
            if have and need:
                k = min(have, need)
                dest[off:off + k] = self.rview[self.rstart:self.rstart + k]
                self.rstart += k
                off += k
                need -= k
                moved = True
            while need or owner.__class__ is Stash and off < owner.length:
                if not need:
                    dest = owner.grow(dest)
                    need = len(dest) - off
                    k = min(self.rend - self.rstart, need)
                    if k:       # bytes read ahead into rbuf come first
                        dest[off:off + k] = self.rview[self.rstart:self.rstart + k]
                        self.rstart += k
                        off += k
                        need -= k
                        continue
                if need < _RBUF:
                    if not self._fill_rbuf():
                        self.incoming = (h, dest, off, owner)
                        return moved
                    k = min(self.rend - self.rstart, need)
                    dest[off:off + k] = self.rview[self.rstart:self.rstart + k]
                    self.rstart += k
                else:
                    try:
                        k = self.sock.recv_into(dest[off:], need)
                    except BlockingIOError:
                        self.incoming = (h, dest, off, owner)
                        return moved
                    except OSError as e:
                        self._os_error(e)
                    if k == 0:
                        self._lost("closed the connection")
                off += k
                need -= k
                moved = True
            self.incoming = None
            complete(self, h, owner)

    # -- writing -----------------------------------------------------------
    def push(self):
        """Write queued sends; True if any byte moved."""
        moved = False
        while self.sends:
            s = self.sends[0]
            try:
                n = self.sock.sendmsg(s.parts if len(s.parts) <= _IOV_MAX else
                                      s.parts[:_IOV_MAX])
            except BlockingIOError:
                return moved
            except OSError as e:
                self._os_error(e)
            moved = True
            while n:
                first = s.parts[0]
                if n >= len(first):
                    n -= len(first)
                    s.parts.pop(0)
                else:
                    s.parts[0] = first[n:]
                    n = 0
            if s.parts:
                self.send_partial = True
                return moved
            self.send_partial = False
            s.done = True
            self.sends.popleft()
        return moved


class TcpTransport(Reports):
    """The links of one group member to every other member."""
    medium = "connection"
    p2p = None                  # a TCP group's point-to-point plane is a second mesh
    peer_memory = None          # no single copy between hosts
    slots = None                # no memory shared between hosts
    scatters = False            # a ByteStream receive goes through a stand-in (byte_stream.staged)
    fans_out = False            # a step with every peer: a world-3 all_reduce of 8 B-4 KiB
                                # in one took 1.01-1.33x recursive doubling's time
    wakes_on_any_byte = True    # poll() watches every socket for input
    spin_ack_s = 0.0
    wait_now_max = -1           # take_now never waits
    yields, yield_s = 0, 0.0    # poll() sleeps once the spin is over
    hosts = None                # each member's host, when the group spans several

    def __init__(self, rank, size, socks, describe_rank, members_here=None):
        """members_here: how many of the group's members share this host (None: not
        known, so possibly all of them); a wait spins before poll() only where each of
        them has a core of its own (waiting.py)."""
        self.rank, self.size = rank, size
        self.members_here = size if members_here is None else members_here
        # a collective's wait for messages up to SPIN_BYTES, and a point-to-point
        # caller's (transport/p2p.py), looks again and again this long before poll()
        # sleeps: sleeping at once, a two-rank ping-pong over loopback took 1.9-2.5x
        # the time at 8 B-256 KiB, the 8-byte all_gather and all_to_all 1.34x and 1.46x
        # (benchmarks/tcp_spin.py)
        self.spin_s = wait_policy(self.members_here, usable_cores())[0]
        self.describe_rank = describe_rank      # group rank -> "rank 3" (global numbering)
        self.links = {}
        for peer, sock in socks.items():
            sock.setblocking(False)
            self.links[peer] = Link(sock, peer, self)
        self.broken = None
        self.pid = os.getpid()
        self.reason_of = None                    # peer -> its abort reason from the store
        self._sending = None                     # the stamp of the collective exchange under way
        self._benign = set()                     # peers whose next message was checked harmless
        self.op_desc = ""                        # the call in progress, for error messages
        self.choices = {}                        # algorithms/table.py's memo
        self.history = None                      # seq -> this rank's call then (set by the group)
        self.site_text = None                    # site id -> "file:line" (set by the group)
        self.active = None                       # (recvs, sends) being progressed, for reports
        self.interrupted = None                  # an error another thread found (interrupt)
        # the p2p engine's wake-up (sleep/wake), made before any thread can race for it
        self._wakefd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    # -- errors ------------------------------------------------------------
    def first_cause(self, hung_up):
        """Another link's ABORT or crash, seen without waiting; None if all look alive."""
        p = select.poll()
        fds = {}
        for link in self.links.values():
            if link is not hung_up and not link.eof:
                p.register(link.fd, _IDLE_MASK)
                fds[link.fd] = link
        try:
            ready = p.poll(50) if fds else []
        except OSError:
            return None
        for fd, ev in ready:
            link = fds[fd]
            if ev & _IDLE_MASK:
                link.eof = True
                reason = link._last_words()
                if reason is not None:
                    return reason
                if not link.departed:
                    return self.peer_lost(link.peer, f"closed the connection (and "
                                          f"{self.peer_desc(hung_up.peer)} hung up on this rank "
                                          f"as well)")
        return None

    # -- progress ----------------------------------------------------------
    def exchange(self, sends, recvs, stamp, deadline, meanwhile=None, ring=False):
        """Move every (peer, buffer) send and receive; return when all are done.

        meanwhile(): local work (a root's own block), run once the sends have gone as
        far as the sockets take them at once, so the peers read those bytes while this
        thread copies (run first, a two-rank scatter of 64 MiB over loopback took 1.13x
        as long; 64 KiB-16 MiB scatter, all_gather and all_to_all 0.94-1.05x:
        benchmarks/results/small-messages.md); ring: a shared-memory hint,
        meaningless here."""
        self._check_usable()
        recvs, scatter = staged(recvs)
        posted = []
        largest = 0                     # the largest message still to move (SPIN_BYTES)
        for peer, buf in recvs:
            r = Recv(peer, buf, stamp=stamp)
            link = self.links[peer]
            if not link.take_stashed(r):
                link.posted.append(r)
                posted.append(r)
                if r.length > largest:
                    largest = r.length
        outgoing = []
        for peer, buf in sends:
            n = len(buf)
            s = _Send(peer, stamp.header(n), buf)
            self.links[peer].sends.append(s)
            outgoing.append(s)
            if n > largest:
                largest = n
        self._sending = stamp
        if self._benign:
            self._benign.clear()
        spin = self.spin_s if largest <= SPIN_BYTES else 0.0
        try:
            self._progress(posted, outgoing, deadline, spin, meanwhile)
        finally:
            self._sending = None
        if scatter is not None:
            scatter()

    def send1(self, peer, view, stamp, deadline, meanwhile=None):
        """exchange(((peer, view),), (), stamp, deadline, meanwhile)."""
        self.exchange(((peer, view),), (), stamp, deadline, meanwhile)

    def recv1(self, peer, view, stamp, deadline):
        """exchange((), ((peer, view),), stamp, deadline)."""
        self.exchange((), ((peer, view),), stamp, deadline)

    def _progress(self, recvs, sends, deadline, spin=0.0, meanwhile=None):
        """Move recvs and sends until all are done; where nothing can move, look at
        their sockets for `spin` seconds before poll() sleeps (again after each move).
        meanwhile: exchange()'s, run after one write of each send."""
        links = self.links
        self.active = (recvs, sends)
        spun = False
        try:
            if meanwhile is not None:
                for s in sends:
                    links[s.peer].push()
                meanwhile()
            while True:
                moved = False
                for s in sends:
                    if not s.done and links[s.peer].push():
                        moved = True
                for r in recvs:
                    if not r.done and links[r.peer].advance():
                        moved = True
                if all(s.done for s in sends) and all(r.done for r in recvs):
                    return
                if moved:
                    spun = False
                elif spin and not spun:
                    spun = True
                    self._spin(recvs, sends, time.perf_counter() + spin)
                else:
                    self._wait(recvs, sends, deadline)
        except BaseException:
            for r in recvs:
                if not r.done:
                    try:
                        links[r.peer].posted.remove(r)
                    except ValueError:
                        pass
            raise

    def interrupt(self, exc):
        """End the call waiting here with exc (raised by the waiting thread within a
        poll slice): another thread proved it can never complete."""
        self.interrupted = exc

    # -- the point-to-point plane (driven by transport/p2p.py's engine thread) ------
    def tagged_send(self, peer, view, tag):
        """Queue a tagged message to peer; the returned record is done once it is out."""
        s = _Send(peer, HEADER.pack(P2P, OP_SEND, 0, 0, -1, tag, -1, len(view)), view)
        self.links[peer].sends.append(s)
        return s

    def awaits_copy(self, record):
        """A socket send is done once written: False."""
        return False

    def take_now(self, peer, view, tag, wait_s=0.0):
        """Over a socket nothing is read but by step_link: False (at once)."""
        return False

    def withdraw_send(self, s):
        """Take back a send no byte of which left yet; False if it is under way."""
        link = self.links[s.peer]
        if s not in link.sends or (link.sends[0] is s and (
                link.send_partial or link.tls and link.sock.write_pending)):
            return False
        link.sends.remove(s)
        return True

    def step_link(self, link, drain=True):
        """Write what is queued and read everything the peer sent (drain False: only
        what the posted receives take; transport/base.py); True if a byte moved."""
        moved = bool(link.sends) and link.push()
        return link.advance(drain=drain) or moved

    def lost_peers(self):
        """Peers found gone without reading from them (none: a socket reports it)."""
        return {}

    def arm(self, links):
        """Before sleep(): nothing to announce over sockets (poll sees every byte)."""
        return links

    def disarm(self, token):
        """Nothing was raised by arm()."""

    def sleep(self, links, timeout):
        """Sleep until a link can move, wake() is called, or timeout seconds pass."""
        if any(link.tls and link.sock.pending() for link in links):
            return                      # bytes already decrypted: step the links now
        p = select.poll()
        p.register(self._wakefd, select.POLLIN)
        for link in links:
            p.register(link.fd, select.POLLIN | _IDLE_MASK |
                       (select.POLLOUT if link.sends else 0))
        for fd, _ in p.poll(max(0.0, timeout) * 1000.0 + 1):
            if fd == self._wakefd:
                try:
                    os.eventfd_read(self._wakefd)
                except BlockingIOError:
                    pass

    def wake(self):
        """Wake sleep() from another thread (new work was posted)."""
        if self._wakefd is not None:
            os.eventfd_write(self._wakefd, 1)

    def _spin(self, recvs, sends, until):
        """Look at the sockets of the unfinished operations without sleeping, until one
        can move or time.perf_counter() reaches `until`. By poll() with no timeout
        rather than by trying to read: a read takes the socket's lock, which the
        delivery of the peer's bytes also takes (spinning on reads, 8-byte collectives
        took 1.14-1.41x the time of not spinning in a first run; on poll(), 0.68-1.08x
        in benchmarks/tcp_spin.py; benchmarks/results/small-messages.md)."""
        links = self.links
        p = select.poll()
        for s in sends:
            if not s.done:
                p.register(links[s.peer].fd, select.POLLOUT | _IDLE_MASK)
        for r in recvs:
            if not r.done:
                link = links[r.peer]
                if link.tls and link.sock.pending():
                    return
                p.register(link.fd, select.POLLIN | _IDLE_MASK)
        while not p.poll(0) and time.perf_counter() < until:
            pass

    def _wait(self, recvs, sends, deadline):
        if self.interrupted is not None:
            exc, self.interrupted = self.interrupted, None
            raise exc
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise self._timeout(recvs, sends)
        masks = {}
        for s in sends:
            if not s.done:
                masks[s.peer] = masks.get(s.peer, 0) | select.POLLOUT
        for r in recvs:
            if not r.done:
                masks[r.peer] = masks.get(r.peer, 0) | select.POLLIN
        crossing = set()
        if self._sending is not None and any(not s.done for s in sends):
            # a collective send that cannot move: if a peer this call reads nothing from
            # sends us a message of this call or an earlier one that does not match, the
            # ranks disagree (say, each thinks it is the root) and none would ever read.
            # Any peer, not only the one we send to: three "roots" send in a ring.
            for peer, link in self.links.items():
                if not link.posted and not link.eof and not link.departed and \
                        link.incoming is None and peer not in self._benign:
                    masks[peer] = masks.get(peer, 0) | select.POLLIN
                    crossing.add(peer)
        if any(self.links[r.peer].tls and self.links[r.peer].sock.pending()
               for r in recvs if not r.done):
            return                      # bytes already decrypted: progress reads them
        p = select.poll()
        fds = {}
        for peer, link in self.links.items():
            if link.eof and peer not in masks:
                continue
            # idle links are watched too: a peer that dies or aborts anywhere in the
            # group wakes us at once instead of at the deadline
            p.register(link.fd, masks.get(peer, 0) | _IDLE_MASK)
            fds[link.fd] = peer
        for fd, ev in p.poll(min(remaining * 1000.0, _POLL_SLICE_MS) + 1):
            peer = fds[fd]
            if peer in crossing and ev & select.POLLIN:
                self._check_crossing(self.links[peer])
            elif (peer not in masks or peer in crossing) and ev & (_IDLE_MASK | select.POLLIN):
                self._drain_idle(self.links[peer])

    def _check_crossing(self, link):
        h = link.peek_header()
        if h is None:
            return
        stamp = self._sending
        if h[0] == COLL and not stamp.matches(h) and header_seq(h) <= stamp.seq:
            raise self.desync(link.peer, stamp, h,
                              "both ranks are sending to each other in this call")
        if h[0] in (ABORT, BYE):
            self._drain_idle(link)
        else:
            # what the peer sends belongs to a later step: read it in its turn
            self._benign.add(link.peer)

    def _drain_idle(self, link):
        """A link we are not waiting on hung up: read its last words (ABORT or EOF)."""
        try:
            link.advance(drain=True)
        except PeerLost:
            # a peer that said BYE finished its part and left; that is only an error
            # once this rank needs it, which the awaited link itself reports
            if not link.departed:
                raise

    # -- shutdown ----------------------------------------------------------
    def abort(self, exc):
        """Tell every peer why this group is broken, then hang up."""
        if self.broken is not None:
            return
        self.broken = exc
        msg = encode_error(exc)
        for link in self.links.values():
            try:
                if not link.send_partial and not link.eof:
                    link.sock.setblocking(True)
                    link.sock.settimeout(0.2)
                    link.sock.sendall(abort_header(len(msg)) + msg)
            except OSError:
                pass
            self._hang_up(link)

    @staticmethod
    def _hang_up(link):
        try:
            link.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self, grace=0.0):
        if os.getpid() != self.pid:
            # a forked child shares these sockets with its parent: a goodbye or a
            # shutdown here would end the parent's links; just drop our descriptors
            for link in self.links.values():
                link.sock.close()
            self.links = {}
            return
        bye = HEADER.pack(BYE, 0, 0, 0, -1, 0, -1, 0)
        for link in self.links.values():
            if self.broken is None and not link.send_partial and not link.eof:
                try:
                    link.sock.send(bye)
                except OSError:
                    pass
        left = self._leftovers(grace) if self.broken is None and grace > 0 else []
        for link in self.links.values():
            self._hang_up(link)
            link.sock.close()
        self.links = {}
        if self._wakefd is not None:
            os.close(self._wakefd)
            self._wakefd = None
        if self.broken is None:
            self.broken = GroupClosed("the group was destroyed")
        return left

    def _leftovers(self, grace):
        """Collective messages no call of this rank read, seen by reading up to each
        peer's goodbye (for at most `grace` seconds).

        Ranks that disagree in a call where each only sends (both think they are
        the root) find out at their next call; if there is none, only here."""
        end = time.monotonic() + grace
        pending = {p: link for p, link in self.links.items() if not link.eof}
        while pending:
            for peer, link in list(pending.items()):
                try:
                    link.advance(drain=True)
                except Exception:
                    link.eof = True
                    if not link.departed:
                        # a peer that aborted or crashed reported the story already;
                        # what it left unread here is an echo of that
                        return []
                if link.departed or link.eof:
                    del pending[peer]
            remaining = end - time.monotonic()
            if not pending or remaining <= 0:
                break
            p = select.poll()
            for link in pending.values():
                p.register(link.fd, select.POLLIN | _IDLE_MASK)
            p.poll(remaining * 1000.0)
        return [(peer, h) for peer, link in self.links.items()
                for h, _ in link.stash if h[0] == COLL]
