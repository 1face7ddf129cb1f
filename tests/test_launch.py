"""`accord run` (accord/cli/run.py, accord/cli/_child.py) and the `accord` CLI, with real
processes."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent


def _env():
    env = dict(os.environ)
    # the launcher and its ranks import this checkout's accord, installed or not
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env.pop("ACCORD_LAUNCHER_STORE", None)
    return env


def accord(*args, cwd=None, timeout=45, env=None):
    """Run `python -m accord ARGS`; return (exit status, stdout + stderr, seconds)."""
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "accord", *map(str, args)], cwd=cwd,
                          env={**_env(), **(env or {})}, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT,
                          text=True, timeout=timeout)
    return proc.returncode, proc.stdout, time.monotonic() - start


def script(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def alive(pid):
    """True while pid is a live process (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids, within=10.0):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def wait_files(paths, within=20.0):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and not all(p.exists() for p in paths):
        time.sleep(0.05)
    missing = [str(p) for p in paths if not p.exists()]
    assert not missing, f"ranks did not start: {missing}"


# Ranks of these scripts write their pid to OUT/pid-RANK and then do their part.
PIDFILE = """
import os, sys, time
from pathlib import Path
OUT = Path(sys.argv[1])
RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
(OUT / f"pid-{RANK}.tmp").write_text(str(os.getpid()))
os.replace(OUT / f"pid-{RANK}.tmp", OUT / f"pid-{RANK}")

def wait_for_everyone():
    deadline = time.time() + 20
    while not all((OUT / f"pid-{r}").exists() for r in range(WORLD)):
        assert time.time() < deadline, "ranks did not all start"
        time.sleep(0.02)
"""


def pids_of(out, world):
    return [int((out / f"pid-{r}").read_text()) for r in range(world)]


# ------------------------------------------------------------------ environment and arguments

def test_environment_of_each_rank(tmp_path):
    script(tmp_path, "helper_mod.py", "VALUE = 42\n")
    s = script(tmp_path, "env.py", """
        import json, os, sys
        import helper_mod                     # the script's directory is on sys.path
        keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "GROUP_WORLD_SIZE", "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT",
                "PYTHONUNBUFFERED", "ACCORD_LAUNCHER_STORE", "OMP_NUM_THREADS"]
        record = {k: os.environ.get(k) for k in keys}
        record.update(name=__name__, argv=sys.argv, helper=helper_mod.VALUE, pid=os.getpid())
        out = os.path.join(sys.argv[1], "env-%s.json" % os.environ["RANK"])
        with open(out, "w") as f:
            json.dump(record, f)
        """)
    status, output, _ = accord("run", "-n", 3, s, tmp_path)
    assert status == 0, output
    records = [json.loads((tmp_path / f"env-{r}.json").read_text()) for r in range(3)]
    ports = {rec["MASTER_PORT"] for rec in records}
    stores = {rec["ACCORD_LAUNCHER_STORE"] for rec in records}
    assert len(ports) == 1 and 0 < int(ports.pop()) < 65536
    assert len(stores) == 1
    store = stores.pop()
    host, _, port = store.rpartition(":")
    assert host == "127.0.0.1" and 0 < int(port) < 65536
    assert int(port) != int(records[0]["MASTER_PORT"]), "MASTER_PORT must stay free for torch"
    assert len({rec["pid"] for rec in records}) == 3
    for r, rec in enumerate(records):
        assert rec["RANK"] == str(r) and rec["LOCAL_RANK"] == str(r) and rec["ROLE_RANK"] == str(r)
        assert rec["WORLD_SIZE"] == "3" and rec["LOCAL_WORLD_SIZE"] == "3"
        assert rec["GROUP_RANK"] == "0" and rec["GROUP_WORLD_SIZE"] == "1"
        assert rec["MASTER_ADDR"] == "127.0.0.1"
        assert rec["PYTHONUNBUFFERED"] == "1"
        assert rec["OMP_NUM_THREADS"] is not None
        assert rec["name"] == "__main__" and rec["helper"] == 42
        assert rec["argv"] == [str(s), str(tmp_path)]


