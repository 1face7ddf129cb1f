"""Async overlap: compute + async all_reduce in parallel vs one after the other.

    .venv/bin/python benchmarks/bench_overlap.py [-n 2,4] [--mib 16] [--repeat 7]

Each step all-reduces a gradient-sized float32 array (--mib MiB) and runs a
numpy compute kernel sized to take about as long as that all_reduce alone.
Sequential: all_reduce, then compute. Overlapped: all_reduce(async_op=True),
compute on the caller's thread, then work.wait(). The table gives the median
step time (the slowest rank's) for communication alone, compute alone, both
sequential and both overlapped; perfect overlap would make the last equal the
larger of the first two. One BLAS thread per rank (OMP_NUM_THREADS=1).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker(mib, repeat):
    import numpy as np

    import accord

    accord.init_process_group()
    rank, world = accord.get_rank(), accord.get_world_size()
    grad = np.ones((mib << 20) // 4, np.float32)
    rng = np.random.default_rng(rank)
    a, b = rng.standard_normal((256, 256)), rng.standard_normal((256, 256)) / 16

    def compute(reps):
        x = a
        for _ in range(reps):
            x = np.tanh(x @ b)

    def comm():
        accord.all_reduce(grad)

    def timed(fn):
        accord.barrier()
        t0 = time.perf_counter()
        fn()
        t = np.array([time.perf_counter() - t0])
        accord.all_reduce(t, op=accord.ReduceOp.MAX)
        return float(t[0])

    comm_t = statistics.median(timed(comm) for _ in range(5))
    t0 = time.perf_counter()
    compute(20)
    per = (time.perf_counter() - t0) / 20
    reps = np.array([max(1, int(comm_t / per))])
    accord.broadcast(reps, src=0)           # every rank computes the same amount
    reps = int(reps[0])

    def sequential():
        accord.all_reduce(grad)
        compute(reps)

    def overlapped():
        w = accord.all_reduce(grad, async_op=True)
        compute(reps)
        w.wait()

    rows = {"all_reduce alone": comm, "compute alone": lambda: compute(reps),
            "sequential: all_reduce, then compute": sequential,
            "overlapped: async all_reduce + compute": overlapped}
    times = {k: [] for k in rows}
    for _ in range(repeat):
        for k, fn in rows.items():
            times[k].append(timed(fn))
    if rank == 0:
        print("RESULT " + json.dumps({"world": world, "mib": mib, "times": times}), flush=True)
    accord.destroy_process_group()


def table(results, command):
    lines = [f"`{command}`", "", "| world | step | ms (median) |", "|---:|---|---:|"]
    for res in results:
        med = {k: statistics.median(v) * 1e3 for k, v in res["times"].items()}
        for k, v in med.items():
            lines.append(f"| {res['world']} | {k} ({res['mib']} MiB float32) | {v:.1f} |")
        seq = med["sequential: all_reduce, then compute"]
        ovl = med["overlapped: async all_reduce + compute"]
        lines.append(f"| {res['world']} | overlapped vs sequential | {seq / ovl:.2f}x |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", default="2,4")
    ap.add_argument("--mib", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--out", default=os.path.join("benchmarks", "results", "overlap.md"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.mib, args.repeat)
        return 0
    command = "python benchmarks/bench_overlap.py " + " ".join(sys.argv[1:])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    results = []
    for n in [int(x) for x in args.n.split(",")]:
        cmd = [sys.executable, "-m", "accord", "run", "-n", str(n), os.path.abspath(__file__),
               "--worker", "--mib", str(args.mib), "--repeat", str(args.repeat)]
        out = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
        if out.returncode:
            print(out.stdout)
            return out.returncode
        results += [json.loads(l.split("RESULT ", 1)[1]) for l in out.stdout.splitlines()
                    if "RESULT " in l]
    md = table(results, command)
    print(md)
    os.makedirs(os.path.dirname(os.path.join(ROOT, args.out)), exist_ok=True)
    with open(os.path.join(ROOT, args.out), "w") as f:
        f.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
