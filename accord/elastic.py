"""Surviving a lost rank: accord.shrink, accord.agree and accord.admit.

After a member dies, its group is broken everywhere (PeerLost, then
GroupClosed). The survivors do not need its links to go on: they meet
through the job's store (membership.py), decide together which members are
alive, and connect a new group of exactly those under a fresh name. A
process restarted by `accord run --max-restarts` (or by hand with
ACCORD_RESTART_COUNT set) waits in init_process_group() until the members
call admit(), which makes a group of the members first and the newcomers after
them.

The decisions are the store's (compare_set): whichever survivor proposes the
result first, every survivor gets that one, so every survivor builds the same
group with the same ranks (tests/test_elastic.py checks that an all_reduce of
the new group gives the same bytes on every survivor).
"""
import json
import time
import weakref
from typing import Optional

from . import membership, world
from .errors import CommTimeout, GroupClosed, PeerLost
from .group import ProcessGroup
from .options import to_seconds
from ._types import Timeout

# the longest a shrunk group may take to connect before shrink asks whether a member
# died meanwhile (seconds; connecting takes milliseconds when every member is there)
CONNECT_S = 10.0

# how many agree()/admit() calls each group has made (every member makes the same ones)
_calls = weakref.WeakKeyDictionary()


def _next_call(g, what):
    counts = _calls.setdefault(g, {})
    n = counts.get(what, 0)
    counts[what] = n + 1
    return n


def _setup(group, timeout, what):
    """(group, its world or None, deadline, seconds) for a call on group."""
    g = world.resolve_group(group)
    if not g.is_member:
        raise ValueError(f"{what}: this rank is not a member of group {g.name!r}")
    if g.store is None:
        raise ValueError(f"{what}: group {g.name!r} has no store to meet through")
    w = world.current_world() if world.is_initialized() else None
    if w is not None and g not in w.groups and g is not w.default:
        w = None
    seconds = to_seconds(timeout) or g.timeout
    return g, w, time.monotonic() + seconds, seconds


def _dead_fn(g):
    cache = {}

    def dead(r):
        # once gone, always gone; a live verdict is asked again at the next poll
        if cache.get(r):
            return True
        cache[r] = bool(membership.member_dead(g.store, g.name, r))
        return cache[r]
    return dead


def _forget_decision(g, key, n):
    """Delete this member's keys of decision n - 1 once decision n is done: every live
    member has read n - 1's result by then (it answered n after it), so a job that
    agrees every step does not grow the store by a few keys a step."""
    if n < 1:
        return
    old = f"{key}/{n - 1}"
    try:
        g.store.delete_key(f"{old}/in/{g.rank}")
        g.store.delete_key(f"{old}/out")
    except Exception:           # a store without delete_key keeps them
        pass


def _new_name(g):
    base = g.name.split("@", 1)[0]
    return f"{base}@{g.store.add('elastic/generation', 1)}"


def _world_rank(g, w):
    return w.rank if w is not None else g.global_rank


def shrink(group: Optional[ProcessGroup] = None, timeout: Timeout = None) -> ProcessGroup:
    """Make a new group of the members of `group` that are still alive (ULFM's shrink).

    Called by every surviving member after an operation on `group` failed with
    PeerLost (or GroupClosed because of one). The survivors agree through the
    job's store on who is alive, and every one of them gets a group of exactly
    those, ranked in their old order (old ranks 0, 1, 3 of four become 0, 1, 2).
    The old group is revoked first (peers still blocked in it wake up with
    PeerLost, and shrink in turn), then destroyed. Whether the peer died inside a
    collective, inside point-to-point or between calls does not matter, nor how
    many died.

    On the default group (group=None) the new group replaces the world:
    get_rank() and get_world_size() then describe it, and collectives without
    group= use it. The world's other groups follow it: one whose members all
    survived is renumbered (its ranks become the new world's, its links stay);
    one that lost a member is revoked (its calls raise GroupClosed saying so) and
    is rebuilt with shrink(subgroup) by its survivors, after the world (its ranks
    are then the survivors' ranks in the current world).

    A member counts as dead only when its process is certainly gone (the store
    holds each member's pid; a member on the same host reads /proc); a member
    that is alive but does not call shrink is waited for until the timeout.

    Args:
        group: the group to shrink (default: the world's default group).
        timeout: seconds (or a timedelta) to wait for the survivors and connect the
            new group (default: the group's timeout).

    Returns:
        The new ProcessGroup (new name, size = the survivors).

    Raises:
        accord.CommTimeout: the survivors did not all answer within the timeout;
            it names the members that neither answered nor are known dead.
        ValueError: not a member of group, or a group with no store.

    Unlike ULFM, no revoke is needed first (shrink revokes), and failure
    detection is the process's death, not a suspicion. torch has no equivalent.
    """
    g, w, deadline, _ = _setup(group, timeout, "shrink")
    is_default = w is not None and g is w.default
    while True:
        result, ranks, me = decide_survivors(g, w, deadline)
        name = result["name"]
        for r, ident in enumerate(result["ids"]):
            # every survivor's identity under the new name before any connects: one that
            # dies before it gets there is still known dead there
            g.store.set(membership.proc_key(name, r), ident)
        left = max(0.5, deadline - time.monotonic())
        try:
            new = world.make_member_group(name, ranks, me, g.store, g.addr,
                                          min(left, CONNECT_S), g.options)
        except (PeerLost, GroupClosed, CommTimeout):
            if not any(membership.member_dead(g.store, name, r)
                       for r in range(len(result["ids"]))):
                raise
            # a survivor died after it answered, and the new group could not connect:
            # shrink that one in turn (it has a name, a store and its members'
            # identities, but no links)
            stub = ProcessGroup(result["name"], ranks, me, timeout=g.timeout,
                                options=g.options)
            stub.store, stub.addr = g.store, g.addr
            _finish(g, w, stub, is_default, result["alive"])
            g = stub
            continue
        new.timeout = g.timeout
        _finish(g, w, new, is_default, result["alive"])
        return new


