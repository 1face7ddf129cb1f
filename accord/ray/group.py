"""AccordGroup: the ray.util.collective backend "ACCORD", one accord group per Ray group.

Ray makes one instance per (process, group name) when an actor calls
init_collective_group(..., backend="ACCORD"), or on the first collective of a
group declared by create_collective_group. The instance meets its peers
(rendezvous.py), waits until every member is there, failing fast on a member
Ray reports dead (members.py), then holds an accord ProcessGroup of its own:
shared memory among the members on one host, TCP between hosts, hierarchical
(one leader per host on the network) for large collectives of a group
spanning hosts with several members on one. Several Ray groups in one actor are several
independent accord groups.

Each Ray call is one accord collective, run on the calling thread; accord's
errors reach the actor's method unchanged: accord.PeerLost when a member's
process died, accord.Desync when members called different collectives or
mismatched shapes, accord.CommTimeout past the options' timeout_ms (else the
group's: ACCORD_TIMEOUT, 1800 s by default).
"""
from __future__ import annotations

import functools
from typing import Any, List

from ray.util.collective.collective_group.base_collective_group import BaseGroup

from .. import api, world
from ..options import Options
from . import convert, members, rendezvous

BACKEND_NAME = "ACCORD"
_STORE_LINGER_S = 1.0


class ArgumentError(ValueError, RuntimeError):
    """A bad argument to a collective of backend ACCORD, found before any byte moved.

    accord raises ValueError for these; Ray's own argument checks (and gloo,
    through torch) raise RuntimeError, which Ray programs and Ray's tests catch.
    This is both, with accord's message.
    """


