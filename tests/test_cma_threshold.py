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
        assert p2p == 16 * MiB, res             # point-to-point keeps its own default
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
