"""DTensor on CPU device meshes and torch.distributed.checkpoint, on "accord" as on "gloo".

DTensor's collectives come from torch's C++ layer (functional collectives on
the mesh's groups), checkpoint's from its planners (gather_object,
all_gather_object, broadcast and scatter_object_list). Each program runs on
both backends in the same processes; values are compared bitwise where the
arithmetic is exact and within float32 rounding otherwise.
"""
import pytest

torch = pytest.importorskip("torch")
import torch._dynamo  # noqa: E402,F401  (DTensor imports it lazily: once here, not per rank)
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint  # noqa: E402,F401
import torch.distributed.fsdp  # noqa: E402,F401
import torch.distributed.tensor  # noqa: E402,F401

from torch_ranks import run_torch  # noqa: E402

pytestmark = pytest.mark.timeout(150)


def _full(d):
    return d.full_tensor().detach().clone()


def dtensor_1d(rank, world, backend):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6 * world, 5, generator=g)          # the same on every rank
    w = torch.randn(5, 4 * world, generator=g)
    out = {}
    xs = distribute_tensor(x, mesh, [Shard(0)])
    out["local_rows"] = xs.to_local().clone()
    out["shard0_to_replicate"] = xs.redistribute(mesh, [Replicate()]).to_local().clone()
    out["shard0_to_shard1"] = xs.redistribute(mesh, [Shard(1)]).to_local().clone()
    # sharded matmul: rows of x times column-sharded w, gathered
    ws = distribute_tensor(w, mesh, [Shard(1)])
    xr = distribute_tensor(x, mesh, [Replicate()])
    out["matmul_colwise"] = _full(xr @ ws)
    # row-sharded inner dimension: partial sums, reduced by redistribute
    xk = distribute_tensor(x, mesh, [Shard(1)])
    wk = distribute_tensor(w, mesh, [Shard(0)])
    prod = xk @ wk
    out["partial_placement"] = repr(prod.placements[0])
    out["matmul_rowwise"] = prod.redistribute(mesh, [Replicate()]).to_local().clone()
    # a Partial made by hand: every rank's local value summed
    p = distribute_tensor(torch.zeros(3), mesh, [Replicate()])
    mine = torch.full((3,), float(rank + 1))
    from torch.distributed.tensor import DTensor
    part = DTensor.from_local(mine, mesh, [Partial()])
    out["partial_sum"] = part.redistribute(mesh, [Replicate()]).to_local().clone()
    out["replicated_zeros"] = p.to_local().clone()
    return out


def dtensor_2d(rank, world, backend):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    g = torch.Generator().manual_seed(5)
    x = torch.randn(8, 6, generator=g)
    w = torch.randn(6, 8, generator=g)
    out = {"coords": list(mesh.get_coordinate())}
    xs = distribute_tensor(x, mesh, [Shard(0), Shard(1)])
    out["local_block"] = xs.to_local().clone()
    out["to_replicate"] = xs.redistribute(mesh, [Replicate(), Replicate()]).to_local().clone()
    out["swap"] = xs.redistribute(mesh, [Shard(1), Shard(0)]).to_local().clone()
    xd = distribute_tensor(x, mesh, [Shard(0), Replicate()])     # data parallel rows
    wt = distribute_tensor(w, mesh, [Replicate(), Shard(1)])     # tensor parallel columns
    out["matmul"] = _full(xd @ wt)
    tp = mesh["tp"].get_group()
    t = torch.full((2,), float(rank))
    dist.all_reduce(t, group=tp)                                 # the submesh's own group
    out["tp_sum"] = t
    return out


def _compare(results, exact=True):
    for rank, d in enumerate(results):
        g, a = d["gloo"], d["accord"]
        assert g.keys() == a.keys()
        for k in g:
            if isinstance(g[k], torch.Tensor):
                if exact:
                    assert torch.equal(a[k], g[k]), f"rank {rank}: {k}"
                else:
                    torch.testing.assert_close(a[k], g[k], rtol=1e-5, atol=1e-6,
                                               msg=f"rank {rank}: {k}")
            else:
                assert a[k] == g[k], f"rank {rank}: {k}: {a[k]!r} vs {g[k]!r}"


