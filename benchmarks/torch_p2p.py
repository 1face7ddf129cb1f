"""Point to point through torch.distributed on a backend, as torch's own callers make
it: a blocking send/recv ping-pong, the same with isend/irecv and wait(), with
batch_isend_irecv (one op a batch, as a pipeline schedule's), a two-way exchange
in one batch_isend_irecv (a pipeline stage's boundary), and a window of isends.

    accord run -n 2 benchmarks/torch_p2p.py accord      # or gloo

This is where a backend's progress thread shows: accord's used to sleep through
small messages here (up to 250 ms each), then handed each one over (40 µs one
way). Rank 0 prints the best of 5 rounds: each ping-pong's one-way latency (200
round trips a round; the exchange's time per batch) and the window's time per
message (50 windows of 64 isends of 8 bytes, matched by irecvs, then a 4-byte
ack), with the load average.
"""
import os
import sys
import time

import torch
import torch.distributed as dist

import accord.torch  # noqa: F401  (registers the backend "accord")

WINDOW, ROUNDS = 64, 5


def main():
    backend = sys.argv[1] if len(sys.argv) > 1 else "accord"
    dist.init_process_group(backend)
    rank = dist.get_rank()
    m, ack, ack2 = torch.ones(2), torch.zeros(1), torch.zeros(2)

    def pingpong():
        for _ in range(200):
            if rank == 0:
                dist.send(m, 1)
                dist.recv(m, 1)
            elif rank == 1:
                dist.recv(m, 0)
                dist.send(m, 0)

    peer = 1 - rank

    def iwait():
        for _ in range(200):
            if rank == 0:
                dist.isend(m, 1).wait()
                dist.irecv(m, 1).wait()
            elif rank == 1:
                dist.irecv(m, 0).wait()
                dist.isend(m, 0).wait()

    def batched():
        for _ in range(200 if rank < 2 else 0):
            first, then = (dist.isend, dist.irecv) if rank == 0 else (dist.irecv, dist.isend)
            for op in (first, then):
                for w in dist.batch_isend_irecv([dist.P2POp(op, m, peer)]):
                    w.wait()

    def exchange():
        for _ in range(200 if rank < 2 else 0):
            ops = [dist.P2POp(dist.isend, m, peer), dist.P2POp(dist.irecv, ack2, peer)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()

    def windows():
        for _ in range(50):
            if rank == 0:
                works = [dist.isend(m, 1, tag=1) for _ in range(WINDOW)]
                for w in works:
                    w.wait()
                dist.recv(ack, 1, tag=2)
            elif rank == 1:
                works = [dist.irecv(m, 0, tag=1) for _ in range(WINDOW)]
                for w in works:
                    w.wait()
                dist.send(ack, 0, tag=2)

    out = {}
    for name, fn, per in (("pingpong one way", pingpong, 400),
                          ("irecv().wait() one way", iwait, 400),
                          ("batch_isend_irecv one way", batched, 400),
                          ("exchange per batch", exchange, 200),
                          ("window per message", windows, 50 * WINDOW)):
        fn()                                # warm-up
        best = float("inf")
        for _ in range(ROUNDS):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            best = min(best, (time.perf_counter() - t0) / per * 1e6)
        out[name] = best
    if rank == 0:
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
        print(f"{backend}: " + ", ".join(f"{k} {v:.1f} µs" for k, v in out.items()) +
              f" (load {load})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
