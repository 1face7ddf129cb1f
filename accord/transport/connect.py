"""Build a group's full mesh of TCP connections through the store, authenticated.

Each member listens on an ephemeral port of its address (the interface
accord/netif.py chose, never the wildcard) and publishes host:port under the
group's prefix; a rank connects to every lower rank and accepts every higher
one. Every connection proves, in both directions, that its two ends know the
job's secret, before a byte of data moves (challenge-response, HMAC-SHA256):

    connecting rank c -> accepting rank a: HELLO (magic, group token, c, nonce_c)
    a -> c: nonce_a, HMAC(secret, "accept" | group | a | c | nonce_c | nonce_a)
    c -> a: HMAC(secret, "connect" | group | c | a | nonce_a | nonce_c)
    a -> c: one byte, 1 accepted / 0 refused

Both MACs are compared with hmac.compare_digest. The group token (a hash of
the group's name, which anyone can compute) only sorts out connections meant
for another group; the proof is the MAC. A connection that fails any step is
closed and logged (a WARNING on the `accord` logger of the rank that refused
it), and the rank it claimed to be stays free for the real one.

The accepting side serves every pending handshake at once from one thread
(non-blocking sockets under a selector, each with its own HANDSHAKE_S
deadline), so a connection that sends nothing, or sends slowly, delays nobody.

The secret is ACCORD_STORE_TOKEN when it is set (the store's own secret,
which `accord run` generates); otherwise the first rank to ask (under
torchrun, mpiexec or srun) puts a random one in the rendezvous store, which
every other rank reads there (job_secret): then whoever can read the store
can join, and a WARNING says so once per process when the data plane listens
on an address other hosts can reach.
"""
import hashlib
import hmac
import logging
import secrets
import selectors
import socket
import struct
import threading
import time

from ..errors import CommTimeout, HandshakeRefused
from ..netif import family_of, is_loopback, join_host_port, split_host_port

_HELLO = struct.Struct("<8sQi16s")   # magic, group token, connecting group rank, its nonce
_MAGIC = b"accord02"
_NONCE = 16
_MAC = 32
_CHALLENGE = _NONCE + _MAC
_SOCK_BUF = 4 << 20
HANDSHAKE_S = 10.0                   # a connection must finish its handshake within this
_SECRET_KEY = "accord/mesh-secret"
log = logging.getLogger("accord")
_warned_unset = False


def _tune(sock):
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, _SOCK_BUF)
        except OSError:
            pass


