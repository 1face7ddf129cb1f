"""`accord doctor`: check that this host can run accord jobs, and say what is wrong.

    accord doctor [--no-health] [--timeout SECONDS]

Reports the host (Python, numpy, CPUs, hostname), /dev/shm (size, free space,
writable, leftover accord segments), the network interfaces and their
addresses, the address and interface a rank here would listen on and why
(ACCORD_SOCKET_IFNAME, or the route to MASTER_ADDR), whether the job's
secret (ACCORD_STORE_TOKEN) and TLS are set, whether a loopback TCP port can
be bound and connected to, whether torch (with gloo) and mpi4py are importable, the kernel's ptrace_scope (which
decides whether one rank may read another's memory directly), GLIBC_TUNABLES,
the ACCORD_* settings, and ends with a health check: two ranks started with
`accord run` do a broadcast and an all_reduce and verify the results.

Every line starts with OK, WARN, FAIL or INFO; the exit status is 1 when any
line is FAIL, else 0.
"""
import argparse
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time

from . import IMPORT_ROOT
from ..netif import ipv4_of, ipv6_addresses

MiB = 1 << 20
SHM = "/dev/shm"
SHM_LOW = 256 * MiB          # less free space than this in /dev/shm is worth a warning
_IFF_UP, _IFF_LOOPBACK = 0x1, 0x8


class Report:
    def __init__(self, out=None):
        self.out = out or sys.stdout
        self.counts = {"OK": 0, "WARN": 0, "FAIL": 0, "INFO": 0}

    def section(self, title):
        self.out.write(f"\n[{title}]\n")
        self.out.flush()

    def line(self, status, text):
        self.counts[status] += 1
        self.out.write(f"  {status:<5} {text}\n")
        self.out.flush()


def _mib(n):
    return f"{n / MiB:.0f} MiB" if n < 10 * 1024 * MiB else f"{n / (1024 * MiB):.1f} GiB"


def _version(name):
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:
        return None


# --------------------------------------------------------------------------- checks

def check_host(r):
    r.section("host")
    import numpy
    from accord import __version__
    r.line("OK", f"python {platform.python_version()} ({sys.executable}), accord {__version__}, "
                 f"numpy {numpy.__version__}")
    r.line("INFO", f"{platform.system()} {platform.release()} {platform.machine()}, "
                   f"{os.cpu_count()} CPUs"
                   + (f", {len(os.sched_getaffinity(0))} usable"
                      if hasattr(os, "sched_getaffinity") else ""))
    name = socket.gethostname()
    try:
        addrs = sorted({ai[4][0] for ai in socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)})
        r.line("OK", f"hostname {name} resolves to {', '.join(addrs)}")
    except OSError as exc:
        r.line("WARN", f"hostname {name} does not resolve ({exc}); other hosts need "
                       "--master-addr / ACCORD_ADDR to reach this one")
    from ..options import Options
    from ..transport.factory import host_identity
    try:
        options = Options.from_env()
    except ValueError:          # a bad ACCORD_* setting: the environment section says which
        return
    ident = host_identity(options)
    r.line("INFO", f"host identity {ident}: ranks with the same one share memory, and "
                   f"groups that span several run hierarchically"
                   + ("" if options.host_id else " (ACCORD_HOST_ID overrides it)"))


def check_shm(r):
    r.section("/dev/shm")
    if not os.path.isdir(SHM):
        r.line("WARN", f"{SHM} does not exist: ranks on this host cannot share memory "
                       "(ACCORD_TRANSPORT=tcp works)")
        return
    st = os.statvfs(SHM)
    total, free = st.f_frsize * st.f_blocks, st.f_frsize * st.f_bavail
    text = f"{SHM}: {_mib(total)} total, {_mib(free)} free"
    if free < SHM_LOW:
        r.line("WARN", text + f" (under {_mib(SHM_LOW)}: large shared-memory arenas may "
                              "not fit; a container's default is often 64 MiB, "
                              "raise it with --shm-size)")
    else:
        r.line("OK", text)
    try:
        with tempfile.NamedTemporaryFile(dir=SHM, prefix="accord-doctor-") as f:
            f.write(b"x" * 4096)
            f.flush()
        r.line("OK", f"{SHM} is writable")
    except OSError as exc:
        r.line("WARN", f"cannot create a file in {SHM}: {exc}")
    try:
        leftovers = [n for n in os.listdir(SHM) if "accord" in n.lower()
                     and not n.startswith("accord-doctor-")]
    except OSError:
        leftovers = []
    if leftovers:
        size = 0
        for n in leftovers:
            try:
                size += os.stat(os.path.join(SHM, n)).st_size
            except OSError:
                pass
        r.line("WARN", f"{len(leftovers)} segment(s) named like accord's in {SHM} "
                       f"({_mib(size)}): {', '.join(sorted(leftovers)[:5])}"
                       + (" ..." if len(leftovers) > 5 else "")
                       + " (left by a job that is still running or was killed?)")


