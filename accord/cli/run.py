"""`accord run`: start the ranks of a job on this host, like torchrun.

    accord run -n 4 script.py [args...]
    accord run --nnodes 2 --node-rank 0 --master-addr HOST --master-port PORT -n 2 script.py

Each rank is a Python process with torchrun's environment (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT, ...), so a
script written for torchrun runs unchanged. Every line a rank writes to
stdout or stderr comes out whole on the launcher's stdout or stderr, prefixed
"[rank N] " (--no-prefix leaves lines as they are; --log-dir DIR also writes
each rank's lines to DIR/rank-N.log).

The rendezvous store lives in the launcher (node 0's launcher on several
nodes), on its own port, and the ranks learn its address from
ACCORD_LAUNCHER_STORE=host:port: every rank, rank 0 included, connects to it
as a client, so no rank has to bind a port and a rank that dies does not take
the store with it. MASTER_PORT is left free for programs that rendezvous
themselves (torch.distributed with gloo binds it on rank 0, as under torchrun).

When a rank exits non-zero or is killed by a signal, the launcher stops the
others (SIGTERM, then SIGKILL after --grace seconds) and ends with a summary:
the rank at fault (the first to fail on its own, not because a peer was lost),
its exception, message and the user-code file:line, its traceback with
accord's own frames folded (ACCORD_DEBUG unfolds them), and one line for each
other rank. It exits with that rank's exit status (128 + signal number for a
signal). SIGINT, SIGTERM and SIGHUP sent to the
launcher are forwarded to the ranks the same way. The launcher never waits on
a rank that will not die.

With --keep-going a failing rank does not stop the others (they call
accord.shrink and go on), and the launcher marks its process ended in the
store, for survivors on other hosts; --max-restarts N also restarts it, up
to N times in all, with ACCORD_RESTART_COUNT set (its init_process_group()
waits for accord.admit). Such a job exits 0 when every rank still in it at
its end exits 0: a rank that fails once another has finished, or a job where
no rank finishes, fails it as without --keep-going.
"""
import argparse
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Optional, Tuple

from . import _output

DEFAULT_GRACE = 3.0      # seconds between SIGTERM and SIGKILL when stopping ranks
REAP_TIMEOUT = 5.0       # seconds to wait for SIGKILLed ranks to be reaped
DRAIN_TIMEOUT = 2.0      # seconds to wait for the ranks' last output once they are gone
# Errors a rank gets because a peer failed, not a failure of its own: the launcher
# blames another rank over these when it can.
_CONSEQUENCES = ("accord.PeerLost", "accord.GroupClosed",
                 "accord.errors.PeerLost", "accord.errors.GroupClosed")
HEADLINE_CHARS = 300     # the message in the summary's headline is cut here
OTHER_CHARS = 100        # and in the line of each other rank
_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_child.py")


# --------------------------------------------------------------------------- configuration

@dataclass(frozen=True)
class LaunchConfig:
    target: str                       # script path, or module name when module=True
    args: Tuple[str, ...] = ()
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0              # 0: pick a free port (one node only)
    store_port: int = 0               # 0: any free port on one node, master_port + 1 on several
    launcher_store: bool = True       # host the rendezvous store in the launcher
    module: bool = False
    grace: float = DEFAULT_GRACE
    extra_env: dict = field(default_factory=dict)
    prefix: bool = True               # "[rank N] " before every line of a rank's output
    log_dir: Optional[str] = None     # also write each rank's lines to LOG_DIR/rank-N.log
    keep_going: bool = False          # a failing rank does not stop the others
    max_restarts: int = 0             # restart failed ranks' processes, this many times in all

    @property
    def world_size(self):
        return self.nnodes * self.nproc_per_node

    def validate(self):
        if self.nproc_per_node < 1:
            raise ValueError(f"--nproc-per-node must be at least 1, got {self.nproc_per_node}")
        if self.nnodes < 1:
            raise ValueError(f"--nnodes must be at least 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, {self.nnodes}), got {self.node_rank}")
        for name, port in (("--master-port", self.master_port), ("--store-port", self.store_port)):
            if not 0 <= port < 65536:
                raise ValueError(f"{name} must be a TCP port (0-65535), got {port}")
        if self.nnodes > 1:
            if self.master_port == 0:
                raise ValueError("--master-port is required with --nnodes > 1 "
                                 "(every node must be given the same one)")
            if self.master_addr in _LOOPBACK:
                raise ValueError("--master-addr must be node 0's address, reachable from every "
                                 f"node, with --nnodes > 1 (got {self.master_addr!r})")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if not self.grace >= 0:
            raise ValueError(f"--grace must be >= 0 seconds, got {self.grace}")
        if not self.module:
            _check_script(self.target)


