"""Mismatched calls raise a Desync on every involved rank that names each side's call."""
import re
import time

import numpy as np
import pytest

import accord as dist
from harness import run_ranks, timed as _timed

pytestmark = pytest.mark.timeout(120)
HERE = "test_desync.py:"


@pytest.fixture(params=["tcp", "shm"])
def env(request):
    """Every test runs over both transports: the messages must not depend on the wire."""
    return {"ACCORD_TRANSPORT": request.param}


def _errors(out):
    res = []
    for kind, payload in out:
        assert kind == "ok", payload
        res.append(payload)
    return res


def _different_ops(rank, world):
    x = np.arange(4, dtype=np.float32)
    if rank == 0:
        return _timed(lambda: (dist.all_reduce(x), dist.barrier()))
    return _timed(lambda: (dist.broadcast(x, src=1), dist.barrier()))


def test_different_ops_name_both_calls_and_lines(env):
    for name, msg, took in _errors(run_ranks(2, _different_ops, timeout=30, env=env,
                                             expect_fail=True)):
        assert name == "Desync", msg
        assert "all_reduce #0" in msg and "broadcast #0" in msg
        assert msg.count(HERE) >= 2, msg
        assert took < 5


def _different_dtypes(rank, world):
    x = np.ones(4, np.float32 if rank == 0 else np.int32)      # same byte count
    return _timed(lambda: (dist.all_reduce(x), dist.barrier()))


def test_different_dtypes(env):
    for name, msg, took in _errors(run_ranks(2, _different_dtypes, timeout=30, env=env,
                                             expect_fail=True)):
        assert name == "Desync", msg
        assert "float32" in msg and "int32" in msg and "all_reduce #0" in msg


def _different_roots(rank, world):
    x = np.full(4, rank, np.float32)
    # every rank thinks it is the root: each only sends, nothing is read in the call
    first = _timed(lambda: dist.broadcast(x, src=rank))
    second = _timed(lambda: dist.barrier())
    return first, second


def test_different_roots_both_roots_send_only(env):
    for rank, (first, second) in enumerate(_errors(run_ranks(2, _different_roots, timeout=30,
                                                             env=env, expect_fail=True))):
        # the first message either side reads is the other's broadcast: Desync at once
        errs = [e for e in (first, second) if e[0] != "ok"]
        assert errs and errs[0][0] == "Desync", (first, second)
        msg = errs[0][1]
        assert "broadcast #0" in msg and "root 1" in msg or "root rank 1" in msg, msg
        assert "root 0" in msg or "root rank 0" in msg, msg
        assert HERE in msg
        assert errs[0][2] < 5


def _large_different_roots(rank, world):
    # larger than any socket buffer or ring: both "roots" block sending to each other
    x = np.full(16 << 20, rank, np.uint8)
    return _timed(lambda: dist.broadcast(x, src=rank, timeout=20))


@pytest.mark.parametrize("world", [2, 3])
def test_large_broadcast_with_every_rank_a_root_is_a_desync_not_a_timeout(env, world):
    # at world 3 the "roots" send in a ring: each is blocked sending to a rank that is
    # not the one sending to it
    for name, msg, took in _errors(run_ranks(world, _large_different_roots, timeout=40,
                                             env=env, expect_fail=True)):
        assert name == "Desync", msg
        assert sum(f"root {r}" in msg or f"root rank {r}" in msg for r in range(world)) >= 2, msg
        assert took < 5, took


def _roots_three(rank, world):
    x = np.full(4, rank, np.float32)
    src = 2 if rank == 2 else 0
    return _timed(lambda: (dist.broadcast(x, src=src), dist.all_reduce(x), dist.barrier()))


def test_different_roots_three_ranks_every_rank_raises(env):
    res = _errors(run_ranks(3, _roots_three, timeout=30, env=env, expect_fail=True))
    for name, msg, took in res:
        assert name == "Desync", msg
        assert took < 5
    assert any("root 2" in m or "root rank 2" in m for _, m, _ in res)


