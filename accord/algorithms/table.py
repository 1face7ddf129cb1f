"""Which algorithm runs a collective: the one place where that is decided.

For each collective, its algorithms in order of preference; the first whose
`applies(comm, nbytes)` holds runs. `comm` is anything with `rank`, `size`,
`peer_memory`, `slots`, `fans_out` and `choices` (a Comm, or a group's transport when a call is
planned), and every rank of a group gets the same answer, so all take the same
path.

ACCORD_ALGORITHMS=broadcast=chain,all_reduce=ring forces a choice (tests use
it to cover every path at every size; it reaches every path, the phases of a
hierarchical call included). A forced algorithm that cannot run here (single
copy over TCP) leaves the default choice; forcing `broadcast` also sends
lists of buffers (`broadcast_list`) down the plain chain.
"""
from typing import Callable, NamedTuple, Optional

from . import all_gather, broadcast, reduction, single_copy, slotted


class Entry(NamedTuple):
    fn: Callable
    applies: Optional[Callable] = None        # applies(comm, nbytes) -> bool; None: always
    # scratch(numel, size, itemsize) -> elements of receive scratch the call needs
    scratch: Optional[Callable] = None
    # can_run(comm, nbytes) -> bool, where it differs from applies: what forcing it needs
    # (applies adds where it is worth choosing); None: applies
    can_run: Optional[Callable] = None


# below these sizes (bytes) the latency-bound algorithm runs
SMALL = {"broadcast": 256 << 10, "all_gather": 64 << 10, "all_reduce": 64 << 10,
         "reduce_scatter": 16 << 10}


# gather_reduce's limit: the bytes its one step moves in all (n(n - 1) messages); what the
# step costs grows with all of them where ranks share cores
GATHER_REDUCE_BYTES = 48 << 10


def _small(op):
    limit = SMALL[op]
    return lambda c, nbytes: nbytes < limit


