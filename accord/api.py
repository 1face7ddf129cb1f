"""The free functions of the public API (process groups and collectives).

Each one checks its arguments on the calling rank before any byte moves,
turns tensors into `Buf`s, and hands a closure to its group, which runs it in
issue order. Ranks are global in arguments (src, dst) and group-local inside.
"""
from __future__ import annotations

import atexit
import logging
import sys
import threading
import weakref
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from . import debug, hierarchy, plans, rendezvous
from .algorithms import rooted, split
from .algorithms.reduction import piece_elems, ring_reduce_scatter
from .algorithms.table import choose
from .buffers import as_buf
from .errors import Desync, GroupClosed
from .group import ProcessGroup
from .options import Options, to_seconds
from .reduceops import ReduceOp, as_reduce_op, check_op, finish_avg
from .transport.connect import local_address
from .transport.factory import build_transport, connect_p2p
from .work import Work
from ._types import Tensor, Timeout

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

def _connect(g, store, addr, timeout, p2p=True):
    """Give member group g its transport, meeting its peers through store.

    p2p: also its point-to-point plane (groups made for a hierarchy's phases
    carry collectives only)."""
    import time
    g.store = store         # debug.py publishes this rank's position there
    deadline = time.monotonic() + timeout
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
                                 lambda sub: _connect(sub, store, addr, timeout, p2p=False))


def _build_group(w, name, ranks, timeout):
    g = ProcessGroup(name, ranks, w.rank, timeout=timeout, options=w.options)
    if g.is_member:
        _connect(g, w.store, w.addr, timeout)
    w.groups.append(g)
    return g


def _group_from_store(store, rank, size, timeout=None, name="default", ranks=None):
    """A standalone member group over a store someone else set up (accord.torch).

    store: anything with set/get (bytes)/add/wait, e.g. a torch.distributed
    Store, already private to this group. rank/size are group-local; ranks
    are the members' global ranks (used in messages), default range(size).
    The group is not part of accord's own world: its owner destroys it.
    """
    options = Options.from_env()
    timeout = to_seconds(timeout) or options.timeout
    ranks = list(range(size)) if not ranks else [int(r) for r in ranks]
    if len(ranks) != size or not 0 <= rank < size:
        raise ValueError(f"rank {rank} / size {size} / ranks {ranks} do not agree")
    g = ProcessGroup(name, ranks, ranks[rank], timeout=timeout, options=options)
    _connect(g, store, options.addr or local_address(_master_host(None)), timeout)
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
                                    options.launcher_store_addr)
    prefixed = rendezvous.job_prefix(raw, world_size)
    addr = options.addr or local_address(_master_host(init_method))
    w = _World(options, prefixed, raw, rank, world_size, addr, timeout)
    try:
        w.default = _build_group(w, "default", range(world_size), timeout)
    except BaseException:
        if store is None:
            raw.close()
        raise
    w.owns_store = store is None
    _world = w


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


@atexit.register
def _leave_at_exit():
    # say goodbye on every link, so peers know this exit was not a crash
    try:
        destroy_process_group()
    except Desync as e:
        # the program made no call after the mismatch: this is the last chance to say it
        sys.stderr.write(f"accord: Desync: {e}\n")
    except Exception:
        pass


def _group(group):
    if group is not None:     # standalone groups (accord.torch) need no world
        if not isinstance(group, ProcessGroup):
            raise TypeError(f"group: expected an accord ProcessGroup (from new_group) or None, "
                            f"got {type(group).__name__}")
        return group
    return _require_world().default


# Groups this process was told it is not a member of (a WeakSet: a destroyed
# group is forgotten with it).
_told_not_member = weakref.WeakSet()


def _not_member(g, opname):
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
    return _group(group).rank


def get_world_size(group: Optional[ProcessGroup] = None) -> int:
    """The number of ranks of `group` (default: the job); -1 on a non-member, as torch.

    Raises:
        ValueError: the default group is not initialized.
        TypeError: group is not an accord ProcessGroup.
    """
    g = _group(group)
    return g.size if g.is_member else -1


def get_group_rank(group: Optional[ProcessGroup], global_rank: int) -> int:
    """The rank within `group` of the process whose global rank is `global_rank`.

    Raises:
        ValueError: global_rank is not a member of group.
    """
    g = _group(group)
    return g.group_rank_of(global_rank, "global_rank")


def get_global_rank(group: Optional[ProcessGroup], group_rank: int) -> int:
    """The global rank of the process that is `group_rank` within `group`.

    Raises:
        ValueError: group_rank is outside 0 .. size-1.
    """
    g = _group(group)
    if not 0 <= group_rank < g.size:
        raise ValueError(f"group_rank={group_rank} outside group {g.name!r} of size {g.size}")
    return g.ranks[group_rank]


def get_process_group_ranks(group: Optional[ProcessGroup] = None) -> List[int]:
    """The global ranks of `group`'s members, in group-rank order."""
    return list(_group(group).ranks)


