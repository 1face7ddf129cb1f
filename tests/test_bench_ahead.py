"""benchmarks/bench_ahead.py: a row per world and state, each way timed, back to back
or with the ranks in step (--in-step); the receivers check every tensor each round."""
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "benchmarks", "bench_ahead.py")


@pytest.mark.parametrize("in_step", [False, True], ids=["back-to-back", "in-step"])
def test_each_way_is_timed_for_each_state(in_step):
    out = subprocess.run([sys.executable, SCRIPT, "-n", "2", "--tensors", "10,81",
                          "--rounds", "1", "--calls", "3"] + (["--in-step"] if in_step else []),
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = re.findall(r"^\| 2 \| (\d+) tensors, \d+ KiB \|(.*)\|$", out.stdout, re.M)
    assert [n for n, _ in rows] == ["10", "81"], out.stdout
    for _, cells in rows:
        ahead, other, ratio, loop, one, per = [c.strip() for c in cells.split("|")]
        assert float(ahead) > 0 and float(other) > 0 and float(loop) > 0 and float(one) > 0
        assert ratio.endswith("x") and per.endswith("x")
    assert ("each call after a barrier" in out.stdout) == in_step, out.stdout
    assert "load average" in out.stdout
