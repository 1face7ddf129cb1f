"""Ranks blocked in collectives of different groups, each waiting for the other.

Rank 0 calls all_reduce on group A while rank 1 calls it on group B (both
hold ranks 0 and 1): each waits for a rank that can never come, since that
rank's thread is itself blocked in the other group. No message ever crosses
between the two calls, so stamps cannot see it; the positions every rank
publishes (positions.py) can. From its own blocked call, a rank follows "waits
for a rank that has not entered this call and is blocked elsewhere" through
the published positions; a path back to itself is a cycle, a certain
deadlock. It is declared only when seen again after every member has had
time to publish a change, so a stale position never raises a false alarm.

Only calls the main thread is blocked on count (a synchronous call, or
Work.wait): an async call waiting for a rank that computes before its next
call is normal. A process with threads of its own (one that issued a
collective, or any live thread that is not accord's) takes no part: that
thread may yet make the call its peers wait for.
"""
import time

from . import positions
from ..errors import Desync
from .groups import threaded
from .recorder import SEQ, T_START, describe_entry

CONFIRM_S = 3 * positions.PERIOD     # a cycle must still hold this much later
MIN_BLOCKED_S = 2 * positions.PERIOD  # calls blocked for less are still settling
MAX_DEPTH = 8

_first_seen = {}                 # cycle signature -> when it was first seen


def check(groups):
    """Called by the publisher thread: raise a Desync in calls caught in a cycle."""
    now = time.time()
    seen = set()
    for g in groups:
        cur = g.recorder.current
        if cur is None or cur[SEQ] is None or g.waiters <= 0:
            continue
        if now - (cur[T_START] or now) < MIN_BLOCKED_S:
            continue
        cycle = find_cycle(g, cur, groups)
        if cycle is None:
            continue
        sig = tuple((n["rank"], n["group"], n["seq"]) for n in cycle)
        seen.add(sig)
        first = _first_seen.setdefault(sig, now)
        if now - first >= CONFIRM_S and g.recorder.current is cur:
            _declare(g, cycle, groups)
    for sig in list(_first_seen):
        if sig not in seen:
            del _first_seen[sig]


def find_cycle(g, cur, groups):
    """[node, ...] from this rank's blocked call back to it, or None.

    A node is a blocked call: {rank, group, ranks, seq, desc, waiting_on}."""
    if threaded():
        return None
    me = g.global_rank
    mine = {x.name: x for x in groups}
    start = {"rank": me, "group": g.name, "ranks": g.ranks, "seq": cur[SEQ],
             "desc": describe_entry(cur), "waiting_on": positions.waiting_on(g)}
    cache = {}

    def position(rank, node):
        # in accord's own world every group shares one store; a torch group has its own
        store = mine[node["group"]].store if node["group"] in mine else g.store
        key = (rank, node["group"])
        if key not in cache:
            try:
                r = node["ranks"].index(rank)
            except ValueError:
                cache[key] = None
            else:
                cache[key] = positions.read_position(store, node["group"], r)
        return cache[key]

    def walk(path, visited):
        node = path[-1]
        if len(path) > MAX_DEPTH:
            return None
        for b in node["waiting_on"]:
            if b == me:
                own = mine.get(node["group"])
                if own is not None and own is not g and own._seq <= node["seq"]:
                    return path          # it waits for this rank, blocked in g
                continue
            pos = position(b, node)
            if pos is None or pos.get("threads", True) or \
                    pos.get("calls", {}).get(node["group"], node["seq"] + 1) > node["seq"]:
                continue       # b entered that call, says nothing, or issues from threads
            for nb in pos.get("blocked", ()):
                nxt = dict(nb, rank=b)
                if (b, nb["group"]) in visited:
                    continue
                found = walk(path + [nxt], visited | {(b, nb["group"])})
                if found is not None:
                    return found
        return None

    return walk([start], {(me, g.name)})


def describe(cycle):
    lines = []
    for i, n in enumerate(cycle):
        waits_for = cycle[(i + 1) % len(cycle)]["rank"]
        lines.append(f"rank {n['rank']} waits in {n['desc']} on group {n['group']!r} for "
                     f"rank {waits_for}, which has not called it")
    return ("ranks wait for each other in collectives of different groups, so none can "
            "finish (a deadlock): " + "; ".join(lines) + ". Every rank must call the "
            "collectives of the groups it shares in the same order.")


def _declare(g, cycle, groups):
    text = describe(cycle)
    call = cycle[0]["desc"].split(",")[0].split(" at ")[0]
    exc = Desync(f"rank {g.global_rank}: {call} (group {g.name!r}): {text}")
    # the peers waiting on this rank wait in groups this rank belongs to: breaking those
    # sends them the same story at once, before this rank's error ends its process
    involved = {n["group"] for n in cycle[1:]}
    for other in groups:
        if other is g or other.name not in involved:
            continue
        if other.recorder.current is None:
            other._break(exc)
        else:
            other.transport.interrupt(exc)
    g.transport.interrupt(exc)
