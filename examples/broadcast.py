"""Broadcast: one rank's tensor reaches every rank of the group.

Rank 0 holds ones, every other rank zeros; after `dist.broadcast(t, src=0)`
every rank holds ones, written in place into the tensor it passed (nothing new
is allocated). This is how initial model parameters are shared before
training, or re-synchronised after an update.

    accord run -n 4 examples/broadcast.py
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

    # The classic example: every rank must already hold a tensor of the
    # right shape; only the source's values matter.
    t = np.ones(1) if rank == 0 else np.zeros(1)
    in_rank_order(f"rank {rank}/{world} before broadcast: {t}")
    dist.broadcast(t, src=0)
    in_rank_order(f"rank {rank}/{world} after broadcast:  {t}")
    assert t.tolist() == [1.0], f"rank {rank}: expected [1.0], got {t}"

    # The same for "model parameters": a larger float32 array from the last rank.
    src = world - 1
    params = np.empty(100_000, dtype=np.float32)
    if rank == src:
        params[:] = np.arange(params.size, dtype=np.float32) * 0.5
    dist.broadcast(params, src=src)
    expected = np.arange(params.size, dtype=np.float32) * 0.5
    assert np.array_equal(params, expected), f"rank {rank}: parameters differ from rank {src}'s"
    in_rank_order(f"rank {rank}: {params.size} parameters from rank {src}, "
                  f"checksum {params.sum(dtype=np.float64):.1f}")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
