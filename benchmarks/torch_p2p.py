"""Point to point through torch.distributed on a backend: a blocking send/recv
ping-pong and a window of isends/irecvs, as torch's own callers make them.

    accord run -n 2 benchmarks/torch_p2p.py accord      # or gloo

torch waits on the backend's Work from its C++ side, which moves no message
itself, so this is where a backend's progress thread shows: accord's used to
sleep through small messages here (up to 250 ms each). Rank 0 prints the best of
5 rounds: the ping-pong's one-way latency (200 round trips a round) and the
window's time per message (50 windows of 64 isends of 8 bytes, matched by
irecvs, then a 4-byte ack), with the load average.
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
    m, ack = torch.ones(2), torch.zeros(1)

    def pingpong():
        for _ in range(200):
            if rank == 0:
                dist.send(m, 1)
                dist.recv(m, 1)
            elif rank == 1:
                dist.recv(m, 0)
                dist.send(m, 0)

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
    for name, fn, per in (("pingpong one way", pingpong, 400), ("window per message", windows,
                                                                50 * WINDOW)):
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
