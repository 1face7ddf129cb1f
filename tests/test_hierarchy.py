"""Groups spanning hosts with several ranks on one: per-host shared memory plus leaders
over TCP (accord/hierarchy.py). Hosts are simulated with ACCORD_HOST_ID."""
import os
import signal
import time

import numpy as np
import pytest

import accord as dist
from harness import run_ranks

pytestmark = pytest.mark.timeout(120)

LAYOUTS = [["a", "a", "b", "b"], ["a", "a", "a", "b"], ["a", "b", "a", "b"],
           ["a", "b", "c", "a", "c"]]


def _init(rank, layout):
    os.environ["ACCORD_HOST_ID"] = layout[rank]
    dist.init_process_group()
    return dist.world.default_group()


def _shape(rank, world, layout):
    g = _init(rank, layout)
    h = g.hier
    try:
        return (type(g.transport).__name__, type(h.local.transport).__name__
                if h.local.size > 1 else None,
                h.local.ranks, h.leaders.ranks if h.leaders is not None else None)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("layout", LAYOUTS, ids="".join)
def test_subgroups_follow_the_hosts(layout):
    out = run_ranks(len(layout), _shape, layout, init=False, timeout=60)
    leaders = [layout.index(h) for h in dict.fromkeys(layout)]
    for rank, (outer, local_kind, local_ranks, lead) in enumerate(out):
        assert outer == "TcpTransport"
        assert local_ranks == [r for r in range(len(layout)) if layout[r] == layout[rank]]
        assert local_kind == ("ShmTransport" if len(local_ranks) > 1 else None)
        assert lead == (leaders if rank in leaders else None)