# -- argument helpers ---------------------------------------------------------

def _root(g, glob, local, arg):
    if local is not None:
        if glob is not None:
            raise ValueError(f"pass either {arg} or group_{arg}, not both")
        if not 0 <= local < g.size:
            raise ValueError(f"group_{arg}={local} outside group {g.name!r} of size {g.size}")
        return local
    if glob is None:
        glob = g.ranks[0] if arg in ("src", "dst") else None
    if isinstance(glob, bool) or not isinstance(glob, (int, np.integer)):
        raise TypeError(f"{arg}: expected an int rank, got {type(glob).__name__}")
    return g.group_rank_of(int(glob), arg)


def _list(g, value, arg, writable=True):
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{arg}: expected a list of {g.size} tensors, got {type(value).__name__}")
    if len(value) != g.size:
        raise ValueError(f"{arg}: expected {g.size} tensors (one per rank of group {g.name!r}), "
                         f"got {len(value)}")
    return [as_buf(t, f"{arg}[{i}]", writable) for i, t in enumerate(value)]


def _same_dtype(ref, bufs, arg, ref_arg):
    for i, b in enumerate(bufs):
        if b.dtype_code != ref.dtype_code:
            raise TypeError(f"{arg}[{i}]: dtype {b.dtype_name} differs from {ref_arg}'s "
                            f"{ref.dtype_name}")


def _same_size(a, b, arg, ref_arg):
    if a.nbytes != b.nbytes:
        raise ValueError(f"{arg}: holds {a.numel} elements ({a.describe()}) but {ref_arg} holds "
                         f"{b.numel} ({b.describe()})")


def _finish(*bufs):
    for b in bufs:
        b.finish()


# -- collectives ----------------------------------------------------------------

def broadcast(tensor: Tensor, src: Optional[int] = None, group: Optional[ProcessGroup] = None,
              async_op: bool = False, group_src: Optional[int] = None,
              timeout: Timeout = None) -> Optional[Work]:
    """The collective behind `accord.broadcast` (which also queues it inside a
    `coalescing()` block): see `accord.broadcast`.
    """
    g = _group(group)
    if not g.is_member:
        return _not_member(g, "broadcast")
    root = _root(g, src, group_src, "src")
    buf = as_buf(tensor, "tensor", writable=g.rank != root)   # the root only reads
    run, stamp = plans.broadcast_run(g, buf, root)
    if hierarchy.phased(g, "broadcast", buf.nbytes):
        run = g.hier.broadcast(buf, root)

    def body(c):
        run(c)
        buf.finish()
    return plans.run(g, "broadcast", body, async_op, timeout, stamp)


def _all_gather_blocks(g, opname, blocks, mine, outs, async_op, timeout):
    total = sum(b.nbytes for b in blocks)
    forced = g.options.algorithms

    mine_block = blocks[g.rank]
    in_place = mine.arr.size and mine.arr.ctypes.data == mine_block.ctypes.data

    def own():
        # an input that is this rank's block of the output (all_gather_into_tensor in
        # place, as sharded training does) is already where it belongs
        if not in_place:
            np.copyto(mine_block, mine.arr, casting="no")

    if hierarchy.phased(g, "all_gather", total):
        run = g.hier.all_gather(blocks, mine, own)

        def body(c):
            run(c)
            _finish(*outs)
        return plans.run(g, opname, body, async_op, timeout, plans.stamp(mine, count=total))

    def body(c):
        if c is None:
            own()
        else:
            # direct: peers copy this rank's block straight from the input while it
            # copies its own
            choose("all_gather", total, c, forced)(c, blocks, mine.arr, own)
        _finish(*outs)
    return plans.run(g, opname, body, async_op, timeout, plans.stamp(mine, count=total))


def all_gather(tensor_list: Sequence[Tensor], tensor: Tensor,
               group: Optional[ProcessGroup] = None, async_op: bool = False,
               timeout: Timeout = None) -> Optional[Work]:
    """Every rank's `tensor`, in every rank's `tensor_list`.

    Args:
        tensor_list: one output per rank of the group, in group-rank order;
            `tensor_list[r]` receives rank r's tensor. Unlike torch, sizes may
            differ from rank to rank (uneven all_gather): each entry only has to
            match the size of the rank it receives from.
        tensor: this rank's input (only read; it may be read-only).
        group: the group to run on (default: the default group). On a rank that is
            not a member the call does nothing and returns None, as in torch.
        async_op: return a `Work` at once instead of waiting for the result.
        timeout: seconds (or a timedelta) for this call only; default: the group's
            timeout (`ACCORD_TIMEOUT`, 1800 s). Not in torch.

    Returns:
        None, or a `Work` with `async_op=True` (None on a non-member).

    Raises:
        ValueError, TypeError: bad arguments, raised on the calling rank before any
            byte moves.
        accord.Desync: the ranks of the group called different collectives, or the
            same one with different roots, dtypes or sizes (raised on every rank
            involved).
        accord.PeerLost: a rank of the group died or left.
        accord.CommTimeout: the call did not complete within its timeout.
        accord.GroupClosed: the group was destroyed or broken by an earlier error.
    """
    g = _group(group)
    if not g.is_member:
        return _not_member(g, "all_gather")
    mine = as_buf(tensor, "tensor", writable=False)
    outs = _list(g, tensor_list, "tensor_list")
    _same_dtype(mine, outs, "tensor_list", "tensor")
    _same_size(outs[g.rank], mine, f"tensor_list[{g.rank}]", "tensor")
    blocks = [o.arr for o in outs]
    return _all_gather_blocks(g, "all_gather", blocks, mine, outs, async_op, timeout)


