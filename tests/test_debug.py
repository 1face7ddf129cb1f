"""Flight recorder dumps, `accord debug analyze`, SIGUSR1, ACCORD_DEBUG=DETAIL summaries."""
import json
import logging
import os
import signal
import time

import numpy as np
import pytest

import accord as dist
from accord.cli import debug as debug_cli
from accord.debug import detail as debug_detail
from harness import run_ranks

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["tcp", "shm"])
def transport(request):
    """Run over both transports: what a user sees must not depend on the wire."""
    return {"ACCORD_TRANSPORT": request.param}


def _collect_logs():
    records = []

    class H(logging.Handler):
        def emit(self, record):
            records.append((record.levelname, record.getMessage()))
    logging.getLogger("accord").addHandler(H())
    return records


def _desync_then_dump(rank, world):
    x = np.ones(4, np.float32)
    for _ in range(3):
        dist.all_reduce(x)
    try:
        if rank == 0:
            dist.broadcast(x, src=0)
        else:
            dist.all_reduce(x)
        dist.barrier()
    except dist.Desync:
        pass
    return None


def test_error_dumps_flight_recorder_and_analyze_finds_divergence(tmp_path, capsys, transport):
    trace = str(tmp_path / "trace")
    run_ranks(2, _desync_then_dump, timeout=30, env={"ACCORD_TRACE_DIR": trace, **transport})
    files = sorted(os.listdir(trace))
    assert files == ["rank0.json", "rank1.json"], files
    d = json.load(open(os.path.join(trace, "rank0.json")))
    ops = d["groups"]["default"]["ops"]
    assert [o["op"] for o in ops[:3]] == ["all_reduce"] * 3
    assert ops[0]["where"].startswith("test_debug.py:")
    text, found = debug_cli.analyze(trace)
    assert found
    assert "first divergence at call #3" in text, text
    assert "broadcast #3" in text and "all_reduce #3" in text, text
    from accord.cli import main
    assert main(["debug", "analyze", trace]) == 1
    assert "first divergence at call #3" in capsys.readouterr().out


def _sigusr1(rank, world):
    x = np.ones(4, np.float32)
    dist.all_reduce(x)
    dist.broadcast(x, src=0)
    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(0.1)
    return None


def test_sigusr1_dumps(tmp_path, transport):
    trace = str(tmp_path / "t")
    run_ranks(2, _sigusr1, timeout=30, env={"ACCORD_TRACE_DIR": trace, **transport})
    for r in range(2):
        d = json.load(open(os.path.join(trace, f"rank{r}.json")))
        assert d["reason"] == "SIGUSR1"
        assert [o["op"] for o in d["groups"]["default"]["ops"]] == ["all_reduce", "broadcast"]
        assert all(o["state"] == "done" for o in d["groups"]["default"]["ops"])
    text, found = debug_cli.analyze(trace)
    assert not found and "no divergence" in text


def test_analyze_reports_a_rank_that_never_entered(tmp_path):
    def dump(rank, ops):
        data = {"rank": rank, "pid": 1, "host": "h", "time": 0, "reason": "CommTimeout",
                "groups": {"default": {"ranks": [0, 1, 2], "rank": rank, "size": 3,
                                       "seq": len(ops), "ops": ops}}}
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(data))

    def op(seq, state="done"):
        return {"seq": seq, "op": "all_reduce", "root": -1, "dtype": "float32", "count": 16,
                "shape": [4], "where": "train.py:9", "state": state}
    dump(0, [op(0), op(1), op(2, "running")])
    dump(1, [op(0), op(1), op(2, "running")])
    dump(2, [op(0), op(1)])
    text, found = debug_cli.analyze(str(tmp_path))
    assert found
    assert "rank 2 never entered call #2" in text, text
    assert "never entered it; its last call was all_reduce #1" in text


