"""ray.util.collective on backend "ACCORD": Ray's own CPU collective scenarios, and accord's errors.

Ray's tests are not in its wheel (ray/util/collective/tests lives only in
Ray's repository, and the test machines reach no git host), so the scenarios
of its gloo CPU tests (single_node_cpu_tests/ and distributed_cpu_tests/:
test_basic_apis, test_allreduce, test_reduce, test_broadcast, test_allgather,
test_reducescatter, test_sendrecv) are rewritten here, case for case, with the
same assertions; the worker actor has the methods of Ray's
(tests/ray_workers.py). Each scenario runs on backend "ACCORD" and on Ray's own
"GLOO" (torch's gloo), the same assertions on both: what passes on GLOO must
pass on ACCORD. The default run takes ACCORD with a few parameters of each
scenario (three array sizes, two group names); `-m ray_full` runs GLOO and the
rest of Ray's parameters (`-m "ray_full or not ray_full"`: everything).

One local Ray instance serves the module. ACCORD groups run on one pool of
actors, a fresh group per test (Ray starts a cluster per test; this does the
same job in seconds instead of minutes), each test's groups destroyed at its
end. GLOO gets fresh actors per test, as in Ray's tests: Ray's gloo backend
makes the first group of a process torch's default process group, which fixes
the world size and rank order of every later group of that process.

Beyond Ray's tests, on ACCORD only: groups with their own rank orders, accord's
errors raised in the actors' methods (PeerLost when an actor dies, Desync,
CommTimeout from timeout_ms), and a member that dies or never comes while the
group is being made.
"""
import itertools

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="the Ray tests need ray (pip install accord[ray])")
torch = pytest.importorskip("torch")
col = pytest.importorskip("ray.util.collective")
from ray.util.collective.types import ReduceOp  # noqa: E402

import accord  # noqa: E402
import accord.ray  # noqa: E402,F401

# one xdist worker runs every Ray test file (each starts a local Ray cluster)
pytestmark = [pytest.mark.timeout(120), pytest.mark.xdist_group("ray")]

_names = itertools.count()


def full(default, every):
    """The parameters of a scenario: a few by default, all of Ray's under -m ray_full."""
    return [pytest.param(p, marks=pytest.mark.ray_full) if p not in default else p
            for p in every]


NAMES = full(["default", "123?34!"], ["default", "test", "123?34!"])
SIZES = full([2, 2 ** 10, 2 ** 20], [2, 2 ** 5, 2 ** 10, 2 ** 15, 2 ** 20])
SHAPED = full([2, [5, 5, 5]], [2, 2 ** 5, 2 ** 10, 2 ** 15, 2 ** 20, [2, 2], [5, 5, 5]])
DTYPES = [np.uint8, np.float16, np.float32, np.float64]


@pytest.fixture(autouse=True)
def _full_only_when_asked(request):
    if request.node.get_closest_marker("ray_full") and \
            "ray_full" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("one of the rest of Ray's parameters: run them with -m ray_full")


@pytest.fixture(scope="module")
def cluster():
    # the setup hook registers "ACCORD" in every worker process: the actor class, which Ray
    # ships by value, need not import accord.ray itself
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"ACCORD_TIMEOUT": "60"},
                          "worker_process_setup_hook": "accord.ray.register"})
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def pool(cluster):
    from ray_workers import Worker
    actors = [Worker.remote() for _ in range(4)]
    ray.get([a.pid.remote() for a in actors])
    return actors


