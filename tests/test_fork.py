"""A forked child (a DataLoader worker, say) that exits must not take its parent's links."""
import atexit
import os

import numpy as np
import pytest

import accord as dist
from harness import run_ranks

pytestmark = pytest.mark.timeout(60)


def _fork_then_collective(rank, world):
    pid = os.fork()
    if pid == 0:
        # what a normal interpreter exit does in the child: run the atexit handlers
        atexit._run_exitfuncs()
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    x = np.full(5, rank + 1.0)
    dist.all_reduce(x)
    big = np.full(1 << 20, rank, np.int32)
    dist.broadcast(big, src=world - 1)
    return os.waitstatus_to_exitcode(status), x.tolist(), bool((big == world - 1).all())


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_exiting_forked_child_leaves_parent_group_working(transport):
    out = run_ranks(3, _fork_then_collective, timeout=30, env={"ACCORD_TRANSPORT": transport})
    assert out == [(0, [6.0] * 5, True)] * 3


def test_forked_child_forgets_the_parents_issuing_threads():
    # a parent where another thread issued a collective (a test runner, a server) forks
    # workers: each has one thread, so it takes part in deadlock detection again
    import threading

    from accord.debug import groups
    saved = groups.other_issuers
    try:
        t = threading.Thread(target=groups.on_main_thread)
        t.start()
        t.join()
        assert groups.threaded()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            os.write(w, b"1" if groups.other_issuers or groups.threaded() else b"0")
            os._exit(0)
        os.close(w)
        seen = os.read(r, 1)
        os.close(r)
        os.waitpid(pid, 0)
        assert seen == b"0"
    finally:
        groups.other_issuers = saved


def _publisher_in_forked_child(rank, world):
    # this rank's groups started its positions publisher; a child forked now (a worker
    # forked by the test runner, say) starts its own with its first group, and leaves
    # the parent's groups out of what it publishes
    from accord.debug import groups, monitor
    assert monitor._publisher is not None and groups.live_groups()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        ok = monitor._publisher is None and not groups.live_groups()
        os.write(w, b"1" if ok else b"0")
        os._exit(0)
    os.close(w)
    seen = os.read(r, 1)
    os.close(r)
    os.waitpid(pid, 0)
    dist.barrier()
    return seen


def test_forked_child_starts_its_own_positions_publisher():
    assert run_ranks(2, _publisher_in_forked_child, timeout=30) == [b"1", b"1"]
