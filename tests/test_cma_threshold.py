"""The single-copy threshold where ACCORD_SHM_CMA is not set: measured once per process
between group ranks 0 and 1 when a shared-memory group is created, the same on every
rank of the group, and used by every later group of that process."""
import os

import numpy as np
import pytest

from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20


def _thresholds(rank, world):
    import accord
    from accord.transport import cma_threshold
    del cma_threshold._verdict[:]           # what the parent process knew, if anything
    measured = []
    real = cma_threshold._measure

    def spy(*args):
        measured.append(1)
        return real(*args)
    cma_threshold._measure = spy
    os.environ.pop("ACCORD_SHM_CMA", None)
    accord.init_process_group()
    g = accord.world.default_group()
    sub = accord.new_group([1, 2])              # its rank 0 is global rank 1
    x = np.arange(1 << 19, dtype=np.float32) * (rank + 1)  # 2 MiB: either side of 1 MiB
    accord.all_reduce(x)
    np.testing.assert_array_equal(x, np.arange(1 << 19, dtype=np.float32) * 6)
    out = (g.transport.cma_min, g.transport.p2p.cma_min,
           sub.transport.cma_min if rank in (1, 2) else None, len(measured))
    accord.destroy_process_group()
    return out


def test_measured_once_the_same_on_every_rank_and_reused_by_later_groups():
    res = run_ranks(3, _thresholds, init=False)
    value = res[0][0]
    assert value in (MiB, 4 * MiB), res
    for r, (t, p2p, sub, measured) in enumerate(res):
        assert t == value, res                  # every rank of the group alike
        assert p2p == 8 * MiB, res              # point-to-point keeps its own default
        if r in (1, 2):
            assert sub == value, res            # the subgroup's rank 0 knew it already
        # only rank 0 times the probe, once; the subgroup measures nothing
        assert measured == (1 if r == 0 else 0), res


def _set(rank, world):
    import accord
    from accord.transport import cma_threshold
    del cma_threshold._verdict[:]
    accord.init_process_group()
    t = accord.world.default_group().transport
    out = (t.cma_min, bool(cma_threshold._verdict))
    accord.destroy_process_group()
    return out


@pytest.mark.parametrize("value,want", [("2M", 2 * MiB), ("0", 1 << 62)])
def test_a_set_threshold_is_used_as_it_is_and_nothing_is_measured(value, want):
    assert run_ranks(2, _set, init=False, env={"ACCORD_SHM_CMA": value}) == [(want, False)] * 2


class _TimedTransport:
    """A stand-in for the probe's transport: each ring swap and each single-copy swap
    takes the next of the given times (seconds), by the probe's own clock."""

    def __init__(self, clock, ring_times, cma_times):
        self.cma_min = 4 * MiB
        self._clock, self._ring, self._cma = clock, list(ring_times), list(cma_times)

    def exchange(self, sends, recvs, stamp, deadline, ring=False):
        self._clock.now += (self._ring if ring else self._cma).pop(0)


class _Clock:
    now = 0.0

    def __call__(self):
        return self.now


@pytest.mark.parametrize("ring_times, cma_times, want", [
    # single copy 0.6x the ring in every pair: it wins
    ([1.0] * 8, [0.6] * 8, MiB),
    # as fast as the ring but for one pair where the ring was held up by a burst of
    # load: the ring stays (a verdict from the best times alone went to single copy)
    ([1.0, 1.0, 1.0, 3.0, 1.0, 1.0, 1.0, 1.0], [0.95, 1.0, 1.0, 0.5, 1.0, 1.0, 1.0, 1.1],
     4 * MiB),
    # single copy 0.9x the ring: too little to leave the rings (both cores copy there)
    ([1.0] * 8, [0.9] * 8, 4 * MiB),
])
def test_the_verdict_is_the_median_of_paired_swaps(monkeypatch, ring_times, cma_times, want):
    from accord.transport import cma_threshold
    clock = _Clock()
    monkeypatch.setattr(cma_threshold.time, "perf_counter", clock)
    t = _TimedTransport(clock, ring_times, cma_times)
    assert cma_threshold._probe(t, 1, None) == want
    assert t.cma_min == 4 * MiB                  # put back as it was
    assert not t._ring and not t._cma            # one warm-up and seven pairs


def _resident_arena_bytes(rank, world):
    import accord
    t = accord.world.default_group().transport
    rss, in_arena = None, False
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split(None, 1)[0]
            if not first.endswith(":"):             # a mapping's first line: its range, ...
                in_arena = "/accord-" in line      # ... and the file's name
            elif first == "Rss:" and in_arena:
                rss = int(line.split()[1]) * 1024
    return rss, 2 * (world - 1) * (t.cap + t.p2p.cap)


def test_every_ring_a_rank_uses_is_mapped_in_before_the_first_call():
    # first touches cost a fault per page (a cold 1 MiB swap took several times a
    # warm one): a new group maps its rings in at once, so no call pays them
    for rss, ring_bytes in run_ranks(3, _resident_arena_bytes, env={"ACCORD_SHM_CMA": "0"}):
        assert rss is not None, "no shared-memory arena among this process's mappings"
        assert rss >= ring_bytes, (rss, ring_bytes)
