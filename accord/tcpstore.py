"""TCPStore: the rendezvous store reachable from every host.

A threaded server holds a store.Table; each client keeps one socket. Every
message is a frame: u32 length, u8 code, then fields, each u32 length + bytes
(ints and timeouts travel as ASCII). Blocking get/wait run on the server with
the caller's remaining timeout, so the server, not the client, decides that
time is up; the client only adds a grace period in case the server host
vanished without closing the connection.
"""
import atexit
import errno
import hashlib
import hmac
import logging
import os
import secrets
import select
import socket
import threading
import time

from .errors import AccordError, CommTimeout, PeerLost
from .netif import family_of, is_loopback, join_host_port, store_bind_address, strip_brackets
from .store import (DEFAULT_STORE_TIMEOUT, Store, Table, as_value, check_amount, check_key,
                    check_keys, timeout_error)

_MAGIC = b"accord-store-1"
_HELLO, _SET, _GET, _ADD, _CAS, _CHECK, _WAIT, _DELETE, _NUM_KEYS, _AUTH = range(1, 11)
_OK, _TIMEOUT, _VALUE_ERROR, _ERROR = range(4)
_MAX_FRAME = 1 << 31            # values may be large, but not absurd
_MAX_FIRST_FRAME = 1024         # before HELLO: a stray client (HTTP, a probe) sends junk
_GRACE_S = 5.0                  # client-side slack over a server-side wait
_AUTH_TAG = b"auth-hmac-sha256"
_TLS_HANDSHAKE_S = 10.0
log = logging.getLogger("accord.store")


def _proof(token, nonce):
    return hmac.new(token.encode(), nonce, hashlib.sha256).digest()


def _tls_options():
    """The options when ACCORD_TLS_* asks for TLS, else None."""
    from .options import Options
    from . import tls
    options = Options.from_env()
    return options if tls.enabled(options) else None


def default_token():
    """ACCORD_STORE_TOKEN, through options (the only reader of ACCORD_* variables)."""
    from .options import Options
    try:
        return Options.from_env().store_token
    except ValueError:
        return ""


class AddressInUse(AccordError, OSError):
    """The store's port is taken, most often by another job's store."""

    errno = errno.EADDRINUSE


class _BadFrame(Exception):
    pass


class _ServerTimeout(Exception):
    """The server's wait ran out; args[0] lists the keys still missing."""


def _frame(code, fields=()):
    parts = [bytes((code,))]
    for f in fields:
        parts.append(len(f).to_bytes(4, "little"))
        parts.append(f)
    body = b"".join(parts)
    return len(body).to_bytes(4, "little") + body


def _parse(frame):
    if not frame:
        raise _BadFrame("empty frame")
    view, pos, fields = memoryview(frame), 1, []
    while pos < len(frame):
        n = int.from_bytes(view[pos:pos + 4], "little")
        if pos + 4 + n > len(frame):
            raise _BadFrame("field overruns its frame")
        fields.append(bytes(view[pos + 4:pos + 4 + n]))
        pos += 4 + n
    return frame[0], fields


class _Conn:
    """Reads whole frames off a socket, one recv for small ones."""

    def __init__(self, sock):
        self.sock = sock
        self.buf = bytearray()

    def read_frame(self, limit=_MAX_FRAME):
        buf = self.buf
        while True:
            if len(buf) >= 4:
                n = int.from_bytes(buf[:4], "little")
                if n > limit:
                    raise _BadFrame(f"frame of {n} bytes exceeds {limit}")
                if len(buf) >= 4 + n:
                    frame = bytes(buf[4:4 + n])
                    del buf[:4 + n]
                    return frame
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise EOFError
            buf += chunk


def _peer_gone(sock):
    """True if the client closed its end (it sends nothing while it waits)."""
    try:
        if not select.select([sock], [], [], 0)[0]:
            return False
        if hasattr(sock, "pending"):
            # TLS cannot peek; a waiting client sends nothing, so readable means it hung up
            return True
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except (OSError, ValueError):
        return True