def check_network(r):
    r.section("network")
    try:
        names = [n for _, n in socket.if_nameindex()]
    except OSError as exc:
        r.line("WARN", f"cannot list network interfaces: {exc}")
        names = []
    v6 = ipv6_addresses()
    routable = 0
    for name in names:
        flags, v4 = ipv4_of(name)
        addrs = ([v4] if v4 else []) + v6.get(name, [])
        state = ("" if flags is None else
                 (" up" if flags & _IFF_UP else " DOWN") + (", loopback" if flags & _IFF_LOOPBACK
                                                          else ""))
        if v4 and not v4.startswith("127.") and flags is not None and flags & _IFF_UP:
            routable += 1
        r.line("INFO", f"{name}{(' (' + state.strip() + ')') if state else ''}: "
                       f"{', '.join(addrs) if addrs else 'no address'}")
    if names and not routable:
        r.line("INFO", "no interface with a non-loopback IPv4 address: jobs on this host only")
    check_chosen_interface(r)
    # loopback: bind, listen, connect, one round trip
    try:
        t0 = time.perf_counter()
        with socket.socket() as srv:
            srv.bind(("127.0.0.1", 0))
            srv.listen(1)
            port = srv.getsockname()[1]
            with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
                a, _ = srv.accept()
                with a:
                    c.sendall(b"ping")
                    got = a.recv(4)
                    a.sendall(got)
                    back = c.recv(4)
        if back != b"ping":
            raise OSError("the bytes sent did not come back")
        r.line("OK", f"loopback TCP: bound 127.0.0.1:{port}, connected, round trip "
                     f"({(time.perf_counter() - t0) * 1e3:.1f} ms with set-up)")
    except OSError as exc:
        r.line("FAIL", f"loopback TCP: cannot bind/connect a port on 127.0.0.1: {exc}")
    try:
        with socket.socket() as s:
            s.bind(("0.0.0.0", 0))
            s.listen(1)
        r.line("OK", "a port on all interfaces (0.0.0.0) can be bound (multi-host rendezvous)")
    except OSError as exc:
        r.line("WARN", f"cannot bind a port on 0.0.0.0 ({exc}): other hosts cannot reach a "
                       "store here")


def check_chosen_interface(r, env=None):
    """Say which address (and interface) a rank here would listen on, and why."""
    from ..netif import choose_address, interfaces, store_bind_address
    from ..options import Options
    env = os.environ if env is None else env
    try:
        options = Options.from_env(env)
    except ValueError:          # the environment section says which setting is bad
        return
    master = env.get("MASTER_ADDR", "127.0.0.1")
    try:
        addr, name, why = choose_address(options, master)
        bind = store_bind_address(master, options)
    except ValueError as exc:
        r.line("FAIL", f"{exc}: every rank would refuse to start")
        return
    if name is None:
        name = next((n for n, _, addrs in interfaces() if addr in addrs), "?")
    if options.store_token:
        r.line("OK", "ACCORD_STORE_TOKEN is set: the store and every connection between ranks "
                     "prove it")
    else:
        r.line("INFO", "ACCORD_STORE_TOKEN is not set: `accord run` makes one on one host; "
                       "elsewhere the ranks' connections prove a secret shared through the "
                       "store, which anyone who reaches the store can read")
    r.line("INFO", "TLS: " + (f"on (ACCORD_TLS_CERT={options.tls_cert}, ACCORD_TLS_CA="
                              f"{options.tls_ca})" if options.tls_cert else
                              "off (ACCORD_TLS_CERT/KEY/CA turn it on)"))
    r.line("OK", f"ranks here listen on {addr} (interface {name}): {why}; a store hosted here "
                 f"for MASTER_ADDR {master} listens on {bind}"
                 + ("" if options.socket_ifname or options.addr else
                    " (ACCORD_SOCKET_IFNAME chooses another interface)"))


