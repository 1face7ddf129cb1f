"""Synchronising a model: initial sync from rank 0, periodic re-sync every k steps.

Every rank builds its own randomly initialised two-layer MLP (numpy), so the
ranks start different. `broadcast_state` makes them equal rank 0's in one
call (a few collectives, whatever the number of tensors). Then each rank
trains on its own shard of a regression problem with plain SGD (local SGD):
the replicas drift apart, and every K steps they are re-synchronised by
averaging the parameters, many small tensors coalesced into one all_reduce
per dtype. A last `broadcast_state` of the whole training state (parameters,
momentum, the step counter and the learning rate, non-tensor leaves included)
leaves every rank with identical parameters, which the example checks.

    accord run -n 4 examples/mlp_sync.py
"""
import hashlib

import numpy as np

import accord as dist

K = 5           # re-sync every K steps
STEPS = 40
LR = 0.05


def init_params(rng, sizes=(8, 32, 32, 1)):
    params = {}
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        params[f"fc{i}.weight"] = rng.standard_normal((n_in, n_out)) / np.sqrt(n_in)
        params[f"fc{i}.bias"] = np.zeros(n_out)
    return params


def forward_backward(params, x, y):
    """Mean squared error of a ReLU MLP and its gradients."""
    n = len(params) // 2
    acts = [x]
    for i in range(n):
        z = acts[-1] @ params[f"fc{i}.weight"] + params[f"fc{i}.bias"]
        acts.append(np.maximum(z, 0) if i < n - 1 else z)
    err = acts[-1] - y
    loss = float(np.mean(err ** 2))
    grads, d = {}, 2 * err / len(x)
    for i in reversed(range(n)):
        grads[f"fc{i}.weight"] = acts[i].T @ d
        grads[f"fc{i}.bias"] = d.sum(0)
        if i:
            d = (d @ params[f"fc{i}.weight"].T) * (acts[i] > 0)
    return loss, grads


def fingerprint(params):
    h = hashlib.sha256()
    for k in sorted(params):
        h.update(params[k].tobytes())
    return h.hexdigest()[:16]


def main():
    dist.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()

    # every rank starts from its own random init ...
    params = init_params(np.random.default_rng(100 + rank))
    before = fingerprint(params)
    # ... and one call makes them rank 0's, in place
    dist.broadcast_state(params, src=0)
    prints = [None] * world
    dist.all_gather_object(prints, (before, fingerprint(params)))
    if rank == 0:
        print(f"initial sync: {len(params)} tensors; fingerprints before "
              f"{[p[0] for p in prints]}, after {prints[0][1]} on every rank")
    assert len({p[1] for p in prints}) == 1

    # a regression problem; each rank trains on its own shard
    data_rng = np.random.default_rng(7)
    w_true = data_rng.standard_normal((8, 1))
    x = data_rng.standard_normal((256 * world, 8))
    y = np.sin(x @ w_true)
    xs, ys = x[rank::world], y[rank::world]
    momentum = {k: np.zeros_like(v) for k, v in params.items()}
    state = {"params": params, "momentum": momentum, "step": 0, "lr": LR}

    for step in range(1, STEPS + 1):
        batch = np.random.default_rng(step * 31 + rank).integers(0, len(xs), 32)
        loss, grads = forward_backward(params, xs[batch], ys[batch])
        for k in params:
            momentum[k] = 0.9 * momentum[k] + grads[k]
            params[k] -= state["lr"] * momentum[k]
        state["step"] = step
        if step % K == 0:
            # re-sync: average the replicas; the small tensors travel as one all_reduce
            with dist.coalescing():
                for p in params.values():
                    dist.all_reduce(p, op=dist.ReduceOp.AVG)
            full, _ = forward_backward(params, x, y)
            if rank == 0:
                print(f"step {step:3d}: local loss {loss:.4f}, after re-sync full-data loss "
                      f"{full:.4f}")

    # a final sync of the whole training state from rank 0 (tensors and plain values)
    dist.broadcast_state(state, src=0)
    dist.all_gather_object(prints, fingerprint(params))
    assert len(set(prints)) == 1, f"rank {rank}: parameters differ: {prints}"
    assert state["step"] == STEPS
    if rank == 0:
        print(f"done: {world} ranks hold identical parameters (fingerprint {prints[0]})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
