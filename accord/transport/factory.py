"""Which transport a group gets: shared memory on one host, TCP otherwise.

ACCORD_TRANSPORT=auto (the default) gives a group whose members all share a
host the shared-memory transport, and TCP to any other group; `tcp` forces
TCP; `shm` forces shared memory and refuses a group that spans hosts. A
group that mixes hosts gets TCP links, and where a host holds several of its
ranks, per-host shared-memory subgroups for hierarchical collectives
(hierarchy.py).

Host identity: ACCORD_HOST_ID, else the host name plus the kernel's boot id
(two containers on one kernel with different host names count as different
hosts: they may not share /dev/shm).
"""
import os
import socket

from .connect import connect_mesh
from .tcp import TcpTransport


def host_identity(options):
    if options.host_id:
        return options.host_id
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def group_hosts(store, prefix, rank, size, options, deadline):
    """Every member's host identity, in group-rank order (one store round)."""
    store.set(f"{prefix}/host/{rank}", host_identity(options))
    return [_text(store.get(f"{prefix}/host/{r}")) for r in range(size)]


def _text(v):
    return v.decode() if isinstance(v, (bytes, bytearray)) else str(v)


def build_transport(store, prefix, rank, size, describe_rank, options, addr, deadline):
    """Connect this member of group `prefix` to the others; return its transport."""
    mode = options.transport
    if size > 1 and mode != "tcp":
        hosts = group_hosts(store, prefix, rank, size, options, deadline)
        if len(set(hosts)) == 1 and os.path.isdir("/dev/shm"):
            from . import futex
            if futex.AVAILABLE or mode == "shm":
                from .shm import ShmUnavailable, connect_shm
                try:
                    return connect_shm(store, prefix, rank, size, describe_rank, deadline,
                                       arena_bytes=options.shm_arena,
                                       cma_min=options.shm_cma_min,
                                       p2p_cma_min=options.shm_p2p_cma_min)
                except ShmUnavailable:
                    # every member raises it together, so all fall back to TCP together
                    if mode == "shm":
                        raise
        if mode == "shm":
            by_host = {}
            for r, h in enumerate(hosts):
                by_host.setdefault(h, []).append(describe_rank(r))
            layout = "; ".join(f"{h}: {', '.join(rs)}" for h, rs in by_host.items())
            raise ValueError(f"ACCORD_TRANSPORT=shm, but group {prefix!r} spans "
                             f"{len(by_host)} hosts ({layout}); shared memory only links "
                             f"ranks on one host: use ACCORD_TRANSPORT=auto or tcp")
    socks = connect_mesh(store, prefix, rank, size, addr, deadline)
    if size > 1 and mode != "tcp":
        t = TcpTransport(rank, size, socks, describe_rank, hosts.count(hosts[rank]))
        t.hosts = hosts         # mixed: api.py adds per-host shared memory (hierarchy.py)
        return t
    return TcpTransport(rank, size, socks, describe_rank)


def connect_p2p(store, prefix, rank, size, describe_rank, coll, addr, deadline):
    """The point-to-point plane beside the collective transport coll (transport/p2p.py).

    Shared memory: the second rings of the arena coll already maps (no setup);
    TCP: a second connection per pair, so tagged messages never queue behind a
    collective's bytes on one socket, nor a collective behind theirs."""
    if coll.p2p is not None:
        return coll.p2p
    socks = connect_mesh(store, f"{prefix}/p2p", rank, size, addr, deadline)
    return TcpTransport(rank, size, socks, describe_rank, coll.members_here)

