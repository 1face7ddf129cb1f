"""Never hang, always explain: call sites, flight recorder, positions, stuck-rank reports.

Everything here is off the per-call hot path or costs a few hundred
nanoseconds on it:

- `call_site()` names the user's file:line of a collective (cached per
  code location); its 23-bit id rides in every message stamp, so a Desync
  can name the peer's line too.
- `Recorder`: the last N calls of a group (a deque of small lists). Dumped as
  JSON to ACCORD_TRACE_DIR on a timeout, on any communication error, and on
  SIGUSR1; `accord debug analyze DIR` (cli/debug.py) reads the dumps of every
  rank and prints the first call where they diverge.
- Positions: a daemon thread per process (monitor.py) publishes, at most every PERIOD
  seconds and only when something changed, where each of its groups stands
  (last call entered and completed, whom it waits on) to the group's store.
  No call ever waits on the store for this.
- `stuck_report()`: when a call times out, the rank reads every member's
  position back and says who never entered the call and who waits in it.
"""
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import weakref
import zlib

log = logging.getLogger("accord")

PERIOD = 0.25            # seconds between position publications (when changed)
RECORD = 2000            # calls kept per group by the flight recorder
_ACCORD_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_SKIP = (_ACCORD_DIR, os.sep + "torch" + os.sep)
SITE_MASK = (1 << 23) - 1

# -- call sites -------------------------------------------------------------------

_sites = {}          # (code object, offset) -> (site id, "file:line")
_site_text = {}      # site id -> "file:line"


_skip = {}           # code object -> True if it is accord's (or torch's) own


def call_site(depth=2):
    """(site id, 'file:line') of the nearest caller outside accord (and torch).

    Cached per (code object, bytecode offset): a few hundred nanoseconds.
    """
    try:
        f = sys._getframe(depth)
    except ValueError:
        return 0, ""
    skip = _skip
    while f is not None:
        code = f.f_code
        s = skip.get(code)
        if s is None:
            name = code.co_filename
            s = skip[code] = name.startswith(_SKIP[0]) or _SKIP[1] in name
        if not s:
            break
        f = f.f_back
    if f is None:
        return 0, ""
    key = (code, f.f_lasti)
    hit = _sites.get(key)
    if hit is None:
        name, line = code.co_filename, f.f_lineno
        text = f"{os.path.basename(name)}:{line}"
        site = (zlib.crc32(f"{name}:{line}".encode()) & SITE_MASK) or 1
        hit = _sites[key] = (site, text)
        if site not in _site_text:
            _site_text[site] = text
            _announce([(site, text)], list(_groups))
    return hit


def site_text(site):
    """'file:line' for a site id this process knows (peers run the same code)."""
    return _site_text.get(site)


def _site_key(global_rank, site):
    return f"debug/site/{global_rank}/{site}"


def _announce(sites, groups):
    """Write call sites' text into the groups' stores, once per site and store.

    Messages carry only a site's id (23 bits of the header). Its text is written
    here before the first message with that id leaves this process, so a peer
    that gets the id in a Desync can always read the text back, even after this
    process has exited (the positions the publisher writes every PERIOD would
    miss a site used just before an exit).
    """
    done = set()
    for g in groups:
        store = getattr(g, "store", None)
        if store is None or not g.is_member or id(store) in done:
            continue
        done.add(id(store))
        for site, text in sites:
            try:
                store.set(_site_key(g.global_rank, site), text)
            except Exception:       # a store that is gone: the publisher's table remains
                break


# -- the flight recorder ------------------------------------------------------------

# an entry is a list (cheap to build, mutable in place):
SEQ, OP, ROOT, DTYPE, COUNT, SHAPE, WHERE, T_ISSUE, T_START, T_END, STATE, ERROR = range(12)
ISSUED, RUNNING, DONE, FAILED = "issued", "running", "done", "failed"
_FIELDS = ("seq", "op", "root", "dtype", "count", "shape", "where", "t_issue", "t_start",
           "t_end", "state", "error")


class Recorder:
    """The last RECORD calls of one group, and where the group stands."""

    def __init__(self, size=RECORD):
        import collections
        self.entries = collections.deque(maxlen=size)
        self.current = None          # the entry running now
        self.last_done = None        # the last entry completed

    def add(self, seq, op, root, dtype, count, shape, where):
        e = [seq, op, root, dtype, count, shape, where, None, None, None, ISSUED, None]
        self.entries.append(e)
        return e

    def find(self, seq):
        for e in reversed(self.entries):
            if e[SEQ] == seq:
                return e
        return None

    def as_dicts(self):
        return [dict(zip(_FIELDS, e)) for e in list(self.entries)]


