"""The shared-memory ring's optional C helper (accord/transport/ring_core.c) and the choice
between it and the pure-Python path (transport/ring_helper.py).

The helper must write the very bytes the pure path writes (ranks with and without it
share rings), decline exactly what the pure path declines (the general path then
reports a Desync or routes the message), and wake a sleeping peer the same way. The
pure path must still pass the tests that drive these rings: test_pure_path_passes_
the_ring_tests runs them again with ACCORD_RING_HELPER=0.
"""
import ctypes
import mmap
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import accord
from accord.transport import ring_helper
from accord.transport.wire import COLL, HEADER, HEADER_SIZE, OP_SEND, P2P, Stamp

from harness import run_ranks

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parent.parent

built = pytest.mark.skipif(not ring_helper.built(), reason="the C helper was not built here")

# a loopback ring in one mapping: this process is producer and consumer
HEAD, TAIL, WANT_DATA, WANT_SPACE, WANT_ACK, ACKED = 0, 8, 16, 24, 32, 40
BELL = 512                  # byte offset of the doorbell (int32)
RING, CAP = 4096, 8192


class Loop:
    def __init__(self, rewind=CAP):
        self.mm = mmap.mmap(-1, RING + CAP)
        self.q = np.frombuffer(self.mm, np.int64, RING // 8)
        self.bell = np.frombuffer(self.mm, np.int32, 1, BELL)
        self.ring = memoryview(self.mm)[RING:RING + CAP]
        anchor = ctypes.c_char.from_buffer(self.mm)
        base = ctypes.addressof(anchor)
        del anchor
        self.link = ring_helper.ring_link(self.mm, base, base + RING, base + RING, CAP,
                                          HEAD, TAIL, WANT_DATA, HEAD, TAIL, WANT_SPACE,
                                          WANT_ACK, ACKED, base + BELL, 1, rewind)

    def put(self, stamp, payload, tag=0):
        head = self.link.put(int(self.q[HEAD]), stamp, tag, memoryview(payload).cast("B"))
        return head

    def take(self, stamp, dest, tag=0, spin=0.0):
        return self.link.take(int(self.q[TAIL]), stamp, tag, memoryview(dest).cast("B"), spin)


def _stamp(seq=7, count=16, root=1, site=0):
    return Stamp(1, seq, root=root, dtype=11, redop=0, count=count, site=site)


@built
def test_put_writes_the_pure_paths_bytes_and_take_reads_them_back():
    loop = Loop()
    x = np.arange(4, dtype=np.float32)
    s = _stamp(site=5)
    assert loop.put(s, x) == HEADER_SIZE + 16
    assert loop.q[HEAD] == HEADER_SIZE + 16
    # the header exactly as Stamp.pack_into (the pure path) writes it
    assert bytes(loop.ring[:HEADER_SIZE]) == s.header(16)
    assert bytes(loop.ring[HEADER_SIZE:HEADER_SIZE + 16]) == x.tobytes()
    out = np.zeros(4, np.float32)
    # the same call from another line (another site id) still matches: only seq counts
    assert loop.take(_stamp(site=9), out) == HEADER_SIZE + 16
    assert loop.q[TAIL] == HEADER_SIZE + 16
    assert out.tolist() == [0.0, 1.0, 2.0, 3.0]


@built
@pytest.mark.parametrize("other", [
    dict(seq=8), dict(count=32), dict(root=0)], ids=["seq", "count", "root"])
def test_take_declines_another_call_and_consumes_nothing(other):
    loop = Loop()
    loop.put(_stamp(), np.ones(4, np.float32))
    out = np.zeros(4, np.float32)
    assert loop.take(_stamp(**other), out) == -1
    assert loop.q[TAIL] == 0 and out.tolist() == [0.0] * 4       # left for the general path
    small = np.zeros(2, np.float32)                               # another size: declined too
    assert loop.take(_stamp(), small) == -1
    assert loop.take(_stamp(), out) == HEADER_SIZE + 16


@built
def test_put_gathers_a_byte_stream_and_take_scatters_into_one():
    from accord.byte_stream import ByteStream
    loop = Loop()
    a, b = np.arange(3, dtype=np.float32), np.arange(10, 15, dtype=np.float32)
    parts = ByteStream([memoryview(a).cast("B"), memoryview(b""),
                        memoryview(b).cast("B")])
    s = _stamp(count=32)
    assert loop.link.put(0, s, 0, parts) == HEADER_SIZE + 32
    # the bytes a contiguous payload of the same values writes
    assert bytes(loop.ring[:HEADER_SIZE]) == s.header(32)
    assert bytes(loop.ring[HEADER_SIZE:HEADER_SIZE + 32]) == np.concatenate([a, b]).tobytes()
    x, y = np.zeros(5, np.float32), np.zeros(3, np.float32)
    into = ByteStream([memoryview(x).cast("B"), memoryview(y).cast("B")])
    assert loop.link.take(0, _stamp(count=32), 0, into, 0.0) == HEADER_SIZE + 32
    assert x.tolist() == [0, 1, 2, 10, 11] and y.tolist() == [12, 13, 14]


@built
@pytest.mark.parametrize("parts", [1, 3], ids=["one-buffer", "byte-stream"])
def test_put_with_streaming_stores_writes_the_same_bytes(parts):
    # the payload written with streaming stores (a large message where its ring's
    # writer timed them faster: transport/shared_write.py) is byte for byte memcpy's,
    # at any alignment of the payload in the ring and with a tail shorter than 64 bytes
    from accord.byte_stream import ByteStream
    rng = np.random.default_rng(parts)
    for n in (1, 15, 64, 1000, 4001):
        for start in (0, 8, 40):
            plain, streamed = Loop(), Loop()
            data = rng.integers(0, 256, n, dtype=np.uint8)
            cuts = [data[:n // 3], data[n // 3:n // 2], data[n // 2:]]
            payload = ByteStream([memoryview(c) for c in cuts]) if parts == 3 else data
            s = _stamp(count=n, seq=start)
            for loop in (plain, streamed):
                loop.q[HEAD] = loop.q[TAIL] = start         # the message starts there
            assert plain.link.put(start, s, 0, payload) == start + HEADER_SIZE + n
            assert streamed.link.put(start, s, 0, payload, True) == start + HEADER_SIZE + n
            assert bytes(streamed.ring) == bytes(plain.ring), (n, start)
            out = np.zeros(n, np.uint8)
            assert streamed.take(s, out) == start + HEADER_SIZE + n
            assert np.array_equal(out, data)


@built
def test_take_refuses_a_byte_stream_with_a_read_only_view_and_consumes_nothing():
    from accord.byte_stream import ByteStream
    loop = Loop()
    loop.put(_stamp(), np.ones(4, np.float32))
    x = np.zeros(2, np.float32)
    into = ByteStream([memoryview(x).cast("B"), memoryview(bytes(8))])
    with pytest.raises(TypeError, match="read-only"):
        loop.link.take(0, _stamp(), 0, into, 0.0)
    assert loop.q[TAIL] == 0 and x.tolist() == [0.0, 0.0]
    with pytest.raises(TypeError, match="a buffer or a ByteStream"):
        loop.link.put(int(loop.q[HEAD]), _stamp(), 0, object())


@built
def test_take_spins_for_a_message_not_there_then_declines():
    loop = Loop()
    out = np.zeros(4, np.float32)
    assert loop.take(_stamp(), out, spin=0.002) == -1
    assert loop.q[TAIL] == 0


_PIECES = """
import sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from test_ring_helper import HEAD, HEADER_SIZE, TAIL, Loop, _stamp
loop = Loop()
if sys.argv[2] == "part":
    loop.ring[:HEADER_SIZE] = _stamp().header(16)
    loop.q[HEAD] = HEADER_SIZE + 8                  # the header and half the payload
else:
    loop.put(None, np.zeros(1, np.float32), tag=3)  # a smaller message is first
print(loop.take(_stamp(), np.zeros(4, np.float32), spin=3600.0), loop.q[TAIL])
"""


@built
@pytest.mark.parametrize("arrived", ["part", "another"])
def test_take_does_not_spin_on_a_message_that_comes_in_pieces(arrived):
    # A message the ring had no room for in one piece is streamed in by the general
    # path, its head published piece by piece: a take that spun for the whole message
    # would hold it up for all its spin (here an hour). The spin holds the GIL, which
    # no test timeout can interrupt, so it runs in a process of its own.
    proc = subprocess.run([sys.executable, "-c", _PIECES, str(ROOT / "tests"), arrived],
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=60)
    assert proc.stdout.split() == ["-1", "0"], proc.stdout


def test_pure_path_does_not_spin_on_a_message_that_comes_in_pieces():
    # the same for the pure path's spin (transport/shm.py's _recv_inline)
    from types import SimpleNamespace

    from accord.transport.shm import ShmTransport
    q = np.zeros(2, np.int64)
    q[0] = HEADER_SIZE + 8                              # past the tail, short of the message
    link = SimpleNamespace(fast=None, i_head_i=0, i_tail=0,
                           _take_whole=lambda dest, kind, stamp, tag: False)
    t = SimpleNamespace(links={1: link}, q=q, _spin_s=3600.0)
    assert ShmTransport._recv_inline(t, 1, memoryview(bytearray(16)), _stamp()) is False


@built
def test_put_declines_a_full_ring_and_a_message_that_would_wrap():
    loop = Loop()
    big = np.zeros((CAP - HEADER_SIZE) // 4, np.float32)
    assert loop.put(_stamp(), big) == CAP                           # exactly fills it
    assert loop.put(_stamp(), np.zeros(1, np.float32)) == -1        # no room
    assert loop.q[HEAD] == CAP

    loop = Loop()
    first = np.zeros((CAP - 64 - HEADER_SIZE) // 4, np.float32)
    assert loop.put(_stamp(), first) == CAP - 64
    # not consumed, and only 64 bytes are left before the ring's end: a 96-byte
    # message would wrap
    assert loop.put(_stamp(), np.zeros(16, np.float32)) == -1
    assert loop.q[HEAD] == CAP - 64
    loop.q[TAIL] = CAP - 128                      # partly consumed: still no rewind
    assert loop.put(_stamp(), np.zeros(16, np.float32)) == -1
    assert loop.put(_stamp(), np.zeros(2, np.float32)) == CAP - 64 + HEADER_SIZE + 8


@built
@pytest.mark.parametrize("helper", [True, False], ids=["helper", "pure"])
def test_an_empty_ring_starts_over_at_its_beginning(helper):
    """A one-piece message that would reach past the rewind offset of an empty ring is
    written at offset 0 behind a pad to the ring's end, so the bytes a link cycles
    through stay few (and in cache); the reader skips the pad, on either path."""
    loop = Loop(rewind=4096)
    first = np.zeros((CAP - 64 - HEADER_SIZE) // 4, np.float32)
    assert loop.put(_stamp(), first) == CAP - 64
    loop.q[TAIL] = CAP - 64                       # consumed: the ring is empty
    x = np.arange(16, dtype=np.float32)
    assert loop.put(_stamp(), x) == CAP + HEADER_SIZE + 64
    assert HEADER.unpack_from(loop.ring, CAP - 64) == (0x20, 0, 0, 0, -1, 0, -1,
                                                        64 - HEADER_SIZE)
    assert bytes(loop.ring[:HEADER_SIZE]) == _stamp().header(64)
    assert bytes(loop.ring[HEADER_SIZE:HEADER_SIZE + 64]) == x.tobytes()
    out = np.zeros(16, np.float32)
    if helper:
        assert loop.take(_stamp(), out) == CAP + HEADER_SIZE + 64
    else:
        assert _pure_take(loop, out)
    assert out.tolist() == x.tolist()
    # below the rewind offset an empty ring is written on where it is
    assert loop.put(_stamp(), x) == CAP + 2 * (HEADER_SIZE + 64)


def _pure_take(loop, out):
    """shm.py's pure-Python take of the same loopback ring."""
    from accord.transport import shm
    link = shm._Link.__new__(shm._Link)
    link.t = type("T", (), {"q": loop.q})()
    link.cap, link.i_ring = CAP, loop.ring
    link.i_head_i, link.i_tail_i = HEAD, TAIL
    link.i_want_space_i, link.i_want_ack_i, link.i_acked_i = WANT_SPACE, WANT_ACK, ACKED
    link.posted = link.stash = ()
    link.incoming, link.fast = None, None
    link.i_tail = int(loop.q[TAIL])
    link.peer_doorbell, link.wake_n = 0, 1
    link.poke_space = lambda: None
    if not link._take_whole(memoryview(out).cast("B"), 1, _stamp(), None):
        return False
    assert loop.q[TAIL] == link.i_tail == CAP + HEADER_SIZE + 64
    return True


@built
def test_put_wakes_a_sleeper_only_when_it_asked_for_that_much():
    loop = Loop()
    loop.q[WANT_DATA] = 1000                      # the consumer sleeps for head >= 1000
    loop.put(_stamp(), np.zeros(4, np.float32))
    assert loop.bell[0] == 0                      # not enough yet: no wake-up
    loop.q[WANT_DATA] = 1
    loop.put(_stamp(), np.zeros(4, np.float32))
    assert loop.bell[0] == 1                      # FUTEX_WAKE_OP added 1 (and woke)


@built
def test_take_wakes_a_producer_waiting_for_room():
    loop = Loop()
    loop.put(_stamp(), np.zeros(4, np.float32))
    loop.q[WANT_SPACE] = HEADER_SIZE + 16         # the producer sleeps for tail >= this
    loop.take(_stamp(), np.zeros(4, np.float32))
    assert loop.bell[0] == 1


@built
def test_take_of_a_tagged_message_matches_its_tag():
    loop = Loop()
    assert loop.put(None, np.arange(2, dtype=np.float32), tag=42) == HEADER_SIZE + 8
    # the header the pure path's tagged_send writes
    assert bytes(loop.ring[:HEADER_SIZE]) == HEADER.pack(P2P, OP_SEND, 0, 0, -1, 42, -1, 8)
    out = np.zeros(2, np.float32)
    assert loop.take(None, out, tag=41) == -1
    assert loop.take(_stamp(), out) == -1          # a collective does not take it
    assert loop.take(None, out, tag=42) == HEADER_SIZE + 8
    assert out.tolist() == [0.0, 1.0]


@built
def test_addresses_outside_the_arena_are_refused():
    mm = mmap.mmap(-1, RING + CAP)
    anchor = ctypes.c_char.from_buffer(mm)
    base = ctypes.addressof(anchor)
    del anchor
    with pytest.raises(ValueError, match="outside the arena"):
        ring_helper.ring_link(mm, base, base + RING, base + RING + 4096, CAP, 0, 8, 16, 0, 8,
                              24, 32, 40, base + BELL, 1, CAP)
    with pytest.raises(ValueError, match="word index outside"):
        ring_helper.ring_link(mm, base, base + RING, base + RING, CAP, 0, 8, 16, 0, 8,
                              24, 32, (RING + CAP) // 8, base + BELL, 1, CAP)


def test_built_wherever_a_c_compiler_was_found():
    """`pip install` builds the helper where it finds a C compiler (make test installs
    with the machine's gcc): a build that silently fell back would go unnoticed."""
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler on this machine: the pure path is expected")
    assert ring_helper.built(), "a C compiler is here, yet accord/transport/ring_core.c is not built"


def _paths(rank, world, off_on):
    """Which path each link of this rank's group took, after a round of collectives and
    point to point across sizes that fit the ring in one piece, wrap it, or stream."""
    if rank in off_on:
        os.environ["ACCORD_RING_HELPER"] = "0"
    accord.init_process_group()
    t = accord.world.default_group().transport
    fast = [link.fast is not None for link in t.links.values()]
    got = []
    for numel in (1, 100, 16384, 300000):
        x = np.arange(numel, dtype=np.float32) + rank
        b = x.copy()
        accord.broadcast(b, src=1)
        got.append(float(b.sum()))
        r = x.copy()
        accord.all_reduce(r)
        got.append(float(r.sum()))
        outs = [np.empty(numel, np.float32) for _ in range(world)]
        accord.all_gather(outs, x)
        got.append([float(o.sum()) for o in outs])
        m = x.copy()
        if rank == 0:
            accord.send(m, 1, tag=numel)
            accord.recv(m, 1, tag=numel)
        elif rank == 1:
            accord.recv(m, 0, tag=numel)
            m += 1
            accord.send(m, 0, tag=numel)
        got.append(float(m.sum()))
    accord.barrier()
    accord.destroy_process_group()
    return fast, got


@built
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_with_and_without_the_helper_share_rings(world):
    res = run_ranks(world, _paths, (0,), init=False)
    assert res[0][0] == [False] * (world - 1)            # ACCORD_RING_HELPER=0
    assert all(res[r][0] == [True] * (world - 1) for r in range(1, world))
    expect = run_ranks(world, _paths, tuple(range(world)), init=False)   # all pure
    assert [g for _, g in res] == [g for _, g in expect]
    assert all(not any(f) for f, _ in expect)
    # and the values themselves, for the first size
    b0 = res[0][1][0]
    assert b0 == float(np.arange(1, dtype=np.float32).sum() + 1)


def _cycling(rank, world, off_on):
    """40 rounds of a 256 KiB all_reduce and broadcast, many times what the 4 MiB rings
    hold. Returns the results and the farthest any ring's head got from its
    beginning."""
    if rank in off_on:
        os.environ["ACCORD_RING_HELPER"] = "0"
    accord.init_process_group()
    t = accord.world.default_group().transport
    assert t.cap == 4 << 20
    reach, got = 0, []
    for i in range(40):
        x = np.arange(65536, dtype=np.float32) + rank + i
        accord.all_reduce(x)
        got.append(float(x[1]))
        accord.broadcast(x, src=i % world)
        got.append(float(x[-1]))
        reach = max([reach] + [link.o_head % link.cap for link in t.links.values()])
    accord.barrier()
    accord.destroy_process_group()
    return got, reach


@built
def test_rings_start_over_when_empty_between_ranks_with_and_without_the_helper():
    res = run_ranks(2, _cycling, (0,), init=False)
    got, reach = res[0]
    assert res[1][0] == got
    # all_reduce of ranks 0 and 1 (3 + 2i at index 1), then rank i % 2's broadcast
    assert got[0::2] == [float(3 + 2 * i) for i in range(40)]
    assert got[1::2] == [float(2 * (65535 + i) + 1) for i in range(40)]
    # the rings started over: 40 rounds of 256 KiB messages write several times a ring's
    # 4 MiB into each, so heads that never went back to the start would cycle through it. How far past the first megabyte a
    # head gets depends on how far the writer runs ahead of a reader that has not emptied
    # its ring yet; the ranks meet in every round's all_reduce, so that is about a
    # round's messages (one 256 KiB message past it on a quiet host, and 160 bytes more
    # once with a second test run beside it), far under 2 MiB
    assert max(reach, res[1][1]) < 2 << 20


# the tests whose calls go through the helper's put and take (tests/test_shm.py drives
# the rings' streaming and failure paths, which are Python's on both)
RING_TESTS = ["tests/test_lane.py", "tests/test_desync.py", "tests/test_p2p.py",
              "tests/transport"]


@pytest.mark.timeout(600)
def test_pure_path_passes_the_ring_tests():
    """The pure-Python path is not left to rot where the helper is built: the tests that
    drive the rings' one-piece messages (the lean path, Desync reports, point to point,
    the transport conformance suite) pass with ACCORD_RING_HELPER=0 too."""
    if not ring_helper.built():
        pytest.skip("the helper is not built: the whole suite runs the pure path already")
    env = dict(os.environ, ACCORD_RING_HELPER="0")
    # the TCP cases of these files run the same code either way; the stuck-rank and
    # no-false-alarm cases are left out too: seconds each of a rank waiting for a
    # message that does not come, a wait the Desync, timeout, point-to-point and
    # conformance cases that stay make as well
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-k", "not tcp and not stuck_rank and not false_alarm",
                           *RING_TESTS], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=580)
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout, proc.stdout[-2000:]
