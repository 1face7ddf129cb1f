"""How a TCP rank waits, three or four ways in turn in the same processes.

    accord run -n 2 benchmarks/tcp_spin.py [--ways chosen,none,small,all]
        [--sizes 8,64K,1M,16M] [--ops broadcast,all_gather,scatter,all_reduce,
        all_to_all,pingpong] [--blocks 16]

The group is made over TCP (ACCORD_TRANSPORT=tcp unless set otherwise). The ways,
switched on both ranks between barriers (the transport's attributes, nothing
rebuilt):

- "chosen": as accord waits: where each rank has a core, a collective whose messages
  are at most tcp.SPIN_BYTES looks at its sockets with poll() for spin_s before it
  sleeps, and a blocking point-to-point call steps its link for spin_s;
- "none": every wait sleeps in poll() at once (accord before it spun on sockets);
- "small": collectives spin only for messages of up to 64 KiB;
- "all": collectives spin whatever the size.

For every op and size the ways run in blocks that alternate (a, b, c, then c, b, a,
...), each block a barrier then a fixed number of calls; a block's time is the
slower rank's. Rank 0 prints each way's median block time a call and the median,
over blocks, of its time against the first way's in the same block. Ways that
share a block's neighbourhood of the host's speed are compared, so drift in the
host's speed between minutes (20-50% on the development VM) cancels.
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import accord  # noqa: E402
from accord.cli.bench import parse_size  # noqa: E402
from accord.transport import tcp  # noqa: E402

OPS = ("broadcast", "all_gather", "scatter", "all_reduce", "all_to_all", "pingpong")


def ways(spin_s):
    """name -> (seconds a wait spins, the largest collective message it spins for)."""
    return {"chosen": (spin_s, tcp.SPIN_BYTES), "none": (0.0, tcp.SPIN_BYTES),
            "small": (spin_s, 64 << 10), "all": (spin_s, 1 << 62)}


def calls_per_block(nbytes):
    return 200 if nbytes <= 4096 else 50 if nbytes <= 64 << 10 else 10 if nbytes <= 1 << 20 \
        else 3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ways", default="chosen,none,small,all")
    ap.add_argument("--sizes", default="8,64K,1M,16M")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--blocks", type=int, default=16)
    args = ap.parse_args(argv)
    os.environ.setdefault("ACCORD_TRANSPORT", "tcp")
    accord.init_process_group()
    rank, world = accord.get_rank(), accord.get_world_size()
    group = accord.world.default_group()
    coll = group.transport
    if not isinstance(coll, tcp.TcpTransport) or world != 2:
        raise SystemExit("tcp_spin.py: run two ranks over TCP (accord run -n 2, "
                         "ACCORD_TRANSPORT=tcp)")
    table = ways(coll.spin_s)
    names = args.ways.split(",")
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"tcp_spin.py: no way {unknown[0]!r}; choose of {', '.join(table)}")
    if not coll.spin_s:
        print("tcp_spin.py: this host gives each rank no core of its own: no way spins",
              file=sys.stderr)
    spin_bytes = tcp.SPIN_BYTES

    def use(name):
        spin, most = table[name]
        coll.spin_s = spin
        tcp.SPIN_BYTES = most
        if group.p2p is not None:
            group.p2p.t.spin_s = group.p2p.spin_s = spin

    peer = 1 - rank
    if rank == 0:
        load = os.getloadavg()
        print(f"# benchmarks/tcp_spin.py --ways {args.ways} --sizes {args.sizes} --blocks "
              f"{args.blocks}; spin {coll.spin_s * 1e6:.0f} µs, SPIN_BYTES {spin_bytes}; "
              f"load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
        print(f"{'op':10s} {'size':>9s}  " + "  ".join(
            f"{n + ' µs':>10s}" + ("" if i == 0 else f" {n + '/' + names[0]:>12s}")
            for i, n in enumerate(names)), flush=True)
    for size in [parse_size(s) for s in args.sizes.split(",")]:
        numel = max(1, size // 4)
        x = np.full(numel, rank + 1, np.float32)
        got = np.empty(numel, np.float32)
        blocks = [np.empty(numel, np.float32) for _ in range(world)]
        shards = [np.full(numel, i, np.float32) for i in range(world)] if rank == 0 else None
        acc = np.zeros(numel, np.float32)
        a2a_in, a2a_out = np.zeros(numel * world, np.float32), np.empty(numel * world,
                                                                        np.float32)

        def pingpong():
            if rank == 0:
                accord.send(x, peer)
                accord.recv(got, peer)
            else:
                accord.recv(got, peer)
                accord.send(x, peer)
        fns = {"broadcast": lambda: accord.broadcast(x, 0),
               "all_gather": lambda: accord.all_gather(blocks, x),
               "scatter": lambda: accord.scatter(got, shards, src=0),
               "all_reduce": lambda: accord.all_reduce(acc),
               "all_to_all": lambda: accord.all_to_all_single(a2a_out, a2a_in),
               "pingpong": pingpong}
        calls = calls_per_block(size)
        for op in args.ops.split(","):
            fn = fns[op]
            times = {n: [] for n in names}
            for b in range(args.blocks):
                for name in (names if b % 2 == 0 else names[::-1]):
                    use(name)
                    fn()
                    accord.barrier()
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        fn()
                    times[name].append((time.perf_counter() - t0) / calls)
            arr = np.array([times[n] for n in names])
            accord.all_reduce(arr, op=accord.ReduceOp.MAX)
            if rank == 0:
                cols = []
                for i, n in enumerate(names):
                    cols.append(f"{statistics.median(arr[i]) * 1e6:10.1f}")
                    if i:
                        cols.append(f"{statistics.median(arr[i] / arr[0]):11.2f}x")
                print(f"{op:10s} {size:>9d}  " + "  ".join(cols), flush=True)
    use("chosen")
    tcp.SPIN_BYTES = spin_bytes
    accord.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
