"""accord.torch.shrink: a torch program on backend "accord" goes on without a dead rank."""
import os
import signal
import time

import pytest

torch = pytest.importorskip("torch")

from torch_ranks import run_torch  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def _survive(rank, world, backend):
    import accord
    import accord.torch
    import torch.distributed as dist
    t = torch.ones(1024)
    dist.barrier()
    if rank == 1:
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)
    try:
        dist.all_reduce(t)
        first = "ok"
    except (accord.PeerLost, accord.GroupClosed) as e:
        first = type(e).__name__
    accord.torch.shrink(timeout=20)
    y = torch.full((5,), float(rank + 1))
    dist.all_reduce(y)
    z = torch.tensor([float(rank)])
    dist.broadcast(z, src=0)
    return first, dist.get_rank(), dist.get_world_size(), y.tolist(), z.item()


def test_torch_default_group_shrinks_to_the_survivors():
    out = run_torch(3, _survive, timeout=40, expect_fail=True)
    assert out[1][0] == "died", out[1]
    for old, new in ((0, 0), (2, 1)):
        kind, payload = out[old]
        assert kind == "ok", payload
        first, rank, size, y, z = payload["accord"]
        assert first in ("PeerLost", "GroupClosed")
        assert (rank, size, y, z) == (new, 2, [4.0] * 5, 0.0)
