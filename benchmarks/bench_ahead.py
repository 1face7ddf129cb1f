"""A state synced again, two ways of moving it: beyond two ranks the root's pieces
through its shared slot (written once, copied out by each receiver) against on every
receiver's ring; at two ranks the state as one message through the ring behind the
root's row against copied by address once the rows are in.

    .venv/bin/python benchmarks/bench_ahead.py [-n 3,4] [--tensors 10,30] [--rounds 9]
                                               [--calls 100] [--in-step] [--out FILE]

A dict of float32 torch tensors of 128 B to 128 KiB (geometric sizes, as
bench_state.py --small makes them) is synced from rank 0 with broadcast_state,
which sends its pieces behind the root's row in the agreement's call (state.py,
_send_ahead). Beyond two ranks accord.state.AHEAD_SLOT picks the way ("ahead":
True, through the root's slot; "other": False, on the rings); at two ranks
accord.state.AHEAD_PAIR ("ahead": True, the default: through the ring under half the
single-copy threshold, 2 MiB, by address from it; "other": False, by address from
1 MiB, a smaller state still behind the row through the ring). Rounds alternate the two ways in
the same processes (the machine's speed moves between runs, not within a pair
of rounds); a round times --calls back-to-back calls, its time the slowest
rank's. With --in-step every call follows a barrier and is timed alone (the
barrier left out), as a sync between steps of a program that computes in between
finds the ranks: back to back, a root that returns while its receiver still copies
runs ahead into its next call, which the ranks in step never do. The loop of
broadcasts and one broadcast of the same bytes run in the same rounds, for scale.
Receivers check every tensor after every round.
"""
import argparse
import json
import os
import statistics
import sys

from worlds import run_worlds, slowest_per_call, write_table

METHODS = ("ahead", "other", "loop", "one")


def worker(tensors, rounds, calls, in_step=False):
    import torch

    import accord
    from accord import state
    accord.init_process_group()
    rank, world = accord.get_rank(), accord.get_world_size()
    for n in tensors:
        lo, hi = 128, 128 << 10
        sizes = [max(1, int(lo * (hi / lo) ** (i / max(1, n - 1))) // 4) for i in range(n)]
        g = torch.Generator().manual_seed(n)
        ref = {f"layer{i // 4}.p{i % 4}": torch.randn(s, generator=g)
               for i, s in enumerate(sizes)}
        sd = {k: v.clone() if rank == 0 else torch.zeros_like(v) for k, v in ref.items()}
        flat = torch.zeros(sum(sizes))

        def sync(ahead):
            def f():
                if world == 2:
                    state.AHEAD_PAIR = ahead
                else:
                    state.AHEAD_SLOT = ahead
                accord.broadcast_state(sd, src=0)
            return f

        def loop():
            for t in sd.values():
                accord.broadcast(t, src=0)

        def one():
            accord.broadcast(flat, src=0)
        fns = {"ahead": sync(True), "other": sync(False), "loop": loop, "one": one}
        times = {k: [] for k in METHODS}
        for rnd in range(rounds + 2):           # two warm-up rounds
            for name in METHODS:
                if rank != 0:
                    for t in sd.values():
                        t.zero_()
                dt = slowest_per_call(fns[name], calls, in_step=in_step)
                if rank != 0 and name in ("ahead", "other", "loop"):
                    for k, t in sd.items():
                        if not torch.equal(t, ref[k]):
                            raise AssertionError(f"{name}: rank {rank}: {k} differs")
                if rnd >= 2:
                    times[name].append(dt)
        state.AHEAD_SLOT = state.AHEAD_PAIR = True
        if rank == 0:
            print("RESULT " + json.dumps({"world": world, "tensors": n, "in_step": in_step,
                                          "nbytes": sum(sizes) * 4, "times": times}),
                  flush=True)
    accord.destroy_process_group()


def table(results, command, load0, load1):
    lines = [f"`{command}`", "",
             "time per sync (µs): the median round's slowest rank; ahead: world 2 through "
             "the ring behind the row, beyond through the root's slot; other: world 2 by "
             "address (from 1 MiB), beyond on the rings; ahead/other: the median of the "
             "per-round ratios (each pair of rounds run back to back)" +
             ("; --in-step: each call after a barrier, timed alone, the mean of a round's "
              "calls" if results and results[0].get("in_step") else ""), "",
             "| world | state | ahead | other | ahead/other | loop | one broadcast | "
             "loop/ahead |", "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        t = r["times"]
        med = {k: statistics.median(v) * 1e6 for k, v in t.items()}
        ratio = statistics.median(a / b for a, b in zip(t["ahead"], t["other"]))
        lines.append(f"| {r['world']} | {r['tensors']} tensors, {r['nbytes'] // 1024} KiB | "
                     f"{med['ahead']:.0f} | {med['other']:.0f} | {ratio:.2f}x | "
                     f"{med['loop']:.0f} | {med['one']:.0f} | {med['loop'] / med['ahead']:.2f}x |")
    lines += ["", f"load average {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f} at the start, "
              f"{load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f} at the end"]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", default="3,4", help="world sizes, comma-separated")
    ap.add_argument("--tensors", default="10,30", help="tensors in the state, comma-separated")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--in-step", action="store_true",
                    help="a barrier before every call, each call timed alone")
    ap.add_argument("--out", default=None, help="markdown table (default: print only)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    tensors = [int(x) for x in args.tensors.split(",")]
    if args.worker:
        worker(tensors, args.rounds, args.calls, args.in_step)
        return 0
    command = "python benchmarks/bench_ahead.py " + " ".join(sys.argv[1:])
    load0 = os.getloadavg()
    results = run_worlds(__file__, [int(x) for x in args.n.split(",")],
                         ["--tensors", args.tensors, "--rounds", str(args.rounds),
                          "--calls", str(args.calls)] + (["--in-step"] if args.in_step else []))
    write_table(table(results, command, load0, os.getloadavg()), args.out)
    return 0

if __name__ == "__main__":
    sys.exit(main())
