"""What one host allows an all_gather: forked processes, flags in shared memory, no accord.

    .venv/bin/python benchmarks/allgather_floor.py [--world 4] [--sizes 1M] [--calls 1000]
        [--repeat 3] [--methods slot,read,direct]

Each of --world processes holds a block of SIZE bytes and gathers every block
into an output of world x SIZE, --calls times back to back, two ways:

- slot: each rank copies its block once into a slot of its own in a shared
  mapping, and every peer copies it out of there (one write, world - 1 reads
  and its own block: world + 1 memcpys a rank). A rank's slot is written again
  only once every peer has read it, so no call waits for the others at its end.
- read: a ring in which each rank copies one block a step out of its left
  neighbour's output with process_vm_readv (world - 1 single copies a rank, each
  just after the neighbour wrote it), MPICH's way for large blocks on one host.
- direct: every rank reads every peer's input block straight out of the peer
  with process_vm_readv as soon as the peer says it is there (world - 1 single
  copies and its own block: world copies a rank, no write into shared memory),
  then waits until every peer has read its own block, as a call must before it
  returns (its input may change after).

The steps wait on words in a shared mapping, yielding the core in between, as
MPICH's ranks do; nothing else runs. It prints, per method, the time per call
(the slowest rank's, the median over --repeat runs) and each rank's CPU time
per call, with the load average. An all_gather through a library cannot be
faster than its method here: compare `accord bench -n WORLD --ops all_gather`
rows (and MPICH's) against it. On 4 ranks sharing 2 cores the time is the four
ranks' CPU over two cores, so CPU per call is the figure to read.
"""
import argparse
import mmap
import os
import resource
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from accord.cli.bench import parse_size  # noqa: E402  (after the path: run from a checkout)
from accord.transport import cma  # noqa: E402

# word offsets in the flags page (up to 8 ranks): each rank's epoch word, the
# world x world "read" words, the start flags, the output addresses and pids
_EPOCH, _DONE, _READY, _OUT, _PID, _IN = 0, 64, 128, 192, 256, 320
MAX_WORLD = 8


def _wait(q, i, value):
    while q[i] < value:
        os.sched_yield()


def _slot_call(q, r, world, x, out, slots, nbytes, ep):
    """One call of the shared-slot method on rank r (epoch ep)."""
    n = x.size
    for p in range(world):
        if p != r:
            _wait(q, _DONE + p * world + r, ep - 1)     # p has read my slot's last block
    slots[r][...] = x
    q[_EPOCH + r] = ep
    out[r * n:(r + 1) * n] = x
    for k in range(1, world):
        p = (r + k) % world
        _wait(q, _EPOCH + p, ep)
        out[p * n:(p + 1) * n] = slots[p]
        q[_DONE + r * world + p] = ep


def _read_call(q, r, world, x, out, nbytes, ep):
    """One call of the read-the-neighbour ring on rank r (epoch ep)."""
    n = x.size
    left, right = (r - 1) % world, (r + 1) % world
    _wait(q, _DONE + right, ep - 1)         # my right neighbour has read last call's blocks
    out[r * n:(r + 1) * n] = x
    here = cma.address(memoryview(out))
    q[_EPOCH + r] = ep * world              # step 0: my own block is in place
    pid, there = int(q[_PID + left]), int(q[_OUT + left])
    for s in range(world - 1):
        b = (r - 1 - s) % world
        _wait(q, _EPOCH + left, ep * world + s)
        cma.read(pid, here + b * nbytes, there + b * nbytes, nbytes)
        q[_EPOCH + r] = ep * world + s + 1
    q[_DONE + r] = ep


def _direct_call(q, r, world, x, out, nbytes, ep):
    """One call of the read-every-input method on rank r (epoch ep)."""
    n = x.size
    q[_EPOCH + r] = ep                      # my input is there for this call
    out[r * n:(r + 1) * n] = x
    here = cma.address(memoryview(out))
    for k in range(1, world):
        p = (r + k) % world
        _wait(q, _EPOCH + p, ep)
        cma.read(int(q[_PID + p]), here + p * nbytes, int(q[_IN + p]), nbytes)
        q[_DONE + p * world + r] = ep       # r has read p's input
    for p in range(world):
        if p != r:
            _wait(q, _DONE + r * world + p, ep)     # p has read mine: x may change now


