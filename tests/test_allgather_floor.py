"""benchmarks/allgather_floor.py: both methods gather every rank's block, and say so."""
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "benchmarks", "allgather_floor.py")


@pytest.mark.parametrize("world", [2, 3])
def test_both_methods_run_and_report_a_time_and_cpu_per_call(world):
    out = subprocess.run([sys.executable, SCRIPT, "--world", str(world), "--sizes", "4K,64K",
                          "--calls", "20", "--repeat", "1"],
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    rows = re.findall(r"^(slot|read) (\d+) ([\d.]+) ([\d.]+)$", out.stdout, re.M)
    assert [(m, int(n)) for m, n, _, _ in rows] == [("slot", 4096), ("read", 4096),
                                                    ("slot", 65536), ("read", 65536)]
    assert all(float(t) > 0 and float(c) > 0 for _, _, t, c in rows)


def test_a_world_it_cannot_lay_out_is_refused():
    out = subprocess.run([sys.executable, SCRIPT, "--world", "9"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2
    assert "--world: 2 to 8 ranks" in out.stderr