_INTERPRETER = re.compile(r"python[0-9.]*")


def _check_script(target):
    """A script file every rank can run with the launcher's Python: not missing, and not
    a program (mpirun's habit, `accord run -n 2 python train.py`, would otherwise
    hand the interpreter's binary to Python as source and fail on every rank with a
    SyntaxError about null bytes)."""
    hint = (f"accord run starts every rank with its own Python ({sys.executable}): "
            f"name the script, as in `accord run -n 2 train.py`")
    if not os.path.isfile(target):
        if _INTERPRETER.fullmatch(os.path.basename(target)):
            raise ValueError(f"{target!r} is a Python interpreter, not a script: {hint}")
        raise ValueError(f"no such script: {target}")
    try:
        with open(target, "rb") as f:
            head = f.read(4)
    except OSError as exc:
        raise ValueError(f"cannot read the script {target}: {exc}") from None
    # an executable binary (ELF, Mach-O); a .pyc or a zip application stays a script
    if head == b"\x7fELF" or head in _MACH_O:
        what = ("a Python interpreter" if _INTERPRETER.fullmatch(os.path.basename(target))
                else "a compiled program")
        raise ValueError(f"{target} is {what}, not a Python script: {hint}")


_MACH_O = {b"\xfe\xed\xfa\xce", b"\xfe\xed\xfa\xcf", b"\xce\xfa\xed\xfe",
           b"\xcf\xfa\xed\xfe", b"\xca\xfe\xba\xbe"}


def add_arguments(parser):
    parser.usage = ("accord run [-n N] [--nnodes N --node-rank I --master-addr HOST "
                    "--master-port PORT] [-m] script.py|module [args...]")
    parser.description = __doc__.split("\n\n")[2].replace("\n", " ")
    parser.add_argument("-n", "--nproc-per-node", "--nproc_per_node", dest="nproc_per_node",
                        type=int, default=1, metavar="N",
                        help="ranks to start on this host (default 1)")
    parser.add_argument("--nnodes", type=int, default=1, metavar="N",
                        help="number of hosts taking part (default 1)")
    parser.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int, default=0,
                        metavar="I", help="this host's index, 0 .. nnodes-1 (default 0)")
    parser.add_argument("--master-addr", "--master_addr", dest="master_addr",
                        default="127.0.0.1", metavar="HOST",
                        help="address of node 0, reachable from every node (default 127.0.0.1)")
    parser.add_argument("--master-port", "--master_port", dest="master_port", type=int,
                        default=0, metavar="PORT",
                        help="MASTER_PORT given to the ranks (default: a free port; "
                             "required with --nnodes > 1)")
    parser.add_argument("--store-port", dest="store_port", type=int, default=0, metavar="PORT",
                        help="port of the launcher's rendezvous store on node 0 (default: a free "
                             "port on one node, master-port + 1 on several)")
    parser.add_argument("--no-launcher-store", dest="launcher_store", action="store_false",
                        help="do not host the store in the launcher: rank 0 hosts it on "
                             "MASTER_PORT, as with a plain env:// rendezvous")
    parser.add_argument("--grace", type=float, default=DEFAULT_GRACE, metavar="SECONDS",
                        help="when stopping ranks, seconds between SIGTERM and SIGKILL "
                             f"(default {DEFAULT_GRACE:g})")
    parser.add_argument("--no-prefix", dest="prefix", action="store_false",
                        help='do not put "[rank N] " before each line of the ranks\' output '
                             "(lines still come out whole)")
    parser.add_argument("--log-dir", dest="log_dir", default=None, metavar="DIR",
                        help="also write each rank's output (stdout and stderr, no prefix) "
                             "to DIR/rank-N.log, and its full traceback if it fails")
    parser.add_argument("--keep-going", dest="keep_going", action="store_true",
                        help="a rank that fails does not stop the others (they call "
                             "accord.shrink and go on); exit 0 when every rank still in the "
                             "job at its end exits 0")
    parser.add_argument("--max-restarts", dest="max_restarts", type=int, default=0,
                        metavar="N",
                        help="implies --keep-going; restart a failed rank's process, up to N "
                             "times in all, with ACCORD_RESTART_COUNT set: its "
                             "init_process_group() waits until the ranks call accord.admit()")
    parser.add_argument("-m", "--module", action="store_true",
                        help="run the target as a module (python -m), not a script file")
    parser.add_argument("target", metavar="script.py|module",
                        help="the program every rank runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, metavar="args",
                        help="arguments passed to the program")