def decide_survivors(g, w, deadline):
    """The survivors' shared decision: (result, the new group's ranks, this rank's
    global rank in it)."""
    if g.broken_by is None:
        g.revoke(PeerLost(f"rank {g.global_rank}: group {g.name!r} is being shrunk "
                          f"(accord.shrink after a lost member)"))

    def propose(vals):
        alive = sorted(vals)
        vals = {r: json.loads(v) for r, v in vals.items()}
        return json.dumps({"name": _new_name(g), "alive": alive,
                           "world": [vals[r]["world"] for r in alive],
                           "ids": [vals[r]["id"] for r in alive]}).encode()

    mine = json.dumps({"world": _world_rank(g, w), "id": membership.identity()}).encode()
    out = membership.decide(g.store, f"{g.name}/shrink", g.size, g.rank, mine,
                            _dead_fn(g), propose, deadline,
                            f"rank {g.global_rank}: accord.shrink of group {g.name!r}")
    result = json.loads(out)
    alive = result["alive"]
    if g.rank not in alive:
        raise PeerLost(f"rank {g.global_rank}: the other members of group {g.name!r} "
                       f"judged this rank dead and shrank without it")
    if w is not None and g is w.default:
        return result, range(len(alive)), alive.index(g.rank)
    return result, result["world"], _world_rank(g, w)


def _finish(old, w, new, is_default, alive=()):
    """Make `new` the group that replaces `old`. On the default group, alive lists the
    old world ranks that are in the new world, in order (the new world's ranks 0, 1, ...):
    every other group is carried into the new world's numbering, or revoked if it lost a
    member."""
    if w is not None:
        w.groups.append(new)
        if is_default:
            world.replace_default(w, new)
            for g in world.renumber_groups(w, {old_rank: i for i, old_rank in enumerate(alive)}):
                if g is old:
                    continue
                gone = [r for r in g.ranks if r not in alive]
                g.revoke(PeerLost(
                    f"rank {w.rank}: group {g.name!r} lost member{'s' * (len(gone) > 1)} "
                    f"{', '.join(map(str, gone))} (ranks of the world before it shrank): "
                    f"rebuild it with accord.shrink(group) on its surviving members, or make "
                    f"a new one with new_group", peer=gone[0]))
    world.forget_group(w, old)


def agree(flag: bool, group: Optional[ProcessGroup] = None, timeout: Timeout = None) -> bool:
    """A fault-tolerant AND of `flag` over the live members of `group` (ULFM's agree).

    Every member calls it (in the same order of agree calls on the group). It
    completes even if members die before or during it: the answer is True
    exactly when every member that took part passed True, and every survivor
    gets the same answer. It works on a broken group too (it meets through the
    store, not the group's links), so "should every rank commit this step?"
    can be asked after a failure, before shrink.

    Args:
        flag: this member's vote.
        group: the group (default: the world's default group).
        timeout: seconds (or a timedelta) to wait for the live members (default:
            the group's timeout).

    Returns:
        The AND of the votes of the members that took part.

    Raises:
        accord.CommTimeout: a member that is alive did not vote before the
            timeout (it is named).
        ValueError: not a member of group.

    Unlike ULFM's MPIX_Comm_agree, it does not also report which members
    failed (use shrink for that); torch has no equivalent. Costs a few store
    round trips: use it at step boundaries, not per tensor.
    """
    g, w, deadline, _ = _setup(group, timeout, "agree")
    n = _next_call(g, "agree")
    out = membership.decide(g.store, f"{g.name}/agree/{n}", g.size, g.rank,
                            b"1" if flag else b"0", _dead_fn(g),
                            lambda vals: b"1" if all(v == b"1" for v in vals.values()) else b"0",
                            deadline, f"rank {g.global_rank}: accord.agree #{n} on group "
                                      f"{g.name!r}")
    _forget_decision(g, f"{g.name}/agree", n)
    return out == b"1"


