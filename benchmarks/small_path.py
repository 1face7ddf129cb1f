"""The 8-byte path: how long one small call takes, and where the time goes.

    .venv/bin/python benchmarks/small_path.py [-n 2] [--iters 5000] [--ops broadcast,...]
                                              [--transport shm|tcp] [--top 12]

For each op (broadcast, all_reduce, all_gather, scatter, barrier, a blocking
send/recv ping-pong, the same with rank 0 receiving from any rank, and a window: rank 0 isends WINDOW messages that rank 1
irecvs, then waits for all and an ack, osu_bw's pattern), on one float32 element
(8 bytes for the point-to-point messages of two elements; the window's latency
is per message):

1. latency: 7 blocks of --iters calls, each block after a barrier; a block's
   time is the slowest rank's mean call time; the median block is shown;
2. breakdown: the same call --iters/5 times under cProfile on every rank (so
   the ranks stay in step); rank 0's profile gives the Python function calls
   one operation makes, and the functions that take the most time in their
   own code (tottime), per operation. Profiled times are inflated by the
   profiler itself (roughly 2-3x here); read them as shares, not as latency.

A thread sleeping in the kernel (futex) shows as time in the function that
made the system call, so the profile also tells spinning from waiting.
One `accord run -n N` of this file with --worker does the work.

--parts instead times, on rank 0 alone, each piece an 8-byte broadcast is made
of (argument checks, call site, stamp, flight-recorder entry, the call's Comm,
a whole call on a group of one, which moves nothing) in a loop of its own: the
minimum over 7 repeats of 20000 calls, which a busy machine barely moves, so it
is the breakdown to read while others share the cores.
"""
import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPS = ("broadcast", "all_reduce", "all_gather", "scatter", "barrier", "pingpong", "anysource",
       "window")
BLOCKS = 7
WINDOW = 64


def make_call(op, rank, world):
    import numpy as np

    import accord

    x = np.ones(1, np.float32)
    if op == "broadcast":
        return lambda: accord.broadcast(x, src=0)
    if op == "all_reduce":
        z = np.zeros(1, np.float32)      # stays finite however many sums
        return lambda: accord.all_reduce(z)
    if op == "all_gather":
        outs = [np.empty(1, np.float32) for _ in range(world)]
        return lambda: accord.all_gather(outs, x)
    if op == "scatter":
        ins = [np.ones(1, np.float32) for _ in range(world)] if rank == 0 else None
        return lambda: accord.scatter(x, ins, src=0)
    if op == "barrier":
        return accord.barrier
    if op in ("pingpong", "anysource"):
        m = np.ones(2, np.float32)
        peer = 1 - rank if rank < 2 else None
        if peer is None:
            return lambda: None
        src = None if op == "anysource" else 1       # rank 0 receives from any rank
        if rank == 0:
            def call():
                accord.send(m, 1)
                accord.recv(m, src)
        else:
            def call():
                accord.recv(m, 0)
                accord.send(m, 0)
        return call
    if op == "window":
        m, ack = np.ones(2, np.float32), np.ones(1, np.float32)
        if rank == 0:
            def call():
                works = [accord.isend(m, 1, tag=1) for _ in range(WINDOW)]
                for w in works:
                    w.wait()
                accord.recv(ack, 1, tag=2)
        elif rank == 1:
            def call():
                works = [accord.irecv(m, 0, tag=1) for _ in range(WINDOW)]
                for w in works:
                    w.wait()
                accord.send(ack, 0, tag=2)
        else:
            return lambda: None
        return call
    raise ValueError(f"unknown op {op!r}")


def slowest(t):
    import numpy as np

    import accord
    a = np.array([t], np.float64)
    accord.all_reduce(a, op=accord.ReduceOp.MAX)
    return float(a[0])


def parts():
    """[(piece, ns a call)] of an 8-byte broadcast on the default group, each timed alone."""
    import numpy as np

    import accord
    from accord import debug, plans
    from accord.algorithms import Comm
    from accord.args import root_rank
    from accord.buffers import as_buf
    from accord.transport.wire import OP_CODES, Stamp
    from accord.world import resolve_group

    g = resolve_group(None)
    solo = accord.new_group([0])        # every rank makes it; only rank 0 is a member
    x = np.ones(1, np.float32)
    buf = as_buf(x, "tensor")
    op = OP_CODES["broadcast"]
    t = g.transport
    pieces = [
        ("resolve_group + is_member", lambda: resolve_group(None).is_member),
        ("root_rank (src=0)", lambda: root_rank(g, 0, None, "src")),
        ("as_buf (numpy, 1 elem)", lambda: as_buf(x, "tensor", writable=False)),
        ("plans.broadcast_run", lambda: plans.broadcast_run(g, buf, 0, finish=True)),
        ("debug.call_site", debug.call_site),
        ("debug.on_main_thread", debug.on_main_thread),
        ("Stamp()", lambda: Stamp(op, 1, 0, 11, 0, 4, "float32", (1,), 5, "x.py:1")),
        ("recorder.add", lambda: g.recorder.add(1, "broadcast", 0, "float32", 4, (1,), "x.py:1")),
        ("Comm()", lambda: Comm(t, None, 0.0)),
        ("time.monotonic + time.time", lambda: (time.monotonic(), time.time())),
        ("broadcast on a group of one", lambda: accord.broadcast(x, src=0, group=solo)),
    ]
    out = []
    for name, fn in pieces:
        for _ in range(1000):
            fn()
        best = float("inf")
        for _ in range(7):
            t0 = time.perf_counter_ns()
            for _ in range(20000):
                fn()
            best = min(best, (time.perf_counter_ns() - t0) / 20000)
        out.append((name, best))
    return out