class Groups:
    """The test's groups: unique names, over the pool's first n actors (ACCORD) or over
    fresh actors (GLOO); the ACCORD groups are destroyed at the end, the fresh actors
    killed."""

    def __init__(self, pool, backend):
        self.backend, self.made = backend, []
        self.fresh = backend != "ACCORD"
        self.pool = [] if self.fresh else pool

    def actors(self, n):
        if self.fresh and len(self.pool) < n:
            from ray_workers import Worker
            self.pool += [Worker.remote() for _ in range(n - len(self.pool))]
        return self.pool[:n]

    def make(self, n=2, name=None, ranks=None):
        name = name or f"g{next(_names)}"
        actors = self.actors(n)
        ranks = ranks or list(range(n))
        assert all(ray.get([a.init_group.remote(n, r, self.backend, name)
                            for a, r in zip(actors, ranks)]))
        self.made.append((actors, name))
        return actors, name

    def declare(self, n, ranks):
        """A group declared from the driver (create_collective_group): made on first use."""
        name = f"declared{next(_names)}"
        actors = self.actors(n)
        col.create_collective_group(actors, n, ranks, backend=self.backend, group_name=name)
        self.made.append((actors, name))
        return actors, name

    def close(self):
        made, self.made = self.made, []
        if self.fresh:
            for _, name in made:            # the declarations' named actors
                try:
                    ray.kill(ray.get_actor("info_" + name))
                except ValueError:
                    pass
            for a in self.pool:
                ray.kill(a)
            return
        for actors, name in made:
            ray.get([a.destroy_group.remote(name) for a in actors])
        # every test starts from Ray's worker defaults: ones(10) and two ones(10)
        ray.get([a.set_buffer.remote(np.ones(10, np.float32)) for a in self.pool])
        ray.get([a.set_list_buffer.remote([np.ones(10, np.float32)] * 2, copy=True)
                 for a in self.pool])


@pytest.fixture(params=["ACCORD", pytest.param("GLOO", marks=pytest.mark.ray_full)])
def backend(request):
    return request.param


@pytest.fixture
def groups(pool, backend):
    """Groups of the test's backend: Ray's scenarios run on ACCORD and on GLOO."""
    g = Groups(pool, backend)
    yield g
    g.close()


@pytest.fixture
def accord_groups(pool):
    """Groups on ACCORD only: what goes beyond Ray's tests."""
    g = Groups(pool, "ACCORD")
    yield g
    g.close()


def fill(actors, size, dtype=np.float32, base=1, kind="numpy"):
    """Rank i's buffer: (i + base) everywhere; its list: world_size ones-arrays (Ray's
    init_tensors_for_gather_scatter)."""
    n = len(actors)
    for i, a in enumerate(actors):
        if kind == "numpy":
            t = np.ones(size, dtype=dtype) * (i + base)
            lst = [np.ones(size, dtype=dtype) for _ in range(n)]
        else:
            t = torch.ones(size, dtype=torch.float32) * (i + base)
            lst = [torch.ones(size, dtype=torch.float32) for _ in range(n)]
        ray.get([a.set_buffer.remote(t), a.set_list_buffer.remote(lst, copy=True)])


# -- test_basic_apis -----------------------------------------------------------------

@pytest.mark.parametrize("group_name", NAMES)
def test_init_two_actors(groups, group_name):
    actors, name = groups.make(2, group_name)
    assert ray.get([a.report_backend.remote(name) for a in actors]) == [groups.backend] * 2


def test_init_multiple_groups_and_ranks(groups):
    # ten groups on one pair of actors, and a second group with the ranks reversed
    for _ in range(10):
        groups.make(2)
    actors, first = groups.make(2)
    assert ray.get([a.report_rank.remote(first) for a in actors]) == [0, 1]
    _, second = groups.make(2, ranks=[1, 0])
    assert ray.get([a.report_rank.remote(second) for a in actors]) == [1, 0]
    assert ray.get([a.report_world_size.remote(second) for a in actors]) == [2, 2]


def test_group_with_ranks_reversed_is_a_group_of_its_own(accord_groups):
    # rank 0 of the reversed group is actors[1] (under GLOO it would still be actors[0]:
    # every group of a process there has the ranks of its first)
    actors, _ = accord_groups.make(2)
    _, second = accord_groups.make(2, ranks=[1, 0])
    ray.get([a.set_buffer.remote(np.full(4, 10 * i + 1, np.float32))
             for i, a in enumerate(actors)])
    out = ray.get([a.do_broadcast.remote(second, 0) for a in actors])
    assert [o.tolist() for o in out] == [[11.0] * 4] * 2


