"""PyTorch DistributedDataParallel on the "accord" backend.

    accord run -n 4 examples/torch_ddp.py
    torchrun --nproc-per-node 4 examples/torch_ddp.py

The only accord-specific lines are `import accord.torch` and the backend
name: everything else is plain torch.distributed. Each rank trains on its
shard of a synthetic regression task (DistributedSampler); DDP averages the
gradients with accord's all_reduce. Rank 0 picks the hyper-parameters and
sends them with broadcast_object_list; at the end every rank checks that its
replica equals rank 0's.
"""
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import accord.torch  # noqa: F401  registers the backend "accord"


def main():
    dist.init_process_group("accord")          # env:// (set by accord run / torchrun)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)

    config = [{"lr": 0.05, "epochs": 5, "batch": 16}] if rank == 0 else [None]
    dist.broadcast_object_list(config, src=0)
    cfg = config[0]

    # y = x @ w_true + noise; every rank builds the same dataset, trains on its shard
    g = torch.Generator().manual_seed(0)
    w_true = torch.randn(8, 2, generator=g)
    x = torch.randn(512, 8, generator=g)
    y = x @ w_true + 0.01 * torch.randn(512, 2, generator=g)
    data = TensorDataset(x, y)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=1)
    loader = DataLoader(data, batch_size=cfg["batch"], sampler=sampler)

    torch.manual_seed(rank)                     # different starts: DDP syncs from rank 0
    model = DDP(nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)

    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        total = torch.zeros(2)                  # (sum of losses, batches)
        for xb, yb in loader:
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(xb), yb)
            loss.backward()
            opt.step()
            total += torch.tensor([loss.item(), 1.0])
        dist.all_reduce(total)
        if rank == 0:
            print(f"epoch {epoch}: mean loss {total[0] / total[1]:.5f}", flush=True)

    # every replica must equal rank 0's
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, src=0)
    same = torch.tensor([int(torch.equal(flat, ref))])
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    if rank == 0:
        print(f"{world} replicas identical: {bool(same.item())}", flush=True)
    dist.destroy_process_group()
    if not same.item():
        raise SystemExit(1)


if __name__ == "__main__":
    main()