def all_gather_into_tensor(output_tensor: Tensor, input_tensor: Tensor,
                           group: Optional[ProcessGroup] = None, async_op: bool = False,
                           timeout: Timeout = None) -> Optional[Work]:
    """Every rank's `input_tensor`, concatenated in rank order into `output_tensor`.

    Args:
        output_tensor: group size x input_tensor's elements, same dtype. An input
            that already is this rank's block of the output (in place) is not
            copied.
        input_tensor: this rank's block (only read).
        group: the group to run on (default: the default group). On a rank that is
            not a member the call does nothing and returns None, as in torch.
        async_op: return a `Work` at once instead of waiting for the result.
        timeout: seconds (or a timedelta) for this call only; default: the group's
            timeout (`ACCORD_TIMEOUT`, 1800 s). Not in torch.

    Returns:
        None, or a `Work` with `async_op=True` (None on a non-member).

    Raises:
        ValueError, TypeError: bad arguments, raised on the calling rank before any
            byte moves.
        accord.Desync: the ranks of the group called different collectives, or the
            same one with different roots, dtypes or sizes (raised on every rank
            involved).
        accord.PeerLost: a rank of the group died or left.
        accord.CommTimeout: the call did not complete within its timeout.
        accord.GroupClosed: the group was destroyed or broken by an earlier error.
    """
    g = _group(group)
    if not g.is_member:
        return _not_member(g, "all_gather_into_tensor")
    mine = as_buf(input_tensor, "input_tensor", writable=False)
    out = as_buf(output_tensor, "output_tensor")
    _same_dtype(mine, [out], "output_tensor", "input_tensor")
    if out.numel != mine.numel * g.size:
        raise ValueError(f"output_tensor: must hold group size ({g.size}) x input_tensor's "
                         f"{mine.numel} elements, holds {out.numel} ({out.describe()})")
    blocks = split(out.arr, [mine.numel] * g.size)
    return _all_gather_blocks(g, "all_gather", blocks, mine, [out], async_op, timeout)


def _optional_list(g, value, arg, is_root, root_arg, writable=True):
    if is_root:
        if value is None:
            raise ValueError(f"{arg}: required on the {root_arg} rank")
        return _list(g, value, arg, writable)
    if value is not None and len(value):
        raise ValueError(f"{arg}: must be None or empty on ranks other than {root_arg} "
                         f"(this is rank {g.global_rank})")
    return None


def gather(tensor: Tensor, gather_list: Optional[Sequence[Tensor]] = None,
           dst: Optional[int] = None, group: Optional[ProcessGroup] = None,
           async_op: bool = False, group_dst: Optional[int] = None,
           timeout: Timeout = None) -> Optional[Work]:
    """Every rank's `tensor`, into the root's `gather_list`.

    Args:
        tensor: this rank's input (only read).
        gather_list: on the root, one output per rank, in group-rank order; sizes
            may differ from rank to rank (not in torch). None or empty elsewhere.
        dst: the root's global rank (default 0).
        group: the group to run on (default: the default group). On a rank that is
            not a member the call does nothing and returns None, as in torch.
        async_op: return a `Work` at once instead of waiting for the result.
        group_dst: the root as a rank of `group` instead of dst (as torch 2.6+).
        timeout: seconds (or a timedelta) for this call only; default: the group's
            timeout (`ACCORD_TIMEOUT`, 1800 s). Not in torch.

    Returns:
        None, or a `Work` with `async_op=True` (None on a non-member).

    Raises:
        ValueError, TypeError: bad arguments, raised on the calling rank before any
            byte moves.
        accord.Desync: the ranks of the group called different collectives, or the
            same one with different roots, dtypes or sizes (raised on every rank
            involved).
        accord.PeerLost: a rank of the group died or left.
        accord.CommTimeout: the call did not complete within its timeout.
        accord.GroupClosed: the group was destroyed or broken by an earlier error.
    """
    g = _group(group)
    if not g.is_member:
        return _not_member(g, "gather")
    root = _root(g, dst, group_dst, "dst")
    mine = as_buf(tensor, "tensor", writable=False)
    outs = _optional_list(g, gather_list, "gather_list", g.rank == root, "dst")
    if outs is not None:
        _same_dtype(mine, outs, "gather_list", "tensor")
        _same_size(outs[root], mine, f"gather_list[{root}]", "tensor")

    def body(c):
        if outs is not None:
            np.copyto(outs[root].arr, mine.arr, casting="no")
        if c is not None:
            rooted.gather(c, mine.arr, outs and [o.arr for o in outs], root)
        if outs is not None:
            _finish(*outs)
    return plans.run(g, "gather", body, async_op, timeout, plans.stamp(mine, root))


