"""Who is still alive, and one decision every survivor shares: the store side of
accord.shrink, accord.agree and accord.admit (elastic.py), and of a restarted
process waiting to be admitted (world.py).

Nothing here uses a group's links, which a death has broken: every member
meets through the job's store, which outlives any rank (`accord run` hosts it
in the launcher; without one, rank 0 serves it from a process of its own,
store_process.py).

A **decision** (`decide`) has a key. Each member that takes part writes its
contribution under it; once every member has either answered or is known to
be dead, the first member to propose a result fixes it with the store's
compare_set, and every member returns that one result. A member that dies
half way is either counted (it answered before it died) or not (it did not),
but every survivor sees the same result, whichever member proposed it.

**Dead** means the process is gone, nothing weaker: each member of a group
publishes its identity (boot id, pid namespace, pid, start time) when the group
is made, and a member on the same host (the same kernel and pid namespace)
reads /proc to tell whether that process still runs (a zombie counts as
gone). For a member on another host, `accord run --keep-going` (its launcher
saw the process exit) marks it ended in the job's store. A process that merely stopped answering is waited for until the
deadline and then named in a CommTimeout, never silently dropped: a rank
judged dead while alive would go on as a group of its own.
"""
import json
import os
import time

from .errors import CommTimeout
from .options import Options

# how often an undecided decision looks at the store again (seconds): short first,
# since the survivors of one failure arrive within a few ms of one another
_POLLS = (0.002, 0.005, 0.01, 0.02, 0.05)


def _read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _host():
    """This host's identity: its kernel's boot id and this pid namespace (and
    ACCORD_HOST_ID, with which tests simulate several hosts on one machine)."""
    try:
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        ns = 0
    boot = _read("/proc/sys/kernel/random/boot_id")
    return f"{boot}:{ns}:{Options.from_env().host_id}" if boot else ""