def _detail(rank, world):
    records = _collect_logs()
    x = np.zeros(4, np.float32) if rank == 0 else np.full(4, 7.0, np.float32)
    dist.broadcast(x, src=0)                        # the root's tensor was never written
    y = np.array([1.0, np.nan, 3.0, np.inf], np.float32)
    dist.all_reduce(y)
    return records


def test_detail_logs_summaries_and_warns_about_sources(transport):
    out = run_ranks(2, _detail, timeout=30, env={"ACCORD_DEBUG": "DETAIL", **transport})
    r0 = "\n".join(m for _, m in out[0])
    r1 = "\n".join(m for _, m in out[1])
    assert "rank 0 broadcast #0 at test_debug.py:" in r0
    assert "before: tensor float32[4] min=0 max=0 mean=0 nan=0 inf=0" in r0
    assert "after: tensor float32[4] min=0 max=0" in r1      # rank 1 received the zeros
    warnings0 = [m for lvl, m in out[0] if lvl == "WARNING"]
    assert any("source tensor is all zeros" in m and "broadcast #0" in m for m in warnings0)
    # only the root's broadcast tensor is a source
    assert not any("broadcast" in m for lvl, m in out[1] if lvl == "WARNING")
    for recs in out:
        assert any(lvl == "WARNING" and "all_reduce #1" in m and "1 NaN and 1 Inf" in m
                   for lvl, m in recs)


def _detail_shapes(rank, world):
    x = np.ones((2, 3) if rank == 0 else (3, 2), np.float32)     # same bytes, other shape
    try:
        dist.all_reduce(x)
    except dist.Desync as e:
        return str(e)
    return "no error"


def test_detail_checks_full_shapes_on_every_rank(transport):
    out = run_ranks(2, _detail_shapes, timeout=30, env={"ACCORD_DEBUG": "DETAIL", **transport})
    for msg in out:
        assert "ACCORD_DEBUG=DETAIL: ranks disagree" in msg, msg
        assert "rank 0: all_reduce(tensor=float32[2, 3])" in msg
        assert "rank 1: all_reduce(tensor=float32[3, 2])" in msg
        assert "test_debug.py:" in msg


