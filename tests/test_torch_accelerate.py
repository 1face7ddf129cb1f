"""An accelerate training loop on CPU runs on "accord" as on "gloo".

On CPU, accelerate (1.15) picks "gloo" itself and refuses any other name
given to it; it uses a process group that already exists, though. So the
way is: `torch.distributed.init_process_group("accord")` first, then
`Accelerator(cpu=True)` (what examples/torch_accelerate.py does). The
harness makes the group before calling `train`, as such a script would, and
the same loop runs on both backends; parameters, losses and the gathered
metrics are compared.
"""
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")
import torch._dynamo  # noqa: E402,F401  (DDP imports it lazily: once here, not per rank)
import accelerate  # noqa: E402,F401

from torch_ranks import run_torch  # noqa: E402

pytestmark = pytest.mark.timeout(150)


def train(rank, world, backend):
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    # what a launcher (torchrun, accord run) puts in the environment
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      OMP_NUM_THREADS="1")
    try:
        acc = Accelerator(cpu=True)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        g = torch.Generator().manual_seed(9)
        data = TensorDataset(torch.randn(60, 6, generator=g), torch.randn(60, 2, generator=g))
        loader = DataLoader(data, batch_size=5, shuffle=False)
        model, opt, loader = acc.prepare(model, opt, loader)
        losses = []
        for x, y in loader:
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            opt.step()
            losses.append(acc.gather_for_metrics(loss.detach()[None]))
        seen = acc.gather_for_metrics(torch.tensor([float(rank)]))
        state = {k: v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()}
        return {"state": state, "losses": torch.cat(losses), "seen": seen,
                "distributed": str(acc.distributed_type), "processes": acc.num_processes,
                "backend": dist.get_backend()}
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parametrize("world", [2, 3])
def test_accelerate_loop_trains_like_gloo(world):
    res = run_torch(world, train, backends=("gloo", "accord"), timeout=120)
    ref = res[0]["accord"]
    for rank, d in enumerate(res):
        g, a = d["gloo"], d["accord"]
        assert a["backend"] == "accord" and g["backend"] == "gloo"
        assert a["distributed"] == "DistributedType.MULTI_CPU" and a["processes"] == world
        assert torch.equal(a["seen"], torch.arange(world, dtype=torch.float32))
        assert a["losses"].numel() == g["losses"].numel() == 60 // 5   # every batch once
        if world == 2:
            assert torch.equal(a["losses"], g["losses"])
        else:
            torch.testing.assert_close(a["losses"], g["losses"], rtol=1e-5, atol=1e-6)
        for k in g["state"]:
            if world == 2:
                assert torch.equal(a["state"][k], g["state"][k]), f"rank {rank}: {k}"
            else:
                torch.testing.assert_close(a["state"][k], g["state"][k], rtol=1e-5, atol=1e-6)
            assert torch.equal(a["state"][k], ref["state"][k]), f"replicas differ in {k}"
