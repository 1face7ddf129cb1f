"""An accelerate (Hugging Face) training loop on the "accord" backend, on CPU.

    accord run -n 2 examples/torch_accelerate.py
    torchrun --nproc-per-node 2 examples/torch_accelerate.py

On CPU, accelerate chooses "gloo" by itself and refuses another name given
to `Accelerator` ("Your assigned backend accord is not available"), but it
uses a process group that already exists. So the script makes the group
first, with `init_process_group("accord")` (an installed accord is known to
torch without any import), and then builds `Accelerator(cpu=True)`; every
collective accelerate and DDP make then runs on accord. accelerate still
prints "gloo" as its backend: on CPU it only uses that name to choose
between all_gather and all_gather_into_tensor, and accord serves both.
"""
import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main():
    dist.init_process_group("accord")          # before Accelerator: it keeps this group
    acc = Accelerator(cpu=True)
    torch.set_num_threads(1)

    g = torch.Generator().manual_seed(0)
    w_true = torch.randn(8, 2, generator=g)
    x = torch.randn(512, 8, generator=g)
    y = x @ w_true + 0.01 * torch.randn(512, 2, generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True,
                        generator=torch.Generator().manual_seed(1))

    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = acc.prepare(model, opt, loader)   # DDP over accord, sharded loader

    for epoch in range(5):
        total = torch.zeros(1)
        for xb, yb in loader:
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(xb), yb)
            acc.backward(loss)
            opt.step()
            total += loss.detach()
        mean = acc.gather_for_metrics(total).mean().item() / len(loader)
        acc.print(f"epoch {epoch}: mean loss {mean:.5f}")

    # every replica holds the same weights (checked against rank 0's), close to w_true
    w = acc.unwrap_model(model).weight.detach().clone()
    ref = w.clone()
    dist.broadcast(ref, src=0)
    assert torch.equal(w, ref), "replicas differ"
    err = (w.T - w_true).abs().max().item()
    assert err < 0.05, f"did not converge: max error {err:.3f}"
    acc.print(f"{acc.num_processes} processes on backend {dist.get_backend()!r}: "
              f"max weight error {err:.4f}")
    acc.end_training()                          # (destroys the process group)


if __name__ == "__main__":
    main()
