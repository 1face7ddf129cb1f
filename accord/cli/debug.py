"""`accord debug analyze DIR`: the first call where the ranks' flight recorders diverge.

Every rank of a job run with ACCORD_TRACE_DIR writes its recorder there
(debug.dump: on a timeout, a communication error or SIGUSR1). This reads them
all back (debug/recorder.py's load_dumps) and, group by group, walks the calls in sequence
order until the ranks called different things, one never entered a call, or a
call did not complete.
"""
import sys

from ..debug.positions import ranks_text
from ..debug.recorder import DONE, FAILED, ISSUED, RUNNING, load_dumps


def add_arguments(parser):
    parser.usage = "accord debug analyze DIR"
    sub = parser.add_subparsers(dest="action", metavar="analyze")
    a = sub.add_parser("analyze", help="read every rank's flight recorder in DIR and print "
                                       "the first call where the ranks diverge")
    a.add_argument("dir", metavar="DIR", help="the ACCORD_TRACE_DIR of the job")


def main(args):
    if getattr(args, "action", None) != "analyze":
        sys.stderr.write("usage: accord debug analyze DIR\n")
        return 2
    try:
        text, diverged = analyze(args.dir)
    except (OSError, ValueError) as e:
        sys.stderr.write(f"accord debug analyze: {e}\n")
        return 2
    sys.stdout.write(text + "\n")
    return 1 if diverged else 0


def _sig(op):
    return (op.get("op"), op.get("root"), op.get("dtype"), op.get("count"))


def _op_text(op):
    root = f", root rank {op['root']}" if op.get("root") is not None and op["root"] >= 0 else ""
    shape = f"{op['dtype']}{op['shape']}" if op.get("shape") is not None else (op.get("dtype") or "")
    parts = [f"{op['op']} #{op['seq']}{root}"]
    if shape:
        parts.append(shape)
    if op.get("count") is not None and op["count"] >= 0:
        parts.append(f"{op['count']} bytes")
    text = ", ".join(parts)
    if op.get("where"):
        text += f" at {op['where']}"
    state = op.get("state")
    if state == FAILED and op.get("error"):
        text += f" [failed: {op['error'].splitlines()[0][:200]}]"
    elif state in (RUNNING, ISSUED):
        text += f" [{state}, never completed]"
    return text


def analyze(trace_dir):
    """(report text, whether a divergence was found) for the dumps in trace_dir."""
    dumps = load_dumps(trace_dir)
    lines = [f"flight recorders of ranks {sorted(dumps)} in {trace_dir}"]
    for rank, d in sorted(dumps.items()):
        lines.append(f"  rank {rank} (pid {d.get('pid')} on {d.get('host')}): dumped on "
                     f"{str(d.get('reason', '')).splitlines()[0][:160]}")
    group_names = sorted({g for d in dumps.values() for g in d["groups"]})
    found = False
    for gname in group_names:
        members = {r: d["groups"][gname] for r, d in dumps.items() if gname in d["groups"]}
        ranks = next(iter(members.values()))["ranks"]
        missing = [r for r in ranks if r not in members]
        ops = {r: {o["seq"]: o for o in g["ops"] if o.get("seq") is not None}
               for r, g in members.items()}
        start = max((min(o) if o else 0) for o in ops.values())
        end = max((max(o) if o else -1) for o in ops.values())
        verdict = None
        for seq in range(start, end + 1):
            present = {r: o[seq] for r, o in ops.items() if seq in o}
            absent = [r for r in ops if seq not in ops[r]]
            sigs = {_sig(o) for o in present.values()}
            unfinished = [r for r, o in present.items() if o.get("state") != DONE]
            if len(sigs) > 1:
                verdict = (seq, f"ranks called different things at call #{seq}", present, absent)
            elif absent:
                verdict = (seq, f"{ranks_text(absent)} never entered call #{seq}", present, absent)
            elif unfinished:
                verdict = (seq, f"call #{seq} did not complete on {ranks_text(unfinished)}",
                           present, absent)
            if verdict:
                break
        if verdict is None:
            lines.append(f"group {gname!r} (ranks {ranks}): no divergence in calls "
                         f"#{start}..#{end}" + (f" (no dump from {ranks_text(missing)})"
                                                if missing else ""))
            continue
        found = True
        seq, what, present, absent = verdict
        lines.append(f"group {gname!r} (ranks {ranks}): first divergence at call #{seq}: {what}")
        for r in sorted(set(present) | set(absent)):
            if r in present:
                lines.append(f"  rank {r}: {_op_text(present[r])}")
            else:
                last = max(ops[r]) if ops[r] else None
                lines.append(f"  rank {r}: never entered it; its last call was "
                             + (_op_text(ops[r][last]) if last is not None else "none"))
        if missing:
            lines.append(f"  no dump from {ranks_text(missing)} (did it die before writing one?)")
    return "\n".join(lines), found
