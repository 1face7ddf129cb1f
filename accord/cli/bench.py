"""`accord bench`: time accord's collectives and point-to-point, side by side with gloo and MPI.

    accord bench -n 2 --ops broadcast,all_gather,scatter,all_reduce,pingpong,p2p_bw,halo \\
                 --sizes 8,1K,64K,1M,16M,64M [--compare gloo,mpi] [--csv out.csv] [--plot out.png]

For every world size (-n 2,4 gives one table each) the ranks of every library are
started here: accord's and gloo's by `accord run` (gloo rendezvous with env:// on
loopback, GLOO_SOCKET_IFNAME=lo), MPI's by the mpiexec next to this Python (mpi4py +
MPICH), each library only where it is installed. Every rank runs
accord.cli.bench_worker, which times every op the same way: warm-up, then timed blocks
of ops each preceded by a barrier, the max over ranks of each block, the median
block; busbw with nccl-tests' factors. A barrier row gives barrier latency. Two
point-to-point ops, between ranks 0 and 1, are the OSU benchmarks'
(accord.cli.bench_p2p): pingpong is osu_latency (half a blocking round trip), p2p_bw is
osu_bw (a window of isends matched by irecvs, then an ack; bytes one way per
second); halo is a simulation's boundary exchange on every rank (irecv from both
neighbours of a ring, isend to both, wait for all; one step's time).
"""
import csv
import importlib.util
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from . import IMPORT_ROOT
from .bench_p2p import P2P_OPS
from .bench_worker import ALL_OPS, OPS, PREFIX, algbw_bytes, bus_factor

DEFAULT_SIZES = "8,1K,64K,1M,16M,64M"
QUICK_SIZES = "8,1K,64K"
LIB_NAMES = {"gloo": "gloo", "mpi": "mpi", "mpich": "mpi"}
CSV_FIELDS = ["lib", "world", "op", "size_bytes", "lat_us", "algbw_GBps", "busbw_GBps",
              "op_p50_us", "blk_min_us", "iters", "blocks", "verified", "transport",
              "glibc_tunables", "repeats", "peak_rss_MiB", "msgs_per_iter"]
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20,
          "MB": 1 << 20, "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


# --------------------------------------------------------------------------- arguments

def parse_size(text):
    """'8' -> 8, '1K' -> 1024, '64M' / '64MiB' -> 64 MiB (binary units)."""
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"bad size {text!r} (examples: 8, 1K, 64K, 1M, 64M)")
    size = int(m.group(1)) * _UNITS[m.group(2).upper()]
    if size < 4 or size % 4:
        raise ValueError(f"size {text!r} must be a positive multiple of 4 bytes "
                         "(each rank's tensor is float32)")
    return size


def fmt_size(n):
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def _int_list(text, what):
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{what} must be integers separated by commas, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"{what} must be positive integers, got {text!r}")
    return values


