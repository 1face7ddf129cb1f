"""The wrapper `accord run` starts each rank through (not a public interface).

    python .../accord/cli/_child.py ERROR_FILE LAUNCHER_PID script|module TARGET [ARGS...]

It runs TARGET as __main__ exactly as `python TARGET ARGS...` (or
`python -m TARGET ARGS...`) would, with three additions:

- an uncaught exception is written as JSON (rank, time, type, message, the
  user-code file:line, the traceback with and without accord's frames) to
  ERROR_FILE, so the launcher can name the rank that failed first and show
  its traceback once, in the job's summary; the rank itself prints one line
  (its exception and where) to stderr, or the whole traceback when
  ACCORD_DEBUG is set;
- the rank dies with the launcher (Linux: PR_SET_PDEATHSIG), so a launcher
  killed with SIGKILL leaves no orphaned ranks behind;
- a rank that failed exits within a few seconds even if non-daemon threads
  would keep the interpreter alive.

It is started by file path, not with -m, so that it does not import the accord
package before the user's program does (which is also why the traceback
folding lives here rather than in a module of the package).
"""
import os
import sys

# Python put this file's directory (accord/cli) first on sys.path; it holds
# modules named like ones a program may import (run.py, bench.py), so take it
# off before importing anything else. (os and sys are loaded before any script runs.)
if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

import json  # noqa: E402
import re  # noqa: E402
import runpy  # noqa: E402
import signal  # noqa: E402
import sysconfig  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

EXIT_GRACE = 5.0  # seconds a failed rank may spend in interpreter shutdown
_SAFE_PATH = bool(getattr(sys.flags, "safe_path", False))  # python -P / PYTHONSAFEPATH


def _die_with_parent(launcher_pid):
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except Exception:
        return
    if os.getppid() != launcher_pid:  # the launcher died before prctl took effect
        os._exit(1)


