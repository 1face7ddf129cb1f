"""What one host allows a large point-to-point message: forked processes, no accord.

    .venv/bin/python benchmarks/split_copy_floor.py [--sizes 4M] [--calls 100] [--repeat 3]

A receiver takes a message of SIZE bytes out of a sender's memory two ways, --calls
times each, the sender's process waiting on a word in a shared mapping:

- alone: the receiver copies all of it with process_vm_readv (what accord's
  single-copy message does today: transport/shm.py's descriptor messages, from
  ACCORD_SHM_CMA bytes; the sender waits for the acknowledgement meanwhile);
- split: the receiver reads the front half while the sender writes the back half
  into the receiver's buffer with process_vm_writev (both cores copy, as
  algorithms/single_copy.py's broadcasts do between two ranks).

It prints the median time of each (the receiver's clock, from asking to having
every byte) with the load average. A blocking send and its receive are both inside
their calls for the whole copy, so the split is what a point-to-point transfer of
that size could take; what it would need in the transport: the receiver publishing
its destination for the message, both sides claiming chunks from either end, and a
two-flag handshake (the receiver closing, the sender busy, each flag set and then
the other read across a fence) so that no sender writes into a buffer whose receive
has completed.
"""
import argparse
import mmap
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from accord.cli.bench import parse_size  # noqa: E402  (after the path: run from a checkout)
from accord.transport import cma  # noqa: E402

# word offsets in the flags page: the receiver's request epoch, the sender's done epoch,
# whether the sender helps, the receiver's buffer address, and the stop flag
_ASK, _DONE, _SPLIT, _DEST, _STOP = 0, 8, 16, 24, 32


def _sender(q, src, n, parent):
    while True:
        while q[_ASK] == q[_DONE]:
            if q[_STOP]:
                return
            os.sched_yield()
        ask = int(q[_ASK])
        if q[_SPLIT]:
            half = n // 2
            cma.write(parent, src.ctypes.data + half, int(q[_DEST]) + half, n - half)
        q[_DONE] = ask


def run(n, calls, repeat):
    """{"alone": µs, "split": µs}: medians over repeat runs of each run's median call."""
    flags = mmap.mmap(-1, 4096)
    q = np.frombuffer(flags, np.int64)
    src = np.random.default_rng(0).integers(0, 256, n, np.uint8)
    dst = np.zeros(n, np.uint8)
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            _sender(q, src, n, parent)
        except BaseException as e:          # said on stderr, the parent fails
            print(f"split_copy_floor: sender: {e!r}", file=sys.stderr)
            code = 1
        os._exit(code)
    out = {"alone": [], "split": []}
    try:
        for _ in range(repeat):
            for way in ("alone", "split"):
                times = []
                for _ in range(calls):
                    dst[:] = 0
                    t = time.perf_counter()
                    q[_SPLIT] = way == "split"
                    q[_DEST] = dst.ctypes.data
                    ask = int(q[_ASK]) + 1
                    q[_ASK] = ask
                    cma.read(pid, dst.ctypes.data, src.ctypes.data,
                             n // 2 if way == "split" else n)
                    while q[_DONE] != ask:
                        os.sched_yield()
                    times.append(time.perf_counter() - t)
                    if not np.array_equal(dst, src):
                        raise SystemExit(f"split_copy_floor: {way}: the message arrived wrong")
                out[way].append(statistics.median(times) * 1e6)
    finally:
        q[_STOP] = 1
        _, status = os.waitpid(pid, 0)
    if status:
        raise SystemExit("split_copy_floor: the sender failed")
    return {way: statistics.median(v) for way, v in out.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="4M", help="bytes of the message, K/M/G units")
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)
    if not cma.AVAILABLE:
        p.error("process_vm_readv is not available here")
    print(f"# {args.calls} calls a run, median of {args.repeat} runs; "
          f"load average {os.getloadavg()[0]:.2f}")
    print("size alone_us split_us alone/split")
    for size in (parse_size(s) for s in args.sizes.split(",")):
        got = run(size, args.calls, args.repeat)
        print(f"{size} {got['alone']:.1f} {got['split']:.1f} "
              f"{got['alone'] / got['split']:.2f}", flush=True)
    print(f"# load average at the end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
