"""How a caller waiting on a point-to-point operation waits where ranks share cores: it
yields its core a few times, moving its links after each yield, before it sleeps on the
plane (a sleeper costs its peer a wake-up per message, and on two cores four ranks
exchanging halos took 1.5x the time that way). With a core each it spins instead, and
with no yields asked it sleeps at once after its spin."""
import os
import socket
import threading

import numpy as np
import pytest

from accord.transport.p2p import Engine, Pending
from accord.transport.tcp import TcpTransport
from accord.transport.waiting import YIELDS, wait_policy
from accord.transport.wire import HEADER, OP_SEND, P2P

pytestmark = pytest.mark.timeout(60)


def _plane(yields, yield_s=0.0):
    """A p2p engine over one socket pair, waiting the way asked (no spin)."""
    a, b = socket.socketpair()
    t = TcpTransport(0, 2, {1: a}, lambda r: f"rank {r}")
    t.spin_s = 0.0
    t.yields, t.yield_s = yields, yield_s
    return Engine(t, "test", [0, 1], "rank 0"), t, b


def _tagged(tag, payload):
    return HEADER.pack(P2P, OP_SEND, 0, 0, -1, tag, -1, len(payload)) + payload


def _wait_counting(monkeypatch, engine, t, b, send_after_s):
    """Post a receive, have the peer send after send_after_s, wait for it on this thread:
    (the bytes received, this thread's yields and sleeps in order)."""
    me = threading.get_ident()
    events = []
    real_yield, real_sleep = os.sched_yield, t.sleep

    def counted_yield():
        if threading.get_ident() == me:
            events.append("yield")
        real_yield()

    def counted_sleep(*a):
        if threading.get_ident() == me:
            events.append("sleep")
        return real_sleep(*a)
    monkeypatch.setattr(os, "sched_yield", counted_yield)
    t.sleep = counted_sleep
    dest = np.zeros(4, np.uint8)
    op = Pending(False, 1, memoryview(dest), 5, 20.0, "irecv")
    engine.post([op])
    payload = bytes([1, 2, 3, 4])
    sender = threading.Timer(send_after_s, lambda: b.sendall(_tagged(5, payload)))
    sender.start()
    try:
        assert engine.wait(op, 20.0)
    finally:
        sender.join()
    assert op.result() == 1
    return dest.tobytes(), events


def _waited(monkeypatch, yields, yield_s=0.0):
    """A receive whose message comes after 0.3 s, waited on by a plane waiting the way
    asked: this thread's yields and sleeps in order (the bytes checked)."""
    engine, t, b = _plane(yields, yield_s)
    try:
        got, events = _wait_counting(monkeypatch, engine, t, b, 0.3)
    finally:
        engine.close(), t.close(), b.close()
    assert got == bytes([1, 2, 3, 4])
    return events


def test_a_waiter_yields_before_it_sleeps(monkeypatch):
    events = _waited(monkeypatch, yields=5)
    # the peer takes 0.3 s: the waiter yields its 5 times, then sleeps until the bytes come
    assert events[:5] == ["yield"] * 5 and "sleep" in events[5:], events[:12]
    assert events.index("sleep") == 5


def test_without_yields_a_waiter_sleeps_at_once(monkeypatch):
    events = _waited(monkeypatch, yields=0)
    assert "yield" not in events and "sleep" in events


def test_a_waiter_yields_for_the_least_time_asked(monkeypatch):
    # one yield asked, but for at least 0.1 s: it goes on yielding that long first
    events = _waited(monkeypatch, yields=1, yield_s=0.1)
    first_sleep = events.index("sleep")
    assert first_sleep > 1 and set(events[:first_sleep]) == {"yield"}


def test_the_shared_policy_yields_only_where_ranks_outnumber_cores():
    assert wait_policy(2, 2)[2] == 0                # a core each: spin instead
    assert wait_policy(4, 2)[2] == YIELDS
    assert wait_policy(3, 2)[2:] == (YIELDS, wait_policy(3, 2)[3]) and wait_policy(3, 2)[3] > 0
