"""Reduce, all-reduce and reduce-scatter.

Floating results are bit-identical on every rank: each element is reduced
once, in one rank's order, and then copied, never re-reduced elsewhere.
"""
import numpy as np

from ..reduceops import ReduceOp, finish_avg, reduce_into
from . import even_counts, split


def tree_reduce(c, acc, root, op, bf16, tmp):
    """Binomial reduce into acc on root; acc is scratch on the other ranks."""
    n, vr = c.size, (c.rank - root) % c.size
    mask = 1
    while mask < n:
        if vr & mask:
            c.send((vr - mask + root) % n, acc)
            return
        child = vr + mask
        if child < n:
            c.recv((child + root) % n, tmp)
            reduce_into(op, acc, tmp, bf16)
        mask <<= 1
    if op == ReduceOp.AVG:
        finish_avg(acc, n, bf16)


def recursive_doubling(c, acc, op, bf16, tmp):
    n, r = c.size, c.rank
    p2 = 1 << (n.bit_length() - 1)
    extra = n - p2
    # fold the ranks beyond the largest power of two into their partners
    if r >= p2:
        c.send(r - p2, acc)
        c.recv(r - p2, acc)
        return
    if r < extra:
        c.recv(r + p2, tmp)
        reduce_into(op, acc, tmp, bf16)
    mask = 1
    while mask < p2:
        partner = r ^ mask
        c.exchange(sends=[(partner, acc)], recvs=[(partner, tmp)])
        # both partners reduce (lower rank's part) op (higher rank's part): numpy's
        # complex64 multiply is not bit-commutative (a*b != b*a), so the operand order
        # must be the same on both sides for every rank to end with the same bits
        if r < partner:
            reduce_into(op, acc, tmp, bf16)
        else:
            reduce_into(op, tmp, acc, bf16)
            acc[...] = tmp
        mask <<= 1
    if op == ReduceOp.AVG:
        finish_avg(acc, n, bf16)
    if r < extra:
        c.send(r + p2, acc)


def ring_reduce_scatter(c, blocks, op, bf16, tmp):
    """After it, rank r holds the full reduction in blocks[r] (not averaged)."""
    n, r = c.size, c.rank
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        sb = blocks[(r - s - 1) % n]
        rb = blocks[(r - s - 2) % n]
        t = tmp[:rb.size]
        c.exchange(sends=[(right, sb)], recvs=[(left, t)])
        reduce_into(op, rb, t, bf16)


def ring_allreduce(c, acc, op, bf16, tmp):
    n = c.size
    blocks = split(acc, even_counts(acc.size, n))
    ring_reduce_scatter(c, blocks, op, bf16, tmp)
    if op == ReduceOp.AVG:
        finish_avg(blocks[c.rank], n, bf16)
    from .allgather import ring
    ring(c, blocks)


def scratch(arr, numel):
    return np.empty(numel, dtype=arr.dtype)
