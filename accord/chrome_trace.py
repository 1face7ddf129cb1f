"""accord's flight recorder in the Chrome trace format (chrome://tracing, Perfetto).

The same format torch.profiler's `export_chrome_trace` writes, so a job without
torch gets a timeline too: one complete event ("ph": "X") per recorded call,
named `accord:<op>` as the torch backend's profiler events are, on a track per
rank (pid) and group (tid), with the call's sequence number, dtype, shape,
size (`count`: what ranks compare, bytes for most collectives), call site,
state and error as its args. Times are wall clock
(the recorder's), so the ranks of a host line up.

    import accord.chrome_trace as ct
    ct.export_chrome_trace("trace-rank0.json")          # this process, now
    ct.merge_dumps(os.environ["ACCORD_TRACE_DIR"], "job.json")   # every rank's dump
"""
from __future__ import annotations

import json
import os
from typing import Dict, Iterable, List, Optional

from . import debug


def _event(rank: int, group: str, op: Dict) -> Optional[Dict]:
    start = op.get("t_start") or op.get("t_issue")
    if start is None:
        return None
    end = op.get("t_end")
    args = {k: op.get(k) for k in ("seq", "dtype", "count", "shape", "root", "where", "state")
            if op.get(k) not in (None, "")}
    if op.get("error"):
        args["error"] = op["error"]
    if op.get("t_issue") is not None and op.get("t_start") is not None:
        args["queued_us"] = round((op["t_start"] - op["t_issue"]) * 1e6, 3)
    return {"name": f"accord:{op.get('op')}", "cat": "accord", "ph": "X",
            "ts": round(start * 1e6, 3),
            "dur": round(((end if end is not None else start) - start) * 1e6, 3),
            "pid": rank, "tid": group, "args": args}


def trace_events(dumps: Iterable[Dict]) -> List[Dict]:
    """Chrome trace events of flight-recorder dumps (dicts as `debug.dump` writes)."""
    meta, events = [], []
    for d in dumps:
        rank = int(d["rank"])
        meta.append({"name": "process_name", "ph": "M", "pid": rank,
                     "args": {"name": f"rank {rank}"}})
        for name, g in d["groups"].items():
            for op in g["ops"]:
                e = _event(rank, name, op)
                if e is not None:
                    events.append(e)
    events.sort(key=lambda e: (e["pid"], e["ts"]))
    return meta + events


def _write(path: str, events: List[Dict]) -> str:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f, default=str)
    os.replace(tmp, path)
    return path


def export_chrome_trace(path: str, groups=None) -> str:
    """Write this process's flight recorder (its groups', or those given) to path.

    Returns path. Calls still running appear with zero duration.
    """
    groups = debug.live_groups() if groups is None else list(groups)
    by_rank: Dict[int, Dict] = {}
    for g in groups:
        d = by_rank.setdefault(g.global_rank, {"rank": g.global_rank, "groups": {}})
        d["groups"][g.name] = {"ops": g.recorder.as_dicts()}
    return _write(path, trace_events(by_rank.values()))


def merge_dumps(trace_dir: str, path: str) -> str:
    """One Chrome trace of every rank's flight-recorder dump in trace_dir
    (ACCORD_TRACE_DIR: written on errors, timeouts and SIGUSR1). Returns path."""
    return _write(path, trace_events(debug.load_dumps(trace_dir).values()))