def test_multi_node_environment(tmp_path):
    """Node 1 of 2: global ranks follow the node's, and the store is on node 0 at port + 1."""
    s = script(tmp_path, "env.py", """
        import json, os, sys
        keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "MASTER_ADDR", "MASTER_PORT", "ACCORD_LAUNCHER_STORE"]
        out = os.path.join(sys.argv[1], "env-%s.json" % os.environ["LOCAL_RANK"])
        with open(out, "w") as f:
            json.dump({k: os.environ.get(k) for k in keys}, f)
        """)
    status, output, _ = accord("run", "--nnodes", 2, "--node-rank", 1, "--master-addr",
                               "10.1.2.3", "--master-port", 29400, "-n", 2, s, tmp_path)
    assert status == 0, output
    for local in range(2):
        rec = json.loads((tmp_path / f"env-{local}.json").read_text())
        assert rec == {"RANK": str(2 + local), "WORLD_SIZE": "4", "LOCAL_RANK": str(local),
                       "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "MASTER_ADDR": "10.1.2.3",
                       "MASTER_PORT": "29400", "ACCORD_LAUNCHER_STORE": "10.1.2.3:29401"}


def test_script_arguments_pass_through(tmp_path):
    s = script(tmp_path, "args.py", """
        import json, os, sys
        with open(os.path.join(os.path.dirname(__file__), "args-%s.json" % os.environ["RANK"]),
                  "w") as f:
            json.dump(sys.argv[1:], f)
        """)
    args = ["-n", "5", "--master-port", "7", "plain", "--flag=x y", "-m", "--"]
    status, output, _ = accord("run", "-n", 2, s, *args)
    assert status == 0, output
    for r in range(2):
        assert json.loads((tmp_path / f"args-{r}.json").read_text()) == args


def test_module_mode(tmp_path):
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "job.py").write_text(textwrap.dedent("""
        import os, sys
        if __name__ == "__main__":
            open("mod-%s.txt" % os.environ["RANK"], "w").write(" ".join(sys.argv[1:]))
        """))
    status, output, _ = accord("run", "-n", 2, "-m", "mypkg.job", "a", "b", cwd=tmp_path)
    assert status == 0, output
    for r in range(2):
        assert (tmp_path / f"mod-{r}.txt").read_text() == "a b"


def test_all_ranks_succeed(tmp_path):
    s = script(tmp_path, "ok.py", """
        import os, sys
        sys.stdout.write("hello from rank %s\\n" % os.environ["RANK"])  # one write: no interleaving
        open(os.path.join(sys.argv[1], "done-" + os.environ["RANK"]), "w").close()
        """)
    status, output, _ = accord("run", "-n", 4, s, tmp_path)
    assert status == 0, output
    for r in range(4):
        assert f"hello from rank {r}" in output
        assert (tmp_path / f"done-{r}").exists()
    assert "failed" not in output


# ------------------------------------------------------------------ failures

def test_failing_rank_stops_the_others(tmp_path):
    s = script(tmp_path, "fail.py", PIDFILE + """
wait_for_everyone()
if RANK == 1:
    def inner():
        raise ValueError("boom")
    inner()
time.sleep(60)
""")
    status, output, seconds = accord("run", "-n", 3, s, tmp_path)
    assert status == 1, output
    assert seconds < 20, f"the launcher took {seconds:.1f} s"
    assert "job failed: rank 1 " in output
    assert "exited with code 1" in output
    assert "[rank 1] ValueError: boom" in output
    assert '[rank 1]     raise ValueError("boom")' in output
    assert "_child.py" not in output and "runpy" not in output, output
    assert "rank 0 stopped (SIGTERM)" in output and "rank 2 stopped (SIGTERM)" in output
    assert not wait_gone(pids_of(tmp_path, 3), within=5), "ranks outlived the launcher"


def test_rank_killed_by_signal(tmp_path):
    s = script(tmp_path, "kill.py", PIDFILE + """
wait_for_everyone()
if RANK == 2:
    os.kill(os.getpid(), 9)
time.sleep(60)
""")
    status, output, seconds = accord("run", "-n", 3, s, tmp_path)
    assert status == 128 + 9, output
    assert seconds < 20
    assert "job failed: rank 2 " in output
    assert "killed by SIGKILL (signal 9)" in output
    assert not wait_gone(pids_of(tmp_path, 3), within=5)


