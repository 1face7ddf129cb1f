"""Running a benchmark's worker under `accord run` at each world size, for the scripts
that time in their own rank processes and print one `RESULT {json}` line a result
(bench_ahead.py, bench_halves.py), and timing a block of calls inside those ranks
(slowest_per_call)."""
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_worlds(script, worlds, worker_args, env=None):
    """Run `accord run -n N script --worker *worker_args` for each N in worlds, from the
    repository's root with it first on PYTHONPATH (and OMP_NUM_THREADS=1 unless set),
    echoing every other line the ranks print. Returns the parsed RESULT lines of every
    run, in order; exits with a run's exit code where one fails."""
    env = dict(os.environ, **(env or {}))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    results = []
    for n in worlds:
        cmd = [sys.executable, "-m", "accord", "run", "-n", str(n), os.path.abspath(script),
               "--worker", *worker_args]
        out = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
        lines = out.stdout.splitlines()
        sys.stdout.write("".join(line + "\n" for line in lines if "RESULT " not in line))
        if out.returncode:
            print(f"world {n}: failed with exit code {out.returncode}", file=sys.stderr)
            sys.exit(out.returncode)
        results += [json.loads(line.split("RESULT ", 1)[1]) for line in lines
                    if "RESULT " in line]
    return results


def slowest_per_call(fn, calls, warm=0, in_step=False):
    """In a rank of an accord job: fn() `warm` times untimed, a barrier, then `calls`
    times back to back (in_step: each after a barrier of its own and timed alone, the
    barriers left out). Returns the slowest rank's seconds a call (every rank gets it:
    an all_reduce of the ranks' times, MAX)."""
    import numpy as np

    import accord
    for _ in range(warm):
        fn()
    accord.barrier()
    if in_step:
        spent = 0.0
        for _ in range(calls):
            accord.barrier()
            t0 = time.perf_counter()
            fn()
            spent += time.perf_counter() - t0
    else:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        spent = time.perf_counter() - t0
    slowest = np.array([spent / calls])
    accord.all_reduce(slowest, op=accord.ReduceOp.MAX)
    return float(slowest[0])


def write_table(md, out):
    """Print the markdown table and, where out is given, write it there (relative to the
    repository's root)."""
    print(md)
    if out:
        with open(os.path.join(ROOT, out), "w") as f:
            f.write(md)
