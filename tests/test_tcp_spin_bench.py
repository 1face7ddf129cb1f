"""benchmarks/tcp_spin.py: a row per op and size with every way's time and its ratio to
the first way, the ways switched in the same two processes over TCP."""
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "tcp_spin.py")


def test_every_way_is_timed_for_every_op_and_size():
    env = dict(os.environ, ACCORD_TRANSPORT="tcp")
    out = subprocess.run([sys.executable, "-m", "accord", "run", "-n", "2", SCRIPT,
                          "--ways", "chosen,none,all", "--sizes", "8,64K",
                          "--ops", "broadcast,pingpong", "--blocks", "2"],
                         capture_output=True, text=True, timeout=100, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert re.search(r"# benchmarks/tcp_spin.py .* SPIN_BYTES 1048576; load \d", out.stdout)
    rows = re.findall(r"^\[rank 0\] (\w+) +(\d+) +([\d.]+) +([\d.]+) +([\d.]+)x +([\d.]+) +"
                      r"([\d.]+)x$", out.stdout, re.M)
    assert [(op, int(size)) for op, size, *_ in rows] == [
        ("broadcast", 8), ("pingpong", 8), ("broadcast", 65536), ("pingpong", 65536)], \
        out.stdout
    for _, _, chosen, none, r_none, every, r_every in rows:
        assert min(float(chosen), float(none), float(every)) > 0
        assert float(r_none) > 0 and float(r_every) > 0


def test_it_refuses_a_way_it_does_not_know():
    env = dict(os.environ, ACCORD_TRANSPORT="tcp")
    out = subprocess.run([sys.executable, "-m", "accord", "run", "-n", "2", SCRIPT,
                          "--ways", "chosen,sometimes", "--sizes", "8"],
                         capture_output=True, text=True, timeout=100, env=env, cwd=ROOT)
    assert out.returncode != 0
    assert "no way 'sometimes'; choose of chosen, none, small, all" in out.stdout + out.stderr
