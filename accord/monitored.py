"""monitored_barrier: a barrier whose failure names every rank that did not arrive.

torch's meaning (gloo's `monitored_barrier`): rank 0 of the group waits for
each other rank to arrive, within `timeout` in all; when one does not, rank 0
raises naming it ("Rank 2 failed to pass monitoredBarrier in 1000 ms"), or,
with wait_all_ranks=True, naming all of them ("Ranks 1, 2 failed to pass
..."); the other ranks then raise "Rank r successfully reached
monitoredBarrier, but received errors while waiting for send/recv from rank
0". It goes through the group's store, not its links: a rank that is stuck
in a collective, or gone, cannot hold it up, and a failed monitored barrier
leaves the group usable.
"""
from __future__ import annotations

import datetime
import sys
import time
import weakref
from typing import Optional

from .errors import CommTimeout
from .group import ProcessGroup
from .options import to_seconds
from ._types import Timeout


_calls: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # group -> calls so far


def _is_torch_store(store) -> bool:
    return type(store).__module__.split(".")[0] == "torch"


def _arrived(store, key: str, seconds: float) -> bool:
    """Whether key exists within `seconds` (0: look once, without waiting)."""
    if seconds <= 0:
        return bool(store.check([key]))
    try:
        if _is_torch_store(store):
            store.wait([key], datetime.timedelta(seconds=seconds))
        else:
            store.wait([key], seconds)
        return True
    except Exception:       # the store's own timeout error (accord's or torch's)
        return bool(store.check([key]))


def _resolve(group):
    """The accord group behind `group`: an accord group, a torch group on backend
    "accord", or None (accord's default group, else torch's default group when that
    one runs on accord); None for a rank outside a torch group."""
    from . import world
    if group is None and not world.is_initialized():
        bridge = sys.modules.get("accord.torch")
        if bridge is not None:
            group = bridge.default_group()
    if group is not None and not isinstance(group, ProcessGroup):
        inner = getattr(group, "accord_group", None)      # accord.torch.AccordProcessGroup
        if inner is not None:
            return inner
        torch = sys.modules.get("torch")
        if torch is not None and group is torch.distributed.GroupMember.NON_GROUP_MEMBER:
            return None
    return world.resolve_group(group)


def _ms(seconds: float) -> int:
    return int(round(seconds * 1000))


def monitored_barrier(group: Optional[ProcessGroup] = None, timeout: Timeout = None,
                      wait_all_ranks: bool = False) -> None:
    """Block until every rank of the group arrives; rank 0 names the ones that do not.

    Args:
        group: the group: an accord group, or a torch.distributed group on backend
            "accord" (default: accord's default group, or torch's default group in a
            program that made it with init_process_group("accord")). A rank that is
            not a member returns at once, as in torch.
        timeout: how long rank 0 waits for all the others together (seconds or a
            timedelta); default: the group's timeout.
        wait_all_ranks: rank 0 waits the whole timeout and names every missing rank,
            instead of stopping at the first (lowest) one.

    Raises:
        accord.CommTimeout: on rank 0, "Rank r failed to pass monitoredBarrier in
            T ms" (the lowest missing rank; with wait_all_ranks "Ranks r1, r2, ...
            failed ..."), or "Rank 0 timed out in monitoredBarrier after T ms" when
            the timeout was spent before any wait (timeout 0); on the other ranks,
            "Rank r successfully reached monitoredBarrier, but received errors while
            waiting for send/recv from rank 0".
    """
    g = _resolve(group)
    if g is None or not g.is_member:
        return None
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif timeout is None:
        seconds = g.timeout
    else:
        seconds = to_seconds(timeout) if timeout else 0.0   # 0: torch's "no wait at all"
    if seconds < 0:
        raise ValueError(f"timeout: must not be negative, got {timeout}")
    if g.size == 1:
        return None
    store = g.store
    gen = _calls.get(g, 0)
    _calls[g] = gen + 1
    prefix = f"accord/monitored_barrier/{g.name}/{gen}"
    done = f"{prefix}/done"
    me = g.ranks[g.rank]
    if g.rank != 0:
        store.set(f"{prefix}/arrived/{g.rank}", b"1")
        # rank 0 always answers within its timeout (plus slack), unless it is gone
        if _arrived(store, done, 2 * seconds + 5.0):
            outcome = store.get(done)
            outcome = outcome.decode() if isinstance(outcome, bytes) else str(outcome)
            if outcome == "ok":
                return None
            why = f"rank 0 reported: {outcome}"
        else:
            why = f"no answer from rank 0 within {_ms(2 * seconds + 5.0)} ms"
        raise CommTimeout(f"[Rank {me}]: Rank {me} successfully reached monitoredBarrier, but "
                          f"received errors while waiting for send/recv from rank "
                          f"{g.ranks[0]} ({why}; group {g.name!r})")
    if seconds <= 0:        # no time to wait at all: only ranks already there pass
        late = [g.ranks[r] for r in range(1, g.size) if not store.check([f"{prefix}/arrived/{r}"])]
        if late:
            msg = (f"[Rank {me}]: Rank {me} timed out in monitoredBarrier after 0 ms (group "
                   f"{g.name!r}; not arrived: {', '.join(map(str, late))})")
            store.set(done, msg)
            raise CommTimeout(msg)
    deadline = time.monotonic() + seconds
    missing = []
    for r in range(1, g.size):
        if not _arrived(store, f"{prefix}/arrived/{r}", max(deadline - time.monotonic(), 0.0)):
            missing.append(g.ranks[r])
            if not wait_all_ranks:
                break
    if not missing:
        store.set(done, "ok")
        return None
    if len(missing) == 1 and not wait_all_ranks:
        msg = f"[Rank {me}]: Rank {missing[0]} failed to pass monitoredBarrier in {_ms(seconds)} ms"
    else:
        names = ", ".join(str(r) for r in missing)
        msg = f"[Rank {me}]: Ranks {names} failed to pass monitoredBarrier in {_ms(seconds)} ms"
    msg += f" (group {g.name!r}, global ranks)"
    store.set(done, msg)
    raise CommTimeout(msg)
