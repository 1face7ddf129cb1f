"""Surviving rank 0's death in a job started by hand (no launcher): rank 0 started the
store's server in a process of its own, so the survivors still meet through it,
shrink, admit a restarted rank 0 and go on; the server never outlives the job."""
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(90)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

JOB = textwrap.dedent("""
    import json, os, signal, subprocess, sys, threading, time
    import numpy as np
    import accord as dist

    out, init, rank, world = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])

    def data(r):
        # a float sum that depends on the order of addition: bit-identity is a real check
        return np.random.default_rng(100 + r).standard_normal(4099).astype(np.float32) * 1e3

    def write(name, value):
        with open(os.path.join(out, name + ".tmp"), "w") as f:
            json.dump(value, f)
        os.rename(os.path.join(out, name + ".tmp"), os.path.join(out, name))

    def join():
        if init == "env://":
            dist.init_process_group()            # RANK, WORLD_SIZE, MASTER_* set by the test
        else:
            dist.init_process_group(init_method=init, rank=rank, world_size=world)

    restarted = os.environ.get("ACCORD_RESTART_COUNT", "0") != "0"
    join()
    state = {"w": np.zeros(6), "step": np.zeros(1, np.int64)}
    if restarted:
        dist.broadcast_state(state, src=0)       # healed from the new rank 0
        y = data(100)
        dist.all_reduce(y)
        write("newcomer", [dist.get_rank(), dist.get_world_size(), state["w"].tolist(),
                           int(state["step"][0]), y.tobytes().hex()])
        dist.destroy_process_group()
        sys.exit(0)
    if rank == 0:
        store = dist.world.current_world().raw_store
        write("store_pid", store.server_process.proc.pid)
    x = np.ones(1 << 16, np.float32)
    dist.barrier()
    if rank == 0:
        # the store's host dies inside a collective, as a preempted machine would
        threading.Timer(0.1, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
        while True:
            dist.all_reduce(x)
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 30:
            dist.all_reduce(x)
        first = "no error"
    except (dist.PeerLost, dist.GroupClosed) as e:
        first = type(e).__name__
    dist.shrink(timeout=30)
    state["w"] += np.arange(6.0) * 3 + 1
    state["step"] += 7
    y = data(rank)
    dist.all_reduce(y)
    shrunk = [dist.get_rank(), dist.get_world_size(), y.tobytes().hex()]
    proc = None
    if dist.get_rank() == 0:
        # rank 0 started again by hand: a restart, which waits to be admitted
        env = dict(os.environ, ACCORD_RESTART_COUNT="1", RANK="0")
        proc = subprocess.Popen([sys.executable, __file__, out, init, "0", str(world)], env=env)
    dist.admit(timeout=30)
    dist.broadcast_state(state, src=0)
    y = data(100)
    dist.all_reduce(y)
    write(f"rank{rank}", [first, shrunk, [dist.get_rank(), dist.get_world_size(),
                                          y.tobytes().hex()]])
    dist.destroy_process_group()
    if proc is not None:
        proc.wait(timeout=30)
""")


def _data(r):
    return np.random.default_rng(100 + r).standard_normal(4099).astype(np.float32) * 1e3


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gone(pid, within):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def _start(tmp_path, init, world, transport):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    port = _free_port()
    url = f"tcp://127.0.0.1:{port}" if init == "tcp://" else "env://"
    procs = []
    for r in range(world):
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   ACCORD_TIMEOUT="60", ACCORD_TRANSPORT=transport)
        for var in ("ACCORD_LAUNCHER_STORE", "ACCORD_RESTART_COUNT", "ACCORD_LAUNCH_SLOT"):
            env.pop(var, None)
        if init == "env://":
            env.update(RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, str(script), str(tmp_path), url, str(r),
                                       str(world)], env=env, cwd=str(tmp_path)))
    return procs


def _finish(procs, within=75):
    deadline = time.monotonic() + within
    codes = []
    try:
        for p in procs:
            codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return codes


@pytest.mark.parametrize("init,world,transport", [("tcp://", 4, "auto"), ("env://", 3, "tcp")],
                         ids=["tcp-world4-shm", "env-world3-tcp"])