def _forgot_group(rank, world):
    g = dist.new_group([0, 1])
    x = np.ones(4, np.float32)
    if rank == 0:
        return _timed(lambda: (dist.broadcast(x, src=0, group=g), dist.barrier()))
    return _timed(lambda: (dist.broadcast(x, src=0), dist.barrier()))   # forgot group=g


def test_forgotten_group_is_a_desync_on_both_ranks(env):
    for name, msg, took in _errors(run_ranks(2, _forgot_group, timeout=30, env=env,
                                             expect_fail=True)):
        assert name == "Desync", msg
        assert "broadcast #0" in msg and "barrier #0" in msg
        assert took < 5


def _skipper(rank, world):
    x = np.ones(4, np.float32)
    dist.barrier()
    if rank == world - 1:
        time.sleep(3.0)        # "forgot" the all_reduce; the others time out
        return _timed(lambda: dist.barrier())
    return _timed(lambda: dist.all_reduce(x, timeout=1.0))


def test_stuck_rank_report_names_who_never_entered(env):
    res = _errors(run_ranks(3, _skipper, timeout=30, env=env, expect_fail=True))
    for rank in (0, 1):
        name, msg, took = res[rank]
        assert name == "CommTimeout", msg
        assert "rank 2 never entered all_reduce #1" in msg, msg
        assert "ranks 0, 1 are waiting in it" in msg or "ranks 0\u20131" in msg, msg
        assert "last completed barrier #0" in msg
        assert took < 4
    # rank 2 learns it either from the others' report, or (where the all_reduce's one
    # step already sent it their inputs: a small one over shared memory at world 3)
    # from their messages, which name the call it skipped
    name, msg, _ = res[2]
    if name == "Desync":
        assert "this rank called barrier #1" in msg and "called all_reduce #1" in msg, msg
    else:
        assert name == "CommTimeout" and "reported by" in msg and "never entered" in msg, msg


def _stuck_through_another_group(rank, world):
    g = dist.new_group([1, 2])
    x = np.ones(4, np.float32)
    dist.barrier()
    if rank == 0:
        return _timed(lambda: dist.all_reduce(x, timeout=1.0))
    if rank == 2:
        time.sleep(3.0)        # late for g's call, for which rank 1 waits
    return _timed(lambda: (dist.all_reduce(x, group=g, timeout=10.0), dist.barrier()))


def test_stuck_rank_report_follows_a_rank_blocked_in_another_group(env):
    # rank 1 never enters the default group's all_reduce: it waits in g's for rank 2, and
    # rank 0's report says so, naming rank 2 (the rank to look at)
    res = run_ranks(3, _stuck_through_another_group, timeout=30, env=env, expect_fail=True)
    kind, (name, msg, took) = res[0]
    assert kind == "ok" and name == "CommTimeout", msg
    assert "ranks 1, 2 never entered all_reduce #1" in msg, msg
    assert "busy in all_reduce #0" in msg and "(waiting on rank 2)" in msg, msg
    assert took < 5                # its own 1 s timeout, not rank 1's 10 s


def _stuck_two_groups_away(rank, world):
    # rank 2 waits in a's all_reduce for rank 0, which waits in b's for rank 1, which
    # waits in c's for rank 3, which sleeps: rank 2's report must reach rank 3
    a, b, c = dist.new_group([0, 2]), dist.new_group([0, 1]), dist.new_group([1, 3])
    x = np.ones(4, np.float32)
    dist.barrier()
    if rank == 2:
        return _timed(lambda: dist.all_reduce(x, group=a, timeout=1.5))
    if rank == 3:
        time.sleep(4.0)
        return _timed(lambda: dist.all_reduce(x, group=c, timeout=10.0))
    if rank == 1:
        return _timed(lambda: (dist.all_reduce(x, group=c, timeout=10.0),
                               dist.all_reduce(x, group=b, timeout=10.0)))
    return _timed(lambda: (dist.all_reduce(x, group=b, timeout=10.0),
                           dist.all_reduce(x, group=a, timeout=10.0)))


