"""How the members of one Ray collective group find each other's store.

Rank 0 hosts the group's accord store (a TCPStore server in its own process, on
the address Ray knows its node by) and publishes "where and which secret" in
Ray's internal key-value store, which every process of the cluster can read;
the other members poll that key, then connect. The key names the Ray namespace
and the group, so two jobs' groups of the same name do not meet, and rank 0
removes it once every member is in: a group made again under the same name
(after destroy_collective_group) meets afresh.

The search for the store ends at the group's join deadline, or at once when
Ray reports rank 0's actor dead (members.py).

A key left behind by a rank 0 that died during its rendezvous points at a
store nobody serves: a member that cannot reach it reads the key again until
the deadline, so the next rank 0's address, published under the same key,
wins.
"""
from __future__ import annotations

import json
import secrets
import time
from typing import Optional, Tuple

import ray
from ray.experimental import internal_kv

from ..errors import AccordError, CommTimeout
from ..tcpstore import TCPStore
from .members import Watch

_KV_NAMESPACE = "accord"
_POLL_S = (0.02, 0.25)          # the first and the longest pause between reads of the key
_CONNECT_TRY_S = 5.0            # one attempt to reach a published store


def kv_key(group_name: str) -> str:
    """The internal-KV key rank 0 publishes the store of group_name under."""
    namespace = ray.get_runtime_context().namespace or ""
    return f"group/{namespace}/{group_name}"


def node_address() -> str:
    """The address Ray knows this process's node by (its --node-ip-address)."""
    return ray.util.get_node_ip_address()


def host_store(group_name: str, size: int, timeout: float) -> TCPStore:
    """Rank 0: serve the group's store and publish its address and secret."""
    host = node_address()
    token = secrets.token_hex(16)
    store = TCPStore(host, 0, size, is_master=True, timeout=timeout, token=token)
    record = {"host": host, "port": store.port, "token": token, "size": size}
    internal_kv._internal_kv_put(kv_key(group_name), json.dumps(record), overwrite=True,
                                 namespace=_KV_NAMESPACE)
    return store


def unpublish(group_name: str) -> None:
    """Rank 0, once every member is connected (or its rendezvous failed)."""
    try:
        internal_kv._internal_kv_del(kv_key(group_name), namespace=_KV_NAMESPACE)
    except Exception:       # noqa: BLE001 (Ray shutting down: nothing is left to meet)
        pass


def join_store(group_name: str, rank: int, size: int, timeout: float,
               watch: Watch) -> Tuple[TCPStore, str]:
    """Any other rank: (a client of the group's store, the store's host).

    timeout: the group's (the store's operations); the search for the store
    ends at the watch's join deadline, or as soon as Ray reports rank 0's
    actor dead (a declared group names it).

    Raises:
        accord.PeerLost: Ray reports rank 0's actor dead.
        accord.CommTimeout: no reachable store for a group of `size` was published
            within the join timeout (rank 0 not started, or made with another world size).
    """
    deadline = watch.deadline
    pause, last = _POLL_S[0], None
    key = kv_key(group_name)
    while True:
        record = _read(key)
        if record is not None and record.get("size") != size:
            last = (f"rank 0 published a group of world_size {record.get('size')}, this rank "
                    f"was told {size}")
        elif record is not None:
            remaining = deadline - time.monotonic()
            try:
                store = TCPStore(record["host"], int(record["port"]), size,
                                 timeout=max(0.1, min(_CONNECT_TRY_S, remaining)),
                                 token=record["token"])
                store.set_timeout(timeout)
                return store, record["host"]
            except (AccordError, OSError) as e:
                last = f"the published store {record['host']}:{record['port']}: {e}"
        watch.check()
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise CommTimeout(
                f"rank {rank} of Ray collective group {group_name!r}: rank 0 did not publish "
                f"a reachable store within {watch.timeout:g} s (ACCORD_RAY_JOIN_TIMEOUT)"
                + (f" (last: {last})" if last else " (is rank 0's init_collective_group running?)"))
        time.sleep(min(pause, remaining))
        pause = min(pause * 2, _POLL_S[1])


def published(group_name: str) -> Optional[dict]:
    """What rank 0 of group_name published (host, port, token, size), None before it did
    or once every member is in."""
    return _read(kv_key(group_name))


def _read(key: str) -> Optional[dict]:
    raw = internal_kv._internal_kv_get(key, namespace=_KV_NAMESPACE)
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return None