def _ray_errors(method):
    """Re-raise accord's ValueError from method as ArgumentError (both types)."""
    @functools.wraps(method)
    def call(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except ValueError as e:
            if isinstance(e, ArgumentError):
                raise
            raise ArgumentError(str(e)).with_traceback(e.__traceback__) from None
    return call


class AccordGroup(BaseGroup):
    """A Ray collective group on accord (see the module's docstring).

    Args:
        world_size: the number of processes in the group.
        rank: this process's rank in it.
        group_name: the group's name; members meet under it.

    Raises:
        accord.PeerLost: Ray reports a member's actor dead before every member arrived
            (members.py: a member that arrived, or any member of a declared group).
        accord.CommTimeout: not every member arrived within the join timeout
            (ACCORD_RAY_JOIN_TIMEOUT, default 60 s, at most the group's timeout); the
            message names the missing ranks.
    """

    def __init__(self, world_size: int, rank: int, group_name: str):
        super().__init__(world_size, rank, group_name)
        options = Options.from_env()
        self.timeout = options.timeout
        self._store = None
        self._group = None
        join_s = min(options.ray_join_timeout, self.timeout)
        watch = members.Watch(group_name, rank, world_size, join_s) if world_size > 1 else None
        if world_size > 1 and rank == 0:
            self._store = rendezvous.host_store(group_name, world_size, self.timeout)
            master = rendezvous.node_address()
        elif world_size > 1:
            self._store, master = rendezvous.join_store(group_name, rank, world_size,
                                                        self.timeout, watch)
        else:
            from ..store import HashStore
            self._store, master = HashStore(), "127.0.0.1"
        try:
            if watch is not None:
                # every member there, or a dead or missing one named, within the join timeout
                members.await_arrivals(self._store, watch)
            # connecting, once every member is there, is bounded by the join timeout too: a
            # member that dies now is not waited for until the group's timeout either
            self._group = world.group_from_store(
                self._store, rank, world_size, self.timeout, f"ray:{group_name}",
                master_host=master, connect_timeout=join_s)
            if world_size > 1:
                # rank 0 serves the store: every member is done reading it before any
                # member may leave (and take the server with it)
                api.barrier(group=self._group)
        except BaseException:
            self._close_store()
            raise
        finally:
            if rank == 0 and world_size > 1:
                rendezvous.unpublish(group_name)

    @classmethod
    def backend(cls) -> str:
        """The name Ray knows this backend by."""
        return BACKEND_NAME

    @classmethod
    def check_backend_availability(cls) -> bool:
        """Always True: accord needs nothing but numpy."""
        return True

    @property
    def accord_group(self):
        """The accord ProcessGroup under this Ray group (accord's own calls take it as group=)."""
        return self._group

    def destroy_group(self) -> None:
        """Leave the group (destroy_collective_group); rank 0 stops serving its store.

        Raises:
            accord.Desync: a peer sent a collective message no call of this rank read.
        """
        g, self._group = self._group, None
        try:
            if g is not None:
                g.destroy()
        finally:
            self._close_store()

    def _close_store(self):
        store, self._store = self._store, None
        if store is not None:
            try:
                # rank 0's server waits for the other members to disconnect, but members
                # leave a Ray group each on its own, if at all: a short grace, not 30 s
                store.set_timeout(_STORE_LINGER_S)
                store.close()
            except Exception:       # noqa: BLE001 (leaving: the store has nothing left to say)
                pass

    # -- collectives ----------------------------------------------------------------
    # Outputs go through convert.writable: Ray's read-only argument arrays are written
    # into, as gloo does (see there).
    @_ray_errors
    def allreduce(self, tensor: List[Any], allreduce_options: Any = None) -> None:
        """Reduce every member's tensor into every member's, in place (accord.all_reduce)."""
        api.all_reduce(_output(tensor, "allreduce"), op=convert.reduce_op(allreduce_options),
                       group=self._live(), timeout=convert.timeout_s(allreduce_options))

    @_ray_errors
    def barrier(self, barrier_options: Any = None) -> None:
        """Wait until every member has entered the barrier."""
        api.barrier(group=self._live(), timeout=convert.timeout_s(barrier_options))

    @_ray_errors
    def reduce(self, tensor: List[Any], reduce_options: Any = None) -> None:
        """Reduce every member's tensor into root_rank's; the others' are left unchanged."""
        api.reduce(_output(tensor, "reduce"), op=convert.reduce_op(reduce_options),
                   group=self._live(), group_dst=_root(reduce_options),
                   timeout=convert.timeout_s(reduce_options))

    @_ray_errors
    def allgather(self, tensor_list: List[List[Any]], tensor: List[Any],
                  allgather_options: Any = None) -> None:
        """Every member's tensor into every member's list, in rank order."""
        outs = [convert.writable(t) for t in convert.one_list(tensor_list, "allgather")]
        api.all_gather(outs, convert.one_tensor(tensor, "allgather"), group=self._live(),
                       timeout=convert.timeout_s(allgather_options))

    @_ray_errors
    def broadcast(self, tensor: List[Any], broadcast_options: Any = None) -> None:
        """root_rank's tensor into every member's, in place."""
        api.broadcast(_output(tensor, "broadcast"), group=self._live(),
                      group_src=_root(broadcast_options),
                      timeout=convert.timeout_s(broadcast_options))

    @_ray_errors
    def reducescatter(self, tensor: List[Any], tensor_list: List[List[Any]],
                      reducescatter_options: Any = None) -> None:
        """Entry r of every member's list, reduced, into member r's tensor (the lists are
        left unchanged, unlike Ray's gloo group, which all-reduces every entry in place)."""
        api.reduce_scatter(_output(tensor, "reducescatter"),
                           convert.one_list(tensor_list, "reducescatter"),
                           op=convert.reduce_op(reducescatter_options), group=self._live(),
                           timeout=convert.timeout_s(reducescatter_options))

    @_ray_errors
    def send(self, tensor: List[Any], send_options: Any) -> None:
        """Send the tensor (its first n_elements, when set) to dst_rank."""
        t = convert.first_elements(convert.one_tensor(tensor, "send"),
                                   int(getattr(send_options, "n_elements", 0) or 0))
        api.send(t, group=self._live(), group_dst=int(send_options.dst_rank),
                 timeout=convert.timeout_s(send_options))

    @_ray_errors
    def recv(self, tensor: List[Any], recv_options: Any) -> None:
        """Receive into the tensor (its first n_elements, when set) from src_rank."""
        t = convert.first_elements(_output(tensor, "recv"),
                                   int(getattr(recv_options, "n_elements", 0) or 0))
        api.recv(t, group=self._live(), group_src=int(recv_options.src_rank),
                 timeout=convert.timeout_s(recv_options))

    def _live(self):
        if self._group is None:
            from ..errors import GroupClosed
            raise GroupClosed(f"Ray collective group {self.group_name!r} was destroyed")
        return self._group


def _output(tensor: Any, what: str) -> Any:
    return convert.writable(convert.one_tensor(tensor, what))


def _root(options: Any) -> int:
    root = getattr(options, "root_rank", 0)
    return 0 if root is None else int(root)
