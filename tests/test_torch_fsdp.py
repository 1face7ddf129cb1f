"""FSDP (FullyShardedDataParallel and fully_shard) trains the same on "accord" as on "gloo".

Each rank trains a small MLP for a few optimizer steps under both backends in
the same process (same seeds, different data per rank), then takes a full and
a sharded state dict. At world 2 every result is bitwise equal to gloo's (a
sum of two is the same in either order); at world 3 accord adds partial sums
in another order than gloo, so results agree within float32 rounding, and
every rank's full state dict is bitwise equal to every other's.
"""
import pytest

torch = pytest.importorskip("torch")
import torch._dynamo  # noqa: E402,F401  (FSDP imports it lazily: once here, not per rank)
import torch.distributed as dist  # noqa: E402
import torch.distributed.fsdp  # noqa: E402,F401

from torch_ranks import run_torch  # noqa: E402

pytestmark = pytest.mark.timeout(150)


def _mlp():
    from torch import nn
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 4))


def _batches(rank, steps=4):
    g = torch.Generator().manual_seed(50 + rank)
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g))
            for _ in range(steps)]


def _train(model, rank):
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    losses = []
    for x, y in _batches(rank):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _local(t):
    """A state dict value as a plain tensor: a ShardedTensor's or DTensor's local shard."""
    if hasattr(t, "to_local"):
        return t.to_local().detach().clone()
    if hasattr(t, "local_shards"):
        shards = t.local_shards()
        return torch.cat([s.tensor.reshape(-1) for s in shards]) if shards else torch.empty(0)
    return t.detach().clone()


def resize_after_collective(rank, world, backend):
    t = torch.ones(4)
    dist.all_reduce(t)
    total = t.clone()
    t.resize_(16)                 # FSDP frees and regrows flat parameters this way
    t.untyped_storage().resize_(0)
    b = torch.ones(3, dtype=torch.bfloat16)
    dist.broadcast(b, src=0)
    b.untyped_storage().resize_(0)
    return {"total": total, "shape": tuple(t.shape), "freed": b.untyped_storage().size()}


def test_storage_stays_resizable_after_a_collective():
    for d in run_torch(2, resize_after_collective, backends=("gloo", "accord"), timeout=60):
        assert d["accord"]["shape"] == d["gloo"]["shape"] == (16,)
        assert d["accord"]["freed"] == d["gloo"]["freed"] == 0
        assert torch.equal(d["accord"]["total"], torch.full((4,), 2.0))


def fsdp1(rank, world, backend):
    from torch.distributed.fsdp import FullStateDictConfig, ShardedStateDictConfig
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType
    model = FSDP(_mlp(), device_id=torch.device("cpu"))
    losses = _train(model, rank)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(rank0_only=False)):
        full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT,
                              ShardedStateDictConfig()):
        sharded = {k: _local(v) for k, v in model.state_dict().items()}
    return {"losses": losses, "full": full, "sharded": sharded}


def fsdp2(rank, world, backend):
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         get_model_state_dict)
    from torch.distributed.fsdp import fully_shard
    model = _mlp()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    losses = _train(model, rank)
    sharded = {k: _local(v) for k, v in model.state_dict().items()}
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    full = {k: v.detach().clone() for k, v in full.items()}
    return {"losses": losses, "full": full, "sharded": sharded}


def _same(a, b, exact, what):
    if exact:
        assert torch.equal(a, b), f"{what}: differs from gloo"
    else:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=what)


def _check(results, world):
    exact = world == 2
    ref = results[0]["accord"]["full"]
    for rank, d in enumerate(results):
        g, a = d["gloo"], d["accord"]
        assert len(a["losses"]) == len(g["losses"]) == 4
        _same(torch.tensor(a["losses"]), torch.tensor(g["losses"]), exact, f"rank {rank} losses")
        for part in ("full", "sharded"):
            assert a[part].keys() == g[part].keys() and a[part]
            for k in g[part]:
                _same(a[part][k], g[part][k], exact, f"rank {rank}: {part} {k}")
        for k, v in a["full"].items():
            assert torch.equal(v, ref[k]), f"rank {rank}: full state dict {k} differs from rank 0"
    # training moved the weights away from the common start
    start = _mlp().state_dict()
    assert any(not torch.equal(start[k], ref[k]) for k in start)


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp1_trains_like_gloo(world):
    _check(run_torch(world, fsdp1, backends=("gloo", "accord"), timeout=90), world)


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp2_trains_like_gloo(world):
    _check(run_torch(world, fsdp2, backends=("gloo", "accord"), timeout=90), world)
