"""The process's world: init/destroy_process_group, groups, and who is who in them.

What `init_process_group` establishes (the job's store, this rank, the world
size, the address peers reach it at) lives here, with every group made from
it: `new_group`, `new_subgroups`, the rank queries, and `connect`, which gives a
member group its transports (and, for a group spanning hosts with several ranks
on one, its hierarchy). `resolve_group` turns a `group=` argument into a group
(`not_member` is what a call does on a group this rank is not in);
`group_from_store` makes a standalone group over someone else's store
(accord.torch). The collectives (api.py) build on this; nothing here knows them.
"""
from __future__ import annotations

import atexit
import logging
import sys
import threading
import weakref
from typing import Any, List, Optional, Sequence, Tuple

from . import debug, hierarchy, membership, rendezvous
from .errors import AccordError, Desync, GroupClosed, PeerLost
from .group import ProcessGroup
from .options import Options, to_seconds
from .reduceops import quiet_overflow
from .netif import local_address
from .transport.factory import build_transport, connect_p2p
from ._types import Timeout

_log = logging.getLogger("accord")


class _World:
    """What init_process_group established for this process."""

    def __init__(self, options, store, raw_store, rank, size, addr, timeout):
        self.options, self.store, self.raw_store = options, store, raw_store
        self.rank, self.size, self.addr, self.timeout = rank, size, addr, timeout
        self.groups = []
        self.next_group_id = 0
        self.default = None
        self.lock = threading.Lock()


_world = None


def _require_world():
    if _world is None:
        raise ValueError("the default process group has not been initialized: call "
                         "accord.init_process_group() first")
    return _world


def is_initialized() -> bool:
    """True between `init_process_group()` and `destroy_process_group()`, as in torch."""
    return _world is not None


# -- groups -------------------------------------------------------------------

def connect(g, store, addr, timeout, p2p=True):
    """Give member group g its transport, meeting its peers through store.

    p2p: also its point-to-point plane (groups made for a hierarchy's phases
    carry collectives only)."""
    import time
    quiet_overflow()        # again: a warnings filter made at import may be gone
    g.store = store         # debug/monitor.py publishes this rank's position there
    g.addr = addr           # where a group shrunk from this one connects (elastic.py)
    deadline = time.monotonic() + timeout
    if p2p:
        # who this member is, so survivors can tell it died (membership.py)
        store.set(membership.proc_key(g.name, g.rank), membership.identity())
    # shared memory when every member shares this host, TCP otherwise (transport/factory.py)
    g.transport = build_transport(store, g.name, g.rank, g.size, g.describe_rank, g.options,
                                  addr, deadline)
    if p2p and g.size > 1:
        g.attach_p2p(connect_p2p(store, g.name, g.rank, g.size, g.describe_rank, g.transport,
                                 addr, deadline))
    hosts = g.transport.hosts
    if hosts is not None and hierarchy.wanted(hosts):
        # several hosts, several ranks on one: shared memory inside each host as well
        g.hier = hierarchy.build(g, hosts,
                                 lambda sub: connect(sub, store, addr, timeout, p2p=False))


def _build_group(w, name, ranks, timeout):
    g = ProcessGroup(name, ranks, w.rank, timeout=timeout, options=w.options)
    if g.is_member:
        connect(g, w.store, w.addr, timeout)
    w.groups.append(g)
    return g


