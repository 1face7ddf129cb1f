"""Scripts started by mpiexec, srun or torchrun find rank and world size by themselves."""
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(90)

JOB = textwrap.dedent("""
    import numpy as np, accord as dist
    dist.init_process_group()
    r, n = dist.get_rank(), dist.get_world_size()
    x = np.full(3, r + 1.0)
    dist.all_reduce(x)
    assert (x == n * (n + 1) / 2).all()
    print(f"OK rank {r}/{n}", flush=True)
    dist.destroy_process_group()
""")


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_", "OMPI_", "PMI_",
                                "SLURM_", "ACCORD_LAUNCHER"))}
    env.update(extra)
    return env


def test_mpiexec(tmp_path):
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
    if mpiexec is None:
        pytest.skip("mpiexec is not installed (pip install mpich)")
    job = tmp_path / "job.py"
    job.write_text(JOB)
    res = subprocess.run([mpiexec, "-n", "3", sys.executable, str(job)], env=_clean_env(),
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    # ranks share one stdout, so their lines may run together
    assert sorted(re.findall(r"OK rank (\d)/3", res.stdout)) == ["0", "1", "2"], res.stdout


def test_slurm_variables(tmp_path):
    """srun sets SLURM_PROCID/SLURM_NTASKS/SLURM_JOB_ID; every rank derives the same port."""
    job = tmp_path / "job.py"
    job.write_text(JOB)
    procs = [subprocess.Popen([sys.executable, str(job)], stdout=subprocess.PIPE, text=True,
                              env=_clean_env(SLURM_JOB_ID=str(os.getpid()), SLURM_STEP_ID="0",
                                             SLURM_PROCID=str(r), SLURM_NTASKS="2",
                                             SLURM_JOB_NODELIST="localhost"))
             for r in range(2)]
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "OK rank 0/2" in outs[0] and "OK rank 1/2" in outs[1]


def test_env_without_port_is_a_clear_error(tmp_path):
    job = tmp_path / "job.py"
    job.write_text(JOB)
    res = subprocess.run([sys.executable, str(job)], env=_clean_env(RANK="0", WORLD_SIZE="2"),
                         capture_output=True, text=True, timeout=30)
    assert res.returncode != 0
    assert "MASTER_PORT is not set" in res.stderr
