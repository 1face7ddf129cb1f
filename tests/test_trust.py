"""Who may join a group's mesh, and which network it uses.

Every mesh connection proves the job's secret in both directions
(accord/transport/connect.py); a forged hello, a stranger running accord's own
handshake with another secret, and sockets that send nothing are refused
without holding anyone up. ACCORD_SOCKET_IFNAME picks the interface
(accord/netif.py); IPv6 loopback works end to end.
"""
import hmac
import logging
import os
import socket
import threading
import time

import numpy as np
import pytest

from accord import netif
from accord.errors import AccordError, CommTimeout, HandshakeRefused
from accord.options import Options
from accord.store import HashStore
from accord.transport import connect
from harness import run_ranks

pytestmark = pytest.mark.timeout(60)


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _listener_of(store, rank):
    host, port = netif.split_host_port(store.get(f"accord/0/default/addr/{rank}").decode())
    return host, int(port)


def _attack_then_join(rank, world):
    """Rank 2 attacks ranks 0 and 1 before it joins: a forged hello, a stranger with
    accord's own handshake and another job's secret, and two idle sockets it holds
    open while it joins. Every rank then checks an all_reduce."""
    import accord
    from accord.tcpstore import TCPStore
    seen = _Warnings()
    logging.getLogger("accord").addHandler(seen)
    held, outcome = [], {}
    if rank == 2:
        store = TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), timeout=20)
        host, port = _listener_of(store, 0)
        # 1. a forged hello claiming rank 2, then a made-up proof
        with socket.create_connection((host, port), timeout=5) as s:
            s.sendall(connect._HELLO.pack(connect._MAGIC, connect.group_token("default"), 2,
                                          os.urandom(16)))
            s.recv(48)
            s.sendall(hmac.new(b"guess", b"x", "sha256").digest())
            outcome["forged"] = s.recv(1)
        # 2. a process of another job running accord's own handshake with its own secret
        try:
            connect.dial(host, port, time.monotonic() + 5, "default", 2, 0, b"another job")
            outcome["stranger"] = "joined"
        except HandshakeRefused as e:
            outcome["stranger"] = str(e)
        # 3. sockets that send nothing, or a few bytes, held open while rank 2 joins
        for r in (0, 1):
            h, p = _listener_of(store, r)
            held.append(socket.create_connection((h, p), timeout=5))
            slow = socket.create_connection((h, p), timeout=5)
            slow.sendall(b"accord02")
            held.append(slow)
        store.close()
    t0 = time.monotonic()
    accord.init_process_group()
    outcome["init_s"] = time.monotonic() - t0
    x = np.full(1000, rank + 1.0)
    accord.all_reduce(x)
    outcome["sum_ok"] = bool((x == world * (world + 1) / 2).all())
    accord.destroy_process_group()
    for s in held:
        s.close()
    outcome["warnings"] = seen.lines
    return outcome


@pytest.mark.parametrize("token", ["with-token", "no-token"])
def test_forged_hello_stranger_and_idle_sockets_are_refused(token):
    env = {"ACCORD_TRANSPORT": "tcp", "ACCORD_TIMEOUT": "30"}
    if token == "with-token":
        env["ACCORD_STORE_TOKEN"] = "s3cret-of-this-job"
    out = run_ranks(3, _attack_then_join, env=env, init=False, timeout=40)
    assert all(o["sum_ok"] for o in out), out
    attacker = out[2]
    assert attacker["forged"] in (b"", b"\x00")
    assert "does not know this job's secret" in attacker["stranger"]
    # the idle sockets (held open until after the job) delayed nobody
    assert attacker["init_s"] < 5.0, attacker
    w0 = "\n".join(out[0]["warnings"])
    assert "refused a connection" in w0 and "claiming group rank 2" in w0, w0
    assert "failed to prove it knows the job's secret" in w0, w0
    assert "had not finished its handshake" in w0, w0
    assert "had not finished its handshake" in "\n".join(out[1]["warnings"])


def _mesh(rank, size, secret, store, out, deadline):
    try:
        out[rank] = connect.connect_mesh(store, "g", rank, size, "127.0.0.1", deadline,
                                         secret=secret)
    except Exception as e:
        out[rank] = e