def _rank(method, r, world, nbytes, calls, q, slot_map, report):
    n = nbytes // 4
    x = np.full(n, r, np.float32)
    out = np.empty(world * n, np.float32)
    q[_OUT + r] = cma.address(memoryview(out))
    q[_IN + r] = cma.address(memoryview(x))
    q[_PID + r] = os.getpid()
    slots = [np.frombuffer(slot_map, np.float32, n, p * nbytes) for p in range(world)] \
        if method == "slot" else None
    # every rank's output address and pid are posted before anyone reads them
    q[_READY + r] = 1
    for p in range(world):
        _wait(q, _READY + p, 1)

    def call(ep):
        if method == "slot":
            _slot_call(q, r, world, x, out, slots, nbytes, ep)
        elif method == "direct":
            _direct_call(q, r, world, x, out, nbytes, ep)
        else:
            _read_call(q, r, world, x, out, nbytes, ep)
    for ep in range(1, 11):
        call(ep)
    ru0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for ep in range(11, 11 + calls):
        call(ep)
    wall = (time.perf_counter() - t0) / calls
    ru = resource.getrusage(resource.RUSAGE_SELF)
    if method == "read":
        _wait(q, _DONE + (r + 1) % world, 10 + calls)   # nobody reads my output any more
    got = out.reshape(world, n)
    if not ((got[:, 0] == np.arange(world)).all() and (got[:, -1] == np.arange(world)).all()):
        raise SystemExit(f"{method}: rank {r} gathered the wrong blocks")
    cpu = (ru.ru_utime - ru0.ru_utime + ru.ru_stime - ru0.ru_stime) / calls
    os.write(report, f"{r} {wall} {cpu}\n".encode())


def run(method, world, nbytes, calls):
    """(slowest rank's seconds per call, [each rank's CPU seconds per call])."""
    flags = mmap.mmap(-1, 4096)
    q = np.frombuffer(flags, dtype=np.int64)
    slot_map = mmap.mmap(-1, world * nbytes) if method == "slot" else mmap.mmap(-1, 4096)
    rd, wr = os.pipe()
    pids = []
    for r in range(world):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                os.close(rd)
                _rank(method, r, world, nbytes, calls, q, slot_map, wr)
            except BaseException as e:          # said on stderr, the parent fails
                print(f"allgather_floor: rank {r}: {e!r}", file=sys.stderr)
                code = 1
            os._exit(code)
        pids.append(pid)
    os.close(wr)
    with os.fdopen(rd) as f:
        lines = f.read().split("\n")
    failed = [pid for pid in pids if os.waitpid(pid, 0)[1] != 0]
    rows = [line.split() for line in lines if line]
    if failed or len(rows) != world:
        raise SystemExit(f"allgather_floor: {method} failed on {len(failed)} rank(s)")
    rows.sort(key=lambda row: int(row[0]))
    return max(float(w) for _, w, _ in rows), [float(c) for _, _, c in rows]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--sizes", default="1M", help="bytes of each rank's block, K/M/G units")
    p.add_argument("--calls", type=int, default=1000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--methods", default="slot,read,direct")
    args = p.parse_args(argv)
    if not 2 <= args.world <= MAX_WORLD:
        p.error(f"--world: 2 to {MAX_WORLD} ranks")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        if m not in ("slot", "read", "direct"):
            p.error(f"--methods: {m!r} is not slot, read or direct")
    print(f"# world {args.world}, {args.calls} calls a run, median of {args.repeat} runs; "
          f"load average {os.getloadavg()[0]:.2f}")
    print("method size us_per_call cpu_us_per_rank")
    for size in (parse_size(s) for s in args.sizes.split(",")):
        for m in methods:
            runs = [run(m, args.world, size, args.calls) for _ in range(args.repeat)]
            wall = statistics.median(w for w, _ in runs)
            cpu = statistics.median(c for _, cs in runs for c in cs)
            print(f"{m} {size} {wall * 1e6:.1f} {cpu * 1e6:.1f}", flush=True)
    print(f"# load average at the end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