def _probe(code, timeout):
    """Run Python code in a fresh interpreter; (ok, output)."""
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return False, f"timed out after {timeout:g}s"
    except OSError as exc:
        return False, str(exc)
    text = (p.stdout.strip() or p.stderr.strip().splitlines()[-1:] and
            p.stderr.strip().splitlines()[-1] or "")
    return p.returncode == 0, text


def check_libraries(r, timeout):
    r.section("libraries")
    import importlib.util
    if importlib.util.find_spec("torch") is None:
        r.line("INFO", "torch: not installed (optional: accord works on numpy arrays; "
                       "needed for torch tensors and --compare gloo)")
    else:
        ok, text = _probe("import torch, torch.distributed as d; "
                          "print(torch.__version__, d.is_available() and d.is_gloo_available())",
                          timeout)
        if ok:
            version, gloo = (text.split() + ["?", "?"])[:2]
            r.line("OK", f"torch {version} importable; gloo "
                         f"{'available' if gloo == 'True' else 'NOT available'}")
        else:
            r.line("WARN", f"torch is installed but does not import: {text}")
    if importlib.util.find_spec("mpi4py") is None:
        r.line("INFO", "mpi4py: not installed (optional: only for --compare mpi)")
    else:
        ok, text = _probe("import mpi4py; mpi4py.rc.initialize = False; "
                          "from mpi4py import MPI; "
                          "print(mpi4py.__version__, '|', "
                          "MPI.Get_library_version().strip().splitlines()[0])", timeout)
        if ok:
            version, _, lib = text.partition("|")
            from .bench import find_mpiexec
            mpiexec = find_mpiexec()
            lib = " ".join(lib.split())
            r.line("OK", f"mpi4py {version.strip()} importable ({lib}); mpiexec: "
                         f"{mpiexec or 'not found'}")
        else:
            r.line("WARN", f"mpi4py is installed but does not import: {text}")
    if importlib.util.find_spec("matplotlib") is None:
        r.line("INFO", "matplotlib: not installed (optional: only for accord bench --plot)")
    else:
        r.line("OK", f"matplotlib {_version('matplotlib')} (accord bench --plot)")


def _cma_probe():
    """Can one process read a sibling's memory with process_vm_readv, as ranks would?

    Two children of this process: a holder with a known buffer, and a reader that
    copies it out (siblings, like the ranks of `accord run`). Returns (ok, text).
    """
    import ctypes

    class IoVec(ctypes.Structure):
        _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        readv = libc.process_vm_readv
    except (OSError, AttributeError) as exc:
        return False, f"not available ({exc})"
    readv.restype = ctypes.c_ssize_t
    probe = b"accord-cma-probe"
    remote = ctypes.create_string_buffer(len(probe))
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    holder = os.fork()
    if holder == 0:                                  # fill this copy of the buffer, wait
        try:
            remote.value = probe
            os.write(ready_w, b"x")
            os.read(done_r, 1)
        finally:
            os._exit(0)
    reader = None
    try:
        os.read(ready_r, 1)
        reader = os.fork()
        if reader == 0:                              # read the holder's buffer
            code = 99
            try:
                local = ctypes.create_string_buffer(len(probe))
                liov = IoVec(ctypes.cast(local, ctypes.c_void_p), len(probe))
                riov = IoVec(ctypes.cast(remote, ctypes.c_void_p), len(probe))
                n = readv(holder, ctypes.byref(liov), 1, ctypes.byref(riov), 1, 0)
                code = 0 if n == len(probe) and local.raw == probe else \
                    min(ctypes.get_errno() or 98, 98)
            finally:
                os._exit(code)
        _, status = os.waitpid(reader, 0)
        code = os.waitstatus_to_exitcode(status)
    finally:
        os.write(done_w, b"x")
        os.waitpid(holder, 0)
        for fd in (ready_r, ready_w, done_r, done_w):
            os.close(fd)
    if code == 0:
        return True, "works between sibling processes (single-copy transfers are possible)"
    why = os.strerror(code) if 0 < code < 98 else "wrong bytes or crash"
    return False, (f"refused between sibling processes ({why}): large messages go "
                   "through shared memory in two copies instead")


