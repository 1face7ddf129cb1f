"""A pipeline-parallel training step (torch.distributed.pipelining) on a backend: the
client whose activations and gradients cross ranks point to point.

    accord run -n 2 benchmarks/bench_pipeline.py accord      # or gloo; --schedule GPipe

One stage a rank, each a small MLP block (Linear 64x64 + Tanh, so the step is mostly
communication and scheduling), 16 microbatches of 8 rows a step: each microbatch's
activation goes forward and its gradient back across every stage boundary,
through batch_isend_irecv and wait(). Rank 0 prints the best of 5 rounds of 20
steps (ms a step), after 3 warm-up steps, with the load average.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn

import accord.torch  # noqa: F401  (registers the backend "accord")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("backend", nargs="?", default="accord")
    ap.add_argument("--schedule", default="1F1B", choices=["GPipe", "1F1B"])
    ap.add_argument("--microbatches", type=int, default=16)
    ap.add_argument("--width", type=int, default=64)
    args = ap.parse_args()
    from torch.distributed import pipelining as pp

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    block = nn.Sequential(nn.Linear(args.width, args.width), nn.Tanh())
    stage = pp.PipelineStage(block, rank, world, torch.device("cpu"))
    cls = {"GPipe": pp.ScheduleGPipe, "1F1B": pp.Schedule1F1B}[args.schedule]
    sched = cls(stage, n_microbatches=args.microbatches, loss_fn=nn.functional.mse_loss)
    opt = torch.optim.SGD(block.parameters(), lr=0.01)
    rows = 8 * args.microbatches
    x, y = torch.randn(rows, args.width), torch.randn(rows, args.width)

    def step():
        opt.zero_grad()
        if rank == 0:
            sched.step(x)
        elif rank == world - 1:
            sched.step(target=y, losses=[])
        else:
            sched.step()
        opt.step()

    for _ in range(3):
        step()
    best = float("inf")
    for _ in range(5):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(20):
            step()
        dist.barrier()
        best = min(best, (time.perf_counter() - t0) / 20 * 1e3)
    if rank == 0:
        load = " ".join(f"{v:.2f}" for v in os.getloadavg())
        print(f"{args.backend}: {args.schedule}, {world} stages, {args.microbatches} "
              f"microbatches: {best:.2f} ms a step (load {load})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