def group_token(prefix):
    """The 64-bit FNV-1a hash of a group's name: sorts out connections meant for
    another group. Not a secret: anyone can compute it."""
    h = 1469598103934665603
    for b in prefix.encode():
        h = ((h ^ b) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h


def _mac(secret, role, prefix, me, peer, first, second):
    name = prefix.encode()
    msg = role + struct.pack("<I", len(name)) + name + struct.pack("<ii", me, peer) + first + second
    return hmac.new(secret, msg, hashlib.sha256).digest()


def job_secret(store, addr=""):
    """The secret (bytes) every mesh connection of this job proves it knows.

    ACCORD_STORE_TOKEN when set (every rank has it). Otherwise one random
    secret per job, created by whichever rank asks first and read by the
    others from `store` (compare_set, so no rank needs to go first); then
    any process that can read the store can learn it, which a WARNING says
    once per process when `addr` (where the data plane listens) is not loopback.
    """
    global _warned_unset
    from ..options import Options
    token = Options.from_env().store_token
    if token:
        return token.encode()
    secret = store.compare_set(_SECRET_KEY, b"", secrets.token_hex(32).encode())
    if not _warned_unset and addr and not is_loopback(addr):
        _warned_unset = True
        log.warning("ACCORD_STORE_TOKEN is not set: the connections between ranks prove a "
                    "secret that rank 0 shared through the rendezvous store, so any process "
                    "that can reach that store can join this job; set the same "
                    "ACCORD_STORE_TOKEN on every rank (`accord run` makes one on one host)")
    return bytes(secret)


def _recv_exact(sock, n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("connection closed during handshake")
        data += chunk
    return data


def dial(host, port, deadline, prefix, rank, peer, secret):
    """Connect to group rank `peer` at host:port as group rank `rank` and run the
    handshake; return the connected socket (blocking, tuned).

    Retries refused or dropped connections until the deadline (the peer may not
    listen yet). HandshakeRefused: the peer failed to prove the secret, or
    refused this rank's proof; CommTimeout: nobody answered in time.
    """
    delay, last = 0.01, None
    where = join_host_port(host, port)
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise CommTimeout(f"group {prefix}: could not connect to group rank {peer} at "
                              f"{where}: {last}")
        s = None
        try:
            s = socket.create_connection((host, port), timeout=min(max(0.1, remaining),
                                                                   HANDSHAKE_S))
            _prove(s, prefix, rank, peer, secret, where)
            s.settimeout(None)
            _tune(s)
            return s
        except HandshakeRefused:
            s.close()
            raise
        except (OSError, ConnectionError) as e:
            if s is not None:
                s.close()
            last = e
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, 0.5)


def _prove(s, prefix, rank, peer, secret, where):
    nonce = secrets.token_bytes(_NONCE)
    s.sendall(_HELLO.pack(_MAGIC, group_token(prefix), rank, nonce))
    challenge = _recv_exact(s, _CHALLENGE)
    theirs, mac = challenge[:_NONCE], challenge[_NONCE:]
    if not hmac.compare_digest(mac, _mac(secret, b"accept", prefix, peer, rank, nonce, theirs)):
        log.warning("group %s: rank %s refused the listener at %s (published as group rank %s): "
                    "it failed to prove it knows the job's secret", prefix, rank, where, peer)
        raise HandshakeRefused(
            f"group {prefix}: the process listening at {where} for group rank {peer} does not "
            f"know this job's secret (ACCORD_STORE_TOKEN differs between ranks, or another "
            f"process holds that address)")
    s.sendall(_mac(secret, b"connect", prefix, rank, peer, theirs, nonce))
    if _recv_exact(s, 1) != b"\x01":
        raise HandshakeRefused(f"group {prefix}: group rank {peer} at {where} refused this "
                               f"rank's connection (group rank {rank} is already connected)")


class _Pending:
    """One accepted connection part-way through its handshake."""
    __slots__ = ("sock", "who", "until", "buf", "peer", "nonce", "their_nonce")

    def __init__(self, sock, who, until):
        self.sock, self.who, self.until = sock, who, until
        self.buf = b""
        self.peer = self.nonce = self.their_nonce = None


class _Acceptor:
    """Accepts the higher ranks of a group on one listener, from a thread of its own,
    serving every pending handshake at once."""

    def __init__(self, listener, prefix, rank, size, secret):
        self.listener, self.prefix, self.rank, self.size = listener, prefix, rank, size
        self.secret, self.token = secret, group_token(prefix)
        self.socks = {}
        self.refused = 0
        self.error = None
        self.stop = False
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name=f"accord-accept:{prefix}")
        self.thread.start()

    def _refuse(self, p, why, sel):
        log.warning("group %s: rank %s refused a connection from %s%s: %s", self.prefix,
                    self.rank, p.who, "" if p.peer is None else f" claiming group rank {p.peer}",
                    why)
        with self.cond:
            self.refused += 1
        self._drop(p, sel)

    @staticmethod
    def _drop(p, sel):
        try:
            sel.unregister(p.sock)
        except (KeyError, ValueError):
            pass
        p.sock.close()

    def _run(self):
        sel = selectors.DefaultSelector()
        pending = {}
        try:
            self.listener.setblocking(False)
            sel.register(self.listener, selectors.EVENT_READ, None)
            while not self.stop and len(self.socks) < self.size - 1 - self.rank:
                now = time.monotonic()
                wait = min([0.2] + [p.until - now for p in pending.values()])
                for key, _ in sel.select(max(0.0, wait)):
                    if key.data is None:
                        self._accept(sel, pending)
                    else:
                        self._step(key.data, sel, pending)
                now = time.monotonic()
                for p in [p for p in pending.values() if p.until <= now]:
                    del pending[p.sock]
                    self._refuse(p, f"no handshake within {HANDSHAKE_S:g} s "
                                    f"({len(p.buf)} bytes received)", sel)
        except BaseException as e:        # surfaced by wait()
            self.error = e
        finally:
            for p in pending.values():
                # the group formed (or failed) before these finished: they were not the peers
                log.warning("group %s: rank %s closed a connection from %s that had not "
                            "finished its handshake", self.prefix, self.rank, p.who)
                self._drop(p, sel)
            sel.close()
            with self.cond:
                self.cond.notify_all()

    def _accept(self, sel, pending):
        while True:
            try:
                s, addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:         # EMFILE, ECONNABORTED: the next one may do
                log.warning("group %s: rank %s could not accept a connection: %s",
                            self.prefix, self.rank, e)
                time.sleep(0.01)
                return
            s.setblocking(False)
            p = _Pending(s, join_host_port(*addr[:2]), time.monotonic() + HANDSHAKE_S)
            pending[s] = p
            sel.register(s, selectors.EVENT_READ, p)

    def _step(self, p, sel, pending):
        need = _HELLO.size if p.peer is None else _MAC
        try:
            chunk = p.sock.recv(need - len(p.buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            chunk = None
            why = f"the connection failed during its handshake ({e.strerror or e})"
        else:
            why = "it closed the connection during its handshake"
        if not chunk:
            del pending[p.sock]
            self._refuse(p, why, sel)
            return
        p.buf += chunk
        if len(p.buf) < need:
            return
        data, p.buf = p.buf, b""
        if p.peer is None:
            self._hello(p, data, sel, pending)
        else:
            self._proof(p, data, sel, pending)

    def _hello(self, p, data, sel, pending):
        magic, token, peer, nonce = _HELLO.unpack(data)
        why = None
        if magic != _MAGIC:
            why = "not an accord mesh handshake"
        elif token != self.token:
            why = "its group token is another group's (a connection meant for another group or job)"
        elif not self.rank < peer < self.size:
            why = f"it claims group rank {peer}, which does not connect to group rank {self.rank}"
        elif peer in self.socks:
            why = f"group rank {peer} is connected already"
        if why is not None:
            del pending[p.sock]
            self._refuse(p, why, sel)
            return
        p.peer, p.their_nonce, p.nonce = peer, nonce, secrets.token_bytes(_NONCE)
        reply = p.nonce + _mac(self.secret, b"accept", self.prefix, self.rank, peer, nonce,
                               p.nonce)
        if not self._send(p, reply):
            del pending[p.sock]
            self._refuse(p, "it does not read its handshake", sel)

    def _proof(self, p, data, sel, pending):
        del pending[p.sock]
        want = _mac(self.secret, b"connect", self.prefix, p.peer, self.rank, p.nonce,
                    p.their_nonce)
        if not hmac.compare_digest(data, want):
            self._send(p, b"\x00")
            self._refuse(p, "it failed to prove it knows the job's secret (wrong or missing "
                            "ACCORD_STORE_TOKEN?)", sel)
            return
        if p.peer in self.socks:
            self._send(p, b"\x00")
            self._refuse(p, f"group rank {p.peer} is connected already", sel)
            return
        if not self._send(p, b"\x01"):
            self._refuse(p, "it hung up at the end of its handshake", sel)
            return
        sel.unregister(p.sock)
        p.sock.setblocking(True)
        _tune(p.sock)
        with self.cond:
            self.socks[p.peer] = p.sock
            self.cond.notify_all()

    @staticmethod
    def _send(p, data):
        try:
            return p.sock.send(data) == len(data)   # a few bytes into an empty buffer
        except OSError:
            return False

    def wait(self, deadline):
        """{peer: socket} of every higher rank; CommTimeout at the deadline."""
        expected = self.size - 1 - self.rank
        with self.cond:
            while len(self.socks) < expected and self.error is None and self.thread.is_alive():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self.cond.wait(min(remaining, 0.5))
            socks, refused = dict(self.socks), self.refused
        if self.error is not None:
            raise self.error
        if len(socks) < expected:
            missing = [p for p in range(self.rank + 1, self.size) if p not in socks]
            raise CommTimeout(f"group {self.prefix}: rank {self.rank} timed out waiting for "
                              f"group ranks {missing} to connect"
                              + (f" (it refused {refused} connection(s) that failed the "
                                 f"handshake: see the WARNING lines of the accord logger)"
                                 if refused else ""))
        return socks

    def close(self):
        self.stop = True
        self.thread.join(timeout=5.0)


def _tls_wrap(socks, rank, deadline, prefix):
    """With ACCORD_TLS_* set, run a TLS handshake (mutual authentication) on every
    authenticated socket: the client side towards lower ranks, then the server side
    towards higher ones, in rank order (each waits only on lower pairs: no cycle)."""
    from ..options import Options
    from .. import tls
    options = Options.from_env()
    if not tls.enabled(options):
        return socks
    out = {}
    try:
        for peer in sorted(socks):
            remaining = max(0.1, deadline - time.monotonic())
            try:
                ssock = tls.wrap(socks[peer], options, server=peer > rank, timeout=remaining)
            except OSError as e:
                raise HandshakeRefused(f"group {prefix}: the TLS handshake with group rank "
                                       f"{peer} failed: {e} (is its certificate signed by "
                                       f"ACCORD_TLS_CA, and ACCORD_TLS_* set on every rank?)") \
                    from None
            ssock.settimeout(None)
            out[peer] = tls.TlsSocket(ssock)
        return out
    except BaseException:
        for s in list(out.values()) + list(socks.values()):   # wrapped ones own their fd
            s.close()
        raise


def connect_mesh(store, prefix, rank, size, addr, deadline, secret=None):
    """Return {peer group rank: connected socket} for every other member.

    Every connection is authenticated (see the module docstring); `secret`
    defaults to job_secret(store, addr). The listener binds `addr` only. With
    ACCORD_TLS_* set the sockets are TLS (accord/tls.py's TlsSocket).
    """
    if size == 1:
        return {}
    if secret is None:
        secret = job_secret(store, addr)
    listener = socket.socket(family_of(addr), socket.SOCK_STREAM)
    socks, acceptor = {}, None
    try:
        listener.bind((addr, 0))
        listener.listen(max(size, 128))
        if rank < size - 1:
            acceptor = _Acceptor(listener, prefix, rank, size, secret)
        store.set(f"{prefix}/addr/{rank}", join_host_port(addr, listener.getsockname()[1]))
        for peer in range(rank):
            host, port = split_host_port(store.get(f"{prefix}/addr/{peer}").decode())
            socks[peer] = dial(host, int(port), deadline, prefix, rank, peer, secret)
        if acceptor is not None:
            socks.update(acceptor.wait(deadline))
        return _tls_wrap(socks, rank, deadline, prefix)
    except BaseException:
        for s in socks.values():
            s.close()
        if acceptor is not None:
            acceptor.close()
            for s in acceptor.socks.values():
                s.close()
            acceptor = None
        raise
    finally:
        if acceptor is not None:
            acceptor.close()
        listener.close()