def add_arguments(parser):
    parser.usage = ("accord bench [-n N[,N...]] [--ops OPS] [--sizes SIZES] "
                    "[--compare gloo,mpi] [--csv FILE] [--plot FILE.png] [--quick]")
    parser.description = __doc__.split("\n\n")[2].replace("\n", " ")
    parser.add_argument("-n", "--nproc", "--world", dest="worlds", default="2", metavar="N[,N..]",
                        help="ranks per run; several world sizes give one table each "
                             "(default 2)")
    parser.add_argument("--ops", default=",".join(OPS),
                        help=f"ops to time, of {', '.join(ALL_OPS)} (default "
                             f"{','.join(OPS)}; reduce_scatter is reduce_scatter_tensor, "
                             "each rank's output block SIZE bytes; all_to_all is "
                             "all_to_all_single, SIZE bytes from each rank to each; "
                             "pingpong and p2p_bw "
                             "are point-to-point between ranks 0 and 1; halo is "
                             "every rank's exchange with both neighbours of a ring)")
    parser.add_argument("--sizes", default=None,
                        help=f"bytes of each rank's float32 tensor, K/M/G binary units "
                             f"(default {DEFAULT_SIZES}; {QUICK_SIZES} with --quick)")
    parser.add_argument("--compare", default="", metavar="gloo,mpi",
                        help="also run these libraries in the same invocation, where installed")
    parser.add_argument("--no-barrier", dest="barrier", action="store_false",
                        help="skip the barrier-latency row")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: small sizes, 2 warm-up ops and 3 blocks of 5 ops")
    parser.add_argument("--transport", choices=("auto", "shm", "tcp"), default=None,
                        help="ACCORD_TRANSPORT for accord's ranks (default: inherited, "
                             "else auto)")
    parser.add_argument("--glibc-tunables", default=None, metavar="TUNABLES",
                        help="GLIBC_TUNABLES for every rank of every library, e.g. "
                             "glibc.cpu.x86_non_temporal_threshold=0x1000000 "
                             "(default: inherited)")
    parser.add_argument("--csv", default=None, metavar="FILE", help="write every row here")
    parser.add_argument("--plot", default=None, metavar="FILE.png",
                        help="write a PNG of busbw and latency against size (needs matplotlib: "
                             "pip install 'accord[plot]')")
    parser.add_argument("--markdown", default=None, metavar="FILE.md",
                        help="write the tables as markdown, with the command and settings")
    parser.add_argument("--repeat", type=int, default=1, metavar="R",
                        help="run every library R times, interleaved (accord, gloo, mpi, "
                             "accord, ...), and report each row's median: fairer on a busy "
                             "machine (default 1)")
    parser.add_argument("--timeout", type=float, default=900.0, metavar="SECONDS",
                        help="give up on one library's run after this long (default 900)")


# --------------------------------------------------------------------------- settings

def _version(dist_name):
    try:
        from importlib.metadata import version
        return version(dist_name)
    except Exception:
        return None


def find_mpiexec():
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.access(here, os.X_OK):
        return here
    return shutil.which("mpiexec")


def nt_threshold():
    """glibc's effective x86_non_temporal_threshold in this process tree, or None."""
    for ld in ("/lib64/ld-linux-x86-64.so.2", "/lib/ld-linux-aarch64.so.1"):
        if not os.path.exists(ld):
            continue
        try:
            out = subprocess.run([ld, "--list-tunables"], capture_output=True, text=True,
                                 timeout=5).stdout
        except (OSError, subprocess.SubprocessError):
            return None
        m = re.search(r"x86_non_temporal_threshold:\s*(\S+)", out)
        return m.group(1) if m else None
    return None


def glibc_setting(env):
    value = env.get("GLIBC_TUNABLES")
    return value if value else "unset"


class Settings:
    """Everything a run needs, parsed and checked."""

    def __init__(self, args):
        self.worlds = _int_list(args.worlds, "-n")
        asked = [o.strip() for o in args.ops.split(",") if o.strip()]
        bad = [o for o in asked if o not in ALL_OPS]
        # always in the canonical order: each op's result check knows what the ops before
        # it leave in the shared buffers (a broadcast first, then all_gather sends it)
        self.ops = [o for o in ALL_OPS if o in asked]
        if bad or not self.ops:
            raise ValueError(f"--ops: unknown {', '.join(bad) or '(none given)'}; "
                             f"choose from {', '.join(ALL_OPS)}")
        p2p = [o for o in self.ops if o in P2P_OPS]
        if p2p and min(self.worlds) < 2:
            raise ValueError(f"--ops {','.join(p2p)}: point-to-point needs -n 2 or more")
        sizes = args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)
        self.sizes = sorted({parse_size(s) for s in sizes.split(",") if s.strip()})
        if not self.sizes:
            raise ValueError("--sizes: no size given")
        self.quick = args.quick
        self.barrier = args.barrier
        self.compare = []
        for name in (c.strip().lower() for c in args.compare.split(",") if c.strip()):
            if name not in LIB_NAMES:
                raise ValueError(f"--compare: unknown library {name!r} (choose from gloo, mpi)")
            if LIB_NAMES[name] not in self.compare:
                self.compare.append(LIB_NAMES[name])
        if args.timeout <= 0:
            raise ValueError("--timeout must be positive")
        self.timeout = args.timeout
        if args.repeat < 1:
            raise ValueError("--repeat must be at least 1")
        self.repeat = args.repeat
        self.env = dict(os.environ)
        if args.transport:
            self.env["ACCORD_TRANSPORT"] = args.transport
        if args.glibc_tunables is not None:
            if args.glibc_tunables:
                self.env["GLIBC_TUNABLES"] = args.glibc_tunables
            else:
                self.env.pop("GLIBC_TUNABLES", None)
        # the ranks import the same accord as this process
        self.env["PYTHONPATH"] = os.pathsep.join(
            p for p in (IMPORT_ROOT, self.env.get("PYTHONPATH", "")) if p)
        self.transport = self.env.get("ACCORD_TRANSPORT", "") or "auto"
        self.glibc = glibc_setting(self.env)
        self.csv, self.plot, self.markdown = args.csv, args.plot, args.markdown

    def worker_args(self, lib):
        out = ["--lib", lib, "--ops", ",".join(self.ops),
               "--sizes", ",".join(str(s) for s in self.sizes)]
        if self.quick:
            out.append("--quick")
        if not self.barrier:
            out.append("--no-barrier")
        return out