def test_is_group_initialized_and_destroy(groups):
    actors, name = groups.make(2)
    assert ray.get(actors[0].report_is_group_initialized.remote(name))
    assert not ray.get(actors[0].report_is_group_initialized.remote("random"))
    ray.get(actors[0].destroy_group.remote(name))
    assert not ray.get(actors[0].report_is_group_initialized.remote(name))
    ray.get(actors[0].destroy_group.remote("random"))          # no such group: no error
    assert ray.get(actors[1].report_is_group_initialized.remote(name))
    ray.get(actors[1].destroy_group.remote(name))
    assert not ray.get(actors[1].report_is_group_initialized.remote(name))
    groups.made = []
    # the same name again: a new group, which works
    groups.make(2, name)
    out = ray.get([a.do_allreduce.remote(name) for a in actors])
    assert all((o == 2).all() for o in out)


# -- test_allreduce ------------------------------------------------------------------

@pytest.mark.parametrize("group_name", NAMES)
def test_allreduce_different_name(groups, group_name):
    actors, name = groups.make(2, group_name)
    for r in ray.get([a.do_allreduce.remote(name) for a in actors]):
        assert (r == np.ones(10, np.float32) * 2).all()


@pytest.mark.parametrize("array_size", SIZES)
def test_allreduce_different_array_size(groups, array_size):
    actors, name = groups.make(2)
    ray.get([a.set_buffer.remote(np.ones(array_size, np.float32)) for a in actors])
    for r in ray.get([a.do_allreduce.remote(name) for a in actors]):
        assert r.shape == (array_size,) and (r == 2).all()


def test_allreduce_destroy(groups):
    actors, name = groups.make(2)
    assert all((r == 2).all() for r in ray.get([a.do_allreduce.remote(name) for a in actors]))
    ray.get([a.destroy_group.remote(name) for a in actors])
    groups.made = []
    with pytest.raises(RuntimeError, match="not initialized"):
        ray.get([a.do_allreduce.remote(name) for a in actors])
    groups.make(2, name)
    assert all((r == 4).all() for r in ray.get([a.do_allreduce.remote(name) for a in actors]))


def test_allreduce_multiple_group(groups):
    names = [groups.make(2)[1] for _ in range(5)]
    actors = groups.actors(2)
    for i, name in enumerate(names):
        r = ray.get([a.do_allreduce.remote(name) for a in actors])
        assert (r[0] == 2 ** (i + 1)).all() and (r[1] == 2 ** (i + 1)).all()


@pytest.mark.parametrize("op, expected", [(ReduceOp.PRODUCT, 6), (ReduceOp.MIN, 2),
                                          (ReduceOp.MAX, 3), (ReduceOp.SUM, 5)])
def test_allreduce_different_op(groups, op, expected):
    actors, name = groups.make(2)
    fill(actors, 10, base=2)
    for r in ray.get([a.do_allreduce.remote(name, op) for a in actors]):
        assert (r == expected).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_allreduce_different_dtype(groups, dtype):
    actors, name = groups.make(2)
    ray.get([a.set_buffer.remote(np.ones(10, dtype=dtype)) for a in actors])
    for r in ray.get([a.do_allreduce.remote(name) for a in actors]):
        assert r.dtype == dtype and (r == 2).all()


def test_allreduce_torch_numpy(groups):
    actors, name = groups.make(2)
    ray.get(actors[1].set_buffer.remote(torch.ones(10)))
    r = ray.get([a.do_allreduce.remote(name) for a in actors])
    assert isinstance(r[0], np.ndarray) and isinstance(r[1], torch.Tensor)
    assert (r[0] == 2).all() and (r[1] == 2).all()


def test_allreduce_world_of_four_declared_by_the_driver(groups):
    # create_collective_group from the driver: the actors make the group on first use
    actors, name = groups.declare(4, [3, 2, 1, 0])
    fill(actors, 1000, base=1)
    r = ray.get([a.do_allreduce.remote(name, ReduceOp.PRODUCT) for a in actors])
    assert all((x == 24).all() for x in r)
    assert ray.get([a.report_rank.remote(name) for a in actors]) == [3, 2, 1, 0]


# -- test_reduce ---------------------------------------------------------------------

@pytest.mark.parametrize("group_name", NAMES)
@pytest.mark.parametrize("dst_rank", [0, 1])
def test_reduce_different_name(groups, group_name, dst_rank):
    actors, name = groups.make(2, group_name)
    r = ray.get([a.do_reduce.remote(name, dst_rank) for a in actors])
    for i in range(2):
        assert (r[i] == (2 if i == dst_rank else 1)).all()


