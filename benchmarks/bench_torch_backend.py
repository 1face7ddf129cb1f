"""torch.distributed with backend "accord" vs backend "gloo", and accord called directly.

    .venv/bin/python benchmarks/bench_torch_backend.py --world 2 \\
        [--sizes 8,1K,64K,1M,16M,64M] [--repeat 3] [--csv out.csv] [--markdown out.md]

The method is accord bench's (warm-up, barrier-led blocks): ranks started
with torch.multiprocessing.spawn; for every (op, size) a warm-up, then timed
blocks of ITERS ops each preceded by a barrier; a block's time is the max
over ranks; the row is the median block / ITERS; busbw with nccl-tests'
factors. Tensors are float32 torch tensors of `size` bytes per rank.

Three libraries run in the same rank processes, one after the other (and the
whole sequence --repeat times, interleaved; each row is the median over the
repeats, so a burst of outside load does not land on one library only):

    torch-gloo    torch.distributed, init_process_group("gloo")
    torch-accord  torch.distributed, init_process_group("accord") (import accord.torch)
    accord        accord's own functions on the same torch tensors

The last table compares torch-accord with accord at 8 bytes: the cost of
going through torch's Python layer and the backend adapter.

With --paired, `torch-bare` may run beside them too: torch's functions over a
ProcessGroup whose methods do nothing but call accord's (no argument checks,
no options read but the root, no Work): the least any backend written in
Python can cost under torch's layer, so its ratio is torch's own share.

--paired (the way to measure that cost on a shared, noisy machine) runs
torch-accord and accord side by side instead of one after the other: both
are initialized together in the same rank processes (two accord groups over
two stores), and their timed blocks alternate (A B, then B A, ...), so a
burst of outside load lands on both. Each block pair gives a ratio
torch-accord/accord; the overhead table then shows the median of those
ratios over every block of every repeat, and the lowest and highest
per-repeat medians. torch-gloo, if asked for, still runs on its own.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SIZES = [8, 1 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
OPS = ["broadcast", "all_gather", "scatter", "all_reduce"]
LIBS = ["torch-gloo", "torch-accord", "accord"]      # and torch-bare, with --paired
FIELDS = ["lib", "world", "op", "size_bytes", "lat_us", "algbw_GBps", "busbw_GBps", "op_p50_us",
          "blk_min_us", "iters", "blocks", "repeats"]


def plan(size):
    """(warmup, iters per block, blocks), as `accord bench` plans them."""
    if size <= 1 << 10:
        return 50, 200, 7
    if size <= 64 << 10:
        return 20, 100, 7
    if size <= 1 << 20:
        return 5, 20, 7
    if size <= 16 << 20:
        return 2, 5, 5
    return 1, 3, 5


def bus_factor(op, n):
    return {"broadcast": 1.0, "all_gather": (n - 1) / n,
            "scatter": (n - 1) / n, "all_reduce": 2 * (n - 1) / n}[op]


def parse_size(text):
    text = text.strip().upper().rstrip("B").rstrip("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * mult


_BARE = {}


def _bare_group(rank, world):
    """torch-bare: a torch group over the accord group of torch's default (accord) group,
    registered as backend "accord-bare", that does nothing but call accord."""
    import torch.distributed as dist

    import accord
    _BARE["g"] = dist.group.WORLD.accord_group     # this repeat's

    class Bare(dist.ProcessGroup):
        def __init__(self):
            super().__init__(rank, world)
            self.g = _BARE["g"]

        def rank(self):
            return rank

        def size(self):
            return world

        def getBackendName(self):
            return "accord-bare"

        def setGroupName(self, name):
            self._name = name

        def getGroupName(self):
            return self._name

        def broadcast(self, tensors, opts):
            accord.broadcast(tensors[0], group_src=opts.rootRank, group=self.g)

        def allreduce(self, tensors, opts):
            accord.all_reduce(tensors[0], group=self.g)

        def allgather(self, outs, ins, opts):
            accord.all_gather(outs[0], ins[0], group=self.g)

        def scatter(self, outs, ins, opts):
            accord.scatter(outs[0], ins[0] if ins else None, group_src=opts.rootRank, group=self.g)

        def barrier(self, opts=None):
            accord.barrier(group=self.g)

    if "accord-bare" not in dist.Backend.backend_list:
        dist.Backend.register_backend("accord-bare", lambda *a: Bare(), devices=["cpu"])
    pg = dist.new_group(list(range(world)), backend="accord-bare")

    class D:                   # torch's functions on the bare group
        ReduceOp = dist.ReduceOp

        @staticmethod
        def broadcast(t, src):
            dist.broadcast(t, src, group=pg)

        @staticmethod
        def all_gather(outs, t):
            dist.all_gather(outs, t, group=pg)

        @staticmethod
        def scatter(t, lst, src):
            dist.scatter(t, lst, src=src, group=pg)

        @staticmethod
        def all_reduce(t, op):
            dist.all_reduce(t, op=op, group=pg)

        @staticmethod
        def barrier():
            dist.barrier(group=pg)

        @staticmethod
        def destroy_process_group():
            dist.destroy_process_group(pg)
    return D


def _init(lib, rank, world, path):
    if lib == "torch-bare":
        return _bare_group(rank, world)
    if lib == "accord":
        import accord
        accord.init_process_group(init_method=f"file://{path}", rank=rank, world_size=world,
                                  timeout=300)
        return accord
    import torch.distributed as dist
    dist.init_process_group(lib.split("-", 1)[1], init_method=f"file://{path}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=300))
    return dist


def _fns(D, x, gl, sc, y, z):
    return {
        "broadcast": lambda: D.broadcast(x, src=0),
        "all_gather": lambda: D.all_gather(gl, x),
        "scatter": lambda: D.scatter(y, sc, src=0),
        "all_reduce": lambda: D.all_reduce(z, op=D.ReduceOp.SUM),
    }


def _bench_libs(libs, rank, world, sizes, ops):
    """libs: [(name, D)], one library or two side by side (their blocks alternate).

    Returns (rows, ratios): ratios[(lib, op, size)] are the per-block ratios of lib
    to the last library (max over ranks of each block), when several run."""
    import torch
    rows, ratios = [], {}
    D0 = libs[0][1]
    for size in sizes:
        numel = size // 4
        x = torch.full((numel,), float(rank + 1))
        gl = [torch.empty(numel) for _ in range(world)]
        sc = [torch.full((numel,), float(i)) for i in range(world)] if rank == 0 else None
        y = torch.empty(numel)
        z = torch.zeros(numel)
        fns = [(lib, D, _fns(D, x, gl, sc, y, z)) for lib, D in libs]
        warm, iters, blocks = plan(size)
        for op in ops:
            for _, _, f in fns:
                for _ in range(warm):
                    f[op]()
            times = [[] for _ in fns]
            per_op = [[] for _ in fns]
            for b in range(blocks):
                order = list(enumerate(fns))
                if b % 2:
                    order.reverse()       # A B, B A, ...: drift within a pair cancels
                for i, (_, D, f) in order:
                    fn = f[op]
                    D.barrier()
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        t1 = time.perf_counter()
                        fn()
                        per_op[i].append(time.perf_counter() - t1)
                    times[i].append((time.perf_counter() - t0) / iters)
            flat = []
            for i in range(len(fns)):
                flat += times[i] + [statistics.median(per_op[i])]
            t = torch.tensor(flat, dtype=torch.float64)
            D0.all_reduce(t, op=D0.ReduceOp.MAX)
            t = t.tolist()
            blks = []
            for i, (lib, _, _) in enumerate(fns):
                part = t[i * (blocks + 1):(i + 1) * (blocks + 1)]
                blk, p50 = part[:-1], part[-1]
                blks.append(blk)
                rows.append((lib, world, op, size, statistics.median(blk), p50, min(blk), iters,
                             blocks))
            for (lib, _, _), blk in zip(fns[:-1], blks[:-1]):
                ratios[(lib, op, size)] = [a / b for a, b in zip(blk, blks[-1])]
    return rows, ratios


PAIR = ("torch-accord", "accord")


def worker(rank, world, tmp, sizes, ops, repeat, libs, paired, queue):
    import torch
    torch.set_num_threads(1)
    import accord.torch  # noqa: F401  registers the backend
    out, ratios = [], []
    n = 0
    together = list(PAIR) + (["torch-bare"] if "torch-bare" in libs else [])
    runs = [[lib] for lib in libs if not (paired and lib in together)]
    if paired:
        # torch-accord first (it makes torch's default group), accord last (the reference)
        runs.append([lib for lib in ("torch-accord", "torch-bare", "accord") if lib in together])
    for rep in range(repeat):
        for run in runs:
            Ds = []
            for lib in run:
                n += 1
                Ds.append((lib, _init(lib, rank, world, os.path.join(tmp, f"store{n}"))))
            rows, r = _bench_libs(Ds, rank, world, sizes, ops)
            out += rows
            ratios += [(lib, op, size, rep, blk) for (lib, op, size), blk in r.items()]
            for _, D in reversed(Ds):
                D.barrier()
                D.destroy_process_group()
            if rank == 0:
                print(f"  repeat {rep + 1}/{repeat}: {' + '.join(run)} done", file=sys.stderr,
                      flush=True)
    if rank == 0:
        queue.put((out, ratios))


def summarize(raw, world):
    """Median over repeats of each (lib, op, size) -> rows of FIELDS."""
    groups = {}
    for lib, w, op, size, med, p50, bmin, iters, blocks in raw:
        groups.setdefault((lib, op, size), []).append((med, p50, bmin, iters, blocks))
    rows = []
    for (lib, op, size), runs in groups.items():
        med = statistics.median(r[0] for r in runs)
        p50 = statistics.median(r[1] for r in runs)
        bmin = min(r[2] for r in runs)
        S = size * world if op in ("all_gather", "scatter") else size
        algbw = S / med / 1e9
        rows.append(dict(lib=lib, world=world, op=op, size_bytes=size, lat_us=med * 1e6,
                         algbw_GBps=algbw, busbw_GBps=algbw * bus_factor(op, world),
                         op_p50_us=p50 * 1e6, blk_min_us=bmin * 1e6, iters=runs[0][3],
                         blocks=runs[0][4], repeats=len(runs)))
    return rows


def _fmt_size(n):
    for unit, k in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k}{unit}"
    return str(n)


def summarize_pairs(ratios):
    """(lib, op, size) -> (median of every block ratio to accord, lowest and highest
    per-repeat median)."""
    by = {}
    for lib, op, size, rep, blk in ratios:
        by.setdefault((lib, op, size), []).append(blk)
    return {key: (statistics.median(r for blk in reps for r in blk),
                  min(statistics.median(blk) for blk in reps),
                  max(statistics.median(blk) for blk in reps)) for key, reps in by.items()}


def markdown(rows, world, libs, command, pairs=None):
    by = {(r["lib"], r["op"], r["size_bytes"]): r for r in rows}
    sizes = sorted({r["size_bytes"] for r in rows})
    ops = [op for op in OPS if any(r["op"] == op for r in rows)]
    lines = [f"`{command}`", "",
             f"world {world}, float32, latency in µs (median block / iters, max over ranks) "
             f"and busbw in GB/s", ""]
    head = ["op", "size"] + [f"{lib} µs" for lib in libs] + [f"{lib} GB/s" for lib in libs]
    if "torch-gloo" in libs and "torch-accord" in libs:
        head.append("gloo/accord")
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for op in ops:
        for size in sizes:
            cells = [op, _fmt_size(size)]
            cells += [f"{by[(lib, op, size)]['lat_us']:.1f}" if (lib, op, size) in by else "-"
                      for lib in libs]
            cells += [f"{by[(lib, op, size)]['busbw_GBps']:.3f}" if (lib, op, size) in by
                      else "-" for lib in libs]
            if "torch-gloo" in libs and "torch-accord" in libs:
                g, a = by.get(("torch-gloo", op, size)), by.get(("torch-accord", op, size))
                cells.append(f"{g['lat_us'] / a['lat_us']:.2f}x" if g and a else "-")
            lines.append("| " + " | ".join(cells) + " |")
    if "accord" in libs and "torch-accord" in libs and 8 in sizes:
        bare = "torch-bare" in libs and pairs and any(k[0] == "torch-bare" for k in pairs)
        lines += ["", "overhead of the torch path at 8 bytes (target: at most 1.3x accord "
                  "called directly)", ""]
        if pairs:
            lines += ["paired: blocks alternate between them in the same processes; "
                      "ratio = median over every block pair, spread = lowest/highest "
                      "per-repeat median" + ("; torch-bare: torch's functions over a group "
                                             "that only calls accord (torch's own share)"
                                             if bare else ""), ""]
            head = ["op", "torch-accord µs", "accord µs", "ratio", "spread"]
            if bare:
                head += ["torch-bare µs", "torch-bare ratio", "spread"]
            lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        else:
            lines += ["| op | torch-accord µs | accord µs | ratio |", "|---|---|---|---|"]
        for op in ops:
            t, a = by.get(("torch-accord", op, 8)), by.get(("accord", op, 8))
            if t and a:
                line = f"| {op} | {t['lat_us']:.1f} | {a['lat_us']:.1f} | "
                if pairs and ("torch-accord", op, 8) in pairs:
                    med, lo, hi = pairs[("torch-accord", op, 8)]
                    line += f"{med:.2f}x | {lo:.2f}-{hi:.2f}x |"
                    b = by.get(("torch-bare", op, 8))
                    if bare and b and ("torch-bare", op, 8) in pairs:
                        med, lo, hi = pairs[("torch-bare", op, 8)]
                        line += f" {b['lat_us']:.1f} | {med:.2f}x | {lo:.2f}-{hi:.2f}x |"
                else:
                    line += f"{t['lat_us'] / a['lat_us']:.2f}x |"
                lines.append(line)
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--sizes", default="8,1K,64K,1M,16M,64M")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--libs", default=",".join(LIBS))
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--paired", action="store_true",
                    help="run torch-accord and accord side by side, blocks alternating, and "
                         "report the median per-block ratio (see above)")
    ap.add_argument("--csv", default="")
    ap.add_argument("--markdown", default="")
    a = ap.parse_args()
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    ops = a.ops.split(",")
    libs = a.libs.split(",")
    if a.paired and not all(lib in libs for lib in PAIR):
        ap.error("--paired needs both torch-accord and accord in --libs")
    if "torch-bare" in libs and not a.paired:
        ap.error("torch-bare runs only with --paired (over torch-accord's group)")
    command = "python benchmarks/bench_torch_backend.py " + " ".join(sys.argv[1:])
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="accord-bench-torch-") as tmp:
        mp.spawn(worker, args=(a.world, tmp, sizes, ops, a.repeat, libs, a.paired, q),
                 nprocs=a.world, join=True)
        raw, ratios = q.get()
    rows = summarize(raw, a.world)
    md = markdown(rows, a.world, libs, command, summarize_pairs(ratios) if ratios else None)
    print(md)
    if a.csv:
        with open(a.csv, "w") as f:
            f.write(",".join(FIELDS) + "\n")
            for r in rows:
                f.write(",".join(f"{r[k]:.4f}" if isinstance(r[k], float) else str(r[k])
                                 for k in FIELDS) + "\n")
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(md)


if __name__ == "__main__":
    main()
