"""Ray Train on accord: TorchTrainer with TorchConfig(backend="accord").

    python examples/ray_train.py             # starts a local Ray; needs `pip install accord[ray]`

Nothing else is accord-specific: Ray creates torch's process group in each
training worker with backend "accord", which an installed accord registers
with torch by itself (at `import torch`), so the workers need no import and
no setup hook. Two workers fit a small regression model with
DistributedDataParallel; rank 0 prints the loss, and the driver checks that
it went down.
"""
import ray
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer


def train(config):
    import torch
    import torch.distributed as dist
    import ray.train
    import ray.train.torch

    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rank = ray.train.get_context().get_world_rank()
    data = torch.Generator().manual_seed(rank)                 # each worker its own batches
    losses = []
    for step in range(config["steps"]):
        x = torch.randn(64, 8, generator=data)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    if rank == 0:
        print(f"backend {dist.get_backend()}: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
        with open(config["out"], "w") as f:
            f.write(f"{losses[0]} {losses[-1]}")


def main():
    import os
    import tempfile
    ray.init(num_cpus=4, include_dashboard=False)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "loss")
        TorchTrainer(train, train_loop_config={"steps": 30, "out": out},
                     scaling_config=ScalingConfig(num_workers=2),
                     torch_config=TorchConfig(backend="accord"),
                     run_config=RunConfig(storage_path=tmp, name="ray_train_example")).fit()
        first, last = map(float, open(out).read().split())
    assert last < first / 2, (first, last)
    print(f"ok: loss {first:.3f} -> {last:.3f} on backend accord")
    ray.shutdown()


if __name__ == "__main__":
    main()
