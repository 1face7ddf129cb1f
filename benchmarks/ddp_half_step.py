"""A DistributedDataParallel training step that all-reduces 16-bit gradients, on accord
or on gloo.

    accord run -n 2 benchmarks/ddp_half_step.py accord [bf16|fp16-hook|fp32]
    GLOO_SOCKET_IFNAME=lo accord run -n 2 benchmarks/ddp_half_step.py gloo [bf16|fp16-hook|fp32]

Eight 1024x1024 linear layers, a batch of 16, SGD. bf16 (the default): a
bfloat16 model (16 MiB of bfloat16 gradients, one DDP bucket). fp16-hook: a
float32 model whose gradients DDP compresses to float16 before reducing them
(torch's fp16_compress_hook: 32 MiB of float32 gradients, 16 MiB reduced as
float16, in buckets of 25 MiB). fp32, for scale: the float32 model reducing float32
gradients. Three warm-up steps, then 5 rounds of 5 steps (a
barrier before each round); rank 0 prints each round's ms per step, the median,
and the sum of the first two parameters after the last step (the same on every
backend that reduces alike: accord's 16-bit sums round as torch's do).
"""
import sys
import time

import torch
import torch.distributed as dist
from torch import nn


def main():
    backend = sys.argv[1] if len(sys.argv) > 1 else "accord"
    mode = sys.argv[2] if len(sys.argv) > 2 else "bf16"
    if mode not in ("bf16", "fp16-hook", "fp32"):
        sys.exit(f"mode: bf16, fp16-hook or fp32, not {mode!r}")
    if backend == "accord":
        import accord.torch  # noqa: F401  (registers the backend)
    dist.init_process_group(backend)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)]).to(dtype)
    ddp = nn.parallel.DistributedDataParallel(model)
    if mode == "fp16-hook":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    x = torch.randn(16, 1024, dtype=dtype)

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
        print(f"{backend} {mode}: ms/step {[round(t, 1) for t in times]} median "
              f"{sorted(times)[2]:.1f}; parameters {check}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