def _collectives(rank, world, layout):
    g = _init(rank, layout)
    calls = []
    real = dist.plans.run

    def spy(group, opname, *a, **k):
        calls.append(f"{opname} on {group.name}")
        return real(group, opname, *a, **k)
    dist.plans.run = spy
    try:
        # below MIN_BYTES flat, above in phases; a size on either side of each threshold
        for n in (0, 7, 4095, 4097, 65535, 65537, 300_001, (4 << 20) // 4 + 3):
            for root in range(world):
                want = (np.arange(n) * (root + 1) % 1013).astype(np.float32)
                x = want.copy() if rank == root else np.zeros(n, np.float32)
                dist.broadcast(x, src=root)
                assert np.array_equal(x, want), (n, root)
            for dtype in (np.int64, np.float64, np.float16):
                x = (np.arange(n) % 5 + rank).astype(dtype)
                dist.all_reduce(x)
                want = sum((np.arange(n) % 5 + r).astype(np.float64) for r in range(world))
                assert np.array_equal(x, want.astype(dtype)), (n, dtype)
            out = np.zeros(n * world, np.int32)
            dist.all_gather_into_tensor(out, (np.arange(n) * (rank + 1)).astype(np.int32))
            want = np.concatenate([np.arange(n) * (r + 1) for r in range(world)])
            assert np.array_equal(out, want.astype(np.int32)), n
            # uneven blocks, one tensor per rank
            outs = [np.zeros(n + 1000 * r, np.float64) for r in range(world)]
            dist.all_gather(outs, np.full(n + 1000 * rank, float(rank)))
            assert all((o == r).all() for r, o in enumerate(outs)), n
            inp = np.concatenate([np.arange(n) + 10 * r + rank for r in range(world)])
            res = np.zeros(n, np.int64)
            dist.reduce_scatter_tensor(res, inp.astype(np.int64))
            want = sum(np.arange(n) + 10 * rank + q for q in range(world))
            assert np.array_equal(res, want), n
            avg = np.zeros(n)
            dist.reduce_scatter_tensor(avg, np.full(n * world, float(rank)),
                                       op=dist.ReduceOp.AVG)
            assert np.allclose(avg, (world - 1) / 2), n
            ins = [np.full(n + 1000 * r, float(rank + r)) for r in range(world)]
            res = np.zeros(n + 1000 * rank)
            dist.reduce_scatter(res, ins)                  # uneven blocks
            assert (res == sum(q + rank for q in range(world))).all(), n
            x = np.full(n, float(rank))
            dist.all_reduce(x, op=dist.ReduceOp.MAX)
            assert (x == world - 1).all()
            x = np.full(n, float(rank))
            dist.all_reduce(x, op=dist.ReduceOp.AVG)
            assert np.allclose(x, (world - 1) / 2)
        strided = np.zeros((600, 400))[:, ::2]      # a non-contiguous tensor, over 256 KiB
        if rank == 1:
            strided[:] = 5
        dist.broadcast(strided, src=1)
        assert (strided == 5).all()
        dist.barrier()
        try:
            import torch
        except ImportError:
            torch = None
        if torch is not None:          # bfloat16 travels as int16 bits: reduced as bf16
            torch.set_num_threads(1)
            t = torch.full((1 << 14,), float(rank + 1), dtype=torch.bfloat16)
            dist.all_reduce(t, op=dist.ReduceOp.AVG)
            assert (t.float() == (world + 1) / 2).all(), t[:4]
            per = (1 << 19) // world + 1                     # an input of 1 MiB or more
            inp = torch.full((per * world,), float(rank + 1), dtype=torch.bfloat16)
            res = torch.zeros(per, dtype=torch.bfloat16)
            dist.reduce_scatter_tensor(res, inp, op=dist.ReduceOp.AVG)
            assert (res.float() == (world + 1) / 2).all(), res[:4]
        # the flat collectives keep working on the same group
        out = [np.zeros(3) for _ in range(world)]
        dist.all_gather(out, np.full(3, float(rank)))
        assert [o[0] for o in out] == list(range(world))
    finally:
        dist.plans.run = real
        dist.destroy_process_group()
    return sorted(set(calls))


@pytest.mark.parametrize("layout", LAYOUTS, ids="".join)
def test_collectives_run_in_phases_and_agree(layout):
    out = run_ranks(len(layout), _collectives, layout, init=False, timeout=110)
    for rank, calls in enumerate(out):
        host = layout[rank]
        local = f"default/host{list(dict.fromkeys(layout)).index(host)}"
        for phase in ("broadcast", "reduce", "gather", "scatter"):
            assert f"{phase} on {local}" in calls or layout.count(host) == 1, calls
        if rank == layout.index(host):
            for phase in ("broadcast", "all_reduce", "all_gather", "reduce_scatter"):
                assert f"{phase} on default/leaders" in calls, calls


def _killed(rank, world, layout):
    _init(rank, layout)
    x = np.ones(1 << 17)
    dist.barrier()
    if rank == 1:
        import threading
        threading.Timer(0.05, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
        while True:
            dist.all_reduce(x)
    t0 = time.monotonic()
    try:
        for _ in range(1000):
            dist.all_reduce(x)
    except dist.AccordError as e:
        return type(e).__name__, str(e), time.monotonic() - t0
    return "ok", "", 0.0


def test_a_dead_rank_is_named_in_every_phase():
    layout = ["a", "a", "b", "b"]
    out = run_ranks(4, _killed, layout, init=False, timeout=60, expect_fail=True)
    assert out[1][0] == "died"
    for rank in (0, 2, 3):
        kind, (name, msg, took) = out[rank]
        assert kind == "ok" and name == "PeerLost", out[rank]
        assert "rank 1" in msg or "rank 0" in msg, msg
        assert took < 10


def _roots_differ(rank, world, layout):
    _init(rank, layout)
    x = np.zeros(4)
    t0 = time.monotonic()
    try:
        dist.broadcast(x, src=0 if rank < 3 else 3)
        dist.barrier()
    except dist.AccordError as e:
        return type(e).__name__, str(e), time.monotonic() - t0
    return "ok", "", 0.0


def test_different_roots_are_a_desync():
    out = run_ranks(4, _roots_differ, ["a", "a", "b", "b"], init=False, timeout=60,
                    expect_fail=True)
    names = [payload[0] for kind, payload in out]
    assert "Desync" in names, out
    for kind, (name, msg, took) in out:
        assert name in ("Desync", "PeerLost", "GroupClosed"), msg
        assert took < 10


# -- through torch.distributed (backend "accord") ------------------------------------------

def _torch_hier(rank, world, backend):
    import torch
    import torch.distributed as tdist
    # groups made from here on see two hosts of two ranks
    os.environ["ACCORD_HOST_ID"] = "ab"[rank // 2]
    g = tdist.new_group(list(range(world)))
    hier = g.accord_group.hier is not None if hasattr(g, "accord_group") else None
    t = torch.full((1 << 18,), float(rank + 1))
    tdist.all_reduce(t, group=g)
    out = torch.zeros(world * (1 << 18))
    tdist.all_gather_into_tensor(out, torch.full((1 << 18,), float(rank)), group=g)
    b = torch.arange(1 << 17, dtype=torch.float64) if rank == 3 else torch.zeros(1 << 17,
                                                                                dtype=torch.float64)
    tdist.broadcast(b, src=3, group=g)
    return (hier, float(t[0]), bool((t == t[0]).all()),
            [float(out[r << 18]) for r in range(world)], bool((b == torch.arange(1 << 17)).all()))


def test_torch_groups_spanning_hosts_are_hierarchical():
    torch_ranks = pytest.importorskip("torch_ranks")
    for r in torch_ranks.run_torch(4, _torch_hier, timeout=90):
        hier, first, same, gathered, bcast = r["accord"]
        assert hier is True
        assert first == 10.0 and same
        assert gathered == [0.0, 1.0, 2.0, 3.0] and bcast