def _run_mesh(secrets_, within):
    store, out = HashStore(), {}
    deadline = time.monotonic() + within
    threads = [threading.Thread(target=_mesh, args=(r, len(secrets_), s, store, out, deadline))
               for r, s in enumerate(secrets_)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(within + 10)
    return out


def test_mesh_forms_when_every_rank_knows_the_secret():
    out = _run_mesh([b"k"] * 4, 10)
    try:
        for r in range(4):
            assert sorted(out[r]) == [p for p in range(4) if p != r]
        out[3][0].sendall(b"hi")
        assert out[0][3].recv(2) == b"hi"
    finally:
        for socks in out.values():
            for s in getattr(socks, "values", lambda: [])():
                s.close()


def test_a_rank_with_another_secret_is_refused_both_ways(caplog):
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="accord"):
        out = _run_mesh([b"right", b"wrong"], 2.0)
    # the connecting rank finds out at once that its peer does not know its secret
    assert isinstance(out[1], HandshakeRefused) and isinstance(out[1], AccordError), out
    # the accepting one waits for the real rank 1 until its deadline, and says why
    assert isinstance(out[0], CommTimeout) and "refused 1 connection" in str(out[0]), out
    assert time.monotonic() - t0 < 6
    assert any("refused" in r.getMessage() for r in caplog.records)


def test_job_secret_is_the_token_or_one_shared_random_secret(monkeypatch):
    monkeypatch.setenv("ACCORD_STORE_TOKEN", "tok")
    assert connect.job_secret(HashStore()) == b"tok"
    monkeypatch.delenv("ACCORD_STORE_TOKEN")
    store = HashStore()
    a, b = connect.job_secret(store), connect.job_secret(store)
    assert a == b and len(a) == 64
    assert connect.job_secret(HashStore()) != a


def test_no_token_off_loopback_warns_once(monkeypatch, caplog):
    monkeypatch.delenv("ACCORD_STORE_TOKEN", raising=False)
    monkeypatch.setattr(connect, "_warned_unset", False)
    store = HashStore()
    with caplog.at_level(logging.WARNING, logger="accord"):
        connect.job_secret(store, "127.0.0.1")
        assert not caplog.records          # loopback: only this host's processes
        connect.job_secret(store, "10.0.0.5")
        connect.job_secret(store, "10.0.0.5")
    warned = [r for r in caplog.records if "ACCORD_STORE_TOKEN is not set" in r.getMessage()]
    assert len(warned) == 1


# -- the network ----------------------------------------------------------------------

_IFACES = [("lo", netif.IFF_UP | netif.IFF_LOOPBACK, ["127.0.0.1", "::1"]),
           ("docker0", netif.IFF_UP, ["172.17.0.1"]),
           ("eth0", netif.IFF_UP, ["10.0.0.5", "fe80::1"]),
           ("eth1", 0, ["10.1.0.5"]),
           ("ib0", netif.IFF_UP, ["fe80::2", "fd00::7"])]


@pytest.mark.parametrize("spec,name,addr", [
    ("eth0", "eth0", "10.0.0.5"),
    ("eth", "eth0", "10.0.0.5"),             # a prefix, as NCCL reads it; eth1 is down
    ("=eth0", "eth0", "10.0.0.5"),
    ("ib0,eth0", "ib0", "fd00::7"),          # IPv6 only: link-local is skipped
    ("^docker,lo", "eth0", "10.0.0.5"),
    ("^docker,eth,ib", "lo", "127.0.0.1"),   # loopback only when nothing else is left
])
def test_socket_ifname_selects(spec, name, addr):
    assert netif.select_interface(spec, _IFACES)[:2] == (name, addr)


@pytest.mark.parametrize("spec", ["eth7", "eth0,wlan", "=eth"])
def test_socket_ifname_naming_no_interface_is_a_value_error(spec):
    with pytest.raises(ValueError, match="matches '(eth7|wlan|eth)'"):
        netif.select_interface(spec, _IFACES)


def test_socket_ifname_shape_is_checked_with_the_other_options():
    with pytest.raises(ValueError, match="ACCORD_SOCKET_IFNAME"):
        Options.from_env({"ACCORD_SOCKET_IFNAME": "^,"})
    assert Options.from_env({"ACCORD_SOCKET_IFNAME": " lo "}).socket_ifname == "lo"


