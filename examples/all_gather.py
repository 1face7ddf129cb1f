"""all_gather: every rank contributes a tensor, and every rank ends up with all of them.

Used to share per-rank results, for example evaluation metrics. accord also
accepts contributions of different lengths (uneven sizes along the first
dimension), which torch does not.

    accord run -n 4 examples/all_gather.py
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

    # Even sizes: rank r contributes [10r, 10r + 1, 10r + 2].
    mine = np.arange(3, dtype=np.int64) + 10 * rank
    gathered = [np.zeros(3, dtype=np.int64) for _ in range(world)]
    in_rank_order(f"rank {rank} contributes {mine}")
    dist.all_gather(gathered, mine)
    in_rank_order(f"rank {rank} gathered {[g.tolist() for g in gathered]}")
    for r, got in enumerate(gathered):
        assert got.tolist() == [10 * r, 10 * r + 1, 10 * r + 2], \
            f"rank {rank}: slot {r} holds {got}"

    # The same into one flat tensor.
    flat = np.zeros(3 * world, dtype=np.int64)
    dist.all_gather_into_tensor(flat, mine)
    assert np.array_equal(flat, np.concatenate([np.arange(3) + 10 * r for r in range(world)]))

    # Uneven sizes: rank r contributes r + 1 values, all equal to r.
    mine = np.full(rank + 1, float(rank))
    gathered = [np.empty(r + 1) for r in range(world)]
    dist.all_gather(gathered, mine)
    for r, got in enumerate(gathered):
        assert got.tolist() == [float(r)] * (r + 1), f"rank {rank}: slot {r} holds {got}"
    in_rank_order(f"rank {rank} gathered uneven parts of sizes {[g.size for g in gathered]}")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