def test_rank0_dies_the_survivors_shrink_and_admit_its_restart(tmp_path, init, world, transport):
    codes = _finish(_start(tmp_path, init, world, transport))
    assert codes[0] == -signal.SIGKILL and codes[1:] == [0] * (world - 1), codes
    results = {r: json.loads((tmp_path / f"rank{r}").read_text()) for r in range(1, world)}
    newcomer = json.loads((tmp_path / "newcomer").read_text())
    survivors = list(range(1, world))
    want = sum(_data(r).astype(np.float64) for r in survivors)
    for r, (first, shrunk, admitted) in results.items():
        assert first in ("PeerLost", "GroupClosed"), first
        assert shrunk[:2] == [r - 1, world - 1]
        assert admitted[:2] == [r - 1, world]
    # bit-identical on every survivor, and the sum of exactly the survivors' data
    assert len({res[1][2] for res in results.values()}) == 1
    got = np.frombuffer(bytes.fromhex(results[1][1][2]), np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-2)
    # the restarted rank 0 came in last, healed, and computes with the others
    assert newcomer[:4] == [world - 1, world, [float(3 * i + 1) for i in range(6)], 7]
    assert len({newcomer[4]} | {res[2][2] for res in results.values()}) == 1
    # the store's process ended with the job
    assert _gone(json.loads((tmp_path / "store_pid").read_text()), 10)


IDLE = textwrap.dedent("""
    import json, os, sys, time
    import accord as dist
    dist.init_process_group(init_method=sys.argv[1], rank=int(sys.argv[2]), world_size=2)
    if dist.get_rank() == 0:
        pid = dist.world.current_world().raw_store.server_process.proc.pid
        print(pid, flush=True)
    dist.barrier()
    if sys.argv[3] == "hang":
        time.sleep(60)
    dist.destroy_process_group()
    if dist.is_initialized() is False and sys.argv[2] == "0":
        try:
            os.kill(pid, 0)
            print("alive", flush=True)
        except ProcessLookupError:
            print("gone", flush=True)
""")


@pytest.mark.parametrize("how", ["finish", "all-killed"])
def test_the_store_process_never_outlives_the_job(tmp_path, how):
    # a normal end: rank 0's destroy_process_group returns once the server has ended;
    # every rank SIGKILLed: the server sees its owner and its clients gone and ends
    script = tmp_path / "idle.py"
    script.write_text(IDLE)
    url = f"tcp://127.0.0.1:{_free_port()}"
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               ACCORD_TIMEOUT="30")
    env.pop("ACCORD_LAUNCHER_STORE", None)
    mode = "hang" if how == "all-killed" else "end"
    procs = [subprocess.Popen([sys.executable, str(script), url, str(r), mode], env=env,
                              stdout=subprocess.PIPE, text=True) for r in range(2)]
    pid = int(procs[0].stdout.readline())
    if how == "all-killed":
        time.sleep(0.5)
        for p in procs:
            p.kill()
    _finish(procs, 40)
    if how == "finish":
        assert procs[0].stdout.read().split() == ["gone"]
    assert _gone(pid, 10)


def test_rank0_on_a_taken_port_gets_a_clear_error():
    import accord
    from accord.tcpstore import AddressInUse
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(AddressInUse, match=f"store port {port} on 127.0.0.1 is already in use"):
            accord.init_process_group(init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                      world_size=1, timeout=10)
    assert not accord.is_initialized()


def test_without_an_interpreter_to_start_rank0_serves_the_store_itself(monkeypatch, caplog):
    import accord
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    url = f"tcp://127.0.0.1:{_free_port()}"
    with caplog.at_level("WARNING", logger="accord"):
        accord.init_process_group(init_method=url, rank=0, world_size=1, timeout=10)
    try:
        x = np.ones(3)
        accord.all_reduce(x)
        assert x.tolist() == [1.0] * 3
    finally:
        accord.destroy_process_group()
    assert "cannot start the store's own process" in caplog.text
    assert "its death will end the job" in caplog.text
