"""Surviving a lost rank: shrink, agree and admit with real processes and SIGKILL."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import accord as dist
from harness import run_ranks

pytestmark = pytest.mark.timeout(60)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _die(delay=0.0):
    if delay:
        threading.Timer(delay, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    else:
        os.kill(os.getpid(), signal.SIGKILL)


def _all_reduce_until_a_death(rank, victim, delay, x, group=None):
    """Every rank all-reduces x in a loop; `victim` is SIGKILLed `delay` s in, the
    others return once a call fails for it (PeerLost, or GroupClosed after one)."""
    if rank == victim:
        _die(delay)
    try:
        while True:
            dist.all_reduce(x, group=group)
    except (dist.PeerLost, dist.GroupClosed):
        pass


def _data(rank):
    # values whose float sum depends on the order of addition: bit-identity is a real check
    return np.random.default_rng(100 + rank).standard_normal(4099).astype(np.float32) * 1e3


def _survive(rank, world, where, victims):
    x = np.ones(1 << 18, np.float32)
    dist.barrier()
    if rank in victims:
        if where == "between":
            time.sleep(0.2)
            _die()
        _die(0.05 + 0.02 * victims.index(rank))
        try:
            while True:
                if where == "all_reduce":
                    dist.all_reduce(x)
                elif where == "broadcast":
                    dist.broadcast(x, src=0)
                else:
                    _ring(rank, world, x)
        except (dist.PeerLost, dist.GroupClosed):
            # a second victim may hear of the first one's death before its own
            # timer fires: it waits for it, as a victim must not live on
            time.sleep(30)
    first = None
    t0 = time.monotonic()
    try:
        if where == "between":
            time.sleep(0.6)
            dist.all_reduce(x)
        while time.monotonic() - t0 < 20:
            if where == "all_reduce":
                dist.all_reduce(x)
            elif where == "broadcast":
                dist.broadcast(x, src=0)
            else:
                _ring(rank, world, x)
    except (dist.PeerLost, dist.GroupClosed) as e:
        first = type(e).__name__
    t1 = time.monotonic()
    dist.shrink(timeout=20)
    survivors = [r for r in range(world) if r not in victims]
    assert dist.get_world_size() == len(survivors), dist.get_world_size()
    assert dist.get_rank() == survivors.index(rank)
    y = _data(rank)
    dist.all_reduce(y)
    took = time.monotonic() - t1
    z = np.full(4, float(rank), np.float64)
    dist.broadcast(z, src=0)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rank)
    return first, y.tobytes(), float(z[0]), gathered, took


def _ring(rank, world, x):
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    buf = np.empty_like(x)
    reqs = [dist.isend(x, nxt), dist.irecv(buf, prv)]
    for r in reqs:
        r.wait()


# one and two victims at every world from 3 to 5; rank 0 (every broadcast's root) among them
CASES = [(3, (1,)), (3, (0, 2)), (4, (0,)), (4, (1, 2)), (5, (4,)), (5, (1, 3))]


@pytest.mark.parametrize("world,victims", CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("where", ["all_reduce", "broadcast", "p2p", "between"])
@pytest.mark.parametrize("medium", ["shm", "tcp"])
def test_survivors_shrink_and_go_on(world, victims, where, medium):
    out = run_ranks(world, _survive, where, list(victims), timeout=40,
                    env={"ACCORD_TRANSPORT": medium}, expect_fail=True)
    survivors = [r for r in range(world) if r not in victims]
    for r in victims:
        assert out[r][0] == "died", out[r]
    results = []
    for r in survivors:
        kind, payload = out[r]
        assert kind == "ok", payload
        results.append(payload)
    firsts = {res[0] for res in results}
    assert firsts <= {"PeerLost", "GroupClosed"} and firsts, firsts
    # bit-identical on every rank, and the sum of exactly the survivors' data
    assert len({res[1] for res in results}) == 1
    got = np.frombuffer(results[0][1], np.float32)
    want = sum(_data(r).astype(np.float64) for r in survivors)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-2)
    assert {res[2] for res in results} == {float(survivors[0])}      # new rank 0 is the root
    assert all(res[3] == survivors for res in results)
    assert max(res[4] for res in results) < 10


def _agree(rank, world):
    dist.barrier()
    if rank == 2:
        time.sleep(0.3)              # the others are inside agree by now
        _die()
    first = dist.agree(True, timeout=15)
    second = dist.agree(rank != 1, timeout=15)
    third = dist.agree(True, timeout=15)
    return first, second, third


def test_agree_completes_when_a_member_dies_during_it():
    out = run_ranks(4, _agree, timeout=30, expect_fail=True)
    assert out[2][0] == "died"
    for r in (0, 1, 3):
        assert out[r] == ("ok", (True, False, True)), out[r]


def _silent(rank, world):
    if rank == 2:
        time.sleep(4)                # alive, but never calls shrink
        return None
    t0 = time.monotonic()
    try:
        dist.shrink(timeout=1.5)
    except dist.CommTimeout as e:
        return str(e), time.monotonic() - t0
    return "no error", 0


def test_shrink_timeout_names_the_member_that_did_not_answer():
    out = run_ranks(3, _silent, timeout=30, expect_fail=True)
    for r in (0, 1):
        kind, (msg, took) = out[r]
        assert "member 2 did not answer" in msg, msg
        assert took < 5


def _admit(rank, world, newcomer_env):
    dist.barrier()
    _all_reduce_until_a_death(rank, 2, 0.1, np.ones(4))
    dist.shrink(timeout=20)
    t0 = time.monotonic()
    dist.admit()                     # nobody waiting: the same group, at once
    same = time.monotonic() - t0
    assert dist.get_world_size() == 2
    proc = None
    if rank == 0:
        env = dict(os.environ, **newcomer_env)
        proc = subprocess.Popen([sys.executable, "-c", NEWCOMER], env=env,
                                stdout=subprocess.PIPE, text=True)
    dist.admit(timeout=20)
    state = {"w": np.arange(5.0) * 7, "step": np.array([42])}
    dist.broadcast_state(state, src=0)
    y = np.full(3, float(dist.get_rank() + 1))
    dist.all_reduce(y)
    line = proc.communicate(timeout=20)[0] if proc else None
    return dist.get_rank(), dist.get_world_size(), y.tolist(), line, same


NEWCOMER = """
import json, numpy as np, accord as dist
dist.init_process_group()
state = {"w": np.zeros(5), "step": np.array([0])}
dist.broadcast_state(state, src=0)
y = np.full(3, float(dist.get_rank() + 1))
dist.all_reduce(y)
print(json.dumps([dist.get_rank(), dist.get_world_size(), state["w"].tolist(),
                  int(state["step"][0]), y.tolist()]))
