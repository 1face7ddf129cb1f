"""The torch suite harness opens exactly the gates it says it opens (in memory)."""
import importlib.util
import re

import pytest

pytest.importorskip("torch")
import torch_distributed_suite as suite  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def _source():
    spec = importlib.util.find_spec(suite.MODULE)
    with open(spec.origin) as f:
        return f.read()


def _gates_by_test(source):
    """{test name: its decorator lines} for every decorated test in source."""
    out, decorators = {}, []
    for line in source.split("\n"):
        s = line.strip()
        m = re.match(r"def (test_\w+)", s)
        if m:
            out[m.group(1)] = "\n".join(decorators)
            decorators = []
        elif s.startswith("def "):
            decorators = []
        elif s.startswith("@") or decorators:
            decorators.append(s)
    return out


def test_gpu_gate_opened_only_on_cpu_bodied_object_tests():
    """The "gpu" feature-set gate admits accord on the four object-collective tests,
    and on no other test; the file on disk is left unchanged."""
    before = _source()
    opened = _gates_by_test(suite.open_decorator_gates(before, "accord"))
    gated = {name for name, d in _gates_by_test(before).items() if suite.GPU_GATE in d}
    admitted = {name for name in gated
                if f'({suite.GPU_GATE} | {{"accord"}})' in opened[name]}
    assert admitted == set(suite.CPU_BODIED_GPU_GATED)
    assert len(gated) > len(admitted)          # the CUDA tests stay gated on "gpu"
    assert _source() == before
