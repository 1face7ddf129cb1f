"""Coverage-guided fuzzing of what accord reads from the network, for a fixed budget.

    python benchmarks/fuzz.py --seconds 300                 # every target, 300 s each
    python benchmarks/fuzz.py --target store --seconds 60 --corpus DIR

Targets (each a function of one input, bytes):

- frames: a byte stream a peer sends on a TCP link (accord/transport/tcp.py reads
  headers and payloads off it, collective and point-to-point), the header checks
  (wire.header_problem, describe_header, an ABORT's decode_error), and the store
  client's frame reader (tcpstore._Conn, _parse) on a hostile server's bytes;
- store: a client's bytes to the rendezvous store server (tcpstore's _serve), before
  the hello, after it, and after the HMAC proof (a server without a token);
- handshake: a stranger's bytes to a mesh listener (transport/connect.py's acceptor:
  random bytes, or a hello of the right group with random fields and a made-up
  proof), and a hostile listener's challenge to a dialling rank (_prove).

What counts as a crash: any exception other than the error the code is meant to raise
(an accord error, a dropped connection), a stranger let in, a store that still counts
the client after it left, or an input that takes longer than --input-timeout. With
atheris (libFuzzer) installed the targets are fuzzed with coverage feedback; without
it, with hypothesis's random inputs for the same budget. Inputs that crashed are
saved (atheris: --artifacts DIR) and belong in tests/fuzz_regressions/TARGET/, where
tests/test_fuzz.py replays every one of them.
"""
import argparse
import logging
import os
import socket
import subprocess
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
TARGETS = ("frames", "store", "handshake")
_STATE = {}


def _quiet():
    # refusals are WARNINGs by design; thousands of them per second say nothing here
    logging.getLogger("accord").setLevel(logging.CRITICAL)
    logging.getLogger("accord.store").setLevel(logging.CRITICAL)


# -- frames ----------------------------------------------------------------------------

class _BytesSock:
    """What tcpstore._Conn needs of a socket, over fixed bytes."""

    def __init__(self, data, step):
        self.data, self.step = data, max(1, step)

    def recv(self, n):
        chunk, self.data = self.data[:min(n, self.step)], self.data[min(n, self.step):]
        return chunk


