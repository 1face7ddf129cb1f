"""Point-to-point ping-pong written three ways, accord beside MPICH: what a program's
choice of calls costs, not only what the transport allows.

    .venv/bin/python benchmarks/p2p_patterns.py [--iters 3000] [--rounds 3] [--no-mpi]

Two ranks exchange a 2-element float32 message (8 bytes) back and forth, each way
written as:

- blocking:  send / recv (what `accord bench`'s pingpong times);
- wait each: isend(...).wait(), then irecv(...).wait();
- post first: irecv posted, then isend, then both waited (MPI's usual pattern, as
  in a halo exchange): the rank that answers posts its receive and waits for it
  before it sends.

A round times --iters round trips of each pattern after a barrier; the figure is the
median round's one-way time (half a round trip) on rank 0, in µs. accord runs under
`accord run -n 2`, MPICH through mpi4py under the mpiexec next to this Python
(skipped with --no-mpi, and with a line saying so where there is none). The rounds of a
library run in one job, the patterns in turn within each round; the two libraries
run one after the other, so compare the ratios of one run, not figures of different
runs (the load average is printed beside them).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from accord.cli.bench import find_mpiexec     # the mpiexec `accord bench` runs MPICH with

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PATTERNS = ("blocking", "wait each", "post first")


def _patterns(rank, send, recv, isend, irecv, wait, wait_all):
    """The three patterns over one library's calls: send/recv(buf, peer) blocking,
    isend/irecv(buf, peer) returning a request, wait(request), wait_all(requests)."""
    import numpy as np
    out, into = np.zeros(2, np.float32), np.zeros(2, np.float32)
    peer = 1 - rank

    def blocking():
        if rank == 0:
            send(out, peer)
            recv(into, peer)
        else:
            recv(into, peer)
            send(out, peer)

    def wait_each():
        if rank == 0:
            wait(isend(out, peer))
            wait(irecv(into, peer))
        else:
            wait(irecv(into, peer))
            wait(isend(out, peer))

    def post_first():
        r = irecv(into, peer)
        if rank == 0:
            wait_all([isend(out, peer), r])
        else:
            wait(r)
            wait(isend(out, peer))

    return blocking, wait_each, post_first


def _accord_calls():
    import accord
    accord.init_process_group()
    rank = accord.get_rank()

    def wait_all(requests):
        for r in requests:
            r.wait()
    fns = _patterns(rank, accord.send, accord.recv, accord.isend, accord.irecv,
                    lambda r: r.wait(), wait_all)
    return rank, accord.barrier, fns, accord.destroy_process_group


def _mpi_calls():
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    fns = _patterns(rank, comm.Send, comm.Recv, comm.Isend, comm.Irecv, lambda r: r.Wait(),
                    MPI.Request.Waitall)
    return rank, comm.Barrier, fns, lambda: None


def worker(lib, iters, rounds):
    rank, barrier, fns, close = (_accord_calls if lib == "accord" else _mpi_calls)()
    times = {name: [] for name in PATTERNS}
    for rnd in range(rounds + 1):              # the first round warms up
        for name, fn in zip(PATTERNS, fns):
            barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            one_way = (time.perf_counter() - t0) / iters / 2
            if rnd:
                times[name].append(one_way)
    barrier()
    if rank == 0:
        print("RESULT " + json.dumps({"lib": lib, "times": times}), flush=True)
    close()


def _run(cmd):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    out = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    lines = out.stdout.splitlines()
    sys.stdout.write("".join(line + "\n" for line in lines if "RESULT " not in line))
    if out.returncode:
        sys.exit(f"{' '.join(cmd[:4])}...: failed with exit code {out.returncode}")
    [res] = [json.loads(line.split("RESULT ", 1)[1]) for line in lines if "RESULT " in line]
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-mpi", action="store_true")
    p.add_argument("--worker", choices=("accord", "mpi"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.iters, args.rounds)
    script = os.path.abspath(__file__)
    opts = ["--iters", str(args.iters), "--rounds", str(args.rounds)]
    load = os.getloadavg()
    results = [_run([sys.executable, "-m", "accord", "run", "-n", "2", script,
                     "--worker", "accord", *opts])]
    mpiexec = None if args.no_mpi else find_mpiexec()
    if mpiexec is not None:
        results.append(_run([mpiexec, "-n", "2", sys.executable, script, "--worker", "mpi",
                             *opts]))
    elif not args.no_mpi:
        print("no mpiexec next to this Python or on PATH: accord alone")
    end = os.getloadavg()
    med = {r["lib"]: {k: statistics.median(v) * 1e6 for k, v in r["times"].items()}
           for r in results}
    print(f"one-way µs (8 bytes), the median of {args.rounds} rounds of {args.iters} round "
          f"trips; load average {load[0]:.2f} at the start, {end[0]:.2f} at the end")
    head = "| pattern | accord µs |" + (" mpich µs | accord/mpich |" if "mpi" in med else "")
    print(head)
    print("|---|---:|" + ("---:|---:|" if "mpi" in med else ""))
    for name in PATTERNS:
        row = f"| {name} | {med['accord'][name]:.1f} |"
        if "mpi" in med:
            row += f" {med['mpi'][name]:.1f} | {med['accord'][name] / med['mpi'][name]:.2f}x |"
        print(row)


if __name__ == "__main__":
    main()