@pytest.mark.parametrize("array_size", SIZES)
@pytest.mark.parametrize("dst_rank", [0, 1])
def test_reduce_different_array_size(groups, array_size, dst_rank):
    actors, name = groups.make(2)
    ray.get([a.set_buffer.remote(np.ones(array_size, np.float32)) for a in actors])
    r = ray.get([a.do_reduce.remote(name, dst_rank) for a in actors])
    for i in range(2):
        assert (r[i] == (2 if i == dst_rank else 1)).all()


@pytest.mark.parametrize("dst_rank", [0, 1])
def test_reduce_multiple_group(groups, dst_rank):
    names = [groups.make(2)[1] for _ in range(5)]
    actors = groups.actors(2)
    for i, name in enumerate(names):
        r = ray.get([a.do_reduce.remote(name, dst_rank) for a in actors])
        for j in range(2):
            assert (r[j] == ((i + 2) if j == dst_rank else 1)).all()


@pytest.mark.parametrize("dst_rank", [0, 1])
@pytest.mark.parametrize("op, expected", [(ReduceOp.PRODUCT, 6), (ReduceOp.MIN, 2),
                                          (ReduceOp.MAX, 3)])
def test_reduce_different_op(groups, dst_rank, op, expected):
    actors, name = groups.make(2)
    fill(actors, 10, base=2)
    r = ray.get([a.do_reduce.remote(name, dst_rank, op) for a in actors])
    for i in range(2):
        assert (r[i] == (expected if i == dst_rank else i + 2)).all()


@pytest.mark.parametrize("dst_rank", [0, 1])
def test_reduce_torch_numpy(groups, dst_rank):
    actors, name = groups.make(2)
    ray.get(actors[1].set_buffer.remote(torch.ones(10)))
    r = ray.get([a.do_reduce.remote(name, dst_rank) for a in actors])
    assert (r[dst_rank] == 2).all() and (r[1 - dst_rank] == 1).all()


def test_reduce_invalid_rank(groups):
    actors, name = groups.make(2)
    with pytest.raises(ValueError, match="rank '3' must be less than world size '2'"):
        ray.get([a.do_reduce.remote(name, 3) for a in actors])


# -- test_broadcast ------------------------------------------------------------------

@pytest.mark.parametrize("group_name", NAMES)
@pytest.mark.parametrize("src_rank", [0, 1])
def test_broadcast_different_name(groups, group_name, src_rank):
    actors, name = groups.make(2, group_name)
    fill(actors, 10, base=2)
    for r in ray.get([a.do_broadcast.remote(name, src_rank) for a in actors]):
        assert (r == src_rank + 2).all()


@pytest.mark.parametrize("array_size", SIZES)
@pytest.mark.parametrize("src_rank", [0, 1])
def test_broadcast_different_array_size(groups, array_size, src_rank):
    actors, name = groups.make(2)
    fill(actors, array_size, base=2)
    for r in ray.get([a.do_broadcast.remote(name, src_rank) for a in actors]):
        assert r.shape == (array_size,) and (r == src_rank + 2).all()


@pytest.mark.parametrize("src_rank", [0, 1])
def test_broadcast_torch_numpy(groups, src_rank):
    actors, name = groups.make(2)
    ray.get(actors[1].set_buffer.remote(torch.ones(10) * 2))
    r = ray.get([a.do_broadcast.remote(name, src_rank) for a in actors])
    assert (r[0] == src_rank + 1).all() and (r[1] == src_rank + 1).all()


def test_broadcast_invalid_rank(groups):
    actors, name = groups.make(2)
    with pytest.raises(ValueError, match="rank '3' must be less than world size '2'"):
        ray.get([a.do_broadcast.remote(name, 3) for a in actors])


