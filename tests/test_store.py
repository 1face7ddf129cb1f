"""Stores: one conformance suite over every store, then each store's own duties."""
import datetime
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from accord.errors import AccordError, CommTimeout, PeerLost
from accord.store import FileStore, HashStore, PrefixStore, Store
from accord.tcpstore import AddressInUse, TCPStore, TCPStoreServer

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"


def spawn(code, *args):
    """A fresh interpreter running `code` with accord importable."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc, timeout=20):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"child failed (rc={proc.returncode}):\n{err}"
    return out


def free_port():
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class Env:
    """One store under test: `store`, more handles to it, and how a child
    process opens it (None where the store lives in this process only)."""

    def __init__(self):
        self.store = None
        self.remote = None
        self._handle = None
        self._closers = []

    def handle(self):
        h = self._handle()
        self._closers.append(h.close)
        return h

    def close(self):
        for close in reversed(self._closers):
            close()


def make_env(kind, tmp_path):
    e = Env()
    if kind == "hash":
        store = HashStore(timeout=10)
        e._handle = lambda: store
    elif kind == "file":
        path = str(tmp_path / "filestore")
        e._handle = lambda: FileStore(path, timeout=10)
        e.remote = f"FileStore({path!r}, timeout=10)"
    elif kind == "prefix":
        base = HashStore(timeout=10)
        e._handle = lambda: PrefixStore("job", base)
    else:
        master = TCPStore(HOST, 0, is_master=True, timeout=10)
        e._closers.append(master.close)
        e._handle = lambda: TCPStore(HOST, master.port, timeout=10)
        e.remote = f"TCPStore({HOST!r}, {master.port}, timeout=10)"
        if kind == "tcp_master":
            e.store = master
    if e.store is None:
        e.store = e.handle()
    return e


@pytest.fixture(params=["hash", "file", "prefix", "tcp_master", "tcp_client"])
def env(request, tmp_path):
    e = make_env(request.param, tmp_path)
    yield e
    e.close()


@pytest.fixture(params=["file", "tcp_master", "tcp_client"])
def shared_env(request, tmp_path):
    """The stores other processes can open."""
    e = make_env(request.param, tmp_path)
    yield e
    e.close()


# ---- conformance: every store ------------------------------------------------

def test_set_get_bytes_and_str(env):
    s = env.store
    s.set("b", b"\x00\xffraw")
    s.set("s", "héllo")
    s.set("empty", b"")
    assert s.get("b") == b"\x00\xffraw"
    assert s.get("s") == "héllo".encode("utf-8")
    assert s.get("empty") == b""
    s.set("s", "again")
    assert s.get("s") == b"again"
    assert isinstance(s.get("s"), bytes)


def test_get_blocks_until_another_handle_sets(env):
    other = env.handle()
    timer = threading.Timer(0.15, other.set, args=("late", b"here"))
    t0 = time.monotonic()
    timer.start()
    try:
        assert env.store.get("late") == b"here"
    finally:
        timer.join()
    assert time.monotonic() - t0 >= 0.1


def test_get_timeout_names_key(env):
    s = env.store
    s.set_timeout(0.2)
    assert s.timeout == pytest.approx(0.2)
    t0 = time.monotonic()
    with pytest.raises(CommTimeout) as info:
        s.get("never-set")
    assert 0.15 <= time.monotonic() - t0 < 2.0
    assert "never-set" in str(info.value) and "0.2 s" in str(info.value)
    assert isinstance(info.value, TimeoutError) and isinstance(info.value, AccordError)
    # a per-call timeout overrides the store's
    s.set_timeout(30)
    t0 = time.monotonic()
    with pytest.raises(CommTimeout, match="never-set"):
        s.get("never-set", timeout=0.2)
    assert time.monotonic() - t0 < 2.0


def test_wait_and_check(env):
    s = env.store
    s.set("present", "1")
    s.wait(["present"])
    s.wait("present", timeout=datetime.timedelta(seconds=0.2))
    assert s.check(["present"]) is True
    assert s.check(["present", "nope"]) is False
    t0 = time.monotonic()
    with pytest.raises(CommTimeout) as info:
        s.wait(["present", "nope"], timeout=0.2)
    assert time.monotonic() - t0 < 2.0
    msg = str(info.value)       # names the missing key only (PrefixStore: with its prefix)
    assert "nope'" in msg and "present" not in msg

    other = env.handle()
    timer = threading.Timer(0.1, other.set, args=("b", "2"))
    timer.start()
    s.wait(["present", "b"], timeout=5)
    assert s.check(["present", "b"])
    # the key is there once the server has it, maybe before the setter has read its
    # reply: closing its handle under it would fail the timer's thread
    timer.join(5)


def test_add(env):
    s = env.store
    assert s.add("n", 5) == 5          # a missing key counts as 0
    assert s.add("n", -7) == -2
    assert s.add("n", 0) == -2
    assert s.get("n") == b"-2"          # ASCII decimal, as torch stores it
    s.set("m", "40")
    assert s.add("m", 2) == 42
    s.set("text", "abc")
    with pytest.raises(ValueError, match="not an integer"):
        s.add("text", 1)
    assert s.get("text") == b"abc"
    with pytest.raises(TypeError):
        s.add("n", 1.5)


def test_add_is_atomic_across_threads(env):
    # two threads share env.store (one handle used concurrently), two have their own
    handles = [env.store, env.store, env.handle(), env.handle()]
    results = [[] for _ in handles]

    def work(h, out):
        for _ in range(100):
            out.append(h.add("counter", 1))

    threads = [threading.Thread(target=work, args=(h, out)) for h, out in zip(handles, results)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert env.store.get("counter") == b"400"
    # every add saw a distinct total: no two increments interleaved
    assert sorted(sum(results, [])) == list(range(1, 401))


def test_compare_set(env):
    s = env.store
    # missing key, expected "": set
    assert s.compare_set("k", b"", b"first") == b"first"
    assert s.get("k") == b"first"
    # match: replace
    assert s.compare_set("k", "first", "second") == b"second"
    assert s.get("k") == b"second"
    # mismatch: unchanged, current value reported
    assert s.compare_set("k", b"wrong", b"third") == b"second"
    assert s.get("k") == b"second"
    # missing key, non-empty expected: torch reports `expected` and sets nothing
    assert s.compare_set("absent", b"x", b"y") == b"x"
    assert not s.check(["absent"])


def test_delete_and_num_keys(env):
    s = env.store
    base = s.num_keys()
    s.set("d1", "x")
    s.set("d2", "y")
    s.set("d1", "z")                    # overwriting adds no key
    assert s.num_keys() == base + 2
    assert s.delete_key("d1") is True
    assert s.delete_key("d1") is False
    assert s.num_keys() == base + 1
    assert not s.check(["d1"])
    with pytest.raises(CommTimeout):
        s.get("d1", timeout=0.2)
    s.set("d1", "back")
    assert s.get("d1") == b"back"


def test_timeout_and_argument_types(env):
    s = env.store
    s.set_timeout(datetime.timedelta(seconds=7))
    assert s.timeout == 7.0
    with pytest.raises(TypeError, match="key"):
        s.set(3, b"x")
    with pytest.raises(TypeError, match="value"):
        s.set("k", 3)
    with pytest.raises(TypeError):
        s.set_timeout("soon")
    with pytest.raises(ValueError):
        s.set_timeout(-1)


def test_other_process_sees_and_sets_keys(shared_env):
    env = shared_env
    child = spawn(f"""
        from accord.store import FileStore
        from accord.tcpstore import TCPStore
        s = {env.remote}
        s.set("pong", s.get("ping") + b"!")
        s.close()
    """)
    time.sleep(0.1)
    env.store.set("ping", "hi")
    assert env.store.get("pong") == b"hi!"
    finish(child)


def test_add_is_atomic_across_processes(shared_env):
    env = shared_env
    code = f"""
        from accord.store import FileStore
        from accord.tcpstore import TCPStore
        s = {env.remote}
        for _ in range(100):
            s.add("pcount", 1)
        s.close()
    """
    children = [spawn(code) for _ in range(4)]
    for c in children:
        finish(c)
    assert env.store.get("pcount") == b"400"


# ---- PrefixStore -------------------------------------------------------------

@pytest.mark.parametrize("kind", ["hash", "tcp"])
def test_prefix_isolation(kind):
    master = TCPStore(HOST, 0, is_master=True, timeout=10) if kind == "tcp" else HashStore()
    try:
        a, b = PrefixStore("a", master), PrefixStore("b", master)
        assert a.underlying_store is master
        a.set("k", "1")
        assert not b.check(["k"])
        with pytest.raises(CommTimeout, match="'b/k'"):
            b.get("k", timeout=0.2)
        b.set("k", "2")
        assert a.get("k") == b"1" and b.get("k") == b"2"
        assert master.get("a/k") == b"1"
        assert a.add("n", 3) == 3 and b.add("n", 1) == 1
        assert b.delete_key("k") and a.get("k") == b"1"
        assert a.num_keys() == master.num_keys() == 3     # delegated, as in torch
        nested = PrefixStore("inner", a)
        nested.set("x", "y")
        assert master.get("a/inner/x") == b"y"
        a.close()                                          # leaves master usable
        assert master.get("a/k") == b"1"
    finally:
        master.close()


def test_prefix_timeout_is_its_own_once_set():
    base = HashStore(timeout=30)
    p = PrefixStore("p", base)
    assert p.timeout == 30
    p.set_timeout(0.2)
    assert p.timeout == 0.2 and base.timeout == 30
    t0 = time.monotonic()
    with pytest.raises(CommTimeout, match="0.2 s"):
        p.get("missing")
    assert time.monotonic() - t0 < 2.0


# ---- FileStore ---------------------------------------------------------------

def test_filestore_removed_after_world_size_closes(tmp_path):
    path = tmp_path / "fs"
    stores = [FileStore(path, world_size=3, timeout=5) for _ in range(3)]
    stores[0].set("k", "v")
    stores[0].close()
    stores[0].close()                   # a second close is not a second user
    stores[1].close()
    assert path.exists()
    assert stores[2].get("k") == b"v"
    stores[2].close()
    assert not path.exists()
    with pytest.raises(ValueError, match="closed"):
        stores[2].get("k")


def test_filestore_removed_after_processes_close(tmp_path):
    path = str(tmp_path / "fs")
    parent = FileStore(path, world_size=5, timeout=10)
    code = """
        import sys
        from accord.store import FileStore
        s = FileStore(sys.argv[1], world_size=5, timeout=10)
        for _ in range(50):
            s.add("n", 2)
        s.close()
    """
    children = [spawn(code, path) for _ in range(4)]
    for c in children:
        finish(c)
    assert parent.get("n") == b"400"
    assert os.path.exists(path)
    parent.close()
    assert not os.path.exists(path)


def test_filestore_without_world_size_keeps_file(tmp_path):
    path = tmp_path / "fs"
    s = FileStore(path)
    s.set("k", "v")
    s.close()
    assert path.exists()
    again = FileStore(path, timeout=1)
    assert again.get("k") == b"v"       # a later handle replays the log
    again.close()


# ---- TCPStore ----------------------------------------------------------------

def test_tcp_port_in_use_is_a_clear_error():
    first = TCPStoreServer(HOST, 0)
    try:
        port = first.port
        expected = f"port {port} on {HOST} is already in use (another job? choose another MASTER_PORT)"
        with pytest.raises(AddressInUse) as info:
            TCPStoreServer(HOST, port)
        assert expected in str(info.value)
        assert isinstance(info.value, OSError) and isinstance(info.value, AccordError)
        # the master binds every interface; a live server on loopback still blocks it
        with pytest.raises(AddressInUse, match=f"port {port} on {HOST} is already in use"):
            TCPStore(HOST, port, is_master=True, timeout=1)
    finally:
        first.close()


def test_tcp_port_reusable_right_after_close():
    server = TCPStoreServer(HOST, 0)
    port = server.port
    client = TCPStore(HOST, port, timeout=5)
    client.set("k", "v")
    server.close()          # the server closes first: its side sits in TIME_WAIT
    time.sleep(0.05)
    client.close()
    again = TCPStore(HOST, port, is_master=True, timeout=5)     # SO_REUSEADDR
    assert again.port == port and again.num_keys() == 0
    again.close()


def test_tcp_client_waits_for_a_late_master():
    port = free_port()
    started = []
    timer = threading.Timer(0.3, lambda: started.append(TCPStore(HOST, port, is_master=True, timeout=10)))
    t0 = time.monotonic()
    timer.start()
    try:
        client = TCPStore(HOST, port, timeout=10)
        assert time.monotonic() - t0 >= 0.25
        client.set("k", "v")
        timer.join()
        assert started[0].get("k") == b"v"
        client.close()
    finally:
        timer.join()
        for m in started:
            m.close()


def test_tcp_client_gives_up_naming_the_address():
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(CommTimeout) as info:
        TCPStore(HOST, port, timeout=0.3)
    assert time.monotonic() - t0 < 3.0
    assert f"{HOST}:{port}" in str(info.value)


def test_tcp_master_waits_for_workers():
    port = free_port()
    timer = threading.Timer(0.2, lambda: clients.append(TCPStore(HOST, port, timeout=10)))
    clients = []
    timer.start()
    master = TCPStore(HOST, port, world_size=2, is_master=True, timeout=10, wait_for_workers=True)
    timer.join()
    assert master._server.num_clients() == 2
    clients[0].close()
    master.close()
    with pytest.raises(CommTimeout, match="1 of 3 workers"):
        TCPStore(HOST, 0, world_size=3, is_master=True, timeout=0.3, wait_for_workers=True)


def test_tcp_master_close_waits_for_other_clients():
    master = TCPStore(HOST, 0, is_master=True, timeout=10)
    client = TCPStore(HOST, master.port, timeout=10)
    closer = threading.Thread(target=master.close)
    closer.start()
    time.sleep(0.3)
    assert closer.is_alive()            # still serving the client
    client.set("still", "works")
    assert client.get("still") == b"works"
    client.close()
    closer.join(timeout=3)
    assert not closer.is_alive()


def test_tcp_master_close_is_bounded_by_timeout():
    master = TCPStore(HOST, 0, is_master=True, timeout=0.5)
    client = TCPStore(HOST, master.port, timeout=5)
    t0 = time.monotonic()
    master.close()
    assert 0.4 <= time.monotonic() - t0 < 3.0
    with pytest.raises(PeerLost, match="closed the connection"):
        client.get("k")
    client.close()


def test_tcp_master_exiting_without_close_waits_for_peers():
    child = spawn(f"""
        from accord.tcpstore import TCPStore
        m = TCPStore({HOST!r}, 0, is_master=True, timeout=20)
        print(m.port, flush=True)
        m.get("go")
        # exits without close(): atexit must keep serving the client
    """)
    try:
        client = TCPStore(HOST, int(child.stdout.readline()), timeout=10)
        client.set("go", "1")
        time.sleep(0.3)
        assert child.poll() is None
        client.set("k", "v")
        assert client.get("k") == b"v"
        client.close()
        finish(child, timeout=5)
    finally:
        child.kill()
        child.communicate()


def test_tcp_store_refuses_use_from_forked_child():
    master = TCPStore(HOST, 0, is_master=True, timeout=5)
    try:
        pid = os.fork()
        if pid == 0:    # child: report through the exit code only
            try:
                master.set("k", "v")
                code = 1
            except AccordError as e:
                code = 0 if "forked child" in str(e) else 2
            except BaseException:
                code = 3
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        master.set("k", "v")            # the parent's connection is intact
        assert master.get("k") == b"v"
    finally:
        master.close()


SERVER_CODE = """
    import time
    from accord.tcpstore import TCPStoreServer
    server = TCPStoreServer("127.0.0.1", 0)
    print(server.port, flush=True)
    time.sleep(60)
