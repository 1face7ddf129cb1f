"""benchmarks/shared_write_floor.py and bench_shared_write.py: every way of writing runs
and is reported."""
import os
import re
import subprocess
import sys

import pytest

from accord.transport import shared_write

pytestmark = pytest.mark.timeout(60)

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                     "benchmarks")
SCRIPT = os.path.join(BENCH, "shared_write_floor.py")


@pytest.mark.skipif(shared_write.stream_copy is None or len(os.sched_getaffinity(0)) < 2,
                    reason="needs the copy helper and two CPUs")
def test_memcpy_and_streaming_are_timed_every_second():
    out = subprocess.run([sys.executable, SCRIPT, "--seconds", "2", "--size", "256K"],
                         capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    rows = re.findall(r"^ +(\d+) +([\d.]+) +([\d.]+)$", out.stdout, re.M)
    assert [int(s) for s, _, _ in rows] == [0, 1]
    assert all(float(a) > 0 and float(b) > 0 for _, a, b in rows)


def test_each_way_of_writing_gets_its_blocks_and_its_row():
    out = subprocess.run([sys.executable, os.path.join(BENCH, "bench_shared_write.py"), "-n", "3",
                          "--ops", "broadcast,scatter", "--sizes", "1M", "--blocks", "2",
                          "--calls", "5"], capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stdout[-2000:]
    for op in ("broadcast", "scatter"):
        assert f"{op} 1048576 B, per block" in out.stdout
    rows = re.findall(r"^\| (memcpy|stream|timed) \| ([\d.]+) \| ([\d.]+) \| (\d+)% \|$",
                      out.stdout, re.M)
    assert [m for m, *_ in rows] == ["memcpy", "stream", "timed"] * 2
    assert all(float(t) > 0 for _, t, _, _ in rows)


@pytest.mark.skipif(shared_write.stream_copy is None or len(os.sched_getaffinity(0)) < 2,
                    reason="needs the copy helper and two CPUs")
def test_state_stretch_prints_the_probe_beside_each_round():
    pytest.importorskip("torch")
    out = subprocess.run([sys.executable, os.path.join(BENCH, "state_stretch.py"), "--rounds",
                          "2", "--tensors", "12", "--blocks", "1", "--calls", "5"],
                         capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = re.findall(r"^\| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| "
                      r"([+-][\d.]+) \| ([\d.]+) \|$", out.stdout, re.M)
    assert [int(r[0]) for r in rows] == [0, 1]
    for _, memcpy, stream, state, one, more, check in rows:
        assert min(map(float, (memcpy, stream, state, one, check))) > 0
        assert abs(float(state) - float(one) - float(more)) < 0.11