def group_from_store(store, rank, size, timeout=None, name="default", ranks=None,
                     master_host=None, connect_timeout=None):
    """A standalone member group over a store someone else set up (accord.torch, accord.ray).

    store: anything with set/get (bytes)/add/wait, e.g. a torch.distributed
    Store, already private to this group. rank/size are group-local; ranks
    are the members' global ranks (used in messages), default range(size).
    master_host: a host every member reaches (the store's); this process listens
    on the interface that routes there (default: MASTER_ADDR, else loopback).
    connect_timeout: how long connecting to the peers may take (default: timeout,
    the group's default for its collectives).
    The group is not part of accord's own world: its owner destroys it.
    """
    options = Options.from_env()
    timeout = to_seconds(timeout) or options.timeout
    ranks = list(range(size)) if not ranks else [int(r) for r in ranks]
    if len(ranks) != size or not 0 <= rank < size:
        raise ValueError(f"rank {rank} / size {size} / ranks {ranks} do not agree")
    g = ProcessGroup(name, ranks, ranks[rank], timeout=timeout, options=options)
    connect(g, store, local_address(options, master_host or _master_host(None)),
            to_seconds(connect_timeout) or timeout)
    return g


def init_process_group(backend: Optional[str] = "auto", init_method: Optional[str] = None,
                       timeout: Timeout = None, world_size: int = -1, rank: int = -1,
                       store: Any = None, group_name: str = "", pg_options: Any = None,
                       device_id: Any = None) -> None:
    """Join the job: find this process's rank and its peers, and build the default group.

    Under `accord run`, torchrun, mpirun/mpiexec or srun the rank and world size
    come from the environment, so `init_process_group()` needs no arguments.

    Args:
        backend: "auto" or "accord" (accord always runs its own transports: shared
            memory between ranks of one host, TCP between hosts). torch's "gloo" or
            "nccl" are refused with a ValueError.
        init_method: "env://" (default: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE),
            "tcp://host:port" or "file:///path", as in torch.
        timeout: the default timeout of every collective of the job, in seconds
            or a timedelta (default: `ACCORD_TIMEOUT`, else 1800 s).
        world_size: the number of ranks (-1: from the environment).
        rank: this process's rank (-1: from the environment).
        store: a store (accord's, or torch's TCPStore/FileStore) to meet through
            instead of init_method; rank and world_size are then required.
        group_name: accepted for torch compatibility and ignored.
        pg_options: accepted for torch compatibility and ignored.
        device_id: accepted for torch compatibility and ignored.

    Raises:
        ValueError: called twice, an unknown backend, both init_method and store,
            or a rank/world size that cannot be found.
        accord.CommTimeout: the peers did not all arrive within the timeout.
    """
    global _world
    if _world is not None:
        raise ValueError("init_process_group was already called in this process; call "
                         "destroy_process_group() first")
    if backend not in (None, "auto", "accord", "tcp", "cpu:accord"):
        raise ValueError(f"backend: accord runs its own transports; expected 'auto' or 'accord', "
                         f"got {backend!r}")
    options = Options.from_env()
    timeout = to_seconds(timeout) or options.timeout
    # before any connection: a bad ACCORD_SOCKET_IFNAME is a ValueError on every rank
    addr = local_address(options, _master_host(init_method))
    if store is not None:
        if init_method is not None:
            raise ValueError("pass either init_method or store, not both")
        if rank is None or rank < 0 or world_size is None or world_size < 1:
            raise ValueError("with store=, rank= and world_size= are required")
        rank, world_size = rendezvous.rank_and_size(rank, world_size)
        raw = store
    else:
        init_method = init_method or "env://"
        rank, world_size = rendezvous.rank_and_size(rank, world_size)
        raw = rendezvous.make_store(init_method, rank, world_size, timeout,
                                    options.launcher_store_addr,
                                    restarted=options.restart_count > 0)
    restart = options.restart_count
    try:
        if restart and store is None:
            w = _join(options, raw, world_size, addr, timeout)
        else:
            prefixed = rendezvous.job_prefix(raw, world_size)
            w = _World(options, prefixed, raw, rank, world_size, addr, timeout)
            w.default = _build_group(w, "default", range(world_size), timeout)
    except BaseException:
        if store is None:
            raw.close()
        raise
    w.owns_store = store is None
    _world = w


