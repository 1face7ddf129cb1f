"""benchmarks/bench_coalescing.py: a loop of small calls beside the same calls coalesced."""
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(180)

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "benchmarks", "bench_coalescing.py")


def test_both_methods_run_checked_and_give_one_row_per_count_and_op():
    pytest.importorskip("torch")
    out = subprocess.run([sys.executable, SCRIPT, "-n", "3", "--tensors", "4,12", "--range",
                          "64,1024", "--repeat", "2", "--calls", "3"],
                         capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = re.findall(r"^\| 3 \| (\d+) \| (\w+) \| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+)x \|$",
                      out.stdout, re.M)
    assert [(n, op) for n, op, *_ in rows] == [("4", "broadcast"), ("4", "all_reduce"),
                                               ("12", "broadcast"), ("12", "all_reduce")]
    for n, op, nbytes, loop, coal, ratio in rows:
        assert float(loop) > 0 and float(coal) > 0
        assert abs(float(ratio) - float(loop) / float(coal)) < 0.01
    assert "load average" in out.stdout