dist.destroy_process_group()
"""


def test_admit_lets_a_restarted_process_in_and_heals_it():
    out = run_ranks(3, _admit, {"ACCORD_RESTART_COUNT": "1"}, timeout=40, expect_fail=True)
    assert out[2][0] == "died"
    for r, want_rank in ((0, 0), (1, 1)):
        kind, payload = out[r]
        assert kind == "ok", payload
        rank, size, y, _, same = payload
        assert (rank, size, y) == (want_rank, 3, [6.0] * 3)
        assert same < 1.0
    newcomer = json.loads(out[0][1][3])
    assert newcomer == [2, 3, [0.0, 7.0, 14.0, 21.0, 28.0], 42, [6.0] * 3]


def _accord_run(args, timeout):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "accord", "run", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(90)
def test_elastic_training_example_survives_a_kill_and_admits_the_restart():
    p = _accord_run(["-n", "4", "--max-restarts", "1", "examples/elastic_training.py"], 80)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    finals = [line for line in p.stdout.splitlines() if "final loss" in line]
    assert len(finals) == 4, out
    assert len({line.split("final loss ")[1] for line in finals}) == 1, out
    assert "restarting it" in out and "newcomer admitted as rank 3 of 4" in out, out
    assert "recovered: world 3" in out, out


@pytest.mark.timeout(90)
def test_keep_going_finishes_without_the_dead_rank():
    p = _accord_run(["-n", "4", "--keep-going", "examples/elastic_training.py"], 80)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    finals = [line for line in p.stdout.splitlines() if "final loss" in line]
    assert len(finals) == 3 and all("of 3" in f for f in finals), out
    assert len({line.split("final loss ")[1] for line in finals}) == 1, out
    assert "go on (--keep-going)" in out, out


def _subgroup(rank, world):
    sub = dist.new_group([1, 2, 3])
    dist.barrier()
    if rank == 3:
        _die(0.05)
        while True:
            dist.all_reduce(np.ones(4), group=sub)
    if rank != 0:
        try:
            while True:
                dist.all_reduce(np.ones(4), group=sub)
        except (dist.PeerLost, dist.GroupClosed):
            pass
    try:
        dist.all_reduce(np.ones(4))
    except (dist.PeerLost, dist.GroupClosed):
        pass
    dist.shrink(timeout=20)                  # the world first: ranks 0, 1, 2 stay 0, 1, 2
    if rank == 0:
        with pytest.raises(ValueError):
            dist.shrink(sub)
        return None
    new_sub = dist.shrink(sub, timeout=20)
    y = np.full(2, float(rank))
    dist.all_reduce(y, group=new_sub)
    return (dist.get_process_group_ranks(new_sub), dist.get_rank(new_sub),
            dist.get_world_size(new_sub), y.tolist())


def test_a_subgroup_is_rebuilt_with_shrink_of_it():
    out = run_ranks(4, _subgroup, timeout=30, expect_fail=True)
    assert out[3][0] == "died"
    assert out[0] == ("ok", None), out[0]
    assert out[1] == ("ok", ([1, 2], 0, 2, [3.0, 3.0])), out[1]
    assert out[2] == ("ok", ([1, 2], 1, 2, [3.0, 3.0])), out[2]


HOSTS_SCRIPT = """
import os, signal, sys, time
os.environ["ACCORD_HOST_ID"] = "host" + os.environ["RANK"]   # each rank a host of its own
import numpy as np
import accord as dist
dist.init_process_group()
dist.barrier()
if dist.get_rank() == 2:
    time.sleep(0.2)
    os.kill(os.getpid(), signal.SIGKILL)
