"""run_torch: run a function in N forked processes that form a torch.distributed job.

Each rank calls torch's own init_process_group (file:// rendezvous in a fresh
temporary directory, so no ports are guessed) once per backend in `backends`,
runs fn(rank, world, backend, *args), destroys the group, and sends back a
dict {backend: result}. Exceptions come back with their traceback, as in
tests/harness.py. The parent imports torch before forking, so children pay
no import cost; nothing in the parent runs torch kernels.
"""
import datetime
import multiprocessing as mp
import os
import pickle
import tempfile
import time
import traceback

import accord.torch  # noqa: F401  (registers the backend before the fork)
import torch.distributed as dist

_CTX = mp.get_context("fork")


class RankFailed(AssertionError):
    pass


def _child(rank, world, tmp, backends, fn, args, conn, timeout, env):
    try:
        import torch
        torch.set_num_threads(1)
        os.environ.update(env)
        out = {}
        for i, backend in enumerate(backends):
            dist.init_process_group(backend, init_method=f"file://{tmp}/store{i}", rank=rank,
                                    world_size=world,
                                    timeout=datetime.timedelta(seconds=timeout))
            try:
                out[backend] = fn(rank, world, backend, *args)
            finally:
                dist.destroy_process_group()
        conn.send(("ok", pickle.dumps(out)))
    except BaseException as e:
        try:
            conn.send(("error", (type(e).__name__, str(e), traceback.format_exc())))
        except Exception:
            pass
    finally:
        conn.close()
        os._exit(0)


def run_torch(world, fn, *args, backends=("accord",), timeout=60, env=None, expect_fail=False,
              pg_timeout=None):
    """fn(rank, world, backend, *args) on `world` ranks, once per backend.

    timeout bounds the whole run; pg_timeout (default: timeout) is the groups'.

    Returns [ {backend: result} per rank ]. With expect_fail=True, returns
    [(kind, payload)] per rank: kind "ok" (payload the dict), "error"
    (type name, message, traceback), "hung" or "died".
    """
    env = {k: str(v) for k, v in (env or {}).items()}
    with tempfile.TemporaryDirectory(prefix="accord-torch-") as tmp:
        procs, conns = [], []
        try:
            for r in range(world):
                parent, child = _CTX.Pipe(duplex=False)
                p = _CTX.Process(target=_child, daemon=True,
                                 args=(r, world, tmp, tuple(backends), fn, args, child,
                                       pg_timeout or timeout, env))
                p.start()
                child.close()
                procs.append(p)
                conns.append(parent)
            deadline = time.monotonic() + timeout + 10
            outcomes = []
            for p, c in zip(procs, conns):
                if c.poll(max(0.0, deadline - time.monotonic())):
                    try:
                        outcomes.append(c.recv())
                    except EOFError:
                        outcomes.append(("died", f"exit code {p.exitcode}"))
                else:
                    outcomes.append(("hung", "no result before the deadline"))
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()
    if expect_fail:
        return [(k, pickle.loads(v) if k == "ok" else v) for k, v in outcomes]
    failed = [(r, k, v) for r, (k, v) in enumerate(outcomes) if k != "ok"]
    if failed:
        lines = []
        for r, k, v in failed:
            lines.append(f"--- rank {r}: {k}")
            lines.append(v[2] if k == "error" else str(v))
        raise RankFailed("\n".join(lines))
    return [pickle.loads(v) for _, v in outcomes]
