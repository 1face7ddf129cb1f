"""How a TCP rank waits: it looks at its sockets for a while before poll() sleeps, where
every member of its group on this host has a core of its own, and only for messages up
to SPIN_BYTES; the spin gives up at once when the awaited peer hangs up."""
import socket
import threading
import time

import numpy as np
import pytest

from accord.errors import PeerLost
from accord.transport import tcp, wire
from accord.transport.tcp import SPIN_BYTES, TcpTransport
from accord.transport.waiting import SPIN_US
from accord.transport.wire import Stamp

pytestmark = pytest.mark.timeout(60)


def _describe(r):
    return f"rank {r}"


def _pair(monkeypatch, cores=2, size=2, members_here=None):
    monkeypatch.setattr(tcp, "usable_cores", lambda: cores)
    a, b = socket.socketpair()
    return TcpTransport(0, size, {1: a}, _describe, members_here), b


def test_a_rank_spins_only_where_each_member_here_has_a_core(monkeypatch):
    t, b = _pair(monkeypatch, cores=2, size=2)
    assert t.spin_s == SPIN_US * 1e-6
    t.close(), b.close()
    # four ranks on two cores: a spinning rank would hold off the one it waits for
    t, b = _pair(monkeypatch, cores=2, size=4)
    assert t.spin_s == 0.0
    t.close(), b.close()
    # a group across hosts with one member on this one (the hosts' leaders)
    t, b = _pair(monkeypatch, cores=2, size=8, members_here=1)
    assert t.spin_s == SPIN_US * 1e-6
    t.close(), b.close()


def _stamp(nbytes):
    return Stamp(wire.OP_CODES["broadcast"], 0, 1, 11, 0, nbytes, "uint8")


def _send_later(b, nbytes, after_s, value=7):
    """The peer's side: a collective message of nbytes, after_s seconds from now."""
    def go():
        time.sleep(after_s)
        b.sendall(_stamp(nbytes).header(nbytes) + bytes([value]) * nbytes)
    th = threading.Thread(target=go)
    th.start()
    return th


def _receive(t, nbytes, sleeps):
    """Receive one collective message of nbytes on t, counting the sleeps in poll()."""
    real = t._wait

    def counted(*a):
        sleeps.append(1)
        return real(*a)
    t._wait = counted
    dest = np.zeros(nbytes, np.uint8)
    t.exchange([], [(1, memoryview(dest))], _stamp(nbytes), time.monotonic() + 20)
    return dest


@pytest.mark.parametrize("nbytes,spins", [(8, True), (SPIN_BYTES, True),
                                          (SPIN_BYTES + 1, False)])
def test_a_message_that_comes_within_the_spin_is_read_without_sleeping(monkeypatch, nbytes,
                                                                       spins):
    t, b = _pair(monkeypatch)
    t.spin_s = 10.0                     # far longer than the peer takes (0.2 s)
    th = _send_later(b, nbytes, 0.2)
    sleeps = []
    try:
        dest = _receive(t, nbytes, sleeps)
    finally:
        th.join()
        t.close()
        b.close()
    assert (dest == 7).all()
    # up to SPIN_BYTES the wait looks at the socket until the bytes come; beyond, it
    # sleeps in poll() (flow control, not a peer's wake-up, holds such a message)
    assert (not sleeps) == spins


def test_without_a_spin_the_wait_sleeps_in_poll(monkeypatch):
    t, b = _pair(monkeypatch, cores=2, size=4)
    th = _send_later(b, 8, 0.2)
    sleeps = []
    try:
        dest = _receive(t, 8, sleeps)
    finally:
        th.join()
        t.close()
        b.close()
    assert (dest == 7).all() and sleeps


def test_a_peer_that_hangs_up_ends_the_spin_at_once(monkeypatch):
    t, b = _pair(monkeypatch)
    t.spin_s = 30.0

    def hang_up():
        time.sleep(0.2)
        b.close()
    th = threading.Thread(target=hang_up)
    th.start()
    start = time.monotonic()
    try:
        with pytest.raises(PeerLost, match="rank 1"):
            _receive(t, 8, [])
    finally:
        th.join()
        t.close()
    assert time.monotonic() - start < 10