def test_stuck_rank_report_follows_the_wait_two_groups_away(env):
    res = run_ranks(4, _stuck_two_groups_away, timeout=40, env=env, expect_fail=True)
    kind, (name, msg, took) = res[2]
    assert kind == "ok" and name == "CommTimeout", msg
    assert "rank 0 never entered all_reduce #0" in msg, msg
    assert "following rank 0: rank 0 waits in all_reduce #0" in msg, msg
    assert "on rank 1; rank 1 waits in all_reduce #0" in msg and "on rank 3" in msg, msg
    assert took < 6                # its own 1.5 s timeout


def _stuck_behind_a_receive(rank, world):
    # rank 2 waits in the default group's all_reduce for rank 0, which waits for a
    # message from rank 1 (a blocking recv, or an irecv's Work.wait), which sleeps
    x = np.ones(4, np.float32)
    dist.barrier()
    if rank == 2:
        return _timed(lambda: dist.all_reduce(x, timeout=1.5))
    if rank == 1:
        time.sleep(4.0)
        return _timed(lambda: (dist.send(x, dst=0), dist.all_reduce(x, timeout=10.0)))
    return _timed(lambda: (dist.recv(x, src=1, tag=0, timeout=10.0),
                           dist.all_reduce(x, timeout=10.0)))


def test_stuck_rank_report_shows_a_rank_blocked_in_a_receive(env):
    res = run_ranks(3, _stuck_behind_a_receive, timeout=40, env=env, expect_fail=True)
    kind, (name, msg, took) = res[2]
    assert kind == "ok" and name == "CommTimeout", msg
    assert "ranks 0, 1 never entered all_reduce #1" in msg, msg
    assert "rank 0: not inside a call" in msg, msg
    assert "busy in recv from rank 1 (tag 0, 16 bytes, group 'default') (waiting on rank 1)" \
        in msg, msg
    assert took < 6                # its own 1.5 s timeout


def _stuck_behind_an_irecv_and_a_group(rank, world):
    # rank 2 waits in a's all_reduce for rank 0, which waits on an irecv from rank 1,
    # which waits in c's all_reduce for rank 3, which sleeps: the chain reaches rank 3
    a, c = dist.new_group([0, 2]), dist.new_group([1, 3])
    x = np.ones(4, np.float32)
    dist.barrier()
    if rank == 2:
        return _timed(lambda: dist.all_reduce(x, group=a, timeout=1.5))
    if rank == 3:
        time.sleep(4.0)
        return _timed(lambda: dist.all_reduce(x, group=c, timeout=10.0))
    if rank == 1:
        return _timed(lambda: (dist.all_reduce(x, group=c, timeout=10.0),
                               dist.send(x, dst=0, tag=7)))
    return _timed(lambda: (dist.irecv(x, src=1, tag=7, timeout=10.0).wait(),
                           dist.all_reduce(x, group=a, timeout=10.0)))


def test_stuck_rank_report_follows_a_wait_through_a_receive(env):
    res = run_ranks(4, _stuck_behind_an_irecv_and_a_group, timeout=40, env=env,
                    expect_fail=True)
    kind, (name, msg, took) = res[2]
    assert kind == "ok" and name == "CommTimeout", msg
    assert "rank 0 never entered all_reduce #0" in msg, msg
    assert "following rank 0: rank 0 waits in irecv from rank 1 (tag 7, 16 bytes, group " \
        "'default') on rank 1; rank 1 waits in all_reduce #0" in msg, msg
    assert "on rank 3" in msg, msg
    assert took < 6                # its own 1.5 s timeout


