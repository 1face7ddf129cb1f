"""A repeated broadcast_state of 300 small tensors at two ranks, beside what the
machine reads at the time.

    .venv/bin/python benchmarks/state_stretch.py [--rounds 12] [--tensors 300]
        [--blocks 10] [--calls 100]

Each round first runs benchmarks/shared_write_floor.py for one second (two
processes pinned to CPUs 0 and 1, no accord: the median time of a 1 MiB memcpy
into bytes the other CPU has just read, and of streaming stores doing the same),
then, under `accord run -n 2`, times three things back to back in the same
processes, the slowest rank's mean over blocks of 100 calls, the median block:

- `broadcast_state(sd)` of the same dict every call (float32 tensors of
  128 B-128 KiB, geometric sizes: bench_state.py --small's largest state);
- one `accord.broadcast` of a tensor holding the same bytes;
- the check a repeated sync makes that the dict still holds the same tensors
  (flat_state.lookup), alone.

The "+" column is the sync's time above the one broadcast: what the
small-state target bounds at 100 µs. On the 2-vCPU development VM the memcpy
column reads 18-24 µs in some stretches and about 100 in others, seconds to
minutes long (transport/shared_write.py); printing it beside each round tells
which kind of stretch the round fell in.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def worker(tensors, blocks=10, calls=100):
    import torch
    import accord
    from accord import flat_state
    from accord.world import resolve_group
    sys.path.insert(0, HERE)
    from bench_state import make_state
    from worlds import slowest_per_call
    accord.init_process_group()
    rank = accord.get_rank()
    sd = make_state(rank, tensors, (128, 128 << 10))
    nbytes = sum(t.numel() * 4 for t in sd.values())
    flat = torch.arange(nbytes // 4, dtype=torch.float32) if rank == 0 else \
        torch.zeros(nbytes // 4)
    g = resolve_group(None)

    def state():
        accord.broadcast_state(sd, src=0)

    def one():
        accord.broadcast(flat, src=0)

    def check():
        if flat_state.lookup(g, sd, 25 << 20, rank == 0)[0] is None:
            raise AssertionError("the dict's entry is gone: the sync took the general path")

    times = {"state": [], "one": [], "check": []}
    for block in range(blocks + 1):
        for name, fn in (("state", state), ("one", one), ("check", check)):
            t = slowest_per_call(fn, calls, warm=max(1, calls // 10))
            if block:
                times[name].append(t)
    ref = make_state(0, tensors, (128, 128 << 10))
    if rank and any(not torch.equal(t, ref[k]) for k, t in sd.items()):
        raise AssertionError(f"rank {rank}: the state differs from rank 0's")
    if rank == 0:
        print("RESULT " + json.dumps({k: statistics.median(v) for k, v in times.items()}),
              flush=True)


def probe():
    """(memcpy µs, streaming µs) a 1 MiB write into bytes the other CPU read, one second."""
    out = subprocess.run([sys.executable, os.path.join(HERE, "shared_write_floor.py"),
                          "--seconds", "1"], capture_output=True, text=True, check=True).stdout
    row = [l for l in out.splitlines() if re.match(r"\s*0\s", l)][0].split()
    return float(row[1]), float(row[2])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--tensors", type=int, default=300)
    ap.add_argument("--blocks", type=int, default=10, help="timed blocks a round (default 10)")
    ap.add_argument("--calls", type=int, default=100, help="calls a block (default 100)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.tensors, args.blocks, args.calls)
        return
    accord_cmd = [sys.executable, "-m", "accord", "run", "-n", "2", os.path.abspath(__file__),
                  "--worker", "--tensors", str(args.tensors), "--blocks", str(args.blocks),
                  "--calls", str(args.calls)]
    print(f"load average at the start: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    print("| round | memcpy µs/MiB | streaming µs/MiB | broadcast_state µs | "
          "one broadcast µs | + µs | check µs |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in range(args.rounds):
        memcpy, stream = probe()
        out = subprocess.run(accord_cmd, capture_output=True, text=True, cwd=ROOT)
        line = [l for l in out.stdout.splitlines() if "RESULT " in l]
        if out.returncode or not line:
            raise SystemExit(f"round {r}: the accord job failed:\n{out.stdout}{out.stderr}")
        t = json.loads(line[0].split("RESULT ", 1)[1])
        s, o, c = (t[k] * 1e6 for k in ("state", "one", "check"))
        print(f"| {r} | {memcpy:.1f} | {stream:.1f} | {s:.1f} | {o:.1f} | {s - o:+.1f} | "
              f"{c:.1f} |", flush=True)
    print(f"load average at the end: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
