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