def fuzz_frames(data):
    from accord.errors import AccordError
    from accord import tcpstore
    from accord.transport import wire
    from accord.transport.tcp import TcpTransport
    if not data:
        return
    mode, body = data[0], data[1:]
    if mode % 4 == 0:                       # one header, every check on it
        raw = (body + bytes(wire.HEADER_SIZE))[:wire.HEADER_SIZE]
        h = wire.HEADER.unpack(raw)
        problem = wire.header_problem(h)
        assert problem is None or isinstance(problem, str)
        wire.describe_header(h)
        err = wire.decode_error(body[wire.HEADER_SIZE:], "rank 1")
        assert isinstance(err, AccordError)
        return
    if mode % 4 == 1:                       # the store client reading a hostile server
        conn = tcpstore._Conn(_BytesSock(body, 1 + mode // 4))
        for _ in range(8):
            try:
                tcpstore._parse(conn.read_frame(limit=1 << 16))
            except (tcpstore._BadFrame, EOFError):
                return
        return
    # a peer's byte stream on a link, read by a collective or by a tagged receive
    a, b = socket.socketpair()
    t = TcpTransport(0, 2, {1: a}, lambda r: f"rank {r}")
    try:
        b.sendall(body)
        b.shutdown(socket.SHUT_WR)
        dest = memoryview(bytearray(16 + (mode >> 4)))
        try:
            if mode % 4 == 2:
                stamp = wire.Stamp(wire.OP_CODES["broadcast"], 0, 1, 11, 0, len(dest),
                                   "float32")
                t.exchange([], [(1, dest)], stamp, time.monotonic() + 2.0)
            else:
                from accord.transport.p2p import Engine, Pending
                engine = Engine(t, "fuzz", [0, 1], "rank 0")
                op = Pending(False, 1, dest, mode >> 4, 2.0, "recv")
                engine.post([op])
                try:
                    op.result(10)
                finally:
                    engine.close()
        except AccordError:
            pass
    finally:
        b.close()
        t.close()


# -- the store ---------------------------------------------------------------------------

def _servers():
    if "servers" not in _STATE:
        from accord.tcpstore import TCPStoreServer
        _STATE["servers"] = (TCPStoreServer("127.0.0.1", 0, token="t0k"),
                             TCPStoreServer("127.0.0.1", 0, token=""))
    return _STATE["servers"]


def fuzz_store(data):
    from accord import tcpstore
    if not data:
        return
    with_token, open_server = _servers()
    mode, body = data[0], data[1:]
    server = with_token if mode % 3 == 0 else open_server
    if mode % 3 == 2:                       # greeted: the requests themselves are fuzzed
        body = tcpstore._frame(1, [tcpstore._MAGIC]) + body
    # served on this thread (coverage feedback sees every line), as the server's own
    # per-client thread would: the bytes wait in the socket until _serve reads them
    listener = _STATE.setdefault("listener", _loopback_listener())
    with socket.create_connection(listener.getsockname(), timeout=5) as s:
        conn, _ = listener.accept()
        try:
            s.sendall(body)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        with server._table.cond:
            server._conns.add(conn)
        server._serve(conn)                 # returns when the client's bytes are done
        assert _drain(s), "the server did not close the connection"
    assert server.num_clients() == 0, "the server still counts a client that left"


def _loopback_listener():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    return listener


def _drain(sock):
    """Read until the other end closes: True, or False when it stayed open 5 s."""
    sock.settimeout(5)
    try:
        while sock.recv(1 << 16):
            pass
        return True
    except socket.timeout:
        return False
    except OSError:
        return True                         # reset: closed as well


# -- the handshake -------------------------------------------------------------------------

def _acceptor():
    if "acceptor" not in _STATE:
        from accord.transport import connect
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        # a group that never fills: the acceptor keeps serving strangers
        _STATE["acceptor"] = connect._Acceptor(listener, "fuzz", 0, 1 << 20, b"secret")
        _STATE["address"] = listener.getsockname()
    return _STATE["acceptor"], _STATE["address"]


def fuzz_handshake(data):
    from accord.errors import HandshakeRefused
    from accord.transport import connect
    if len(data) < 2:
        return
    mode, body = data[0], data[1:]
    if mode % 2 == 0:                       # a hostile listener answering a dialling rank
        a, b = socket.socketpair()
        a.settimeout(2)
        try:
            b.sendall(body[:4096])
            b.shutdown(socket.SHUT_WR)
            try:
                connect._prove(a, "fuzz", 1, 0, b"secret", "fuzz")
            except (HandshakeRefused, ConnectionError, OSError):
                return
            raise AssertionError("a listener that does not know the secret was accepted")
        finally:
            a.close()
            b.close()
    acceptor, address = _acceptor()
    if mode % 4 == 1 and len(body) >= 20:   # a hello of the right group, random fields
        rank = int.from_bytes(body[:4], "little", signed=True)
        if mode & 8:
            rank = 1 + body[0] % 4
        body = connect._HELLO.pack(connect._MAGIC, connect.group_token("fuzz"), rank,
                                   body[4:20]) + body[20:]
    with socket.create_connection(address, timeout=5) as s:
        try:
            s.sendall(body[:4096])
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        # the acceptor must close every connection that hung up, whatever it sent
        assert _drain(s), "the acceptor kept a connection that had hung up"
    with acceptor.cond:
        if acceptor.socks:
            raise AssertionError(f"a stranger was let in: {acceptor.socks}")
    if not acceptor.thread.is_alive() or acceptor.error is not None:
        raise AssertionError(f"the acceptor died: {acceptor.error!r}")


def fuzz_mixed(data):
    """The three targets in one (the first byte picks): one process, one instrumentation,
    for tests/test_fuzz.py's short run."""
    if data:
        (fuzz_frames, fuzz_store, fuzz_handshake)[data[0] % 3](data[1:])


FUNCTIONS = {"frames": fuzz_frames, "store": fuzz_store, "handshake": fuzz_handshake,
             "mixed": fuzz_mixed}


# -- running -----------------------------------------------------------------------------

def have_atheris():
    try:
        import atheris  # noqa: F401
    except ImportError:
        return False
    return True


def _run_atheris(target, seconds, corpus, artifacts, input_timeout, max_len):
    """In this process: instrument accord, fuzz `target` with libFuzzer until the budget
    is spent (atheris exits the process)."""
    import atheris
    with atheris.instrument_imports(include=["accord"]):
        import accord.tcpstore  # noqa: F401
        import accord.transport.connect  # noqa: F401
        import accord.transport.p2p  # noqa: F401
        import accord.transport.tcp  # noqa: F401
        import accord.transport.wire  # noqa: F401
    _quiet()
    fn = FUNCTIONS[target]
    args = [sys.argv[0], f"-max_total_time={int(seconds)}", f"-timeout={int(input_timeout)}",
            f"-max_len={max_len}", "-print_final_stats=1"]
    if artifacts:
        os.makedirs(artifacts, exist_ok=True)
        args.append(f"-artifact_prefix={os.path.join(artifacts, target)}-")
    if corpus:
        os.makedirs(corpus, exist_ok=True)
        args.append(corpus)
    atheris.Setup(args, fn)
    atheris.Fuzz()


def _run_hypothesis(target, seconds, max_len):
    """Random inputs for `seconds` (no coverage feedback). Returns (inputs, crash or None)."""
    import random
    _quiet()
    fn = FUNCTIONS[target]
    rng = random.Random(0)
    n, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        data = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, max_len)))
        try:
            fn(data)
        except Exception as e:
            return n, (data, e)
        n += 1
    return n, None


