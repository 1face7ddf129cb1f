"""Gather and scatter: the root talks to every rank at once."""


def gather(c, mine, blocks, root):
    """blocks: the root's per-rank destinations (its own already filled)."""
    if c.rank == root:
        c.exchange(recvs=[(p, blocks[p]) for p in range(c.size) if p != root])
    else:
        c.send(root, mine)


def scatter(c, mine, blocks, root, meanwhile=None):
    """blocks: the root's per-rank sources; meanwhile (the root's): copies its own block
    to mine, while the others' move where the transport allows."""
    if c.rank == root:
        if c.size == 2:
            c.send(1 - root, blocks[1 - root], meanwhile)
        else:
            c.exchange(sends=[(p, blocks[p]) for p in range(c.size) if p != root],
                       meanwhile=meanwhile)
    else:
        c.recv(root, mine)


def all_to_all(c, out_blocks, in_blocks, meanwhile=None):
    """out_blocks[p] <- rank p's in_blocks[me]; meanwhile (copying this rank's own
    block) runs while the others' move, where the transport allows."""
    r, n = c.rank, c.size
    if n == 2:
        c.swap(1 - r, in_blocks[1 - r], out_blocks[1 - r], meanwhile)
        return
    order = [(r + s) % n for s in range(1, n)]
    c.exchange(sends=[(p, in_blocks[p]) for p in order],
               recvs=[(p, out_blocks[p]) for p in order], meanwhile=meanwhile)


def barrier(c, token):
    """Dissemination: log2(n) rounds of empty messages."""
    n, r, k = c.size, c.rank, 1
    while k < n:
        to, fro = (r + k) % n, (r - k) % n
        if to == fro:
            c.swap(to, token, token)
        else:
            c.exchange(sends=[(to, token)], recvs=[(fro, token)])
        k <<= 1
