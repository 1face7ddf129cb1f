"""16-bit float all_reduce: accord's bfloat16 and float16, with and without its helper,
float32 for scale, and torch's gloo, in the same processes.

    .venv/bin/python benchmarks/bench_halves.py [-n 2,4] [--sizes 8,64K,1M,16M] [--rounds 5]
                                                [--out FILE]

Sizes are bytes of each rank's tensor. Every round times each method in turn,
starting one method later than the round before (the machine's speed moves
between runs, not within a round): a barrier, then a
block of back-to-back all_reduce calls (SUM) sized to take about 50 ms, the
slowest rank's mean; the table shows the median round. The methods:

- accord bf16 / accord f16: accord.all_reduce of a bfloat16 / float16 tensor,
  through the helper's kernels (accord/halves_core.c) where they are built;
- accord bf16, numpy / accord f16, numpy: the same with accord.halves' numpy
  path (what runs without a C compiler, or with ACCORD_HALF_HELPER=0);
- accord f32: a float32 tensor of the same bytes;
- gloo bf16 / gloo f16: torch.distributed.all_reduce of the tensor on gloo, in
  rounds of its own after accord's (a gloo call leaves the next few accord calls
  slower: world 4, 8 B, 125 µs against 36 µs when gloo ran in the same rounds).

After the rounds every rank checks the result of one more call of each 16-bit
method against the exact sum (small integers, exact in both types).
"""
import argparse
import json
import os
import statistics
import sys
import time

from worlds import run_worlds, write_table

METHODS = ("accord bf16", "accord bf16, numpy", "accord f16", "accord f16, numpy",
           "accord f32", "gloo bf16", "gloo f16")


def _bytes(text):
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text[:-1] if text[-1:] in "KMG" else text) * scale


def worker(sizes, rounds):
    import numpy as np
    import torch
    import torch.distributed as tdist

    import accord
    from accord import halves
    accord.init_process_group()
    rank, world = accord.get_rank(), accord.get_world_size()
    port = os.environ["MASTER_PORT"]
    tdist.init_process_group("gloo", init_method=f"file:///tmp/accord-bench-halves-{port}",
                             rank=rank, world_size=world)
    helper = halves._HELPED
    for nbytes in sizes:
        n = max(1, nbytes // 2)
        halfs = {"bf16": torch.ones(n, dtype=torch.bfloat16),
                 "f16": torch.ones(n, dtype=torch.float16)}
        f = torch.ones(max(1, nbytes // 4), dtype=torch.float32)

        def accord_call(t, h):
            def call():
                halves._HELPED = h
                accord.all_reduce(t)
            return call
        fns = {}
        for kind, t in halfs.items():
            fns[f"accord {kind}"] = accord_call(t, helper)
            fns[f"accord {kind}, numpy"] = accord_call(t, False)
        fns["accord f32"] = lambda: accord.all_reduce(f)
        for kind, t in halfs.items():
            fns[f"gloo {kind}"] = (lambda t: lambda: tdist.all_reduce(t))(t)
        calls = {}
        for name, fn in fns.items():       # a block of about 50 ms, agreed by every rank
            t0 = time.perf_counter()
            fn()
            one = np.array([time.perf_counter() - t0])
            accord.all_reduce(one, op=accord.ReduceOp.MAX)
            calls[name] = int(max(1, min(2000, 0.05 / max(one[0], 1e-6))))
        times = {k: [] for k in fns}
        # gloo's rounds after accord's (see the module's text)
        order = [[k for k in fns if not k.startswith("gloo")]] * rounds + \
            [[k for k in fns if k.startswith("gloo")]] * rounds
        for k, names in enumerate(order):
            # each round starts one method later: the first block after the switch from
            # the previous round's last method is not always the same method's
            for name in names[k % len(names):] + names[:k % len(names)]:
                fn = fns[name]
                for t in halfs.values():
                    t.fill_(1)
                accord.barrier()
                t0 = time.perf_counter()
                for _ in range(calls[name]):
                    fn()
                dt = np.array([(time.perf_counter() - t0) / calls[name]])
                accord.all_reduce(dt, op=accord.ReduceOp.MAX)
                times[name].append(float(dt[0]))
        for name in fns:
            if name == "accord f32":
                continue
            t = halfs[name.split()[1].rstrip(",")]
            t.copy_(torch.arange(n) % 7 + rank)
            fns[name]()
            want = (torch.arange(n) % 7) * world + sum(range(world))
            if not torch.equal(t, want.to(t.dtype)):
                raise AssertionError(f"{name}: rank {rank}: wrong sum at {nbytes} bytes")
        halves._HELPED = helper
        if rank == 0:
            print("RESULT " + json.dumps({"world": world, "nbytes": nbytes, "times": times,
                                          "helper": helper}), flush=True)
    tdist.destroy_process_group()
    accord.destroy_process_group()


def table(results, command, load0, load1):
    lines = [f"`{command}`", "",
             "µs per all_reduce (SUM), the median round's slowest rank; x f32: the median "
             "of the per-round ratios to float32 of the same bytes", "",
             "| world | bytes | " + " | ".join(METHODS) + " | bf16 x f32 | f16 x f32 |",
             "|---:|---:|" + "---:|" * (len(METHODS) + 2)]
    for r in results:
        t = r["times"]
        med = {k: statistics.median(v) * 1e6 for k, v in t.items()}
        ratio = {k: statistics.median(a / b for a, b in zip(t[f"accord {k}"], t["accord f32"]))
                 for k in ("bf16", "f16")}
        lines.append(f"| {r['world']} | {r['nbytes']} | " +
                     " | ".join(f"{med[k]:.1f}" for k in METHODS) +
                     f" | {ratio['bf16']:.2f}x | {ratio['f16']:.2f}x |")
    helper = all(r["helper"] for r in results)
    lines += ["", "accord bf16 and f16 ran " + ("with the helper (accord/halves_core.c)" if helper
                                                else "without the helper (not built, or off)"),
              f"load average {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f} at the start, "
              f"{load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f} at the end"]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", default="2,4", help="world sizes, comma-separated")
    ap.add_argument("--sizes", default="8,64K,1M,16M", help="bytes per rank, comma-separated")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None, help="markdown table (default: print only)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes = [_bytes(s) for s in args.sizes.split(",")]
    if args.worker:
        worker(sizes, args.rounds)
        return 0
    command = "python benchmarks/bench_halves.py " + " ".join(sys.argv[1:])
    load0 = os.getloadavg()
    results = run_worlds(__file__, [int(x) for x in args.n.split(",")],
                         ["--sizes", args.sizes, "--rounds", str(args.rounds)], {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")})
    write_table(table(results, command, load0, os.getloadavg()), args.out)
    return 0

if __name__ == "__main__":
    sys.exit(main())