def run_target(target, seconds, corpus=None, artifacts=None, input_timeout=20, max_len=512):
    """Fuzz one target for `seconds` in a child process; return a summary dict:
    engine, runs, seconds, crashed (bool), and the engine's last lines."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--target", target,
           "--seconds", str(seconds), "--input-timeout", str(input_timeout),
           "--max-len", str(max_len)]
    if corpus:
        cmd += ["--corpus", os.path.join(corpus, target)]
    if artifacts:
        cmd += ["--artifacts", artifacts]
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True,
                       timeout=seconds + input_timeout + 120)
    text = p.stdout + p.stderr
    runs = None
    for line in text.splitlines():
        if line.startswith("stat::number_of_executed_units:"):
            runs = int(line.split(":")[-1])
        elif line.startswith("hypothesis-runs:"):
            runs = int(line.split(":")[-1])
    return {"target": target, "engine": "atheris" if have_atheris() else "random",
            "seconds": round(time.monotonic() - t0, 1), "runs": runs,
            "crashed": p.returncode != 0, "tail": text.strip().splitlines()[-12:]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", choices=TARGETS + ("mixed", "all"), default="all",
                   help="one target, mixed (the three in one process), or all (each in "
                        "turn, the budget each; the default)")
    p.add_argument("--seconds", type=float, default=60.0, help="budget per target (60)")
    p.add_argument("--corpus", default=None, help="keep each target's corpus under DIR/TARGET")
    p.add_argument("--artifacts", default=None, help="where atheris writes crashing inputs")
    p.add_argument("--input-timeout", type=float, default=20,
                   help="an input running longer than this is a crash (20 s)")
    p.add_argument("--max-len", type=int, default=512, help="longest input (512 bytes)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        if have_atheris():
            _run_atheris(args.target, args.seconds, args.corpus, args.artifacts,
                         args.input_timeout, args.max_len)
            return 0
        n, crash = _run_hypothesis(args.target, args.seconds, args.max_len)
        print(f"hypothesis-runs:{n}")
        if crash is not None:
            print(f"crash on input {crash[0]!r}: {type(crash[1]).__name__}: {crash[1]}")
            return 1
        return 0
    failed = False
    for target in (TARGETS if args.target == "all" else (args.target,)):
        r = run_target(target, args.seconds, args.corpus, args.artifacts, args.input_timeout,
                       args.max_len)
        print(f"{r['target']}: {r['engine']}, {r['runs']} inputs in {r['seconds']} s, "
              f"{'CRASHED' if r['crashed'] else 'no crash'}")
        if r["crashed"]:
            failed = True
            print("\n".join("    " + line for line in r["tail"]))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(_HERE))
    sys.exit(main())
