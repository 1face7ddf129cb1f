"""scatter: the root splits its data into one part per rank (data sharding).

Each rank receives its part in place into the tensor it passes. The parts may
differ in size (accord accepts uneven sizes, torch does not), for example to
give faster workers more data.

    accord run -n 4 examples/scatter.py
"""
import numpy as np

import accord as dist


def in_rank_order(message):
    """Print one line per rank, rank 0 first (a barrier between ranks' turns)."""
    for turn in range(dist.get_world_size()):
        if turn == dist.get_rank():
            print(message, flush=True)
        dist.barrier()


def main():
    dist.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    root = 0

    # Even shards: the root holds 0 .. 4*world-1 and each rank gets 4 of them.
    shard = np.zeros(4, dtype=np.float32)
    if rank == root:
        data = np.arange(4 * world, dtype=np.float32)
        dist.scatter(shard, scatter_list=list(data.reshape(world, 4)), src=root)
    else:
        dist.scatter(shard, src=root)  # only the root passes scatter_list
    in_rank_order(f"rank {rank} received shard {shard}")
    assert shard.tolist() == [4.0 * rank + i for i in range(4)], f"rank {rank}: got {shard}"

    # Uneven shards: 10 rows split in proportion to made-up worker speeds
    # (rank r has speed r + 1); every rank knows the split, only the root the data.
    rows = 10
    speeds = np.arange(1, world + 1)
    counts = np.floor(rows * speeds / speeds.sum()).astype(int)
    counts[-1] += rows - counts.sum()
    offsets = np.concatenate([[0], np.cumsum(counts)])
    part = np.empty((counts[rank], 3), dtype=np.int32)
    if rank == root:
        table = np.arange(rows * 3, dtype=np.int32).reshape(rows, 3)
        parts = [table[offsets[r]:offsets[r + 1]] for r in range(world)]
        dist.scatter(part, scatter_list=parts, src=root)
    else:
        dist.scatter(part, src=root)
    expected = np.arange(rows * 3, dtype=np.int32).reshape(rows, 3)[offsets[rank]:offsets[rank + 1]]
    assert np.array_equal(part, expected), f"rank {rank}: got rows {part.tolist()}"
    in_rank_order(f"rank {rank} received {counts[rank]} of {rows} rows "
                  f"(rows {offsets[rank]}..{offsets[rank + 1] - 1})")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