def _join(options, raw, world_size, addr, timeout):
    """A restarted process (ACCORD_RESTART_COUNT > 0): wait until the running job's
    ranks admit it (accord.admit), then connect to the group they made with it."""
    from .store import PrefixStore
    # the generation the job's first processes made (rendezvous.job_prefix), not a new one
    generation = max(0, raw.add("accord/init", 0) - 1) // world_size
    store = PrefixStore(f"accord/{generation}", raw)
    record = membership.wait_to_join(store, timeout)
    w = _World(options, store, raw, record["rank"], record["size"], addr, timeout)
    w.next_group_id = record["next_group_id"]
    import time
    g = ProcessGroup(record["name"], range(record["size"]), record["rank"], timeout=timeout,
                     options=options)
    # a member that dies meanwhile ends the wait for its address at once
    connect(g, membership.Watchful(store, g.name, g.size, time.monotonic() + timeout), addr,
            timeout)
    g.store = store
    w.groups.append(g)
    w.default = g
    return w


def current_world():
    """What init_process_group established (ValueError before it): for elastic.py."""
    return _require_world()


def make_member_group(name, ranks, global_rank, store, addr, timeout, options):
    """A connected member group under `name`, over `store` (elastic.py's new groups);
    on a failure to connect, its peers hear of it and what was made is closed."""
    import time
    g = ProcessGroup(name, ranks, global_rank, timeout=timeout, options=options)
    try:
        # waits for peers' addresses end at once if one of them is dead
        connect(g, membership.Watchful(store, name, len(g.ranks), time.monotonic() + timeout),
                addr, timeout)
        g.store = store
    except BaseException:
        g.revoke(PeerLost(f"rank {global_rank}: group {name!r} could not be connected"))
        try:
            g.destroy(check=False)
        except Exception:
            pass
        raise
    return g


def replace_default(w, g):
    """Make member group g the world's default group: get_rank()/get_world_size() and
    calls without group= then use it (accord.shrink/admit on the default group)."""
    with w.lock:
        w.default = g
        w.rank = g.rank
        w.size = g.size


def renumber_groups(w, new_rank_of):
    """After the default group was replaced by one of some of its members (accord.shrink,
    accord.admit), the world's other groups: each whose members are all in the new world
    gets their new global ranks (so src=, dst=, get_global_rank and the like mean the new
    world's ranks, as everywhere else); the groups that lost a member are returned, for
    the caller to revoke.

    new_rank_of: old global rank -> new global rank, for every member still there."""
    lost = []
    for g in list(w.groups):
        if g is w.default:
            continue
        if all(r in new_rank_of for r in g.ranks):
            g.renumber(new_rank_of, w.rank)
        else:
            lost.append(g)
    return lost


def forget_group(w, g):
    """Leave g (broken or replaced) without checking for unread messages."""
    if w is not None and g in w.groups:
        w.groups.remove(g)
    try:
        g.destroy(check=False)
    except Exception:
        pass


def _master_host(init_method):
    import os
    import urllib.parse
    if init_method and init_method.startswith("tcp://"):
        return urllib.parse.urlparse(init_method).hostname
    if init_method and init_method.startswith("file://"):
        return "127.0.0.1"
    return os.environ.get("MASTER_ADDR", "127.0.0.1")


