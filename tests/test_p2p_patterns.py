"""benchmarks/p2p_patterns.py: each way of writing a ping-pong runs under accord and,
where mpiexec is there, under MPICH, and gets its row."""
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "benchmarks", "p2p_patterns.py")


def _rows(stdout):
    return {name: cells for name, cells in
            re.findall(r"^\| (blocking|wait each|post first) \|(.*)\|$", stdout, re.M)}


def test_every_pattern_gets_a_row_for_accord():
    out = subprocess.run([sys.executable, SCRIPT, "--iters", "20", "--rounds", "1",
                          "--no-mpi"], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    rows = _rows(out.stdout)
    assert sorted(rows) == ["blocking", "post first", "wait each"], out.stdout
    assert all(float(cells.split("|")[0]) > 0 for cells in rows.values())
    assert "mpich" not in out.stdout


def test_mpich_runs_the_same_patterns_beside_it():
    pytest.importorskip("mpi4py")
    sys.path.insert(0, os.path.dirname(SCRIPT))
    from p2p_patterns import find_mpiexec
    if find_mpiexec() is None:
        pytest.skip("no mpiexec next to this Python or on PATH")
    out = subprocess.run([sys.executable, SCRIPT, "--iters", "20", "--rounds", "1"],
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    rows = _rows(out.stdout)
    assert len(rows) == 3, out.stdout
    for cells in rows.values():
        accord_us, mpich_us, ratio = [c.strip() for c in cells.split("|")]
        a, m = float(accord_us), float(mpich_us)
        assert a > 0 and m > 0
        # the ratio of the unrounded times: within the rounding of the printed ones
        assert ratio.endswith("x") and abs(float(ratio[:-1]) - a / m) <= 0.05 * a / m + 0.01
