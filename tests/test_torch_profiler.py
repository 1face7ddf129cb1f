"""torch's profiler shows one event per call on backend "accord", as it does for gloo.

Each call appears as an asynchronous event "accord:<op>" (gloo: "gloo:<op>")
carrying its input shapes, whether it came from torch's Python functions, an
async_op Work or DDP's C++ reducer.
"""
import time

import pytest

torch = pytest.importorskip("torch")
import torch._dynamo  # noqa: E402,F401  (DDP imports it lazily: once here, not per rank)
import torch.distributed as dist  # noqa: E402

from torch_ranks import run_torch  # noqa: E402

pytestmark = pytest.mark.timeout(120)

# gloo's name for a call where it differs from accord's (torch's op name)
GLOO_NAMES = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter"}


def profiled(rank, world, backend):
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = DDP(torch.nn.Linear(4, 2))
    with torch.autograd.profiler.profile(record_shapes=True) as prof:
        t = torch.ones(10)
        dist.all_reduce(t)
        dist.broadcast(t, src=0)
        dist.all_reduce(torch.ones(3, 2), async_op=True).wait()
        dist.all_gather_into_tensor(torch.empty(2 * world), torch.ones(2))
        dist.all_gather([torch.empty(3) for _ in range(world)], torch.ones(3))
        dist.reduce(torch.ones(5), dst=0)
        if rank == 0:
            dist.send(torch.ones(3), 1)
            time.sleep(0.05)            # rank 1 waits for this one: its own thread takes it
            dist.send(torch.ones(3), 1)
        elif rank == 1:
            dist.recv(torch.ones(3), 0)
            dist.recv(torch.ones(3), 0)
        dist.barrier()
        model(torch.ones(2, 4)).sum().backward()        # one all_reduce from C++
    ours = [e for e in prof.function_events if e.name.startswith(backend + ":")]
    return [(e.name.split(":", 1)[1], e.is_async, e.count, e.input_shapes) for e in ours]


def test_profiler_events_like_gloo():
    for rank, d in enumerate(run_torch(2, profiled, backends=("gloo", "accord"), timeout=60)):
        acc = [(GLOO_NAMES.get(n, n), a, c, s) for n, a, c, s in d["accord"]]
        assert sorted(map(str, acc)) == sorted(map(str, d["gloo"])), (rank, acc, d["gloo"])
        names = [e[0] for e in d["accord"]]
        assert names.count("all_reduce") == 3 and "all_gather_into_tensor" in names
        assert names.count("send" if rank == 0 else "recv") == 2
        assert all(is_async and count == 1 for _, is_async, count, _ in d["accord"])
