"""Soak: random collectives and point-to-point for a while, every result checked exactly.

    accord run -n 4 benchmarks/soak.py --duration 600            # shared memory
    ACCORD_TRANSPORT=tcp accord run -n 4 benchmarks/soak.py --duration 600
    python benchmarks/soak.py --faults                          # faults under load

Every rank draws the same random program (one seed): all_reduce, broadcast
from a random root, all_gather, reduce_scatter, all_to_all, a ring of
isend/irecv, an all_reduce on a random subgroup, async all_reduces waited
together; sizes log-uniform from 0 B to --max-bytes (16 MiB), integer dtypes
(and float64 holding integers) so every expected value is exact.

Every --sample-s seconds (5) all ranks meet at a barrier and sample their memory
there, and meet again before they go on, so that no message is in flight and no
array of the soak is alive while they sample: RSS and
its parts (RssAnon: the heaps; RssShmem: pages of /dev/shm arenas touched so
far), what glibc's malloc has handed out and not had back ("malloc_used") and the
free memory it keeps for reuse instead of returning it ("malloc_free"), and the
number of Python objects. Warm-up is the first fifth of the run; a figure's
growth after warm-up is (the median of its samples in the last fifth - the
median in the second fifth) / the latter, per rank, the worst rank reported
(growth(); peak_growth() also counts single high samples). A leak
shows as malloc_used (or the objects) growing; RSS growing with malloc_used flat
is the allocator's free memory (see the README's soak section).

Rank 0 prints one JSON line: ops, ops/s, wrong results, the growths, the load
average, every rank's samples, open file descriptors and threads after warm-up
and at the end, and which of the job's shared-memory arenas are still in
/dev/shm at the end (none over TCP, which makes none). With --json FILE it also
writes that line there. The exit status is 1 when any result was wrong or
something leaked (fds, threads, /dev/shm). --tracemalloc adds where Python
allocations grew after warm-up (slow).

--faults runs each fault scenario under load as a job of its own and prints one
line per scenario: a rank stopped (SIGSTOP) for less than the timeout, and for
longer; a rank SIGKILLed during 64 MiB all_reduces; and, as root, a partition
between two network namespaces that drops every packet (run_fault,
run_partition; tests/test_faults_under_load.py runs the same).
"""
import argparse
import collections
import ctypes
import gc
import json
import os
import sys
import threading
import time
import tracemalloc

import numpy as np

import accord

_DTYPES = (np.int64, np.int32, np.float64, np.uint8)


def _status():
    """VmRSS and its parts (RssAnon: the heaps; RssShmem: mapped /dev/shm pages;
    RssFile: code and libraries), in KiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssShmem", "RssFile"):
                out[key] = int(rest.split()[0])
    return out


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                "usmblks", "fsmblks", "uordblks", "fordblks",
                                                "keepcost")]


_LIBC = []          # [glibc] once loaded: each ctypes.CDLL() makes new classes, which a
                    # sample every few seconds would add to the memory it measures


def _libc():
    if not _LIBC:
        _LIBC.append(ctypes.CDLL(None))
    return _LIBC[0]


def _malloc_kib():
    """(bytes malloc has handed out and not had back, free bytes it holds), in KiB:
    glibc's mallinfo2 over every arena; (None, None) elsewhere."""
    try:
        f = _libc().mallinfo2
    except (OSError, AttributeError):
        return None, None
    f.restype = _MallInfo2
    m = f()
    return (m.uordblks + m.hblkhd) >> 10, m.fordblks >> 10


def set_mmap_threshold(nbytes):
    """glibc: serve every allocation of nbytes or more with its own mmap, returned to the
    system when freed (mallopt M_MMAP_THRESHOLD, as MALLOC_MMAP_THRESHOLD_ does; a fixed
    threshold also stops glibc from raising it to the largest block freed so far, which
    is what lets freed multi-MiB arrays pile up in the heap). False where not glibc."""
    try:
        return bool(_libc().mallopt(-3, int(nbytes)))      # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def _sample(t0):
    st = _status()
    used, free = _malloc_kib()

    return {"t": round(time.monotonic() - t0, 1), "rss": st["VmRSS"], "anon": st.get("RssAnon"),
            "shmem": st.get("RssShmem"), "malloc_used": used, "malloc_free": free,
            "objects": len(gc.get_objects()),
            "traced": tracemalloc.get_traced_memory()[0] >> 10
            if tracemalloc.is_tracing() else None}


