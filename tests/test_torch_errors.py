"""Failures reach torch.distributed callers as accord's own error types.

A peer that dies, a peer that is late, and ranks that disagree: the caller of
dist.all_reduce (synchronous), of Work.wait() and of get_future().wait()
(asynchronous) gets PeerLost, CommTimeout or Desync, message intact.
"""
import datetime
import os
import re
import time

import pytest

torch = pytest.importorskip("torch")
import torch._dynamo  # noqa: E402,F401  (DDP imports it lazily: once here, not per rank)
import torch.distributed as dist  # noqa: E402

import accord  # noqa: E402
from torch_ranks import run_torch  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _catch(fn):
    try:
        fn()
    except Exception as e:
        return type(e).__name__, str(e), isinstance(e, accord.AccordError)
    return None


def peer_dies(rank, world, backend, mode):
    dist.barrier()
    if rank == 1:
        os._exit(3)
    t = torch.ones(4)
    if mode == "sync":
        return _catch(lambda: dist.all_reduce(t))
    if mode == "funcol":            # torch's C++ layer calls the group, then waits
        import torch.distributed._functional_collectives as funcol
        return _catch(lambda: funcol.wait_tensor(funcol.all_reduce(t, "sum", dist.group.WORLD)))
    if mode == "ddp":               # DDP's constructor checks parameters with allgather (C++)
        from torch.nn.parallel import DistributedDataParallel as DDP
        return _catch(lambda: DDP(torch.nn.Linear(2, 2)))
    w = dist.all_reduce(t, async_op=True)
    fut = w.get_future()
    err = _catch(lambda: w.wait())
    return [err, _catch(lambda: fut.wait()), w.is_completed(), w.is_success()]


@pytest.mark.parametrize("mode", ["sync", "async", "funcol", "ddp"])
def test_peer_lost(mode):
    res = run_torch(2, peer_dies, mode, timeout=30, expect_fail=True)
    assert res[1][0] == "died"
    kind, out = res[0]
    assert kind == "ok", out
    got = out["accord"]
    if mode != "async":
        name, msg, is_accord = got
        assert name == "PeerLost" and is_accord, got
        assert "rank 1" in msg, msg
    else:
        (name, msg, is_accord), fut_err, completed, success = got
        assert name == "PeerLost" and is_accord and "rank 1" in msg, got
        assert fut_err[0] == "PeerLost" and fut_err[1] == msg
        assert completed is True and success is False


def late_peer(rank, world, backend):
    t = torch.ones(4)
    if rank == 1:
        time.sleep(3)
    return _catch(lambda: dist.all_reduce(t))


def test_comm_timeout():
    res = run_torch(2, late_peer, timeout=30, pg_timeout=1.5)
    name, msg, is_accord = res[0]["accord"]
    assert name == "CommTimeout" and is_accord, res[0]
    assert "Timed out" in msg and "rank 1" in msg, msg
    # the words torch's own tests look for in a timeout, and accord's stuck-rank table
    assert re.search(" (Timed out|closed|timeout) ", msg), msg
    assert "where each rank of group" in msg, msg
    # the late rank does not hang: it either finds rank 0's data already sent or
    # learns that the group broke
    assert res[1]["accord"] is None or res[1]["accord"][2], res[1]


def late_peer_async(rank, world, backend):
    t = torch.ones(4)
    if rank == 1:
        time.sleep(3)
        return None
    w = dist.all_reduce(t, async_op=True)
    short = _catch(lambda: w.wait(timeout=datetime.timedelta(seconds=0.2)))
    whole = _catch(lambda: w.wait())          # the operation's own deadline (1.5 s)
    return short, whole, _catch(lambda: w.get_future().wait())


def test_async_timeout_surfaces_as_comm_timeout():
    res = run_torch(2, late_peer_async, timeout=30, pg_timeout=1.5)
    short, whole, fut = res[0]["accord"]
    # a wait shorter than the operation: torch's own words, the operation keeps running
    assert short[0] == "CommTimeout" and short[2], short
    assert "Timed out after 0.2 s" in short[1], short
    # the operation's own timeout, raised inside the Work, comes out as itself
    assert whole[0] == "CommTimeout" and whole[2], whole
    assert "Timed out" in whole[1] and "rank 1" in whole[1], whole
    assert fut[0] == "CommTimeout" and fut[1] == whole[1], fut


def desync(rank, world, backend):
    t = torch.ones(4 + rank)              # ranks disagree about the size
    return _catch(lambda: dist.all_reduce(t))


def test_desync():
    res = run_torch(2, desync, timeout=30)
    errs = [r["accord"] for r in res]
    assert all(e is not None and e[2] for e in errs), errs
    assert any(e[0] == "Desync" for e in errs), errs
    d = next(e for e in errs if e[0] == "Desync")
    assert "all_reduce" in d[1], d


def cross_groups(rank, world, backend):
    g = dist.new_group([0, 1])
    t = torch.ones(4)
    if rank == 0:        # each rank makes the other's call first: no message ever crosses
        return _catch(lambda: (dist.all_reduce(t, group=g), dist.all_reduce(t)))
    return _catch(lambda: (dist.all_reduce(t), dist.all_reduce(t, group=g)))


def test_ranks_blocked_in_different_groups_get_desync_not_a_hang():
    # the groups' timeout is 60 s: a hang would end in CommTimeout there, the deadlock
    # is named as a Desync before it (in seconds; the ranks get 90 s, so a slow
    # detection on a loaded machine shows as the wrong error, not as this test's timeout)
    res = run_torch(2, cross_groups, timeout=90, pg_timeout=60)
    for r in res:
        name, msg, ours = r["accord"]
        assert name == "Desync" and ours, msg
        assert "deadlock" in msg and "rank 0 waits in all_reduce" in msg, msg
        assert "rank 1 waits in all_reduce" in msg, msg


def bad_args(rank, world, backend):
    out = {}
    out["avg_int"] = _catch(lambda: dist.all_reduce(torch.ones(2, dtype=torch.int32),
                                                    op=dist.ReduceOp.AVG))
    dist.barrier()
    t = torch.ones(2)
    dist.all_reduce(t)                    # argument errors do not break the group
    out["after"] = t.tolist()
    return out


def test_argument_errors_leave_group_usable():
    res = run_torch(2, bad_args, timeout=30)
    for r in res:
        a = r["accord"]
        assert a["avg_int"][0] == "TypeError" and "AVG" in a["avg_int"][1]
        assert a["after"] == [2.0, 2.0]