def test_unknown_interface_fails_before_any_connection(monkeypatch):
    import accord
    monkeypatch.setenv("ACCORD_SOCKET_IFNAME", "nosuchif0")
    t0 = time.monotonic()
    # nothing listens on port 1: a rank that tried to connect would wait its timeout
    with pytest.raises(ValueError, match="nosuchif0"):
        accord.init_process_group(init_method="tcp://127.0.0.1:1", rank=1, world_size=2,
                                  timeout=30)
    assert time.monotonic() - t0 < 2
    assert not accord.is_initialized()


def test_store_and_data_plane_listen_on_the_chosen_address_only(monkeypatch):
    from accord.tcpstore import TCPStore
    monkeypatch.setenv("ACCORD_SOCKET_IFNAME", "lo")
    options = Options.from_env()
    assert netif.choose_address(options, "127.0.0.1")[:2] == ("127.0.0.1", "lo")
    assert netif.store_bind_address("10.9.8.7", options) == "127.0.0.1"
    store = TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=5)
    try:
        assert store._server._listener.getsockname()[0] == "127.0.0.1"
        store.set("k", b"v")
        assert store.get("k") == b"v"
    finally:
        store.close()
    monkeypatch.delenv("ACCORD_SOCKET_IFNAME")
    # without it: a loopback master address stays on loopback (it was 0.0.0.0)
    assert netif.store_bind_address("127.0.0.1") == "127.0.0.1"
    assert netif.store_bind_address("localhost") == "127.0.0.1"


def test_host_port_forms():
    assert netif.split_host_port("[::1]:29500") == ("::1", "29500")
    assert netif.split_host_port("::1:29500") == ("::1", "29500")
    assert netif.split_host_port("10.0.0.1:80") == ("10.0.0.1", "80")
    assert netif.join_host_port("::1", 5) == "[::1]:5"
    assert Options.from_env({"ACCORD_LAUNCHER_STORE": "[::1]:29500"}).launcher_store_addr
    with pytest.raises(ValueError):
        Options.from_env({"ACCORD_LAUNCHER_STORE": "[::1]"})


def _v6_job(rank, world, port):
    import accord
    accord.init_process_group(init_method=f"tcp://[::1]:{port}", rank=rank, world_size=world)
    g = accord.world.default_group()
    families = {link.sock.family for link in g.transport.links.values()}
    x = np.arange(10.0) * (rank + 1)
    accord.all_reduce(x)
    accord.destroy_process_group()
    return families == {socket.AF_INET6}, bool((x == np.arange(10.0) * 3).all())


def _free_v6_port():
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", 0))
        return s.getsockname()[1]


def test_ipv6_loopback_end_to_end():
    out = run_ranks(2, _v6_job, _free_v6_port(), env={"ACCORD_TRANSPORT": "tcp"}, init=False,
                    timeout=30)
    assert out == [(True, True)] * 2


# -- TLS ------------------------------------------------------------------------------

def _openssl(*args, cwd):
    import subprocess
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def _make_ca(d, name):
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", f"{name}-ca.key", "-out", f"{name}-ca.pem",
             "-days", "2", "-subj", f"/CN={name}-ca", cwd=d)
    _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj",
             f"/CN={name}", cwd=d)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{name}-ca.pem", "-CAkey",
             f"{name}-ca.key", "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", cwd=d)
    return {"ACCORD_TLS_CERT": str(d / f"{name}.pem"), "ACCORD_TLS_KEY": str(d / f"{name}.key"),
            "ACCORD_TLS_CA": str(d / f"{name}-ca.pem")}


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    import shutil
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make test certificates")
    d = tmp_path_factory.mktemp("tls")
    return _make_ca(d, "job"), _make_ca(d, "other")


def _tls_job(rank, world):
    import accord
    from accord import tls
    g = accord.world.default_group()
    kinds = {type(link.sock) for link in g.transport.links.values()}
    x = np.full(1 << 20, rank + 1.0, dtype=np.float32)       # 4 MiB
    accord.all_reduce(x)
    accord.broadcast(x[:1000], src=1)
    ok = bool((x == 3.0).all())
    if rank == 0:
        accord.send(np.arange(100000.0), dst=1)
    else:
        y = np.empty(100000)
        accord.recv(y, src=0)
        ok = ok and bool((y == np.arange(100000.0)).all())
    return kinds == {tls.TlsSocket}, ok