try:
    time.sleep(0.5)
    dist.all_reduce(np.ones(4))
except (dist.PeerLost, dist.GroupClosed):
    pass
t0 = time.monotonic()
dist.shrink(timeout=15)
y = np.full(2, float(dist.get_rank() + 1))
dist.all_reduce(y)
print("survived", dist.get_rank(), dist.get_world_size(), y.tolist(),
      round(time.monotonic() - t0, 2), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.timeout(60)
def test_a_death_on_another_host_is_learnt_from_the_launcher(tmp_path):
    # no survivor shares the dead rank's host: only the launcher's mark in the store
    # tells that its process is gone
    script = tmp_path / "hosts.py"
    script.write_text(HOSTS_SCRIPT)
    p = _accord_run(["-n", "3", "--keep-going", str(script)], 50)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    lines = sorted(line.split("] ", 1)[1] for line in p.stdout.splitlines() if "survived" in line)
    assert [line.rsplit(" ", 1)[0] for line in lines] == [
        "survived 0 2 [3.0, 3.0]", "survived 1 2 [3.0, 3.0]"], out
    assert all(float(line.rsplit(" ", 1)[1]) < 10 for line in lines), out


LATE_FAILURE = """
import os, sys, time
if os.environ["RANK"] == "1":
    time.sleep(0.5)
    sys.exit(3)
"""

ALL_FAIL = """
import os, sys, time
time.sleep(0.2 * int(os.environ["RANK"]))
sys.exit(4 + int(os.environ["RANK"]))
"""

LATE_NEWCOMER = """
import os, signal, time
import numpy as np
import accord as dist
dist.init_process_group()
if int(os.environ["ACCORD_RESTART_COUNT"]) > 0:
    raise SystemExit("admitted, but nobody calls admit in this script")
if dist.get_rank() == 1:
    os.kill(os.getpid(), signal.SIGKILL)
try:
    dist.all_reduce(np.ones(4))
except (dist.PeerLost, dist.GroupClosed):
    dist.shrink(timeout=15)
print("finished at world", dist.get_world_size(), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("script,status", [(LATE_FAILURE, 3), (ALL_FAIL, 4)],
                         ids=["late-failure", "all-fail"])
def test_keep_going_fails_the_job_when_a_rank_fails_at_its_end(tmp_path, script, status):
    # a rank that fails after another finished, or a job where none finishes, fails
    # (with the status of the rank at fault: the first to fail on its own)
    path = tmp_path / "job.py"
    path.write_text(script)
    p = _accord_run(["-n", "2", "--keep-going", str(path)], 50)
    assert p.returncode == status, p.stdout + p.stderr


@pytest.mark.timeout(60)
def test_a_restart_that_comes_after_the_end_exits_cleanly(tmp_path):
    path = tmp_path / "job.py"
    path.write_text(LATE_NEWCOMER)
    p = _accord_run(["-n", "2", "--max-restarts", "1", str(path)], 50)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    assert "finished at world 1" in out and "restarting it" in out, out
    assert "finished before this restarted process" in out, out


def _die_in_recovery(rank, world, delay):
    dist.barrier()
    if rank == 3:
        _die()
    try:
        time.sleep(0.3)
        dist.all_reduce(np.ones(4))
    except (dist.PeerLost, dist.GroupClosed):
        pass
    if rank == 2:
        _die(delay)                  # a second death, somewhere inside the recovery
    shrunk = False
    while True:
        try:
            if not shrunk:
                dist.shrink(timeout=25)
                shrunk = True
            y = np.full(3, float(rank + 1))
            dist.all_reduce(y)
            time.sleep(0.4)          # rank 2 is dead by now, wherever it died
            dist.barrier()
            return dist.get_rank(), dist.get_world_size(), y.tolist()
        except (dist.PeerLost, dist.GroupClosed):
            shrunk = False


@pytest.mark.parametrize("delay", [0.0, 0.01, 0.03, 0.1])
def test_a_second_death_during_the_recovery(delay):
    out = run_ranks(4, _die_in_recovery, delay, timeout=40, expect_fail=True)
    assert out[3][0] == "died" and out[2][0] == "died", out
    assert out[0] == ("ok", (0, 2, [3.0] * 3)), out[0]
    assert out[1] == ("ok", (1, 2, [3.0] * 3)), out[1]


def _dead_newcomer(rank, world, newcomer_env):
    proc = None
    if rank == 0:
        env = dict(os.environ, **newcomer_env)
        proc = subprocess.Popen([sys.executable, "-c", NEWCOMER], env=env,
                                stdout=subprocess.DEVNULL)
    dist.barrier()
    time.sleep(3)                    # it has taken its ticket and waits by now
    if proc is not None:
        proc.kill()
        proc.wait()
    dist.barrier()
    from accord import membership, world
    tickets = world.current_world().store.add(membership.TICKETS, 0)
    before = dist.get_world_size()
    dist.admit(timeout=0)            # a dead newcomer is not let in
    x = np.ones(2)
    dist.all_reduce(x)
    return tickets, before, dist.get_world_size(), x.tolist()


def test_admit_leaves_out_a_newcomer_that_died_waiting():
    out = run_ranks(2, _dead_newcomer, {"ACCORD_RESTART_COUNT": "1"}, timeout=30)
    assert out == [(1, 2, 2, [2.0, 2.0])] * 2      # it took a ticket, and was left out


def _hier_survive(rank, world, layout):
    os.environ["ACCORD_HOST_ID"] = layout[rank]
    dist.init_process_group()
    dist.barrier()
    _all_reduce_until_a_death(rank, 3, 0.05, np.ones(1 << 16, np.float32))
    dist.shrink(timeout=20)
    y = _data(rank)
    dist.all_reduce(y)
    out = dist.get_rank(), dist.get_world_size(), y.tobytes()
    dist.destroy_process_group()
    return out


def test_a_group_spanning_simulated_hosts_shrinks():
    # two hosts of two ranks (shared memory inside each, TCP between); a rank of the
    # second host dies, and the survivor on its host is the witness
    layout = ["hostA", "hostA", "hostB", "hostB"]
    out = run_ranks(4, _hier_survive, layout, init=False, timeout=30, expect_fail=True)
    assert out[3][0] == "died", out[3]
    res = [out[r] for r in range(3)]
    assert all(k == "ok" for k, _ in res), res
    assert [p[:2] for _, p in res] == [(0, 3), (1, 3), (2, 3)]
    assert len({p[2] for _, p in res}) == 1


def _old_subgroups(rank, world):
    a = dist.new_group([2, 3])           # keeps every member: renumbered
    b = dist.new_group([0, 1])           # loses rank 1: revoked, rebuilt with shrink(b)
    c = dist.new_group([0, 2, 3])        # keeps every member (rank 1 is not in it)
    dist.barrier()
    _all_reduce_until_a_death(rank, 1, 0.05, np.ones(4))
    dist.shrink(timeout=20)              # old ranks 0, 2, 3 are now 0, 1, 2
    out = {"c": dist.get_process_group_ranks(c)}
    y = np.full(2, float(rank))
    dist.all_reduce(y, group=c)
    out["c_sum"] = y.tolist()
    if rank in (2, 3):
        out["a"] = dist.get_process_group_ranks(a)
        z = np.full(3, float(rank))
        dist.broadcast(z, src=1, group=a)    # global rank 1 of the new world: old rank 2
        out["a_bcast"] = z.tolist()
        out["a_global"] = dist.get_global_rank(a, 0), dist.get_group_rank(a, 2)
        with pytest.raises(ValueError) as info:
            dist.admit(a)
        out["admit_a"] = str(info.value)
    if rank == 0:
        with pytest.raises(dist.GroupClosed) as info:
            dist.all_reduce(np.ones(2), group=b)
        out["b_error"] = str(info.value)
        new_b = dist.shrink(b, timeout=20)
        w = np.full(2, 5.0)
        dist.all_reduce(w, group=new_b)
        out["b_new"] = (dist.get_process_group_ranks(new_b), w.tolist())
    return out


def test_groups_made_before_a_world_shrink_are_renumbered_or_revoked():
    out = run_ranks(4, _old_subgroups, timeout=30, expect_fail=True)
    assert out[1][0] == "died", out[1]
    res = {r: out[r][1] for r in (0, 2, 3)}
    assert all(out[r][0] == "ok" for r in (0, 2, 3)), out
    for r in (0, 2, 3):
        assert res[r]["c"] == [0, 1, 2] and res[r]["c_sum"] == [5.0, 5.0]
    for r in (2, 3):
        assert res[r]["a"] == [1, 2] and res[r]["a_global"] == (1, 1)
        assert res[r]["a_bcast"] == [2.0] * 3
        assert "joins the job as a whole" in res[r]["admit_a"]
        assert "call accord.admit() without group=" in res[r]["admit_a"]
    assert "lost member 1 (ranks of the world before it shrank)" in res[0]["b_error"]
    assert "accord.shrink(group)" in res[0]["b_error"]
    assert res[0]["b_new"] == ([0], [5.0, 5.0])


@pytest.mark.parametrize("var,value", [("ACCORD_RESTART_COUNT", "one"),
                                       ("ACCORD_RESTART_COUNT", "-1"),
                                       ("ACCORD_MAX_RESTARTS", "2.5"),
                                       ("ACCORD_LAUNCH_SLOT", "1/0")])
def test_bad_elastic_variables_are_a_clear_error(var, value, monkeypatch):
    from accord.options import Options
    with pytest.raises(ValueError, match=var):
        Options.from_env({var: value})
    # on the rank that has it, before any connection
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=f"{var}.*{value!r}"):
        dist.init_process_group(init_method="tcp://127.0.0.1:1", rank=1, world_size=2,
                                timeout=5)
    assert not dist.is_initialized()


def test_elastic_variables_are_read_through_options():
    from accord.options import Options
    o = Options.from_env({"ACCORD_RESTART_COUNT": " 2 ", "ACCORD_MAX_RESTARTS": "3",
                          "ACCORD_LAUNCH_SLOT": "1.2"})
    assert (o.restart_count, o.max_restarts, o.launch_slot) == (2, 3, "1.2")
    assert (Options.from_env({}).restart_count, Options.from_env({}).max_restarts) == (0, 0)

