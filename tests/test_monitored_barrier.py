"""accord.monitored_barrier: torch's meaning (gloo's), on accord groups and torch groups.

Rank 0 names the ranks that did not arrive within the timeout (the first, or
all of them with wait_all_ranks=True); the ranks that did arrive learn that
rank 0 failed; the group stays usable afterwards.
"""
import datetime
import time

import pytest

import accord
from harness import run_ranks, timed

pytestmark = pytest.mark.timeout(120)


def accord_ranks(rank, world):
    out = {}
    accord.monitored_barrier(timeout=5)                      # everyone: passes
    out["pass"] = True
    accord.monitored_barrier(timeout=datetime.timedelta(seconds=5), wait_all_ranks=True)
    # ranks 1 and 3 skip the next one: rank 0 names rank 1 (the first), rank 2 learns
    if rank in (0, 2):
        out["first"] = timed(lambda: accord.monitored_barrier(timeout=1.0))
    accord.barrier()
    if rank in (0, 2):
        out["all"] = timed(lambda: accord.monitored_barrier(timeout=1.0, wait_all_ranks=True))
    accord.barrier()
    if rank == 0:
        out["zero"] = timed(lambda: accord.monitored_barrier(timeout=0))
    accord.barrier()
    # a subgroup; a rank outside it returns at once
    sub = accord.new_group([0, 1])
    t0 = time.monotonic()
    accord.monitored_barrier(group=sub, timeout=5)
    out["sub_s"] = time.monotonic() - t0
    import numpy as np
    v = np.ones(2)
    accord.all_reduce(v)                                     # the group still works
    out["after"] = v.tolist()
    return out


def test_monitored_barrier_names_the_missing_ranks():
    res = run_ranks(4, accord_ranks, timeout=60)
    for r in res:
        assert r["pass"] is True and r["after"] == [4.0, 4.0]
    kind, msg, secs = res[0]["first"]
    assert kind == "CommTimeout" and "Rank 1 failed to pass monitoredBarrier in 1000 ms" in msg
    assert secs < 5
    kind, msg, _ = res[0]["all"]
    assert kind == "CommTimeout" and "Ranks 1, 3 failed to pass monitoredBarrier" in msg, msg
    kind, msg, _ = res[2]["first"]
    assert kind == "CommTimeout", msg
    assert ("Rank 2 successfully reached monitoredBarrier, but received errors while waiting "
            "for send/recv from rank 0") in msg
    assert "Rank 1 failed" in msg                           # what rank 0 said
    kind, msg, _ = res[0]["zero"]
    assert kind == "CommTimeout" and "Rank 0 timed out in monitoredBarrier" in msg, msg
    assert res[3]["sub_s"] < 1.0                            # not a member: no wait


def torch_ranks_program(rank, world, backend):
    import torch.distributed as dist
    import accord.torch as at
    out = {}
    at.monitored_barrier(timeout=datetime.timedelta(seconds=5))
    dist.group.WORLD.monitored_barrier(datetime.timedelta(seconds=5), wait_all_ranks=True)
    accord.monitored_barrier(timeout=5)                      # torch's default group
    if rank == 0:
        pg = dist.new_group([0, 1])
        out["late"] = timed(lambda: pg.monitored_barrier(datetime.timedelta(seconds=0.5)))
    else:
        dist.new_group([0, 1])
    dist.barrier()
    return out


def test_torch_groups_on_accord():
    from torch_ranks import run_torch
    res = run_torch(3, torch_ranks_program, timeout=60)
    kind, msg, _ = res[0]["accord"]["late"]
    assert kind == "CommTimeout" and "Rank 1 failed to pass monitoredBarrier in 500 ms" in msg
