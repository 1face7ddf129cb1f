"""All-gather into per-rank blocks (own block already filled; sizes may differ)."""


def ring(c, blocks, mine=None, meanwhile=None):
    """n-1 steps, each passing one block right (bandwidth: every link busy).

    meanwhile (copying this rank's own block into place) runs first."""
    if meanwhile is not None:
        meanwhile()
    n, r = c.size, c.rank
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        c.exchange(sends=[(right, blocks[(r - s) % n])], recvs=[(left, blocks[(r - s - 1) % n])])


def direct(c, blocks, mine=None, meanwhile=None):
    """Every rank sends its block to every other at once: one step.

    mine: the source of this rank's block, sent as it is, so that meanwhile (which
    copies it into blocks[rank]) can run while the peers copy it out.
    """
    r = c.rank
    src = blocks[r] if mine is None else mine
    if c.size == 2:
        c.swap(1 - r, src, blocks[1 - r], meanwhile)
        return
    peers = [p for p in range(c.size) if p != r]
    c.exchange(sends=[(p, src) for p in peers], recvs=[(p, blocks[p]) for p in peers],
               meanwhile=meanwhile)


def doubling_applies(c, nbytes):
    """A power of two of ranks beyond two."""
    n = c.size
    return n > 2 and n & (n - 1) == 0


def doubling(c, blocks, mine=None, meanwhile=None):
    """Recursive doubling: log2(n) steps instead of the ring's n - 1, the same bytes.
    Step k swaps the 2^k blocks this rank holds with the partner across them, so
    fewer steps wait for a partner to be scheduled where ranks outnumber cores.

    mine: the source of this rank's block, sent in the first step while meanwhile
    copies it into blocks[rank] (as in direct)."""
    n, r = c.size, c.rank
    mask = 1
    while mask < n:
        partner = r ^ mask
        lo, plo = r & ~(mask - 1), partner & ~(mask - 1)
        if mask == 1:
            c.swap(partner, blocks[r] if mine is None else mine, blocks[partner], meanwhile)
        else:
            c.exchange(sends=[(partner, blocks[i]) for i in range(lo, lo + mask)],
                       recvs=[(partner, blocks[i]) for i in range(plo, plo + mask)])
        mask <<= 1