def _receive_from_a_stuck_rank(rank, world):
    # rank 1 waits for a message from rank 0, which waits in an all_reduce for rank 2,
    # which sleeps: rank 1's timeout must say where rank 0 is, and so name rank 2
    x = np.ones(4, np.float32)
    dist.barrier()
    if rank == 1:
        out = _timed(lambda: dist.recv(x, src=0, tag=3, timeout=1.5))
        # then the calls the others make, so that the group ends clean
        dist.all_reduce(x, timeout=10.0)
        dist.recv(x, src=0, tag=3, timeout=10.0)
        return out
    if rank == 2:
        time.sleep(4.0)
        return _timed(lambda: dist.all_reduce(x, timeout=10.0))
    return _timed(lambda: (dist.all_reduce(x, timeout=10.0), dist.send(x, dst=1, tag=3)))


def test_a_point_to_point_timeout_says_what_the_peer_waits_for(env):
    res = run_ranks(3, _receive_from_a_stuck_rank, timeout=40, env=env, expect_fail=True)
    kind, (name, msg, took) = res[1]
    assert kind == "ok" and name == "CommTimeout", msg
    assert "recv from rank 0 (tag 3, 16 bytes, group 'default'): Timed out after 1.5 s" in msg
    assert "; rank 0 meanwhile: waiting in all_reduce #1" in msg, msg
    # it waits on rank 2 (and, over shared memory, on rank 1, which never entered it)
    assert re.search(r"\(on ranks? (1, )?2\)", msg), msg
    assert took < 6                # its own 1.5 s timeout


def _cross_groups(rank, world):
    g = dist.new_group([0, 1])
    x = np.ones(4, np.float32)
    if rank == 0:
        out = _timed(lambda: (dist.all_reduce(x, group=g), dist.all_reduce(x)))
    else:
        out = _timed(lambda: (dist.all_reduce(x), dist.all_reduce(x, group=g)))
    return out


def test_collectives_in_different_group_orders_are_a_desync_on_both_ranks(env):
    # ACCORD_TIMEOUT is 30 s here: the deadlock is named long before it
    for rank, (name, msg, took) in enumerate(_errors(run_ranks(2, _cross_groups, timeout=30,
                                                               env=env, expect_fail=True))):
        assert name == "Desync", msg
        assert "deadlock" in msg and "different groups" in msg, msg
        assert "rank 0 waits in all_reduce #0" in msg and "group 'group1'" in msg, msg
        assert "rank 1 waits in all_reduce #0" in msg and "group 'default'" in msg, msg
        assert msg.count(HERE) == 2, msg
        assert took < 8, took


def _three_way(rank, world):
    groups = {frozenset(p): dist.new_group(list(p)) for p in ((0, 1), (1, 2), (0, 2))}
    mine = {0: (0, 1), 1: (1, 2), 2: (0, 2)}[rank]
    x = np.ones(4, np.float32)
    return _timed(lambda: dist.all_reduce(x, group=groups[frozenset(mine)]))


def test_three_ranks_each_on_another_pair_group_is_a_desync(env):
    for name, msg, took in _errors(run_ranks(3, _three_way, timeout=30, env=env,
                                             expect_fail=True)):
        assert name == "Desync", msg
        assert "deadlock" in msg, msg
        for r in range(3):
            assert f"rank {r} waits in all_reduce #0" in msg, msg
        assert took < 8, took


def _waited_work_in_other_order(rank, world):
    g = dist.new_group([0, 1])
    x = np.ones(4, np.float32)
    if rank == 0:
        return _timed(lambda: dist.all_reduce(x, group=g, async_op=True).wait())
    return _timed(lambda: (dist.all_reduce(x), dist.all_reduce(x, group=g)))


def test_waiting_on_async_work_counts_as_blocked(env):
    for name, msg, took in _errors(run_ranks(2, _waited_work_in_other_order, timeout=30,
                                             env=env, expect_fail=True)):
        assert name == "Desync" and "deadlock" in msg, msg