def availability(lib):
    """None when the library can run here, else why not."""
    if lib == "accord":
        return None
    if lib == "gloo":
        if importlib.util.find_spec("torch") is None:
            return "torch is not installed"
        return None
    if lib == "mpi":
        if importlib.util.find_spec("mpi4py") is None:
            return "mpi4py is not installed"
        if find_mpiexec() is None:
            return "no mpiexec found (next to this Python or on PATH)"
        return None
    return f"unknown library {lib}"


def _source():
    """' at commit abc1234' (+ ', with uncommitted changes') when accord runs from a git tree."""
    if os.environ.get("ACCORD_BENCH_SOURCE"):          # e.g. a copy made with git archive
        return " " + os.environ["ACCORD_BENCH_SOURCE"]
    root = IMPORT_ROOT
    if not os.path.exists(os.path.join(root, ".git")):
        return ""
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--", "accord"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    if not head:
        return ""
    return f" at commit {head}" + (", with uncommitted changes in accord/" if dirty else "")


def describe_lib(lib, settings):
    if lib == "accord":
        return (f"accord {_version('accord') or ''}{_source()} "
                f"(ACCORD_TRANSPORT={settings.transport})")
    if lib == "gloo":
        ifname = settings.env.get("GLOO_SOCKET_IFNAME", "lo")
        return f"torch {_version('torch')} gloo (GLOO_SOCKET_IFNAME={ifname})"
    if lib == "mpi":
        mpi = _version("mpich")
        return (f"mpi4py {_version('mpi4py')}" + (f" + MPICH {mpi}" if mpi else "")
                + f" ({find_mpiexec()})")
    return lib


# --------------------------------------------------------------------------- progress

class Progress:
    """One line on stderr: overwritten in place on a terminal, one line per step otherwise."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.shown = False

    def show(self, text):
        if self.tty:
            self.stream.write("\r\033[K" + text)
            self.shown = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def clear(self):
        if self.tty and self.shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self.shown = False

    def say(self, text):
        """A lasting message (not overwritten)."""
        self.clear()
        self.stream.write(f"accord bench: {text}\n")
        self.stream.flush()


# --------------------------------------------------------------------------- running a library

class LibFailed(Exception):
    pass


def _command(lib, world, settings):
    worker = settings.worker_args(lib)
    if lib == "mpi":
        return [find_mpiexec(), "-n", str(world), sys.executable, "-m", "accord.cli.bench_worker",
                *worker]
    # --no-prefix: the driver reads the workers' PREFIX lines from the start of each line
    return [sys.executable, "-m", "accord", "run", "--no-prefix", "-n", str(world), "-m",
            "accord.cli.bench_worker", *worker]


def _env(lib, settings):
    env = dict(settings.env)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    # a hung collective ends in an error well before the driver gives up
    env["ACCORD_BENCH_TIMEOUT"] = str(int(max(30, settings.timeout - 10)))
    if lib == "accord":
        env.setdefault("ACCORD_TIMEOUT", str(int(max(30, settings.timeout - 10))))
    if lib == "gloo":
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


def _stop(proc):
    """SIGTERM the run's process group (the launcher forwards it), then SIGKILL."""
    for signum, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            pass