class TCPStoreServer:
    """Serves one Table over TCP; a daemon thread per client connection."""

    def __init__(self, host="0.0.0.0", port=0, display_host=None, token=None):
        self.host = host
        # token: a shared secret clients must prove they know (HMAC of a nonce); None reads
        # ACCORD_STORE_TOKEN, "" turns the check off
        self._token = default_token() if token is None else token
        self._tls = _tls_options()
        self._listener = socket.socket(family_of(host), socket.SOCK_STREAM)
        # SO_REUSEADDR lets a new job bind while the old one's sockets sit in
        # TIME_WAIT; unlike SO_REUSEPORT it still refuses a second live server.
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._listener.bind((host, port))
        except OSError as e:
            self._listener.close()
            if e.errno == errno.EADDRINUSE:
                raise AddressInUse(
                    f"store port {port} on {display_host or host} is already in use "
                    f"(another job? choose another MASTER_PORT)") from e
            raise
        self._listener.listen(512)
        self.port = self._listener.getsockname()[1]
        self._table = Table()
        self._clients = 0               # connections that said HELLO, still open
        self._conns = set()
        self._closed = False
        self._accepter = threading.Thread(target=self._accept_loop, daemon=True,
                                          name=f"accord-store:{self.port}")
        self._accepter.start()

    def __repr__(self):
        return f"<TCPStoreServer {self.host}:{self.port} clients={self.num_clients()}>"

    def num_clients(self):
        with self._table.cond:
            return self._clients

    def wait_clients_gone(self, timeout):
        """True once every client has disconnected; False if timeout passed first."""
        with self._table.cond:
            return self._table.cond.wait_for(lambda: self._clients == 0, timeout)

    def wait_clients(self, n, timeout):
        """True once at least n clients are connected; False at the timeout."""
        with self._table.cond:
            return self._table.cond.wait_for(lambda: self._clients >= n, timeout)

    def close(self):
        with self._table.cond:
            if self._closed:
                return
            self._closed = True
            self._table.cond.notify_all()     # wakes handlers in get/wait
            conns = list(self._conns)
        # shutdown() wakes a thread blocked in accept()/recv() on Linux, where
        # close() alone would not.
        for s in [self._listener] + conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._listener.close()
        self._accepter.join(timeout=1.0)

    def _accept_loop(self):
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.01)    # e.g. EMFILE: back off rather than spin
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._table.cond:
                if self._closed:
                    sock.close()
                    return
                self._conns.add(sock)
            threading.Thread(target=self._serve, args=(sock,), daemon=True,
                             name=f"accord-store:{self.port}:client").start()

    def _serve(self, sock):
        greeted = False
        try:
            peer = join_host_port(*sock.getpeername()[:2])
        except OSError:
            peer = "?"
        try:
            if self._tls is not None:
                from . import tls
                try:
                    ssock = tls.wrap(sock, self._tls, server=True, timeout=_TLS_HANDSHAKE_S)
                except OSError as e:
                    log.warning("store :%s: dropped client %s: TLS handshake failed (%s)",
                                self.port, peer, e)
                    return
                ssock.settimeout(None)
                with self._table.cond:
                    self._conns.discard(sock)
                    self._conns.add(ssock)
                sock = ssock
            conn = _Conn(sock)
            nonce = None
            while not self._closed:
                code, fields = _parse(conn.read_frame(_MAX_FRAME if greeted else _MAX_FIRST_FRAME))
                if not greeted:
                    if nonce is not None:
                        if code != _AUTH or len(fields) != 1 or not hmac.compare_digest(
                                fields[0], _proof(self._token, nonce)):
                            log.warning("store :%s: dropped client %s: authentication failed "
                                        "(wrong or missing ACCORD_STORE_TOKEN)", self.port, peer)
                            sock.sendall(_frame(_ERROR, [b"authentication failed: wrong or "
                                                         b"missing ACCORD_STORE_TOKEN"]))
                            return
                    elif code != _HELLO or fields != [_MAGIC]:
                        log.warning("store :%s: dropped client %s: not an accord store client",
                                    self.port, peer)
                        sock.sendall(_frame(_ERROR, [b"not an accord store client"]))
                        return
                    elif self._token:
                        nonce = secrets.token_bytes(16)
                        sock.sendall(_frame(_OK, [_AUTH_TAG, nonce]))
                        continue
                    greeted = True
                    with self._table.cond:
                        self._clients += 1
                        self._table.cond.notify_all()
                    sock.sendall(_frame(_OK))
                    continue
                sock.sendall(self._handle(code, fields, sock))
        except _BadFrame as e:
            log.warning("store :%s: dropped client %s: malformed request (%s)", self.port, peer, e)
        except (EOFError, OSError, ValueError):
            pass   # client gone or server closing (ValueError: a TLS socket shut under us)
        finally:
            with self._table.cond:
                self._conns.discard(sock)
                if greeted:
                    self._clients -= 1
                    self._table.cond.notify_all()
            sock.close()

    def _handle(self, code, f, sock):
        table = self._table

        def stop():
            return self._closed or _peer_gone(sock)

        try:
            if code == _SET:
                table.set(f[0].decode(), f[1])
                return _frame(_OK)
            if code == _GET:
                value = table.get(f[0].decode(), float(f[1]), stop)
                return _frame(_OK, [value]) if value is not None else _frame(_TIMEOUT, [f[0]])
            if code == _ADD:
                return _frame(_OK, [str(table.add(f[0].decode(), int(f[1]))).encode()])
            if code == _CAS:
                return _frame(_OK, [table.compare_set(f[0].decode(), f[1], f[2])])
            if code == _CHECK:
                return _frame(_OK, [b"1" if table.check([k.decode() for k in f]) else b"0"])
            if code == _WAIT:
                missing = table.wait([k.decode() for k in f[1:]], float(f[0]), stop)
                return _frame(_TIMEOUT, [k.encode() for k in missing]) if missing else _frame(_OK)
            if code == _DELETE:
                return _frame(_OK, [b"1" if table.delete(f[0].decode()) else b"0"])
            if code == _NUM_KEYS:
                return _frame(_OK, [str(table.num_keys()).encode()])
            return _frame(_ERROR, [f"unknown request code {code}".encode()])
        except ValueError as e:
            return _frame(_VALUE_ERROR, [str(e).encode()])
        except (IndexError, UnicodeDecodeError) as e:
            return _frame(_ERROR, [f"malformed request: {e}".encode()])


