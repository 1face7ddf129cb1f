"""A state synced again by address at two ranks, three ways in turn in the same
processes: as accord does it, without torch's tensor guard, and as before both
changes (the cut at half the bytes, a remote segment per tensor).

    accord run -n 2 benchmarks/bench_segments.py [--tensors 300] [--rounds 6]
                                                 [--calls 100]

A dict of float32 torch tensors of 128 B to 128 KiB (geometric sizes, as
bench_state.py --small makes them; 300 of them are 5.7 MB, past the single-copy
threshold, so a repeated sync copies them by address: algorithms/segments.py) is
synced from rank 0 with broadcast_state. Each round runs every way for --calls
calls, timed on each rank between two barriers, then one accord.broadcast of a
tensor holding the same bytes. The ways:

- "accord": the reader joins neighbouring tensors into one remote segment, the cut
  where both ranks' costs meet, torch's compiled guard checking the tensors first;
- "no guard": the same, the tensors checked by flat_state's Python comparison alone;
- "before": no guard, one remote segment per tensor, the cut at half the bytes.

Switching ways drops every entry's segment batches on both ranks between barriers,
so both cut alike. Rank 0 prints the medians over rounds and every round; the
receiver checks its tensors at the end.
"""
import argparse
import statistics
import sys
import os
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--calls", type=int, default=100)
    args = ap.parse_args()

    import torch
    import accord
    from accord import flat_state
    from accord.algorithms import segments
    from bench_state import make_state

    accord.init_process_group()
    rank = accord.get_rank()
    sd = make_state(rank, args.tensors, (128, 128 << 10))
    nbytes = sum(v.nbytes for v in sd.values())
    flat = torch.zeros(nbytes // 4)
    join, cost = segments._may_join, segments.SEGMENT_COST

    def apart(end, start, reading):
        return start == end

    ways = {"accord": (cost, join, True), "no guard": (cost, join, False),
            "before": (0, apart, False)}
    guards = {}

    def use(way):
        segments.SEGMENT_COST, segments._may_join, guard = ways[way]
        for e in flat_state._ENTRIES.values():
            e.remote.clear()
            guards.setdefault(id(e), e.guard)
            e.guard = guards[id(e)] if guard else None

    def timed(fn):
        accord.barrier()
        t = time.perf_counter()
        for _ in range(args.calls):
            fn()
        accord.barrier()
        return (time.perf_counter() - t) / args.calls * 1e6

    for _ in range(20):
        accord.broadcast_state(sd, src=0)
    times = {w: [] for w in list(ways) + ["one broadcast"]}
    for _ in range(args.rounds):
        for way in ways:
            use(way)
            for _ in range(5):
                accord.broadcast_state(sd, src=0)
            times[way].append(timed(lambda: accord.broadcast_state(sd, src=0)))
        times["one broadcast"].append(timed(lambda: accord.broadcast(flat, src=0)))
    use("accord")
    want = make_state(0, args.tensors, (128, 128 << 10))
    if any(not torch.equal(v, want[k]) for k, v in sd.items()):
        raise SystemExit(f"rank {rank}: the state differs from rank 0's")
    if rank == 0:
        print(f"{args.tensors} tensors, {nbytes / 1e6:.2f} MB, world 2, µs a call "
              f"(median of {args.rounds} rounds of {args.calls}; the rounds)")
        for way, ts in times.items():
            print(f"  {way:14s} {statistics.median(ts):7.0f}   " +
                  " ".join(f"{t:.0f}" for t in ts))


if __name__ == "__main__":
    main()
