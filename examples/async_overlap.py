"""Async broadcast overlapped with compute.

Rank 0 publishes new "weights" every step (say, a parameter server or a
teacher model); the others need them for the next step, not this one. With
`async_op=True` the broadcast runs on the group's worker thread while the
caller keeps computing (numpy releases the GIL in its kernels; the transport
sleeps in the kernel while it waits), and `work.wait()` is called only when
the data is needed. The example times the same steps both ways and checks
that every rank received every version.

    accord run -n 4 examples/async_overlap.py
"""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")       # one core per rank for the compute

import time  # noqa: E402

import numpy as np  # noqa: E402

import accord as dist  # noqa: E402

STEPS = 6
WEIGHTS = 4 << 20            # 4 Mi float32 = 16 MiB per broadcast


def compute(a, b, reps):
    for _ in range(reps):
        a = np.tanh(a @ b)
    return a


def run(rank, overlap, a, b, reps):
    weights = np.zeros(WEIGHTS, np.float32)
    seen = []
    t0 = time.perf_counter()
    for step in range(STEPS):
        if rank == 0:
            weights[:] = step + 1                       # the next version
        if overlap:
            work = dist.broadcast(weights, src=0, async_op=True)
            compute(a, b, reps)                         # runs while the bytes move
            work.wait()
        else:
            dist.broadcast(weights, src=0)
            compute(a, b, reps)
        seen.append(float(weights[-1]))
    took = time.perf_counter() - t0
    assert seen == [float(s + 1) for s in range(STEPS)], f"rank {rank}: got versions {seen}"
    return took


def main():
    dist.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    rng = np.random.default_rng(rank)
    a, b = rng.standard_normal((256, 256)), rng.standard_normal((256, 256)) / 16
    # size the compute to about the time of one broadcast
    w = np.zeros(WEIGHTS, np.float32)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(3):
        dist.broadcast(w, src=0)
    comm = (time.perf_counter() - t0) / 3
    t0 = time.perf_counter()
    compute(a, b, 10)
    reps = max(1, int(10 * comm / (time.perf_counter() - t0)))

    results = {}
    for overlap in (False, True, False, True):
        dist.barrier()
        took = np.array([run(rank, overlap, a, b, reps)])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        results.setdefault(overlap, []).append(float(took[0]))
    if rank == 0:
        seq, ovl = min(results[False]), min(results[True])
        print(f"{world} ranks, {STEPS} steps of a 16 MiB broadcast + about {comm * 1e3:.0f} ms "
              f"of compute each:")
        print(f"  sequential (broadcast, then compute): {seq * 1e3:7.1f} ms")
        print(f"  overlapped (async broadcast, compute, wait): {ovl * 1e3:7.1f} ms "
              f"({seq / ovl:.2f}x)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