def run_lib(lib, world, settings, progress, label=None):
    """Run one library at one world size; return its rows (dicts)."""
    cmd = _command(lib, world, settings)
    steps = len(settings.sizes) * len(settings.ops) + (1 if settings.barrier else 0)
    rows, other, facts = [], [], {}
    label = label or {"mpi": "mpich"}.get(lib, lib)
    started = time.monotonic()
    with tempfile.TemporaryFile(mode="w+") as err:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=err, env=_env(lib, settings), text=True,
                                start_new_session=True)
        lines = queue.SimpleQueue()

        def pump():
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)
        threading.Thread(target=pump, daemon=True).start()
        deadline = started + settings.timeout
        step, done, eof = 0, False, False
        current = "starting"
        try:
            while not eof:
                now = time.monotonic()
                if now > deadline:
                    raise LibFailed(f"no result within --timeout {settings.timeout:g}s "
                                    f"(was running: {current})")
                try:
                    line = lines.get(timeout=0.5)
                except queue.Empty:
                    if progress.tty:
                        progress.show(f"[world {world}] {label}: {current} "
                                      f"({step}/{steps}, {now - started:.0f}s)")
                    continue
                if line is None:
                    eof = True
                    continue
                if not line.startswith(PREFIX):
                    other.append(line.rstrip("\n"))
                    continue
                msg = json.loads(line[len(PREFIX):])
                if "progress" in msg:
                    current = _pretty(msg["progress"])
                    if current.startswith("allocating"):
                        if not progress.tty:
                            continue
                    else:
                        step += 1
                    progress.show(f"[world {world}] {label}: {current} "
                                  f"({step}/{steps}, {time.monotonic() - started:.0f}s)")
                elif "facts" in msg:
                    facts = msg["facts"]
                elif "row" in msg:
                    r = msg["row"]
                    r.update(facts)
                    r["transport"] = {"accord": settings.transport, "gloo": "tcp"}.get(lib, "")
                    r["glibc_tunables"] = settings.glibc
                    r["repeats"] = 1
                    rows.append(r)
                elif msg.get("done"):
                    done = True
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise LibFailed(f"did not exit within --timeout {settings.timeout:g}s") from None
        except BaseException:
            _stop(proc)
            raise
        finally:
            progress.clear()
            if proc.poll() is None:
                _stop(proc)
        if proc.returncode != 0 or not done:
            err.seek(0)
            tail = (other + err.read().splitlines())[-25:]
            raise LibFailed(f"exited with status {proc.returncode}"
                            + ("" if done else " before finishing")
                            + (":\n    " + "\n    ".join(tail) if tail else ""))
    return rows


def _pretty(text):
    m = re.fullmatch(r"(.*?)(\d+) B", text)
    return f"{m.group(1)}{fmt_size(int(m.group(2)))}" if m else text


# --------------------------------------------------------------------------- reporting

def _f(value, digits):
    return "-" if value is None else f"{value:.{digits}f}"


def _ratio(a, b):
    if a is None or b is None or not b:
        return None
    return a / b


def _fr(r):
    """A ratio with two decimals; below 0.01 two significant digits (0.0041x), so that a
    row hundreds of times faster does not read 0.00x."""
    if r is None:
        return "-"
    if 0 < r < 0.01:
        return f"{r:.2g}x"
    return f"{r:.2f}x" if r < 100 else f"{r:.0f}x"


def _order(rows, settings):
    """Row keys (op, size) in display order: the barrier after the smallest size's rows."""
    keys = []
    for size in settings.sizes:
        keys += [(op, size) for op in settings.ops]
        if size == settings.sizes[0] and settings.barrier:
            keys.append(("barrier", 0))
    present = {(r["op"], r["size_bytes"]) for r in rows}
    return [k for k in keys if k in present]


