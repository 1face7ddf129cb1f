"""The job's store served by a process of its own, for a rendezvous without a launcher.

With `tcp://host:port` or a plain `env://` (no `accord run` to host the store),
torch's TCPStore master serves the store from a thread of rank 0's own process,
so rank 0's death takes the store, and with it every survivor's way to meet
(shrink, agree and admit all go through the store). Here rank 0 starts the
server as a small process of its own (only the store's modules, no numpy), in
a session of its own, and connects to it as a client like every other rank: a
SIGKILL of rank 0 leaves the store up.

It must never outlive the job. It ends by itself once its owner is done with
it (rank 0's close writes "q" on its stdin, or rank 0 died: its parent changed)
and no client is connected any more; rank 0's normal close waits for that (as
an in-process server's close waits for its clients) and kills it after the wait.
"""
import atexit
import os
import select
import subprocess
import sys
import time

from .errors import AccordError, CommTimeout
from .netif import is_loopback, store_bind_address
from .store import DEFAULT_STORE_TIMEOUT
from .tcpstore import AddressInUse, TCPStore, TCPStoreServer

# how long the owner waits for the server to say it listens (seconds): it starts in
# about 0.1 s on an idle host
START_S = 30.0
# how often the server looks at whether its owner is gone (seconds)
_OWNER_POLL_S = 0.2
_IN_USE = 3          # the server's exit status when its port is taken

# The server process's program. -I keeps the user's directory and PYTHON* variables
# out of its path; the package is a bare namespace over this directory, so only the
# store's modules load (accord/__init__.py would import numpy and everything else for
# a process that serves keys).
_BOOT = """
import sys, types
pkg = types.ModuleType("accord")
pkg.__path__ = [sys.argv[1]]
sys.modules["accord"] = pkg
from accord.store_process import serve
sys.exit(serve(sys.argv[2], int(sys.argv[3]), sys.argv[4]))
"""


def _dial(bind):
    """Where the owner reaches the server: loopback when it listens there or everywhere."""
    if bind in ("0.0.0.0", "::") or is_loopback(bind):
        return "::1" if ":" in bind else "127.0.0.1"
    return bind


class StoreProcess:
    """The server process rank 0 started: its port, and how to end it."""

    def __init__(self, host, port, display_host=None, start_s=START_S):
        bind = store_bind_address(host)
        self.dial = _dial(bind)
        self._owner = os.getpid()
        self._finished = False
        # stdin: the owner's "done" (and EOF when it dies); stdout: one "ready PORT" line;
        # stderr dropped, so the detached server holds none of rank 0's pipes open
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-c", _BOOT, os.path.dirname(os.path.abspath(__file__)),
             bind, str(port), display_host or host],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            start_new_session=True)
        try:
            self.port = self._ready(port, display_host or host, start_s)
        except BaseException:
            self.kill()
            raise

    def _ready(self, port, display_host, start_s):
        out = self.proc.stdout
        if not select.select([out], [], [], start_s)[0]:
            raise CommTimeout(f"the store's process did not start listening on port {port} "
                              f"within {start_s:g} s")
        line = out.readline().decode("utf-8", "replace").strip()
        out.close()
        if line.startswith("ready "):
            return int(line.split()[1])
        status = self.proc.wait(timeout=5)
        if status == _IN_USE:
            raise AddressInUse(f"store port {port} on {display_host} is already in use "
                               f"(another job? choose another MASTER_PORT)")
        raise AccordError(f"the store's process could not listen on {display_host}:{port} "
                          f"({line or f'it exited with status {status}'})")

    def finish(self, wait_s):
        """The owner is done: the server ends once its last client has left; wait for
        that at most wait_s seconds, then kill it. Only the process that started it
        does this (a forked child's copy does nothing)."""
        if self._finished or os.getpid() != self._owner:
            return
        self._finished = True
        try:
            self.proc.stdin.write(b"q")
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._finished = True


class HostedStore(TCPStore):
    """A TCPStore client of a server that runs in a StoreProcess this process started:
    what rank 0 uses where it would have been the store's master.

    close() disconnects, then waits (at most min(timeout, 30 s), as a master's
    close does) until the other clients have left and the server has ended.
    """

    def __init__(self, host, port, world_size=None, timeout=DEFAULT_STORE_TIMEOUT, token=None):
        self.server_process = StoreProcess(host, port)
        try:
            super().__init__(self.server_process.dial, self.server_process.port, world_size,
                             is_master=False, timeout=timeout, token=token)
        except BaseException:
            self.server_process.kill()
            raise
        self.host = host
        atexit.register(self.close)

    def close(self):
        super().close()
        atexit.unregister(self.close)
        self.server_process.finish(min(self.timeout, 30.0))


def _owner_done(started_ppid):
    """True once the owner said it is done ("q" or EOF on stdin) or died (the parent
    changed: the server was handed to init or a subreaper)."""
    if os.getppid() != started_ppid:
        return True
    ready = select.select([sys.stdin.buffer], [], [], _OWNER_POLL_S)[0]
    if ready:
        return True          # "q", or EOF: either way the owner no longer needs it
    return False


def serve(bind, port, display_host):
    """The server process: listen, say so, and end once the owner is done and no
    client is connected."""
    started_ppid = os.getppid()
    try:
        server = TCPStoreServer(bind, port, display_host=display_host)
    except AddressInUse:
        return _IN_USE
    except OSError as e:
        sys.stdout.write(f"error {e}\n")
        return 1
    sys.stdout.write(f"ready {server.port}\n")
    sys.stdout.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)       # the owner closed its end: nothing more goes there
    while not _owner_done(started_ppid):
        pass
    server.wait_clients_gone(None)
    time.sleep(0.05)          # the last reply reaches its client before the socket closes
    server.close()
    return 0

