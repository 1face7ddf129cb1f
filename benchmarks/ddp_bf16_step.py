"""A DistributedDataParallel training step of a bfloat16 model, on accord or on gloo.

    accord run -n 2 benchmarks/ddp_bf16_step.py accord
    GLOO_SOCKET_IFNAME=lo accord run -n 2 benchmarks/ddp_bf16_step.py gloo

Eight 1024x1024 bfloat16 linear layers (16 MiB of gradients, one DDP bucket),
a batch of 16, SGD. Three warm-up steps, then 5 rounds of 5 steps (a barrier
before each round); rank 0 prints each round's ms per step, the median, and the
sum of the first two parameters after the last step (the same on every backend
that reduces alike: accord's bfloat16 sum rounds as torch's does).
"""
import sys
import time

import torch
import torch.distributed as dist
from torch import nn


def main():
    backend = sys.argv[1] if len(sys.argv) > 1 else "accord"
    if backend == "accord":
        import accord.torch  # noqa: F401  (registers the backend)
    dist.init_process_group(backend)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)]).to(torch.bfloat16)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    x = torch.randn(16, 1024, dtype=torch.bfloat16)

    def step():
        opt.zero_grad(set_to_none=False)
        ddp(x).float().square().mean().backward()
        opt.step()
    for _ in range(3):
        step()
    times = []
    for _ in range(5):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(5):
            step()
        times.append((time.perf_counter() - t0) / 5 * 1e3)
    check = [float(p.detach().float().sum()) for p in list(model.parameters())[:2]]
    if dist.get_rank() == 0:
        print(f"{backend}: ms/step {[round(t, 1) for t in times]} median "
              f"{sorted(times)[2]:.1f}; parameters {check}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
