"""Positions: where each rank stands in each of its groups, published to the store.

A daemon thread per process (monitor.py) publishes, at most every PERIOD
seconds and only when something changed, where each of its groups stands (last
call entered and completed, whom it waits on, and the point-to-point messages its
threads are blocked on) to the group's store. No call
ever waits on the store for this. They are read back on error paths only:
`stuck_report()` (when a call times out, the rank reads every member's position
back and says who never entered the call and who waits in it), a peer's call
site text (`published_site_text`), and the deadlock check across groups.
"""
import json
import os
import socket
import time

from . import callsite, groups
from .recorder import SEQ, T_END, T_START, describe_entry

PERIOD = 0.25            # seconds between position publications (when changed)


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
    pos["calls"], pos["blocked"], pos["threads"] = {}, [], groups.threaded()
    pos["p2p"] = []
    for other in groups.live_groups():
        pos["calls"][other.name] = other._seq
        for w in p2p_waits(other):
            # a thread blocked on a message is in no collective: without this a rank
            # waiting for a stopped peer's message would look merely absent
            pos["p2p"].append(w)
            pos["elsewhere"].append(f"{w['desc']} (waiting on {ranks_text(w['waiting_on'])})")
        c = other.recorder.current
        if c is None:
            continue
        if other is not group:
            # whom that call waits for: often the rank to look at, one group further on
            on = waiting_on(other)
            pos["elsewhere"].append(f"{describe_entry(c)} in group {other.name!r}"
                                    + (f" (waiting on {ranks_text(on)})" if on else ""))
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


def p2p_waits(group):
    """The point-to-point operations of group that threads are blocked on (in a blocking
    send or recv, or Work.wait): [{group, ranks, desc, since, waiting_on}], waiting_on
    the global rank it needs (every other member for a receive from any rank)."""
    eng = getattr(group, "p2p", None)
    if eng is None or not eng.waited:
        return []
    out = []
    for op, since in list(eng.waited):
        if op.done():
            continue
        on = ([group.ranks[op.peer]] if op.peer is not None else
              [r for r in group.ranks if r != group.global_rank])
        out.append({"group": group.name, "ranks": group.ranks, "desc": op.desc,
                    "since": since, "waiting_on": on})
    return out


def publish(group):
    store = getattr(group, "store", None)
    if store is None or not group.is_member:
        return
    pos = position(group)
    pos["sites"] = {str(k): v for k, v in callsite.known()[:500]}
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
        key = callsite.site_key(group.ranks[r], site)
        try:
            if group.store.check([key]):
                text = group.store.get(key)
                text = text.decode() if isinstance(text, bytes) else str(text)
                callsite.remember(site, text)
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
                callsite.remember(site, pos["sites"][key])
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


CHAIN_MAX = 6            # hops a stuck report follows from a rank that never entered


def _store_of(group, name):
    """The store group `name`'s positions are in: its own where this process holds it (a
    torch group has its own store), else group's (accord's groups share one)."""
    for g in groups.live_groups():
        if g.name == name:
            return g.store
    return group.store


def wait_chain(group, rank, pos, skip=()):
    """From a member that never entered the call (global `rank`, its position `pos` in
    group), the calls (or point-to-point messages) it is blocked in elsewhere and the
    ranks those wait for, hop by hop as each published it: "rank 0 waits in
    all_reduce #5 (...) of group 'g1' on rank 1; rank 1 waits in ... on rank 3". The report's own line for a rank shows one
    hop; a rank stuck two groups away is found only this way. "" for one hop or none.
    skip: global ranks not to follow (the rank asking, which knows where it is)."""
    hops, seen = [], {rank, *skip}
    while pos is not None and len(hops) < CHAIN_MAX:
        b = next((b for b in (pos.get("blocked") or []) + (pos.get("p2p") or [])
                  if b.get("waiting_on")), None)
        if b is None:
            break
        on = b["waiting_on"]
        # a point-to-point wait's description names its group already
        where = "" if "seq" not in b else f" of group {b['group']!r}"
        hops.append(f"rank {rank} waits in {b['desc']}{where} on {ranks_text(on)}")
        nxt = next((w for w in on if w not in seen), None)
        if nxt is None or nxt not in b.get("ranks", ()):
            break
        seen.add(nxt)
        pos = read_position(_store_of(group, b["group"]), b["group"], b["ranks"].index(nxt))
        rank = nxt
    return "; ".join(hops) if len(hops) > 1 else ""


def peer_text(group, peer):
    """"; rank 0 meanwhile: waiting in all_reduce #12 (...) (on rank 3)", and the chain
    from there: what group rank `peer` was doing, as it last published, for a
    point-to-point timeout on it ("" where it published nothing or was in no call)."""
    if getattr(group, "store", None) is None:
        return ""
    pos = _read_position(group, peer)
    if pos is None:
        return ""
    glob = group.ranks[peer]
    parts = []
    ent = pos.get("entered")
    if ent is not None:
        on = pos.get("waiting_on")
        parts.append(f"waiting in {ent['desc']}" + (f" (on {ranks_text(on)})" if on else ""))
    if pos.get("elsewhere"):
        parts.append("busy in " + "; ".join(pos["elsewhere"]))
    if not parts:
        return ""
    text = f"; rank {glob} meanwhile: " + "; ".join(parts)
    chain = wait_chain(group, glob, pos, skip=(group.global_rank,))
    return text + (f"; following rank {glob}: {chain}" if chain else "")


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
    for glob in never:
        chain = wait_chain(group, glob, positions.get(group.ranks.index(glob)))
        if chain:
            lines.append(f"  following rank {glob}: {chain}")
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
