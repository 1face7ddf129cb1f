"""accord over TCP vs torch's gloo (and MPICH), world 2, loopback: the table of issue 2.

    .venv/bin/python benchmarks/bench_vs_gloo.py [extra accord bench options]

Runs, from the repository root, the single command printed below (also written
at the top of the markdown file), which times accord with ACCORD_TRANSPORT=tcp,
torch gloo and mpi4py/MPICH side by side with accord bench's method
(see accord/cli/bench_worker.py) and writes, under benchmarks/results/:

    bench-tcp-w2.csv          every row (lib, world, op, size, lat_us, algbw, busbw, ...)
    README-table-tcp.md       the table for the README, with the command and settings
    bench-tcp-w2.png          busbw and latency against size, one line per library

Each library runs three times, interleaved (accord, gloo, mpich, accord, ...),
and every row is the median of the three: on a small, shared machine this keeps
a burst of outside load from landing on one library only.  A run takes about
four minutes on 2 cores.

Extra options are passed on to `accord bench` (e.g. --glibc-tunables
glibc.cpu.x86_non_temporal_threshold=0x1000000, or -n 2,4); the run says which
GLIBC_TUNABLES setting it used.
"""
import os
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join("benchmarks", "results")


def main(extra):
    args = ["bench", "-n", "2", "--transport", "tcp",
            "--ops", "broadcast,all_gather,scatter,all_reduce",
            "--sizes", "8,1K,64K,1M,16M,64M", "--compare", "gloo,mpi", "--repeat", "3",
            "--csv", os.path.join(OUT, "bench-tcp-w2.csv"),
            "--markdown", os.path.join(OUT, "README-table-tcp.md"),
            "--plot", os.path.join(OUT, "bench-tcp-w2.png"), *extra]
    print("command: accord " + " ".join(shlex.quote(a) for a in args), flush=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    return subprocess.call([sys.executable, "-m", "accord", *args], cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