def table_rows(rows, world, libs, settings, markdown=False):
    """(header, lines) of one world size's table; each line a list of cells."""
    by = {(r["lib"], r["op"], r["size_bytes"]): r for r in rows if r["world"] == world}
    names = [_lib_label(l, rows) for l in libs]
    others = names[1:] if names and names[0] == "accord" else []
    header = ["op", "size"]
    for n in names:
        header += [f"{n} lat us"] + ([] if markdown else [f"{n} algbw"]) + [f"{n} busbw"]
    for o in others:
        header += [f"lat accord/{o}", f"busbw accord/{o}"]
    lines = []
    for op, size in _order([r for r in rows if r["world"] == world], settings):
        cells = [op, "-" if op == "barrier" else fmt_size(size)]
        for n in names:
            r = by.get((n, op, size))
            if r is None:
                cells += ["-"] + ([] if markdown else ["-"]) + ["-"]
                continue
            mark = "" if r.get("verified", True) else " (WRONG)"
            cells += [_f(r["lat_us"], 1) + mark] + \
                ([] if markdown else [_f(r["algbw_GBps"], 3)]) + [_f(r["busbw_GBps"], 3)]
        a = by.get(("accord", op, size))
        for o in others:
            r = by.get((o, op, size))
            cells += [_fr(_ratio(a and a["lat_us"], r and r["lat_us"])),
                      _fr(_ratio(a and a["busbw_GBps"], r and r["busbw_GBps"]))]
        lines.append(cells)
    return header, lines


def _lib_label(lib, rows):
    if lib == "mpi":
        names = {r["lib"] for r in rows} - {"accord", "gloo"}
        return sorted(names)[0] if names else "mpich"
    return lib


def format_table(header, lines):
    widths = [max(len(h), *(len(l[i]) for l in lines)) if lines else len(h)
              for i, h in enumerate(header)]
    out = ["  ".join(h.rjust(w) if i > 1 else h.ljust(w)
                     for i, (h, w) in enumerate(zip(header, widths)))]
    out.append("  ".join("-" * w for w in widths))
    for l in lines:
        out.append("  ".join(c.rjust(w) if i > 1 else c.ljust(w)
                             for i, (c, w) in enumerate(zip(l, widths))))
    return "\n".join(out)


def format_markdown(header, lines):
    out = ["| " + " | ".join(header) + " |",
           "|" + "|".join("---" if i < 2 else "---:" for i in range(len(header))) + "|"]
    out += ["| " + " | ".join(l) + " |" for l in lines]
    return "\n".join(out)


LEGEND = ("lat us: median over blocks of the slowest rank's mean op time; algbw/busbw: GB/s "
          "(nccl-tests factors); lat accord/X < 1 and busbw accord/X > 1 mean accord is faster")
P2P_LEGEND = ("pingpong: lat = half a blocking send/recv round trip between ranks 0 and 1 "
              "(osu_latency); p2p_bw: lat = a window's time (isends on rank 0, matching "
              "irecvs on rank 1, then a 4-byte ack) over its messages (64, or 4 above 1 MiB), "
              "busbw = algbw = bytes one way per second (osu_bw); halo: lat = one step "
              "of every rank's exchange with both neighbours of a ring (irecv from each, "
              "isend to each, wait for all four), busbw = algbw = bytes one rank sends "
              "(two messages) per second.")


def legend(settings):
    """The legend under the tables (with the p2p rows' meaning when there are any)."""
    if any(op in P2P_OPS for op in settings.ops):
        return LEGEND + ".  \n" + P2P_LEGEND
    return LEGEND


def write_csv(path, rows):
    _makedirs(path)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            out = dict(r)
            for k in ("lat_us", "op_p50_us", "blk_min_us"):
                out[k] = f"{r[k]:.2f}"
            if r.get("msgs_per_iter") is None:
                out["msgs_per_iter"] = ""
            if r.get("peak_rss_MiB") is not None:
                out["peak_rss_MiB"] = f"{r['peak_rss_MiB']:.1f}"
            for k in ("algbw_GBps", "busbw_GBps"):
                out[k] = "" if r[k] is None else f"{r[k]:.6g}"
            w.writerow(out)


def _makedirs(path):
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)


