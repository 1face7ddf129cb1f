"""Large point-to-point messages three ways in turn, in the same two processes:

    accord run -n 2 benchmarks/p2p_split.py [--sizes 4M,8M,16M] [--rounds 5]
                                            [--calls 20] [--op pingpong|window]

- "ring": streamed through the pair's point-to-point ring (the single-copy
  threshold set above the size), both processes copying;
- "alone": single copy, the receiver reading all of it (process_vm_readv) while
  the sender waits for the acknowledgement;
- "split": single copy as accord does it (transport/split_message.py), the
  waiting sender writing the back of the message into the receiver's buffer while
  the receiver reads the front.

--op pingpong: a blocking send/recv round trip of the same buffer, µs a message
(half a round trip, osu_latency's measure); --op window: four isends matched by
four irecvs, then a one-byte reply, µs a message. The buffers are filled (rank 0's)
or zeroed (the receiver's) before each block's barrier, outside its time. Each round runs every way for
--calls timed blocks (each after a barrier); rank 0 prints the median of each
round and the median over rounds, with the load average before and after. The
way is switched on both ranks between barriers, so both send and receive alike;
the receiver checks the last message's bytes of every block.
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from accord.cli.bench import parse_size  # noqa: E402  (after the path: run from a checkout)
from accord.transport import split_message  # noqa: E402

SPLITS = split_message.applies      # accord's own rule, put back for the "split" way

WAYS = ("ring", "alone", "split")
WINDOW = 4


def _use(way, n):
    """Switch this process to a way for n-byte messages."""
    from accord.world import default_group
    t = default_group().p2p.t
    t.cma_min = n + 1 if way == "ring" else 1 << 20
    split_message.applies = SPLITS if way == "split" else (lambda n: False)


def _prepare(rank, op, bufs, pattern):
    """Before a timed block: the message in rank 0's buffer, the receiver's zeroed."""
    if op == "pingpong" and rank == 0:
        bufs[0][:] = pattern
    elif op == "window" and rank == 1:
        for b in bufs:
            b[:] = 0


def _block(rank, n, op, bufs, pattern):
    import accord
    if op == "pingpong":
        buf = bufs[0]
        for _ in range(5):
            if rank == 0:
                accord.send(buf, 1)
                accord.recv(buf, 1)
            else:
                accord.recv(buf, 0)
                accord.send(buf, 0)
        return 10, rank == 1 and not np.array_equal(buf, pattern)
    if rank == 0:
        ws = [accord.isend(pattern, dst=1) for _ in bufs]
    else:
        ws = [accord.irecv(b, src=0) for b in bufs]
    for w in ws:
        w.wait()
    one = np.zeros(1, np.uint8)
    if rank == 0:
        accord.recv(one, 1)
    else:
        accord.send(one, 0)
    return len(bufs), rank == 1 and not np.array_equal(bufs[-1], pattern)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="4M,8M,16M")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--op", choices=("pingpong", "window"), default="pingpong")
    args = ap.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]

    import accord
    accord.init_process_group()
    rank = accord.get_rank()
    if accord.get_world_size() != 2:
        raise SystemExit("p2p_split.py: run it on two ranks (accord run -n 2)")
    load0 = os.getloadavg()[0]
    out = {}
    wrong = 0
    for n in sizes:
        pattern = np.random.default_rng(n).integers(0, 256, n, np.uint8)
        bufs = [np.zeros(n, np.uint8) for _ in range(1 if args.op == "pingpong" else WINDOW)]
        for _ in range(args.rounds):
            for way in WAYS:
                accord.barrier()
                _use(way, n)
                times = []
                for _ in range(args.calls):
                    _prepare(rank, args.op, bufs, pattern)
                    accord.barrier()
                    t0 = time.perf_counter()
                    k, bad = _block(rank, n, args.op, bufs, pattern)
                    times.append((time.perf_counter() - t0) / k * 1e6)
                    wrong += bad
                out.setdefault((n, way), []).append(statistics.median(times))
    bad = np.array([wrong], np.int64)
    accord.all_reduce(bad)
    if rank == 0:
        print(f"# {args.op}, µs a message, medians of {args.calls} blocks a round; "
              f"load average {load0:.2f} -> {os.getloadavg()[0]:.2f}")
        print("size way median rounds")
        for (n, way), v in out.items():
            print(f"{n} {way} {statistics.median(v):.0f} "
                  + ",".join(f"{x:.0f}" for x in v))
    accord.destroy_process_group()
    if int(bad[0]):
        raise SystemExit(f"p2p_split.py: {int(bad[0])} blocks delivered wrong bytes")


if __name__ == "__main__":
    main()