class TCPStore(Store):
    """torch.distributed.TCPStore's shape: is_master=True also runs the server.

    With is_master and port 0 the server takes a free port; `.port` says which.
    Clients retry connecting until the timeout, since the master may start
    later. wait_for_workers (master only) waits until world_size clients,
    the master's own included, have connected.
    """

    def __init__(self, host, port, world_size=None, is_master=False,
                 timeout=DEFAULT_STORE_TIMEOUT, wait_for_workers=False, token=None):
        super().__init__(timeout)
        self._token = default_token() if token is None else token
        self.host, self.world_size = host, world_size
        self._server = None
        self._sock = None
        self._lock = threading.Lock()
        self._closed = False
        self._broken = None     # the error that ended this connection, if any
        self._pid = os.getpid()
        host = strip_brackets(host)
        self.host = host
        dial = host
        if is_master:
            # Listen where the clients dial (host itself, or the ACCORD_SOCKET_IFNAME
            # interface), not on every interface; only a host name, or an address this
            # host cannot bind, gets the wildcard (netif.store_bind_address). The master
            # talks to its server over loopback when it can, which cannot be misrouted.
            bind = store_bind_address(host)
            self._server = TCPStoreServer(bind, port, display_host=host, token=self._token)
            port = self._server.port
            atexit.register(self.close)
            dial = (("::1" if ":" in bind else "127.0.0.1")
                    if bind in ("0.0.0.0", "::") or is_loopback(bind) else bind)
        elif not port:
            raise ValueError("TCPStore: a client needs the master's port, got 0")
        self.port = port
        self._where = join_host_port(host, port)
        try:
            self._connect(dial, port)
            if is_master and wait_for_workers and world_size:
                if not self._server.wait_clients(world_size, self.timeout):
                    raise CommTimeout(
                        f"TCPStore master at {self._where}: only {self._server.num_clients()} "
                        f"of {world_size} workers connected within {self.timeout:g} s")
        except BaseException:
            self.close()
            raise

    def __repr__(self):
        role = "master" if self._server else "client"
        return f"<TCPStore {role} {self._where}>"

    def _connect(self, host, port):
        deadline = time.monotonic() + self.timeout
        delay, last = 0.01, None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CommTimeout(
                    f"could not reach the store at {host}:{port} within {self.timeout:g} s "
                    f"(last error: {last}); is the master (rank 0) running, and are "
                    f"MASTER_ADDR/MASTER_PORT right?")
            try:
                sock = socket.create_connection((host, port), timeout=min(remaining, 10.0))
                if sock.getsockname() == sock.getpeername():
                    # a local port nobody listens on yet, picked as this socket's own
                    # ephemeral port: TCP connects the socket to itself
                    sock.close()
                    raise ConnectionRefusedError("connected to itself (master not up yet)")
                break
            except OSError as e:    # refused (master not up yet), unreachable, DNS
                last = e
                time.sleep(min(delay, max(remaining, 0)))
                delay = min(delay * 2, 0.5)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        tls_options = _tls_options()
        if tls_options is not None:
            from . import tls
            try:
                sock = tls.wrap(sock, tls_options, server=False,
                                timeout=max(1.0, min(deadline - time.monotonic(), 30.0)))
            except OSError as e:
                sock.close()
                raise AccordError(f"the store at {host}:{port}: TLS handshake failed ({e}); is "
                                  f"ACCORD_TLS_* the same on the store's host and its "
                                  f"certificate signed by ACCORD_TLS_CA?") from None
        self._sock, self._conn = sock, _Conn(sock)
        try:
            reply = self._call(_HELLO, [_MAGIC])
        except AccordError as e:
            raise AccordError(f"the service at {host}:{port} is not an accord store "
                              f"(handshake failed: {e})") from None
        if reply[:1] == [_AUTH_TAG]:
            if not self._token:
                self._drop()
                raise AccordError(f"the store at {host}:{port} requires a token: set "
                                  f"ACCORD_STORE_TOKEN to the job's shared secret")
            try:
                self._call(_AUTH, [_proof(self._token, reply[1])])
            except AccordError as e:
                raise AccordError(f"the store at {host}:{port} refused this client: {e}") \
                    from None

    def _call(self, code, fields, wait=None):
        """One request/response; `wait` is the server-side wait, if any."""
        if self._pid != os.getpid():
            # A forked child shares our socket: its replies would interleave.
            raise AccordError(f"TCPStore {self._where} was created in process {self._pid}; "
                              f"a forked child must open its own TCPStore")
        with self._lock:
            if self._sock is None:
                if isinstance(self._broken, PeerLost) and not self._closed:
                    raise PeerLost(str(self._broken), peer=self._where)
                if self._broken is not None and not self._closed:
                    raise AccordError(str(self._broken))
                raise AccordError(f"TCPStore {self._where} is closed")
            try:
                self._sock.settimeout(self.timeout if wait is None else wait + _GRACE_S)
                self._sock.sendall(_frame(code, fields))
                status, out = _parse(self._conn.read_frame())
            except socket.timeout:
                # The answer may still arrive later and would be read as the
                # reply to the next request: this connection is unusable now.
                self._drop()
                self._broken = CommTimeout(f"the store at {self._where} did not answer within "
                                           f"{self._sock_timeout(wait):g} s; connection dropped")
                raise self._broken from None
            except (EOFError, OSError, _BadFrame) as e:
                self._drop()
                if self._closed:
                    raise AccordError(f"TCPStore {self._where} was closed") from None
                self._broken = PeerLost(
                    f"the store at {self._where} closed the connection "
                    f"({type(e).__name__}{': ' + str(e) if str(e) else ''}); "
                    f"did the master (rank 0) exit or crash?", peer=self._where)
                raise self._broken from None
        if status == _OK:
            return out
        if status == _VALUE_ERROR:
            raise ValueError(out[0].decode(errors="replace"))
        if status == _TIMEOUT:
            raise _ServerTimeout([k.decode(errors="replace") for k in out])
        raise AccordError(f"store at {self._where}: {out[0].decode(errors='replace')}")

    def _sock_timeout(self, wait):
        return self.timeout if wait is None else wait + _GRACE_S

    def _drop(self):
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def set(self, key, value):
        self._call(_SET, [check_key(key).encode(), as_value(value)])

    def get(self, key, timeout=None):
        t = self._deadline_s(timeout)
        try:
            return self._call(_GET, [check_key(key).encode(), repr(t).encode()], wait=t)[0]
        except _ServerTimeout:
            raise timeout_error("get", [key], t, f" (in the store at {self._where})") from None

    def add(self, key, amount):
        return int(self._call(_ADD, [check_key(key).encode(),
                                     str(check_amount(amount)).encode()])[0])

    def compare_set(self, key, expected, desired):
        return self._call(_CAS, [check_key(key).encode(), as_value(expected, "expected"),
                                 as_value(desired, "desired")])[0]

    def wait(self, keys, timeout=None):
        t = self._deadline_s(timeout)
        keys = check_keys(keys)
        try:
            self._call(_WAIT, [repr(t).encode()] + [k.encode() for k in keys], wait=t)
        except _ServerTimeout as e:
            raise timeout_error("wait", e.args[0], t,
                                f" (in the store at {self._where})") from None

    def check(self, keys):
        return self._call(_CHECK, [k.encode() for k in check_keys(keys)])[0] == b"1"

    def delete_key(self, key):
        return self._call(_DELETE, [check_key(key).encode()])[0] == b"1"

    def num_keys(self):
        return int(self._call(_NUM_KEYS, [])[0])

    def close(self):
        """Disconnect; the master then waits (at most min(timeout, 30 s)) for
        the other clients to leave before stopping the server, so rank 0 does
        not pull the store from under ranks still using it."""
        if self._closed:
            return
        self._closed = True
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)   # wakes a thread blocked in _call
            except OSError:
                pass
        with self._lock:
            self._drop()
        if self._server is not None:
            atexit.unregister(self.close)
            self._server.wait_clients_gone(min(self.timeout, 30.0))
            self._server.close()
