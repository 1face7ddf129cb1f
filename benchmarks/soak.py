"""Soak: random collectives and point-to-point for a while, every result checked exactly.

    accord run -n 4 benchmarks/soak.py --duration 600            # shared memory
    ACCORD_TRANSPORT=tcp accord run -n 4 benchmarks/soak.py --duration 600

Every rank draws the same random program (one seed): all_reduce, broadcast
from a random root, all_gather, reduce_scatter, all_to_all, a ring of
isend/irecv, an all_reduce on a random subgroup, async all_reduces waited
together; sizes log-uniform from 0 B to --max-bytes (16 MiB), integer dtypes
(and float64 holding integers) so every expected value is exact. Rank 0
prints one JSON line: ops, ops/s, wrong results, peak RSS per rank over time
(after warm-up and at the end), open file descriptors and threads after
warm-up and at the end, and which of its groups' shared-memory arenas are
still in /dev/shm at the end (none over TCP, which makes none). With
--json FILE it also writes that line there. The exit status is 1 when any
result was wrong or something leaked.
"""
import argparse
import json
import os
import sys
import threading
import time

import numpy as np

import accord

_DTYPES = (np.int64, np.int32, np.float64, np.uint8)


def _rss_kib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _fds():
    return len(os.listdir("/proc/self/fd"))


def _value(dtype, rank, salt):
    # small values: sums over 4 ranks stay exact in every dtype (uint8 included)
    return dtype((rank * 7 + salt) % 50)


