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
    peers = [p for p in range(c.size) if p != r]
    src = blocks[r] if mine is None else mine
    c.exchange(sends=[(p, src) for p in peers], recvs=[(p, blocks[p]) for p in peers],
               meanwhile=meanwhile)
