"""torchrun starts accord programs: plain accord (torchrun's agent store) and torch's "accord"."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

pytestmark = pytest.mark.timeout(120)

TORCHRUN = Path(sys.executable).with_name("torchrun")

PLAIN = """
import numpy as np
import accord as dist
dist.init_process_group()
r = dist.get_rank()
x = np.array([r + 1.0])
dist.all_reduce(x)
dist.all_gather_object([None] * dist.get_world_size(), r)
print(f"rank {r}/{dist.get_world_size()} sum={x[0]:g}", flush=True)
dist.destroy_process_group()
"""

WITH_TORCH = """
import torch, torch.distributed as dist
import accord.torch
dist.init_process_group("accord")
t = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(t)
g = dist.new_group([0, 1])
dist.barrier(group=g)
print(f"torch rank {dist.get_rank()} sum={t.item():g} backend={dist.get_backend()}", flush=True)
dist.destroy_process_group()
"""


def _torchrun(tmp_path, source, n=2):
    script = tmp_path / "prog.py"
    script.write_text(source)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).parents[1]))
    proc = subprocess.run([str(TORCHRUN), "--nproc-per-node", str(n), "--log-dir",
                           str(tmp_path / "logs"), "--tee", "3", str(script)],
                          capture_output=True, text=True, timeout=100, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not installed")
def test_torchrun_plain_accord(tmp_path):
    out = _torchrun(tmp_path, PLAIN)
    assert "rank 0/2 sum=3" in out and "rank 1/2 sum=3" in out, out


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not installed")
def test_torchrun_torch_backend(tmp_path):
    out = _torchrun(tmp_path, WITH_TORCH)
    assert out.count("sum=3 backend=accord") == 2, out


# restarts: rank 1 fails on torchrun's first attempt, after the group is made (its
# keys are in the agent's store when the second attempt's workers meet there)
RESTARTED = """
import os, sys
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
rank = int(os.environ["RANK"])
if sys.argv[1] == "torch":
    import torch, torch.distributed as dist
    import accord.torch
    dist.init_process_group("accord")
    t = torch.tensor([rank + 1.0])
else:
    import numpy as np
    import accord as dist
    dist.init_process_group()
    t = np.array([rank + 1.0])
if attempt == 0 and rank == 1:
    raise RuntimeError("rank 1 fails on attempt 0")
dist.all_reduce(t)
dist.barrier()
print(f"attempt {attempt} rank {rank} sum {float(t[0]):g}", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not installed")
@pytest.mark.parametrize("api,rdzv", [("torch", "static"), ("torch", "c10d"),
                                      ("plain", "static")])
def test_torchrun_max_restarts(tmp_path, api, rdzv):
    """torchrun --max-restarts 1: the second attempt meets afresh and finishes."""
    script = tmp_path / "prog.py"
    script.write_text(RESTARTED)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).parents[1]))
    rdzv_args = ["--standalone"] if rdzv == "c10d" else []
    logs = tmp_path / "logs"
    proc = subprocess.run([str(TORCHRUN), *rdzv_args, "--nproc-per-node", "2",
                           "--max-restarts", "1", "--monitor-interval", "0.5",
                           "--log-dir", str(logs), "--redirects", "3", str(script), api],
                          capture_output=True, timeout=100, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr).decode()
    # torchrun's log dir: <run id>/attempt_<n>/<local rank>/stdout.log
    attempts = {p.parent.parent.name: p for p in logs.glob("*/attempt_*/1/stderr.log")}
    assert sorted(attempts) == ["attempt_0", "attempt_1"], attempts
    assert b"RuntimeError: rank 1 fails on attempt 0" in attempts["attempt_0"].read_bytes()
    for r in (0, 1):
        out = next(logs.glob(f"*/attempt_1/{r}/stdout.log")).read_bytes()
        assert out == f"attempt 1 rank {r} sum 3\n".encode(), out
