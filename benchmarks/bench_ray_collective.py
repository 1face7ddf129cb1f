"""accord vs gloo through ray.util.collective, with actors on every node of a Ray cluster.

    python benchmarks/bench_ray_collective.py --address HOST:PORT [--per-node 2]
        [--node-ip IP] [--sizes 1K,64K,1M,16M] [--backends ACCORD,GLOO] [--check]

Places --per-node actors on each alive node (ranks node by node), makes one
group per backend and times allreduce and broadcast of float32 arrays: each
actor runs a barrier, then `--iters` calls, and a row is the slowest actor's
time per call. --check instead verifies an allreduce and a broadcast on
ACCORD and reports, as JSON, how the group runs (hierarchical or not, which
ranks lead their node) — tests/test_ray_two_nodes.py reads it.
benchmarks/ray_two_nodes.py runs this on a two-namespace cluster.
"""
import argparse
import json
import time

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text):
    text = text.strip().upper().rstrip("B")
    return int(text[:-1]) * UNITS[text[-1]] if text[-1] in UNITS else int(text)


@ray.remote(num_cpus=0)
class Member:
    def __init__(self):
        import accord.ray  # noqa: F401  (registers "ACCORD" in this actor's process)

    def join(self, world, rank, backend, name):
        import ray.util.collective as col
        col.init_collective_group(world, rank, backend, name)
        return rank

    def check(self, name, rank, world):
        """An allreduce (phased: 64 Ki floats) and a broadcast from the last rank (1 MiB)."""
        import ray.util.collective as col
        x = np.full(1 << 16, rank + 1, np.float32)
        col.allreduce(x, name)
        b = np.full(1 << 18, rank, np.float32)
        col.broadcast(b, world - 1, name)
        g = col.get_group_handle(name).accord_group
        leaders = g.hier.leaders if g.hier is not None else None
        return {"rank": rank, "node": ray.get_runtime_context().get_node_id(),
                "allreduce_ok": bool((x == world * (world + 1) / 2).all()),
                "broadcast_ok": bool((b == world - 1).all()),
                "transport": type(g.transport).__name__, "hierarchical": g.hier is not None,
                "leader": leaders is not None,
                "leaders": leaders.size if leaders is not None else None}

    def time(self, name, op, nbytes, iters):
        import ray.util.collective as col
        x = np.ones(nbytes // 4, np.float32)
        call = (lambda: col.allreduce(x, name)) if op == "allreduce" else \
            (lambda: col.broadcast(x, 0, name))
        call()                                   # warm-up (connections, buffers)
        col.barrier(name)
        t = time.perf_counter()
        for _ in range(iters):
            call()
        return (time.perf_counter() - t) / iters

    def leave(self, name):
        import ray.util.collective as col
        col.destroy_collective_group(name)


def place(per_node):
    nodes = sorted((n for n in ray.nodes() if n["Alive"]), key=lambda n: n["NodeManagerAddress"])
    actors = []
    for n in nodes:
        for _ in range(per_node):
            actors.append(Member.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
                n["NodeID"], soft=False)).remote())
    return actors, len(nodes)


def group(actors, backend, name):
    ray.get([a.join.remote(len(actors), r, backend, name) for r, a in enumerate(actors)])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--address", required=True)
    ap.add_argument("--node-ip", default=None,
                    help="this driver's node IP (Ray guesses it from the host name otherwise)")
    ap.add_argument("--per-node", type=int, default=2)
    ap.add_argument("--sizes", default="1K,64K,1M,16M")
    ap.add_argument("--backends", default="ACCORD,GLOO")
    ap.add_argument("--ops", default="allreduce,broadcast")
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    ray.init(address=args.address, _node_ip_address=args.node_ip, log_to_driver=False,
             runtime_env={"env_vars": {"ACCORD_TIMEOUT": "60"}})
    actors, nodes = place(args.per_node)
    world = len(actors)
    if args.check:
        group(actors, "ACCORD", "check")
        print(json.dumps(ray.get([a.check.remote("check", r, world)
                                  for r, a in enumerate(actors)])))
        ray.get([a.leave.remote("check") for a in actors])
        return
    results = {}
    for backend in args.backends.split(","):
        name = f"bench-{backend.lower()}"
        group(actors, backend, name)
        for op in args.ops.split(","):
            for size in args.sizes.split(","):
                nbytes = parse_size(size)
                iters = max(3, min(200, (64 << 20) // max(nbytes, 1) // 4))
                t = max(ray.get([a.time.remote(name, op, nbytes, iters) for a in actors]))
                results[(op, size, backend)] = t
        ray.get([a.leave.remote(name) for a in actors])
    backends = args.backends.split(",")
    print(f"{world} actors on {nodes} nodes ({args.per_node} per node), float32, "
          f"time per call (slowest actor)\n")
    head = "| op | size | " + " | ".join(f"{b} us" for b in backends)
    if len(backends) == 2:
        head += f" | {backends[0]}/{backends[1]}"
    print(head + " |")
    print("|---|---|" + "---:|" * (len(backends) + (len(backends) == 2)))
    for op in args.ops.split(","):
        for size in args.sizes.split(","):
            ts = [results[(op, size, b)] for b in backends]
            row = f"| {op} | {size} | " + " | ".join(f"{t * 1e6:.1f}" for t in ts)
            if len(ts) == 2:
                row += f" | {ts[0] / ts[1]:.2f}x"
            print(row + " |")


if __name__ == "__main__":
    main()
