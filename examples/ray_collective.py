"""ray.util.collective on accord: four Ray actors, one "ACCORD" group.

    python examples/ray_collective.py            # starts a local Ray; needs `pip install accord[ray]`

Each actor imports accord.ray (which registers the backend "ACCORD" in its
process) and joins the group with init_collective_group; then Ray's own
functions run on accord: allreduce, broadcast, allgather, reducescatter,
send/recv. A second group on the same actors runs beside the first. The
driver prints what rank 0 saw and checks every actor's result.
"""
import numpy as np
import ray
import ray.util.collective as col
from ray.util.collective.types import ReduceOp

WORLD = 4


@ray.remote(num_cpus=0)
class Trainer:
    def __init__(self, rank):
        import accord.ray  # noqa: F401  registers "ACCORD" in this actor's process
        self.rank = rank

    def setup(self):
        col.init_collective_group(WORLD, self.rank, backend="ACCORD", group_name="main")
        # a second group, ranks reversed: independent of the first
        col.init_collective_group(WORLD, WORLD - 1 - self.rank, backend="ACCORD",
                                  group_name="reversed")
        return True

    def step(self):
        r = self.rank
        grad = np.full(8, r + 1.0, np.float32)
        col.allreduce(grad, "main")                           # sum: 1+2+3+4 = 10
        biggest = np.array([r * 10.0])
        col.allreduce(biggest, "main", ReduceOp.MAX)          # 30
        weights = np.arange(4.0) if r == 0 else np.zeros(4)
        col.broadcast(weights, src_rank=0, group_name="main")
        parts = [np.zeros(2, np.int64) for _ in range(WORLD)]
        col.allgather(parts, np.array([r, r * r]), "main")
        shard = np.zeros(3, np.float32)
        col.reducescatter(shard, [np.full(3, r + 1.0, np.float32)] * WORLD, "main")
        token = np.array([r], np.int64)
        if r % 2 == 0:
            col.send(token, r + 1, "main")
        else:
            col.recv(token, r - 1, "main")
        other = np.array([float(r)])
        col.allreduce(other, "reversed", ReduceOp.PRODUCT)     # 0 * 1 * 2 * 3
        return {"grad": grad.tolist(), "max": biggest.item(), "weights": weights.tolist(),
                "gathered": [p.tolist() for p in parts], "shard": shard.tolist(),
                "token": token.item(), "reversed_rank": col.get_rank("reversed"),
                "product": other.item()}

    def teardown(self):
        col.destroy_collective_group("main")
        col.destroy_collective_group("reversed")
        return True


def main():
    ray.init(num_cpus=WORLD, include_dashboard=False, log_to_driver=False)
    actors = [Trainer.remote(r) for r in range(WORLD)]
    ray.get([a.setup.remote() for a in actors])
    results = ray.get([a.step.remote() for a in actors])
    ray.get([a.teardown.remote() for a in actors])
    print("rank 0 saw:", results[0])
    for r, res in enumerate(results):
        assert res["grad"] == [10.0] * 8 and res["max"] == 30.0
        assert res["weights"] == [0.0, 1.0, 2.0, 3.0]
        assert res["gathered"] == [[i, i * i] for i in range(WORLD)]
        assert res["shard"] == [10.0] * 3
        assert res["token"] == r - r % 2 and res["reversed_rank"] == WORLD - 1 - r
        assert res["product"] == 0.0
    print(f"ok: {WORLD} actors, backend ACCORD")
    ray.shutdown()


if __name__ == "__main__":
    main()
