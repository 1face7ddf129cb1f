"""Data-parallel training that survives a lost rank and takes in its replacement.

    accord run -n 4 --max-restarts 1 examples/elastic_training.py

A linear model is trained with data-parallel all_reduce of its gradient. At
step 20 rank 2 kills itself (SIGKILL: no goodbye, as a preempted machine).
The others get PeerLost, call accord.shrink() and go on at world 3, re-syncing
their state from the new rank 0; the launcher restarts the dead process
(ACCORD_RESTART_COUNT=1), whose init_process_group() waits until the ranks
call accord.admit() at a step boundary; it joins as rank 3 and is healed from
rank 0 with broadcast_state. Every rank prints the same final loss.

Under `accord run -n 4 --keep-going` (no restart) the job finishes at world 3.
"""
import os
import signal
import sys
import tempfile
import time

import numpy as np

import accord

STEPS = int(os.environ.get("ELASTIC_STEPS", "80"))
KILL_RANK, KILL_STEP = 2, 20
ADMIT_EVERY = 5
DIM, BATCH, LR = 16, 256, 0.1


def global_batch(step):
    """The step's whole batch, the same on every rank (each rank takes its share)."""
    rng = np.random.default_rng(step)
    x = rng.standard_normal((BATCH, DIM))
    y = x @ np.linspace(-1.0, 1.0, DIM) + 0.01 * rng.standard_normal(BATCH)
    return x, y


def local_gradient(w, step, rank, size):
    x, y = global_batch(step)
    x, y = x[rank::size], y[rank::size]
    err = x @ w - y
    # [gradient sum..., squared error sum, samples]: one all_reduce carries all three
    return np.concatenate([2.0 * x.T @ err, [float(err @ err), float(len(y))]])


def death_file():
    return os.path.join(tempfile.gettempdir(),
                        f"accord-elastic-{os.environ.get('MASTER_PORT', 'x')}.death")


def main():
    accord.init_process_group()      # a restarted process waits here until admitted
    restarted = int(os.environ.get("ACCORD_RESTART_COUNT", "0")) > 0
    expect_restart = int(os.environ.get("ACCORD_MAX_RESTARTS", "0")) > 0
    start_size = int(os.environ.get("WORLD_SIZE", accord.get_world_size()))
    state = {"w": np.zeros(DIM), "step": np.zeros(1, np.int64), "loss": np.zeros(1)}
    if restarted:
        accord.broadcast_state(state, src=0)      # healed from rank 0
        print(f"newcomer admitted as rank {accord.get_rank()} of {accord.get_world_size()} "
              f"at step {int(state['step'][0])}, healed from rank 0", flush=True)
    recovering_since = None
    while int(state["step"][0]) < STEPS:
        step = int(state["step"][0])
        rank, size = accord.get_rank(), accord.get_world_size()
        if not restarted and step == KILL_STEP and rank == KILL_RANK and size == start_size:
            with open(death_file(), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            g = local_gradient(state["w"], step, rank, size)
            accord.all_reduce(g)
        except (accord.PeerLost, accord.GroupClosed) as e:
            if recovering_since is None:
                recovering_since = time.time()
            said = str(e).splitlines()[0]
            said = said if len(said) <= 90 else said[:87] + "..."
            print(f"step {step}: {type(e).__name__}: {said}", flush=True)
            accord.shrink()
            # some survivors may have finished the failed step: take the new rank 0's state
            accord.broadcast_state(state, src=0)
            continue
        if recovering_since is not None:
            try:
                with open(death_file()) as f:
                    died = float(f.read())
                took = (f"{time.time() - died:.2f} s after the death (PeerLost came "
                        f"{recovering_since - died:.2f} s after it)")
            except (OSError, ValueError):
                took = f"{time.time() - recovering_since:.2f} s after PeerLost"
            print(f"recovered: world {size} (rank {rank}), first all_reduce of the new group "
                  f"done {took}", flush=True)
            recovering_since = None
        n = g[-1]
        state["w"] -= LR * g[:DIM] / n
        state["loss"][0] = g[DIM] / n
        state["step"][0] = step + 1
        time.sleep(0.03)             # the rest of a real step's work
        step += 1
        if step % ADMIT_EVERY == 0 and step < STEPS:
            # at the last admit before the end, wait for a replacement that is on its way
            wait = 30 if (expect_restart and size < start_size and step >= STEPS - 10) else 0
            before = accord.get_world_size()
            accord.admit(timeout=wait)
            if accord.get_world_size() != before:
                print(f"step {step}: admitted {accord.get_world_size() - before} newcomer(s): "
                      f"world {accord.get_world_size()}", flush=True)
                accord.broadcast_state(state, src=0)
    print(f"rank {accord.get_rank()} of {accord.get_world_size()}: final loss "
          f"{state['loss'][0]:.15f} after {STEPS} steps", flush=True)
    accord.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
