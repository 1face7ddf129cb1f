"""Ray Train on accord: TorchTrainer(..., torch_config=TorchConfig(backend="accord")).

Ray creates the torch process group in each training worker before the
training function runs; nothing in the job imports accord: the backend is
there because an installed accord registers "accord" with torch at `import
torch` (its "torch.backends" entry point). The training function trains the
same small model twice in the same workers, once with DistributedDataParallel
on the default group (accord) and once on a gloo group of the same ranks, and
the two must agree.
"""
import json

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="the Ray tests need ray (pip install accord[ray])")
pytest.importorskip("ray.train.torch")
torch = pytest.importorskip("torch")

# one xdist worker runs every Ray test file (each starts a local Ray cluster)
pytestmark = [pytest.mark.timeout(240), pytest.mark.xdist_group("ray")]


def _train(config):
    import sys
    import torch
    import torch.distributed as dist
    import ray.train

    rank = ray.train.get_context().get_world_rank()
    default = dist.distributed_c10d._get_default_group()
    report = {"backend": dist.get_backend(), "group": type(default).__name__,
              "world": dist.get_world_size(), "hooked": "accord.ray" in sys.modules}
    gloo = dist.new_group(backend="gloo")

    def train(group):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                    torch.nn.Linear(16, 1))
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        data = torch.Generator().manual_seed(100 + rank)      # each rank its own batches
        for _ in range(5):
            x = torch.randn(32, 8, generator=data)
            loss = torch.nn.functional.mse_loss(ddp(x), x.sum(1, keepdim=True))
            opt.zero_grad()
            loss.backward()
            opt.step()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()

    report["accord"] = train(None)
    report["gloo"] = train(gloo)
    with open(f"{config['out']}.{rank}", "w") as f:
        json.dump(report, f)


@pytest.fixture(scope="module")
def cluster():
    import sys
    from ray import cloudpickle
    # the workers cannot import this test module: ship _train by value
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def test_torch_trainer_on_accord_trains_as_gloo(cluster, tmp_path):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer
    out = tmp_path / "weights"
    trainer = TorchTrainer(_train, train_loop_config={"out": str(out)},
                           scaling_config=ScalingConfig(num_workers=2),
                           torch_config=TorchConfig(backend="accord"),
                           run_config=RunConfig(storage_path=str(tmp_path / "runs"), name="accord"))
    trainer.fit()
    reports = [json.loads((tmp_path / f"weights.{r}").read_text()) for r in range(2)]
    for r in reports:
        assert (r["backend"], r["group"], r["world"]) == ("accord", "AccordProcessGroup", 2)
        assert not r["hooked"]          # no setup hook, no import: the entry point did it
        # DDP averages the same two gradients on both groups: the same weights, bit for bit
        assert np.array_equal(np.array(r["accord"]), np.array(r["gloo"]))
    assert reports[0]["accord"] == reports[1]["accord"]
    # and training moved them: the initial weights of torch.manual_seed(0) are not the result
    torch.manual_seed(0)
    start = torch.cat([p.detach().reshape(-1) for p in torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).parameters()])
    assert not np.allclose(start.numpy(), np.array(reports[0]["accord"]))