def scatter(tensor: Tensor, scatter_list: Optional[Sequence[Tensor]] = None,
            src: Optional[int] = None, group: Optional[ProcessGroup] = None,
            async_op: bool = False, group_src: Optional[int] = None,
            timeout: Timeout = None) -> Optional[Work]:
    """The root's `scatter_list[r]` into rank r's `tensor`.

    Args:
        tensor: this rank's output.
        scatter_list: on the root, one input per rank in group-rank order (only
            read); sizes may differ from rank to rank (uneven shards, not in
            torch): entry r must match rank r's tensor. None or empty elsewhere.
        src: the root's global rank (default 0).
        group: the group to run on (default: the default group). On a rank that is
            not a member the call does nothing and returns None, as in torch.
        async_op: return a `Work` at once instead of waiting for the result.
        group_src: the root as a rank of `group` instead of src.
        timeout: seconds (or a timedelta) for this call only; default: the group's
            timeout (`ACCORD_TIMEOUT`, 1800 s). Not in torch.

    Returns:
        None, or a `Work` with `async_op=True` (None on a non-member).

    Raises:
        ValueError, TypeError: bad arguments, raised on the calling rank before any
            byte moves.
        accord.Desync: the ranks of the group called different collectives, or the
            same one with different roots, dtypes or sizes (raised on every rank
            involved).
        accord.PeerLost: a rank of the group died or left.
        accord.CommTimeout: the call did not complete within its timeout.
        accord.GroupClosed: the group was destroyed or broken by an earlier error.
    """
    g = _group(group)
    if not g.is_member:
        return _not_member(g, "scatter")
    root = _root(g, src, group_src, "src")
    mine = as_buf(tensor, "tensor")
    # the root only reads its scatter_list: read-only sources are fine
    ins = _optional_list(g, scatter_list, "scatter_list", g.rank == root, "src", writable=False)
    if ins is not None:
        _same_dtype(mine, ins, "scatter_list", "tensor")
        _same_size(ins[root], mine, f"scatter_list[{root}]", "tensor")

    def body(c):
        own = None
        if ins is not None:
            def own():
                np.copyto(mine.arr, ins[root].arr, casting="no")
        if c is not None:
            # the root copies its own block while the peers take theirs (shared memory)
            rooted.scatter(c, mine.arr, ins and [b.arr for b in ins], root, own)
        elif own is not None:
            own()
        mine.finish()
    return plans.run(g, "scatter", body, async_op, timeout, plans.stamp(mine, root))


def reduce(tensor: Tensor, dst: Optional[int] = None, op: ReduceOp = ReduceOp.SUM,
           group: Optional[ProcessGroup] = None, async_op: bool = False,
           group_dst: Optional[int] = None, timeout: Timeout = None) -> Optional[Work]:
    """The collective behind `accord.reduce`: see `accord.reduce`."""
    g = _group(group)
    if not g.is_member:
        return _not_member(g, "reduce")
    root = _root(g, dst, group_dst, "dst")
    op = as_reduce_op(op)
    buf = as_buf(tensor, "tensor")
    check_op(op, buf)
    run, stamp = plans.reduce_run(g, buf, root, op)

    def body(c):
        run(c)
        if g.rank == root:
            buf.finish()
    return plans.run(g, "reduce", body, async_op, timeout, stamp)


def all_reduce(tensor: Tensor, op: ReduceOp = ReduceOp.SUM, group: Optional[ProcessGroup] = None,
               async_op: bool = False, timeout: Timeout = None) -> Optional[Work]:
    """The collective behind `accord.all_reduce`: see `accord.all_reduce`."""
    g = _group(group)
    if not g.is_member:
        return _not_member(g, "all_reduce")
    op = as_reduce_op(op)
    buf = as_buf(tensor, "tensor")
    check_op(op, buf)
    run, stamp = plans.all_reduce_run(g, buf, op)
    if hierarchy.phased(g, "all_reduce", buf.nbytes):
        run = g.hier.all_reduce(buf, op)

    def body(c):
        run(c)
        buf.finish()
    return plans.run(g, "all_reduce", body, async_op, timeout, stamp)


