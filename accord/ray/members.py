"""Who the members of one Ray collective group are, and whether Ray says one died.

Making a group waits for every member; a member that will never come must not
keep the others waiting for the group's timeout (ACCORD_TIMEOUT, 1800 s by
default). So the wait has its own deadline, the join timeout
(ACCORD_RAY_JOIN_TIMEOUT, default 60 s, never more than the group's timeout),
and while it lasts each member asks Ray about the members it can name:

- a group the driver declared with create_collective_group: every member, since
  Ray keeps the declaration (the actors, by rank) in a named actor
  "info_<group name>";
- any group: the members that already arrived, since each one writes its Ray
  actor id into the group's store on arrival.

A member Ray reports DEAD ends the wait on every member that asked, within
about a second, with accord.PeerLost naming its rank. A member nobody can name
(init_collective_group called on the others while its actor was already gone)
is waited for until the join deadline, then named in a CommTimeout. (Once all
have arrived, connecting to one another gets the join timeout again: group.py.)

Ray is asked through its control store's actor table, the one its own state
tools read (`ray.util.state` needs the dashboard, which a cluster may run
without).
"""
from __future__ import annotations

import json
import time
from typing import Dict, Optional

import ray

from ..errors import CommTimeout, PeerLost

_ASK_EVERY_S = 0.5          # how often a waiting member asks Ray about the others
_INFO_GET_S = 10.0          # reading the declaration from Ray's named actor


def my_actor_id() -> str:
    """This process's Ray actor id (hex); init_collective_group runs only in actors."""
    return ray.get_runtime_context().get_actor_id() or ""


def declared_actors(group_name: str, size: int) -> Dict[int, str]:
    """{rank: actor id} of a group declared with create_collective_group; {} otherwise.

    Only a declaration of this group's size that lists this actor counts: a
    group made with init_collective_group under a declared group's name is
    not that group.
    """
    try:
        info = ray.get_actor("info_" + group_name)
    except ValueError:
        return {}
    try:
        ids, world, ranks = ray.get(info.get_info.remote(), timeout=_INFO_GET_S)[:3]
    except Exception:       # noqa: BLE001 (the declaration is a hint; without it, fewer checks)
        return {}
    hexes = [i.hex() if hasattr(i, "hex") else str(i) for i in ids or []]
    if world != size or my_actor_id() not in hexes or len(ranks) != len(hexes):
        return {}
    return {int(r): h for r, h in zip(ranks, hexes)}


def death(actor_id: str) -> Optional[str]:
    """Why Ray says actor_id died, or None while Ray does not say so (alive, starting,
    restarting, or unknown: Ray not reachable)."""
    from ray._private import state      # the control store's actor table (pinned Ray)
    try:
        info = state.actors(actor_id=actor_id)
    except Exception:       # noqa: BLE001 (no answer is no evidence of death)
        return None
    if not info or info.get("State") != "DEAD":
        return None
    return _cause(info.get("DeathCause")) or "Ray reports the actor DEAD"


def _cause(cause) -> str:
    """The first line of the error message in Ray's ActorDeathCause, if it has one."""
    if cause is None:
        return ""
    try:
        context = getattr(cause, cause.WhichOneof("context"))
        message = getattr(context, "error_message", "") or ""
    except Exception:       # noqa: BLE001 (a field Ray renamed: the state alone will do)
        return ""
    return message.strip().splitlines()[0] if message.strip() else ""


