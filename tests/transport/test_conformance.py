"""The transport conformance suite (conformance.py) against every medium: TCP over
socket pairs, shared memory (default rings, small rings without single copy, single
copy from 4 KiB), each group built inside this process with ranks as threads."""
import errno
import itertools
import socket
import threading
import time

import pytest

import conformance
from accord.store import HashStore
from accord.transport import shm
from accord.transport.tcp import TcpTransport

pytestmark = pytest.mark.timeout(120)


def describe(r):
    return f"rank {r}"


class TcpMaker:
    name = "tcp"

    def make(self, size):
        planes = []
        socks = [[{}, {}] for _ in range(size)]
        for a, b in itertools.combinations(range(size), 2):
            for plane in (0, 1):
                sa, sb = socket.socketpair()
                socks[a][plane][b], socks[b][plane][a] = sa, sb
        for r in range(size):
            planes.append((TcpTransport(r, size, socks[r][0], describe),
                           TcpTransport(r, size, socks[r][1], describe)))
        return planes

    def close(self, planes):
        for coll, p2p in planes:
            p2p.close(0.0)
            coll.close(0.0)

    def fault(self, t, peer):
        link = t.links[peer]
        real = link.sock

        class Failing:
            """The peer's socket, failing every read as a broken NIC would."""
            def __getattr__(self, name):
                return getattr(real, name)

            def recv_into(self, *a):
                raise OSError(errno.EIO, "Input/output error")
            recv = recv_into
        link.sock = Failing()

        def undo():
            link.sock = real
        return undo


class ShmMaker:
    _ids = itertools.count()

    def __init__(self, name, arena=64 << 20, cma_min=1 << 20):
        self.name, self.arena, self.cma_min = name, arena, cma_min

    def make(self, size):
        store = HashStore()
        prefix = f"conformance{next(self._ids)}"
        out = [None] * size

        def rank(r):
            out[r] = shm.connect_shm(store, prefix, r, size, describe, time.monotonic() + 20,
                                     arena_bytes=self.arena, cma_min=self.cma_min)
        ts = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
        return [(t, t.p2p) for t in out]

    def close(self, planes):
        for coll, p2p in planes:
            p2p.close(0.0)
            coll.close(0.0)

    def fault(self, t, peer):
        # single copy: the read out of the peer's memory fails; rings only: the sleep
        name, mod = ("read", shm.cma) if self.cma_min else ("wait", shm.futex)
        real = getattr(mod, name)

        def failing(*a):
            raise OSError(errno.EFAULT, "Bad address")
        setattr(mod, name, failing)

        def undo():
            setattr(mod, name, real)
        return undo


MAKERS = [TcpMaker(), ShmMaker("shm"), ShmMaker("shm-small", arena=64 << 10, cma_min=0),
          ShmMaker("shm-cma", cma_min=4 << 10)]


@pytest.mark.parametrize("maker", MAKERS, ids=[m.name for m in MAKERS])
@pytest.mark.parametrize("check", conformance.CHECKS, ids=[c.__name__ for c in conformance.CHECKS])
def test_transport_conforms(check, maker):
    check(maker)
