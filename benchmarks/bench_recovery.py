"""Time from a rank's death to the first successful collective of the survivors' group.

    .venv/bin/python benchmarks/bench_recovery.py [-n 4] [--repeat 5] [--out FILE]

A job of N ranks runs all_reduce of 1024 float32 in a loop; after 0.3 s one rank
writes the time and SIGKILLs itself. Each survivor catches PeerLost/GroupClosed,
calls accord.shrink() and runs one all_reduce of the new group; it reports how
long after the death it learnt of it (detection) and how long after the death
that all_reduce completed (recovery). A run's figure is the slowest survivor's;
the table shows the median and the worst of --repeat runs, for each of:

- `accord run --keep-going` (the launcher hosts the store), rank 2 dies;
- ranks started by hand with tcp:// (rank 0 serves the store from a process of
  its own), rank 0 dies: the store's owner;

each over shared memory (ACCORD_TRANSPORT=auto on one host) and over TCP.
"""
import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker(out_dir, victim, init, rank, world):
    import numpy as np

    import accord
    if init:
        accord.init_process_group(init_method=init, rank=rank, world_size=world)
    else:
        accord.init_process_group()
    rank = accord.get_rank()
    x = np.ones(1024, np.float32)
    accord.barrier()
    t0 = time.monotonic()
    try:
        while True:
            if rank == victim and time.monotonic() - t0 > 0.3:
                with open(os.path.join(out_dir, "death"), "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            accord.all_reduce(x)
    except (accord.PeerLost, accord.GroupClosed):
        seen = time.time()
    accord.shrink(timeout=30)
    accord.all_reduce(x)
    done = time.time()
    with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
        json.dump([seen, done], f)
    accord.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(world, how, transport):
    with tempfile.TemporaryDirectory(prefix="accord-bench-recovery-") as tmp:
        env = dict(os.environ, ACCORD_TRANSPORT=transport, ACCORD_TIMEOUT="60",
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        me = os.path.abspath(__file__)
        if how == "launcher":
            victim = 2
            subprocess.run([sys.executable, "-m", "accord", "run", "-n", str(world),
                            "--keep-going", me, "--worker", tmp, str(victim), ""],
                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           timeout=120)
        else:
            victim = 0
            for var in ("ACCORD_LAUNCHER_STORE", "RANK", "WORLD_SIZE"):
                env.pop(var, None)
            url = f"tcp://127.0.0.1:{_free_port()}"
            procs = [subprocess.Popen([sys.executable, me, "--worker", tmp, str(victim), url,
                                       str(r), str(world)], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                     for r in range(world)]
            for p in procs:
                p.wait(timeout=120)
        with open(os.path.join(tmp, "death")) as f:
            death = float(f.read())
        got = []
        for name in os.listdir(tmp):
            if name.startswith("rank"):
                with open(os.path.join(tmp, name)) as f:
                    got.append(json.load(f))
        if len(got) != world - 1:
            raise RuntimeError(f"{how}/{transport}: {len(got)} of {world - 1} survivors "
                               f"reported")
        return max(s - death for s, _ in got), max(d - death for _, d in got)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", nargs="+", default=None)
    args = ap.parse_args()
    if args.worker:
        out_dir, victim, init, *rest = args.worker
        worker(out_dir, int(victim), init, *(int(v) for v in rest or (-1, -1)))
        return
    rows = ["| start | who dies | transport | detection (s, median / max) | "
            "death to first collective of the new group (s, median / max) |",
            "|---|---|---|---:|---:|"]
    for how, who in (("launcher", "rank 2"), ("by hand, tcp://", "rank 0 (the store's owner)")):
        for transport in ("auto", "tcp"):
            runs = [one_run(args.n, "launcher" if how == "launcher" else "hand", transport)
                    for _ in range(args.repeat)]
            det = [r[0] for r in runs]
            rec = [r[1] for r in runs]
            rows.append(f"| {'accord run --keep-going' if how == 'launcher' else how} | {who} | "
                        f"{'shm' if transport == 'auto' else 'tcp'} | "
                        f"{statistics.median(det):.2f} / {max(det):.2f} | "
                        f"{statistics.median(rec):.2f} / {max(rec):.2f} |")
            print(rows[-1], flush=True)
    text = (f"`python benchmarks/bench_recovery.py -n {args.n} --repeat {args.repeat}` "
            f"(world {args.n}; load average {os.getloadavg()[0]:.1f} at the end)\n\n"
            + "\n".join(rows) + "\n")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