# -- test_allgather ------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("array_size", SHAPED)
def test_allgather_different_array_size(groups, array_size, kind):
    actors, name = groups.make(2)
    fill(actors, array_size, kind=kind)
    for lst in ray.get([a.do_allgather.remote(name) for a in actors]):
        for j, t in enumerate(lst):
            assert type(t).__module__.split(".")[0] == kind
            assert list(t.shape) == list(np.ones(array_size).shape) and (t == j + 1).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_allgather_different_dtype(groups, dtype):
    actors, name = groups.make(2)
    fill(actors, 10, dtype=dtype)
    for lst in ray.get([a.do_allgather.remote(name) for a in actors]):
        assert [t.dtype for t in lst] == [dtype] * 2
        assert all((t == j + 1).all() for j, t in enumerate(lst))


@pytest.mark.parametrize("length", [0, 1, 3])
def test_unmatched_tensor_list_length(groups, length):
    actors, name = groups.make(2)
    ray.get([a.set_list_buffer.remote([np.ones(10, np.float32)] * length, copy=True)
             for a in actors])
    with pytest.raises(RuntimeError):
        ray.get([a.do_allgather.remote(name) for a in actors])


@pytest.mark.parametrize("shape", [20, [4, 5], [1, 3, 5, 7]])
def test_unmatched_tensor_shape(groups, shape):
    actors, name = groups.make(2)
    fill(actors, 10)
    ray.get([a.set_list_buffer.remote([np.ones(shape, np.float32)] * 2, copy=True)
             for a in actors])
    # Ray's test wants a RuntimeError (gloo's, from torch), on each member
    for ref in [a.do_allgather.remote(name) for a in actors]:
        with pytest.raises(RuntimeError) as caught:
            ray.get(ref)
        if groups.backend == "ACCORD":
            # accord's is a ValueError naming the argument, raised before any byte moves:
            # ArgumentError is both
            assert isinstance(caught.value, ValueError) and "tensor_list" in str(caught.value)
    # nothing moved: the same group goes on
    ray.get([a.set_list_buffer.remote([np.ones(10, np.float32)] * 2, copy=True) for a in actors])
    lists = ray.get([a.do_allgather.remote(name) for a in actors])
    assert all((lst[j] == j + 1).all() for lst in lists for j in range(2))


def test_allgather_torch_numpy(groups):
    actors, name = groups.make(2)
    shape = [10, 10]
    mixes = [("torch", ["numpy", "numpy"]), ("numpy", ["torch", "torch"]),
             ("numpy", ["torch", "numpy"])]
    for mine, outs in mixes:
        for i, a in enumerate(actors):
            t = (torch.ones(shape) if mine == "torch" else np.ones(shape, np.float32)) * (i + 1)
            lst = [torch.ones(shape) if k == "torch" else np.ones(shape, np.float32)
                   for k in outs]
            ray.get([a.set_buffer.remote(t), a.set_list_buffer.remote(lst, copy=True)])
        for lst in ray.get([a.do_allgather.remote(name) for a in actors]):
            assert [type(t).__module__.split(".")[0] for t in lst] == outs
            assert all((t == j + 1).all() for j, t in enumerate(lst))


# -- test_reducescatter --------------------------------------------------------------

@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("array_size", SHAPED)
def test_reducescatter_different_array_size(groups, array_size, kind):
    actors, name = groups.make(2)
    fill(actors, array_size, kind=kind)
    for r in ray.get([a.do_reducescatter.remote(name) for a in actors]):
        assert type(r).__module__.split(".")[0] == kind and (r == 2).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_reducescatter_different_dtype(groups, dtype):
    actors, name = groups.make(2)
    fill(actors, 10, dtype=dtype)
    for r in ray.get([a.do_reducescatter.remote(name) for a in actors]):
        assert r.dtype == dtype and (r == 2).all()


def test_reducescatter_torch_numpy(groups):
    actors, name = groups.make(2)
    shape = [10, 10]
    mixes = [(["torch", "torch"], ["numpy", "numpy"]), (["numpy", "numpy"], ["torch", "torch"]),
             (["torch", "numpy"], ["torch", "numpy"]), (["torch", "numpy"], ["numpy", "torch"])]
    for mine, ins in mixes:
        for i, a in enumerate(actors):
            t = (torch.ones(shape) if mine[i] == "torch" else np.ones(shape, np.float32)) * (i + 1)
            lst = [torch.ones(shape) if k == "torch" else np.ones(shape, np.float32) for k in ins]
            ray.get([a.set_buffer.remote(t), a.set_list_buffer.remote(lst)])
        r = ray.get([a.do_reducescatter.remote(name) for a in actors])
        assert [type(x).__module__.split(".")[0] for x in r] == mine
        assert all((x == 2).all() for x in r)


