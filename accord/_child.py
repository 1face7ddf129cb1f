"""The wrapper `accord run` starts each rank through (not a public interface).

    python .../accord/_child.py ERROR_FILE LAUNCHER_PID script|module TARGET [ARGS...]

It runs TARGET as __main__ exactly as `python TARGET ARGS...` (or
`python -m TARGET ARGS...`) would, with three additions:

- an uncaught exception is printed to stderr with every line prefixed
  "[rank N] ", and written as JSON (rank, time, type, message, traceback) to
  ERROR_FILE, so the launcher can name the rank that failed first and show its
  traceback;
- the rank dies with the launcher (Linux: PR_SET_PDEATHSIG), so a launcher
  killed with SIGKILL leaves no orphaned ranks behind;
- a rank that failed exits within a few seconds even if non-daemon threads
  would keep the interpreter alive.

It is started by file path, not with -m, so that it does not import the accord
package before the user's program does.
"""
import os
import sys

# Python put this file's directory (the accord package) first on sys.path; it
# holds modules named like real ones (accord/torch.py), so take it off before
# importing anything else. (os and sys are loaded before any script runs.)
if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

import json  # noqa: E402
import runpy  # noqa: E402
import signal  # noqa: E402
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


def _user_traceback(exc):
    """The traceback as Python would print it, without this wrapper's and runpy's frames."""
    skip = {os.path.abspath(__file__), os.path.abspath(runpy.__file__), "<frozen runpy>"}
    tb = exc.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if name not in skip and os.path.abspath(name) not in skip:
            break
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _report(exc, error_file, rank):
    when = time.time()
    text = _user_traceback(exc)
    kind = type(exc)
    name = kind.__qualname__ if kind.__module__ in ("builtins", "__main__") \
        else f"{kind.__module__}.{kind.__qualname__}"
    try:
        message = str(exc)
    except Exception:
        message = "<unprintable>"
    record = {"rank": rank, "pid": os.getpid(), "time": when, "type": name,
              "message": message, "traceback": text}
    try:
        tmp = f"{error_file}.tmp"
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, error_file)
    except Exception:
        pass
    prefix = f"[rank {rank}] "
    try:
        sys.stdout.flush()
    except Exception:
        pass
    sys.stderr.write("".join(prefix + line + "\n" for line in text.rstrip("\n").split("\n")))
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
        _report(exc, error_file, rank)
        _exit_soon(1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
