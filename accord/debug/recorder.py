"""The flight recorder: the last calls of each group, dumped when something fails.

`Recorder` keeps the last RECORD calls of a group (a deque of small lists,
made when the group is and rewritten in place call after call). Dumped as JSON
to ACCORD_TRACE_DIR on a timeout, on any communication error, and on SIGUSR1;
`accord debug analyze DIR` (cli/debug.py) reads the dumps of every rank and
prints the first call where they diverge. Also here: the "accord" logger and
ACCORD_DEBUG's handler.
"""
import collections
import json
import logging
import os
import signal
import socket
import sys
import threading
import time

from . import groups as registered
from ..transport.wire import OP_CODES, describe

log = logging.getLogger("accord")

RECORD = 2000            # calls kept per group by the flight recorder

# an entry is a list (cheap to build, mutable in place):
SEQ, OP, ROOT, DTYPE, COUNT, SHAPE, WHERE, T_ISSUE, T_START, T_END, STATE, ERROR = range(12)
ISSUED, RUNNING, DONE, FAILED = "issued", "running", "done", "failed"
_FIELDS = ("seq", "op", "root", "dtype", "count", "shape", "where", "t_issue", "t_start",
           "t_end", "state", "error")


class Recorder:
    """The last RECORD calls of one group, and where the group stands.

    The ring is full from the start (RECORD blank entries, made when the group is),
    and each call's entry replaces the oldest: a group's recorder holds as much
    memory after its first call as after its millionth, where a ring filling up
    would grow for RECORD calls (a subgroup used now and then: for hours)."""

    def __init__(self, size=RECORD):
        self.entries = collections.deque(
            ([None] * len(_FIELDS) for _ in range(size)), maxlen=size)
        self.added = 0               # calls recorded so far (the monitor's change counter)
        self.current = None          # the entry running now
        self.last_done = None        # the last entry completed

    def add(self, seq, op, root, dtype, count, shape, where):
        # the oldest entry, rewritten in place: blank, or done (nothing writes to an
        # entry once it says so). A fresh list a call lived through RECORD more calls,
        # long enough to reach the garbage collector's oldest generation, and each one
        # that got there brought the next full collection (every object of the
        # program scanned) closer, in any program whose own allocations run the
        # collector. An entry still running, or failed (its error may be written
        # after its state), is left to whoever holds it and a fresh one taken.
        entries = self.entries
        e = entries.popleft()
        state = e[STATE]
        if state is None or state is DONE and e is not self.last_done:
            e[SEQ] = seq
            e[OP] = op
            e[ROOT] = root
            e[DTYPE] = dtype
            e[COUNT] = count
            e[SHAPE] = shape
            e[WHERE] = where
            e[T_ISSUE] = e[T_START] = e[T_END] = e[ERROR] = None
            e[STATE] = ISSUED
        else:
            e = [seq, op, root, dtype, count, shape, where, None, None, None, ISSUED, None]
        entries.append(e)
        self.added += 1
        return e

    def find(self, seq):
        for e in reversed(self.entries):
            if e[STATE] is None:     # never used: nothing older either
                return None
            if e[SEQ] == seq:
                return e
        return None

    def as_dicts(self):
        return [dict(zip(_FIELDS, e)) for e in list(self.entries) if e[STATE] is not None]


def describe_entry(e):
    """'all_reduce #3, root rank 1, float32[4] (16 bytes) at train.py:12' for an entry."""
    text = describe(OP_CODES.get(e[OP], 0), e[SEQ], -1, e[DTYPE] or "", e[COUNT],
                    e[SHAPE])
    if e[OP] not in OP_CODES:
        text = f"{e[OP]} " + text.split(" ", 1)[1]
    if e[ROOT] is not None and e[ROOT] >= 0:
        text = text.replace(f"#{e[SEQ]}", f"#{e[SEQ]}, root rank {e[ROOT]}", 1)
    return f"{text} at {e[WHERE]}" if e[WHERE] else text


# -- dumps -------------------------------------------------------------------------------

def dump(reason, trace_dir=None, groups=None):
    """Write this rank's flight recorder to trace_dir/rank<R>.json; return the path."""
    groups = registered.live_groups() if groups is None else groups
    if not groups:
        return None
    trace_dir = trace_dir or groups[0].options.trace_dir if groups[0].options else trace_dir
    if not trace_dir:
        return None
    rank = groups[0].global_rank
    data = {"rank": rank, "pid": os.getpid(), "host": socket.gethostname(), "time": time.time(),
            "reason": reason, "groups": {}}
    for g in groups:
        data["groups"][g.name] = {"ranks": g.ranks, "rank": g.rank, "size": g.size,
                                  "seq": g._seq, "ops": g.recorder.as_dicts()}
    os.makedirs(trace_dir, exist_ok=True)
    path = os.path.join(trace_dir, f"rank{rank}.json")
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, default=str)
    os.replace(tmp, path)
    return path


def load_dumps(trace_dir):
    """{rank: dump} of every rank*.json in trace_dir (ValueError when there is none)."""
    dumps = {}
    for name in sorted(os.listdir(trace_dir)):
        if name.startswith("rank") and name.endswith(".json"):
            with open(os.path.join(trace_dir, name)) as f:
                d = json.load(f)
            dumps[int(d["rank"])] = d
    if not dumps:
        raise ValueError(f"no flight-recorder dumps (rank*.json) in {trace_dir}; set "
                         f"ACCORD_TRACE_DIR when running the job")
    return dumps


def on_error(group, exc):
    """A call failed: dump the flight recorder if ACCORD_TRACE_DIR is set."""
    opts = group.options
    if opts is None or not opts.trace_dir:
        return
    try:
        path = dump(f"{type(exc).__name__}: {exc}", opts.trace_dir)
        if path:
            log.warning("rank %s: flight recorder written to %s", group.global_rank, path)
    except Exception as e:      # never mask the real error
        log.warning("rank %s: could not write the flight recorder: %s", group.global_rank, e)


_signal_installed = False


def install_signal(options):
    """SIGUSR1 dumps the flight recorder (with ACCORD_TRACE_DIR, unless the program
    handles SIGUSR1 itself)."""
    global _signal_installed
    if _signal_installed or options is None or not options.trace_dir:
        return
    if threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, None):
            return              # the program handles SIGUSR1 itself
        signal.signal(signal.SIGUSR1, _on_sigusr1)
        _signal_installed = True
    except (ValueError, OSError, AttributeError):
        pass


def _on_sigusr1(signum, frame):
    try:
        path = dump("SIGUSR1")
        if path:
            sys.stderr.write(f"accord: flight recorder written to {path}\n")
    except Exception as e:
        sys.stderr.write(f"accord: could not write the flight recorder: {e}\n")


# -- the logger --------------------------------------------------------------------------

def setup_logging(options, rank):
    """ACCORD_DEBUG=INFO/DETAIL: log accord's lines to stderr, prefixed with the rank."""
    if options is None or options.debug == "OFF":
        return
    if any(getattr(h, "_accord", False) for h in log.handlers):
        return
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(logging.Formatter(f"[accord rank {rank}] %(levelname)s %(message)s"))
    h._accord = True
    log.addHandler(h)
    log.setLevel(logging.INFO)