# the accord package (this file is accord/cli/_child.py): its frames are not the user's
_ACCORD_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# Where libraries live: a frame there is not "the user's code" (numpy, torch, the stdlib).
_LIBRARY_DIRS = tuple(sorted({os.path.abspath(p) + os.sep for p in (
    sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")) if p}))
MAX_CHAIN = 8      # chained exceptions shown at most (a cycle or a very long chain stops there)


def _wrapper_frame(filename):
    return (filename == "<frozen runpy>" or os.path.abspath(filename) in
            (os.path.abspath(__file__), os.path.abspath(runpy.__file__)))


def _is_accord(filename):
    return os.path.abspath(filename).startswith(_ACCORD_DIR)


def _frames(tb):
    """The traceback's frames, less this wrapper's and runpy's at the bottom."""
    frames = traceback.extract_tb(tb)
    while frames and _wrapper_frame(frames[0].filename):
        frames.pop(0)
    return frames


def _format_frames(frames, fold):
    out = []
    folded = 0
    for f in frames:
        if fold and _is_accord(f.filename):
            folded += 1
            continue
        if folded:
            out.append(f"  [... {folded} frame{'s' * (folded != 1)} inside accord; "
                       "ACCORD_DEBUG=INFO shows them]\n")
            folded = 0
        out.append(f'  File "{f.filename}", line {f.lineno}, in {f.name}\n')
        if f.line:
            out.append(f"    {f.line.strip()}\n")
    if folded:
        out.append(f"  [... {folded} frame{'s' * (folded != 1)} inside accord; "
                   "ACCORD_DEBUG=INFO shows them]\n")
    return out


def _chain(exc):
    """The exceptions Python would print, oldest first, each with how it links to the next."""
    chain, seen = [], set()
    link = None
    while exc is not None and id(exc) not in seen and len(chain) < MAX_CHAIN:
        seen.add(id(exc))
        chain.append((exc, link))
        if exc.__cause__ is not None:
            exc, link = exc.__cause__, "cause"
        elif exc.__context__ is not None and not exc.__suppress_context__:
            exc, link = exc.__context__, "context"
        else:
            exc = None
    return chain[::-1]


def format_traceback(exc, fold):
    """The traceback as Python prints it (without carets); fold: accord's frames as one line."""
    out = []
    entries = _chain(exc)
    for i, (e, _) in enumerate(entries):
        frames = _frames(e.__traceback__)
        if frames:
            out.append("Traceback (most recent call last):\n")
            out += _format_frames(frames, fold)
        out += traceback.format_exception_only(type(e), e)
        if i + 1 < len(entries):
            link = entries[i][1]
            out.append("\nThe above exception was the direct cause of the following "
                       "exception:\n\n" if link == "cause" else
                       "\nDuring handling of the above exception, another exception "
                       "occurred:\n\n")
    return "".join(out)


def user_frame(exc):
    """'file:line, in function' of the innermost frame of the user's code, or ''."""
    frames = _frames(exc.__traceback__)
    outside = [f for f in frames if not _is_accord(f.filename)]
    user = [f for f in outside
            if not os.path.abspath(f.filename).startswith(_LIBRARY_DIRS)] or outside
    if not user:
        return ""
    f = user[-1]
    name = f.filename
    if not name.startswith("<"):
        rel = os.path.relpath(os.path.abspath(name))
        name = name if rel.startswith("..") else rel    # short under the working directory
    return f"{name}:{f.lineno}, in {f.name}"


def _type_name(kind):
    if kind.__module__ in ("builtins", "__main__"):
        return kind.__qualname__
    return f"{kind.__module__}.{kind.__qualname__}"


def _peer_blamed(exc):
    """The global rank a PeerLost names as gone (its `peer`, else its message), or None."""
    if type(exc).__name__ != "PeerLost":
        return None
    peer = getattr(exc, "peer", None)
    if isinstance(peer, int):
        return peer
    m = re.search(r"peer rank (\d+)", str(exc))
    return int(m.group(1)) if m else None


def _debugging():
    return os.environ.get("ACCORD_DEBUG", "").strip().upper() not in ("", "OFF", "0")


def _report(exc, error_file, rank):
    when = time.time()
    try:
        message = str(exc)
    except Exception:
        message = "<unprintable>"
    name = _type_name(type(exc))
    where = user_frame(exc)
    full = format_traceback(exc, fold=False)
    record = {"rank": rank, "pid": os.getpid(), "time": when, "type": name,
              "message": message, "where": where, "traceback": full,
              "folded": full if _debugging() else format_traceback(exc, fold=True),
              "peer_lost": _peer_blamed(exc)}
    try:
        tmp = f"{error_file}.tmp"
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, error_file)
    except Exception:
        pass
    try:
        sys.stdout.flush()
    except Exception:
        pass
    if _debugging():
        text = full
    else:
        # one line: the launcher's summary shows the traceback of the rank that failed first
        first = message.split("\n", 1)[0]
        text = f"{name}: {first}" + (f" (at {where})" if where else "") + "\n"
    sys.stderr.write(text)
    sys.stderr.flush()


def _exit_soon(status):
    """Exit normally (atexit, flushing), but never later than EXIT_GRACE from now."""
    timer = threading.Timer(EXIT_GRACE, os._exit, args=(status,))
    timer.daemon = True
    timer.start()
    sys.exit(status)


def main(argv):
    if len(argv) < 4 or argv[2] not in ("script", "module"):
        sys.stderr.write("usage: _child.py ERROR_FILE LAUNCHER_PID script|module TARGET [ARGS...]\n")
        return 2
    error_file, launcher_pid, kind, target, args = argv[0], int(argv[1]), argv[2], argv[3], argv[4:]
    if launcher_pid > 0:
        _die_with_parent(launcher_pid)
    rank = os.environ.get("RANK", "?")
    try:
        if kind == "script":
            sys.argv = [target] + args
            if not _SAFE_PATH:
                sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
            runpy.run_path(target, run_name="__main__")
        else:
            sys.argv = [target] + args  # runpy replaces argv[0] with the module's file
            if not _SAFE_PATH:
                sys.path.insert(0, os.getcwd())
            runpy.run_module(target, run_name="__main__", alter_sys=True)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:  # noqa: B902 - report anything else, then fail
        world = sys.modules.get("accord.world")
        if world is not None:     # the script used accord: its peers hear why we leave
            world.note_uncaught(exc)
        _report(exc, error_file, rank)
        _exit_soon(1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