def admit(group: Optional[ProcessGroup] = None, timeout: Timeout = 0) -> ProcessGroup:
    """Let processes waiting to join into the job, at a step boundary.

    Every member of the world's default group calls it at the same point.
    Processes restarted by `accord run --max-restarts N` (or started by hand with
    ACCORD_RESTART_COUNT=1 and the job's rendezvous settings) wait in
    init_process_group() for it. The members agree on who is waiting and make a
    new default group: the old members first, in their order, the newcomers
    after them (a newcomer's rank is therefore not the rank of the process it
    replaces). A member found dead meanwhile is left out, as shrink would.
    Then call `broadcast_state(model, src=0)` to give the newcomers the state.

    Args:
        group: the default group (None); other groups cannot take newcomers.
        timeout: seconds to wait for at least one process to be waiting
            (default 0: only those already waiting).

    Returns:
        The new default group, or `group` itself, at once, when nobody is
        waiting and no member died.

    Raises:
        accord.CommTimeout: a live member did not call admit within the group's
            timeout.
        accord.PeerLost: a member or a newcomer died while the new group was
            being connected; the old group is still the default group (shrink it
            if a member died, or call admit again).
        ValueError: group is not the default group (a newcomer joins the
            world, and no other group: make those that should include it with
            new_group after admit).

    torch has no equivalent (torchrun restarts every rank instead); torchft's
    quorum is the closest.
    """
    g, w, deadline, _ = _setup(group, None, "admit")
    if w is None or g is not w.default:
        raise ValueError(
            f"admit(group={g.name!r}): a newcomer joins the job as a whole (its "
            f"init_process_group() makes it a member of the world, not of any other group): "
            f"call accord.admit() without group=, then make the groups that should include "
            f"it with new_group (every rank calls it, the newcomers too)")
    wait = to_seconds(timeout) if timeout else 0.0
    store = g.store
    n = _next_call(g, "admit")
    upto = int(store.get(membership.UPTO)) if store.check([membership.UPTO]) else 1
    until = time.monotonic() + wait
    while True:
        tickets = store.add(membership.TICKETS, 0)
        if tickets >= upto or time.monotonic() >= until:
            break
        time.sleep(0.05)

    def propose(vals):
        contributions = {r: json.loads(v) for r, v in vals.items()}
        last = max(c["tickets"] for c in contributions.values())
        new = []
        for t in range(upto, last + 1):
            key = membership.ticket_key(t)
            end = time.monotonic() + 2.0      # it takes its ticket, then writes who it is
            while not store.check([key]) and time.monotonic() < end:
                time.sleep(0.01)
            if store.check([key]) and membership.is_dead(store.get(key)) is not True:
                new.append(t)
        alive = sorted(vals)
        ids = [contributions[r]["id"] for r in alive] + [
            store.get(membership.ticket_key(t)).decode() for t in new]
        same = not new and len(alive) == g.size
        return json.dumps({"same": same, "upto": last + 1, "alive": alive, "new": new,
                           "name": None if same else _new_name(g),
                           "next_group_id": w.next_group_id, "ids": ids}).encode()

    out = membership.decide(store, f"{g.name}/admit/{n}", g.size, g.rank,
                            json.dumps({"tickets": tickets, "id": membership.identity()}).encode(),
                            _dead_fn(g), propose,
                            deadline, f"rank {g.global_rank}: accord.admit #{n} on group "
                                      f"{g.name!r}")
    result = json.loads(out)
    store.set(membership.UPTO, str(result["upto"]))
    _forget_decision(g, f"{g.name}/admit", n)
    if result["same"]:
        return g
    alive, new = result["alive"], result["new"]
    if g.rank not in alive:
        raise PeerLost(f"rank {g.global_rank}: the other members of group {g.name!r} "
                       f"judged this rank dead and went on without it")
    size = len(alive) + len(new)
    for r, ident in enumerate(result["ids"]):
        # known before anyone connects: a member or newcomer that dies first stops the
        # connection at once (PeerLost; the old group is then still this rank's)
        store.set(membership.proc_key(result["name"], r), ident)
    for i, t in enumerate(new):
        store.set(membership.admitted_key(t), json.dumps(
            {"name": result["name"], "size": size, "rank": len(alive) + i,
             "next_group_id": result["next_group_id"]}))
    me = alive.index(g.rank)
    new_group = world.make_member_group(result["name"], range(size), me, store, g.addr,
                                        max(0.5, deadline - time.monotonic()), g.options)
    new_group.timeout = g.timeout
    _finish(g, w, new_group, True, alive)
    return new_group
