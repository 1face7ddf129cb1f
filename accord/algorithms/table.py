"""Which algorithm runs a collective: by message size, overridable per op.

ACCORD_ALGORITHMS=broadcast=chain,all_reduce=ring forces a choice (tests use
it to cover every path at every size).
"""
from . import allgather, broadcast, reduction

ALGORITHMS = {
    "broadcast": {"tree": broadcast.tree, "chain": broadcast.chain},
    "all_gather": {"direct": allgather.direct, "ring": allgather.ring},
    "all_reduce": {"recursive_doubling": reduction.recursive_doubling,
                   "ring": reduction.ring_allreduce},
}

# Below the threshold (bytes) the first, latency-bound, algorithm runs.
_SMALL = {"broadcast": 256 << 10, "all_gather": 64 << 10, "all_reduce": 64 << 10}


def choose(op, nbytes, size, forced):
    algos = ALGORITHMS[op]
    name = forced.get(op)
    if name is not None:
        try:
            return algos[name]
        except KeyError:
            raise ValueError(f"ACCORD_ALGORITHMS: {op} has no algorithm {name!r}; choose one "
                             f"of {', '.join(algos)}") from None
    small, large = list(algos.values())
    # a ring of 2 is a single exchange: the small path is as good and simpler
    return small if nbytes < _SMALL[op] or size <= 2 and op == "all_gather" else large