@pytest.mark.parametrize("world", [2, 3])
def test_dtensor_1d_mesh_like_gloo(world):
    res = run_torch(world, dtensor_1d, backends=("gloo", "accord"), timeout=90)
    _compare(res, exact=world == 2)
    total = sum(range(1, world + 1))
    for d in res:
        a = d["accord"]
        assert torch.equal(a["partial_sum"], torch.full((3,), float(total)))
        assert a["partial_placement"] == "Partial(sum)"
        # the matmuls agree with the one a single process computes
        g = torch.Generator().manual_seed(3)
        x = torch.randn(6 * world, 5, generator=g)
        w = torch.randn(5, 4 * world, generator=g)
        torch.testing.assert_close(a["matmul_colwise"], x @ w)
        torch.testing.assert_close(a["matmul_rowwise"], x @ w, rtol=1e-5, atol=1e-5)
        assert torch.equal(a["shard0_to_replicate"], x)


def test_dtensor_2d_mesh_like_gloo():
    res = run_torch(4, dtensor_2d, backends=("gloo", "accord"), timeout=120)
    _compare(res)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(8, 6, generator=g)
    w = torch.randn(6, 8, generator=g)
    for rank, d in enumerate(res):
        a = d["accord"]
        assert a["coords"] == [rank // 2, rank % 2]
        assert torch.equal(a["to_replicate"], x)
        torch.testing.assert_close(a["matmul"], x @ w)
        base = 2 * (rank // 2)
        assert torch.equal(a["tp_sum"], torch.full((2,), float(base + base + 1)))


def checkpoint_roundtrip(rank, world, backend, root):
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    def build(seed):
        torch.manual_seed(seed)
        m = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
        fully_shard(m)
        return m, torch.optim.Adam(m.parameters(), lr=0.01)

    model, opt = build(0)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 6, generator=g)).sum().backward()
        opt.step()
    msd, osd = get_state_dict(model, opt)
    path = f"{root}/{backend}"
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)

    fresh, fresh_opt = build(1)              # other weights, no optimizer state yet
    before = {k: v.full_tensor().clone() for k, v in fresh.state_dict().items()}
    msd2, osd2 = get_state_dict(fresh, fresh_opt)
    state = {"model": msd2, "optim": osd2}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    saved = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    loaded = {k: v.full_tensor().clone() for k, v in fresh.state_dict().items()}
    # one more step from the loaded state matches one more step from the original
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(99 + rank))
    for m, o in ((model, opt), (fresh, fresh_opt)):
        o.zero_grad()
        m(x).sum().backward()
        o.step()
    after = [{k: v.full_tensor().clone() for k, v in m.state_dict().items()}
             for m in (model, fresh)]
    return {"saved": saved, "loaded": loaded, "before": before, "after": after}


@pytest.mark.parametrize("world", [2, 3])
def test_checkpoint_save_and_load_like_gloo(world, tmp_path):
    res = run_torch(world, checkpoint_roundtrip, str(tmp_path), backends=("gloo", "accord"),
                    timeout=120)
    for rank, d in enumerate(res):
        g, a = d["gloo"], d["accord"]
        for k in a["saved"]:
            assert torch.equal(a["loaded"][k], a["saved"][k]), f"rank {rank}: loaded {k}"
            assert not torch.equal(a["before"][k], a["saved"][k])
            assert torch.equal(a["after"][0][k], a["after"][1][k]), f"rank {rank}: step {k}"
            if world == 2:
                assert torch.equal(a["saved"][k], g["saved"][k]), f"rank {rank}: {k}"
            else:
                torch.testing.assert_close(a["saved"][k], g["saved"][k], rtol=1e-5, atol=1e-6)
    assert (tmp_path / "accord" / ".metadata").is_file()