def _start_time(pid):
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), its
    state letter; (None, None) once it is gone."""
    stat = _read(f"/proc/{pid}/stat")
    if not stat:
        return None, None
    fields = stat.rsplit(")", 1)[-1].split()
    try:
        return fields[19], fields[0]
    except IndexError:
        return None, None


def identity(pid=None):
    """This process's identity, as published for its groups: host/pid/start/slot, where
    slot is ACCORD_LAUNCH_SLOT (what `accord run` calls this process, "" without it)."""
    pid = os.getpid() if pid is None else pid
    start, _ = _start_time(pid)
    return f"{_host()}/{pid}/{start or '?'}/{Options.from_env().launch_slot}"


def ended_key(slot):
    """Where `accord run` marks that the process it calls slot has exited (the job's
    store, unprefixed): how survivors on other hosts learn of a death."""
    return f"accord/ended/{slot}"


def _parse(ident):
    if isinstance(ident, bytes):
        ident = ident.decode("utf-8", "replace")
    parts = ident.split("/")
    if len(parts) == 3:
        parts.append("")
    if len(parts) != 4:
        return None
    host, pid, start, slot = parts
    try:
        return host, int(pid), start, slot
    except ValueError:
        return None


def is_dead(ident):
    """True when the process `ident` names is certainly gone; False when it runs;
    None when this host cannot tell (another host, or no identity)."""
    if not ident:
        return None
    parsed = _parse(ident)
    if parsed is None:
        return None
    host, pid, start, _ = parsed
    if not host or host != _host():
        return None
    now, state = _start_time(pid)
    if now is None or state in ("Z", "X", "x"):
        return True
    return start != "?" and now != start


def proc_key(group_name, group_rank):
    """Where a member of a group publishes its identity."""
    return f"{group_name}/proc/{group_rank}"


def member_dead(store, group_name, group_rank):
    """is_dead() of a group member, from the identity it published."""
    key = proc_key(group_name, group_rank)
    try:
        if not store.check([key]):
            return None
        ident = store.get(key)
        dead = is_dead(ident)
        if dead is None:
            # another host: its launcher says when the process exited
            parsed = _parse(ident)
            base = getattr(store, "underlying_store", None)
            if parsed and parsed[3] and base is not None and base.check([ended_key(parsed[3])]):
                return True
        return dead
    except Exception:
        return None


def decide(store, key, size, me, value, dead, propose, deadline, what):
    """Take part in the decision `key` among members 0..size-1 as member `me`.

    value: this member's contribution (bytes). dead(r): True when member r is
    certainly gone. propose({member: value}): the result (bytes) from the
    contributions of every member that answered, made by whichever member
    first sees every member decided. Returns the one result every member gets.

    Raises CommTimeout (naming the members that neither answered nor are known
    dead) when no result is fixed by deadline (time.monotonic()).
    """
    out = f"{key}/out"
    store.set(f"{key}/in/{me}", value)
    vals = {me: value}
    gone = set()
    polls = 0
    while True:
        if store.check([out]):
            return store.get(out)
        missing = []
        for r in range(size):
            if r in vals or r in gone:
                continue
            k = f"{key}/in/{r}"
            if store.check([k]):
                vals[r] = store.get(k)
            elif dead(r):
                # checked again: it may have answered just before it died
                if store.check([k]):
                    vals[r] = store.get(k)
                else:
                    gone.add(r)
            else:
                missing.append(r)
        if not missing:
            # once judged dead a member stays dead; one that answered counts
            return store.compare_set(out, b"", propose(dict(vals)))
        if time.monotonic() >= deadline:
            if store.check([out]):
                return store.get(out)
            answered = ", ".join(str(r) for r in sorted(vals)) or "none"
            dead_text = (f"; members known dead: {', '.join(str(r) for r in sorted(gone))}"
                         if gone else "")
            raise CommTimeout(
                f"{what}: member{'s' * (len(missing) > 1)} "
                f"{', '.join(str(r) for r in missing)} did not answer before the deadline and "
                f"{'are' if len(missing) > 1 else 'is'} not known to be dead (members that "
                f"answered: {answered}{dead_text}). Every surviving member must make the "
                f"same call; a process on another host that stopped answering is waited for, "
                f"never dropped")
        time.sleep(_POLLS[min(polls, len(_POLLS) - 1)])
        polls += 1


# -- newcomers --------------------------------------------------------------------

TICKETS = "elastic/join/tickets"     # how many processes ever asked to join (1-based tickets)
UPTO = "elastic/join/upto"           # the first ticket no admit has considered yet
ENDED = "elastic/ended"              # a rank left the job normally: nobody will admit now


def ticket_key(ticket):
    return f"elastic/join/{ticket}"


def admitted_key(ticket):
    return f"elastic/join/{ticket}/admitted"


def wait_to_join(store, timeout):
    """A restarted process asks to join the job's store and waits for an admit.

    Returns the admission record (a dict: name, size, rank, next_group_id)."""
    ticket = store.add(TICKETS, 1)
    store.set(ticket_key(ticket), identity())
    key = admitted_key(ticket)
    deadline = time.monotonic() + timeout
    polls = 0
    while not store.check([key]):
        if store.check([ENDED]) and not store.check([key]):
            import sys
            sys.stderr.write(f"accord: the job's ranks finished before this restarted process "
                             f"(ticket {ticket}) was admitted; it exits with nothing to do\n")
            raise SystemExit(0)
        if time.monotonic() >= deadline:
            raise CommTimeout(f"this restarted process (ticket {ticket}) was not admitted "
                              f"within {timeout:g} s: the job's ranks let newcomers in only "
                              f"when they call accord.admit()")
        time.sleep(_POLLS[min(polls, len(_POLLS) - 1)] * 5)
        polls += 1
    return json.loads(store.get(key))


class Watchful:
    """A store seen by a group being connected whose members may die meanwhile.

    Connecting a group waits in the store for every member's address; a member
    that died before it wrote its own would be waited for until the store's
    timeout. Here every wait and blocking get looks, while it waits, at whether
    a member of the group is dead (member_dead) and raises PeerLost naming it,
    so a shrink can go on without it at once. Everything else is the store's.
    """

    def __init__(self, store, group_name, size, deadline):
        self._s, self._name, self._size, self._deadline = store, group_name, size, deadline

    def __getattr__(self, attr):
        return getattr(self._s, attr)

    def _watch(self, keys):
        polls = 0
        while not self._s.check(keys):
            for r in range(self._size):
                if member_dead(self._s, self._name, r):
                    from .errors import PeerLost
                    raise PeerLost(f"member {r} of group {self._name!r} died while the group "
                                   f"was being connected", peer=r)
            if time.monotonic() >= self._deadline:
                raise CommTimeout(f"group {self._name!r}: keys {keys[:3]} did not appear in "
                                  f"the store before the deadline")
            time.sleep(_POLLS[min(polls, len(_POLLS) - 1)])
            polls += 1

    def wait(self, keys, timeout=None):
        self._watch([keys] if isinstance(keys, str) else list(keys))

    def get(self, key, timeout=None):
        self._watch([key])
        return self._s.get(key)