def test_exit_code_of_failing_rank(tmp_path):
    s = script(tmp_path, "exit3.py", PIDFILE + """
wait_for_everyone()
if RANK == 0:
    sys.exit(3)
time.sleep(60)
""")
    status, output, _ = accord("run", "-n", 2, s, tmp_path)
    assert status == 3, output
    assert "job failed: rank 0 " in output and "exited with code 3" in output
    assert "Traceback" not in output  # SystemExit is not a crash


def test_rank_ignoring_sigterm_is_killed(tmp_path):
    s = script(tmp_path, "stubborn.py", PIDFILE + """
import signal
signal.signal(signal.SIGTERM, signal.SIG_IGN)
wait_for_everyone()
if RANK == 1:
    raise RuntimeError("first")
time.sleep(60)
""")
    status, output, seconds = accord("run", "--grace", "0.5", "-n", 2, s, tmp_path)
    assert status == 1, output
    assert seconds < 15
    assert "did not stop within 0.5s; sending SIGKILL" in output
    assert "[rank 1] RuntimeError: first" in output
    assert not wait_gone(pids_of(tmp_path, 2), within=5)


def test_first_failure_is_blamed(tmp_path):
    """Rank 0 raises but is slow to exit; rank 1 fails because of it and exits first.
    The launcher still names rank 0, whose exception came first."""
    s = script(tmp_path, "cascade.py", PIDFILE + """
wait_for_everyone()
if RANK == 0:
    import atexit
    atexit.register(time.sleep, 30)     # slow to exit after raising
    (OUT / "raised").touch()
    raise KeyError("root cause")
while not (OUT / "raised").exists():
    time.sleep(0.01)
time.sleep(0.3)
raise RuntimeError("consequence")
""")
    status, output, seconds = accord("run", "-n", 2, s, tmp_path)
    assert status == 1, output
    assert seconds < 20
    assert "rank 1 exited with code 1; stopping the other 1 rank" in output
    assert "job failed: rank 0 " in output and "raised KeyError" in output
    assert "[rank 0] KeyError: 'root cause'" in output
    assert "rank 1 exited with code 1 after it raised RuntimeError: consequence (at " in output


# ------------------------------------------------------------------ signals to the launcher