def test_tls_job_over_tcp(certs, monkeypatch):
    for k, v in certs[0].items():
        monkeypatch.setenv(k, v)       # the harness's store and both ranks
    out = run_ranks(2, _tls_job, env={"ACCORD_TRANSPORT": "tcp"}, timeout=40)
    assert out == [(True, True)] * 2


def test_tls_store_refuses_plain_and_foreign_clients(certs, monkeypatch):
    from accord.tcpstore import TCPStore, TCPStoreServer
    for k, v in certs[0].items():
        monkeypatch.setenv(k, v)
    server = TCPStoreServer("127.0.0.1", 0, token="")
    try:
        ok = TCPStore("127.0.0.1", server.port, timeout=5)
        ok.set("k", b"v")
        assert ok.get("k") == b"v"
        ok.close()
        for k, v in certs[1].items():   # a certificate another CA signed
            monkeypatch.setenv(k, v)
        with pytest.raises(AccordError, match="TLS handshake failed"):
            TCPStore("127.0.0.1", server.port, timeout=5)
        for k in certs[1]:
            monkeypatch.delenv(k)
        with pytest.raises(AccordError):
            TCPStore("127.0.0.1", server.port, timeout=3)
    finally:
        server.close()


def test_tls_needs_all_three_files():
    with pytest.raises(ValueError, match="ACCORD_TLS_KEY, ACCORD_TLS_CA"):
        Options.from_env({"ACCORD_TLS_CERT": "/x.pem"})


def _v6_env_job(rank, world, port):
    import accord
    os.environ.pop("ACCORD_LAUNCHER_STORE")
    os.environ.update(MASTER_ADDR="[::1]", MASTER_PORT=str(port))
    accord.init_process_group()
    x = np.ones(5) * (rank + 1)
    accord.all_reduce(x)
    store = accord.world.default_group().store
    accord.destroy_process_group()
    return bool((x == 3).all()), type(store).__name__


def test_ipv6_master_addr_env():
    # rank 0 hosts the store on ::1 (brackets as in a URL are accepted)
    out = run_ranks(2, _v6_env_job, _free_v6_port(), env={"ACCORD_TRANSPORT": "tcp"},
                    init=False, timeout=30)
    assert [o[0] for o in out] == [True, True]


def test_doctor_names_the_interface_and_why():
    import io
    from accord.cli import doctor
    buf = io.StringIO()
    r = doctor.Report(buf)
    doctor.check_chosen_interface(r, {"MASTER_ADDR": "127.0.0.1", "ACCORD_SOCKET_IFNAME": "lo"})
    doctor.check_chosen_interface(r, {"ACCORD_SOCKET_IFNAME": "nosuchif0"})
    text = buf.getvalue()
    assert "listen on 127.0.0.1 (interface lo): ACCORD_SOCKET_IFNAME=lo" in text, text
    assert "FAIL" in text and "nosuchif0" in text, text


# -- the handshake fuzzed, and a stopped rank ----------------------------------------

def _fuzz_one(prefix_bytes, tail, close):
    """Rank 0 of a 2-rank mesh meets a connection that sends `prefix_bytes` (a hello of
    the right group with random fields, or junk) then `tail`, before the real rank 1
    connects: the mesh must still form, with the real rank 1."""
    store, out = HashStore(), {}
    deadline = time.monotonic() + 10
    t0 = threading.Thread(target=_mesh, args=(0, 2, b"k", store, out, deadline))
    t0.start()
    host, port = netif.split_host_port(store.get("g/addr/0", timeout=5).decode())
    junk = socket.create_connection((host, int(port)), timeout=5)
    try:
        try:
            junk.sendall(prefix_bytes + tail)
            if close:
                junk.shutdown(socket.SHUT_WR)
        except OSError:
            pass            # rank 0 refused it already
        _mesh(1, 2, b"k", store, out, deadline)
        t0.join(15)
    finally:
        junk.close()
    try:
        assert not isinstance(out[0], Exception) and not isinstance(out[1], Exception), out
        out[1][0].sendall(b"real")
        assert out[0][1].recv(4) == b"real"
    finally:
        for socks in out.values():
            for s in getattr(socks, "values", lambda: [])():
                s.close()


