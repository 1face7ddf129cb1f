"""Headers from peers are validated: corrupt or hostile frames are errors, never huge
allocations, out-of-bounds writes or hangs (fuzzed with hypothesis)."""
import socket
import threading
import time
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from accord.errors import AccordError, Desync, PeerLost
from accord.transport import wire
from accord.transport.p2p import Engine, Pending
from accord.transport.tcp import TcpTransport
from accord.transport.wire import ABORT, BYE, COLL, HEADER, HEADER_SIZE, P2P, Stamp

pytestmark = pytest.mark.timeout(120)
FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])


def _pair():
    a, b = socket.socketpair()
    t = TcpTransport(0, 2, {1: a}, lambda r: f"rank {r}")
    return t, b


def _recv_tagged(t, peer, dest, tag, timeout):
    """A tagged receive through a p2p engine driving t (as a group's p2p plane)."""
    engine = Engine(t, "test", [0, 1], "rank 0")
    op = Pending(False, peer, dest, tag, timeout, "recv")
    engine.post([op])
    try:
        return op.result(timeout + 5)
    finally:
        engine.close()


def _feed(data, recv_len=16, p2p=False):
    """Send data then hang up; receive on the transport. Returns the outcome."""
    t, b = _pair()
    try:
        b.sendall(data)
        b.shutdown(socket.SHUT_WR)
        dest = memoryview(bytearray(recv_len))
        deadline = time.monotonic() + 2.0
        try:
            if p2p:
                _recv_tagged(t, 1, dest, 0, 2.0)
            else:
                stamp = Stamp(wire.OP_CODES["broadcast"], 0, 1, 11, 0, recv_len, "float32")
                t.exchange([], [(1, dest)], stamp, deadline)
        except AccordError as e:
            return e
        return None
    finally:
        b.close()
        t.close()


@FUZZ
@given(st.binary(min_size=HEADER_SIZE, max_size=HEADER_SIZE))
def test_header_problem_is_total(raw):
    h = HEADER.unpack(raw)
    problem = wire.header_problem(h)
    assert problem is None or isinstance(problem, str)
    wire.describe_header(h)          # never raises either


@FUZZ
@given(st.binary(max_size=300), st.booleans())
def test_random_bytes_are_errors_not_crashes(data, p2p):
    out = _feed(data, p2p=p2p)
    assert out is None or isinstance(out, AccordError)


headers = st.tuples(st.sampled_from([COLL, P2P, ABORT, BYE, 0, 7, 255]),
                    st.integers(0, 255), st.integers(0, 255), st.integers(0, 255),
                    st.integers(-2**31, 2**31 - 1), st.integers(-2**63, 2**63 - 1),
                    st.integers(-2**63, 2**63 - 1), st.integers(0, 2**64 - 1))


@FUZZ
@given(headers, st.binary(max_size=64), st.booleans())
def test_fuzzed_headers_never_allocate_what_they_claim(h, tail, p2p):
    tracemalloc.start()
    try:
        out = _feed(HEADER.pack(*h) + tail, p2p=p2p)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert out is None or isinstance(out, AccordError)
    assert peak < 8 << 20, f"{peak} bytes allocated for header {h}"


def test_impossible_length_is_rejected_by_name():
    out = _feed(HEADER.pack(P2P, 10, 0, 0, -1, 0, -1, 1 << 62))
    assert isinstance(out, PeerLost) and "impossible payload length" in str(out)
    out = _feed(HEADER.pack(9, 0, 0, 0, -1, 0, -1, 0))
    assert isinstance(out, PeerLost) and "unknown message kind 9" in str(out)
    out = _feed(HEADER.pack(ABORT, 0, 0, 0, -1, 0, -1, 1 << 30))
    assert isinstance(out, PeerLost) and "oversized abort" in str(out)


@pytest.mark.parametrize("chunks", [1, 7])
def test_a_legit_large_stashed_message_still_arrives(chunks):
    # a p2p message nobody asked for yet is stashed; its buffer grows as bytes arrive
    t, b = _pair()
    try:
        payload = np.arange(3 << 18, dtype=np.uint32).tobytes()      # 3 MiB
        stamp_hdr = Stamp(wire.OP_CODES["barrier"], 0, -1, 255, 0, 0, "")
        data = (HEADER.pack(P2P, 10, 0, 0, -1, 5, -1, len(payload)) + payload
                + stamp_hdr.header(0))

        def send():
            # odd-sized pieces with pauses: the reader sees every split of the boundaries
            step = -(-len(data) // chunks) + 13
            for i in range(0, len(data), step):
                b.sendall(data[i:i + step])
                time.sleep(0.01)
        sender = threading.Thread(target=send)
        sender.start()
        t.exchange([], [(1, memoryview(bytearray(0)))], stamp_hdr, time.monotonic() + 5)
        dest = bytearray(len(payload))
        _recv_tagged(t, 1, memoryview(dest), 5, 5.0)
        assert bytes(dest) == payload
        sender.join()
    finally:
        b.close()
        t.close()


def test_mismatched_stamp_is_desync():
    other = Stamp(wire.OP_CODES["all_reduce"], 0, -1, 11, 0, 16, "float32")
    out = _feed(other.header(16) + bytes(16))
    assert isinstance(out, Desync) and "all_reduce #0" in str(out)