ALGORITHMS = {
    "broadcast": {
        "single_copy": Entry(single_copy.broadcast, single_copy.broadcast_applies),
        "slotted": Entry(slotted.broadcast, slotted.broadcast_applies,
                         can_run=slotted.can_run),
        "tree": Entry(broadcast.tree, _small("broadcast")),
        "chain": Entry(broadcast.chain),
    },
    # a list of buffers broadcast as one call (broadcast_state's buckets, a
    # hierarchical all_gather's last phase)
    "broadcast_list": {
        # two ranks: the ring, both cores copying (50 MiB state dicts in 0.68x the split
        # single copy's time, 10 MiB of small tensors 0.92x: six paired runs of
        # benchmarks/bench_state.py -n 2); more: the split single copy
        "ring": Entry(single_copy.ring_list, single_copy.ring_list_applies),
        "single_copy": Entry(single_copy.broadcast_list, single_copy.list_applies),
        "slotted": Entry(slotted.broadcast_list, slotted.list_applies,
                         can_run=slotted.can_run),
        "tree": Entry(broadcast.tree_pieces, _small("broadcast")),
        "chain": Entry(broadcast.chain_pieces),
    },
    "all_gather": {
        "slotted": Entry(slotted.all_gather, slotted.all_gather_applies,
                         can_run=slotted.can_run),
        # a ring of 2 is a single exchange: the direct path is as good and simpler
        "direct": Entry(all_gather.direct,
                        lambda c, nbytes: nbytes < SMALL["all_gather"] or c.size <= 2),
        # a power of two of ranks beyond two: log2(n) steps, not n - 1 (64 KiB: 0.62x the
        # ring's time at world 4, 0.73x at world 8; from 1 MiB 0.95-1.00x)
        "doubling": Entry(all_gather.doubling, all_gather.doubling_applies),
        "ring": Entry(all_gather.ring),
    },
    # reduce_scatter's algorithms take (comm, ins, whole, out, op, bf16, tmp, spare):
    # whole, this rank's input as one array (None where it is not one); all but the ring
    # only where it is and every block has out's size (plans.reduce_scatter_moves sees
    # to it)
    "reduce_scatter": {
        # gather_reduce's case: small, not a power of two, shared memory (the limit on
        # the bytes the one step moves: (n - 1) x the whole input)
        "direct": Entry(lambda c, ins, whole, out, op, bf16, tmp, spare:
                        reduction.direct_reduce_scatter_into(c, ins, out, op, bf16, tmp),
                        lambda c, nbytes: c.size > 2 and c.size & (c.size - 1)
                        and c.fans_out and (c.size - 1) * nbytes <= GATHER_REDUCE_BYTES,
                        can_run=lambda c, nbytes: True),
        "doubling": Entry(lambda c, ins, whole, out, op, bf16, tmp, spare:
                          reduction.doubling_reduce_scatter_into(c, whole, out, op, bf16,
                                                                 tmp, spare),
                          lambda c, nbytes: c.size > 2 and nbytes < SMALL["reduce_scatter"],
                          can_run=lambda c, nbytes: c.size > 2),
        # the same halving through the slots as all_reduce's, from a smaller size
        "slotted": Entry(lambda c, ins, whole, out, op, bf16, tmp, spare:
                         slotted.reduce_scatter(c, whole, out, op, bf16, spare),
                         slotted.reduce_scatter_applies, can_run=slotted.all_reduce_can_run),
        "halving": Entry(lambda c, ins, whole, out, op, bf16, tmp, spare:
                         reduction.halving_reduce_scatter_into(c, whole, out, op, bf16, tmp,
                                                               spare),
                         reduction.halving_doubling_applies),
        "ring": Entry(lambda c, ins, whole, out, op, bf16, tmp, spare:
                      reduction.ring_reduce_scatter_into(c, ins, out, op, bf16, tmp)),
    },
    "all_reduce": {
        "slotted": Entry(slotted.all_reduce, slotted.all_reduce_applies,
                         scratch=lambda numel, size, itemsize: 0,
                         can_run=slotted.all_reduce_can_run),
        # small, the group not a power of two, shared memory: one step where recursive
        # doubling takes three at world 3 (8 B-8 KiB there in 0.51-0.90x its time; world 6
        # at 8 B-1 KiB 0.67-0.97x; over TCP 1.01-1.33x, at a power of two 1.14-1.25x:
        # benchmarks/results/small-messages.md)
        "gather_reduce": Entry(reduction.gather_reduce, lambda c, nbytes:
                               c.size & (c.size - 1) and c.fans_out and
                               c.size * (c.size - 1) * nbytes <= GATHER_REDUCE_BYTES,
                               scratch=lambda numel, size, itemsize: (size - 1) * numel,
                               can_run=lambda c, nbytes: True),
        "recursive_doubling": Entry(reduction.recursive_doubling, _small("all_reduce"),
                                    scratch=lambda numel, size, itemsize: numel),
        # a power of two of ranks beyond two: 2 log2(n) steps, not 2(n - 1) (world 4,
        # 64 KiB-1 MiB: 0.55-0.97x the ring's time over shared memory, 0.57-0.68x over
        # TCP; world 8: 0.48-0.78x; paired rounds, benchmarks/results/small-messages.md)
        "halving_doubling": Entry(reduction.halving_doubling,
                                  reduction.halving_doubling_applies,
                                  scratch=lambda numel, size, itemsize:
                                  min(numel // 2 + 1, reduction.piece_elems(itemsize))),
        "ring": Entry(reduction.ring_allreduce,
                      scratch=lambda numel, size, itemsize:
                      min(-(-numel // size), reduction.piece_elems(itemsize))),
    },
}


_MEMO_MAX = 512        # distinct (op, size) choices kept per set of links


def entry(op, nbytes, comm, forced):
    """The Entry that runs `op` on nbytes over comm; forced: ACCORD_ALGORITHMS.

    The choice depends only on the op, the size and the links (which never change
    for a group's life), so it is kept in the links' `choices` dict: a small call
    pays a dictionary lookup, not the predicates."""
    memo = comm.choices
    if not forced:
        e = memo.get((op, nbytes))
        if e is not None:
            return e
        if len(memo) >= _MEMO_MAX:
            memo.clear()
        e = memo[(op, nbytes)] = _entry(op, nbytes, comm, forced)
        return e
    return _entry(op, nbytes, comm, forced)


def _entry(op, nbytes, comm, forced):
    algos = ALGORITHMS[op]
    name = forced.get(op)
    if name is None and op == "broadcast_list" and "broadcast" in forced:
        name = "chain"
    if name is not None:
        e = algos.get(name)
        if e is None:
            raise ValueError(f"ACCORD_ALGORITHMS: {op} has no algorithm {name!r}; choose one "
                             f"of {', '.join(algos)}")
        check = e.can_run or e.applies
        if check is None or check(comm, nbytes):
            return e
    for e in algos.values():
        if e.applies is None or e.applies(comm, nbytes):
            return e
    raise AssertionError(f"no algorithm applies to {op}")     # the last one always does


def choose(op, nbytes, comm, forced):
    """The function that runs `op`: fn(comm, ...) with the collective's arguments."""
    return entry(op, nbytes, comm, forced).fn
