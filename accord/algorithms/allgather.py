"""All-gather into per-rank blocks (own block already filled; sizes may differ)."""


def ring(c, blocks):
    n, r = c.size, c.rank
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        c.exchange(sends=[(right, blocks[(r - s) % n])], recvs=[(left, blocks[(r - s - 1) % n])])


def direct(c, blocks):
    """Every rank sends its block to every other at once: one step, for small sizes."""
    r = c.rank
    peers = [p for p in range(c.size) if p != r]
    c.exchange(sends=[(p, blocks[r]) for p in peers], recvs=[(p, blocks[p]) for p in peers])
