"""The slot writer's choice between memcpy and streaming stores (transport/shared_write.py).

A fake clock stands in for the copies' cost: a piece whose memcpy costs `memcpy`
seconds a byte and whose streaming copy costs `stream` (and a memcpy into bytes
that streaming stores wrote last, two pieces before, `cold`), so each test says which method a writer should
settle on and checks that it does, and how often it tries the other one.
"""
import numpy as np
import pytest

from accord.transport import shared_write
from accord.transport.shared_write import EXPLORE, EXPLORE_MEMCPY, MIN_BYTES, RUN, SharedWriter

pytestmark = pytest.mark.timeout(30)


class Costs:
    """The fake clock and both copies: every copy advances the clock by its cost."""

    def __init__(self, memcpy, stream, cold=None):
        self.memcpy, self.stream, self.cold = memcpy, stream, cold
        self.now = 0.0
        self.used = []                  # True for each streaming copy, False for memcpy

    def clock(self):
        return self.now

    def stream_copy(self, dst, src):
        dst.data[:] = src
        self.now += self.stream * len(src)
        self.used.append(True)

    def plain(self, n):
        # a slot's bytes come round every other piece: the copy two before wrote these
        after_stream = len(self.used) >= 2 and self.used[-2]
        cost = self.cold if after_stream and self.cold is not None else self.memcpy
        self.now += cost * n
        self.used.append(False)


class Piece:
    """A slot piece: `piece[:] = src` is the memcpy, charged to the fake clock."""

    def __init__(self, costs, n):
        self.costs, self.data = costs, np.zeros(n, np.uint8)

    def __len__(self):
        return len(self.data)

    def __setitem__(self, key, src):
        self.data[key] = src
        self.costs.plain(len(self.data))


@pytest.fixture
def fake(monkeypatch):
    """make(costs) -> (Costs, a SharedWriter on its clock); every copy of the method in use
    timed (SAMPLE 1), so that each test sees every time it feeds."""
    monkeypatch.setattr(shared_write, "SAMPLE", 1)

    def make(memcpy, stream, cold=None):
        costs = Costs(memcpy, stream, cold)
        monkeypatch.setattr(shared_write, "stream_copy", costs.stream_copy)
        return costs, SharedWriter(streams=True, clock=costs.clock)
    return make


def _copies(costs, copier, k, n=MIN_BYTES):
    src = np.arange(n, dtype=np.uint64).astype(np.uint8)
    for _ in range(k):
        piece = Piece(costs, n)
        copier.copy(piece, src)
        assert np.array_equal(piece.data, src)      # whichever method, the bytes arrive


def test_memcpy_stays_where_it_is_faster_and_streaming_is_tried_in_short_runs(fake):
    costs, copier = fake(memcpy=1e-11, stream=2e-11)
    _copies(costs, copier, 2 * EXPLORE_MEMCPY)
    assert copier.streaming is False
    streamed = sum(costs.used)
    # one run once memcpy has a time (from its third copy, the first two before it
    # being memcpy too), then one every EXPLORE_MEMCPY copies outside the runs (the
    # runs' own copies do not count): 2 runs in 2 * EXPLORE_MEMCPY copies
    assert costs.used[:3 + RUN] == [False] * 3 + [True] * RUN
    assert streamed == 2 * RUN, streamed


def test_a_streaming_writer_tries_memcpy_more_often(fake):
    # streaming's time barely moves from one stretch to the next, memcpy's does: a
    # writer that streams looks at memcpy every EXPLORE copies
    costs, copier = fake(memcpy=5e-11, stream=1e-11)
    _copies(costs, copier, 5 * EXPLORE)
    assert copier.streaming is True
    runs = sum(1 for i in range(1, len(costs.used))
               if not costs.used[i] and costs.used[i - 1])   # memcpy after streaming
    assert 4 <= runs <= 5, runs             # against one in EXPLORE_MEMCPY copies


def test_a_writer_turns_to_streaming_where_it_is_faster_and_back_when_that_changes(fake):
    costs, copier = fake(memcpy=5e-11, stream=1e-11)
    _copies(costs, copier, 10)
    assert copier.streaming is True
    _copies(costs, copier, 3 * EXPLORE)
    assert sum(costs.used[-EXPLORE:]) >= EXPLORE - RUN       # streaming, but for a run
    costs.memcpy = 0.5e-11                                   # the machine changed
    _copies(costs, copier, EXPLORE + RUN + 1)
    assert copier.streaming is False


