"""One collective, one size, several forced algorithms: time and CPU per call, side by side.

    .venv/bin/python benchmarks/algorithms.py -n 4 --op all_gather --size 1M \
        --algorithms slotted,doubling [--calls 300] [--rounds 3]

Each round runs every algorithm once, in turn (`accord run -n N` of this file with
ACCORD_ALGORITHMS=op=algorithm), so a machine whose speed drifts over minutes
drifts for all of them alike. A run: 20 calls to warm up, a barrier, then --calls
calls back to back; its time is the slowest rank's mean wall time per call, its
CPU the ranks' mean process CPU time per call (where ranks outnumber cores the
wall time follows the CPU every rank spends). The table gives each round's
figures and the median, and the ratio of each algorithm's median time to the
first's. --size is per rank (as `accord bench`: an all_gather's output is n
times it). An algorithm that cannot run at that size or on that transport leaves
the default choice (ACCORD_ALGORITHMS' rule): the worker prints which ran.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

OPS = ("broadcast", "all_gather", "all_reduce")


def worker(op, nbytes, calls):
    import numpy as np

    import accord
    from accord.algorithms import table

    accord.init_process_group()
    rank, world = accord.get_rank(), accord.get_world_size()
    # written, not np.zeros: calloc's untouched pages all read the one zero page, which
    # flatters every copy out of x; zeros for all_reduce, so sums stay finite
    x = np.full(nbytes // 4, 0.0 if op == "all_reduce" else rank + 1, np.float32)
    outs = [np.empty_like(x) for _ in range(world)]
    call = {"broadcast": lambda: accord.broadcast(x, src=0),
            "all_gather": lambda: accord.all_gather(outs, x),
            "all_reduce": lambda: accord.all_reduce(x)}[op]
    ran = []
    entries = table.ALGORITHMS[op]
    saved = dict(entries)
    for name, e in saved.items():
        def spy(*args, _fn=e.fn, _name=name, **kwargs):
            if not ran:
                ran.append(_name)
            return _fn(*args, **kwargs)
        entries[name] = e._replace(fn=spy)
    for _ in range(20):
        call()
    accord.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(calls):
        call()
    wall = (time.perf_counter() - t0) / calls
    cpu = (time.process_time() - c0) / calls
    walls = np.zeros(world)
    cpus = np.zeros(world)
    walls[rank], cpus[rank] = wall, cpu
    accord.all_reduce(walls)
    accord.all_reduce(cpus)
    if rank == 0:
        print(json.dumps({"ran": ran[0] if ran else "?", "us": float(walls.max()) * 1e6,
                          "cpu_us": float(cpus.mean()) * 1e6}), flush=True)
    accord.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=4, help="world size (default 4)")
    ap.add_argument("--op", choices=OPS, required=True)
    ap.add_argument("--size", default="1M", help="bytes per rank (default 1M)")
    ap.add_argument("--algorithms", required=True, help="comma list, the first is the base")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    from accord.cli.bench import parse_size
    nbytes = parse_size(a.size)
    if a.worker:
        worker(a.op, nbytes, a.calls)
        return
    algos = [x for x in a.algorithms.split(",") if x]
    load0 = os.getloadavg()
    got = {name: [] for name in algos}
    ran = {}
    for _ in range(a.rounds):
        for name in algos:
            env = dict(os.environ, ACCORD_ALGORITHMS=f"{a.op}={name}")
            cmd = [sys.executable, "-m", "accord", "run", "-n", str(a.n),
                   os.path.abspath(__file__), "--worker", "--op", a.op, "--size", a.size,
                   "--algorithms", a.algorithms, "--calls", str(a.calls)]
            out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True,
                                 check=True).stdout
            for line in out.splitlines():
                line = line.split("] ", 1)[-1]
                if line.startswith("{"):
                    r = json.loads(line)
                    got[name].append((r["us"], r["cpu_us"]))
                    ran[name] = r["ran"]
    load1 = os.getloadavg()
    print(f"# {' '.join(sys.argv)}")
    print(f"# world {a.n}, {a.op} of {nbytes} bytes a rank, {a.calls} calls a run; "
          f"load {load0[0]:.2f} at the start, {load1[0]:.2f} at the end")
    base = statistics.median(t for t, _ in got[algos[0]])
    print(f"{'algorithm':>12} {'ran':>12}  {'µs a call, each round':<32} {'median':>8} "
          f"{'CPU µs':>7} {'time/base':>9}")
    for name in algos:
        ts = [t for t, _ in got[name]]
        med = statistics.median(ts)
        cpu = statistics.median(c for _, c in got[name])
        rounds = " ".join(f"{t:.1f}" for t in ts)
        print(f"{name:>12} {ran.get(name, '?'):>12}  {rounds:<32} {med:8.1f} {cpu:7.1f} "
              f"{med / base:8.2f}x")


if __name__ == "__main__":
    main()