class Watch:
    """The members of one group that Ray can be asked about, and the join deadline.

    Args:
        group_name, rank, size: the group and this member.
        timeout: the join timeout, in seconds.
    """

    def __init__(self, group_name: str, rank: int, size: int, timeout: float):
        self.group_name, self.rank, self.size, self.timeout = group_name, rank, size, timeout
        self.deadline = time.monotonic() + timeout
        self.known = declared_actors(group_name, size)
        self.known.pop(rank, None)
        self._asked = 0.0

    def learn(self, rank: int, actor_id: str) -> None:
        """Member `rank` arrived as actor_id: ask about it from now on."""
        if rank != self.rank and actor_id:
            self.known[rank] = actor_id

    def check(self) -> None:
        """Raise PeerLost if Ray reports a known member dead (asks at most every 0.5 s).

        Raises:
            accord.PeerLost: naming the dead member's rank and actor.
        """
        now = time.monotonic()
        if now - self._asked < _ASK_EVERY_S:
            return
        self._asked = now
        for r, actor in sorted(self.known.items()):
            why = death(actor)
            if why is not None:
                raise self.lost(r, f"its actor {actor} died: {why}")

    def lost(self, rank: int, what: str) -> PeerLost:
        """The PeerLost of member `rank` of this group while it was being made."""
        return PeerLost(f"rank {self.rank} of Ray collective group {self.group_name!r}: peer "
                        f"rank {rank} died while the group was being made ({what})", peer=rank)

    def remaining(self) -> float:
        return self.deadline - time.monotonic()


def arrival_key(rank: int) -> str:
    return f"ray/arrived/{rank}"


_FAILED_KEY = "ray/failed"


def await_arrivals(store, watch: Watch) -> None:
    """Arrive in the group's store, then wait until every member has (see the module).

    A member whose wait fails says why in the store, so that the others fail
    at once with the same error rather than each at its own deadline.

    Raises:
        accord.PeerLost: Ray reports a member dead, or rank 0's store went away.
        accord.CommTimeout: members did not arrive within the join timeout (named).
    """
    try:
        _await(store, watch)
    except (PeerLost, CommTimeout) as e:
        if not getattr(e, "relayed", False):
            _tell(store, e)
        raise


def _await(store, watch: Watch) -> None:
    rank, size = watch.rank, watch.size
    keys = [arrival_key(r) for r in range(size)]
    arrived = {rank}
    try:
        store.set(keys[rank], my_actor_id())
        while True:
            try:
                store.wait(keys, timeout=max(0.05, min(_ASK_EVERY_S, watch.remaining())))
                return
            except CommTimeout:
                pass
            if store.check([_FAILED_KEY]):
                raise _relayed(watch, json.loads(store.get(_FAILED_KEY)))
            for r in range(size):
                if r not in arrived and store.check([keys[r]]):
                    arrived.add(r)
                    watch.learn(r, store.get(keys[r]).decode())
            watch.check()
            if watch.remaining() <= 0:
                missing = [r for r in range(size) if r not in arrived]
                if not missing:
                    return
                raise CommTimeout(
                    f"rank {rank} of Ray collective group {watch.group_name!r}: rank(s) "
                    f"{', '.join(map(str, missing))} of {size} did not join within "
                    f"{watch.timeout:g} s (ACCORD_RAY_JOIN_TIMEOUT; is their actor alive, and "
                    f"did it call init_collective_group with this group name?)")
    except PeerLost as e:
        if rank == 0 or isinstance(e.peer, int) or getattr(e, "relayed", False):
            raise
        # a client of rank 0's store: the store went with rank 0's process
        raise watch.lost(0, f"its store closed the connection: {e}") from None


def _tell(store, error) -> None:
    """Leave this member's failure in the store for the others (best effort)."""
    record = {"kind": type(error).__name__, "peer": getattr(error, "peer", None),
              "message": str(error)}
    try:
        store.set(_FAILED_KEY, json.dumps(record))
    except Exception:       # noqa: BLE001 (the store itself may be what failed)
        pass


def _relayed(watch: Watch, record: dict):
    """Another member's failure to make the group, raised here."""
    text = f"rank {watch.rank} of Ray collective group {watch.group_name!r}: another member " \
           f"gave up making the group: {record.get('message')}"
    peer = record.get("peer")
    if record.get("kind") == "PeerLost":
        error = PeerLost(text, peer=peer if isinstance(peer, int) else None)
    else:
        error = CommTimeout(text)
    error.relayed = True
    return error
