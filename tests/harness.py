"""run_ranks: run a function in N real processes that form an accord job.

The parent hosts the rendezvous store (as `accord run` does) and waits for
every child under a deadline; a child's exception comes back with its
traceback and is re-raised in the test, and a hung child is killed.
"""
import multiprocessing as mp
import os
import pickle
import sys
import time
import traceback

from accord.tcpstore import TCPStoreServer

_CTX = mp.get_context("fork")


class RankFailed(AssertionError):
    pass


def _child(rank, world, port, env, fn, args, conn, init):
    try:
        torch = sys.modules.get("torch")
        if torch is not None:
            # a parent that ran torch kernels has an OpenMP pool a forked child cannot
            # use (its threads did not survive the fork): stay on one thread
            torch.set_num_threads(1)
        os.environ.update({k: str(v) for k, v in env.items()})
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port), ACCORD_LAUNCHER_STORE=f"127.0.0.1:{port}")
        import accord
        if init:
            accord.init_process_group()
        result = fn(rank, world, *args)
        if init:
            accord.destroy_process_group()
        conn.send(("ok", pickle.dumps(result)))
    except BaseException as e:
        conn.send(("error", (type(e).__name__, str(e), traceback.format_exc())))
    finally:
        conn.close()
        os._exit(0)


def timed(fn):
    """(error type name or "ok", message, seconds) of calling fn(): what a rank reports
    about a call that should fail fast."""
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:
        return type(e).__name__, str(e), time.monotonic() - t0
    return "ok", "", time.monotonic() - t0


def run_ranks(world, fn, *args, timeout=60, env=None, init=True, expect_fail=False):
    """Run fn(rank, world, *args) on `world` ranks; return the per-rank results.

    With expect_fail=True, return [(kind, payload)] per rank instead of raising,
    where kind is "ok", "error" (payload: (type name, message, traceback)) or
    "hung"/"died".
    """
    server = TCPStoreServer("127.0.0.1", 0)
    env = dict(env or {})
    env.setdefault("ACCORD_TIMEOUT", str(timeout))
    procs, conns = [], []
    try:
        for r in range(world):
            parent, child = _CTX.Pipe(duplex=False)
            p = _CTX.Process(target=_child, args=(r, world, server.port, env, fn, args, child, init),
                             daemon=True)
            p.start()
            child.close()
            procs.append(p)
            conns.append(parent)
        deadline = time.monotonic() + timeout + 10
        outcomes = []
        for r, (p, c) in enumerate(zip(procs, conns)):
            remaining = max(0.0, deadline - time.monotonic())
            if c.poll(remaining):
                try:
                    kind, payload = c.recv()
                except EOFError:
                    kind, payload = "died", f"exit code {p.exitcode}"
            else:
                kind, payload = ("hung", "no result before the deadline")
            outcomes.append((kind, payload))
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
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        server.close()


class spy_algorithms:
    """with spy_algorithms("broadcast") as ran: ... -- the names of the algorithms
    that ran each call of the collective, in order (algorithms/table.py's choice)."""

    def __init__(self, op):
        self.op = op

    def __enter__(self):
        from accord.algorithms import table
        self.table = table.ALGORITHMS[self.op]
        self.saved = dict(self.table)
        ran = []
        for name, e in self.saved.items():
            def fn(*args, _fn=e.fn, _name=name, **kwargs):
                ran.append(_name)
                return _fn(*args, **kwargs)
            self.table[name] = e._replace(fn=fn)
        return ran

    def __exit__(self, *exc):
        self.table.clear()
        self.table.update(self.saved)



class shm_in_threads:
    """with shm_in_threads(prefix, size, arena_bytes=...) as members: ... -- the
    shared-memory transports of a group of `size` ranks, each made on a thread of this
    process (connect_shm needs every member connecting at once); a member that did not
    connect within 30 s is None. Each is closed with its point-to-point plane at the end."""

    def __init__(self, prefix, size, **connect_kw):
        self.prefix, self.size, self.kw = prefix, size, connect_kw

    def __enter__(self):
        import threading

        from accord.store import HashStore
        from accord.transport import shm
        store, out = HashStore(), [None] * self.size

        def member(r):
            out[r] = shm.connect_shm(store, self.prefix, r, self.size, lambda g: f"rank {g}",
                                     time.monotonic() + 20, **self.kw)
        threads = [threading.Thread(target=member, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        self.members = out
        return out

    def __exit__(self, *exc):
        for t in self.members:
            if t is not None:
                t.p2p.close(0.0)
                t.close(0.0)
