"""DTensor on CPU device meshes, on the "accord" backend.

    accord run -n 2 examples/torch_dtensor.py
    torchrun --nproc-per-node 2 examples/torch_dtensor.py
    accord run -n 2 examples/torch_dtensor.py --backend gloo     # the same, on gloo
    accord run -n 4 examples/torch_dtensor.py                    # adds a 2x2 mesh

A DTensor is one logical tensor laid out over a device mesh: each rank holds
a shard (`Shard(dim)`), a full copy (`Replicate()`) or a summand
(`Partial()`). `redistribute` changes the layout with the mesh group's
collectives (all_gather, reduce_scatter, all_reduce, ...), which torch
issues from C++ as functional collectives; here they run on accord.

Every rank builds the same x and w (same seed) so that the distributed
results can be checked against a one-process `x @ w`. Rank 0 prints

    result: <sum of the checked results, repr> sha=<sha256 of their bytes>

which a run with `--backend gloo` must repeat (bit for bit at 2 ranks).
"""
import argparse
import hashlib

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import accord.torch  # noqa: F401  registers "accord" (an installed accord needs no import)


def one_d(world, rank):
    mesh = init_device_mesh("cpu", (world,))   # every rank, one dimension
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6 * world, 5, generator=g)
    w = torch.randn(5, 4 * world, generator=g)
    out = []

    # rows of x sharded; back to a full copy (all_gather), then sharded by columns (an
    # all_to_all on GPUs; on CPU torch uses all_gather + chunk, and logs a warning saying so)
    xs = distribute_tensor(x, mesh, [Shard(0)])
    assert torch.equal(xs.redistribute(mesh, [Replicate()]).to_local(), x)
    out.append(xs.redistribute(mesh, [Shard(1)]).full_tensor())

    # column-parallel matmul: a full x times w's column shards; each rank owns its columns
    y = distribute_tensor(x, mesh, [Replicate()]) @ distribute_tensor(w, mesh, [Shard(1)])
    assert y.placements == (Shard(1),)
    out.append(y.full_tensor())

    # row-parallel matmul: x's columns times w's rows leave partial sums on every rank,
    # which the redistribute to Replicate adds up (an all_reduce)
    p = distribute_tensor(x, mesh, [Shard(1)]) @ distribute_tensor(w, mesh, [Shard(0)])
    assert isinstance(p.placements[0], Partial), p.placements
    out.append(p.redistribute(mesh, [Replicate()]).to_local())

    # a Partial made by hand: each rank contributes rank + 1
    part = DTensor.from_local(torch.full((3,), float(rank + 1)), mesh, [Partial()])
    out.append(part.full_tensor())
    assert torch.equal(out[-1], torch.full((3,), world * (world + 1) / 2))

    ref = x @ w                                  # the one-process answer
    torch.testing.assert_close(out[1], ref)
    torch.testing.assert_close(out[2], ref, rtol=1e-5, atol=1e-5)   # other summation order
    return out


def two_d(rank):
    # 4 ranks as 2x2: "dp" (rows of the mesh) by "tp" (columns); rank = 2 * dp + tp
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    g = torch.Generator().manual_seed(5)
    x = torch.randn(8, 6, generator=g)
    w = torch.randn(6, 8, generator=g)
    # x's rows split over dp (data parallel), w's columns over tp (tensor parallel)
    y = (distribute_tensor(x, mesh, [Shard(0), Replicate()])
         @ distribute_tensor(w, mesh, [Replicate(), Shard(1)]))
    assert y.placements == (Shard(0), Shard(1))   # each rank one block of x @ w
    full = y.full_tensor()
    torch.testing.assert_close(full, x @ w)
    # a submesh is a plain process group too: sum the ranks of this rank's tp row
    t = torch.full((2,), float(rank))
    dist.all_reduce(t, group=mesh["tp"].get_group())
    base = 2 * (rank // 2)
    assert torch.equal(t, torch.full((2,), float(2 * base + 1)))
    return [full, t]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="accord", choices=["accord", "gloo"])
    args = ap.parse_args()

    dist.init_process_group(args.backend)      # env:// (set by accord run / torchrun)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)                    # several ranks on a small CPU

    results = one_d(world, rank)
    meshes = f"1-D mesh of {world}"
    if world == 4:
        results += two_d(rank)
        meshes += " and a 2x2 mesh"

    # every rank checked its own results above; rank 0 sums and hashes what it holds
    h = hashlib.sha256()
    for t in results:
        h.update(t.contiguous().numpy().tobytes())
    total = sum(t.double().sum().item() for t in results)
    if rank == 0:
        print(f"{meshes} on {dist.get_backend()!r}: every result matches x @ w", flush=True)
        print(f"result: {total!r} sha={h.hexdigest()[:16]}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
