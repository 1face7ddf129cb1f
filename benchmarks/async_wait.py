"""Small collectives with async_op=True against the same calls made synchronously: what
a Work costs when the program waits on it at once, and when it issues a few first.

    .venv/bin/python benchmarks/async_wait.py [-n 2] [--iters 2000] [--rounds 3]

Each rank calls, on an 8-byte float32 array:

- sync:        all_reduce(x) (or broadcast(x, src=0));
- async, wait: all_reduce(x, async_op=True).wait();
- 8 then wait: eight async calls on eight arrays, then each Work waited in turn
  (the figure is per call).

A round times --iters calls of each way after a barrier (the ways in turn; the
slowest rank's time, worlds.slowest_per_call); the figure is the median round's µs
per call. Everything runs in one `accord run -n N` (worlds.run_worlds), so compare
the rows of one run (the load average is printed beside them), not figures of
different runs.
"""
import argparse
import json
import os
import statistics

from worlds import run_worlds, slowest_per_call

WAYS = ("sync", "async, wait", "8 then wait")
OPS = ("all_reduce", "broadcast")


def worker(iters, rounds):
    import numpy as np

    import accord
    accord.init_process_group()
    rank = accord.get_rank()
    xs = [np.zeros(2, np.float32) for _ in range(8)]
    x = xs[0]
    calls = {"all_reduce": lambda a, asy: accord.all_reduce(a, async_op=asy),
             "broadcast": lambda a, asy: accord.broadcast(a, src=0, async_op=asy)}

    def ways(call):
        def sync():
            call(x, False)

        def wait_at_once():
            call(x, True).wait()

        def eight():
            for w in [call(a, True) for a in xs]:
                w.wait()
        return sync, wait_at_once, eight

    times = {op: {w: [] for w in WAYS} for op in OPS}
    for rnd in range(rounds + 1):              # the first round warms up
        for op in OPS:
            for name, fn in zip(WAYS, ways(calls[op])):
                per = 8 if name == "8 then wait" else 1
                per_call = slowest_per_call(fn, iters // per) / per
                if rnd:
                    times[op][name].append(per_call)
    accord.barrier()
    if rank == 0:
        print("RESULT " + json.dumps(times), flush=True)
    accord.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-n", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args.iters, args.rounds)
    load = os.getloadavg()
    [res] = run_worlds(__file__, [args.n], ["--iters", str(args.iters),
                                            "--rounds", str(args.rounds)])
    end = os.getloadavg()
    print(f"world {args.n}, µs per call (8 bytes), the median of {args.rounds} rounds of "
          f"{args.iters} calls; load average {load[0]:.2f} at the start, {end[0]:.2f} at the end")
    print("| op | " + " | ".join(WAYS) + " | async, wait / sync |")
    print("|---|" + "---:|" * (len(WAYS) + 1))
    for op in OPS:
        med = {w: statistics.median(res[op][w]) * 1e6 for w in WAYS}
        print(f"| {op} | " + " | ".join(f"{med[w]:.1f}" for w in WAYS) +
              f" | {med['async, wait'] / med['sync']:.2f}x |")


if __name__ == "__main__":
    main()
