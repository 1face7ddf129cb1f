"""Build a group's full mesh of TCP connections through the store.

Each member listens on an ephemeral port and publishes host:port under the
group's prefix; a rank connects to every lower rank and accepts every higher
one. A handshake carries the group token and the connecting rank, so a stray
connection (another job, a port scanner) is refused instead of joining.
"""
import socket
import struct
import time

from ..errors import CommTimeout

_HELLO = struct.Struct("<8sQi")
_MAGIC = b"accord01"
_SOCK_BUF = 4 << 20


def _tune(sock):
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, _SOCK_BUF)
        except OSError:
            pass


def _token(prefix):
    h = 1469598103934665603
    for b in prefix.encode():
        h = ((h ^ b) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h


def _recv_exact(sock, n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("connection closed during handshake")
        data += chunk
    return data


def connect_mesh(store, prefix, rank, size, addr, deadline):
    """Return {peer group rank: connected socket} for every other member."""
    if size == 1:
        return {}
    token = _token(prefix)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((addr, 0))
        listener.listen(size)
        store.set(f"{prefix}/addr/{rank}", f"{addr}:{listener.getsockname()[1]}")
        socks = {}
        for peer in range(rank):
            host, _, port = store.get(f"{prefix}/addr/{peer}").decode().rpartition(":")
            s = _connect(host, int(port), deadline, peer)
            s.sendall(_HELLO.pack(_MAGIC, token, rank))
            socks[peer] = s
        while len(socks) < size - 1:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = [p for p in range(rank + 1, size) if p not in socks]
                raise CommTimeout(f"group {prefix}: rank {rank} timed out waiting for group "
                                  f"ranks {missing} to connect")
            listener.settimeout(remaining)
            try:
                s, _ = listener.accept()
            except socket.timeout:
                continue
            s.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                magic, tok, peer = _HELLO.unpack(_recv_exact(s, _HELLO.size))
            except (OSError, ConnectionError):
                s.close()
                continue
            if magic != _MAGIC or tok != token or not rank < peer < size or peer in socks:
                s.close()
                continue
            s.settimeout(None)
            _tune(s)
            socks[peer] = s
        return socks
    finally:
        listener.close()


def _connect(host, port, deadline, peer):
    delay = 0.01
    while True:
        try:
            s = socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic()))
            s.settimeout(None)
            _tune(s)
            return s
        except OSError as e:
            if time.monotonic() + delay > deadline:
                raise CommTimeout(f"could not connect to group rank {peer} at {host}:{port}: "
                                  f"{e}") from None
            time.sleep(delay)
            delay = min(delay * 2, 0.5)


def local_address(master_addr):
    """The address peers can reach us on: the interface that routes to the master."""
    if not master_addr or master_addr in ("localhost",) or master_addr.startswith("127."):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(master_addr), 9))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())