def worker(ops, iters, top, with_parts=False):
    import accord

    accord.init_process_group()
    rank, world = accord.get_rank(), accord.get_world_size()
    if with_parts:
        if rank == 0:
            rows = parts()
            print(json.dumps({"parts": rows}), flush=True)
        else:
            accord.new_group([0])
        accord.barrier()
        accord.destroy_process_group()
        return
    all_iters = iters
    for op in ops:
        call = make_call(op, rank, world)
        # a ping-pong call is a round trip: its one-way latency is half of it; a
        # window's latency, calls and times are per message (and it makes fewer calls)
        per_msg = {"pingpong": 2, "anysource": 2, "window": WINDOW}.get(op, 1)
        iters = max(10, all_iters // WINDOW) if op == "window" else all_iters
        for _ in range(min(iters, 500)):
            call()
        blocks = []
        for _ in range(BLOCKS):
            accord.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                call()
            blocks.append(slowest((time.perf_counter() - t0) / iters))
        latency_us = statistics.median(blocks) / per_msg * 1e6

        n = max(iters // 5, 100 if op != "window" else 20)
        accord.barrier()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(n):
            call()
        prof.disable()
        accord.barrier()
        if rank == 0:
            st = pstats.Stats(prof)
            total_calls = sum(v[1] for v in st.stats.values())
            rows = sorted(st.stats.items(), key=lambda kv: kv[1][2], reverse=True)
            funcs = []
            k = n * (per_msg if op == "window" else 1)
            for (path, line, name), (_cc, nc, tt, ct, _callers) in rows[:top]:
                where = os.path.relpath(path, ROOT) if path.startswith(ROOT) else os.path.basename(path)
                funcs.append({"func": f"{where}:{line}({name})", "calls": nc / k,
                              "own_us": tt / k * 1e6, "cum_us": ct / k * 1e6})
            print(json.dumps({"op": op, "world": world, "latency_us": latency_us,
                              "calls_per_op": total_calls / k, "profiled_us": st.total_tt / k * 1e6,
                              "top": funcs}), flush=True)
    accord.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=2, help="world size (default 2)")
    ap.add_argument("--iters", type=int, default=5000, help="calls per timed block (default 5000)")
    ap.add_argument("--ops", default=",".join(OPS), help="comma list (default: all)")
    ap.add_argument("--transport", choices=("shm", "tcp"), default=None)
    ap.add_argument("--top", type=int, default=12, help="functions shown per op (default 12)")
    ap.add_argument("--json", action="store_true", help="print the raw JSON lines")
    ap.add_argument("--parts", action="store_true",
                    help="time each piece of an 8-byte broadcast alone instead (see above)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    ops = [o for o in a.ops.split(",") if o]
    for o in ops:
        if o not in OPS:
            ap.error(f"unknown op {o!r}; choose from {', '.join(OPS)}")
    if a.worker:
        worker(ops, a.iters, a.top, a.parts)
        return
    env = dict(os.environ)
    if a.transport:
        env["ACCORD_TRANSPORT"] = a.transport
    cmd = [sys.executable, "-m", "accord", "run", "-n", str(a.n), os.path.abspath(__file__),
           "--worker", "--ops", ",".join(ops), "--iters", str(a.iters), "--top", str(a.top)]
    if a.parts:
        cmd.append("--parts")
    out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=True).stdout
    load = os.getloadavg()
    print(f"# {' '.join(sys.argv)}   (world {a.n}, {a.transport or 'default'} transport, "
          f"load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f})")
    for line in out.splitlines():
        line = line.split("] ", 1)[-1] if line.startswith("[rank") else line
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        if "parts" in r:
            print(f"\n{'ns a call':>10}  piece of an 8-byte broadcast (each alone, min of 7 x 20000)")
            for name, ns in r["parts"]:
                print(f"{ns:10.0f}  {name}")
            continue
        if a.json:
            print(line)
            continue
        unit = "message" if r["op"] == "window" else "call"
        print(f"\n## {r['op']}: {r['latency_us']:.1f} µs a {unit} (median block); "
              f"{r['calls_per_op']:.0f} Python calls a {unit}; profiled {r['profiled_us']:.1f} µs")
        print(f"{'calls':>6} {'own µs':>7} {'cum µs':>7}  function")
        for f in r["top"]:
            print(f"{f['calls']:6.1f} {f['own_us']:7.2f} {f['cum_us']:7.2f}  {f['func']}")


if __name__ == "__main__":
    main()
