"""Hierarchical collectives for groups that span hosts with several ranks on one.

Such a group's own links are TCP (transport/factory.py). Next to them it gets
two private subgroups: the members on this rank's host, over shared memory,
and one leader per host (its first member), over TCP. broadcast, all_reduce,
all_gather and reduce_scatter of MIN_BYTES or more then run in three phases:
on the host, among the leaders, on the host again, so each host's bytes cross
the network once and the rest move at memory speed. Smaller ones, the barrier and the
other collectives keep the flat TCP algorithms: three phases cost three
latencies.

Measured with hosts simulated on one machine (benchmarks/bench_hierarchy.py,
4 ranks as 2 hosts of 2, against ACCORD_TRANSPORT=tcp): all_reduce 64 KiB
444 vs 1101 µs, 16 MiB 16.1 vs 29.8 ms; broadcast 256 KiB 242 vs 338 µs,
16 MiB 7.5 vs 14.4 ms; all_gather 4 MiB in all 4.1 vs 4.6 ms, 64 MiB 37.7
vs 51.9 ms; but broadcast 64 KiB 132 vs 106 µs, 1 KiB 100 vs 55 µs,
all_reduce 1 KiB 474 vs 380 µs, all_gather 256 KiB in all 767 vs 670 µs,
barrier 365 vs 244 µs. Across a 1 Gbit/s link (benchmarks/netns_hierarchy.sh)
all_reduce 16 MiB took 154 vs 211 ms and all_gather of 16 MiB per rank 302 vs
439 ms: the leaders move each host's bytes across once. reduce_scatter is the
exception on loopback (16 MiB per rank 97.9 vs 92.8 ms: the first phase reduces
the whole input on each host, not a share of it) but gains across the link
(380 vs 452 ms), which is where the hierarchy applies.

The subgroups are used only from inside a call of their parent, one call at a
time, on the thread running it; each phase is a call of its own, stamped and
checked as any other, under what is left of the parent call's deadline. A
failure breaks the parent and both subgroups, so peers waiting in any phase
hear why.
"""
import time

from . import plans
from .algorithms import rooted
from .algorithms.table import choose
from .group import ProcessGroup
from .reduceops import ReduceOp, finish_avg, reduce_into

MIN_BYTES = {"broadcast": 256 << 10, "all_reduce": 16 << 10, "all_gather": 1 << 20,
             "reduce_scatter": 1 << 20}


def phased(group, op, nbytes):
    """Whether `op` of nbytes on group runs in phases (the group spans hosts and the
    call is large enough). Every rank decides alike where sizes agree."""
    return group.hier is not None and nbytes >= MIN_BYTES[op]


def wanted(hosts):
    """Whether a group with these member hosts (in group-rank order) gains from it."""
    distinct = set(hosts)
    return len(distinct) > 1 and len(distinct) < len(hosts)


