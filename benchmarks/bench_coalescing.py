"""Many small collectives: a plain loop of calls vs the same calls in `accord.coalescing()`.

    .venv/bin/python benchmarks/bench_coalescing.py [-n 2] [--tensors 10,100,300]
        [--range 256,4096] [--ops broadcast,all_reduce] [--repeat 7] [--calls 20]

Every rank holds N float32 torch tensors of geometric sizes between the two byte
counts of --range (a model's small parameters). A round times --calls
back-to-back repetitions of one method and divides by --calls; the slowest rank
counts (a barrier before, the max over ranks after). The two methods alternate
round by round (loop first in even rounds, the block first in odd ones), so a
burst of outside load lands on both; the table gives each one's median round
and their ratio. Results are checked after every round.

    loop        for t in tensors: accord.<op>(t)
    coalesced   with accord.coalescing(): for t in tensors: accord.<op>(t)

(all_reduce with ReduceOp.AVG, as a model's averaging does, so that repeated
calls keep the values exact.)

One `accord run -n N` of this file with --worker does the work.
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sizes(n, lo, hi):
    return [max(1, int(lo * (hi / lo) ** (i / max(1, n - 1))) // 4) for i in range(n)]


def worker(args):
    import numpy as np
    import torch

    import accord

    accord.init_process_group()
    rank, world = accord.get_rank(), accord.get_world_size()
    lo, hi = (int(x) for x in args.range.split(","))
    rows = []
    for n in (int(x) for x in args.tensors.split(",")):
        ts = [torch.empty(k) for k in sizes(n, lo, hi)]
        for op in args.ops.split(","):
            def reset():
                for i, t in enumerate(ts):
                    t.fill_(rank + 1 if op == "all_reduce" else (i if rank == 0 else -1))

            def check():
                for i, t in enumerate(ts):
                    # the mean is where repetitions stay (a sum would grow past float32's
                    # exact integers)
                    want = float(i) if op == "broadcast" else (world + 1) / 2
                    if not bool((t == want).all()):
                        raise AssertionError(f"{op} rank {rank}: tensor {i} holds "
                                             f"{t[0].item()}, expected {want}")

            def call(t):
                if op == "broadcast":
                    accord.broadcast(t, src=0)
                else:
                    accord.all_reduce(t, op=accord.ReduceOp.AVG)

            def loop():
                for t in ts:
                    call(t)

            def coalesced():
                with accord.coalescing():
                    for t in ts:
                        call(t)

            methods = [("loop", loop), ("coalesced", coalesced)]
            times = {name: [] for name, _ in methods}
            for rnd in range(args.repeat + 1):           # round 0 warms up
                order = methods if rnd % 2 == 0 else methods[::-1]
                for name, fn in order:
                    reset()
                    accord.barrier()
                    t0 = time.perf_counter()
                    for _ in range(args.calls):
                        fn()
                    mine = np.array([(time.perf_counter() - t0) / args.calls])
                    accord.all_reduce(mine, op=accord.ReduceOp.MAX)
                    check()
                    if rnd:
                        times[name].append(float(mine[0]))
            loop_t = statistics.median(times["loop"])
            coal_t = statistics.median(times["coalesced"])
            rows.append((n, op, sum(t.numel() * 4 for t in ts), loop_t, coal_t))
    if rank == 0:
        print(f"| world | tensors ({lo} B-{hi} B) | op | bytes | loop µs | coalesced µs | "
              f"loop / coalesced |")
        print("|---:|---:|---|---:|---:|---:|---:|")
        for n, op, nbytes, a, b in rows:
            print(f"| {world} | {n} | {op} | {nbytes} | {a * 1e6:.1f} | {b * 1e6:.1f} | "
                  f"{a / b:.2f}x |")
        sys.stdout.flush()
    accord.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-n", type=int, default=2, help="world size (default 2)")
    p.add_argument("--tensors", default="10,100,300", help="tensor counts (default 10,100,300)")
    p.add_argument("--range", default="256,4096",
                   help="smallest,largest tensor in bytes (default 256,4096)")
    p.add_argument("--ops", default="broadcast,all_reduce")
    p.add_argument("--repeat", type=int, default=7, help="timed rounds a method (default 7)")
    p.add_argument("--calls", type=int, default=20, help="repetitions a round (default 20)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    load = os.getloadavg()
    cmd = [sys.executable, "-m", "accord", "run", "--no-prefix", "-n", str(args.n), __file__,
           "--worker"] + sys.argv[1:]
    print(f"`python benchmarks/bench_coalescing.py {' '.join(sys.argv[1:])}`\n")
    sys.stdout.flush()
    rc = subprocess.call(cmd, cwd=ROOT)
    end = os.getloadavg()
    print(f"\nload average {load[0]:.2f} at the start, {end[0]:.2f} at the end")
    return rc


if __name__ == "__main__":
    sys.exit(main())