def _reduce_scatter_blocks(g, output, ins_counts, fill, op, async_op, timeout, total_bytes):
    out = output
    hier = hierarchy.phased(g, "reduce_scatter", total_bytes)

    def body(c):
        work = fill()
        blocks = split(work, ins_counts)
        if hier:
            # in phases; the result arrives averaged where op is AVG
            g.hier.reduce_scatter(work, blocks, out, op)(c)
            np.copyto(out.arr, blocks[g.rank], casting="no")
            out.finish()
            return
        if c is not None:
            need = min(max(ins_counts) if ins_counts else 0, piece_elems(work.itemsize))
            ring_reduce_scatter(c, blocks, op, out.is_bf16, g.scratch(work.dtype, need))
        if op == ReduceOp.AVG:
            finish_avg(blocks[g.rank], g.size, out.is_bf16)
        np.copyto(out.arr, blocks[g.rank], casting="no")
        out.finish()
    return plans.run(g, "reduce_scatter", body, async_op, timeout,
                     plans.stamp(out, -1, op, total_bytes))


def reduce_scatter(output: Tensor, input_list: Sequence[Tensor], op: ReduceOp = ReduceOp.SUM,
                   group: Optional[ProcessGroup] = None, async_op: bool = False,
                   timeout: Timeout = None) -> Optional[Work]:
    """Reduce `input_list[r]` over every rank into rank r's `output`.

    Args:
        output: this rank's result.
        input_list: one input per rank, in group-rank order (only read); entry r
            must match rank r's output, and sizes may differ from rank to rank.
        op: a `ReduceOp` (AVG included).
        group: the group to run on (default: the default group). On a rank that is
            not a member the call does nothing and returns None, as in torch.
        async_op: return a `Work` at once instead of waiting for the result.
        timeout: seconds (or a timedelta) for this call only; default: the group's
            timeout (`ACCORD_TIMEOUT`, 1800 s). Not in torch.

    Returns:
        None, or a `Work` with `async_op=True` (None on a non-member).

    Raises:
        ValueError, TypeError: bad arguments, raised on the calling rank before any
            byte moves.
        accord.Desync: the ranks of the group called different collectives, or the
            same one with different roots, dtypes or sizes (raised on every rank
            involved).
        accord.PeerLost: a rank of the group died or left.
        accord.CommTimeout: the call did not complete within its timeout.
        accord.GroupClosed: the group was destroyed or broken by an earlier error.
    """
    g = _group(group)
    if not g.is_member:
        return _not_member(g, "reduce_scatter")
    op = as_reduce_op(op)
    out = as_buf(output, "output")
    ins = [as_buf(t, f"input_list[{i}]", writable=False) for i, t in
           enumerate(_check_len(g, input_list, "input_list"))]
    _same_dtype(out, ins, "input_list", "output")
    _same_size(ins[g.rank], out, f"input_list[{g.rank}]", "output")
    check_op(op, out)
    counts = [b.numel for b in ins]
    return _reduce_scatter_blocks(g, out, counts, lambda: np.concatenate([b.arr for b in ins]),
                                  op, async_op, timeout, sum(b.nbytes for b in ins))


def reduce_scatter_tensor(output: Tensor, input: Tensor, op: ReduceOp = ReduceOp.SUM,
                          group: Optional[ProcessGroup] = None, async_op: bool = False,
                          timeout: Timeout = None) -> Optional[Work]:
    """Reduce `input` (group size blocks of output's size) over every rank; block r to rank r.

    Args:
        output: this rank's result block.
        input: group size x output's elements, same dtype (only read).
        op: a `ReduceOp`.
        group: the group to run on (default: the default group). On a rank that is
            not a member the call does nothing and returns None, as in torch.
        async_op: return a `Work` at once instead of waiting for the result.
        timeout: seconds (or a timedelta) for this call only; default: the group's
            timeout (`ACCORD_TIMEOUT`, 1800 s). Not in torch.

    Returns:
        None, or a `Work` with `async_op=True` (None on a non-member).

    Raises:
        ValueError, TypeError: bad arguments, raised on the calling rank before any
            byte moves.
        accord.Desync: the ranks of the group called different collectives, or the
            same one with different roots, dtypes or sizes (raised on every rank
            involved).
        accord.PeerLost: a rank of the group died or left.
        accord.CommTimeout: the call did not complete within its timeout.
        accord.GroupClosed: the group was destroyed or broken by an earlier error.
    """
    g = _group(group)
    if not g.is_member:
        return _not_member(g, "reduce_scatter_tensor")
    op = as_reduce_op(op)
    out = as_buf(output, "output")
    inp = as_buf(input, "input", writable=False)
    _same_dtype(out, [inp], "input", "output")
    if inp.numel != out.numel * g.size:
        raise ValueError(f"input: must hold group size ({g.size}) x output's {out.numel} "
                         f"elements, holds {inp.numel} ({inp.describe()})")
    check_op(op, out)
    return _reduce_scatter_blocks(g, out, [out.numel] * g.size, lambda: inp.arr.copy(), op,
                                  async_op, timeout, inp.nbytes)