def _one_op(rng, rank, world, subgroups, max_bytes):
    """Run one random op; return the number of wrong results it produced."""
    dtype = _DTYPES[rng.integers(len(_DTYPES))]
    item = np.dtype(dtype).itemsize
    nbytes = 0 if rng.random() < 0.05 else int(np.exp(rng.uniform(0, np.log(max_bytes))))
    n = max(0, nbytes // item)
    salt = int(rng.integers(1000))
    op = rng.integers(8)
    vals = [_value(dtype, r, salt) for r in range(world)]
    if op == 0:
        x = np.full(n, vals[rank], dtype)
        accord.all_reduce(x)
        return int(not (x == dtype(sum(int(v) for v in vals))).all())
    if op == 1:
        root = int(rng.integers(world))
        x = np.full(n, vals[rank], dtype)
        accord.broadcast(x, src=root)
        return int(not (x == vals[root]).all())
    if op == 2:
        k = n // world
        outs = [np.empty(k, dtype) for _ in range(world)]
        accord.all_gather(outs, np.full(k, vals[rank], dtype))
        return int(not all((o == vals[r]).all() for r, o in enumerate(outs)))
    if op == 3:
        k = n // world
        out = np.empty(k, dtype)
        accord.reduce_scatter(out, [np.full(k, vals[rank], dtype) for _ in range(world)])
        return int(not (out == dtype(sum(int(v) for v in vals))).all())
    if op == 4:
        k = n // world
        ins = [np.full(k, vals[rank] + r, dtype) for r in range(world)]
        outs = [np.empty(k, dtype) for _ in range(world)]
        accord.all_to_all(outs, ins)
        return int(not all((o == dtype(vals[r] + rank)).all() for r, o in enumerate(outs)))
    if op == 5:
        tag = int(rng.integers(100))
        right, left = (rank + 1) % world, (rank - 1) % world
        got = np.empty(n, dtype)
        works = [accord.irecv(got, src=left, tag=tag),
                 accord.isend(np.full(n, vals[rank], dtype), dst=right, tag=tag)]
        for w in works:
            w.wait()
        return int(not (got == vals[left]).all())
    if op == 6:
        members, g = subgroups[int(rng.integers(len(subgroups)))]
        if rank not in members:
            return 0
        x = np.full(n, vals[rank], dtype)
        accord.all_reduce(x, group=g)
        return int(not (x == dtype(sum(int(vals[r]) for r in members))).all())
    xs = [np.full(max(1, n // 4), vals[rank], dtype) for _ in range(3)]
    works = [accord.all_reduce(x, async_op=True) for x in xs]
    for w in works:
        w.wait()
    want = dtype(sum(int(v) for v in vals))
    return sum(int(not (x == want).all()) for x in xs)


def shm_left(report, settle_s=2.0):
    """The shared-memory arenas of this job's groups still in /dev/shm (every rank
    unlinks its group's name once all have mapped it; waits up to settle_s for
    ranks still leaving). Another job's segments are not counted."""
    paths = sorted({p for e in report["ranks"] for p in e["arenas"]})
    end = time.monotonic() + settle_s
    while True:
        left = [p for p in paths if os.path.exists(p)]
        if not left or time.monotonic() >= end:
            return left
        time.sleep(0.1)


def soak(duration, max_bytes=16 << 20, seed=1234, sample_s=5.0):
    """Run the soak in an initialised job for `duration` seconds; return the report
    (rank 0's: every rank's figures gathered), or None on other ranks."""
    rank, world = accord.get_rank(), accord.get_world_size()
    subgroups = [(m, accord.new_group(m)) for m in
                 ([0, 1], list(range(world))[1:], list(range(0, world, 2)))]
    rng = np.random.default_rng(seed)
    ops = wrong = 0
    t0 = time.monotonic()
    warm_rss = None
    rss = []
    next_sample = t0 + sample_s
    flag = np.zeros(1, np.int64)
    while True:
        if ops % 20 == 0:
            flag[0] = int(time.monotonic() - t0 < duration) if rank == 0 else 0
            accord.broadcast(flag, src=0)
            if not flag[0]:
                break
        wrong += _one_op(rng, rank, world, subgroups, max_bytes)
        ops += 1
        now = time.monotonic()
        if now >= next_sample:
            rss.append(_rss_kib())
            if warm_rss is None and now - t0 >= min(30.0, duration / 4):
                # after warm-up: every group, thread and buffer pool exists by now
                warm_rss, fds0, threads0 = max(rss), _fds(), threading.active_count()
            next_sample = now + sample_s
    elapsed = time.monotonic() - t0
    fds1, threads1 = _fds(), threading.active_count()
    arenas = sorted({getattr(g.transport, "arena_path", "") for g in
                     [accord.world.default_group()] + [g for _, g in subgroups if g is not None]
                     if g.transport is not None} - {""})
    if warm_rss is None:
        fds0, threads0 = fds1, threads1
    for _, g in subgroups:
        if g is not None:
            accord.destroy_process_group(g)
    accord.barrier()
    mine = {"rank": rank, "ops": ops, "wrong": wrong, "rss_kib": rss or [_rss_kib()],
            "warm_rss_kib": warm_rss or _rss_kib(), "end_rss_kib": _rss_kib(),
            "fds": [fds0, fds1], "threads": [threads0, threads1], "arenas": arenas}
    every = [None] * world
    accord.all_gather_object(every, mine)
    if rank != 0:
        return None
    return {"world": world, "transport": os.environ.get("ACCORD_TRANSPORT", "auto"),
            "seconds": round(elapsed, 1), "ops": ops, "ops_per_s": round(ops / elapsed, 1),
            "wrong": sum(e["wrong"] for e in every),
            "rss_growth_after_warmup": max(
                (max(e["rss_kib"]) - e["warm_rss_kib"]) / e["warm_rss_kib"] for e in every),
            "ranks": every}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=60.0, help="seconds (default 60)")
    p.add_argument("--max-bytes", type=int, default=16 << 20, help="largest message (16 MiB)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", default=None, help="also write rank 0's report here")
    args = p.parse_args(argv)
    accord.init_process_group()
    report = soak(args.duration, args.max_bytes, args.seed)
    rank = accord.get_rank()
    accord.destroy_process_group()
    if report is None:
        return 0
    report["shm_left"] = shm_left(report)
    leaks = [e for e in report["ranks"] if e["fds"][0] != e["fds"][1]
             or e["threads"][0] != e["threads"][1]]
    report["leaks"] = bool(leaks)
    line = json.dumps(report)
    print(line, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            f.write(line + "\n")
    return 1 if report["wrong"] or report["shm_left"] or leaks else 0


if __name__ == "__main__":
    sys.exit(main())
