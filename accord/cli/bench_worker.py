"""One rank of `accord bench`: times collectives of one library and reports to the driver.

Started by accord.cli.bench, never by hand:

    accord run -n N -m accord.cli.bench_worker --lib accord|gloo ... (accord, torch gloo)
    mpiexec -n N python -m accord.cli.bench_worker --lib mpi ...     (mpi4py + MPICH)

The method is the anchor benchmarks' (bench_gloo.py, bench_mpi.py), unchanged:
for every size, allocate the buffers; for every op, warm up, then BLOCKS timed
blocks of ITERS ops, each block preceded by a barrier; a block's time is its
mean op time; the max over ranks of every block time (and of each rank's
median single-op time) is taken with an all_reduce(MAX); the reported latency
is the median block.  size = bytes of each rank's float32 tensor; busbw uses
nccl-tests' factors.  The point-to-point ops (pingpong, p2p_bw, halo: see
accord.cli.bench_p2p) run in the same loop, one op being one round trip, one
window or one exchange step; pingpong's and p2p_bw's latency is divided by the
messages that op moves.

Rank 0 writes lines that start with PREFIX on stdout, one JSON object each:
{"progress": "..."} before each measurement, {"row": {...}} after it.  After
the timing of each size, every result is checked (broadcast/all_gather/scatter
/all_reduce wrote what they should, every p2p receive buffer holds its
sender's pattern), and the row says so in "verified".
"""
import argparse
import json
import os
import statistics
import sys
import time

from accord.cli.bench_p2p import P2P_OPS, MpiStyle, TorchStyle, messages_per_call, p2p_ops

PREFIX = "@@accord-bench "
OPS = ("broadcast", "all_gather", "scatter", "all_reduce")
# timed only when asked for (--ops): reduce_scatter_tensor (MPI's Reduce_scatter_block),
# each rank's output block `size` bytes, its input the group size times that; and
# all_to_all_single (MPI's Alltoall), `size` bytes from each rank to each rank
EXTRA_OPS = ("reduce_scatter", "all_to_all")
ALL_OPS = OPS + EXTRA_OPS + P2P_OPS
BARRIER_SIZE = 8          # the barrier row is timed with the plan of an 8-byte op


def plan(size, quick=False):
    """(warm-up ops, ops per block, blocks): the same plan for every library; --quick is a smoke test."""
    if quick:
        return 2, 5, 3
    if size <= 1 << 10: return 50, 200, 7
    if size <= 64 << 10: return 20, 100, 7
    if size <= 1 << 20: return 5, 20, 7
    if size <= 16 << 20: return 2, 5, 5
    return 1, 3, 5


def bus_factor(op, n):
    """nccl-tests: busbw = algbw * factor."""
    return {"broadcast": 1.0, "all_gather": (n - 1) / n, "scatter": (n - 1) / n,
            "all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n,
            "all_to_all": (n - 1) / n, "barrier": 0.0,
            "pingpong": 1.0, "p2p_bw": 1.0, "halo": 1.0}[op]


def algbw_bytes(op, size, world):
    """nccl-tests' S: the bytes an op is said to move (all_gather/scatter/reduce_scatter/
    all_to_all: the whole buffer; pingpong/p2p_bw: one message, their latency being per
    message; halo: the two messages a rank sends in a step)."""
    if op == "halo":
        return 2 * size
    return size * world if op in ("all_gather", "scatter", "reduce_scatter",
                                  "all_to_all") else size


def _emit(obj):
    sys.stdout.write(PREFIX + json.dumps(obj) + "\n")
    sys.stdout.flush()


# --------------------------------------------------------------------------- the libraries
# Each adapter has rank, world, barrier(), max_over_ranks(list) -> list,
# buffers(size) -> (ops dict, verify() -> bool), p2p(size) -> the same for
# the point-to-point ops, close().

def _a2a_input(np, rank, world, numel):
    """all_to_all's input on rank: the block for rank p holds rank * world + p."""
    return (rank * world + np.arange(world, dtype=np.float32)).repeat(numel)


