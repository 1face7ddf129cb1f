"""Optional TLS for the rendezvous store and the TCP transport (Python's ssl).

Set ACCORD_TLS_CERT (this process's certificate, PEM), ACCORD_TLS_KEY (its
private key) and ACCORD_TLS_CA (the CA that signed every rank's certificate)
on every rank, and on `accord run`: each connection then runs a TLS handshake
with mutual authentication (both ends present a certificate the CA signed;
CERT_REQUIRED on both sides). Host names are not checked: ranks dial
addresses, and a job's certificates are its own CA's, so the CA is the
proof. With none of them set nothing changes. The mesh's HMAC proof of the
job's secret (transport/connect.py) runs before TLS either way.

TlsSocket gives an SSLSocket the few socket methods the TCP transport uses,
with "would block" said as BlockingIOError, as a plain non-blocking socket says it.
"""
import socket
import ssl

_contexts = {}
_WRITE_CHUNK = 1 << 18


def enabled(options):
    """True when ACCORD_TLS_* asks for TLS."""
    return bool(options.tls_cert)


def context(options, server):
    """The SSLContext (server or client side) for options' files, made once."""
    key = (options.tls_cert, options.tls_key, options.tls_ca, server)
    ctx = _contexts.get(key)
    if ctx is None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_cert_chain(options.tls_cert, options.tls_key)
            ctx.load_verify_locations(options.tls_ca)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"ACCORD_TLS_CERT/KEY/CA: cannot load {options.tls_cert}, "
                             f"{options.tls_key} or {options.tls_ca}: {e}") from None
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_REQUIRED
        _contexts[key] = ctx
    return ctx


def wrap(sock, options, server, timeout):
    """Run the TLS handshake on a connected, blocking socket; return the SSLSocket.

    ssl.SSLError (an OSError) when the peer's certificate is not the CA's."""
    sock.settimeout(timeout)
    s = context(options, server).wrap_socket(sock, server_side=server,
                                             do_handshake_on_connect=False)
    s.do_handshake()
    return s


class TlsSocket:
    """An SSLSocket seen through the methods of a non-blocking socket that
    transport/tcp.py calls (recv_into, recv, sendmsg, send, sendall, ...)."""

    def __init__(self, ssock):
        self.s = ssock
        self.family = ssock.family
        # a write ssl could not finish: it must be retried with the same bytes, so the
        # send it belongs to can no longer be withdrawn (transport/tcp.py)
        self.write_pending = False

    def fileno(self):
        return self.s.fileno()

    def pending(self):
        """Decrypted bytes waiting inside ssl, which poll() cannot see."""
        try:
            return self.s.pending()
        except (OSError, ValueError):
            return 0

    def recv_into(self, buf, nbytes=0):
        try:
            return self.s.recv_into(buf, nbytes)
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            raise BlockingIOError from None
        except ssl.SSLZeroReturnError:
            return 0

    def recv(self, n, flags=0):
        blocking = self.s.getblocking()
        if flags & socket.MSG_DONTWAIT and blocking:
            self.s.setblocking(False)
        try:
            return self.s.recv(n)
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            raise BlockingIOError from None
        except ssl.SSLZeroReturnError:
            return b""
        finally:
            if flags & socket.MSG_DONTWAIT and blocking:
                self.s.setblocking(True)

    def send(self, data):
        try:
            n = self.s.send(memoryview(data)[:_WRITE_CHUNK])
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            self.write_pending = True
            raise BlockingIOError from None
        self.write_pending = False
        return n

    def sendmsg(self, parts):
        """Write the parts in order; the bytes written (BlockingIOError: none)."""
        total = 0
        for part in parts:
            view = memoryview(part).cast("B")
            while view:
                try:
                    n = self.send(view)
                except BlockingIOError:
                    if total:
                        return total
                    raise
                total += n
                view = view[n:]
        return total

    def sendall(self, data):
        self.s.sendall(data)

    def setblocking(self, flag):
        self.s.setblocking(flag)

    def settimeout(self, t):
        self.s.settimeout(t)

    def setsockopt(self, *args):
        self.s.setsockopt(*args)

    def getpeername(self):
        return self.s.getpeername()

    def shutdown(self, how):
        self.s.shutdown(how)

    def close(self):
        self.s.close()
