"""Point-to-point rows of `accord bench`, measured the OSU way, for every library.

pingpong (osu_latency): rank 0 sends, rank 1 receives and sends back, rank 0
receives; blocking send/recv.  One timed call is one round trip; the row's
latency is half of it.

p2p_bw (osu_bw): rank 0 posts a window of non-blocking sends of one buffer,
rank 1 posts the matching non-blocking receives into one buffer, each side
waits for all of its window, then rank 1 sends a 4-byte ack that rank 0
receives.  One timed call is one window plus the ack; the row's latency is the
window's time over its messages, so algbw (= busbw) is bytes one way per second.

halo (a simulation's boundary exchange): every rank of a periodic 1-D ring posts
non-blocking receives from its left and right neighbours, then non-blocking sends
to both, then waits for all four (MPI's usual pattern). One timed call is one such
step on every rank; algbw (= busbw) is the bytes one rank sends (two messages) per
second. At world 2 both neighbours are the same rank, told apart by the tags.

pingpong and p2p_bw run between ranks 0 and 1; any other rank joins the barriers
and the max over ranks with a zero-time call.  The two sides post in the same order
(every send before the ack's receive, every receive before the ack's send), so
the window does not depend on a posted receive letting later operations of the
group run first.

Every message carries a pattern that depends on its sender; after the timing of
each size the receivers' buffers are compared with what they should hold.
"""
import numpy as np

P2P_OPS = ("pingpong", "p2p_bw", "halo")
TAG = 17                      # the timed messages' tag (the ack uses TAG + 1;
                              # halo: TAG to the right neighbour, TAG + 1 to the left)
_WINDOW, _BIG, _BIG_WINDOW = 64, 1 << 20, 4


def window(size):
    """Messages per p2p_bw window: osu_bw's 64, but 4 above 1 MiB (a window of
    64 MiB messages would be 4 GiB; per-message costs are negligible at that size)."""
    return _WINDOW if size <= _BIG else _BIG_WINDOW


def messages_per_call(op, size):
    """How many one-way messages one timed call of a p2p op is divided into for its
    row's latency (a halo row's latency is the whole step's)."""
    return {"pingpong": 2, "halo": 1}.get(op) or window(size)


def pattern(numel, sender):
    """The float32 values a message from `sender` carries: never 0, exact in float32."""
    return (np.arange(numel, dtype=np.int64) % 1021 + 1 + 2000 * sender).astype(np.float32)


class TorchStyle:
    """Point-to-point of accord or torch.distributed (the same names and meaning).

    dist: the module; to_buf: numpy array -> that library's tensor (writable)."""

    def __init__(self, dist, to_buf):
        self.dist, self.to_buf = dist, to_buf

    def send(self, buf, peer, tag):
        self.dist.send(buf, dst=peer, tag=tag)

    def recv(self, buf, peer, tag):
        self.dist.recv(buf, src=peer, tag=tag)

    def isend(self, buf, peer, tag):
        return self.dist.isend(buf, dst=peer, tag=tag)

    def irecv(self, buf, peer, tag):
        return self.dist.irecv(buf, src=peer, tag=tag)

    @staticmethod
    def wait_all(works):
        for w in works:
            w.wait()


class MpiStyle:
    """Point-to-point of mpi4py on numpy buffers."""

    def __init__(self, comm, MPI):
        self.comm, self.MPI = comm, MPI
        self.to_buf = lambda a: a

    def send(self, buf, peer, tag):
        self.comm.Send(buf, dest=peer, tag=tag)

    def recv(self, buf, peer, tag):
        self.comm.Recv(buf, source=peer, tag=tag)

    def isend(self, buf, peer, tag):
        return self.comm.Isend(buf, dest=peer, tag=tag)

    def irecv(self, buf, peer, tag):
        return self.comm.Irecv(buf, source=peer, tag=tag)

    def wait_all(self, reqs):
        self.MPI.Request.Waitall(reqs)


def _same(got, want):
    return bool((got == want).all())


def _halo(ep, rank, world, numel):
    """(one halo step on this rank, verify()): see the module's text."""
    buf = ep.to_buf
    left, right = (rank - 1) % world, (rank + 1) % world
    mine = buf(pattern(numel, rank))
    from_left, from_right = buf(np.zeros(numel, np.float32)), buf(np.zeros(numel, np.float32))

    def halo():
        ep.wait_all([ep.irecv(from_left, left, TAG), ep.irecv(from_right, right, TAG + 1),
                     ep.isend(mine, right, TAG), ep.isend(mine, left, TAG + 1)])

    def verify():
        return _same(from_left, pattern(numel, left)) and _same(from_right, pattern(numel, right))
    return halo, verify


def p2p_ops(ep, rank, world, size):
    """({op: one timed call}, verify(done)) for the p2p ops on this rank.

    ep: a TorchStyle or MpiStyle; size: bytes of each message (float32)."""
    numel = size // 4
    if world < 2:
        idle = lambda: None
        return {op: idle for op in P2P_OPS}, lambda done: True
    halo, halo_ok = _halo(ep, rank, world, numel)
    if rank > 1:
        idle = lambda: None
        return {"pingpong": idle, "p2p_bw": idle, "halo": halo}, \
            lambda done: "halo" not in done or halo_ok()
    peer = 1 - rank
    buf = ep.to_buf
    mine, theirs = buf(pattern(numel, rank)), buf(pattern(numel, peer))
    got_pp = buf(np.zeros(numel, np.float32))          # pingpong's receive buffer
    got_bw = buf(np.zeros(numel, np.float32))          # p2p_bw's (rank 1)
    ack_out = buf(np.full(1, 3.0, np.float32))
    ack_in = buf(np.zeros(1, np.float32))
    win = window(size)

    def pingpong():
        if rank == 0:
            ep.send(mine, peer, TAG)
            ep.recv(got_pp, peer, TAG)
        else:
            ep.recv(got_pp, peer, TAG)
            ep.send(mine, peer, TAG)

    def p2p_bw():
        if rank == 0:
            ep.wait_all([ep.isend(mine, peer, TAG) for _ in range(win)])
            ep.recv(ack_in, peer, TAG + 1)
        else:
            ep.wait_all([ep.irecv(got_bw, peer, TAG) for _ in range(win)])
            ep.send(ack_out, peer, TAG + 1)

    def verify(done):
        ok = "halo" not in done or halo_ok()
        if "pingpong" in done:
            ok &= _same(got_pp, theirs)
        if "p2p_bw" in done:
            ok &= _same(ack_in, ack_out) if rank == 0 else _same(got_bw, theirs)
        return ok

    return {"pingpong": pingpong, "p2p_bw": p2p_bw, "halo": halo}, verify
