"""torch.distributed.pipelining schedules on backend "accord", beside gloo: a small
model split into stages trains one step with the same losses and gradients."""
import pytest

torch = pytest.importorskip("torch")

from torch_ranks import run_torch  # noqa: E402

pytestmark = pytest.mark.timeout(240)

LAYERS, WIDTH, BATCH, MICRO = 8, 16, 8, 4


def _model():
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def _train(rank, world, backend, schedule_name):
    import torch.distributed.pipelining as pp
    per_rank = 2 if schedule_name == "ScheduleInterleaved1F1B" else 1
    n_stages = world * per_rank
    full = _model()
    per = len(full) // n_stages
    stages, params = [], []
    for k in range(per_rank):
        index = rank + k * world
        part = full[index * per:(index + 1) * per]
        params.append(list(part.parameters()))
        stages.append(pp.PipelineStage(part, index, n_stages, torch.device("cpu")))
    loss_fn = torch.nn.MSELoss()
    cls = getattr(pp, schedule_name)
    schedule = cls(stages if per_rank > 1 else stages[0], n_microbatches=MICRO,
                   loss_fn=loss_fn)
    torch.manual_seed(1)
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    losses = []
    first = rank == 0
    last = rank == (n_stages - 1) % world
    if first and last:
        schedule.step(x, target=y, losses=losses)
    elif first:
        schedule.step(x)
    elif last:
        schedule.step(target=y, losses=losses)
    else:
        schedule.step()
    grads = [[p.grad.clone().numpy().tobytes() for p in ps] for ps in params]
    return [float(v) for v in losses], grads


@pytest.mark.parametrize("schedule", ["ScheduleGPipe", "Schedule1F1B",
                                      "ScheduleInterleaved1F1B"])
@pytest.mark.parametrize("world", [2, 4])
def test_pipeline_schedule_matches_gloo(world, schedule):
    out = run_torch(world, _train, schedule, backends=("gloo", "accord"), timeout=180)
    for rank, res in enumerate(out):
        assert res["accord"] == res["gloo"], f"rank {rank} differs from gloo"
    last = out[(world * (2 if "Interleaved" in schedule else 1) - 1) % world]
    assert len(last["accord"][0]) == MICRO          # the last stage saw every microbatch