def check_kernel(r):
    r.section("kernel and environment")
    path = "/proc/sys/kernel/yama/ptrace_scope"
    meaning = {"0": "any process of the same user may read a peer's memory "
                    "(process_vm_readv single-copy works)",
               "1": "restricted to descendants: ranks cannot read each other's memory "
                    "directly unless they allow it (single-copy falls back)",
               "2": "admin only: single-copy between ranks is unavailable",
               "3": "no ptrace at all: single-copy between ranks is unavailable"}
    try:
        with open(path) as f:
            value = f.read().strip()
        r.line("INFO", f"ptrace_scope = {value}: {meaning.get(value, 'unknown value')}")
    except OSError:
        r.line("INFO", f"ptrace_scope: {path} absent (no Yama: same-user ranks may read each "
                       "other's memory)")
    ok, text = _cma_probe()
    r.line("OK" if ok else "INFO",
           f"process_vm_readv: {text}")
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        status = "OK" if soft >= 1024 else "WARN"
        r.line(status, f"open files limit {soft} (hard {hard})"
               + ("" if status == "OK" else ": large jobs need a socket per peer; raise ulimit -n"))
    except (ImportError, OSError, ValueError):
        pass
    from .bench import nt_threshold
    nt = nt_threshold()
    r.line("INFO", f"GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES') or 'unset'}"
                   + (f" (glibc x86_non_temporal_threshold {nt}: copies larger than this "
                      "bypass the cache)" if nt else ""))
    from accord.transport import ring_helper
    r.line("INFO", "shared-memory ring: " + (
        "C helper compiled and in use" if ring_helper.wanted() else
        "C helper compiled, off (ACCORD_RING_HELPER=0): pure-Python path" if ring_helper.built()
        else "pure-Python path (the optional C helper was not built: no C compiler when "
             "accord was installed; reinstall with one to build it)"))
    from accord.transport import split_message
    from accord.transport.tcp import SPIN_BYTES
    from accord.transport.waiting import SPIN_US, usable_cores
    r.line("INFO", f"waiting for a peer: {SPIN_US:.0f} µs of spinning before sleeping, in "
                   f"groups of at most {usable_cores()} ranks on this host (a core each; over "
                   f"TCP for messages up to {SPIN_BYTES >> 10} KiB); no spin in larger groups "
                   f"(shared memory yields the core a few times first)")
    r.line("INFO", "large single-copy messages: " + (
        f"copied by the receiver and the waiting sender together, in groups of at most "
        f"{usable_cores()} ranks on this host (a core each)" if split_message.wanted() else
        "read by the receiver alone (ACCORD_SHM_SPLIT=0)"))
    from accord import localcopy
    mib = localcopy.STREAM_MIN >> 20
    r.line("INFO", "large local copies: " + (
        f"streamed by the C helper from {mib} MiB (and a buffer to or from many tensors "
        f"copied by it; large messages into shared memory streamed where timed faster)"
        if localcopy.helper_on() else
        "numpy's copy (C helper compiled, off: ACCORD_COPY_HELPER=0)" if localcopy.built()
        else "numpy's copy (the optional C helper was not built: no C compiler when accord "
             "was installed)"))
    from accord import halves
    r.line("INFO", "16-bit float reductions: " + (
        "the C helper's one pass (bfloat16" +
        (" and float16)" if halves.f16_in_helper() else "; float16 by numpy: this CPU has "
         "no half conversions the helper uses)") if halves.helped() else
        "numpy (C helper compiled, off: ACCORD_HALF_HELPER=0)" if halves.built()
        else "numpy (the optional C helper was not built: no C compiler when accord was "
             "installed)"))
    accord_vars = {k: v for k, v in sorted(os.environ.items()) if k.startswith("ACCORD_")}
    if accord_vars:
        r.line("INFO", "settings: " + ", ".join(f"{k}={v}" for k, v in accord_vars.items()))
    try:
        from accord.options import Options
        Options.from_env()
        r.line("OK", "ACCORD_* settings are valid" if accord_vars else
                     "no ACCORD_* settings (defaults: ACCORD_TRANSPORT=auto)")
    except (ValueError, TypeError) as exc:
        r.line("FAIL", f"ACCORD_* settings are invalid, every job would fail: {exc}")


# --------------------------------------------------------------------------- health check

HEALTH_MARK = "@@accord-doctor "


