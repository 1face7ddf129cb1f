"""Scatter a dataset in uneven shards, sized to each rank's speed.

A common use of scatter: the root splits the data into per-rank parts, and
when the ranks differ in speed the parts should differ in size. Here rank r
"runs" at a made-up speed; rank 0 sizes each shard in proportion, tells every
rank its shard size (a scatter of one number each), then scatters the rows
themselves: accord's scatter takes a list whose tensors differ in length along
the first dimension. Each rank processes its shard (the slow ones sleep
longer per row), and an uneven gather brings the results back to rank 0,
which checks them against doing it all itself. With shards proportional to
speed, every rank finishes at about the same time.

    accord run -n 4 examples/uneven_shards.py
"""
import time

import numpy as np

import accord as dist

ROWS, COLS = 1000, 16
PER_ROW_S = 2e-4         # simulated cost of a row at speed 1


def speeds(world):
    return [1.0 + (r % 3) for r in range(world)]        # 1x, 2x, 3x, 1x, ...


def main():
    dist.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    sp = speeds(world)

    # rank 0 owns the dataset and decides the split
    if rank == 0:
        data = np.random.default_rng(0).standard_normal((ROWS, COLS)).astype(np.float32)
        counts = np.floor(ROWS * np.array(sp) / sum(sp)).astype(np.int64)
        counts[: ROWS - counts.sum()] += 1               # hand out the remainder
        shards = np.split(data, np.cumsum(counts)[:-1])
        count_list = [np.array([c], np.int64) for c in counts]
    else:
        shards = count_list = None

    # 1. every rank learns its shard size, 2. the uneven scatter of the rows
    n = np.zeros(1, np.int64)
    dist.scatter(n, count_list, src=0)
    shard = np.empty((int(n[0]), COLS), np.float32)
    dist.scatter(shard, shards, src=0)

    # process it: a row norm per row; slower ranks take longer per row
    t0 = time.perf_counter()
    time.sleep(len(shard) * PER_ROW_S / sp[rank])
    result = np.linalg.norm(shard, axis=1).astype(np.float32)
    took = time.perf_counter() - t0

    # gather the uneven results back
    outs = [np.empty(len(s), np.float32) for s in shards] if rank == 0 else None
    dist.gather(result, outs, dst=0)
    times = [None] * world
    dist.all_gather_object(times, (len(shard), sp[rank], took))
    if rank == 0:
        for r, (rows, s, t) in enumerate(times):
            print(f"rank {r}: speed {s:.0f}x, {rows:4d} rows, {t * 1e3:6.1f} ms")
        full = np.concatenate(outs)
        assert np.allclose(full, np.linalg.norm(data, axis=1)), "results differ"
        print(f"rank 0: {len(full)} results gathered from {world} uneven shards, all correct")
        equal = max(ROWS / world * PER_ROW_S / s for s in sp)
        print(f"slowest rank took {max(t for _, _, t in times) * 1e3:.0f} ms; with equal shards "
              f"the slowest would need about {equal * 1e3:.0f} ms")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
