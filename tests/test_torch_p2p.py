"""torch.distributed's point-to-point on backend "accord", beside gloo: batch_isend_irecv
with the receives listed first, rings of isend/irecv, tags."""
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from torch_ranks import run_torch  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _batch_ring(rank, world, backend):
    right, left = (rank + 1) % world, (rank - 1) % world
    got_l = torch.zeros(6)
    got_r = torch.zeros(6, dtype=torch.int64)
    ops = [dist.P2POp(dist.irecv, got_l, left, tag=3),
           dist.P2POp(dist.irecv, got_r, right, tag=4),
           dist.P2POp(dist.isend, torch.arange(6.0) + rank, right, tag=3),
           dist.P2POp(dist.isend, torch.arange(6) * rank, left, tag=4)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    # the MPI pattern through torch's own isend/irecv: every receive posted first
    peers = [p for p in range(world) if p != rank]
    bufs = {p: torch.zeros(1000) for p in peers}
    works = [dist.irecv(bufs[p], src=p) for p in peers]
    works += [dist.isend(torch.full((1000,), float(rank * 10 + p)), dst=p) for p in peers]
    for w in works:
        w.wait()
    return got_l.tolist(), got_r.tolist(), {p: bufs[p][:3].tolist() for p in peers}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_batch_isend_irecv_matches_gloo(world):
    out = run_torch(world, _batch_ring, backends=("gloo", "accord"), timeout=60)
    for rank, res in enumerate(out):
        assert res["accord"] == res["gloo"], (rank, res)
        left = (rank - 1) % world
        assert res["accord"][0] == [float(i + left) for i in range(6)]


def _ping_pong(rank, world, backend, rounds):
    # blocking send/recv through torch: the receiving rank waits on accord's Work from
    # torch's C++ side, which moves no messages itself; the engine thread must take
    # the reply at once (it used to sleep through it for up to 250 ms a message)
    m = torch.zeros(2)
    for i in range(rounds):
        if rank == 0:
            dist.send(torch.full((2,), float(i)), 1)
            dist.recv(m, 1)
        else:
            dist.recv(m, 0)
            dist.send(m * 2, 0)
    return m.tolist()


@pytest.mark.timeout(60)
def test_a_ping_pong_through_torch_does_not_stall():
    # 600 messages: at the stall's 128 ms a message on average, 77 s, past the deadline
    out = run_torch(2, _ping_pong, 300, backends=("gloo", "accord"), timeout=40)
    assert out[0]["accord"] == out[0]["gloo"] == [2.0 * 299] * 2


def _as_called(rank, world, backend):
    # what accord's flight recorder (and so a stuck-rank report) says each torch call
    # was: torch's blocking send/recv as accord's blocking ones, made on this thread,
    # its isend/irecv as themselves; and a small isend is over when it returns
    g = dist.distributed_c10d._get_default_group().accord_group
    peer = 1 - rank
    m = torch.zeros(3)
    if rank == 0:
        dist.send(torch.arange(3.0), peer)
        w = dist.isend(torch.arange(3.0) + 10, peer)
        at_once = w.is_completed()
        w.wait()
        src = dist.recv(m)              # from any rank
    else:
        dist.recv(m, peer)
        first = m.tolist()
        dist.irecv(m, peer).wait()
        at_once = [first, m.tolist()]
        dist.send(torch.full((3,), 7.0), peer)
        src = None
    ops = [e["op"] for e in g.recorder.as_dicts() if e["op"] in ("send", "recv", "isend",
                                                                   "irecv")]
    return ops, at_once, src, m.tolist()


def test_torch_send_and_recv_run_as_accords_blocking_calls():
    out = run_torch(2, _as_called)
    assert out[0]["accord"] == (["send", "isend", "recv"], True, 1, [7.0] * 3)
    assert out[1]["accord"] == (["recv", "irecv", "send"],
                                [[0.0, 1.0, 2.0], [10.0, 11.0, 12.0]], None, [10.0, 11.0, 12.0])