def new_group(ranks: Optional[Sequence[int]] = None, timeout: Timeout = None,
              backend: Optional[str] = None, pg_options: Any = None,
              use_local_synchronization: bool = False,
              group_desc: Optional[str] = None) -> ProcessGroup:
    """Create a group of some of the job's ranks.

    As in torch, every rank of the job calls it, with the same ranks and in the
    same order of group creations, members and non-members alike.

    Args:
        ranks: global ranks of the members (default: every rank); order does not
            matter.
        timeout: the default timeout of the group's collectives (default: the
            job's).
        backend: accepted for torch compatibility and ignored.
        pg_options: accepted for torch compatibility and ignored.
        use_local_synchronization: accepted for torch compatibility and ignored.
        group_desc: a name shown in the group's error messages.

    Returns:
        The new `ProcessGroup`. On a non-member it is a group whose collectives
        return None at once.

    Raises:
        ValueError: not initialized, duplicate ranks, ranks outside the world or
            an empty list.
        TypeError: ranks is not a list of ints.
    """
    w = _require_world()
    if ranks is None:
        ranks = list(range(w.size))
    try:
        ranks = [int(r) for r in ranks]
    except (TypeError, ValueError):
        raise TypeError(f"ranks: expected a list of ints, got {ranks!r}") from None
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"ranks: duplicate ranks in {ranks}")
    bad = [r for r in ranks if not 0 <= r < w.size]
    if bad:
        raise ValueError(f"ranks: {bad} outside the world of {w.size} ranks")
    if not ranks:
        raise ValueError("ranks: a group needs at least one rank")
    timeout = to_seconds(timeout) or w.timeout
    with w.lock:
        gid = w.next_group_id = w.next_group_id + 1
    name = f"group{gid}" + (f":{group_desc}" if group_desc else "")
    return _build_group(w, name, sorted(ranks), timeout)


