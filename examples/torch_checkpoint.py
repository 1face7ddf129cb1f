"""torch.distributed.checkpoint (DCP) save and load of a sharded model, on "accord".

    accord run -n 2 examples/torch_checkpoint.py
    torchrun --nproc-per-node 2 examples/torch_checkpoint.py
    accord run -n 2 examples/torch_checkpoint.py --backend gloo        # the same, on gloo
    accord run -n 2 examples/torch_checkpoint.py --dir /tmp/ckpt       # keep the files

A model sharded with FSDP2's `fully_shard` trains a few steps; DCP then saves
its sharded state dict (weights and Adam's state): each rank writes only its
own shards, and the ranks agree on one metadata file through the process
group's object collectives (gather_object, broadcast, scatter_object_list),
which run on accord. A fresh model with other weights loads the checkpoint,
and every rank checks that each loaded shard equals the one it saved, and
that one more step goes the same from either. Rank 0 prints

    result: loss=<last training loss, repr> params=<sha256 of the full weights>

which a run with `--backend gloo` must repeat (bit for bit at 2 ranks).
Without --dir, rank 0 makes a temporary directory, sends its name to the
others (broadcast_object_list) and removes it at the end. The directory must
be one every rank can read: one host here, or a shared file system.
"""
import argparse
import hashlib
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import accord.torch  # noqa: F401  registers "accord" (an installed accord needs no import)


def build(seed):
    torch.manual_seed(seed)                     # the same start on every rank
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    fully_shard(model)                          # parameters become DTensors, Shard(0)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def step(model, opt, x):
    opt.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    return loss.item()


def shards(model):
    """This rank's own pieces of the weights, as plain tensors."""
    return {k: v.to_local().detach().clone() for k, v in model.state_dict().items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="accord", choices=["accord", "gloo"])
    ap.add_argument("--dir", help="checkpoint directory (default: a temporary one)")
    args = ap.parse_args()

    dist.init_process_group(args.backend)      # env:// (set by accord run / torchrun)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)                    # several ranks on a small CPU

    # one directory for all ranks: rank 0 chooses it, the others learn its name
    where = [args.dir or (tempfile.mkdtemp(prefix="accord-dcp-") if rank == 0 else None)]
    dist.broadcast_object_list(where, src=0)
    path = where[0]

    model, opt = build(0)
    g = torch.Generator().manual_seed(rank)    # each rank its own data
    for _ in range(3):
        loss = step(model, opt, torch.randn(4, 6, generator=g))
    msd, osd = get_state_dict(model, opt)      # sharded: DTensors, no gathering
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)

    fresh, fresh_opt = build(1)                 # other weights, no optimizer state yet
    msd2, osd2 = get_state_dict(fresh, fresh_opt)
    state = {"model": msd2, "optim": osd2}
    dcp.load(state, checkpoint_id=path)         # fills the tensors of `state` in place
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])

    saved, loaded = shards(model), shards(fresh)
    ok = all(torch.equal(loaded[k], saved[k]) for k in saved)
    # the optimizer state came back too: one more step is the same from either copy
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(99 + rank))
    step(model, opt, x)
    step(fresh, fresh_opt, x)
    ok = ok and all(torch.equal(a, b) for a, b in zip(shards(model).values(),
                                                     shards(fresh).values()))
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # every rank's verdict

    full = {k: v.full_tensor() for k, v in fresh.state_dict().items()}   # collective
    if rank == 0:
        h = hashlib.sha256()
        for k in sorted(full):
            h.update(k.encode())
            h.update(full[k].numpy().tobytes())
        print(f"{world} ranks on {dist.get_backend()!r}: checkpoint in {path} "
              f"loaded back {'intact' if flag.item() else 'DIFFERENT'}", flush=True)
        print(f"result: loss={loss!r} params={h.hexdigest()[:16]}", flush=True)
    dist.barrier()                              # nobody reads the files any more
    if rank == 0 and not args.dir:
        shutil.rmtree(path)
    dist.destroy_process_group()
    if not flag.item():
        raise SystemExit(1)


if __name__ == "__main__":
    main()
