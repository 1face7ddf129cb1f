"""FSDP (fully sharded data parallel) training on the "accord" backend, on CPU.

    accord run -n 2 examples/torch_fsdp.py
    torchrun --nproc-per-node 2 examples/torch_fsdp.py
    accord run -n 2 examples/torch_fsdp.py --backend gloo     # the same, on gloo
    accord run -n 2 examples/torch_fsdp.py --fsdp1            # FullyShardedDataParallel

FSDP2's `fully_shard` splits every parameter across the ranks: each forward
all-gathers a layer's shards, each backward reduce-scatters its gradients,
and the optimizer only ever sees this rank's shard. Every rank trains on its
own batches, so the gradients really are combined across ranks. At the end
the full state dict is gathered on rank 0 (with --fsdp1, on every rank: see
below), and rank 0 prints one line:

    result: loss=<rank-averaged final loss, repr> params=<sha256 of the weights>

The line is deterministic, so a run with `--backend gloo` must print the
same one (bit for bit at 2 ranks: a sum of two floats does not depend on the
order it is taken in).
"""
import argparse
import hashlib

import torch
import torch.distributed as dist
from torch import nn

import accord.torch  # noqa: F401  registers "accord" (an installed accord needs no import)


def checksum(state):
    """sha256 of the tensors' bytes, in key order: equal only if bitwise equal."""
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode())
        h.update(state[k].detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def build():
    # the same start on every rank: FSDP keeps each rank's slice of these weights,
    # it does not broadcast rank 0's
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 4))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="accord", choices=["accord", "gloo"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--fsdp1", action="store_true",
                    help="wrap with FullyShardedDataParallel (FSDP1) instead of fully_shard")
    args = ap.parse_args()

    dist.init_process_group(args.backend)      # env:// (set by accord run / torchrun)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)                    # 2 ranks on a small CPU: no oversubscription

    model = build()
    if args.fsdp1:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        model = FSDP(model, device_id=torch.device("cpu"))
    else:
        from torch.distributed.fsdp import fully_shard
        for layer in model:                     # one all-gather per Linear, as in real models
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)                      # the root: whatever is left (nothing here)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)

    g = torch.Generator().manual_seed(50 + rank)   # each rank its own data
    for step in range(args.steps):
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()

    # the mean loss over ranks (SUM then divide: gloo has no ReduceOp.AVG)
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    mean = mean.item() / world

    # the full (unsharded) state dict; get_model_state_dict serves FSDP1 and FSDP2 alike.
    # cpu_offload=True gathers it on rank 0 only (the other ranks get {}). FSDP1 cannot do
    # that with parameters already on the CPU (torch 2.13, on gloo as on accord: "setStorage:
    # ... out of bounds for storage of size 0"), so there every rank gathers it
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=not args.fsdp1))
    if rank == 0:
        assert set(full) == set(build().state_dict()), sorted(full)
        print(f"{world} ranks on {dist.get_backend()!r}, {args.steps} steps of "
              f"{'FSDP1' if args.fsdp1 else 'fully_shard'}", flush=True)
        print(f"result: loss={mean!r} params={checksum(full)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