def test_handshake_fuzzed():
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    hello = st.builds(lambda magic, tok, rank, nonce: connect._HELLO.pack(magic, tok, rank, nonce),
                      st.sampled_from([connect._MAGIC, b"accord01", b"\0" * 8]),
                      st.sampled_from([connect.group_token("g"), 0, 2 ** 64 - 1]),
                      st.integers(-2 ** 31, 2 ** 31 - 1) | st.sampled_from([0, 1, 2]),
                      st.binary(min_size=16, max_size=16))

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.one_of(hello, st.binary(max_size=64)), st.binary(max_size=80), st.booleans())
    def run(prefix_bytes, tail, close):
        _fuzz_one(prefix_bytes, tail, close)

    run()


def _stopped_rank(rank, world, stop_s):
    """Rank 1 stops itself (SIGSTOP) between two all_reduces; a helper wakes it after
    stop_s seconds. Returns (outcome of the second all_reduce, seconds it took)."""
    import signal
    import subprocess
    import accord
    from harness import timed
    x = np.ones(1 << 16)
    accord.all_reduce(x)
    if rank == 1:
        subprocess.Popen(["sh", "-c", f"sleep {stop_s}; kill -CONT {os.getpid()}"])
        os.kill(os.getpid(), signal.SIGSTOP)
    y = np.full(1 << 16, rank + 1.0)
    kind, msg, took = timed(lambda: accord.all_reduce(y))
    return kind, msg, took, bool((y == world * (world + 1) / 2).all())


def test_rank_stopped_shorter_than_the_timeout_completes():
    out = run_ranks(3, _stopped_rank, 2, env={"ACCORD_TRANSPORT": "tcp", "ACCORD_TIMEOUT": "20"},
                    timeout=30)
    assert [o[0] for o in out] == ["ok"] * 3 and all(o[3] for o in out), out


def test_rank_stopped_longer_than_the_timeout_is_named():
    out = run_ranks(3, _stopped_rank, 8, env={"ACCORD_TRANSPORT": "tcp", "ACCORD_TIMEOUT": "3"},
                    timeout=30, expect_fail=True)
    for r in (0, 2):
        kind, payload = out[r]
        assert kind == "ok", out
        err, msg, took, _ = payload
        assert err == "CommTimeout" and "rank 1" in msg, payload
        assert took < 3 + 4, payload


def test_store_protocol_fuzzed():
    """Random frames (valid codes with random fields, bad lengths, junk) sent to a store
    server, before and after the hello: it drops or answers them, and a real client
    is served afterwards, every time."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from accord import tcpstore
    from accord.tcpstore import TCPStore, TCPStoreServer
    server = TCPStoreServer("127.0.0.1", 0, token="t0k")
    fields = st.lists(st.binary(max_size=24), max_size=4)
    frame = st.builds(tcpstore._frame, st.integers(0, 255), fields)

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(["none", "hello", "authenticated"]),
           st.lists(frame | st.binary(max_size=40), max_size=4))
    def run(greet, frames):
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
            s.settimeout(2)
            try:
                if greet != "none":
                    s.sendall(tcpstore._frame(1, [tcpstore._MAGIC]))   # HELLO
                if greet == "authenticated":          # the proof, then fuzz the requests
                    conn = tcpstore._Conn(s)
                    _, (tag, nonce) = tcpstore._parse(conn.read_frame())
                    s.sendall(tcpstore._frame(tcpstore._AUTH, [tcpstore._proof("t0k", nonce)]))
                    assert tcpstore._parse(conn.read_frame())[0] == tcpstore._OK
                for f in frames:
                    s.sendall(f)
                s.shutdown(socket.SHUT_WR)
                while s.recv(4096):
                    pass
            except OSError:
                pass            # dropped, as it should be
        ok = TCPStore("127.0.0.1", server.port, timeout=5, token="t0k")
        try:
            ok.set("k", b"v")
            assert ok.get("k") == b"v"
        finally:
            ok.close()

    try:
        run()
    finally:
        server.close()
