"""The frame parser, the store protocol and the mesh handshake, fuzzed briefly
(benchmarks/fuzz.py: coverage-guided with atheris where it is installed, random
inputs otherwise), and every input that ever crashed one of them replayed."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import fuzz  # noqa: E402

pytestmark = pytest.mark.timeout(120)
_REGRESSIONS = os.path.join(os.path.dirname(__file__), "fuzz_regressions")


def test_short_fuzz_run_finds_no_crash():
    r = fuzz.run_target("mixed", seconds=4, input_timeout=20)
    assert not r["crashed"], "\n".join(r["tail"])
    assert r["runs"] and r["runs"] > 100, r


def _regressions():
    out = []
    for target in sorted(os.listdir(_REGRESSIONS)) if os.path.isdir(_REGRESSIONS) else []:
        for name in sorted(os.listdir(os.path.join(_REGRESSIONS, target))):
            out.append(pytest.param(target, os.path.join(_REGRESSIONS, target, name),
                                    id=f"{target}/{name}"))
    return out


@pytest.mark.parametrize("target,path", _regressions())
def test_crash_found_by_fuzzing_stays_fixed(target, path):
    with open(path, "rb") as f:
        fuzz.FUNCTIONS[target](f.read())
