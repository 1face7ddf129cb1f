"""A short soak under load (benchmarks/soak.py): random collectives and point-to-point
at world 4 over shared memory and over TCP, every result checked exactly, and no file
descriptor, thread or /dev/shm segment left behind. `-m "not soak"` deselects it."""
import os
import sys

import pytest

from harness import run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import soak  # noqa: E402

pytestmark = [pytest.mark.soak, pytest.mark.timeout(90)]


def _soak(rank, world, seconds):
    return soak.soak(seconds, max_bytes=4 << 20, sample_s=1.0)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_soak_stays_correct_and_leaks_nothing(transport):
    out = run_ranks(4, _soak, 8.0, env={"ACCORD_TRANSPORT": transport}, timeout=60)
    report = out[0]
    assert report["ops"] > 20, report
    assert report["wrong"] == 0, report
    for e in report["ranks"]:
        assert e["fds"][0] == e["fds"][1], e
        assert e["threads"][0] == e["threads"][1], e
    # this job's arenas, by name (the machine may be running other jobs' segments)
    assert bool(report["ranks"][0]["arenas"]) == (transport == "shm")
    assert soak.shm_left(report) == []
