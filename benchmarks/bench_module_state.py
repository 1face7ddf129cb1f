"""broadcast_state(model) synced again against the same call on its state_dict, two ranks.

    .venv/bin/accord run -n 2 benchmarks/bench_module_state.py

A model of 40 modules (13 blocks of Linear, LayerNorm, Linear: 78 tensors of 64x64
and 64 floats) is synced from rank 0 as a module and as the dict of its
state_dict(keep_vars=True), the dict taken once: the difference is what taking the
module's tensors costs on each call (module_state.py: a walk comparing the module's
shape with its last sync's, where state_dict() was called before). Each is timed as
300 back-to-back calls after a barrier, five times, the best kept, twice in turn;
rank 0 prints the times in µs a call.
"""
import time, torch, torch.nn as nn, accord
accord.init_process_group()
r = accord.get_rank()
net = nn.Sequential(*[nn.Sequential(nn.Linear(64,64), nn.LayerNorm(64), nn.Linear(64,64)) for _ in range(13)])
sd = dict(net.state_dict(keep_vars=True))
with torch.no_grad():
    for _ in range(20): accord.broadcast_state(net); accord.broadcast_state(sd)
    res = {}
    for name, obj in (("module", net), ("dict", sd)) * 2:
        best = 1e9
        for _ in range(5):
            accord.barrier(); t0 = time.perf_counter()
            for _ in range(300): accord.broadcast_state(obj)
            best = min(best, (time.perf_counter() - t0) / 300 * 1e6)
        res.setdefault(name, []).append(round(best, 1))
    if r == 0: print(res, flush=True)