# -- test_sendrecv -------------------------------------------------------------------

@pytest.mark.parametrize("group_name", NAMES)
@pytest.mark.parametrize("dst_rank", [0, 1])
@pytest.mark.parametrize("array_size", full([2, 2 ** 20, [5, 9, 10, 85]],
                                            [2, 2 ** 5, 2 ** 10, 2 ** 15, 2 ** 20, [2, 2],
                                             [5, 9, 10, 85]]))
def test_sendrecv(groups, group_name, array_size, dst_rank):
    actors, name = groups.make(2, group_name)
    fill(actors, array_size)
    src_rank = 1 - dst_rank
    refs = [actors[i].do_send.remote(name, dst_rank) if i != dst_rank
            else actors[i].do_recv.remote(name, src_rank) for i in range(2)]
    for r in ray.get(refs):
        assert (r == src_rank + 1).all()


@pytest.mark.parametrize("dst_rank", [0, 1])
def test_sendrecv_torch_numpy(groups, dst_rank):
    actors, name = groups.make(2)
    ray.get(actors[1].set_buffer.remote(torch.ones(10) * 2))
    src_rank = 1 - dst_rank
    refs = [actors[i].do_send.remote(name, dst_rank) if i != dst_rank
            else actors[i].do_recv.remote(name, src_rank) for i in range(2)]
    r = ray.get(refs)
    assert isinstance(r[0], np.ndarray) and isinstance(r[1], torch.Tensor)
    assert (r[0] == src_rank + 1).all() and (r[1] == src_rank + 1).all()


def test_sendrecv_invalid_rank(groups):
    actors, name = groups.make(2)
    with pytest.raises(ValueError, match="rank '3' must be less than world size '2'"):
        ray.get([a.do_send.remote(name, 3) for a in actors])


def test_sendrecv_every_pair_of_four(groups):
    # distributed_cpu_tests/test_distributed_sendrecv: every (src, dst) in a world of 4
    actors, name = groups.make(4)
    for src, dst in itertools.permutations(range(4), 2):
        fill(actors, [5, 9])
        refs = [a.get_buffer.remote() for a in actors]
        refs[src] = actors[src].do_send.remote(name, dst)
        refs[dst] = actors[dst].do_recv.remote(name, src)
        r = ray.get(refs)
        assert (r[dst] == src + 1).all() and (r[src] == src + 1).all(), (src, dst)


# -- accord's errors, raised in the actors' methods ----------------------------------

def test_mismatched_shapes_raise_desync_on_every_member(accord_groups):
    actors, name = accord_groups.make(2)
    ray.get([actors[0].set_buffer.remote(np.ones(10, np.float32)),
             actors[1].set_buffer.remote(np.ones(12, np.float32))])
    refs = [a.do_allreduce.remote(name) for a in actors]
    for ref in refs:
        with pytest.raises(accord.Desync, match="all_reduce"):
            ray.get(ref)


def test_timeout_ms_raises_comm_timeout(accord_groups):
    # only rank 0 calls: its allreduce ends at AllReduceOptions.timeout_ms
    actors, name = accord_groups.make(2)
    with pytest.raises(accord.CommTimeout, match="all_reduce"):
        ray.get(actors[0].allreduce_within.remote(name, 300))


def test_dead_actor_raises_peer_lost(pool):
    # rank 0 is a fresh actor that dies; two of the pool survive it: their pending
    # allreduce fails at once, naming the dead rank, and they leave the broken group
    from ray_workers import Worker
    victim = Worker.remote()
    survivors = pool[:2]
    name = f"death{next(_names)}"
    try:
        ray.get([a.init_group.remote(3, r, "ACCORD", name)
                 for r, a in enumerate([victim] + survivors)])
        pending = [a.do_allreduce.remote(name) for a in survivors]
        victim.die.remote()
        for ref in pending:
            with pytest.raises(accord.PeerLost, match="peer rank 0 died"):
                ray.get(ref, timeout=60)
        ray.get([a.destroy_group.remote(name) for a in survivors])
    finally:
        ray.kill(victim)


