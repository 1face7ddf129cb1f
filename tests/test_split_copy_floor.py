"""benchmarks/split_copy_floor.py: both ways deliver the message whole, and say how long."""
import os
import re
import subprocess
import sys

import pytest

from accord.transport import cma

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not cma.AVAILABLE, reason="no process_vm_readv")]

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "benchmarks", "split_copy_floor.py")


def test_both_ways_run_and_report_their_times():
    # the script checks every message's bytes and exits non-zero where one is wrong
    out = subprocess.run([sys.executable, SCRIPT, "--sizes", "64K,1M", "--calls", "5",
                          "--repeat", "1"], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    rows = re.findall(r"^(\d+) ([\d.]+) ([\d.]+) ([\d.]+)$", out.stdout, re.M)
    assert [int(r[0]) for r in rows] == [65536, 1 << 20], out.stdout
    assert all(float(a) > 0 and float(s) > 0 for _, a, s, _ in rows)