def new_subgroups(group_size: Optional[int] = None,
                  group: Optional[ProcessGroup] = None) -> Tuple[ProcessGroup, List[ProcessGroup]]:
    """Split the world into consecutive groups of `group_size` ranks, as torch does.

    Every rank calls it. Ranks 0..group_size-1 form the first group, and so on.

    Args:
        group_size: ranks per group; it must divide the world size (torch's
            default of one group per host is not implemented: pass it).
        group: accepted for torch compatibility; the world is split.

    Returns:
        (this rank's group, every group in order).

    Raises:
        ValueError: group_size missing or not a divisor of the world size.
    """
    w = _require_world()
    if group_size is None or group_size < 1 or w.size % group_size:
        raise ValueError(f"group_size: must divide the world size {w.size}, got {group_size}")
    groups = [new_group(list(range(s, s + group_size))) for s in range(0, w.size, group_size)]
    return groups[w.rank // group_size], groups


def destroy_process_group(group: Optional[ProcessGroup] = None) -> None:
    """Destroy one group, or (None) every group, and leave the job.

    Leaving says goodbye on every link, so peers know this exit is not a crash.
    It is also run at interpreter exit.

    Args:
        group: the group to destroy (default: every group, then the job).

    Raises:
        accord.Desync: a peer sent a collective message that no call of this rank
            read: the ranks made different calls (for example this rank skipped a
            collective, or two ranks each thought they were a broadcast's root).
            Every group is left even so. Unlike torch, which cannot tell.
    """
    global _world
    w = _world
    if w is None:
        return
    if group is not None and group is not w.default:
        if group in w.groups:
            w.groups.remove(group)
        group.destroy()
        return
    first = None
    if w.default is not None and w.default.broken_by is None:
        try:        # a restarted process still waiting to be admitted need not wait
            w.store.set(membership.ENDED, b"1")
        except Exception:
            pass
    # after an error, messages left unread elsewhere are its echo, not news
    failed = [g._closed for g in w.groups
              if g._closed is not None and not isinstance(g._closed, GroupClosed)]
    check = not failed
    for g in reversed(w.groups):
        if failed and g._closed is None and g.transport is not None:
            # peers still waiting on this rank in another group hear why it leaves,
            # rather than only that it left
            g._break(failed[0])
        try:
            g.destroy(check)
        except Desync as e:     # calls nobody matched: still leave every group
            first = first or e
    _world = None
    if w.owns_store:
        w.raw_store.close()
    if first is not None:
        raise first


# the exception the program is dying of (see note_uncaught), told to peers at exit
_dying = None
_previous_excepthook = sys.excepthook


def note_uncaught(exc):
    """The program is ending with exc (an uncaught exception): at exit, peers hear
    why this rank leaves. Called by sys.excepthook and by `accord run`'s child."""
    global _dying
    _dying = exc


def _excepthook(tp, value, tb):
    note_uncaught(value)
    _previous_excepthook(tp, value, tb)


sys.excepthook = _excepthook


@atexit.register
def _leave_at_exit():
    # say goodbye on every link, so peers know this exit was not a crash; a program
    # dying of an exception tells them why instead (and its peers' unread messages
    # are that exception's echo, not a Desync worth printing)
    w = _world
    if w is not None and isinstance(_dying, Exception) and not isinstance(_dying, AccordError) \
            and w.default is not None and w.default._closed is None:
        w.default._break(PeerLost(f"rank {w.rank} left the job: its program raised "
                                  f"{type(_dying).__name__}: {_dying}"))
    try:
        destroy_process_group()
    except Desync as e:
        # the program made no call after the mismatch: this is the last chance to say it
        sys.stderr.write(f"accord: Desync: {e}\n")
    except Exception:
        pass


def resolve_group(group):
    """group itself (checked), or the default group for None."""
    if group is not None:     # standalone groups (accord.torch) need no world
        if not isinstance(group, ProcessGroup):
            raise TypeError(f"group: expected an accord ProcessGroup (from new_group) or None, "
                            f"got {type(group).__name__}")
        return group
    return _require_world().default


# Groups this process was told it is not a member of (a WeakSet: a destroyed
# group is forgotten with it).
_told_not_member = weakref.WeakSet()


def not_member(g, opname):
    """A call on a group this rank is not a member of: it does nothing, as in torch.

    torch says nothing, and a rank that expected the call to run then waits or
    computes on data that never came. Said once per group (a non-member may
    skip every call of a training loop), at INFO: the rule is torch's, not an
    error, and ACCORD_DEBUG=INFO/DETAIL (or the user's logging) shows it.
    """
    if g not in _told_not_member:
        _told_not_member.add(g)
        if _log.isEnabledFor(logging.INFO):
            where = debug.call_site()[1]
            _log.info("rank %s is not a member of group %r (ranks %s): its %s%s does "
                      "nothing, as in torch.distributed, and so will its later calls on that "
                      "group (said once per group)", g.global_rank, g.name, g.ranks, opname,
                      f" at {where}" if where else "")
    return None


def get_rank(group: Optional[ProcessGroup] = None) -> int:
    """This process's rank in `group` (default: its global rank); -1 if not a member.

    Raises:
        ValueError: the default group is not initialized.
        TypeError: group is not an accord ProcessGroup.
    """
    return resolve_group(group).rank


def get_world_size(group: Optional[ProcessGroup] = None) -> int:
    """The number of ranks of `group` (default: the job); -1 on a non-member, as torch.

    Raises:
        ValueError: the default group is not initialized.
        TypeError: group is not an accord ProcessGroup.
    """
    g = resolve_group(group)
    return g.size if g.is_member else -1


def get_group_rank(group: Optional[ProcessGroup], global_rank: int) -> int:
    """The rank within `group` of the process whose global rank is `global_rank`.

    Raises:
        ValueError: global_rank is not a member of group.
    """
    g = resolve_group(group)
    return g.group_rank_of(global_rank, "global_rank")


def get_global_rank(group: Optional[ProcessGroup], group_rank: int) -> int:
    """The global rank of the process that is `group_rank` within `group`.

    Raises:
        ValueError: group_rank is outside 0 .. size-1.
    """
    g = resolve_group(group)
    if not 0 <= group_rank < g.size:
        raise ValueError(f"group_rank={group_rank} outside group {g.name!r} of size {g.size}")
    return g.ranks[group_rank]


def get_process_group_ranks(group: Optional[ProcessGroup] = None) -> List[int]:
    """The global ranks of `group`'s members, in group-rank order."""
    return list(resolve_group(group).ranks)


def default_group():
    """The default group of accord's own world (ValueError before init_process_group)."""
    return _require_world().default
