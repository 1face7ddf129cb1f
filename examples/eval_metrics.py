"""Evaluation metrics with all_gather: every rank scores its shard, every rank sees the total.

Each rank evaluates a (fixed, made-up) classifier on its own shard of a test
set. Fixed-size metrics (per-class correct and total counts) travel as one
tensor through `all_gather_into_tensor`; variable-size results (the ids of
misclassified samples, a list whose length differs per rank) go through
`all_gather` with uneven sizes, after an all_gather of their lengths; and a
free-form summary dict through `all_gather_object`. Every rank then prints
the same global accuracy.

    accord run -n 4 examples/eval_metrics.py
"""
import numpy as np

import accord as dist

CLASSES, SAMPLES, FEATURES = 5, 2000, 10


def main():
    dist.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()

    rng = np.random.default_rng(0)                         # the same test set everywhere
    w = rng.standard_normal((FEATURES, CLASSES))
    x = rng.standard_normal((SAMPLES, FEATURES))
    labels = np.argmax(x @ w + 0.8 * rng.standard_normal((SAMPLES, CLASSES)), axis=1)
    ids = np.arange(SAMPLES)[rank::world]                   # this rank's shard
    pred = np.argmax(x[ids] @ w, axis=1)
    ok = pred == labels[ids]

    # fixed-size metrics: [correct per class, total per class] from every rank
    mine = np.concatenate([np.bincount(labels[ids][ok], minlength=CLASSES),
                           np.bincount(labels[ids], minlength=CLASSES)]).astype(np.int64)
    table = np.zeros(world * mine.size, np.int64)
    dist.all_gather_into_tensor(table, mine)
    table = table.reshape(world, 2, CLASSES).sum(0)
    correct, total = table

    # variable-size results: the misclassified ids, a different count on each rank
    wrong = ids[~ok].astype(np.int64)
    lengths = np.zeros(world, np.int64)
    dist.all_gather_into_tensor(lengths, np.array([wrong.size], np.int64))
    all_wrong = [np.empty(int(n), np.int64) for n in lengths]
    dist.all_gather(all_wrong, wrong)

    # anything picklable: a per-rank summary
    summaries = [None] * world
    dist.all_gather_object(summaries, {"rank": rank, "samples": int(ids.size),
                                       "accuracy": round(float(ok.mean()), 4)})

    acc = correct.sum() / total.sum()
    assert total.sum() == SAMPLES and sum(len(a) for a in all_wrong) == SAMPLES - correct.sum()
    for turn in range(world):
        if turn == rank:
            print(f"rank {rank}: global accuracy {acc:.4f} over {total.sum()} samples; "
                  f"per class {np.round(correct / total, 3).tolist()}; "
                  f"{sum(len(a) for a in all_wrong)} misclassified", flush=True)
        dist.barrier()
    if rank == 0:
        for s in summaries:
            print(f"  shard of rank {s['rank']}: {s['samples']} samples, accuracy "
                  f"{s['accuracy']}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
