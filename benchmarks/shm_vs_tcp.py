"""accord over shared memory vs accord over TCP, side by side, on this host.

    .venv/bin/python benchmarks/shm_vs_tcp.py [--worlds 2,4] [--sizes 16M,64M] [--iters 5]

Prints 8-byte broadcast and barrier latency (µs, mean over many calls, the
slowest rank) and broadcast / all_gather / all_reduce (float32) algorithm
bandwidth for each transport (GB/s, nccl-tests' algbw:
buffer bytes / time, all_gather counting its whole output; the slowest rank).
Sizes are per rank.
memcpy speed depends on GLIBC_TUNABLES (glibc's x86_non_temporal_threshold);
the setting in effect is printed.
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from harness import run_ranks  # noqa: E402


def _size(text):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1].upper(), 1)
    return int(text[:-1] if mult > 1 else text) * mult


def _ranks(rank, world, sizes, iters):
    import accord as dist
    out = {}
    z = np.zeros(2, np.float32)
    for name, fn in (("broadcast 8 B", lambda: dist.broadcast(z, src=0)),
                     ("barrier", dist.barrier)):
        for _ in range(200):
            fn()
        dist.barrier()
        n = 2000
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        dist.barrier()
        out[name] = (time.perf_counter() - t0) / n * 1e6
    for nbytes in sizes:
        x = np.ones(nbytes // 4, np.float32)
        g = np.empty(nbytes // 4 * world, np.float32)
        ops = {"broadcast": lambda: dist.broadcast(x, src=0),
               "all_gather": lambda: dist.all_gather_into_tensor(g, x),
               "all_reduce": lambda: dist.all_reduce(x)}
        for name, fn in ops.items():
            fn()
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(iters):
                fn()
            cpu = (time.process_time() - c0) / iters
            dist.barrier()
            # nccl-tests' algbw: all_gather counts the whole output (world x per-rank bytes)
            total = nbytes * world if name == "all_gather" else nbytes
            out[f"{name} {nbytes >> 20} MiB"] = total / ((time.perf_counter() - t0) / iters) / 1e9
            # CPU time (user + system) per call: what a loaded machine cannot blur
            out[f"{name} {nbytes >> 20} MiB cpu"] = cpu * 1e3
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--sizes", default="16M,64M")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--transports", default="shm,tcp")
    a = ap.parse_args()
    sizes = [_size(s) for s in a.sizes.split(",")]
    print(f"GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '')!r}  cpus={os.cpu_count()}  "
          f"load={os.getloadavg()[0]:.1f}")
    for world in [int(w) for w in a.worlds.split(",")]:
        res = {}
        for tr in a.transports.split(","):
            per_rank = run_ranks(world, _ranks, sizes, a.iters, env={"ACCORD_TRANSPORT": tr},
                                 timeout=600)
            # the slowest rank: highest latency or CPU time, lowest bandwidth
            res[tr] = {k: (min if k.endswith("MiB") else max)(r[k] for r in per_rank)
                       for k in per_rank[0]}
        trs = list(res)
        print(f"\nworld {world}")
        print("| metric | " + " | ".join(trs) + (" | shm vs tcp |" if len(trs) == 2 else " |"))
        print("|---|" + "---:|" * (len(trs) + (len(trs) == 2)))
        for k in res[trs[0]]:
            unit = "µs" if k in ("barrier", "broadcast 8 B") else \
                "ms/call" if k.endswith("cpu") else "GB/s"
            vals = [res[t][k] for t in trs]
            ratio = ""
            if len(trs) == 2:
                ratio = f" | {vals[0] / vals[1]:.1f}x" if unit == "GB/s" else \
                    f" | {vals[1] / vals[0]:.1f}x less"
            print(f"| {k} ({unit}) | " + " | ".join(f"{v:.1f}" if unit == "µs" else f"{v:.2f}"
                                                   for v in vals) + ratio + " |")


if __name__ == "__main__":
    main()