def write_plot(path, rows, settings):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ops = settings.ops
    fig, axes = plt.subplots(2, len(ops), figsize=(max(4.2 * len(ops), 6.5), 7.8), squeeze=False)
    series = sorted({(r["lib"], r["world"]) for r in rows if r["op"] != "barrier"},
                    key=lambda k: (k[1], k[0] != "accord", k[0]))
    multi = len(settings.worlds) > 1
    colors = {"accord": "C0", "gloo": "C1"}
    for j, op in enumerate(ops):
        for lib, world in series:
            pts = sorted((r["size_bytes"], r["busbw_GBps"], r["lat_us"]) for r in rows
                         if r["lib"] == lib and r["world"] == world and r["op"] == op)
            if not pts:
                continue
            label = f"{lib} (n={world})" if multi else lib
            styles = ("-", "--", ":", "-.")
            style = dict(marker="o", linewidth=2.2 if lib == "accord" else 1.4,
                         color=colors.setdefault(lib, f"C{len(colors)}"),
                         linestyle=styles[settings.worlds.index(world) % len(styles)]
                         if world in settings.worlds else "-")
            xs = [p[0] for p in pts]
            axes[0][j].plot(xs, [max(p[1], 1e-6) for p in pts], label=label, **style)
            axes[1][j].plot(xs, [p[2] for p in pts], label=label, **style)
        axes[0][j].set_title(op)
        for i, ylabel in ((0, "busbw GB/s"), (1, "latency µs")):
            ax = axes[i][j]
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(settings.sizes)
            ax.set_xticklabels([fmt_size(s).replace(" ", "") for s in settings.sizes],
                               fontsize=7, rotation=45)
            ax.set_xlabel("bytes per rank")
            ax.grid(True, which="both", alpha=0.3)
            if j == 0:
                ax.set_ylabel(ylabel)
        axes[0][j].legend(fontsize=8)
    worlds = ",".join(str(w) for w in settings.worlds)
    fig.suptitle(f"accord bench, n={worlds}, ACCORD_TRANSPORT={settings.transport}\n"
                 f"GLIBC_TUNABLES={settings.glibc}", fontsize=10)
    fig.tight_layout()
    _makedirs(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def command_line(argv=None):
    import shlex
    argv = sys.argv[1:] if argv is None else argv
    return "accord " + " ".join(shlex.quote(a) for a in argv)


def merge_runs(runs):
    """Rows of several runs of one library -> one row per (op, size): the median latency."""
    import statistics
    if len(runs) == 1:
        return runs[0]
    groups = {}
    for rows in runs:
        for r in rows:
            groups.setdefault((r["op"], r["size_bytes"]), []).append(r)
    out = []
    for (op, size), rs in groups.items():
        m = dict(rs[0])
        m["lat_us"] = statistics.median(r["lat_us"] for r in rs)
        m["op_p50_us"] = statistics.median(r["op_p50_us"] for r in rs)
        m["blk_min_us"] = min(r["blk_min_us"] for r in rs)
        m["verified"] = all(r.get("verified", True) for r in rs)
        m["repeats"] = len(rs)
        if any(r.get("peak_rss_MiB") is not None for r in rs):
            m["peak_rss_MiB"] = max(r.get("peak_rss_MiB") or 0.0 for r in rs)
        if op != "barrier":
            m["algbw_GBps"] = algbw_bytes(op, size, m["world"]) / (m["lat_us"] * 1e-6) / 1e9
            m["busbw_GBps"] = m["algbw_GBps"] * bus_factor(op, m["world"])
        out.append(m)
    return out


def single_copy_line(runs):
    """A line naming the single-copy threshold each accord run's group used (it decides
    which path the rows from 1 MiB take), or "" where no run reported one."""
    firsts = [rows[0] for rows in runs if rows]
    seen = [r.get("single_copy_min") for r in firsts]
    if not any(v is not None for v in seen):
        return ""

    def fmt(v):
        return "none (no shared memory)" if v is None else "off" if v < 0 else fmt_size(v)
    each = ", ".join(fmt(v) for v in seen)
    how = ("set by ACCORD_SHM_CMA" if any(r.get("single_copy_set") for r in firsts)
           else "measured when each group was created")
    return (f"accord's single-copy threshold ({how}): {each}"
            + (" (one per run)" if len(seen) > 1 else ""))


def _cpu_model():
    """The CPU's model name (Linux), or "": the same row moves with it (the rings' speed
    against single copy's differs between CPU families), so a table names it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _load():
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg()) + " (1, 5, 15 min)"
    except OSError:
        return "unknown"


# --------------------------------------------------------------------------- main

def main(args):
    progress = Progress()
    try:
        settings = Settings(args)
    except ValueError as exc:
        progress.say(f"error: {exc}")
        return 2
    libs, skipped = ["accord"], []
    for lib in settings.compare:
        why = availability(lib)
        if why:
            skipped.append((lib, why))
            progress.say(f"skipping {lib}: {why}")
        else:
            libs.append(lib)
    if settings.plot and importlib.util.find_spec("matplotlib") is None:
        progress.say("error: --plot needs matplotlib (pip install 'accord[plot]')")
        return 2

    nt = nt_threshold()
    head = [f"# {command_line()}",
            f"# method: warm-up, then blocks of ops (a barrier before each; the slowest "
            f"rank's time; the median block){'; --quick plan' if settings.quick else ''}"
            + ("; p2p ops the OSU way (osu_latency, osu_bw) between ranks 0 and 1"
               if any(op in P2P_OPS for op in settings.ops) else ""),
            "# libraries: " + "; ".join(describe_lib(l, settings) for l in libs)
            + "".join(f"; {l}: skipped ({why})" for l, why in skipped),
            f"# GLIBC_TUNABLES={settings.glibc}"
            + (f" (x86_non_temporal_threshold {nt})" if nt else "")
            + f"; {os.cpu_count()} CPUs"
            + (f" ({_cpu_model()})" if _cpu_model() else "")
            + f"; load average at the start: {_load()}"
            + (f"; each library run {settings.repeat} times, interleaved, median per row"
               if settings.repeat > 1 else "")]
    print("\n".join(head), flush=True)

    all_rows, failures, md = [], [], []
    for world in settings.worlds:
        runs = {lib: [] for lib in libs}
        failed = set()
        for rep in range(settings.repeat):
            for lib in libs:
                if lib in failed:
                    continue
                label = {"mpi": "mpich"}.get(lib, lib)
                if settings.repeat > 1:
                    label += f" (run {rep + 1}/{settings.repeat})"
                progress.show(f"[world {world}] {label}: starting")
                t0 = time.monotonic()
                try:
                    rows = run_lib(lib, world, settings, progress, label)
                except LibFailed as exc:
                    failed.add(lib)
                    failures.append((lib, world))
                    progress.say(f"{label} at world {world} failed: {exc}")
                    continue
                except KeyboardInterrupt:
                    progress.say("interrupted")
                    return 130
                progress.say(f"{label} at world {world}: {len(rows)} rows in "
                             f"{time.monotonic() - t0:.1f}s")
                bad = [r for r in rows if not r.get("verified", True)]
                if bad:
                    failures.append((lib, world))
                    progress.say(f"{label} at world {world}: WRONG RESULTS for "
                                 + ", ".join(sorted({f"{r['op']} {fmt_size(r['size_bytes'])}"
                                                     for r in bad})))
                runs[lib].append(rows)
        world_rows, ran = [], []
        chosen = single_copy_line(runs.get("accord", []))
        for lib in libs:
            if runs[lib] and lib not in failed:
                world_rows += merge_runs(runs[lib])
                ran.append(lib)
        all_rows += world_rows
        header, lines = table_rows(world_rows, world, ran, settings)
        print(f"\n## world {world}", flush=True)
        print(format_table(header, lines) if lines else "(no results)", flush=True)
        if chosen:
            print(chosen, flush=True)
        mh, ml = table_rows(world_rows, world, ran, settings, markdown=True)
        md.append((world, mh, ml, chosen))
    end_load = _load()
    print(f"\n# load average at the end: {end_load}", flush=True)
    print("\n" + legend(settings).replace("  \n", "\n"), flush=True)

    if settings.csv:
        write_csv(settings.csv, all_rows)
        progress.say(f"wrote {settings.csv}")
    if settings.markdown:
        _makedirs(settings.markdown)
        with open(settings.markdown, "w") as f:
            f.write("Command:\n\n```\n" + command_line() + "\n```\n\n")
            f.write("\n".join(h.lstrip("# ") for h in head[1:]) .replace("\n", "  \n") + "\n")
            for world, mh, ml, chosen in md:
                f.write(f"\n### world {world}\n\n" + format_markdown(mh, ml) + "\n")
                if chosen:
                    f.write(f"\n{chosen}\n")
            f.write(f"\nLoad average at the end: {end_load}.  \n" + legend(settings) + "\n")
        progress.say(f"wrote {settings.markdown}")
    if settings.plot and all_rows:
        write_plot(settings.plot, all_rows, settings)
        progress.say(f"wrote {settings.plot}")
    return 1 if failures else 0