def _check_len(g, value, arg):
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{arg}: expected a list of {g.size} tensors, got {type(value).__name__}")
    if len(value) != g.size:
        raise ValueError(f"{arg}: expected {g.size} tensors (one per rank of group {g.name!r}), "
                         f"got {len(value)}")
    return value


def _all_to_all_blocks(g, ref, outs, out_blocks, in_blocks, async_op, timeout):
    def body(c):
        np.copyto(out_blocks[g.rank], in_blocks[g.rank], casting="no")
        if c is not None:
            rooted.all_to_all(c, out_blocks, in_blocks)
        _finish(*outs)
    return plans.run(g, "all_to_all", body, async_op, timeout, plans.stamp(ref))


def all_to_all(output_tensor_list: Sequence[Tensor], input_tensor_list: Sequence[Tensor],
               group: Optional[ProcessGroup] = None, async_op: bool = False,
               timeout: Timeout = None) -> Optional[Work]:
    """Rank i's `input_tensor_list[j]` into rank j's `output_tensor_list[i]`.

    Args:
        output_tensor_list: one output per rank, in group-rank order.
        input_tensor_list: one input per rank (only read); sizes may differ.
        group: the group to run on (default: the default group). On a rank that is
            not a member the call does nothing and returns None, as in torch.
        async_op: return a `Work` at once instead of waiting for the result.
        timeout: seconds (or a timedelta) for this call only; default: the group's
            timeout (`ACCORD_TIMEOUT`, 1800 s). Not in torch.

    Returns:
        None, or a `Work` with `async_op=True` (None on a non-member).

    Raises:
        ValueError, TypeError: bad arguments, raised on the calling rank before any
            byte moves.
        accord.Desync: the ranks of the group called different collectives, or the
            same one with different roots, dtypes or sizes (raised on every rank
            involved).
        accord.PeerLost: a rank of the group died or left.
        accord.CommTimeout: the call did not complete within its timeout.
        accord.GroupClosed: the group was destroyed or broken by an earlier error.
    """
    g = _group(group)
    if not g.is_member:
        return _not_member(g, "all_to_all")
    outs = _list(g, output_tensor_list, "output_tensor_list")
    ins = [as_buf(t, f"input_tensor_list[{i}]", writable=False) for i, t in
           enumerate(_check_len(g, input_tensor_list, "input_tensor_list"))]
    _same_dtype(outs[0], outs, "output_tensor_list", "output_tensor_list[0]")
    _same_dtype(outs[0], ins, "input_tensor_list", "output_tensor_list[0]")
    _same_size(outs[g.rank], ins[g.rank], f"output_tensor_list[{g.rank}]",
               f"input_tensor_list[{g.rank}]")
    return _all_to_all_blocks(g, outs[0], outs, [o.arr for o in outs], [b.arr for b in ins],
                              async_op, timeout)


