"""Synchronising a model: broadcast_state vs a per-tensor broadcast loop vs gloo's loop.

    .venv/bin/python benchmarks/bench_state.py [-n 2,4] [--repeat 15] [--calls K] [--out FILE]

A state dict of 100 float32 tensors, about 50 MiB in all (sizes from 4 KiB to
2 MiB, geometric), is sent from rank 0 to every rank; then one of 1000 tensors,
about 10 MiB (sizes from 0.5 KiB to 128 KiB: where per-call costs dominate):

- accord.broadcast_state(sd)                 (dtype buckets of 25 MiB)
- accord.broadcast_state(module)             (the same tensors as a module's buffers)
- for t in sd.values(): accord.broadcast(t)   (the naive loop, on accord)
- the same loop inside `with accord.coalescing():`
- for t in sd.values(): torch.distributed.broadcast(t)   (torch's gloo backend)

All of them run in the same processes, interleaved (each round starting one
method later, and resting 0.1 s after gloo's loop, whose aftermath slowed the
next method), each timed `--repeat` times after two warm-up rounds; a round's
time is the slowest rank's (barrier before, max over ranks after) for --calls
back-to-back calls, divided by --calls (with --calls 10 or more, a tenth as
many run untimed just before), and the table shows the median. Each world size
is one `accord run -n N` of this file with --worker.

--calls (default 1; 10 with --small): one call alone after a barrier also
times the barrier's wake-up (the last rank to arrive wakes the others, which
on an idle core can take tens of µs), a constant added to every method that
hides their differences at small states; back-to-back calls time what a
training loop that syncs often sees, as `accord bench` times blocks of calls.

--small runs small states instead, where fixed costs decide: 10, 30, 81 and
300 float32 tensors of 128 B to 128 KiB (geometric sizes), with one more
method beside the others, one accord.broadcast of a flat tensor holding the
same bytes (what broadcast_state cannot beat; its target is to stay within
100 µs of it, and at least 2x faster than the per-tensor loop).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20


def make_state(rank, n=100, total=50 * MiB):
    """n float32 tensors; total: their bytes (sizes geometric over a factor of 512), or
    (smallest, largest) bytes of a tensor (sizes geometric between them)."""
    import torch
    if isinstance(total, tuple):
        lo, hi = total
        sizes = [max(1, int(lo * (hi / lo) ** (i / max(1, n - 1))) // 4) for i in range(n)]
    else:
        raw = [512 ** (i / (n - 1)) for i in range(n)]
        scale = total / sum(raw)
        sizes = [max(1, int(r * scale) // 4) for r in raw]
    g = torch.Generator().manual_seed(0)
    sd = {}
    for i, s in enumerate(sizes):
        t = torch.empty(s)
        if rank == 0:
            t.normal_(generator=g)
        else:
            t.zero_()
        sd[f"layer{i // 4}.p{i % 4}"] = t
    return sd


def worker(repeat, small=False, calls=1):
    import torch
    import torch.distributed as tdist

    import accord

    accord.init_process_group()
    rank, world = accord.get_rank(), accord.get_world_size()
    port = os.environ["MASTER_PORT"]
    tdist.init_process_group("gloo", init_method=f"file:///tmp/accord-bench-state-{port}",
                             rank=rank, world_size=world)
    for n, total in (SMALL_CONFIGS if small else CONFIGS):
        sd = make_state(rank, n, total)
        run_config(sd, make_state(0, n, total), rank, world, repeat, tdist, torch, accord,
                   calls)
    tdist.destroy_process_group()
    accord.destroy_process_group()


CONFIGS = [(100, 50 * MiB), (1000, 10 * MiB)]
GLOO_SETTLE_S = 0.1     # rest after gloo's loop before the next method (see run_config)
SMALL_CONFIGS = [(n, (128, 128 << 10)) for n in (10, 30, 81, 300)]


def run_config(sd, ref, rank, world, repeat, tdist, torch, accord, calls=1):
    from worlds import slowest_per_call
    nbytes = sum(t.numel() * 4 for t in sd.values())
    n = len(sd)

    def reset():
        if rank != 0:
            for t in sd.values():
                t.zero_()
            flat.zero_()

    def check(name):
        if rank != 0:
            for k, t in sd.items():
                if not torch.equal(t, ref[k]):
                    raise AssertionError(f"{name}: rank {rank}: {k} differs from rank 0's")

    def state():
        accord.broadcast_state(sd, src=0)

    # the same tensors as a module's buffers: what broadcast_state(model) costs beyond the
    # dict (the module's state_dict, taken every call)
    module = torch.nn.Module()
    for i, t in enumerate(sd.values()):
        module.register_buffer(f"t{i}", t)

    def state_module():
        accord.broadcast_state(module, src=0)

    def loop():
        for t in sd.values():
            accord.broadcast(t, src=0)

    def coalesced():
        with accord.coalescing():
            for t in sd.values():
                accord.broadcast(t, src=0)

    def gloo():
        for t in sd.values():
            tdist.broadcast(t, src=0)

    flat_ref = torch.arange(nbytes // 4, dtype=torch.float32)
    flat = flat_ref.clone() if rank == 0 else torch.zeros(nbytes // 4)

    def one():
        accord.broadcast(flat, src=0)

    def check_one(name):
        if not torch.equal(flat, flat_ref):
            raise AssertionError(f"{name}: rank {rank}: the flat tensor differs from rank 0's")

    methods = [("accord.broadcast_state(sd)", state),
               ("accord.broadcast_state(module)", state_module),
               ("accord.broadcast loop", loop),
               ("accord.broadcast loop in coalescing()", coalesced),
               ("one accord.broadcast of the same bytes", one),
               ("torch gloo broadcast loop", gloo)]
    times = {name: [] for name, _ in methods}
    for it in range(repeat + 2):
        # each round starts one method later (the machine's speed drifts; none is always
        # timed first). A rotation keeps the cyclic order, so the method after gloo's loop
        # would always be the same one: on 2 cores, 3 ranks, 10 small tensors, that one
        # (broadcast_state) took 75-226 us a sync right after gloo's loop and 78-89 us
        # after another method; the effect lasts some tens of ms (why is not known:
        # GLOO_SETTLE_S of sleep after gloo's loop brings it to 74-94 us, 20 ms does
        # not), so every round rests that long after gloo's loop; and with --calls 10
        # or more a tenth of them go untimed first, so that no block starts from a
        # rest or another method's caches
        for name, fn in methods[it % len(methods):] + methods[:it % len(methods)]:
            reset()
            t = slowest_per_call(fn, calls, warm=calls // 10 if it and calls >= 10 else 0)
            if it >= 2:
                times[name].append(t)
            if it == 0:
                (check_one if fn is one else check)(name)
            if fn is gloo:
                time.sleep(GLOO_SETTLE_S)
    if rank == 0:
        print("RESULT " + json.dumps({"world": world, "nbytes": nbytes, "tensors": n,
                                      "calls": calls, "times": times}), flush=True)


def table(results, command):
    calls = sorted({res.get("calls", 1) for res in results})
    lines = [f"`{command}`", "",
             f"time per sync: the median round's slowest rank, {'/'.join(map(str, calls))} "
             f"back-to-back call(s) a round", "",
             "| world | state dict | method | time per sync (ms, median) | GB/s | vs gloo loop "
             "| vs accord loop |",
             "|---:|---|---|---:|---:|---:|---:|"]
    for res in results:
        med = {k: statistics.median(v) for k, v in res["times"].items()}
        gloo = med["torch gloo broadcast loop"]
        loop = med["accord.broadcast loop"]
        mb = res["nbytes"] / MiB
        size = f"{mb:.0f} MiB" if mb >= 10 else f"{res['nbytes'] / 1024:.0f} KiB"
        what = f"{res['tensors']} float32 tensors, {size}"
        for k, v in med.items():
            lines.append(f"| {res['world']} | {what} | {k} | {v * 1e3:.3f} | "
                         f"{res['nbytes'] / v / 1e9:.2f} | {gloo / v:.1f}x | {loop / v:.2f}x |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", default="2,4", help="world sizes, comma-separated")
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--out", default=None,
                    help="markdown table (default benchmarks/results/state.md, "
                         "state-small.md with --small)")
    ap.add_argument("--small", action="store_true",
                    help="small states (10-300 tensors of 128 B-128 KiB) instead")
    ap.add_argument("--calls", type=int, default=None,
                    help="back-to-back calls per timed round (default 1; 10 with --small)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    calls = args.calls or (10 if args.small else 1)
    if args.worker:
        worker(args.repeat, args.small, calls)
        return 0
    command = "python benchmarks/bench_state.py " + " ".join(sys.argv[1:])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    results = []
    load0 = os.getloadavg()
    for n in [int(x) for x in args.n.split(",")]:
        cmd = [sys.executable, "-m", "accord", "run", "-n", str(n), os.path.abspath(__file__),
               "--worker", "--repeat", str(args.repeat), "--calls", str(calls)] + \
            (["--small"] if args.small else [])
        print("running: " + " ".join(cmd[1:]), flush=True)
        out = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
        sys.stdout.write("".join(l + "\n" for l in out.stdout.splitlines()
                                 if not l.startswith("RESULT ")))
        if out.returncode:
            print(f"world {n}: failed with exit code {out.returncode}", file=sys.stderr)
            return out.returncode
        for line in out.stdout.splitlines():
            if "RESULT " in line:
                results.append(json.loads(line.split("RESULT ", 1)[1]))
    load1 = os.getloadavg()
    out_path = args.out or os.path.join("benchmarks", "results",
                                        "state-small.md" if args.small else "state.md")
    md = table(results, command) + (f"\nload average {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f} "
                                    f"at the start, {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f} "
                                    f"at the end\n")
    print(md)
    os.makedirs(os.path.dirname(os.path.join(ROOT, out_path)), exist_ok=True)
    with open(os.path.join(ROOT, out_path), "w") as f:
        f.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
