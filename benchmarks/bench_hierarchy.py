"""Hierarchical vs flat collectives on a group spanning simulated hosts.

    accord run -n 4 benchmarks/bench_hierarchy.py [--per-host 2]

Each rank takes ACCORD_HOST_ID = its rank // per-host, so 4 ranks form 2 "hosts" of
2. With ACCORD_TRANSPORT=auto (the default) the default group gets per-host
shared-memory subgroups and leaders over TCP (accord/hierarchy.py); run it again
with ACCORD_TRANSPORT=tcp for the flat TCP algorithms. Rank 0 prints the median
time per op (the slowest rank's, over blocks of calls).
"""
import argparse
import os
import sys

import numpy as np

from worlds import slowest_per_call


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--per-host", type=int, default=2)
    ap.add_argument("--sizes", default="1K,1M,16M", help="bytes per rank")
    ap.add_argument("--blocks", type=int, default=7)
    args = ap.parse_args()
    rank = int(os.environ["RANK"])
    os.environ["ACCORD_HOST_ID"] = f"host{rank // args.per_host}"
    import accord as dist
    dist.init_process_group()
    g = dist.world.default_group()
    mode = ("per-host subgroups (hierarchical above accord.hierarchy.MIN_BYTES)"
            if g.hier is not None else "flat " + type(g.transport).__name__)
    units = {"K": 1 << 10, "M": 1 << 20}
    rows = []
    np.seterr(over="ignore")        # repeated in-place sums of ones overflow; timing is the point
    for s in args.sizes.split(","):
        nbytes = int(s[:-1]) * units[s[-1]] if s[-1] in units else int(s)
        x = np.ones(nbytes // 4, np.float32)
        gathered = np.empty(x.size * dist.get_world_size(), np.float32)
        reps = max(2, min(200, (64 << 20) // max(nbytes, 1) // 8))
        for name, fn in (("broadcast", lambda: dist.broadcast(x, src=0)),
                         ("all_reduce", lambda: dist.all_reduce(x)),
                         ("all_gather", lambda: dist.all_gather_into_tensor(gathered, x)),
                         ("reduce_scatter", lambda: dist.reduce_scatter_tensor(x, gathered)),
                         ("barrier", dist.barrier)):
            fn()
            times = [slowest_per_call(fn, reps) for _ in range(args.blocks)]
            rows.append((name, s if name != "barrier" else "-", np.median(times) * 1e6))
    if rank == 0:
        print(f"{mode}, {dist.get_world_size()} ranks, {args.per_host} per host")
        for name, s, us in rows:
            print(f"  {name:14s} {s:>4s} {us:10.1f} us")
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
