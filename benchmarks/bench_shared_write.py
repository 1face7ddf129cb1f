"""Large writes into shared memory: memcpy, streaming stores, or the timed choice, in one run.

    .venv/bin/python benchmarks/bench_shared_write.py [-n 4] [--ops broadcast,all_gather]
        [--sizes 1M] [--tensors 10] [--blocks 30] [--calls 300] [--out FILE]

Beyond two ranks over shared memory, a large broadcast's root (and every rank of
a large all_gather, each partner of all_reduce's halving steps, and the root of a
repeated broadcast_state: `--ops state`, --tensors arrays of SIZE bytes in all) writes
its piece once into its shared slot and the peers copy it out
(transport/slots.py); a message of up to 1 MiB that fits its ring in one piece
(a scatter's blocks: `--ops scatter`; any op at world 2) is written into it in
one go by the ring helper (transport/shm.py). At world 2 a repeated
broadcast_state's root writes the state into the ring as one message gathered
from its arrays, in one piece up to 1 MiB, in chunks beyond, as the ring's own
gatherer chooses (transport/shm.py, _new_gatherer).
How fast that write goes moves by itself every few seconds on a virtual machine
(transport/shared_write.py), so the three ways of writing are compared in turns
inside one run: block k uses memcpy, streaming stores, then the timed choice
(accord's default), in rotation, each block --calls back-to-back calls after a
barrier; a block's time is the slowest rank's, per call. For each block it also
prints the writer's own copy time per call (rank 0's: the root of a broadcast),
from the copier's clock (slot pieces only: a ring's message is timed with its
whole put, inside the helper's call), so the writer's cost and the whole call's are
seen side by side.

Prints every block (time per call in µs / the writer's copy in µs), then each
method's median and its share of the blocks slower than 1.5x the fastest method's
median; --out writes that as markdown with the command and the load average.
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

from shared_write_floor import parse_size     # this folder's, beside this script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = ("memcpy", "stream", "timed")



def worker(args):
    import numpy as np
    import accord as dist
    from accord.transport import shared_write

    copy_s = [0.0]

    def clocked(real):
        def method(self, *args):
            t0 = time.perf_counter()
            real(self, *args)
            copy_s[0] += time.perf_counter() - t0
        return method
    shared_write.SharedWriter.copy = clocked(shared_write.SharedWriter.copy)
    shared_write.SharedWriter.gather = clocked(shared_write.SharedWriter.gather)

    dist.init_process_group()
    r, w = dist.get_rank(), dist.get_world_size()
    rows = []
    for op in args.ops.split(","):
        for size in (parse_size(s) for s in args.sizes.split(",")):
            x = np.ones(size // 4, np.float32)
            out = np.empty(size // 4 * w, np.float32)
            # "state": --tensors float32 arrays of geometric sizes, SIZE bytes in all,
            # synced again and again (broadcast_state's root writes them into its
            # slot, or at world 2 into its ring)
            cuts = np.geomspace(1, 1024, args.tensors)
            blocks_in = [np.ones(size // 4, np.float32) for _ in range(w)]
            state = {f"t{i}": np.ones(max(1, int(size / 4 * c / cuts.sum())), np.float32)
                     for i, c in enumerate(cuts)}

            def call():
                if op == "broadcast":
                    dist.broadcast(x, 0)
                elif op == "all_gather":
                    dist.all_gather_into_tensor(out, x)
                elif op == "all_reduce":
                    dist.all_reduce(x)
                elif op == "state":
                    dist.broadcast_state(state)
                elif op == "scatter":
                    dist.scatter(x, blocks_in if r == 0 else None, 0)
                else:
                    raise SystemExit(f"unknown op {op}")
            blocks = {m: [] for m in METHODS}
            for b in range(args.blocks * len(METHODS)):
                method = METHODS[b % len(METHODS)]
                shared_write.FORCE = None if method == "timed" else method
                for _ in range(5):
                    call()
                dist.barrier()
                copy_s[0] = 0.0
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    call()
                took = (time.perf_counter() - t0) / args.calls
                every = [None] * w
                dist.all_gather_object(every, took)
                blocks[method].append((max(every) * 1e6, copy_s[0] / args.calls * 1e6))
            rows.append((op, size, blocks))
    if r == 0:
        import json
        print("RESULT " + json.dumps(rows), flush=True)
    dist.destroy_process_group()


def report(rows, command, load0, load1):
    lines = [f"`{command}`", "",
             f"load average {load0} at the start, {load1} at the end", ""]
    for op, size, blocks in rows:
        lines.append(f"{op} {size} B, per block (µs per call / the writer's copy, µs), "
                     f"{', '.join(METHODS)} in turn:")
        lines.append("")
        n = min(len(v) for v in blocks.values())
        for i in range(n):
            lines.append("    " + " | ".join(f"{blocks[m][i][0]:7.1f} / {blocks[m][i][1]:6.1f}"
                                             for m in METHODS))
        lines.append("")
        med = {m: statistics.median(t for t, _ in blocks[m]) for m in METHODS}
        best = min(med.values())
        lines.append("| method | median µs per call | median writer's copy µs | "
                     "blocks over 1.5x the best median |")
        lines.append("|---|---:|---:|---:|")
        for m in METHODS:
            slow = sum(1 for t, _ in blocks[m] if t > 1.5 * best) / len(blocks[m])
            cp = statistics.median(c for _, c in blocks[m])
            lines.append(f"| {m} | {med[m]:.1f} | {cp:.1f} | {slow:.0%} |")
        lines.append("")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=4, help="world size (slots need 3 or more)")
    ap.add_argument("--ops", default="broadcast,all_gather")
    ap.add_argument("--sizes", default="1M")
    ap.add_argument("--tensors", type=int, default=10,
                    help="arrays in --ops state's state (geometric sizes over a factor of 1024)")
    ap.add_argument("--blocks", type=int, default=30, help="blocks per method")
    ap.add_argument("--calls", type=int, default=300, help="calls per block")
    ap.add_argument("--out", default=None, help="markdown file to write")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    import json
    load0 = " ".join(f"{v:.2f}" for v in os.getloadavg())
    cmd = [sys.executable, "-m", "accord", "run", "-n", str(args.n), os.path.abspath(__file__),
           "--worker", "--ops", args.ops, "--sizes", args.sizes, "--tensors", str(args.tensors),
           "--blocks", str(args.blocks),
           "--calls", str(args.calls)]
    out = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    if out.returncode:
        raise SystemExit(out.stdout[-4000:])
    line = next(l for l in out.stdout.splitlines() if "RESULT " in l)
    rows = json.loads(line.split("RESULT ", 1)[1])
    load1 = " ".join(f"{v:.2f}" for v in os.getloadavg())
    shown = "python benchmarks/bench_shared_write.py " + " ".join(sys.argv[1:])
    text = report(rows, shown, load0, load1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