def _detail_every_collective(rank, world):
    records = _collect_logs()
    x = np.arange(4, dtype=np.float32) + rank
    dist.broadcast(x.copy(), src=1)
    dist.all_gather([np.zeros(4, np.float32) for _ in range(world)], x)
    dist.all_gather_into_tensor(np.zeros(4 * world, np.float32), x)
    dist.gather(x, [np.zeros(4, np.float32) for _ in range(world)] if rank == 1 else None, dst=1)
    dist.scatter(np.zeros(4, np.float32), [x] * world if rank == 0 else None, src=0)
    dist.reduce(x.copy(), dst=0)
    dist.all_reduce(x.copy())
    dist.reduce_scatter(np.zeros(4, np.float32), [x] * world)
    dist.reduce_scatter_tensor(np.zeros(2, np.float32), np.tile(x, world // 2 + 1)[:2 * world])
    dist.all_to_all([np.zeros(4, np.float32) for _ in range(world)], [x] * world)
    dist.all_to_all_single(np.zeros(2 * world, np.float32), np.tile(x, world)[:2 * world])
    dist.barrier(async_op=True).wait()
    dist.all_reduce(x.copy(), async_op=True).wait()          # through the group's worker
    return [m for _, m in records]


def test_detail_names_the_tensors_of_every_collective(transport):
    # each call hands its tensors to the check by name; both ranks agree, so no Desync
    out = run_ranks(2, _detail_every_collective, timeout=30,
                    env={"ACCORD_DEBUG": "DETAIL", **transport})
    expected = [("broadcast", "tensor"), ("all_gather", "tensor_list[1]"),
                ("all_gather_into_tensor", "output_tensor"), ("scatter", "tensor"),
                ("reduce", "tensor"), ("all_reduce", "tensor"),
                ("reduce_scatter", "input_list[0]"), ("reduce_scatter_tensor", "input"),
                ("all_to_all", "output_tensor_list[1]"), ("all_to_all_single", "output")]
    for rank, lines in enumerate(out):
        text = "\n".join(lines)
        for op, label in expected:
            assert f"rank {rank} {op} #" in text and f": {label} float32" in text, (op, label)
        gathered = [m for m in lines if " gather #" in m and "gather_list" in m]
        assert bool(gathered) == (rank == 1), gathered       # only the root has a list
        assert sum(" all_reduce #" in m and "before: tensor" in m for m in lines) == 2


def test_suspicious_heuristics():
    assert debug_detail.suspicious("float32", np.zeros(3, np.float32)).startswith("is all zeros")
    assert "denormal" in debug_detail.suspicious("float32", np.array([1e-41, 1.0], np.float32))
    assert debug_detail.suspicious("float32", np.ones(3, np.float32)) is None
    assert debug_detail.suspicious("int64", np.arange(3)) is None


def test_recorder_keeps_the_last_calls_in_a_ring_that_is_full_from_the_start():
    from accord.debug.recorder import DONE, SEQ, STATE, Recorder
    r = Recorder(size=4)
    assert r.as_dicts() == [] and r.find(0) is None      # nothing recorded yet
    assert len(r.entries) == 4                           # ... but the ring's room is taken
    for seq in range(10):
        e = r.add(seq, "all_reduce", -1, "float32", 4, (4,), "train.py:3")
        e[STATE] = DONE
        assert len(r.entries) == 4
    assert [d["seq"] for d in r.as_dicts()] == [6, 7, 8, 9]     # the last four, oldest first
    assert r.as_dicts()[0]["where"] == "train.py:3" and r.as_dicts()[0]["state"] == DONE
    assert r.find(7)[SEQ] == 7 and r.find(5) is None
    assert r.added == 10


def test_recorder_rewrites_done_entries_and_leaves_running_ones_alone():
    # a call still running (a receive waiting on a slow peer) keeps its entry while
    # later calls go round the ring; a done one's list is rewritten for a new call, so
    # a long loop of calls leaves nothing for the garbage collector
    import gc
    from accord.debug.recorder import DONE, FAILED, RUNNING, SEQ, STATE, T_END, Recorder
    r = Recorder(size=4)
    blanks = [id(e) for e in r.entries]
    slow = r.add(0, "irecv", 1, "", 8, None, "halo.py:7")
    slow[STATE] = RUNNING
    failed = r.add(1, "all_reduce", -1, "float32", 4, (4,), "train.py:3")
    failed[STATE] = FAILED
    for seq in range(2, 12):
        e = r.add(seq, "broadcast", 0, "float32", 2, (2,), "train.py:5")
        e[T_END] = 1.0
        e[STATE] = DONE
        r.last_done = e
    assert slow[SEQ] == 0 and slow[STATE] == RUNNING        # its record intact
    assert failed[SEQ] == 1 and failed[STATE] == FAILED
    assert [d["seq"] for d in r.as_dicts()] == [8, 9, 10, 11]
    assert all(d["t_issue"] is None and d["error"] is None for d in r.as_dicts())
    # the two blanks the first calls did not take, and the lists of done calls,
    # went round again: every entry now is one of the ring's own lists but two
    assert sum(id(e) in blanks for e in r.entries) == 2
    gc.collect()                     # every entry now in the collector's oldest generation
    for seq in range(12, 1012):
        e = r.add(seq, "broadcast", 0, "float32", 2, (2,), "train.py:5")
        e[STATE] = DONE
        r.last_done = e
    young = {id(o) for o in gc.get_objects(generation=0)}
    assert not any(id(e) in young for e in r.entries)        # no list made per call
    assert [d["seq"] for d in r.as_dicts()] == [1008, 1009, 1010, 1011]
