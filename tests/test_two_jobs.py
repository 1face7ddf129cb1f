"""Two jobs on one machine at once: separate ports, stores and arenas, no crosstalk."""
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(90)

JOB = textwrap.dedent("""
    import sys
    import numpy as np
    import accord as dist
    job = int(sys.argv[1])
    dist.init_process_group()
    r, n = dist.get_rank(), dist.get_world_size()
    for i in range(200):
        x = np.full(1000, job * 1000 + r, np.int64)
        dist.all_reduce(x)
        assert (x == job * 1000 * n + n * (n - 1) // 2).all(), (job, i, x[0])
        y = np.full(3 << 18, job, np.uint8) if r == 0 else np.zeros(3 << 18, np.uint8)
        dist.broadcast(y, src=0)
        assert (y == job).all()
    print(f"job {job} rank {r} ok", flush=True)
    dist.destroy_process_group()
""")


@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_two_concurrent_jobs_do_not_collide(tmp_path, transport):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = dict(os.environ, ACCORD_TRANSPORT=transport, ACCORD_TIMEOUT="60")
    procs = [subprocess.Popen([sys.executable, "-m", "accord", "run", "-n", "2", str(script),
                               str(job)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for job in (1, 2)]
    outs = [p.communicate(timeout=80)[0] for p in procs]
    for job, (p, out) in enumerate(zip(procs, outs), start=1):
        assert p.returncode == 0, out
        assert f"job {job} rank 0 ok" in out and f"job {job} rank 1 ok" in out, out
