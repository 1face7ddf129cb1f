"""The TCPStore server survives hostile and broken clients; optional token authentication."""
import logging
import socket
import struct
import time

import pytest

from accord.errors import AccordError
from accord.tcpstore import TCPStore, TCPStoreServer

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def server():
    s = TCPStoreServer("127.0.0.1", 0, token="")
    yield s
    s.close()


def _still_serves(port, token=""):
    c = TCPStore("127.0.0.1", port, timeout=5, token=token)
    try:
        c.set("k", b"v")
        assert c.get("k") == b"v"
    finally:
        c.close()


def _raw(port, data, read=True):
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        s.sendall(data)
        if read:
            try:
                return s.recv(4096)
            except OSError:
                return b""
    finally:
        s.close()


def _frame(code, fields):
    body = bytes((code,)) + b"".join(len(f).to_bytes(4, "little") + f for f in fields)
    return len(body).to_bytes(4, "little") + body


HELLO = _frame(1, [b"accord-store-1"])


def test_garbage_and_http_clients_are_dropped_with_a_log_line(server, caplog):
    caplog.set_level(logging.WARNING, logger="accord.store")
    _raw(server.port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    _raw(server.port, b"\x05\x00\x00\x00\x01garbage-after-a-plausible-length")
    _still_serves(server.port)
    time.sleep(0.1)
    assert any("dropped client" in r.getMessage() for r in caplog.records)


def test_oversized_lengths_are_refused_without_allocating(server):
    _raw(server.port, struct.pack("<I", 0xFFFFFFFF) + b"x" * 100)
    # after the handshake: a frame that claims 2 GiB, then the client vanishes
    _raw(server.port, HELLO + struct.pack("<I", (1 << 31) - 1) + b"\x02" + b"x" * 1000,
         read=False)
    # a frame whose field claims more than the frame holds
    _raw(server.port, HELLO + _frame(2, [b"k"])[:-6] + b"\xff\xff\xff\x7f")
    _still_serves(server.port)


def test_disconnect_mid_message_and_half_handshakes(server):
    for data in (HELLO[:3], HELLO[:10], HELLO + _frame(2, [b"key", b"value"])[:9]):
        _raw(server.port, data, read=False)
    # a client that connects and says nothing at all, left open while others work
    idle = socket.create_connection(("127.0.0.1", server.port))
    try:
        _still_serves(server.port)
    finally:
        idle.close()


def test_malformed_requests_get_errors_not_crashes(server):
    s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    try:
        s.sendall(HELLO)
        s.recv(100)
        for code, fields in ((3, [b"\xff\xfe"]), (4, [b"k", b"notanint"]), (3, []), (99, [])):
            s.sendall(_frame(code, fields))
            reply = s.recv(4096)
            assert reply and reply[4] in (2, 3), (code, reply)     # VALUE_ERROR / ERROR
    finally:
        s.close()
    _still_serves(server.port)


def test_token_required_and_checked():
    srv = TCPStoreServer("127.0.0.1", 0, token="s3cret")
    try:
        with pytest.raises(AccordError, match="requires a token"):
            TCPStore("127.0.0.1", srv.port, timeout=5, token="")
        with pytest.raises(AccordError, match="authentication failed"):
            TCPStore("127.0.0.1", srv.port, timeout=5, token="wrong")
        # a raw client that skips the proof is dropped before it can touch a key
        reply = _raw(srv.port, HELLO + _frame(2, [b"intruder", b"v"]))
        _still_serves(srv.port, token="s3cret")
        c = TCPStore("127.0.0.1", srv.port, timeout=5, token="s3cret")
        assert c.check(["intruder"]) is False
        c.close()
        assert srv.wait_clients_gone(5)
        assert reply      # the nonce (and then the refusal)
    finally:
        srv.close()


def test_token_from_environment(monkeypatch):
    monkeypatch.setenv("ACCORD_STORE_TOKEN", "from-env")
    srv = TCPStoreServer("127.0.0.1", 0)
    try:
        _still_serves(srv.port, token=None)        # the client reads it too
        with pytest.raises(AccordError):
            TCPStore("127.0.0.1", srv.port, timeout=5, token="other")
    finally:
        srv.close()


def test_launcher_generates_a_token(tmp_path):
    import subprocess
    import sys
    script = tmp_path / "s.py"
    script.write_text("import os, accord as d\n"
                      "assert len(os.environ['ACCORD_STORE_TOKEN']) == 32\n"
                      "d.init_process_group(); d.barrier(); d.destroy_process_group()\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "ACCORD_STORE_TOKEN"}
    r = subprocess.run([sys.executable, "-m", "accord", "run", "-n", "2", str(script)],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_a_client_connected_to_itself_retries(server, monkeypatch):
    # dialling a local port nobody listens on yet can pick that very port as the source:
    # TCP then connects the socket to itself, which must count as "not up yet"
    import accord.tcpstore as tcpstore
    real = socket.create_connection
    selfies = []

    def first_to_itself(addr, timeout=None):
        if not selfies:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.connect(s.getsockname())
            selfies.append(s)
            return s
        return real(addr, timeout=timeout)
    monkeypatch.setattr(tcpstore.socket, "create_connection", first_to_itself)
    c = TCPStore("127.0.0.1", server.port, timeout=5, token="")
    try:
        c.set("k", b"v")
        assert c.get("k") == b"v"
    finally:
        c.close()
    assert selfies and selfies[0].fileno() == -1        # the self-connected socket was dropped