def _async_then_compute(rank, world):
    g = dist.new_group([0, 1])
    x, y = np.full(4, rank + 1.0), np.full(4, rank + 1.0)
    if rank == 0:
        # not a deadlock: the async call waits for rank 1 while this thread computes,
        # then makes the call rank 1 is blocked in
        w = dist.all_reduce(x, group=g, async_op=True)
        time.sleep(2.5)
        dist.all_reduce(y)
        w.wait()
    else:
        dist.all_reduce(y)
        dist.all_reduce(x, group=g)
    return x.tolist(), y.tolist()


def test_async_call_waiting_while_its_rank_computes_is_no_false_alarm(env):
    for x, y in run_ranks(2, _async_then_compute, timeout=30, env=env):
        assert x == [3.0] * 4 and y == [3.0] * 4


def _two_threads_two_groups(rank, world):
    import threading
    g1, g2 = dist.new_group([0, 1]), dist.new_group([0, 1])
    x, y = np.full(4, rank + 1.0), np.full(4, rank + 1.0)

    def late(group, arr):
        time.sleep(2.5)
        dist.all_reduce(arr, group=group)
    # not a deadlock: each rank's other thread makes the call the peer waits in, late
    other = threading.Thread(target=late, args=(g2, y) if rank == 0 else (g1, x))
    other.start()
    dist.all_reduce(x if rank == 0 else y, group=g1 if rank == 0 else g2)
    other.join()
    return x.tolist(), y.tolist()


def test_calls_from_other_threads_are_no_false_alarm(env):
    for x, y in run_ranks(2, _two_threads_two_groups, timeout=30, env=env):
        assert x == [3.0] * 4 and y == [3.0] * 4


def _roots_then_leave(rank, world):
    x = np.full(4, rank, np.float32)
    dist.broadcast(x, src=rank)     # each only sends: the call itself cannot tell
    return _timed(dist.destroy_process_group)


def test_send_only_mismatch_with_no_later_call_is_named_at_destroy(env):
    res = _errors(run_ranks(2, _roots_then_leave, timeout=30, env=env, expect_fail=True))
    for rank, (name, msg, took) in enumerate(res):
        other = 1 - rank
        assert name == "Desync", msg
        assert f"rank {other} sent broadcast #0, root {other}" in msg, msg
        assert f"this rank called broadcast #0, root rank {rank}" in msg, msg
        assert msg.count(HERE) == 2, msg
        assert took < 2


def test_send_only_mismatch_is_printed_when_the_script_just_exits(env, tmp_path):
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    path = tmp_path / "roots.py"
    path.write_text("import numpy as np, accord as dist\n"
                    "dist.init_process_group()\n"
                    "x = np.zeros(4, np.float32)\n"
                    "dist.broadcast(x, src=dist.get_rank())\n")
    run_env = dict(__import__("os").environ, PYTHONPATH=str(root), **env)
    run_env.pop("ACCORD_LAUNCHER_STORE", None)
    proc = subprocess.run([sys.executable, "-m", "accord", "run", "-n", "2", str(path)],
                          env=run_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=60)
    for rank in (0, 1):
        assert f"Desync: rank {rank}: destroying group 'default'" in proc.stdout, proc.stdout
        assert f"sent broadcast #0, root {1 - rank}" in proc.stdout, proc.stdout
        assert "roots.py:4" in proc.stdout, proc.stdout


def _agreeing_calls_then_leave(rank, world):
    x = np.full(4, rank, np.float32)
    dist.broadcast(x, src=0)
    dist.all_reduce(x)
    return _timed(dist.destroy_process_group)


def test_matching_calls_leave_cleanly(env):
    for name, msg, took in run_ranks(3, _agreeing_calls_then_leave, timeout=30, env=env):
        assert name == "ok", msg