def _health_rank():
    """Run inside each rank: broadcast + all_reduce, small and large, verified."""
    import numpy as np
    import accord
    t0 = time.perf_counter()
    accord.init_process_group()
    rank, world = accord.get_rank(), accord.get_world_size()
    # over shared memory where single copy works: from what size it is used (measured
    # now where ACCORD_SHM_CMA is unset)
    t = accord.world.default_group().transport
    cma = t.cma_min if getattr(t, "cma_everywhere", False) else 0
    problems = []
    for n in (1000, 1 << 20):                     # 4 KB and 4 MiB of float32
        x = np.arange(n, dtype=np.float32) if rank == 0 else np.zeros(n, np.float32)
        accord.broadcast(x, src=0)
        if not np.array_equal(x, np.arange(n, dtype=np.float32)):
            problems.append(f"broadcast of {n * 4} bytes")
        y = np.full(n, rank + 1, np.float64)
        accord.all_reduce(y)
        if not (y == world * (world + 1) / 2).all():
            problems.append(f"all_reduce of {n * 8} bytes")
    flags = np.array([len(problems)], np.int64)
    accord.all_reduce(flags)
    accord.destroy_process_group()
    if rank == 0:
        print(HEALTH_MARK + (f"ok {time.perf_counter() - t0:.2f} {cma}" if flags[0] == 0 else
                             "bad " + "; ".join(problems or ["another rank's results"])),
              flush=True)
    if problems:
        sys.stderr.write(f"rank {rank}: wrong result: {'; '.join(problems)}\n")
        return 1
    return 0


def _size(n):
    for unit, k in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k} {unit}"
    return f"{n} bytes"


def health_check(r, transport, timeout):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (IMPORT_ROOT, env.get("PYTHONPATH", ""))
                                        if p)
    env["ACCORD_TRANSPORT"] = transport
    env["ACCORD_TIMEOUT"] = str(max(5, int(timeout) - 5))
    cmd = [sys.executable, "-m", "accord", "run", "--no-prefix", "-n", "2", "-m",
           "accord.cli.doctor", "--health-rank"]
    what = f"2 ranks, ACCORD_TRANSPORT={transport}: broadcast + all_reduce (4 KB, 4 MiB)"
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                           stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        r.line("FAIL", f"{what}: no answer within {timeout:g}s")
        return
    marks = [l[len(HEALTH_MARK):] for l in p.stdout.splitlines() if l.startswith(HEALTH_MARK)]
    if p.returncode == 0 and marks and marks[-1].startswith("ok"):
        r.line("OK", f"{what} verified ({time.monotonic() - t0:.1f}s with start-up)")
        words = marks[-1].split()
        cma = int(words[2]) if len(words) > 2 and words[2].isdigit() else 0
        if cma and cma < 1 << 62:
            how = ("set by ACCORD_SHM_CMA" if os.environ.get("ACCORD_SHM_CMA")
                   else "measured between the two ranks")
            r.line("INFO", f"shared memory sends messages of {_size(cma)} and more "
                           f"single-copy ({how})")
        return
    detail = marks[-1] if marks else ""
    tail = [l for l in (p.stderr or "").strip().splitlines() if l.strip()][-8:]
    r.line("FAIL", f"{what}: " + (detail or f"exit status {p.returncode}"))
    for l in tail:
        r.out.write(f"          | {l}\n")


# --------------------------------------------------------------------------- the command

def add_arguments(parser):
    parser.description = __doc__.split("\n\n")[2].replace("\n", " ")
    parser.add_argument("--no-health", dest="health", action="store_false",
                        help="skip the 2-rank health check")
    parser.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                        help="limit for each probe and health check (default 60)")


def main(args):
    r = Report()
    r.out.write("accord doctor: checks of this host\n")
    check_host(r)
    check_shm(r)
    check_network(r)
    check_libraries(r, args.timeout)
    check_kernel(r)
    if args.health:
        r.section("health check")
        transports = [os.environ.get("ACCORD_TRANSPORT", "").strip().lower() or "auto"]
        if "tcp" not in transports:
            transports.append("tcp")
        for t in transports:
            health_check(r, t, args.timeout)
    c = r.counts
    r.out.write(f"\nsummary: {c['OK']} OK, {c['WARN']} WARN, {c['FAIL']} FAIL"
                + (" - this host is ready for accord\n" if not c["FAIL"] else
                   " - see the FAIL lines above\n"))
    r.out.flush()
    return 1 if c["FAIL"] else 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m accord.cli.doctor")
    ap.add_argument("--health-rank", action="store_true",
                    help="internal: one rank of the health check")
    a = ap.parse_args()
    if a.health_rank:
        sys.exit(_health_rank())
    ns = argparse.Namespace(health=True, timeout=60.0)
    sys.exit(main(ns))