def _verify(done, rank, x, blocks, y, z, rs, a2a):
    """Whether the buffers hold what the ops in `done` leave there (any library:
    numpy arrays or torch tensors). blocks: all_gather's per-rank results; rs:
    reduce_scatter's output (its inputs are zeros); a2a: all_to_all's output as one
    row per sender (its inputs from _a2a_input)."""
    ok = True
    if "all_to_all" in done:
        for q in range(len(a2a)):
            ok &= bool((a2a[q] == q * len(a2a) + rank).all())
    if "reduce_scatter" in done:
        ok &= bool((rs == 0).all())
    if "broadcast" in done:
        ok &= bool((x == 1).all())
    if "all_gather" in done:
        for i, b in enumerate(blocks):
            ok &= bool((b == (1 if "broadcast" in done else i + 1)).all())
    if "scatter" in done:
        ok &= bool((y == rank).all())
    if "all_reduce" in done:
        ok &= bool((z == 0).all())
    return ok


class AccordLib:
    name = "accord"

    def __init__(self):
        import numpy as np
        import accord
        self.np, self.dist = np, accord
        accord.init_process_group()
        self.rank, self.world = accord.get_rank(), accord.get_world_size()

    def barrier(self):
        self.dist.barrier()

    def max_over_ranks(self, values):
        t = self.np.array(values, dtype=self.np.float64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return t.tolist()

    def buffers(self, size):
        np, dist, rank, world = self.np, self.dist, self.rank, self.world
        numel = size // 4
        x = np.full(numel, rank + 1, np.float32)
        gl = [np.empty(numel, np.float32) for _ in range(world)]
        sc = [np.full(numel, i, np.float32) for i in range(world)] if rank == 0 else None
        y = np.empty(numel, np.float32)
        z = np.zeros(numel, np.float32)
        rs_in, rs = np.zeros(numel * world, np.float32), np.full(numel, -1, np.float32)
        a2a_in, a2a = _a2a_input(np, rank, world, numel), np.full(numel * world, -1, np.float32)
        ops = {
            "broadcast": lambda: dist.broadcast(x, src=0),
            "all_gather": lambda: dist.all_gather(gl, x),
            "scatter": lambda: dist.scatter(y, sc, src=0),
            "all_reduce": lambda: dist.all_reduce(z, op=dist.ReduceOp.SUM),
            "reduce_scatter": lambda: dist.reduce_scatter_tensor(rs, rs_in),
            "all_to_all": lambda: dist.all_to_all_single(a2a, a2a_in),
            "barrier": lambda: dist.barrier(),
        }

        return ops, lambda done: _verify(done, rank, x, gl, y, z, rs,
                                         a2a.reshape(world, numel))

    def p2p(self, size):
        return p2p_ops(TorchStyle(self.dist, lambda a: a), self.rank, self.world, size)

    def facts(self):
        """What this run's group chose that moves its rows: the shared-memory single-copy
        threshold in bytes (-1: single copy off; None where the group has no
        shared-memory links), and whether ACCORD_SHM_CMA set it (else it was measured
        when the group was created)."""
        t = self.dist.world.default_group().transport
        cma_min = getattr(t, "cma_min", None)
        if cma_min is not None:
            cma_min = -1 if cma_min >= 1 << 62 else int(cma_min)
        return {"single_copy_min": cma_min,
                "single_copy_set": bool(os.environ.get("ACCORD_SHM_CMA", "").strip())}

    def close(self):
        self.dist.destroy_process_group()


class GlooLib:
    name = "gloo"

    def __init__(self):
        from datetime import timedelta
        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)
        self.torch, self.dist = torch, dist
        dist.init_process_group("gloo", init_method="env://",
                                rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]),
                                timeout=timedelta(seconds=float(os.environ.get(
                                    "ACCORD_BENCH_TIMEOUT", "300"))))
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def barrier(self):
        self.dist.barrier()

    def max_over_ranks(self, values):
        t = self.torch.tensor(values, dtype=self.torch.float64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return t.tolist()

    def buffers(self, size):
        torch, dist, rank, world = self.torch, self.dist, self.rank, self.world
        numel = size // 4
        x = torch.full((numel,), float(rank + 1))
        gl = [torch.empty(numel) for _ in range(world)]
        sc = [torch.full((numel,), float(i)) for i in range(world)] if rank == 0 else None
        y = torch.empty(numel)
        z = torch.zeros(numel)
        rs_in, rs = torch.zeros(numel * world), torch.full((numel,), -1.0)
        import numpy as np
        a2a_in = torch.from_numpy(_a2a_input(np, rank, world, numel))
        a2a = torch.full((numel * world,), -1.0)
        ops = {
            "broadcast": lambda: dist.broadcast(x, src=0),
            "all_gather": lambda: dist.all_gather(gl, x),
            "scatter": lambda: dist.scatter(y, sc, src=0),
            "all_reduce": lambda: dist.all_reduce(z, op=dist.ReduceOp.SUM),
            "reduce_scatter": lambda: dist.reduce_scatter_tensor(rs, rs_in),
            "all_to_all": lambda: dist.all_to_all_single(a2a, a2a_in),
            "barrier": lambda: dist.barrier(),
        }

        return ops, lambda done: _verify(done, rank, x, gl, y, z, rs,
                                         a2a.reshape(world, numel))

    def p2p(self, size):
        return p2p_ops(TorchStyle(self.dist, self.torch.from_numpy), self.rank, self.world,
                       size)

    def close(self):
        self.dist.barrier()
        self.dist.destroy_process_group()


class MpiLib:
    name = "mpich"

    def __init__(self):
        import numpy as np
        from mpi4py import MPI
        self.np, self.MPI = np, MPI
        self.comm = MPI.COMM_WORLD
        self.rank, self.world = self.comm.Get_rank(), self.comm.Get_size()
        self.name = _mpi_flavour(MPI)

    def barrier(self):
        self.comm.Barrier()

    def max_over_ranks(self, values):
        t = self.np.array(values, dtype=self.np.float64)
        out = self.np.empty_like(t)
        self.comm.Allreduce(t, out, op=self.MPI.MAX)
        return out.tolist()

    def buffers(self, size):
        np, MPI, comm, rank, world = self.np, self.MPI, self.comm, self.rank, self.world
        numel = size // 4
        x = np.full(numel, rank + 1, np.float32)
        gl = np.empty(numel * world, np.float32)
        sc = np.arange(world, dtype=np.float32).repeat(numel) if rank == 0 else None
        y = np.empty(numel, np.float32)
        z = np.zeros(numel, np.float32)
        zr = np.empty(numel, np.float32)
        rs_in, rs = np.zeros(numel * world, np.float32), np.full(numel, -1, np.float32)
        a2a_in, a2a = _a2a_input(np, rank, world, numel), np.full(numel * world, -1, np.float32)
        ops = {
            "broadcast": lambda: comm.Bcast(x, root=0),
            "all_gather": lambda: comm.Allgather(x, gl),
            "scatter": lambda: comm.Scatter(sc, y, root=0),
            "all_reduce": lambda: comm.Allreduce(z, zr, op=MPI.SUM),
            "reduce_scatter": lambda: comm.Reduce_scatter_block(rs_in, rs, op=MPI.SUM),
            "all_to_all": lambda: comm.Alltoall(a2a_in, a2a),
            "barrier": lambda: comm.Barrier(),
        }

        return ops, lambda done: _verify(done, rank, x, gl.reshape(world, numel), y, zr, rs,
                                         a2a.reshape(world, numel))

    def p2p(self, size):
        return p2p_ops(MpiStyle(self.comm, self.MPI), self.rank, self.world, size)

    def close(self):
        self.comm.Barrier()


def _mpi_flavour(MPI):
    try:
        text = MPI.Get_library_version().lower()
    except Exception:
        return "mpi"
    for name in ("mpich", "open mpi", "intel", "mvapich"):
        if name in text:
            return {"open mpi": "openmpi"}.get(name, name)
    return "mpi"


LIBS = {"accord": AccordLib, "gloo": GlooLib, "mpi": MpiLib}


# --------------------------------------------------------------------------- the method

def measure(lib, fn, warm, iters, blocks):
    """The timing loop; returns (median block time, max-over-ranks op p50, fastest block)."""
    for _ in range(warm):
        fn()
    times, per_op = [], []
    perf = time.perf_counter
    for _ in range(blocks):
        lib.barrier()
        t0 = perf()
        for _ in range(iters):
            t1 = perf(); fn(); per_op.append(perf() - t1)
        times.append((perf() - t0) / iters)
    t = lib.max_over_ranks(times + [statistics.median(per_op)])
    blk, p50 = t[:-1], t[-1]
    return statistics.median(blk), p50, min(blk)


def row(lib, op, size, med, p50, bmin, iters, blocks, verified):
    world = lib.world
    if op == "barrier":
        algbw = busbw = None
    else:
        algbw = algbw_bytes(op, size, world) / med / 1e9
        busbw = algbw * bus_factor(op, world)
    return {"lib": lib.name, "world": world, "op": op, "size_bytes": size,
            "lat_us": med * 1e6, "algbw_GBps": algbw, "busbw_GBps": busbw,
            "op_p50_us": p50 * 1e6, "blk_min_us": bmin * 1e6, "iters": iters,
            "blocks": blocks, "verified": verified}


def _peak_rss_mib():
    """This rank's peak resident memory so far (sizes run in increasing order)."""
    try:
        import resource
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return kib / 1024.0 if sys.platform != "darwin" else kib / 1048576.0
    except (ImportError, OSError):
        return 0.0


def run(lib, ops, sizes, quick, barrier):
    rank0 = lib.rank == 0
    say = (lambda text: _emit({"progress": text})) if rank0 else (lambda text: None)
    if rank0 and hasattr(lib, "facts"):
        _emit({"facts": lib.facts()})
    if barrier:
        warm, iters, blocks = plan(BARRIER_SIZE, quick)
        say("barrier")
        med, p50, bmin = measure(lib, lib.barrier, warm, iters, blocks)
        if rank0:
            _emit({"row": row(lib, "barrier", 0, med, p50, bmin, iters, blocks, True)})
    for size in sizes:
        say(f"allocating {size} B")
        ops_fn, checks = {}, []
        if any(op in OPS or op in EXTRA_OPS for op in ops):
            fns, verify = lib.buffers(size)
            ops_fn.update(fns)
            checks.append(verify)
        if any(op in P2P_OPS for op in ops):
            fns, verify = lib.p2p(size)
            ops_fn.update(fns)
            checks.append(verify)
        warm, iters, blocks = plan(size, quick)
        done, pending = [], []
        for op in ops:
            say(f"{op} {size} B")
            med, p50, bmin = measure(lib, ops_fn[op], warm, iters, blocks)
            if op in P2P_OPS:                  # one call moves several messages
                k = messages_per_call(op, size)
                med, p50, bmin = med / k, p50 / k, bmin / k
            done.append(op)
            pending.append((op, med, p50, bmin))
        # results are checked after every op of this size has run (as a reference benchmark would
        # run them, one after the other on the same buffers), on every rank
        ok = all(verify(done) for verify in checks)
        bad, rss = lib.max_over_ranks([0.0 if ok else 1.0, _peak_rss_mib()])
        for op, med, p50, bmin in pending:
            if rank0:
                r = row(lib, op, size, med, p50, bmin, iters, blocks, bad == 0.0)
                r["peak_rss_MiB"] = rss
                if op in P2P_OPS:
                    r["msgs_per_iter"] = messages_per_call(op, size)
                _emit({"row": r})
        del ops_fn, checks


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m accord.cli.bench_worker")
    ap.add_argument("--lib", choices=sorted(LIBS), required=True)
    ap.add_argument("--ops", default=",".join(OPS), help=f"of {','.join(ALL_OPS)}")
    ap.add_argument("--sizes", required=True, help="bytes, comma-separated")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-barrier", dest="barrier", action="store_false")
    a = ap.parse_args(argv)
    asked = a.ops.split(",")
    ops = [o for o in ALL_OPS if o in asked]     # the order _verify expects
    sizes = sorted(int(s) for s in a.sizes.split(",") if s)
    lib = LIBS[a.lib]()
    try:
        run(lib, ops, sizes, a.quick, a.barrier)
    finally:
        lib.close()
    if lib.rank == 0:
        _emit({"done": True})
    return 0


if __name__ == "__main__":
    sys.exit(main())