"""


def test_tcp_client_raises_peerlost_when_server_dies():
    proc = spawn(SERVER_CODE)
    try:
        port = int(proc.stdout.readline())
        client = TCPStore(HOST, port, timeout=30)
        client.set("k", "v")
        threading.Timer(0.3, proc.kill).start()
        t0 = time.monotonic()
        with pytest.raises(PeerLost) as info:
            client.get("never", timeout=30)
        assert time.monotonic() - t0 < 5.0
        assert f"store at {HOST}:{port} closed the connection" in str(info.value)
        with pytest.raises(PeerLost):       # the client stays broken, and says why
            client.set("k", "v")
        client.close()
    finally:
        proc.kill()
        proc.communicate()


def test_tcp_server_notices_client_killed_mid_get():
    server = TCPStoreServer(HOST, 0)
    try:
        child = spawn(f"""
            from accord.tcpstore import TCPStore
            s = TCPStore({HOST!r}, {server.port}, timeout=30)
            print("ready", flush=True)
            s.get("never")
        """)
        assert child.stdout.readline().strip() == "ready"
        assert server.num_clients() == 1
        time.sleep(0.1)                 # let the child block in get
        child.kill()
        child.communicate()
        assert server.wait_clients_gone(3.0) is True
        assert server.num_clients() == 0
    finally:
        server.close()


def test_tcp_rejects_strangers_both_ways():
    server = TCPStoreServer(HOST, 0)
    try:
        with socket.create_connection((HOST, server.port)) as junk:
            junk.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            junk.settimeout(3)
            while junk.recv(4096):      # the server hangs up on it
                pass
        assert server.num_clients() == 0
    finally:
        server.close()

    with socket.socket() as other:      # a service that is not a store
        other.bind((HOST, 0))
        other.listen()
        port = other.getsockname()[1]

        def answer():
            conn, _ = other.accept()
            conn.sendall(b"SSH-2.0-OpenSSH\r\n" * 4)
            conn.close()

        t = threading.Thread(target=answer)
        t.start()
        with pytest.raises(AccordError, match="not an accord store"):
            TCPStore(HOST, port, timeout=3)
        t.join()


def test_store_base_is_abstract():
    s = Store(timeout=1)
    assert s.timeout == 1.0
    with pytest.raises(NotImplementedError):
        s.get("k")
    with Store() as ctx:
        assert ctx.timeout == 300.0
