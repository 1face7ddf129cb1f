"""accord's flight recorder exported in the Chrome trace format, for jobs without torch."""
import json
import os

import numpy as np
import pytest

import accord
from harness import run_ranks

pytestmark = pytest.mark.timeout(60)


def traced(rank, world, out):
    import accord.chrome_trace as ct
    from accord import debug
    x = np.ones(4, dtype=np.float32)
    accord.all_reduce(x)
    accord.broadcast(x, src=1)
    sub = accord.new_group([0, 1])
    accord.all_gather([np.empty(2) for _ in range(2)], np.ones(2), group=sub)
    path = ct.export_chrome_trace(os.path.join(out, f"rank{rank}.trace.json"))
    debug.dump("test", trace_dir=os.path.join(out, "dumps"))
    return path


def test_export_and_merge(tmp_path):
    import accord.chrome_trace as ct
    paths = run_ranks(2, traced, str(tmp_path), timeout=30)
    for rank, path in enumerate(paths):
        events = json.load(open(path))["traceEvents"]
        calls = [e for e in events if e["ph"] == "X"]
        names = [e["name"] for e in calls]
        assert names[:2] == ["accord:all_reduce", "accord:broadcast"], names
        assert "accord:all_gather" in names
        assert {e["pid"] for e in calls} == {rank}
        assert len({e["tid"] for e in calls}) == 2            # the world and the subgroup
        for e in calls:
            assert e["dur"] >= 0 and e["ts"] > 1e15 and e["args"]["state"] == "done"
        ar = calls[0]["args"]
        assert ar["dtype"] == "float32" and ar["shape"] == [4] and ar["seq"] >= 0
        assert ar["count"] == 16                    # the size the call was checked with (bytes)
    merged = ct.merge_dumps(str(tmp_path / "dumps"), str(tmp_path / "job.json"))
    events = json.load(open(merged))["traceEvents"]
    assert {e["pid"] for e in events if e["ph"] == "X"} == {0, 1}
    assert sum(e["name"] == "accord:all_reduce" for e in events) == 2