def describe_entry(e):
    from .transport.wire import describe
    from .transport.wire import OP_CODES
    text = describe(OP_CODES.get(e[OP], 0), e[SEQ], -1, e[DTYPE] or "", e[COUNT],
                    e[SHAPE])
    if e[OP] not in OP_CODES:
        text = f"{e[OP]} " + text.split(" ", 1)[1]
    if e[ROOT] is not None and e[ROOT] >= 0:
        text = text.replace(f"#{e[SEQ]}", f"#{e[SEQ]}, root rank {e[ROOT]}", 1)
    return f"{text} at {e[WHERE]}" if e[WHERE] else text


# -- groups this process belongs to -------------------------------------------------

_groups = weakref.WeakSet()
_lock = threading.Lock()
_options_done = False


def register(group):
    """Called when a member group gets its transport (and store); monitor.register
    calls it, then starts the publisher thread."""
    with _lock:
        known = {id(getattr(g, "store", None)) for g in _groups}
        _groups.add(group)
        if id(getattr(group, "store", None)) not in known:
            # the sites used so far, for peers of this group (its store may be new)
            _announce(list(_site_text.items()), [group])
    _install_signal(group.options)
    setup_logging(group.options, group.global_rank)


def unregister(group):
    with _lock:
        _groups.discard(group)


def live_groups():
    """The groups of this process that have a transport and are not yet destroyed."""
    return list(_groups)


def sites_known():
    """How many call sites this process has named so far (a new one republishes)."""
    return len(_site_text)


# -- which threads issue collectives ------------------------------------------------

other_issuers = False     # a thread other than the main one has issued a collective


def on_main_thread():
    """True on the main thread; notes it when another thread issues a collective.

    A process whose main thread is blocked in a call may still make the call its
    peers wait for from another thread: such processes (see threaded()) take no
    part in deadlock cycles (deadlock.py), and fall back to the timeout's
    stuck-rank table."""
    global other_issuers
    if threading.current_thread() is threading.main_thread():
        return True
    other_issuers = True
    return False


def threaded():
    """Whether another thread of this program may issue collectives: one has, or a
    thread that is not accord's own is alive (it may be about to)."""
    if other_issuers:
        return True
    main = threading.main_thread()
    return any(t is not main and not t.name.startswith("accord-")
               for t in threading.enumerate())


# -- positions ------------------------------------------------------------------------

def _key(group, rank):
    return _pos_key(group.name, rank)


def _pos_key(group_name, rank):
    return f"{group_name}/debug/pos/{rank}"


def position(group):
    """What the rest of the group should know about where this rank stands."""
    rec = group.recorder
    cur, done = rec.current, rec.last_done
    now = time.time()
    pos = {"rank": group.global_rank, "pid": os.getpid(), "host": socket.gethostname(),
           "time": now, "seq": group._seq,
           "entered": None, "completed": None, "waiting_on": [], "elsewhere": []}
    if cur is not None:
        pos["entered"] = {"seq": cur[SEQ], "desc": describe_entry(cur),
                          "since": cur[T_START]}
        pos["waiting_on"] = waiting_on(group)
    if done is not None:
        pos["completed"] = {"seq": done[SEQ], "desc": describe_entry(done), "at": done[T_END]}
    pos["calls"], pos["blocked"], pos["threads"] = {}, [], threaded()
    for other in list(_groups):
        pos["calls"][other.name] = other._seq
        c = other.recorder.current
        if c is None:
            continue
        if other is not group:
            pos["elsewhere"].append(f"{describe_entry(c)} in group {other.name!r}")
        if other.waiters > 0 and c[SEQ] is not None:
            # a thread of this process cannot go on until this call completes
            pos["blocked"].append({"group": other.name, "ranks": other.ranks, "seq": c[SEQ],
                                   "desc": describe_entry(c), "since": c[T_START],
                                   "waiting_on": waiting_on(other)})
    return pos


def waiting_on(group):
    """Global ranks the call running on group waits for (to receive from or send to)."""
    active = getattr(group.transport, "active", None)
    if not active or group.recorder.current is None:
        return []
    recvs, sends = active
    return sorted({group.ranks[r.peer] for r in recvs if not r.done} |
                  {group.ranks[s.peer] for s in sends if not s.done})


def publish(group):
    store = getattr(group, "store", None)
    if store is None or not group.is_member:
        return
    pos = position(group)
    pos["sites"] = {str(k): v for k, v in list(_site_text.items())[:500]}
    store.set(_key(group, group.rank), json.dumps(pos))