def _splits(buf, sizes, n, arg, tensor_arg):
    rows = buf.shape[0] if buf.shape else 1
    per_row = buf.numel // rows if rows else 0
    if sizes is None or len(sizes) == 0:
        if rows % n:
            raise ValueError(f"{tensor_arg}: first dimension {rows} is not divisible by the group "
                             f"size {n}; pass {arg}")
        return [rows // n * per_row] * n
    sizes = [int(s) for s in sizes]
    if len(sizes) != n or any(s < 0 for s in sizes):
        raise ValueError(f"{arg}: expected {n} non-negative sizes, got {sizes}")
    if sum(sizes) != rows:
        raise ValueError(f"{arg}: sizes {sizes} sum to {sum(sizes)}, but {tensor_arg} has "
                         f"{rows} rows")
    return [s * per_row for s in sizes]


def all_to_all_single(output: Tensor, input: Tensor,
                      output_split_sizes: Optional[Sequence[int]] = None,
                      input_split_sizes: Optional[Sequence[int]] = None,
                      group: Optional[ProcessGroup] = None, async_op: bool = False,
                      timeout: Timeout = None) -> Optional[Work]:
    """all_to_all over single tensors split along their first dimension, as in torch.

    Args:
        output: the received rows, rank 0's first.
        input: the rows to send, rank 0's first (only read).
        output_split_sizes: rows received from each rank (default: equal splits).
        input_split_sizes: rows sent to each rank (default: equal splits).
        group: the group to run on (default: the default group). On a rank that is
            not a member the call does nothing and returns None, as in torch.
        async_op: return a `Work` at once instead of waiting for the result.
        timeout: seconds (or a timedelta) for this call only; default: the group's
            timeout (`ACCORD_TIMEOUT`, 1800 s). Not in torch.

    Returns:
        None, or a `Work` with `async_op=True` (None on a non-member).

    Raises:
        ValueError, TypeError: bad arguments, raised on the calling rank before any
            byte moves.
        accord.Desync: the ranks of the group called different collectives, or the
            same one with different roots, dtypes or sizes (raised on every rank
            involved).
        accord.PeerLost: a rank of the group died or left.
        accord.CommTimeout: the call did not complete within its timeout.
        accord.GroupClosed: the group was destroyed or broken by an earlier error.
    """
    g = _group(group)
    if not g.is_member:
        return _not_member(g, "all_to_all_single")
    out = as_buf(output, "output")
    inp = as_buf(input, "input", writable=False)
    _same_dtype(out, [inp], "input", "output")
    oc = _splits(out, output_split_sizes, g.size, "output_split_sizes", "output")
    ic = _splits(inp, input_split_sizes, g.size, "input_split_sizes", "input")
    if oc[g.rank] != ic[g.rank]:
        raise ValueError(f"output_split_sizes/input_split_sizes: this rank keeps {ic[g.rank]} "
                         f"elements of its input but expects {oc[g.rank]} in its output")
    return _all_to_all_blocks(g, out, [out], split(out.arr, oc), split(inp.arr, ic), async_op,
                              timeout)


def barrier(group: Optional[ProcessGroup] = None, async_op: bool = False,
            device_ids: Any = None, timeout: Timeout = None) -> Optional[Work]:
    """Wait until every rank of the group has entered the barrier.

    Args:
        group: the group to run on (default: the default group). On a rank that is
            not a member the call does nothing and returns None, as in torch.
        async_op: return a `Work` at once instead of waiting for the result.
        device_ids: accepted for torch compatibility and ignored.
        timeout: seconds (or a timedelta) for this call only; default: the group's
            timeout (`ACCORD_TIMEOUT`, 1800 s). Not in torch.

    Returns:
        None, or a `Work` with `async_op=True` (None on a non-member).

    Raises:
        ValueError, TypeError: bad arguments, raised on the calling rank before any
            byte moves.
        accord.Desync: the ranks of the group called different collectives, or the
            same one with different roots, dtypes or sizes (raised on every rank
            involved).
        accord.PeerLost: a rank of the group died or left.
        accord.CommTimeout: the call did not complete within its timeout.
        accord.GroupClosed: the group was destroyed or broken by an earlier error.
    """
    g = _group(group)
    if not g.is_member:
        return _not_member(g, "barrier")
    body, stamp = plans.barrier_run(g)
    return plans.run(g, "barrier", body, async_op, timeout, stamp)


# -- point to point ---------------------------------------------------------------

def _p2p(g, peer_global, peer_local, arg, tag):
    peer = _root(g, peer_global, peer_local, arg)
    if peer == g.rank:
        raise ValueError(f"{arg}={g.ranks[peer]} is this rank itself")
    return peer, _tag(tag)


_TAG_MAX = (1 << 63) - 1


def _tag(tag):
    if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)):
        raise TypeError(f"tag: expected an int, got {type(tag).__name__}")
    if not -_TAG_MAX - 1 <= tag <= _TAG_MAX:
        raise ValueError(f"tag: {tag} does not fit in 64 bits")
    return int(tag)


def _p2p_pending(g, is_send, tensor, peer_global, peer_local, tag, timeout, opname):
    """Check one point-to-point call and build its operation; nothing is posted yet."""
    arg = "dst" if is_send else "src"
    tag = _tag(tag)
    timeout = to_seconds(timeout, "timeout")
    if peer_global is None and peer_local is None:
        if is_send:
            raise ValueError("dst: required")
        if g.size == 1:
            raise ValueError("recv with no src: this group has no other rank to receive from")
        peer = None
    else:
        peer, tag = _p2p(g, peer_global, peer_local, arg, tag)
    buf = as_buf(tensor, "tensor", writable=not is_send)
    return g.p2p_op(opname, is_send, peer, buf.mv, tag, timeout,
                    None if is_send else buf.finish)


def _p2p_call(tensor, peer, group, tag, group_peer, timeout, is_send, async_op):
    g = _group(group)
    opname = ("isend" if async_op else "send") if is_send else ("irecv" if async_op else "recv")
    if not g.is_member:
        return _not_member(g, opname)
    op = _p2p_pending(g, is_send, tensor, peer, group_peer, tag, timeout, opname)
    g.post_p2p([op])
    if async_op:
        return Work(op.future, op.desc)
    return op.future.result()


_P2P_RAISES = """
    Raises:
        ValueError, TypeError: before anything is posted: a peer outside the group
            or this rank itself, a tag that is not an int of 64 bits, a read-only
            receive buffer.
        accord.Desync: (receives) the message is not the buffer's size; the sender
            is released and the group stays usable.
        accord.PeerLost: the peer died or left; receives from other peers go on.
        accord.CommTimeout: nothing matched within timeout (default: the group's).
        accord.GroupClosed: the group was destroyed or broken by an earlier error.
"""


