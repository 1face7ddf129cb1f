"""benchmarks/allgather_floor.py: every method gathers every rank's block, and says so."""
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "benchmarks", "allgather_floor.py")


@pytest.mark.parametrize("world", [2, 3])
def test_every_method_runs_and_reports_a_time_and_cpu_per_call(world):
    out = subprocess.run([sys.executable, SCRIPT, "--world", str(world), "--sizes", "4K,64K",
                          "--calls", "20", "--repeat", "1"],
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    rows = re.findall(r"^(slot|read|direct) (\d+) ([\d.]+) ([\d.]+)$", out.stdout, re.M)
    assert [(m, int(n)) for m, n, _, _ in rows] == [
        (m, n) for n in (4096, 65536) for m in ("slot", "read", "direct")]
    assert all(float(t) > 0 and float(c) > 0 for _, _, t, c in rows)


def test_a_world_it_cannot_lay_out_is_refused():
    out = subprocess.run([sys.executable, SCRIPT, "--world", "9"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2
    assert "--world: 2 to 8 ranks" in out.stderr