class Hierarchy:
    def __init__(self, group, hosts, local, leaders):
        self.group = group
        order = list(dict.fromkeys(hosts))                # hosts in order of first rank
        self.host_of = [order.index(h) for h in hosts]    # group rank -> host index
        self.local_index = [hosts[:r].count(hosts[r]) for r in range(len(hosts))]
        self.local, self.leaders = local, leaders         # leaders: None off the leaders
        self.my_host = self.host_of[group.rank]

    @property
    def subgroups(self):
        return [s for s in (self.local, self.leaders) if s is not None]

    # -- the phases ---------------------------------------------------------------
    def broadcast(self, buf, root):
        def run(c):
            rh = self.host_of[root]
            if self.my_host == rh:
                self._call(c, self.local, "broadcast", plans.broadcast_run, buf,
                           self.local_index[root])
            if self.leaders is not None:
                self._call(c, self.leaders, "broadcast", plans.broadcast_run, buf, rh)
            if self.my_host != rh:
                self._call(c, self.local, "broadcast", plans.broadcast_run, buf, 0)
        return run

    def all_reduce(self, buf, op):
        # partial results are sums; an average is taken once, of the whole
        phase = ReduceOp.SUM if op == ReduceOp.AVG else op

        def run(c):
            self._call(c, self.local, "reduce", plans.reduce_run, buf, 0, phase, True)
            if self.leaders is not None:
                self._call(c, self.leaders, "all_reduce", plans.all_reduce_run, buf, phase)
                if op == ReduceOp.AVG:
                    finish_avg(buf.arr, self.group.size, buf.is_bf16)
            self._call(c, self.local, "broadcast", plans.broadcast_run, buf, 0)
        return run

    def all_gather(self, blocks, mine, own):
        """blocks: the output's per-rank blocks; own(): fills this rank's from mine."""
        g = self.group
        here = [r for r in range(g.size) if self.host_of[r] == self.my_host]
        total = sum(b.nbytes for b in blocks)

        def gather_here(sub):
            def body(c):
                if c is not None:
                    rooted.gather(c, mine.arr, [blocks[r] for r in here] if c.rank == 0
                                  else None, 0)
            return body, plans.stamp(mine, 0)

        def between_hosts(sub):
            # each leader sends its host's blocks to every other leader, in group-rank
            # order, and takes theirs the same way
            def body(c):
                if c is not None:
                    mine_l = self.host_of[g.rank]
                    sends, recvs = [], []
                    for h in range(c.size):
                        if h != mine_l:
                            sends += [(h, blocks[r]) for r in here]
                            recvs += [(h, blocks[r]) for r in range(g.size)
                                      if self.host_of[r] == h]
                    c.exchange(sends=sends, recvs=recvs)
            return body, plans.stamp(mine, count=total)

        def spread_here(sub):
            # every block: a member has only its own, the leader all of them
            bufs = list(blocks)

            total_here = sum(b.nbytes for b in bufs)

            def body(c):
                if c is not None:
                    choose("broadcast_list", total_here, c, sub.options.algorithms)(c, bufs, 0)
            return body, plans.stamp(mine, 0, count=total_here)

        def run(c):
            own()
            self._call(c, self.local, "gather", gather_here)
            if self.leaders is not None:
                self._call(c, self.leaders, "all_gather", between_hosts)
            self._call(c, self.local, "broadcast", spread_here)
        return run

    def reduce_scatter(self, work, blocks, like, op):
        """work: this rank's whole input (a scratch copy), blocks: its per-rank views;
        afterwards blocks[rank] holds the reduction (averaged for AVG). like: the
        output's Buf (dtype, bf16)."""
        g = self.group
        here = [r for r in range(g.size) if self.host_of[r] == self.my_host]
        phase = ReduceOp.SUM if op == ReduceOp.AVG else op
        whole = _View(work.reshape(-1), like)

        def between_hosts(sub):
            # leader h ends with every host's partial sums of host h's blocks: in round
            # s it sends leader h+s the blocks of its ranks and reduces what h-s sends
            def body(c):
                if c is None:
                    return
                n, me = c.size, c.rank
                mine_n = sum(blocks[r].size for r in here)
                tmp = sub.scratch(work.dtype, mine_n)
                for s in range(1, n):
                    to, frm = (me + s) % n, (me - s) % n
                    sends = [(to, blocks[r]) for r in range(g.size) if self.host_of[r] == to]
                    recvs, off = [], 0
                    for r in here:
                        recvs.append((frm, tmp[off:off + blocks[r].size]))
                        off += blocks[r].size
                    c.exchange(sends=sends, recvs=recvs)
                    for (_, t), r in zip(recvs, here):
                        reduce_into(phase, blocks[r], t, like.is_bf16)
            return body, plans.stamp(like, -1, phase, work.nbytes)

        def scatter_here(sub):
            def body(c):
                if c is not None:
                    rooted.scatter(c, blocks[g.rank], [blocks[r] for r in here]
                                   if c.rank == 0 else None, 0)
            return body, plans.stamp(like, 0)

        def run(c):
            self._call(c, self.local, "reduce", plans.reduce_run, whole, 0, phase, True)
            if self.leaders is not None:
                self._call(c, self.leaders, "reduce_scatter", between_hosts)
                if op == ReduceOp.AVG:
                    for r in here:
                        finish_avg(blocks[r], g.size, like.is_bf16)
            self._call(c, self.local, "scatter", scatter_here)
        return run

    def _call(self, c, sub, opname, make, *args):
        """One phase: a synchronous call on subgroup sub within the parent's deadline."""
        body, stamp = make(sub, *args)
        plans.run(sub, opname, body, False, max(0.001, c.deadline - time.monotonic()), stamp)

    # -- lifetime -------------------------------------------------------------------
    def break_all(self, exc):
        for s in self.subgroups:
            if s._closed is None and s.transport is not None:
                s._break(exc)

    def destroy(self):
        for s in self.subgroups:
            s.destroy(check=False)


class _View:
    """A contiguous array seen as a Buf: of the same element type as `like`, or of
    plain bytes (like=None) where only the bytes move."""

    def __init__(self, arr, like=None):
        self.arr, self.nbytes, self.numel, self.itemsize = arr, arr.nbytes, arr.size, \
            arr.itemsize
        self.dtype_code = like.dtype_code if like is not None else 0
        self.dtype_name = like.dtype_name if like is not None else ""
        self.is_bf16 = like.is_bf16 if like is not None else False
        self.shape = None


def build(group, hosts, connect):
    """The subgroups of a member group whose hosts are mixed (every member calls this).

    connect(sub): gives a new subgroup its transport, collectives only (the caller
    knows the store and addresses the parent met through)."""
    order = list(dict.fromkeys(hosts))
    mine = [r for r in range(group.size) if hosts[r] == hosts[group.rank]]
    leaders = [hosts.index(h) for h in order]
    name = group.name
    local = ProcessGroup(f"{name}/host{order.index(hosts[group.rank])}",
                         [group.ranks[r] for r in mine], group.global_rank,
                         timeout=group.timeout, options=group.options)
    if local.size > 1:
        connect(local)
    lead = None
    if group.rank in leaders:
        lead = ProcessGroup(f"{name}/leaders", [group.ranks[r] for r in leaders],
                            group.global_rank, timeout=group.timeout, options=group.options)
        connect(lead)
    return Hierarchy(group, hosts, local, lead)