def _read_positions(group):
    out = {}
    for r in range(group.size):
        pos = _read_position(group, r)
        if pos is not None:
            out[r] = pos
    return out


def published_site_text(group, site):
    """A peer's call site, from the tables peers publish (error paths only: store reads)."""
    if getattr(group, "store", None) is None:
        return None
    for r in range(group.size):
        if r == group.rank:
            continue
        key = _site_key(group.ranks[r], site)
        try:
            if group.store.check([key]):
                text = group.store.get(key)
                text = text.decode() if isinstance(text, bytes) else str(text)
                _site_text.setdefault(site, text)
                return text
        except Exception:           # the store went away with the job: try the positions
            break
    deadline = time.monotonic() + 2 * PERIOD
    key = str(site)
    while True:
        for r in range(group.size):
            if r == group.rank:
                continue
            pos = _read_position(group, r)
            if pos and key in pos.get("sites", {}):
                _site_text.setdefault(site, pos["sites"][key])
                return pos["sites"][key]
        if time.monotonic() > deadline:
            return None
        time.sleep(PERIOD / 4)


def _read_position(group, r):
    return read_position(group.store, group.name, r)


def read_position(store, group_name, r):
    """Group rank r's published position in group_name, or None."""
    try:
        key = _pos_key(group_name, r)
        if store.check([key]):
            return json.loads(store.get(key))
    except Exception:
        pass
    return None


def _ago(t, now):
    return f"{max(0.0, now - t):.1f} s" if t else "?"


def stuck_report(group, entry):
    """The table a CommTimeout shows: each member's last call entered and completed."""
    if getattr(group, "store", None) is None:
        return ""
    try:
        publish(group)
        # peers publish within PERIOD of a change: give a just-stalled one that long
        started = entry[T_START] or time.time()
        wait = PERIOD * 1.5 - (time.time() - started)
        if wait > 0:
            time.sleep(wait)
        positions = _read_positions(group)
    except Exception as e:
        return f"\n(no stuck-rank report: the store could not be read: {e})"
    now = time.time()
    seq = entry[SEQ]
    lines = [f"\nwhere each rank of group {group.name!r} stands (this rank timed out in "
             f"{describe_entry(entry)}):"]
    never, waiting, unknown = [], [], []
    for r in range(group.size):
        glob = group.ranks[r]
        pos = positions.get(r)
        if pos is None:
            lines.append(f"  rank {glob}: no position published (hung before its first call?)")
            unknown.append(glob)
            continue
        ent, comp = pos.get("entered"), pos.get("completed")
        parts = []
        if ent is not None:
            w = ent.get("since")
            parts.append(f"waiting in {ent['desc']} for {_ago(w, now)}"
                         + (f" (on rank{'s' if len(pos['waiting_on']) > 1 else ''} "
                            f"{', '.join(map(str, pos['waiting_on']))})"
                            if pos.get("waiting_on") else ""))
        else:
            parts.append("not inside a call of this group"
                         + (f" since {_ago(comp.get('at'), now)}" if comp else ""))
        parts.append(f"last completed {comp['desc']}" if comp else "completed no call yet")
        if pos.get("elsewhere"):
            parts.append("busy in " + "; ".join(pos["elsewhere"]))
        lines.append(f"  rank {glob}: " + "; ".join(parts))
        entered_seq = ent["seq"] if ent is not None else None
        done_seq = comp["seq"] if comp is not None else -1
        if entered_seq == seq:
            waiting.append(glob)
        elif (entered_seq is None or entered_seq < seq) and done_seq < seq:
            never.append(glob)
    name = describe_entry(entry).split(",")[0].split(" at ")[0]
    summary = []
    if never:
        summary.append(f"{ranks_text(never)} never entered {name}")
    if waiting:
        verb = "is" if len(waiting) == 1 else "are"
        summary.append(f"{ranks_text(waiting)} {verb} waiting in it")
    if summary:
        lines.append("; ".join(summary) + ".")
    return "\n".join(lines)


def ranks_text(rs):
    """'rank 3', 'ranks 0–3' or 'ranks 0, 2' for a list of ranks."""
    rs = sorted(rs)
    if len(rs) == 1:
        return f"rank {rs[0]}"
    if rs == list(range(rs[0], rs[-1] + 1)) and len(rs) > 2:
        return f"ranks {rs[0]}\u2013{rs[-1]}"
    return "ranks " + ", ".join(map(str, rs))


# -- dumps -------------------------------------------------------------------------------

def dump(reason, trace_dir=None, groups=None):
    """Write this rank's flight recorder to trace_dir/rank<R>.json; return the path."""
    groups = list(_groups) if groups is None else groups
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


def _install_signal(options):
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
