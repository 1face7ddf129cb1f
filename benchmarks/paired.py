"""Paired rounds: accord at two or more commits, `accord bench` back to back, medians.

    python benchmarks/paired.py HEAD 49f5ec4 --ops pingpong,p2p_bw --sizes 8,64K,4M \
        --rounds 4 [--world 2] [--env name=VAR=VALUE ...]

This machine is shared and the same row moves by 20-50% between runs minutes
apart, so a change is judged by running the trees in turn, round after round
(a, b, then b, a, and so on), and comparing each row's median over the rounds. Each
commit's tree is exported with `git archive` into a temporary directory and
run from there (PYTHONPATH set to it), with this checkout's Python, so only
accord's code differs. The name `.` is this checkout as it is, uncommitted
changes and built C helper (accord/transport/ring_core.c) included; an exported
commit has no helper built, so it runs the pure-Python path. --env NAME=VAR=VALUE adds a variant: the first commit's
tree with an environment variable set (a threshold against its default, say).

Prints one line per row: each variant's median latency (µs) and, after them,
each variant's time over the first one's (below 1: faster than the first).
"""
import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def export(commit, into):
    """The tree of commit, unpacked under into; returns its path (`.`: this checkout)."""
    if commit == ".":
        return ROOT
    path = os.path.join(into, commit.replace("/", "_"))
    os.makedirs(path)
    archive = subprocess.run(["git", "-C", ROOT, "archive", commit], check=True,
                             stdout=subprocess.PIPE).stdout
    subprocess.run(["tar", "-x", "-C", path], input=archive, check=True)
    return path


def bench_once(tree, env_extra, args, csv_path):
    env = dict(os.environ, PYTHONPATH=tree, **env_extra)
    cmd = [sys.executable, "-m", "accord", "bench", "-n", str(args.world), "--ops", args.ops,
           "--sizes", args.sizes, "--no-barrier", "--csv", csv_path]
    out = subprocess.run(cmd, cwd=tree, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=args.timeout)
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} (env {env_extra}) failed with exit status "
                         f"{out.returncode}:\n{out.stdout[-4000:]}")
    with open(csv_path) as f:
        return {(r["op"], int(r["size_bytes"])): float(r["lat_us"])
                for r in csv.DictReader(f) if r["lib"] == "accord"}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("commits", nargs="+", help="commits to compare (the first is the base)")
    p.add_argument("--ops", default="broadcast,all_gather,scatter,all_reduce")
    p.add_argument("--sizes", default="8,64K")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--env", action="append", default=[], metavar="NAME=VAR=VALUE",
                   help="a variant: the first commit with VAR=VALUE in the environment")
    p.add_argument("--timeout", type=float, default=900)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="accord-paired-") as tmp:
        trees = {c: export(c, tmp) for c in dict.fromkeys(args.commits)}
        variants = [(c, trees[c], {}) for c in args.commits]
        for spec in args.env:
            name, _, assignment = spec.partition("=")
            var, _, value = assignment.partition("=")
            if not name or not var:
                p.error(f"--env {spec!r}: expected NAME=VAR=VALUE")
            variants.append((name, trees[args.commits[0]], {var: value}))
        times = {name: {} for name, _, _ in variants}
        for r in range(args.rounds):
            # every other round in reverse order: a drift of the host's speed within a
            # round (the first variant a round runs meeting a slower or faster host than
            # the last) cancels over pairs of rounds instead of favouring one variant
            for name, tree, env in (variants if r % 2 == 0 else variants[::-1]):
                got = bench_once(tree, env, args, os.path.join(tmp, f"{name}.{r}.csv"))
                for row, lat in got.items():
                    times[name].setdefault(row, []).append(lat)
            print(f"# round {r + 1}/{args.rounds} done, load {os.getloadavg()[0]:.2f}",
                  file=sys.stderr, flush=True)
    names = [name for name, _, _ in variants]
    print("op size " + " ".join(f"{n}_us" for n in names) + " " +
          " ".join(f"{n}/{names[0]}" for n in names[1:]))
    for row in sorted(times[names[0]], key=lambda r: (r[0], r[1])):
        meds = [statistics.median(times[n][row]) for n in names]
        print(f"{row[0]} {row[1]} " + " ".join(f"{m:.1f}" for m in meds) + " " +
              " ".join(f"{m / meds[0]:.2f}" for m in meds[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