def send(tensor: Tensor, dst: Optional[int] = None, group: Optional[ProcessGroup] = None,
         tag: int = 0, group_dst: Optional[int] = None, timeout: Timeout = None) -> None:
    """Send tensor to rank dst (global; or group_dst within group); returns once its
    bytes are out of tensor's memory.

    That is once they are delivered or copied where the peer will find them, so a
    small message returns at once even if the peer has not posted its receive; a
    large one may wait until the peer's side takes it (MPI's standard mode). Messages
    match by (group, source, tag) and are never overtaken between one sender and one
    receiver with one tag. Unlike torch: timeout= per call.
    """
    _p2p_call(tensor, dst, group, tag, group_dst, timeout, True, False)


def recv(tensor: Tensor, src: Optional[int] = None, group: Optional[ProcessGroup] = None,
         tag: int = 0, group_src: Optional[int] = None, timeout: Timeout = None) -> int:
    """Receive into tensor from rank src (None: the first message with tag from any
    rank); returns the sender's global rank. The message must be tensor's size.
    """
    return _p2p_call(tensor, src, group, tag, group_src, timeout, False, False)


def isend(tensor: Tensor, dst: Optional[int] = None, group: Optional[ProcessGroup] = None,
          tag: int = 0, group_dst: Optional[int] = None, timeout: Timeout = None) -> Work:
    """Start sending tensor to dst; returns a Work (leave tensor alone until it completes).

    Any number of isend/irecv may be outstanding, per peer, tag and group, posted in
    any order relative to each other and to collectives: a posted receive never
    holds up a collective, nor a collective a send. They progress on their own
    (a thread per group), whether or not this rank is inside an accord call.
    """
    return _p2p_call(tensor, dst, group, tag, group_dst, timeout, True, True)


def irecv(tensor: Tensor, src: Optional[int] = None, group: Optional[ProcessGroup] = None,
          tag: int = 0, group_src: Optional[int] = None, timeout: Timeout = None) -> Work:
    """Start receiving into tensor from src (None: any rank); returns a Work whose
    result() is the sender's global rank. Receives match in the order posted.
    """
    return _p2p_call(tensor, src, group, tag, group_src, timeout, False, True)


for _f in (send, recv, isend, irecv):
    _f.__doc__ += _P2P_RAISES


class P2POp:
    """One operation for `batch_isend_irecv`, as torch.distributed.P2POp.

    Args:
        op: accord.isend or accord.irecv.
        tensor: what to send, or where to receive.
        peer: the other rank (global), or group_peer: its rank within group.
        group: the group (None: the default one); every op of a batch shares it.
        tag: an int; messages match by (group, source, tag).

    Raises:
        ValueError: op is neither accord.isend nor accord.irecv (the other
            arguments are checked when the batch is posted).
    """
    __slots__ = ("op", "tensor", "peer", "group", "tag", "group_peer")

    def __init__(self, op: Callable, tensor: Tensor, peer: Optional[int] = None,
                 group: Optional[ProcessGroup] = None, tag: int = 0,
                 group_peer: Optional[int] = None) -> None:
        if op not in (isend, irecv):
            raise ValueError(f"op: expected accord.isend or accord.irecv, got {op!r}")
        self.op, self.tensor, self.peer, self.group = op, tensor, peer, group
        self.tag, self.group_peer = tag, group_peer

    def __repr__(self):
        peer = self.peer if self.group_peer is None else f"group rank {self.group_peer}"
        return f"P2POp({self.op.__name__}, peer={peer}, tag={self.tag})"


def batch_isend_irecv(p2p_op_list: List[P2POp]) -> List[Work]:
    """Post every send and receive of the list at once; returns their Works, in order.

    As torch: every op must use the same group. The order within the list does
    not matter (receives may come before the sends they answer, as in MPI
    programs). Unlike torch: every op is checked before any is posted, so a bad
    op posts nothing; a non-member of the group gets an empty list.

    Raises:
        ValueError: an empty list, an item that is not a P2POp, ops of different
            groups, or any op's bad peer or tag (TypeError for a tag that is not
            an int); nothing is posted then.
        accord.GroupClosed: the group was destroyed or broken.
    """
    ops = list(p2p_op_list) if isinstance(p2p_op_list, (list, tuple)) else None
    if not ops or not all(isinstance(o, P2POp) for o in ops):
        raise ValueError("p2p_op_list: expected a non-empty list of accord.P2POp")
    if any(o.group is not ops[0].group for o in ops):
        raise ValueError("p2p_op_list: all ops need to use the same group")
    g = _group(ops[0].group)
    if not g.is_member:
        _not_member(g, "batch_isend_irecv")
        return []
    pending = []
    for o in ops:
        is_send = o.op is isend
        pending.append(_p2p_pending(g, is_send, o.tensor, o.peer, o.group_peer, o.tag, None,
                                    "isend" if is_send else "irecv"))
    g.post_p2p(pending)
    return [Work(p.future, p.desc) for p in pending]
