"""benchmarks/async_wait.py: each op gets its row, each way of calling it a time."""
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "benchmarks", "async_wait.py")


def test_every_op_gets_a_row_with_each_way_timed():
    out = subprocess.run([sys.executable, SCRIPT, "--iters", "16", "--rounds", "1"],
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    rows = dict(re.findall(r"^\| (all_reduce|broadcast) \|(.*)\|$", out.stdout, re.M))
    assert sorted(rows) == ["all_reduce", "broadcast"], out.stdout
    for cells in rows.values():
        sync, at_once, eight, ratio = [c.strip() for c in cells.split("|")]
        s, a = float(sync), float(at_once)
        assert s > 0 and a > 0 and float(eight) > 0
        assert ratio.endswith("x") and abs(float(ratio[:-1]) - a / s) <= 0.05 * a / s + 0.01
    assert "world 2, µs per call" in out.stdout and "load average" in out.stdout