def _start_launcher(tmp_path, world, body):
    s = script(tmp_path, "sleepy.py", PIDFILE + body)
    proc = subprocess.Popen([sys.executable, "-m", "accord", "run", "-n", str(world),
                             str(s), str(tmp_path)], env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_files([tmp_path / f"pid-{r}" for r in range(world)])
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    return proc, pids_of(tmp_path, world)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_launcher_stops_ranks(tmp_path, signum):
    proc, pids = _start_launcher(tmp_path, 2, "time.sleep(60)\n")
    proc.send_signal(signum)
    output, _ = proc.communicate(timeout=20)
    assert proc.returncode == 128 + signum, output
    assert f"received {signal.Signals(signum).name}" in output
    assert not wait_gone(pids, within=5)


def test_ranks_die_with_a_killed_launcher(tmp_path):
    proc, pids = _start_launcher(tmp_path, 2, "time.sleep(60)\n")
    proc.kill()
    proc.communicate(timeout=10)
    assert not wait_gone(pids, within=10), "ranks outlived a SIGKILLed launcher"


# ------------------------------------------------------------------ the launcher's store

def test_launcher_store_is_reachable(tmp_path):
    s = script(tmp_path, "store.py", """
        import os, sys
        from accord.tcpstore import TCPStore
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        host, _, port = os.environ["ACCORD_LAUNCHER_STORE"].rpartition(":")
        store = TCPStore(host, int(port), timeout=20)
        store.set(f"from-{rank}", f"hello {rank}")
        got = [store.get(f"from-{r}").decode() for r in range(world)]
        assert got == [f"hello {r}" for r in range(world)], got
        sys.stdout.write(f"rank {rank} counted {store.add('count', 1)}\\n")
        store.close()
        """)
    status, output, _ = accord("run", "-n", 3, s)
    assert status == 0, output
    counts = sorted(int(line.rsplit(" ", 1)[1]) for line in output.splitlines()
                    if " counted " in line)
    assert counts == [1, 2, 3], output


def test_torchrun_script_with_gloo(tmp_path):
    """A script written for torchrun binds MASTER_PORT on rank 0 itself: it must be free."""
    pytest.importorskip("torch")
    s = script(tmp_path, "gloo.py", """
        import datetime, sys
        import torch
        import torch.distributed as dist
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
        t = torch.full((3,), float(dist.get_rank() + 1))
        dist.all_reduce(t)
        assert t.tolist() == [3.0, 3.0, 3.0], t
        sys.stdout.write(f"gloo rank {dist.get_rank()} ok\\n")
        dist.destroy_process_group()
        """)
    status, output, _ = accord("run", "-n", 2, s)
    assert status == 0, output
    assert "gloo rank 0 ok" in output and "gloo rank 1 ok" in output


def test_no_launcher_store(tmp_path):
    s = script(tmp_path, "nostore.py", """
        import os, sys
        assert "ACCORD_LAUNCHER_STORE" not in os.environ
        sys.stdout.write("port %s\\n" % os.environ["MASTER_PORT"])
        """)
    status, output, _ = accord("run", "--no-launcher-store", "-n", 2, s)
    assert status == 0, output
    assert output.count("port ") == 2


# ------------------------------------------------------------------ the command line

def test_cli_help_and_errors(tmp_path):
    status, output, _ = accord("--help")
    assert status == 0 and "run" in output and "usage: accord" in output
    status, output, _ = accord("run", "--help")
    assert status == 0 and "--nproc-per-node" in output and "--master-port" in output
    status, output, _ = accord("frobnicate")
    assert status == 2 and "unknown command 'frobnicate'" in output
    status, output, _ = accord("run", "-n", 2, tmp_path / "missing.py")
    assert status == 2 and "no such script" in output
    status, output, _ = accord("run", "--nnodes", 2, "-n", 2, tmp_path / "missing.py")
    assert status == 2 and "--master-port is required" in output


def test_an_interpreter_or_program_in_place_of_the_script_is_named_at_once(tmp_path):
    # mpirun's habit: `accord run -n 2 python train.py` (the interpreter's binary would
    # otherwise be read as Python source on every rank: a SyntaxError about null bytes)
    train = script(tmp_path, "train.py", "print('ran')\n")
    status, output, took = accord("run", "-n", 2, sys.executable, train)
    assert status == 2, output
    assert f"{sys.executable} is a Python interpreter, not a Python script" in output
    assert "name the script, as in `accord run -n 2 train.py`" in output
    assert "[rank" not in output                          # no rank was started
    status, output, _ = accord("run", "-n", 2, "python3", train, cwd=tmp_path)
    assert status == 2 and "'python3' is a Python interpreter, not a script" in output
    status, output, _ = accord("run", "-n", 2, "/bin/true")
    assert status == 2 and "/bin/true is a compiled program, not a Python script" in output
    # a script, a compiled .pyc or a zip application still run
    pyc = tmp_path / "train.pyc"
    import py_compile
    py_compile.compile(str(train), cfile=str(pyc))
    status, output, _ = accord("run", "-n", 2, pyc)
    assert status == 0 and output.count("] ran\n") == 2, output


def test_cli_main_in_process(capsys):
    from accord import cli
    assert cli.main(["--help"]) == 0
    assert "run" in capsys.readouterr().out
    assert cli.main([]) == 2


# ------------------------------------------------------------------ the examples

@pytest.mark.parametrize("example", ["broadcast", "all_gather", "scatter"])
@pytest.mark.parametrize("world", [1, 4])
def test_examples(example, world):
    status, output, _ = accord("run", "-n", world, ROOT / "examples" / f"{example}.py",
                               cwd=ROOT)
    assert status == 0, output
    assert "Traceback" not in output
    for r in range(world):
        assert f"rank {r}" in output