def config_from_args(args):
    return LaunchConfig(target=args.target, args=tuple(args.args),
                        nproc_per_node=args.nproc_per_node, nnodes=args.nnodes,
                        node_rank=args.node_rank, master_addr=args.master_addr,
                        master_port=args.master_port, store_port=args.store_port,
                        launcher_store=args.launcher_store, module=args.module,
                        grace=args.grace, prefix=args.prefix, log_dir=args.log_dir,
                        keep_going=args.keep_going, max_restarts=args.max_restarts)


def main(args):
    try:
        config = config_from_args(args)
        config.validate()
    except ValueError as exc:
        _say(f"error: {exc}")
        return 2
    return launch(config)


def launch(config):
    """Run one node's share of a job; return the exit status `accord run` exits with."""
    config.validate()
    return _Launcher(config).run()


# --------------------------------------------------------------------------- helpers

def _say(message):
    _output.say(f"accord run: {message}\n")


def _signal_name(signum):
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_status(returncode):
    """'exited with code 3' / 'was killed by SIGKILL (signal 9)'."""
    if returncode is None:
        return "is still running"
    if returncode < 0:
        return f"was killed by {_signal_name(-returncode)} (signal {-returncode})"
    return f"exited with code {returncode}"


def exit_status(returncode):
    """The shell's convention: a process killed by signal S exits 128 + S."""
    return 128 - returncode if returncode < 0 else returncode