# -- a member that dies, or never comes, while the group is being made ---------------
# The others do not wait for the group's timeout (ACCORD_TIMEOUT): the ray.get deadlines
# below are far shorter than it, and than the join timeout (60 s by default).

@pytest.mark.parametrize("victim_rank", [0, 1])
def test_declared_member_dead_before_joining_raises_peer_lost(pool, victim_rank):
    # the driver declares a group of three, and one member's actor is killed before it ever
    # joins: Ray's record of the declaration names its actor, which Ray reports dead. (The
    # victim asks for a resource no node has, so that it is killed before it even starts.)
    from ray_workers import Worker
    victim = Worker.options(resources={"never_granted": 1}).remote()
    survivors = pool[:2]
    actors = list(survivors)
    actors.insert(victim_rank, victim)
    name = f"declared_dead{next(_names)}"
    col.create_collective_group(actors, 3, [0, 1, 2], backend="ACCORD", group_name=name)
    ray.kill(victim)
    try:
        refs = [a.do_allreduce.remote(name) for a in survivors]
        for ref in refs:
            with pytest.raises(accord.PeerLost, match=f"peer rank {victim_rank} died while the "
                                                      f"group was being made"):
                ray.get(ref, timeout=30)
    finally:
        ray.kill(ray.get_actor("info_" + name))


def _wait_arrived(name, rank, size):
    """Block until member `rank` of ACCORD group `name` is in (read from rank 0's store)."""
    import time
    from accord.ray import members, rendezvous
    from accord.tcpstore import TCPStore
    deadline = time.monotonic() + 30
    while (record := rendezvous.published(name)) is None:
        assert time.monotonic() < deadline, "rank 0 never published its store"
        time.sleep(0.05)
    store = TCPStore(record["host"], record["port"], size, timeout=30, token=record["token"])
    try:
        store.wait([members.arrival_key(rank)])
    finally:
        store.close()


def test_member_dead_after_arriving_raises_peer_lost(pool):
    # init_collective_group: rank 1 arrives (its actor id is then known), rank 2 is late, and
    # rank 1's actor dies while rank 0 waits for rank 2
    from ray_workers import Worker
    victim = Worker.remote()
    name = f"arrived_dead{next(_names)}"
    try:
        waiting = pool[0].init_group.remote(3, 0, "ACCORD", name)
        victim.init_group.remote(3, 1, "ACCORD", name)
        _wait_arrived(name, 1, 3)
        ray.kill(victim)
        with pytest.raises(accord.PeerLost, match="peer rank 1 died while the group was being "
                                                  "made .its actor [0-9a-f]+ died"):
            ray.get(waiting, timeout=30)
    finally:
        ray.kill(victim)


def test_member_that_never_joins_is_named_at_the_join_timeout(pool, accord_groups):
    # init_collective_group on ranks 0 and 2 of 3: rank 1 never calls it (its actor died
    # first, and nothing tells the others which actor rank 1 was), so the wait ends at the
    # join timeout (here 2 s) with the missing rank named, on both
    name = f"missing{next(_names)}"
    refs = [a.init_group_within.remote(3, r, name, 2) for a, r in zip(pool[:2], [0, 2])]
    for ref in refs:
        with pytest.raises(accord.CommTimeout, match=r"rank\(s\) 1 of 3 did not join within 2 s"):
            ray.get(ref, timeout=30)
    # nothing is left behind: a group made under the name now meets afresh
    actors, _ = accord_groups.make(2, name)
    assert all((o == 2).all() for o in ray.get([a.do_allreduce.remote(name) for a in actors]))


def test_join_timeout_is_read_from_the_environment():
    from accord.options import Options
    assert Options.from_env({}).ray_join_timeout == 60.0
    assert Options.from_env({"ACCORD_RAY_JOIN_TIMEOUT": " 2.5 "}).ray_join_timeout == 2.5
    for bad in ["soon", "0", "-1"]:
        with pytest.raises(ValueError, match="ACCORD_RAY_JOIN_TIMEOUT"):
            Options.from_env({"ACCORD_RAY_JOIN_TIMEOUT": bad})
