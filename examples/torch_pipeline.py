"""Pipeline parallelism (torch.distributed.pipelining) on the "accord" backend, on CPU.

    accord run -n 2 examples/torch_pipeline.py
    torchrun --nproc-per-node 2 examples/torch_pipeline.py
    accord run -n 2 examples/torch_pipeline.py --backend gloo       # the same, on gloo
    accord run -n 2 examples/torch_pipeline.py --schedule 1F1B

A small model is cut into one stage per rank (2 stages with -n 2). Each
optimizer step splits the batch into 4 microbatches; the schedule runs them
through the stages (GPipe: every forward, then every backward; 1F1B: one
forward, one backward, interleaved, so fewer activations are held at once).
Activations go forward and their gradients backward between neighbouring
ranks with batch_isend_irecv, point to point on accord. The loss is computed
on the last stage, which sends it to rank 0; rank 0 prints

    result: loss=<final step's mean microbatch loss, repr> params=<sha256 of all stages>

which a run with `--backend gloo` must repeat bit for bit (a pipeline only
moves tensors between ranks: it adds up nothing across them).
"""
import argparse
import hashlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining as pp

import accord.torch  # noqa: F401  registers "accord" (an installed accord needs no import)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="accord", choices=["accord", "gloo"])
    ap.add_argument("--schedule", default="GPipe", choices=["GPipe", "1F1B"])
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()

    dist.init_process_group(args.backend)      # env:// (set by accord run / torchrun)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)                    # several ranks on a small CPU
    first, last = rank == 0, rank == world - 1

    # every rank builds the whole model from the same seed and keeps its own block:
    # the pipelined model then starts from the weights a single process would have
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(world)]
    mine = blocks[rank]
    stage = pp.PipelineStage(mine, rank, world, torch.device("cpu"))
    cls = {"GPipe": pp.ScheduleGPipe, "1F1B": pp.Schedule1F1B}[args.schedule]
    schedule = cls(stage, n_microbatches=4, loss_fn=nn.functional.mse_loss)
    opt = torch.optim.SGD(mine.parameters(), lr=0.1)

    for step in range(args.steps):
        # every rank makes the step's batch; the first stage feeds x, the last compares to y
        g = torch.Generator().manual_seed(10 + step)
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
        opt.zero_grad()
        losses = []
        if first:
            schedule.step(x, target=y if last else None, losses=losses if last else None)
        elif last:
            schedule.step(target=y, losses=losses)       # the loss is taken here
        else:
            schedule.step()
        opt.step()

    # the last stage holds the loss: rank 0 learns it by broadcast
    loss = torch.stack(losses).mean().detach() if last else torch.zeros(())
    dist.broadcast(loss, src=world - 1)
    # each rank hashes its own stage's weights; rank 0 combines them in stage order
    h = hashlib.sha256()
    for k, v in mine.state_dict().items():
        h.update(v.numpy().tobytes())
    digests = [None] * world
    dist.all_gather_object(digests, h.hexdigest())
    if first:
        whole = hashlib.sha256("".join(digests).encode()).hexdigest()[:16]
        print(f"{world} stages on {dist.get_backend()!r}, {args.schedule}, {args.steps} "
              f"steps of 4 microbatches", flush=True)
        print(f"result: loss={loss.item()!r} params={whole}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