def _census():
    """How many Python objects (those the collector tracks) of each type there are."""
    return collections.Counter(type(o).__qualname__ for o in gc.get_objects())


def _census_growth(before, top=8):
    """The types whose count grew most since `before`: ["dict +120", ...]."""
    diff = _census()
    diff.subtract(before)
    return [f"{name} {n:+d}" for name, n in diff.most_common(top) if n > 0]


def _fds():
    return len(os.listdir("/proc/self/fd"))


def _value(dtype, rank, salt):
    # small values: sums over 4 ranks stay exact in every dtype (uint8 included)
    return dtype((rank * 7 + salt) % 50)


def _one_op(rng, rank, world, subgroups, max_bytes):
    """Run one random op; return the number of wrong results it produced."""
    dtype = _DTYPES[rng.integers(len(_DTYPES))]
    item = np.dtype(dtype).itemsize
    nbytes = 0 if rng.random() < 0.05 else int(np.exp(rng.uniform(0, np.log(max_bytes))))
    n = max(0, nbytes // item)
    salt = int(rng.integers(1000))
    op = rng.integers(8)
    vals = [_value(dtype, r, salt) for r in range(world)]
    if op == 0:
        x = np.full(n, vals[rank], dtype)
        accord.all_reduce(x)
        return int(not (x == dtype(sum(int(v) for v in vals))).all())
    if op == 1:
        root = int(rng.integers(world))
        x = np.full(n, vals[rank], dtype)
        accord.broadcast(x, src=root)
        return int(not (x == vals[root]).all())
    if op == 2:
        k = n // world
        outs = [np.empty(k, dtype) for _ in range(world)]
        accord.all_gather(outs, np.full(k, vals[rank], dtype))
        return int(not all((o == vals[r]).all() for r, o in enumerate(outs)))
    if op == 3:
        k = n // world
        out = np.empty(k, dtype)
        accord.reduce_scatter(out, [np.full(k, vals[rank], dtype) for _ in range(world)])
        return int(not (out == dtype(sum(int(v) for v in vals))).all())
    if op == 4:
        k = n // world
        ins = [np.full(k, vals[rank] + r, dtype) for r in range(world)]
        outs = [np.empty(k, dtype) for _ in range(world)]
        accord.all_to_all(outs, ins)
        return int(not all((o == dtype(vals[r] + rank)).all() for r, o in enumerate(outs)))
    if op == 5:
        tag = int(rng.integers(100))
        right, left = (rank + 1) % world, (rank - 1) % world
        got = np.empty(n, dtype)
        works = [accord.irecv(got, src=left, tag=tag),
                 accord.isend(np.full(n, vals[rank], dtype), dst=right, tag=tag)]
        for w in works:
            w.wait()
        return int(not (got == vals[left]).all())
    if op == 6:
        members, g = subgroups[int(rng.integers(len(subgroups)))]
        if rank not in members:
            return 0
        x = np.full(n, vals[rank], dtype)
        accord.all_reduce(x, group=g)
        return int(not (x == dtype(sum(int(vals[r]) for r in members))).all())
    xs = [np.full(max(1, n // 4), vals[rank], dtype) for _ in range(3)]
    works = [accord.all_reduce(x, async_op=True) for x in xs]
    for w in works:
        w.wait()
    want = dtype(sum(int(v) for v in vals))
    return sum(int(not (x == want).all()) for x in xs)


def shm_left(report, settle_s=2.0):
    """The shared-memory arenas of this job's groups still in /dev/shm (every rank
    unlinks its group's name once all have mapped it; waits up to settle_s for
    ranks still leaving). Another job's segments are not counted."""
    paths = sorted({p for e in report["ranks"] for p in e["arenas"]})
    end = time.monotonic() + settle_s
    while True:
        left = [p for p in paths if os.path.exists(p)]
        if not left or time.monotonic() >= end:
            return left
        time.sleep(0.1)


_CONTINUE, _STOP, _SAMPLE, _FAULT = 1, 0, 2, 3
WARM_UP = 0.2          # the first fifth of the run is warm-up (see growth())


def growth(samples, key="rss"):
    """How much `key` grew after warm-up: (median of the samples in the last fifth of
    the run - median of those in the second fifth) / the latter. The first fifth is
    warm-up. Medians, so that one sample taken while something was still alive does
    not count as growth (peak_growth counts it). None with too few samples."""
    import statistics
    if not samples:
        return None
    end = samples[-1]["t"]
    early = [s[key] for s in samples if WARM_UP * end <= s["t"] < 2 * WARM_UP * end]
    late = [s[key] for s in samples if s["t"] >= (1 - WARM_UP) * end]
    if not early or not late or not statistics.median(early):
        return None
    return (statistics.median(late) - statistics.median(early)) / statistics.median(early)


def peak_growth(samples, key="rss"):
    """(largest sample after warm-up - the first sample after warm-up) / the latter."""
    if not samples:
        return None
    end = samples[-1]["t"]
    after = [s for s in samples if s["t"] >= WARM_UP * end]
    if len(after) < 2 or not after[0][key]:
        return None
    return (max(s[key] for s in after) - after[0][key]) / after[0][key]


def _fault(kind, rank, world, stop_s):
    """Inject `kind` on the victim (the last rank), at the same op on every rank."""
    import signal
    import subprocess
    victim = world - 1
    if kind in ("stop-short", "stop-long") and rank == victim:
        subprocess.Popen(["sh", "-c", f"sleep {stop_s}; kill -CONT {os.getpid()}"])
        os.kill(os.getpid(), signal.SIGSTOP)
    elif kind == "kill":
        # 64 MiB all_reduces, the victim SIGKILLed a moment into the first one
        x = np.full(16 << 20, rank + 1, np.float32)
        if rank == victim:
            threading.Timer(0.05, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
        for _ in range(20):
            x[:] = rank + 1
            accord.all_reduce(x)
    elif kind == "partition":
        # benchmarks/soak.py's run_partition drops the packets between the two hosts
        # when every rank has written its mark (the soak goes on meanwhile)
        with open(os.path.join(os.environ["SOAK_MARKS"], f"rank{rank}"), "w") as f:
            f.write(str(time.time()))
        # a rank still running well after every timeout shows where it is stuck
        import faulthandler
        faulthandler.dump_traceback_later(accord.world.default_group().timeout + 20)


def soak(duration, max_bytes=16 << 20, seed=1234, sample_s=5.0, fault=None, fault_at=None,
         stop_s=None):
    """Run the soak in an initialised job for `duration` seconds.

    Returns rank 0's report (every rank's figures gathered), or None on other ranks.
    With `fault` ("stop-short", "stop-long", "kill", "partition") the last rank is
    stopped for `stop_s` seconds, or killed during 64 MiB all_reduces, or cut off,
    `fault_at` seconds in (default: half way); a rank whose op then fails returns
    its own report with "error" (type, message, seconds after the fault) at once,
    as does every rank when nothing failed."""
    rank, world = accord.get_rank(), accord.get_world_size()
    subgroups = [(m, accord.new_group(m)) for m in
                 ([0, 1], list(range(world))[1:], list(range(0, world, 2)))]
    arenas = sorted({getattr(g.transport, "arena_path", "") for g in
                     [accord.world.default_group()] + [g for _, g in subgroups if g is not None]
                     if g.transport is not None} - {""})
    rng = np.random.default_rng(seed)
    ops = wrong = 0
    t0 = time.monotonic()
    fault_at = duration / 2 if fault_at is None else fault_at
    fault_t = None                       # time.time() of the fault on this rank
    next_sample = t0 + sample_s
    flag = np.zeros(1, np.int64)
    samples, fds0, threads0, snap0, census0 = [], None, None, None, None
    error = None
    try:
        while True:
            if ops % 20 == 0:
                if rank == 0:
                    now = time.monotonic()
                    flag[0] = (_STOP if now - t0 >= duration else
                               _FAULT if fault and fault_t is None and now - t0 >= fault_at else
                               _SAMPLE if now >= next_sample else _CONTINUE)
                accord.broadcast(flag, src=0)
                if flag[0] == _STOP:
                    break
                if flag[0] == _SAMPLE:
                    accord.barrier()             # quiescent: nothing in flight anywhere
                    samples.append(_sample(t0))
                    accord.barrier()             # ... until every rank has sampled
                    next_sample = time.monotonic() + sample_s
                    if fds0 is None and samples[-1]["t"] >= WARM_UP * duration:
                        # every group, thread and buffer exists by now
                        fds0, threads0 = _fds(), threading.active_count()
                        census0 = _census()
                        if tracemalloc.is_tracing():
                            snap0 = tracemalloc.take_snapshot()
                if flag[0] == _FAULT:
                    fault_t = time.time()
                    _fault(fault, rank, world, stop_s)
            wrong += _one_op(rng, rank, world, subgroups, max_bytes)
            ops += 1
    except accord.AccordError as e:
        if fault is None:
            raise
        error = [type(e).__name__, str(e),
                 None if fault_t is None else round(time.time() - fault_t, 2), time.time()]
    elapsed = time.monotonic() - t0
    mine = {"rank": rank, "ops": ops, "wrong": wrong, "samples": samples}
    if fault is not None:
        mine.update(fault=fault, fault_time=fault_t, error=error, arenas=arenas)
        return mine
    grown = []
    if snap0 is not None:
        # where Python-visible memory (numpy's buffers included) grew after warm-up
        grown = [f"{st.traceback[0].filename}:{st.traceback[0].lineno} "
                 f"{st.size_diff / 1024:+.0f} KiB ({st.count_diff:+d} blocks)"
                 for st in tracemalloc.take_snapshot().compare_to(snap0, "lineno")[:8]]
    fds1, threads1 = _fds(), threading.active_count()
    objects_grown = [] if census0 is None else _census_growth(census0)
    if fds0 is None:
        fds0, threads0 = fds1, threads1
    for _, g in subgroups:
        if g is not None:
            accord.destroy_process_group(g)
    accord.barrier()
    mine.update(fds=[fds0, fds1], threads=[threads0, threads1], arenas=arenas,
                rss_growth=growth(samples), rss_peak_growth=peak_growth(samples),
                anon_growth=growth(samples, "anon"),
                malloc_used_growth=growth(samples, "malloc_used"),
                malloc_free_growth=growth(samples, "malloc_free"),
                objects_growth=growth(samples, "objects"), objects_grown=objects_grown,
                traced_growth=grown)
    every = [None] * world
    accord.all_gather_object(every, mine)
    if rank != 0:
        return None

    def worst(key):
        vals = [e[key] for e in every if e[key] is not None]
        return round(max(vals), 4) if vals else None
    return {"world": world, "transport": os.environ.get("ACCORD_TRANSPORT", "auto"),
            "seconds": round(elapsed, 1), "ops": ops, "ops_per_s": round(ops / elapsed, 1),
            "wrong": sum(e["wrong"] for e in every),
            "warm_up": f"the first {WARM_UP:.0%} of the run",
            "rss_growth_after_warmup": worst("rss_growth"),
            "rss_peak_growth_after_warmup": worst("rss_peak_growth"),
            "anon_growth_after_warmup": worst("anon_growth"),
            "malloc_used_growth_after_warmup": worst("malloc_used_growth"),
            "malloc_free_growth_after_warmup": worst("malloc_free_growth"),
            "objects_growth_after_warmup": worst("objects_growth"),
            "loadavg": os.getloadavg(), "ranks": every}


# -- faults under load, each in a job of its own ---------------------------------------

VICTIM_OF = {"stop-short": 3, "stop-long": 3, "kill": 3}
_FAULT_ENV = {"ACCORD_STORE_TOKEN": "soak-fault-secret"}


def _rank_reports(prefix, world):
    out = {}
    for r in range(world):
        try:
            with open(f"{prefix}.rank{r}") as f:
                out[r] = json.loads(f.read())
        except (OSError, ValueError):
            pass
    return out


def _processes_of(marker):
    """pids whose command line holds `marker` (this job's report prefix)."""
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        pids.append(int(d))
            except OSError:
                pass
    return pids


def _stop(procs):
    import signal
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
        p.wait()


def run_fault(kind, transport="shm", timeout=5.0, workdir=None):
    """Run one fault scenario under load as a job of its own (`accord run -n 4
    --keep-going soak.py --fault KIND`): the soak runs 2 s, then the last rank is
    stopped for 2 s (stop-short, ACCORD_TIMEOUT 20), stopped for timeout + 8 s
    (stop-long, ACCORD_TIMEOUT=timeout) or SIGKILLed 50 ms into 64 MiB all_reduces
    (kill). Returns the report: every rank's outcome, what is left in /dev/shm and
    which processes of the job outlived it, and `problems` (empty when the job
    behaved as it must)."""
    import subprocess
    import tempfile
    workdir = workdir or tempfile.mkdtemp(prefix="soak-fault-")
    prefix = os.path.join(workdir, f"{kind}-{transport}-{os.getpid()}-{time.time_ns()}")
    env_timeout = 20.0 if kind == "stop-short" else 30.0 if kind == "kill" else timeout
    stop_s = {"stop-short": 2.0, "stop-long": timeout + 8}.get(kind)
    duration = 6.0 if kind == "stop-short" else 60.0
    cmd = [sys.executable, "-m", "accord", "run", "-n", "4", "--keep-going",
           os.path.abspath(__file__), "--fault", kind, "--duration", str(duration),
           "--fault-at", "2", "--max-bytes", str(4 << 20), "--json", prefix]
    if stop_s:
        cmd += ["--stop-s", str(stop_s)]
    env = dict(os.environ, ACCORD_TRANSPORT=transport, ACCORD_TIMEOUT=str(env_timeout),
               **_FAULT_ENV)
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         start_new_session=True)
    try:
        output = p.communicate(timeout=duration + env_timeout + 60)[0].decode(errors="replace")
    except subprocess.TimeoutExpired:
        _stop([p])
        output = "(the job did not end in time)"
    time.sleep(0.5)
    ranks = _rank_reports(prefix, 4)
    report = {"fault": kind, "transport": transport, "timeout_s": env_timeout,
              "stop_s": stop_s, "ranks": ranks,
              "shm_left": shm_left({"ranks": list(ranks.values())}),
              "processes_left": _processes_of(prefix)}
    report["problems"] = _problems(report, output)
    return report


def _problems(report, output):
    kind, ranks, victim = report["fault"], report["ranks"], 3
    problems = []
    others = [r for r in range(4) if r != victim]
    if kind == "stop-short":
        for r in range(4):
            e = ranks.get(r)
            if e is None or e["error"] is not None or e["wrong"]:
                problems.append(f"rank {r}: {e}")
    else:
        want = "CommTimeout" if kind == "stop-long" else "PeerLost"
        limit = report["timeout_s"] + 5 if kind == "stop-long" else 5.0
        for r in others:
            e = ranks.get(r)
            err = e and e["error"]
            if not err or err[0] != want or f"rank {victim}" not in err[1] or err[2] > limit:
                problems.append(f"rank {r}: wanted {want} naming rank {victim} within "
                                f"{limit:g} s of the fault, got {err or e}")
        if kind == "kill" and victim in ranks:
            problems.append("the killed rank reported")
    if report["shm_left"]:
        problems.append(f"left in /dev/shm: {report['shm_left']}")
    if report["processes_left"]:
        problems.append(f"processes left: {report['processes_left']}")
    if problems:
        problems.append("job output:\n" + output[-12000:])
    return problems


def _sh(*cmd):
    import subprocess
    return subprocess.run(cmd, capture_output=True, text=True, timeout=20)


def _build_two_hosts(tag):
    """Two network namespaces joined by a veth pair; returns ((ns, addr, dev), ...) or
    raises RuntimeError saying which step this machine refused."""
    import random
    net = f"10.{random.randint(100, 250)}.{random.randint(1, 250)}"
    a, b = f"{tag}a", f"{tag}b"
    steps = [["ip", "netns", "add", a], ["ip", "netns", "add", b],
             ["ip", "link", "add", f"{tag}va", "type", "veth", "peer", "name", f"{tag}vb"],
             ["ip", "link", "set", f"{tag}va", "netns", a],
             ["ip", "link", "set", f"{tag}vb", "netns", b],
             ["ip", "-n", a, "addr", "add", f"{net}.1/24", "dev", f"{tag}va"],
             ["ip", "-n", b, "addr", "add", f"{net}.2/24", "dev", f"{tag}vb"],
             ["ip", "-n", a, "link", "set", f"{tag}va", "up"],
             ["ip", "-n", b, "link", "set", f"{tag}vb", "up"],
             ["ip", "-n", a, "link", "set", "lo", "up"], ["ip", "-n", b, "link", "set", "lo", "up"]]
    for cmd in steps:
        res = _sh(*cmd)
        if res.returncode != 0:
            raise RuntimeError(f"cannot build network namespaces here: {' '.join(cmd)}: "
                               f"{res.stderr.strip()}")
    return (a, f"{net}.1", f"{tag}va"), (b, f"{net}.2", f"{tag}vb")


def _remove_namespace(ns):
    import signal
    res = _sh("ip", "netns", "pids", ns)
    for pid in res.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (OSError, ValueError):
            pass
    _sh("ip", "netns", "del", ns)


def partition_unavailable():
    """Why run_partition cannot run on this machine, or None."""
    import shutil
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"no {tool} command"
    return None


def run_partition(timeout=5.0, workdir=None):
    """A network partition under load: two hosts (network namespaces joined by a veth
    pair, ranks 0-1 on one, 2-3 on the other, TCP between every pair), the soak runs,
    then every packet between the hosts is dropped, not refused: a `pfifo limit 0`
    queue on both ends of the veth (no reset, no ICMP: as a cut cable or a firewall
    that drops). Every rank must raise an accord error naming a rank of the other host
    within ACCORD_TIMEOUT=timeout + 5 s. Returns the report, as run_fault's."""
    import subprocess
    import tempfile
    import random
    why = partition_unavailable()
    if why:
        return {"fault": "partition", "skipped": why, "problems": []}
    workdir = workdir or tempfile.mkdtemp(prefix="soak-partition-")
    marks = tempfile.mkdtemp(prefix="marks-", dir=workdir)
    prefix = os.path.join(workdir, f"partition-{os.getpid()}-{time.time_ns()}")
    tag = f"sp{os.getpid() % 100000}"
    hosts = []
    procs = []
    try:
        try:
            hosts = _build_two_hosts(tag)
        except RuntimeError as e:
            return {"fault": "partition", "skipped": str(e), "problems": []}
        (ns_a, addr_a, _), _ = hosts
        port = str(random.randint(20000, 40000))
        for node, (ns, _, _) in enumerate(hosts):
            env = dict(os.environ, ACCORD_TIMEOUT=str(timeout), ACCORD_TRANSPORT="tcp",
                       ACCORD_HOST_ID=ns, SOAK_MARKS=marks, **_FAULT_ENV)
            procs.append(subprocess.Popen(
                ["ip", "netns", "exec", ns, sys.executable, "-m", "accord", "run", "--nnodes",
                 "2", "--node-rank", str(node), "--master-addr", addr_a, "--master-port", port,
                 "-n", "2", "--keep-going", os.path.abspath(__file__), "--fault", "partition",
                 "--duration", "120", "--fault-at", "2", "--max-bytes", str(4 << 20),
                 "--json", prefix],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                start_new_session=True))
        deadline = time.monotonic() + 60
        while len(os.listdir(marks)) < 4 and time.monotonic() < deadline and \
                all(p.poll() is None for p in procs):
            time.sleep(0.1)
        if len(os.listdir(marks)) < 4:
            _stop(procs)
            out = b"".join(p.stdout.read() for p in procs).decode(errors="replace")
            return {"fault": "partition", "problems": [f"the job did not start: {out[-3000:]}"]}
        time.sleep(0.5)                        # under load: the soak goes on a moment
        for ns, _, dev in hosts:
            res = _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "pfifo", "limit", "0")
            if res.returncode != 0:
                _stop(procs)
                return {"fault": "partition", "skipped": f"cannot drop packets here: "
                        f"{res.stderr.strip()}", "problems": []}
        t_drop = time.time()
        deadline = time.monotonic() + timeout + 30
        while len(_rank_reports(prefix, 4)) < 4 and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        _stop(procs)
        for ns, _, _ in hosts:
            _remove_namespace(ns)
    output = b"".join(p.stdout.read() for p in procs).decode(errors="replace")
    ranks = _rank_reports(prefix, 4)
    report = {"fault": "partition", "transport": "tcp", "timeout_s": timeout, "ranks": ranks,
              "error_after_drop_s": {r: round(e["error"][3] - t_drop, 2)
                                     for r, e in ranks.items() if e.get("error")},
              "processes_left": _processes_of(prefix)}
    problems = [f"rank {r}: {why}" for r, why in blame_problems(ranks, t_drop, timeout).items()]
    if report["processes_left"]:
        problems.append(f"processes left: {report['processes_left']}")
    if problems:
        problems.append("job output:\n" + output[-12000:])
    report["problems"] = problems
    return report


def waited_on(message, rank=None):
    """The rank a CommTimeout says `rank` was waiting for, or None.

    Where the error carries the stuck-rank table, that rank's own line says whom it
    waited on ("(on rank N)"). Otherwise a rank's own error names whom it waited for
    data from (or, if none, whom it waited to send to: a send blocked across a cut
    names the other side too); an error another rank reported to it (the text starts
    with that rank) names the reporter, whose own error says the rest. A point-to-point
    timeout names the peer it expected a message from (or whose message stopped
    arriving half way), or that did not take one."""
    import re
    if rank is not None:
        m = re.search(rf"^\s*rank {rank}: waiting in .*\(on rank (\d+)\)", message, re.M)
        if m:
            return int(m.group(1))
        m = re.match(r"rank (\d+):", message)
        if m and int(m.group(1)) != rank:
            return int(m.group(1))
    m = (re.search(r"waiting for data from rank (\d+)", message)
         or re.search(r"waiting to send to rank (\d+)", message)
         # point to point: an irecv or isend of the soak's ring that timed out
         or re.search(r"no message with tag -?\d+ arrived from rank (\d+)", message)
         or re.search(r"the message from rank (\d+) stopped arriving", message)
         or re.search(r"rank (\d+) did not take the message", message))
    return int(m.group(1)) if m else None


def blame_problems(ranks, t_drop, timeout):
    """What is wrong with the ranks' errors after a partition between ranks {0, 1} and
    {2, 3}: {rank: why}. Every rank must raise an accord error within timeout + 5 s
    of the drop; a rank that waited for data across the cut names the rank on the
    other side; one that waited on a rank of its own side (a ring's neighbour, itself
    waiting across) names that one, and following who waited on whom from any rank
    must reach the other side."""
    side = {0: 0, 1: 0, 2: 1, 3: 1}
    on = {}
    problems = {}
    for r in range(4):
        err = (ranks.get(r) or {}).get("error")
        if not err:
            problems[r] = f"no error (report: {ranks.get(r)})"
            continue
        if err[3] - t_drop > timeout + 5:
            problems[r] = f"its error came {err[3] - t_drop:.1f} s after the drop: {err[:2]}"
        on[r] = waited_on(err[1], r)
        if on[r] is None and not any(f"rank {o}" in err[1] for o in side if side[o] != side[r]):
            problems[r] = f"its error names no rank of the other side: {err[:2]}"
    for r, peer in on.items():
        seen, cur = {r}, peer
        while cur is not None and side[cur] == side[r] and cur not in seen:
            seen.add(cur)
            cur = on.get(cur)
        if peer is not None and (cur is None or side[cur] == side[r]):
            problems.setdefault(r, f"it waited on rank {peer}, and who waited on whom from "
                                   f"there never reaches the other side ({on})")
    return problems


def run_faults(transports=("shm", "tcp"), timeout=5.0):
    """Every fault scenario: run_fault for each kind and transport, and run_partition."""
    out = [run_fault(kind, t, timeout) for kind in ("stop-short", "stop-long", "kill")
           for t in transports]
    return out + [run_partition(timeout)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=60.0, help="seconds (default 60)")
    p.add_argument("--max-bytes", type=int, default=16 << 20, help="largest message (16 MiB)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", default=None,
                   help="also write rank 0's report here (with --fault: each rank's to "
                        "JSON.rankN)")
    p.add_argument("--sample-s", type=float, default=5.0, help="seconds between samples")
    p.add_argument("--malloc-mmap-threshold", type=int, default=None, metavar="BYTES",
                   help="glibc: give allocations of BYTES or more their own mmap (see "
                        "set_mmap_threshold); default: glibc's own dynamic threshold")
    p.add_argument("--tracemalloc", action="store_true",
                   help="trace Python allocations (slow): report where they grew after warm-up")
    p.add_argument("--faults", action="store_true",
                   help="run every fault scenario under load, each as a job of its own "
                        "(world 4, shm and tcp; the partition needs root), and print a report")
    p.add_argument("--fault", choices=("stop-short", "stop-long", "kill", "partition"),
                   default=None,
                   help="half way, stop the last rank (SIGSTOP) for --stop-s seconds, or "
                        "SIGKILL it during 64 MiB all_reduces; every rank prints its outcome")
    p.add_argument("--fault-at", type=float, default=None,
                   help="seconds into the run for --fault (default: half way)")
    p.add_argument("--stop-s", type=float, default=None,
                   help="how long --fault stop-* stops the rank")
    args = p.parse_args(argv)
    if args.faults:
        reports = run_faults()
        for r in reports:
            brief = {k: v for k, v in r.items() if k not in ("ranks", "problems")}
            brief["errors"] = {k: (e.get("error") or [None])[0:3]
                               for k, e in r.get("ranks", {}).items()}
            print(json.dumps(brief))
            for line in r["problems"]:
                print("  PROBLEM:", line)
        return 1 if any(r["problems"] for r in reports) else 0
    if args.tracemalloc:
        tracemalloc.start()
    if args.malloc_mmap_threshold is not None and not set_mmap_threshold(
            args.malloc_mmap_threshold):
        print("--malloc-mmap-threshold: not glibc's malloc here", file=sys.stderr)
        return 2
    accord.init_process_group()
    report = soak(args.duration, args.max_bytes, args.seed, args.sample_s, fault=args.fault,
                  fault_at=args.fault_at, stop_s=args.stop_s)
    if args.fault:
        line = json.dumps({k: report[k] for k in ("rank", "ops", "wrong", "fault", "error",
                                                  "arenas")})
        print(line, flush=True)
        if args.json:
            with open(f"{args.json}.rank{report['rank']}", "w") as f:
                f.write(line + "\n")
        try:
            accord.destroy_process_group()
        except accord.AccordError:
            pass
        return 0
    accord.destroy_process_group()
    if report is None:
        return 0
    report["shm_left"] = shm_left(report)
    report["malloc_mmap_threshold"] = args.malloc_mmap_threshold
    leaks = [e for e in report["ranks"] if e["fds"][0] != e["fds"][1]
             or e["threads"][0] != e["threads"][1]]
    report["leaks"] = bool(leaks)
    line = json.dumps(report)
    print(line, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            f.write(line + "\n")
    return 1 if report["wrong"] or report["shm_left"] or leaks else 0


if __name__ == "__main__":
    sys.exit(main())