def free_port(host="127.0.0.1"):
    """A TCP port that is free now (another process may take it before it is used)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class _Rank:
    rank: int
    local_rank: int
    error_file: str
    proc: Optional[subprocess.Popen] = None
    returncode: Optional[int] = None
    ended: Optional[float] = None     # time.time() when the launcher saw it exit
    signalled: bool = False           # the launcher asked it to stop
    pumps: list = field(default_factory=list)     # threads passing on its stdout and stderr
    log: Optional[_output.RankLog] = None
    slot: str = ""                    # ACCORD_LAUNCH_SLOT of its current process

    @property
    def pid(self):
        return self.proc.pid if self.proc else None

    def error(self):
        try:
            with open(self.error_file) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None


# --------------------------------------------------------------------------- the launcher

class _Launcher:
    def __init__(self, config):
        self.config = config
        self.ranks = []
        self.events = queue.SimpleQueue()   # ("exit", rank) / ("signal", signum); put() is reentrant
        self.store = None
        self.token = ""         # the store's shared secret, passed to the ranks
        self.env = None         # the ranks' environment (a restart is spawned with it)
        self.restarts = 0       # restarts made so far (--max-restarts)
        self.first_ok = None    # when a rank first exited 0 (--keep-going: the job is ending)
        self.late_failure = None    # a rank that failed after that
        self.lost = []          # ranks that failed and were not restarted (--keep-going)
        self.store_address = ""     # the job's store, 'host:port'
        self.client = None      # the launcher's own client of it (--keep-going)

    # -- store and environment

    def _start_store(self):
        """Host the rendezvous store (node 0 only); return its 'host:port' for the ranks or ''."""
        cfg = self.config
        if not cfg.launcher_store:
            return ""
        if cfg.nnodes > 1:
            port = cfg.store_port or cfg.master_port + 1
            if cfg.node_rank != 0:
                return f"{cfg.master_addr}:{port}"
        else:
            port = cfg.store_port
        try:
            from accord.netif import store_bind_address
            from accord.tcpstore import TCPStoreServer
            # the master address (or the ACCORD_SOCKET_IFNAME interface), not 0.0.0.0
            bind = store_bind_address(cfg.master_addr)
        except ImportError as exc:
            _say(f"warning: cannot host the store ({exc}); rank 0 will host it")
            return ""
        # a secret for this job's store: the user's ACCORD_STORE_TOKEN, else (one node,
        # where no other launcher must know it) a fresh one the ranks inherit
        from accord.options import Options
        import secrets
        try:
            user_token = Options.from_env().store_token
        except ValueError:
            user_token = ""
        self.token = user_token or (secrets.token_hex(16) if cfg.nnodes == 1 else "")
        try:
            self.store = TCPStoreServer(host=bind, port=port, token=self.token)
        except OSError as exc:
            raise RuntimeError(f"cannot start the rendezvous store on {bind}:{port}: {exc}") \
                from exc
        return f"{cfg.master_addr}:{self.store.port}"

    def _base_env(self, store_address):
        cfg = self.config
        master_port = cfg.master_port or free_port(
            "127.0.0.1" if cfg.master_addr in _LOOPBACK else "")
        env = dict(os.environ)
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # our store does not speak torch's protocol
        env.update({
            "WORLD_SIZE": str(cfg.world_size),
            "LOCAL_WORLD_SIZE": str(cfg.nproc_per_node),
            "GROUP_RANK": str(cfg.node_rank),
            "GROUP_WORLD_SIZE": str(cfg.nnodes),
            "ROLE_NAME": "default",
            "ROLE_WORLD_SIZE": str(cfg.world_size),
            "MASTER_ADDR": cfg.master_addr,
            "MASTER_PORT": str(master_port),
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
            "PYTHONUNBUFFERED": "1",
            "ACCORD_RESTART_COUNT": "0",
            "ACCORD_MAX_RESTARTS": str(cfg.max_restarts),
        })
        if cfg.nproc_per_node > 1:
            # as torchrun does: N ranks each running a full-width thread pool oversubscribe
            env.setdefault("OMP_NUM_THREADS", "1")
        if store_address:
            env["ACCORD_LAUNCHER_STORE"] = store_address
            if self.token:
                env["ACCORD_STORE_TOKEN"] = self.token
        else:
            env.pop("ACCORD_LAUNCHER_STORE", None)
        env.update(cfg.extra_env)
        return env

    # -- processes

    def _spawn(self, rank, base_env):
        cfg = self.config
        env = dict(base_env)
        env.update({"RANK": str(rank.rank), "LOCAL_RANK": str(rank.local_rank),
                    "ROLE_RANK": str(rank.rank),
                    # what the launcher calls this process: survivors on other hosts learn
                    # from the store that it ended (accord/membership.py)
                    "ACCORD_LAUNCH_SLOT": f"{rank.rank}.{env.get('ACCORD_RESTART_COUNT', '0')}"})
        rank.slot = env["ACCORD_LAUNCH_SLOT"]
        cmd = [sys.executable, _CHILD, rank.error_file, str(os.getpid()),
               "module" if cfg.module else "script", cfg.target, *cfg.args]
        if cfg.log_dir and rank.log is None:
            rank.log = _output.RankLog(cfg.log_dir, rank.rank)
        prefix = f"[rank {rank.rank}] " if cfg.prefix else ""
        pipes = [os.pipe(), os.pipe()]
        try:
            # Each rank leads its own process group: terminal signals reach only the
            # launcher, which forwards them, and stopping a rank stops what it started.
            rank.proc = subprocess.Popen(cmd, env=env, start_new_session=True,
                                         stdout=pipes[0][1], stderr=pipes[1][1])
        except BaseException:
            for r, w in pipes:
                os.close(r)
                os.close(w)
            raise
        for (r, w), out, what in ((pipes[0], sys.stdout, "out"), (pipes[1], sys.stderr, "err")):
            os.close(w)
            pump = _output.Pump(r, out, prefix, rank.log, f"accord-run-{what}-{rank.rank}")
            pump.start()
            rank.pumps.append(pump)
        threading.Thread(target=self._wait_for, args=(rank,), daemon=True,
                         name=f"accord-run-wait-{rank.rank}").start()

    def _wait_for(self, rank):
        rank.proc.wait()
        self.events.put(("exit", rank))

    def _signal(self, rank, signum):
        if rank.returncode is not None or rank.proc is None or rank.proc.returncode is not None:
            return
        try:
            os.killpg(rank.proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(rank.proc.pid, signum)
            except (ProcessLookupError, PermissionError):
                pass

    def _alive(self):
        return [r for r in self.ranks if r.returncode is None]

    # -- signals sent to the launcher

    def _on_signal(self, signum, frame):
        self.events.put(("signal", signum))

    def _install_handlers(self):
        old = {}
        if threading.current_thread() is not threading.main_thread():
            return old
        for signum in _FORWARDED:
            try:
                old[signum] = signal.signal(signum, self._on_signal)
            except (OSError, ValueError):
                pass
        return old

    @staticmethod
    def _restore_handlers(old):
        for signum, handler in old.items():
            try:
                signal.signal(signum, handler)
            except (OSError, ValueError, TypeError):
                pass

    # -- the run

    def run(self):
        cfg = self.config
        old_handlers = self._install_handlers()
        ok = False
        try:
            with tempfile.TemporaryDirectory(prefix="accord-run-") as tmp:
                try:
                    store_address = self._start_store()
                    env = self.env = self._base_env(store_address)
                    self.store_address = store_address
                except (RuntimeError, OSError, ValueError) as exc:
                    _say(f"error: {exc}")
                    return 1
                first = cfg.node_rank * cfg.nproc_per_node
                self.ranks = [_Rank(first + i, i, os.path.join(tmp, f"error-{first + i}.json"))
                              for i in range(cfg.nproc_per_node)]
                try:
                    for rank in self.ranks:
                        self._spawn(rank, env)
                except OSError as exc:
                    _say(f"error: cannot start rank {rank.rank}: {exc}")
                    self._stop_all(signal.SIGKILL)
                    self._supervise(stopping=True)
                    return 1
                status = self._supervise()
                ok = status == 0
                return status
        finally:
            # Nothing we started outlives the launcher.
            for rank in self.ranks:
                if rank.proc is not None and rank.proc.poll() is None:
                    self._signal(rank, signal.SIGKILL)
            self._close_store(ok)
            self._restore_handlers(old_handlers)
            for rank in self.ranks:
                if rank.log is not None:
                    rank.log.close()

    def _drain(self, within=DRAIN_TIMEOUT):
        """Let the pumps pass on what the ranks wrote last (a grandchild that keeps a pipe
        open must not keep the launcher waiting)."""
        deadline = time.monotonic() + within
        for rank in self.ranks:
            for pump in rank.pumps:
                pump.join(max(0.0, deadline - time.monotonic()))

    def _close_store(self, ok):
        if self.client is not None:
            try:
                self.client.close()
            except Exception:
                pass
            self.client = None
        if self.store is None:
            return
        try:
            if ok and self.config.nnodes > 1:
                # ranks on other nodes may still be finishing with the store
                self.store.wait_clients_gone(timeout=30.0)
            elif ok:
                self.store.wait_clients_gone(timeout=2.0)
        except Exception:
            pass
        try:
            self.store.close()
        except Exception:
            pass
        self.store = None

    def _stop_all(self, signum):
        for rank in self._alive():
            rank.signalled = True
            self._signal(rank, signum)

    def _supervise(self, stopping=False):
        """Wait for every rank; stop them all at the first failure or signal. Return the status."""
        cfg = self.config
        failure = None          # the first rank seen to fail on its own
        got_signal = None       # a signal the launcher received
        kill_at = None          # when survivors get SIGKILL
        give_up_at = None       # when the launcher stops waiting for SIGKILLed ranks
        spawned = [r for r in self.ranks if r.proc is not None]
        pending = {id(r) for r in spawned}
        while pending:
            try:
                kind, what = self.events.get(timeout=0.2)
            except queue.Empty:
                kind = what = None
            now = time.monotonic()
            if kind == "exit":
                rank = what
                rank.returncode = rank.proc.returncode
                rank.ended = time.time()
                pending.discard(id(rank))
                if (cfg.keep_going or cfg.max_restarts) and not stopping:
                    self._mark_ended(rank)
                    if self._keep_going(rank, pending):
                        continue
                elif rank.returncode != 0 and not stopping:
                    failure = rank
                    stopping = True
                    others = len(self._alive())
                    _say(f"rank {rank.rank} {describe_status(rank.returncode)}"
                         + (f"; stopping the other {others} rank{'s' * (others != 1)}"
                            if others else ""))
                    self._stop_all(signal.SIGTERM)
                    kill_at = now + cfg.grace
            elif kind == "signal":
                if not stopping:
                    got_signal = what
                    stopping = True
                    _say(f"received {_signal_name(what)}; stopping the ranks")
                    self._stop_all(what)
                    kill_at = now + cfg.grace
                else:
                    if got_signal is None:
                        got_signal = what
                    kill_at = now  # asked twice: no more grace
            if stopping and kill_at is None and give_up_at is None:
                kill_at = now + cfg.grace
            if kill_at is not None and now >= kill_at and pending:
                stuck = self._alive()
                if stuck:
                    _say(f"rank{'s' * (len(stuck) > 1)} "
                         f"{', '.join(str(r.rank) for r in stuck)} did not stop within "
                         f"{cfg.grace:g}s; sending SIGKILL")
                    self._stop_all(signal.SIGKILL)
                kill_at = None
                give_up_at = now + REAP_TIMEOUT
            if give_up_at is not None and now >= give_up_at and pending:
                _say("giving up on rank(s) "
                     + ", ".join(str(r.rank) for r in self._alive())
                     + " that survived SIGKILL")
                break
        self._drain()
        if failure is None and (cfg.keep_going or cfg.max_restarts) and not got_signal:
            failure = self._keep_going_failure()
        if failure is not None:
            return self._report_failure(failure)
        if got_signal is not None:
            return 128 + got_signal
        if stopping:  # a spawn error
            return 1
        return 0

    # -- --keep-going and --max-restarts

    def _mark_ended(self, rank):
        """Tell the job's store that this rank's process has exited: the survivors'
        accord.shrink on other hosts, which cannot look at this host's processes,
        count it dead from this."""
        slot = rank.slot
        if not slot or not self.store_address:
            return
        try:
            if self.client is None:
                from accord.tcpstore import TCPStore
                host, _, port = self.store_address.rpartition(":")
                # a launcher that does not host the store has no token of its own: it
                # proves the job's ACCORD_STORE_TOKEN, as its ranks do (None reads it)
                self.client = TCPStore(host, int(port), is_master=False, timeout=5.0,
                                       token=self.token or None)
            from accord.membership import ended_key
            self.client.set(ended_key(slot), b"1")
        except Exception as exc:      # the survivors on this host can still tell
            _say(f"warning: cannot mark rank {rank.rank} ended in the store: {exc}")

    def _keep_going(self, rank, pending):
        """A rank exited under --keep-going: note it, restart it if restarts are left.
        True: handled (the others go on)."""
        cfg = self.config
        if rank.returncode == 0:
            if self.first_ok is None:
                self.first_ok = time.time()
            return True
        if self.first_ok is not None:
            # the job was ending (a rank finished): a failure now is the job's
            self.late_failure = self.late_failure or rank
            _say(f"rank {rank.rank} {describe_status(rank.returncode)} after another rank "
                 f"finished")
            return True
        if self.restarts < cfg.max_restarts:
            self.restarts += 1
            _say(f"rank {rank.rank} {describe_status(rank.returncode)}; restarting it "
                 f"(restart {self.restarts} of {cfg.max_restarts}); the other ranks go on")
            rank.error_file = rank.error_file.rsplit(".json", 1)[0] + f".r{self.restarts}.json"
            rank.returncode = rank.ended = None
            env = dict(self.env)
            env["ACCORD_RESTART_COUNT"] = str(self.restarts)
            try:
                self._spawn(rank, env)
            except OSError as exc:
                _say(f"error: cannot restart rank {rank.rank}: {exc}")
                rank.returncode = 1
                return True
            pending.add(id(rank))
            return True
        others = len(self._alive())
        _say(f"rank {rank.rank} {describe_status(rank.returncode)}; " +
             (f"the other {others} rank{'s' * (others != 1)} go on (--keep-going)" if others
              else "no rank is left"))
        self.lost.append(rank)
        return True

    def _keep_going_failure(self):
        """Under --keep-going, the rank the job failed because of, or None: one that
        failed after another had finished, or the last to fail if none finished."""
        if self.late_failure is not None:
            return self.late_failure
        if self.first_ok is None:
            failed = [r for r in self.ranks if r.returncode not in (0, None)]
            if failed:
                return max(failed, key=lambda r: r.ended or 0)
        lost = self.lost
        if lost:
            _say(f"job finished without rank{'s' * (len(lost) > 1)} "
                 f"{', '.join(str(r.rank) for r in lost)} (--keep-going); every rank "
                 f"still in it exited 0")
        return None

    def _fate(self, r):
        if r.signalled and r.returncode is not None and r.returncode < 0:
            return f"was stopped by the launcher ({_signal_name(-r.returncode)})"
        return describe_status(r.returncode)

    def _state(self, r):
        """One rank's fate in a few words, for the summary."""
        err = r.error()
        if r.returncode == 0:
            return "finished"
        if r.returncode is None:
            return "still running"
        if r.signalled and r.returncode < 0 and not err:
            return f"stopped ({_signal_name(-r.returncode)})"
        if err:
            how = ("stopped" if r.signalled and r.returncode < 0 else
                   describe_status(r.returncode))
            return f"{how} after it raised {_one_line(err, OTHER_CHARS)}"
        return describe_status(r.returncode)

    def _at_fault(self, observed):
        """The rank the job failed because of.

        The first to fail on its own: a rank that raised (what it raised is not
        PeerLost or GroupClosed, which a rank gets when a peer fails), or that exited
        non-zero or died without the launcher stopping it. If every failure is a
        lost peer, the rank the earliest of them names as gone, when it is ours.
        """
        def when(rank):
            err = rank.error()
            if err and isinstance(err.get("time"), (int, float)):
                return err["time"]
            return rank.ended if rank.ended is not None else float("inf")

        failed = [r for r in self.ranks
                  if r is observed or r.error() is not None
                  or (r.returncode not in (0, None) and not r.signalled)]
        primary = [r for r in failed
                   if not (r.error() and r.error().get("type") in _CONSEQUENCES)]
        if primary:
            return min(primary, key=lambda r: (when(r), r is not observed)), None
        first = min(failed, key=lambda r: (when(r), r is not observed))
        gone = (first.error() or {}).get("peer_lost")
        by_rank = {r.rank: r for r in self.ranks}
        if isinstance(gone, int) and gone in by_rank and by_rank[gone] is not first:
            return by_rank[gone], first
        return first, None

    def _report_failure(self, observed):
        """Print the job's summary; return the exit status of the rank at fault."""
        root, witness = self._at_fault(observed)
        err = root.error()
        where = f"(pid {root.pid}, local rank {root.local_rank} on node {self.config.node_rank})"
        if err and err.get("type"):
            _say(f"job failed: rank {root.rank} {where} raised {_one_line(err)}")
            _say(f"  then it {describe_status(root.returncode)}")
        elif witness is not None:
            _say(f"job failed: rank {root.rank} {where} left while rank {witness.rank} still "
                 f"needed it, which raised {_one_line(witness.error())}")
            _say(f"  rank {root.rank} then {self._fate(root)}")
            err = witness.error()
        else:
            _say(f"job failed: rank {root.rank} {where} {describe_status(root.returncode)}")
        shown = witness if witness is not None else root
        if err and (err.get("folded") or err.get("traceback")):
            text = (err.get("folded") or err["traceback"]).rstrip("\n")
            prefix = f"[rank {shown.rank}] " if self.config.prefix else ""
            _output.say("".join(prefix + line + "\n" for line in text.split("\n")))
        others = [r for r in self.ranks if r is not root and r.proc is not None]
        if others:
            _say("the other ranks:")
            for r in others:
                _say(f"  rank {r.rank} {self._state(r)}")
        for r in self.ranks:
            rerr = r.error()
            if r.log is not None and rerr and rerr.get("traceback"):
                r.log.write(("accord run: this rank's traceback:\n"
                             + rerr["traceback"].rstrip("\n") + "\n").encode())
        if root.signalled and root.returncode < 0:
            return 1  # it had failed before the launcher stopped it
        return exit_status(root.returncode) or 1


def _one_line(err, chars=HEADLINE_CHARS):
    """'Type: first line of the message (at file:line, in f)' from an error record."""
    message = (err.get("message") or "").strip().split("\n", 1)[0]
    if len(message) > chars:
        message = message[:chars - 3] + "..."
    text = err.get("type") or "an error"
    if message:
        text += f": {message}"
    if err.get("where"):
        text += f" (at {err['where']})"
    return text
