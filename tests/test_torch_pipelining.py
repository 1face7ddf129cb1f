"""torch.distributed.pipelining trains the same on "accord" as on "gloo".

A stack of linear layers is cut into stages, one per rank (GPipe, 1F1B) or
two per rank (Interleaved1F1B); a few optimizer steps of four microbatches
each, on both backends in the same processes. The stages' activations and
gradients cross between ranks with batch_isend_irecv, receives and sends in
one batch, which is the point-to-point pattern this exercises.
"""
import pytest

torch = pytest.importorskip("torch")
import torch._dynamo  # noqa: E402,F401  (pipelining imports it lazily: once here, not per rank)
import torch.distributed as dist  # noqa: E402,F401
import torch.distributed.pipelining  # noqa: E402,F401

from torch_ranks import run_torch  # noqa: E402

pytestmark = pytest.mark.timeout(150)

SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B"]


def _layers(n):
    from torch import nn
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(n)]


def _data(step):
    g = torch.Generator().manual_seed(10 + step)
    return torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)


def pipeline(rank, world, backend, schedule):
    from torch.distributed import pipelining as pp
    per_rank = 2 if schedule == "Interleaved1F1B" else 1
    n = world * per_rank
    layers = _layers(n)
    ids = [rank + world * i for i in range(per_rank)]       # stages 0..n-1, round robin
    stages = [pp.PipelineStage(layers[i], i, n, torch.device("cpu")) for i in ids]
    cls = {"GPipe": pp.ScheduleGPipe, "1F1B": pp.Schedule1F1B,
           "Interleaved1F1B": pp.ScheduleInterleaved1F1B}[schedule]
    sched = cls(stages if per_rank > 1 else stages[0], n_microbatches=4,
                loss_fn=torch.nn.functional.mse_loss)
    params = [p for i in ids for p in layers[i].parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    losses = []
    for step in range(3):
        x, y = _data(step)
        opt.zero_grad()
        step_losses = []
        kwargs = {}
        if 0 in ids:
            kwargs["x"] = x
        if n - 1 in ids:
            kwargs.update(target=y, losses=step_losses)
        if "x" in kwargs:
            sched.step(kwargs.pop("x"), **kwargs)
        else:
            sched.step(**kwargs)
        opt.step()
        losses.append([loss.item() for loss in step_losses])
    return {"ids": ids, "losses": losses,
            "state": {i: {k: v.detach().clone() for k, v in layers[i].state_dict().items()}
                      for i in ids}}


def _reference(n):
    """The same training in one process, no pipeline: the microbatches' mean loss."""
    from torch import nn
    model = nn.Sequential(*_layers(n))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x, y = _data(step)
        opt.zero_grad()
        for xm, ym in zip(x.chunk(4), y.chunk(4)):
            (nn.functional.mse_loss(model(xm), ym) / 4).backward()
        opt.step()
    return list(model)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipeline_schedule_like_gloo(schedule, world):
    res = run_torch(world, pipeline, schedule, backends=("gloo", "accord"), timeout=120)
    per_rank = 2 if schedule == "Interleaved1F1B" else 1
    ref = _reference(world * per_rank)
    for rank, d in enumerate(res):
        g, a = d["gloo"], d["accord"]
        assert a["ids"] == g["ids"]
        assert a["losses"] == g["losses"]
        for i in a["ids"]:
            for k, v in a["state"][i].items():
                assert torch.equal(v, g["state"][i][k]), f"rank {rank}: stage {i} {k}"
                torch.testing.assert_close(v, ref[i].state_dict()[k], rtol=1e-5, atol=1e-6)
    last = next(d["accord"] for d in res if world * per_rank - 1 in d["accord"]["ids"])
    assert all(len(step) == 4 for step in last["losses"])