def test_the_first_memcpys_after_streaming_do_not_count(fake):
    # memcpy in a row is faster, but the first two after streaming (into bytes no longer
    # in any cache) are slower than streaming: only copies whose two before used the
    # same method are timed, so the writer stays with memcpy
    costs, copier = fake(memcpy=1e-11, stream=2e-11, cold=9e-11)
    _copies(costs, copier, 5 * EXPLORE)
    assert copier.streaming is False
    assert sum(costs.used[-EXPLORE // 2:]) == 0


def test_one_slow_copy_does_not_change_the_choice(fake):
    costs, copier = fake(memcpy=1e-11, stream=2e-11)
    _copies(costs, copier, EXPLORE // 2)
    costs.memcpy = 50e-11               # one memcpy interrupted by the scheduler
    _copies(costs, copier, 1)
    costs.memcpy = 1e-11
    assert copier.streaming is False
    _copies(costs, copier, 8)
    assert costs.used[-8:] == [False] * 8


def test_the_method_in_use_is_timed_every_sample_th_copy(fake, monkeypatch):
    monkeypatch.setattr(shared_write, "SAMPLE", 4)
    costs, copier = fake(memcpy=1e-11, stream=2e-11)
    _copies(costs, copier, 20)                  # memcpy timed, streaming tried, memcpy
    reads = []
    copier._clock = lambda: reads.append(1) or costs.now
    _copies(costs, copier, EXPLORE - 30)        # short of the next exploring run
    assert len(reads) == 2 * ((EXPLORE - 30) // 4)      # two clock reads a timed copy
    assert copier.streaming is False


class Views:
    """A ByteStream stand-in whose gather is charged to the fake clock like a copy."""

    def __init__(self, costs, data):
        self.costs, self.data = costs, data

    def gather(self, mem, lo, hi, streaming=False):
        mem.data[:] = self.data[lo:hi]
        if streaming:
            self.costs.now += self.costs.stream * (hi - lo)
            self.costs.used.append(True)
        else:
            self.costs.plain(hi - lo)


def test_a_piece_gathered_from_many_tensors_is_chosen_for_alike(fake):
    # broadcast_state's root writes its tensors into its slot as one stream
    costs, copier = fake(memcpy=5e-11, stream=1e-11)
    data = np.arange(3 * MIN_BYTES, dtype=np.uint64).astype(np.uint8)
    views = Views(costs, data)
    for k in range(EXPLORE):
        piece = Piece(costs, MIN_BYTES)
        lo = (k % 3) * MIN_BYTES
        copier.gather(piece, views, lo)
        assert np.array_equal(piece.data, data[lo:lo + MIN_BYTES])
    assert copier.streaming is True
    assert sum(costs.used[-EXPLORE // 2:]) == EXPLORE // 2


def test_small_pieces_are_always_copied_by_memcpy(fake):
    costs, copier = fake(memcpy=9e-11, stream=1e-11)
    _copies(costs, copier, 3 * EXPLORE, n=MIN_BYTES - 1)
    assert costs.used == [False] * (3 * EXPLORE)


def test_a_pinned_method_is_used_for_every_piece(fake, monkeypatch):
    costs, copier = fake(memcpy=1e-11, stream=5e-11)
    monkeypatch.setattr(shared_write, "FORCE", "stream")
    _copies(costs, copier, 20)
    assert costs.used == [True] * 20
    monkeypatch.setattr(shared_write, "FORCE", "memcpy")
    costs.used.clear()
    costs.memcpy, costs.stream = 5e-11, 1e-11
    _copies(costs, copier, 20)
    assert costs.used == [False] * 20


def test_without_streaming_every_piece_is_a_memcpy(fake):
    costs, _ = fake(memcpy=9e-11, stream=1e-11)
    copier = SharedWriter(streams=False, clock=costs.clock)
    _copies(costs, copier, 2 * EXPLORE)
    assert costs.used == [False] * (2 * EXPLORE)


def test_the_copy_helper_switch_turns_streaming_off(monkeypatch):
    monkeypatch.setenv("ACCORD_COPY_HELPER", "0")
    assert shared_write.available() is False
    assert SharedWriter().streams is False


@pytest.mark.skipif(not shared_write.available(), reason="the copy helper is not built here")
def test_the_real_copies_write_the_bytes_both_ways():
    src = np.random.default_rng(1).integers(0, 256, 3 * MIN_BYTES + 13, np.uint8)
    mem = bytearray(len(src) + 7)
    for method in ("memcpy", "stream", None):
        for off in (0, 1, 7):           # streaming stores start at an unaligned byte too
            dst = memoryview(mem)[off:off + len(src)]
            dst[:] = bytes(len(src))
            old = shared_write.FORCE
            shared_write.FORCE = method
            try:
                SharedWriter().copy(dst, src)
            finally:
                shared_write.FORCE = old
            assert bytes(dst) == src.tobytes(), (method, off)


def _ring_messages(rank, world, write):
    """Large ring messages (world 2: no slots), in one piece (up to 1 MiB) and in
    chunks (3 MiB), under each way of writing them; how many writes went through the
    rings' SharedWriter, and whether every byte arrived."""
    import hashlib
    import accord as dist
    shared_write.FORCE = write
    writes = [0]
    real = shared_write.SharedWriter.choose

    def counted(self, n):
        writes[0] += 1
        return real(self, n)
    shared_write.SharedWriter.choose = counted
    rng = np.random.default_rng(rank)
    for n, calls in ((MIN_BYTES, EXPLORE), (3 * MIN_BYTES + 5, EXPLORE),
                     ((1 << 20) - 64, EXPLORE), (3 << 20, 8)):
        for _ in range(calls // world):
            x = rng.integers(0, 256, n, dtype=np.uint8)
            mine = x.copy()
            dist.broadcast(x, src=0)
            got = [np.empty(n, np.uint8) for _ in range(world)]
            dist.all_gather(got, mine)
            every = [None] * world
            dist.all_gather_object(every, hashlib.sha1(mine).hexdigest())
            for r in range(world):
                assert hashlib.sha1(got[r]).hexdigest() == every[r], (n, r)
            assert hashlib.sha1(x).hexdigest() == every[0], n
    return writes[0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("helper", ["1", "0"], ids=["ring-helper", "pure-rings"])
@pytest.mark.parametrize("write", [None, "memcpy", "stream"])
def test_large_ring_messages_arrive_whichever_way_they_are_written(write, helper):
    from harness import run_ranks
    env = {"ACCORD_TRANSPORT": "shm", "ACCORD_SHM_CMA": "0",       # no single copy
           "ACCORD_RING_HELPER": helper}
    writes = run_ranks(2, _ring_messages, write, env=env)
    # each rank's all_gather sends (and the root's broadcast) through its ring writer
    assert all(w >= 3 * EXPLORE // 2 for w in writes), writes


def _state_messages(rank, world, write, n):
    """broadcast_state of n small arrays (128 B to 128 KiB) synced again and again at
    world 2, where the root sends the state as one message gathered from its arrays
    (one piece for 30 of them, 602 KiB; chunks for 81, 1.5 MB), under each way of
    writing it; how many times the root's rings chose a method for a message of the
    state's size (the gatherer's choice is made once a message), and whether every
    sync's bytes arrived."""
    import accord as dist
    shared_write.FORCE = write
    sizes = [max(1, int(128 * 1024 ** (i / (n - 1))) // 4) for i in range(n)]
    total = 4 * sum(sizes)
    chosen = [0]
    real = shared_write.SharedWriter.choose

    def counted(self, nbytes):
        chosen[0] += nbytes == total
        return real(self, nbytes)
    shared_write.SharedWriter.choose = counted
    sd = {f"layer{i}.w": np.zeros(s, np.float32) for i, s in enumerate(sizes)}
    for k in range(3 * RUN + 4):
        if rank == 0:
            for i, a in enumerate(sd.values()):
                a[:] = np.arange(len(a), dtype=np.float32) * (k + 1) + i
        else:
            for a in sd.values():
                a[:] = -1
        dist.broadcast_state(sd, src=0)
        for i, a in enumerate(sd.values()):
            assert np.array_equal(a, np.arange(len(a), dtype=np.float32) * (k + 1) + i), \
                (n, k, i)
    return chosen[0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("helper", ["1", "0"], ids=["ring-helper", "pure-rings"])
@pytest.mark.parametrize("write", [None, "memcpy", "stream"])
@pytest.mark.parametrize("n", [30, 81], ids=["one-piece", "chunks"])
def test_a_state_gathered_into_the_ring_arrives_whichever_way_it_is_written(n, write, helper):
    from harness import run_ranks
    # the single-copy threshold pinned at its default (4 MiB), under which two ranks
    # send a repeated state through the ring (the probe may lower it to 1 MiB)
    env = {"ACCORD_TRANSPORT": "shm", "ACCORD_RING_HELPER": helper, "ACCORD_SHM_CMA": "4M"}
    chosen = run_ranks(2, _state_messages, write, n, env=env)
    # the root chose once a sync from the third (the second sighting of the dict makes
    # its entry, which later syncs send ahead), the receiver never (it sends its row)
    assert chosen[0] >= 3 * RUN + 2 and chosen[1] == 0, chosen
