"""Differential tests: the same torch.distributed program under "gloo" and "accord".

Every rank runs `program` twice, once per backend, in the same process, and
every output tensor is compared. Inputs are small integers (floats included),
so sums and products are exact whatever the summation order and outputs are
compared bit for bit; one test uses random floats and a tolerance.
"""
import datetime

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import accord  # noqa: E402
from torch_ranks import run_torch  # noqa: E402

pytestmark = pytest.mark.timeout(150)

R = dist.ReduceOp
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int8, torch.uint8, torch.int32, torch.int64]


def _val(rank, n, dtype, shift=0):
    t = (torch.arange(n) * 3 + rank * 5 + shift) % 7
    if dtype == torch.bool:
        return (t % 2).bool()
    return t.to(dtype)


def _ops(dtype):
    if dtype == torch.bool:
        return ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]
    ops = ["SUM", "MIN", "MAX", "PRODUCT"]
    if dtype.is_floating_point:
        return ops + ["AVG"]
    return ops + ["BAND", "BOR", "BXOR"]


def program(rank, world, backend):
    out = {}
    last = world - 1

    # every reduce op on every dtype gloo supports, all_reduce and reduce
    for dt in FLOATS + INTS + [torch.bool]:
        for op in _ops(dt):
            t = _val(rank, 5, dt) if op != "PRODUCT" else (_val(rank, 5, dt) % 2 + 1).to(dt)
            dist.all_reduce(t, op=getattr(R, op))
            out[f"all_reduce/{dt}/{op}"] = t
            if op in ("SUM", "MAX"):
                t = _val(rank, 6, dt)
                dist.reduce(t, dst=last, op=getattr(R, op))
                out[f"reduce/{dt}/{op}"] = t if rank == last else None

    for dt in [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8,
               torch.complex64]:
        for root in range(world):
            t = _val(rank, 4, dt)
            dist.broadcast(t, src=root)
            out[f"broadcast/{dt}/{root}"] = t
        outs = [torch.empty(3, dtype=dt) for _ in range(world)]
        dist.all_gather(outs, _val(rank, 3, dt))
        out[f"all_gather/{dt}"] = outs
        big = torch.empty(world * 2, 3, dtype=dt)
        dist.all_gather_into_tensor(big, _val(rank, 6, dt).view(2, 3))
        out[f"all_gather_into_tensor/{dt}"] = big
        if dt == torch.complex64:       # gloo's rooted ops and all_to_all lack complex
            t = _val(rank, 4, torch.float32) + 1j * _val(rank, 4, torch.float32, 2)
            dist.all_reduce(t)
            out["all_reduce/complex64"] = t
            continue
        gl = [torch.empty(2, dtype=dt) for _ in range(world)] if rank == last else None
        dist.gather(_val(rank, 2, dt), gl, dst=last)
        out[f"gather/{dt}"] = gl
        y = torch.empty(3, dtype=dt)
        dist.scatter(y, [_val(i, 3, dt, 1) for i in range(world)] if rank == 0 else None, src=0)
        out[f"scatter/{dt}"] = y
        outs = [torch.empty(2, dtype=dt) for _ in range(world)]
        dist.all_to_all(outs, [_val(rank, 2, dt, i) for i in range(world)])
        out[f"all_to_all/{dt}"] = outs
        y = torch.empty(4, dtype=dt)
        dist.reduce_scatter(y, [_val(rank, 4, dt, i) for i in range(world)])
        out[f"reduce_scatter/{dt}"] = y
        y = torch.empty(2, dtype=dt)
        dist.reduce_scatter_tensor(y, _val(rank, 2 * world, dt), op=R.MAX)
        out[f"reduce_scatter_tensor/{dt}"] = y

    # all_to_all_single: even, and uneven splits (rank r sends i+r+1 rows to rank i)
    y = torch.empty(world * 2, 2)
    dist.all_to_all_single(y, _val(rank, world * 4, torch.float32).view(world * 2, 2))
    out["all_to_all_single/even"] = y
    in_splits = [i + rank + 1 for i in range(world)]
    out_splits = [rank + j + 1 for j in range(world)]
    x = _val(rank, sum(in_splits) * 3, torch.int64).view(-1, 3)
    y = torch.full((sum(out_splits), 3), -1, dtype=torch.int64)
    dist.all_to_all_single(y, x, out_splits, in_splits)
    out["all_to_all_single/uneven"] = y

    # non-contiguous tensors (gloo mishandles them: under gloo the same op runs on a
    # contiguous copy, and accord's in-place result must equal it) and requires_grad
    nc = backend != "gloo"

    def view(t):
        return t if nc else t.contiguous()
    base = _val(rank, 24, torch.float32).view(4, 6)
    col = view(base[:, 1::2])
    dist.all_reduce(col)
    out["noncontig/all_reduce"] = [col, base[:, ::2]]
    tt = view(torch.zeros(3, 4).t())
    if rank == 0:
        tt.copy_(_val(0, 12, torch.float32).view(4, 3))
    dist.broadcast(tt, src=0)
    out["noncontig/broadcast"] = tt
    outs = [view(torch.zeros(2, 4)[:, ::2]) for _ in range(world)]
    dist.all_gather(outs, view(_val(rank, 8, torch.float32).view(4, 2)[::2]))
    out["noncontig/all_gather"] = outs
    assert not nc or not outs[0].is_contiguous()
    w = torch.ones(3, requires_grad=True)
    dist.all_reduce(w)
    out["requires_grad/all_reduce"] = w.detach().clone()

    # coalesced variants
    ts = [_val(rank, 3, torch.float32), _val(rank, 5, torch.float32, 1)]
    dist.all_reduce_coalesced(ts)
    out["all_reduce_coalesced"] = ts
    ol = [[torch.empty(2), torch.empty(3)] for _ in range(world)]
    dist.all_gather_coalesced(ol, [_val(rank, 2, torch.float32), _val(rank, 3, torch.float32)])
    out["all_gather_coalesced"] = ol
    with dist._coalescing_manager(async_ops=True) as cm:
        a = _val(rank, 4, torch.float32)
        b = _val(rank, 4, torch.float32, 3)
        dist.all_reduce(a)
        dist.all_reduce(b)
    cm.wait()
    out["coalescing_manager"] = [a, b]

    # async: several in flight, then wait; futures; is_completed
    ts = [_val(rank, 7, torch.float32, i) for i in range(3)]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    bt = _val(rank, 5, torch.int32)
    works.append(dist.broadcast(bt, src=last, async_op=True))
    for wk in works:
        wk.wait()
    out["async/all_reduce"] = ts
    out["async/broadcast"] = bt
    out["async/completed"] = [wk.is_completed() for wk in works]
    fut = dist.all_reduce(_val(rank, 3, torch.float32), async_op=True).get_future()
    out["async/future"] = fut.then(lambda f: f.value()[0] * 2).wait()
    big = torch.empty(world * 4)
    wk = dist.all_gather_into_tensor(big, _val(rank, 4, torch.float32), async_op=True)
    out["async/all_gather_into_tensor"] = [t.clone() for t in wk.get_future().wait()]

    # functional collectives: torch's C++ layer calls the group (the path DTensor takes)
    import torch.distributed._functional_collectives as funcol
    W = dist.group.WORLD
    ag = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    rs = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
    res = {"all_reduce": funcol.all_reduce(_val(rank, 4, torch.float32), "sum", W),
           "all_gather": ag(_val(rank, 3, torch.float32), 0, W),
           "reduce_scatter": rs(_val(rank, 2 * world, torch.float32), "sum", 0, W),
           "all_to_all": funcol.all_to_all_single(_val(rank, world, torch.float32), None,
                                                  None, W),
           "broadcast": funcol.broadcast(_val(rank, 3, torch.int64), last, W)}
    out["funcol"] = {k: funcol.wait_tensor(v).clone() if hasattr(funcol, "wait_tensor")
                     else torch.as_tensor(v).clone() for k, v in res.items()}

    # point to point: ring with send/recv, isend/irecv, batch_isend_irecv
    if world > 1:
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        r = torch.empty(4)
        if rank % 2 == 0:
            dist.send(_val(rank, 4, torch.float32), nxt)
            src = dist.recv(r, prv)
        else:
            src = dist.recv(r, prv)
            dist.send(_val(rank, 4, torch.float32), nxt)
        out["p2p/send_recv"] = [r, src]
        r = torch.empty(3, dtype=torch.int64)
        reqs = [dist.isend(_val(rank, 3, torch.int64), nxt, tag=7), dist.irecv(r, prv, tag=7)]
        for q in reqs:
            q.wait()
        out["p2p/isend_irecv"] = r
        r = torch.empty(1000)
        ops = [dist.P2POp(dist.isend, _val(rank, 1000, torch.float32), nxt),
               dist.P2POp(dist.irecv, r, prv)]
        for q in dist.batch_isend_irecv(ops):
            q.wait()
        out["p2p/batch_isend_irecv"] = r

    # object collectives
    objs = [{"rank": rank}, [rank] * 3] if rank == 0 else [None, None]
    dist.broadcast_object_list(objs, src=0)
    out["objects/broadcast"] = objs
    gathered = [None] * world
    dist.all_gather_object(gathered, ("r", rank, "x" * rank))
    out["objects/all_gather"] = gathered
    gl = [None] * world if rank == 0 else None
    dist.gather_object({"from": rank}, gl, dst=0)
    out["objects/gather"] = gl
    got = [None]
    dist.scatter_object_list(got, [f"item{i}" for i in range(world)] if rank == 0 else None,
                             src=0)
    out["objects/scatter"] = got

    # subgroups: every other rank, and consecutive pairs; src/dst are global ranks
    evens = list(range(0, world, 2))
    g = dist.new_group(evens)
    if rank in evens:
        t = _val(rank, 4, torch.float32)
        dist.all_reduce(t, group=g)
        out["subgroup/all_reduce"] = t
        t = _val(rank, 4, torch.int64)
        dist.broadcast(t, src=evens[-1], group=g)
        out["subgroup/broadcast"] = t
        outs = [torch.empty(2) for _ in evens]
        dist.all_gather(outs, _val(rank, 2, torch.float32), group=g)
        out["subgroup/all_gather"] = outs
        out["subgroup/rank"] = [dist.get_rank(g), dist.get_world_size(g)]
    else:
        out["subgroup/rank"] = [dist.get_rank(g), dist.get_world_size(g)]
    if world % 2 == 0:
        mine, _ = dist.new_subgroups(group_size=2)
        t = _val(rank, 3, torch.float32)
        dist.all_reduce(t, group=mine)
        out["new_subgroups/all_reduce"] = t
        t = torch.full((2,), float(rank))
        dist.broadcast(t, src=dist.get_global_rank(mine, 1), group=mine)
        out["new_subgroups/broadcast"] = t
    dist.barrier()
    dist.barrier(group=g) if rank in evens else None
    return out


def _compare(a, b, where, tol=None):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{where}: {type(b).__name__} instead of a tensor"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {b.dtype}{list(b.shape)}"
        if tol is None:
            assert torch.equal(a, b), f"{where}: gloo {a} != accord {b}"
        else:
            torch.testing.assert_close(b, a, rtol=tol, atol=tol, msg=where)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: lengths {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            _compare(x, y, f"{where}[{i}]", tol)
    elif isinstance(a, dict) and all(isinstance(v, torch.Tensor) for v in a.values()):
        assert a.keys() == b.keys(), f"{where}: keys"
        for k in a:
            _compare(a[k], b[k], f"{where}/{k}", tol)
    else:
        assert a == b, f"{where}: gloo {a!r} != accord {b!r}"


def compare_backends(results, tol=None):
    for rank, d in enumerate(results):
        gloo, acc = d["gloo"], d["accord"]
        assert gloo.keys() == acc.keys()
        for k in gloo:
            _compare(gloo[k], acc[k], f"rank {rank}: {k}", tol)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_same_outputs_as_gloo(world):
    compare_backends(run_torch(world, program, backends=("gloo", "accord"), timeout=60))


def random_floats(rank, world, backend):
    g = torch.Generator().manual_seed(1234 + rank)
    out = {}
    for n in (1, 1000, 50_000):
        t = torch.randn(n, generator=g)
        dist.all_reduce(t)
        out[f"all_reduce/{n}"] = t
        y = torch.empty(n)
        dist.reduce_scatter_tensor(y, torch.randn(n * world, generator=g))
        out[f"reduce_scatter_tensor/{n}"] = y
        t = torch.randn(n, generator=g, dtype=torch.float64)
        dist.all_reduce(t, op=R.AVG)
        out[f"avg/{n}"] = t
    return out


def test_random_floats_to_tolerance():
    compare_backends(run_torch(3, random_floats, backends=("gloo", "accord"), timeout=60),
                     tol=1e-5)


def accord_only(rank, world, backend):
    out = {}
    # PREMUL_SUM (gloo has none): multiply by the factor first, then sum
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
    out["premul"] = t
    t = torch.full((3,), float(rank + 1), dtype=torch.float64)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(torch.tensor([2.0])))
    out["premul_tensor"] = t
    y = torch.empty(2)
    dist.reduce_scatter_tensor(y, torch.full((2 * world,), float(rank + 1)),
                               op=dist._make_nccl_premul_sum(3.0))
    out["premul_reduce_scatter"] = y
    # dtypes gloo lacks but accord moves: int16, uint16/32/64
    for dt in (torch.int16, torch.uint16, torch.uint32, torch.uint64):
        t = torch.full((3,), rank + 1, dtype=dt)
        dist.all_reduce(t)
        out[f"sum/{dt}"] = t.to(torch.int64)   # (uint tensors do not pickle)
    # backend identity and group names
    pg = dist.group.WORLD
    out["backend"] = dist.get_backend()
    out["group_name"] = bool(pg.group_name)
    out["pg_type"] = type(pg).__name__
    w = dist.barrier(async_op=True)
    w.wait(timeout=datetime.timedelta(seconds=30))
    out["barrier_completed"] = w.is_completed()
    return out


def test_accord_only_ops():
    world = 3
    res = run_torch(world, accord_only, timeout=60)
    total = sum(range(1, world + 1))
    for d in res:
        a = d["accord"]
        assert torch.equal(a["premul"], torch.full((4,), 0.5 * total))
        assert torch.equal(a["premul_tensor"], torch.full((3,), 2.0 * total, dtype=torch.float64))
        assert torch.equal(a["premul_reduce_scatter"], torch.full((2,), 3.0 * total))
        for dt in (torch.int16, torch.uint16, torch.uint32, torch.uint64):
            assert torch.equal(a[f"sum/{dt}"], torch.full((3,), total))
        assert a["backend"] == "accord"
        assert a["group_name"] is True
        assert a["pg_type"] == "AccordProcessGroup"
        assert a["barrier_completed"] is True


def test_import_accord_without_torch_module():
    # the core never imports torch; only accord.torch does
    import subprocess
    import sys
    code = ("import sys; sys.modules['torch'] = None\n"
            "import accord, accord.api, accord.objects\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "ok", out.stderr
    assert accord.__name__ == "accord"


def _any_source(rank, world, backend):
    if rank == 0:
        senders = []
        for _ in range(world - 1):
            t = torch.zeros(3, dtype=torch.int64)
            src = dist.recv(t)                   # no src: whichever rank sends first
            senders.append((src, t.tolist()))
        return sorted(senders)
    dist.send(torch.full((3,), rank * 10, dtype=torch.int64), dst=0)
    return None


def test_recv_without_src_matches_gloo():
    res = run_torch(3, _any_source, backends=("gloo", "accord"), timeout=60)
    assert res[0]["accord"] == res[0]["gloo"] == [(1, [10, 10, 10]), (2, [20, 20, 20])]


# -- device tensors: staged through host memory -------------------------------------------
# No GPU here: a tensor subclass that says it is not on the CPU (and whose .cpu() makes a
# host copy) takes the same path a CUDA tensor takes through torch and the adapter.

class _OffHost(torch.Tensor):
    @property
    def is_cpu(self):
        return False

    def cpu(self):
        return torch.Tensor(self.as_subclass(torch.Tensor).clone())


def _plain(t):
    return t.as_subclass(torch.Tensor).tolist()


def _staged(rank, world, backend):
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x = torch.full((4,), float(rank)).as_subclass(_OffHost)
        dist.broadcast(x, src=1)
        y = torch.full((3,), float(rank + 1)).as_subclass(_OffHost)
        dist.all_reduce(y)
        outs = [torch.zeros(2).as_subclass(_OffHost) for _ in range(world)]
        dist.all_gather(outs, torch.full((2,), float(rank)).as_subclass(_OffHost))
        z = torch.full((2,), float(rank)).as_subclass(_OffHost)
        dist.all_reduce(z, async_op=True).wait()
    staging = [str(w.message) for w in caught if "copied to host memory" in str(w.message)]
    return _plain(x), _plain(y), [_plain(o) for o in outs], _plain(z), staging


def test_off_host_tensors_are_staged_through_host_memory_with_one_warning():
    for r in run_torch(2, _staged):
        x, y, outs, z, staging = r["accord"]
        assert x == [1.0] * 4 and y == [3.0] * 3 and z == [1.0, 1.0]
        assert outs == [[0.0, 0.0], [1.0, 1.0]]
        assert len(staging) == 1, staging


def nested_wait_in_callback(rank, world, backend):
    a, b = torch.full((3,), float(rank + 1)), torch.full((2,), float(rank + 10))
    fut = dist.all_reduce(a, async_op=True).get_future()
    # a callback that starts another operation on the group and waits for it (as
    # PowerSGD's DDP hook does): it must not run on the thread that would do the work
    chained = fut.then(lambda f: (f.value()[0].clone(),
                                  dist.all_reduce(b, async_op=True).get_future().wait()[0]))
    first, second = chained.wait()
    return {"first": first, "second": second}


def test_future_callback_may_wait_on_another_operation():
    res = run_torch(2, nested_wait_in_callback, backends=("gloo", "accord"), timeout=30)
    for d in res:
        for k in ("first", "second"):
            assert torch.equal(d["accord"][k], d["gloo"][k]), k
        assert torch.equal(d["accord"]["second"], torch.full((2,), 21.0))


def _sparse_inputs(rank):
    # ranks overlap on some coordinates (summed) and not on others; 2-d values
    i = torch.tensor([[0, rank + 1, 2], [1, 0, 3]])
    v = torch.tensor([1.0, 2.0 * (rank + 1), 3.0])
    hybrid = torch.sparse_coo_tensor(torch.tensor([[rank % 2, 2]]),
                                     torch.full((2, 3), float(rank + 1)), (3, 3),
                                     check_invariants=True)
    return torch.sparse_coo_tensor(i, v, (5, 4), check_invariants=True), hybrid


def sparse_all_reduce(rank, world, backend):
    t, hybrid = _sparse_inputs(rank)
    dist.all_reduce(t)
    w = dist.all_reduce(hybrid, async_op=True)
    w.wait()
    empty = torch.sparse_coo_tensor(torch.zeros((1, 0), dtype=torch.int64), torch.zeros(0),
                                    (4,), check_invariants=True)
    dist.all_reduce(empty)
    return {"t": t, "hybrid": hybrid, "empty": empty}


@pytest.mark.parametrize("world", [2, 3])
def test_sparse_coo_all_reduce_like_gloo(world):
    res = run_torch(world, sparse_all_reduce, backends=("gloo", "accord"), timeout=60)
    want = sum(_sparse_inputs(r)[0].to_dense() for r in range(world))
    for d in res:
        for k in ("t", "hybrid", "empty"):
            g, a = d["gloo"][k], d["accord"][k]
            assert a.layout == torch.sparse_coo and a.is_coalesced()
            assert torch.equal(a.to_dense(), g.to_dense()), k
            assert torch.equal(a.indices(), g.coalesce().indices()), k
        assert torch.equal(d["accord"]["t"].to_dense(), want)


def accord_sparse(rank, world):
    t = torch.sparse_coo_tensor(torch.tensor([[rank, 3]]), torch.tensor([1.0, 2.0]), (4,))
    accord.all_reduce(t)
    try:
        accord.all_reduce(torch.sparse_coo_tensor(torch.tensor([[0]]), torch.ones(1), (2,)),
                          op=accord.ReduceOp.MAX)
        bad = None
    except ValueError as e:
        bad = str(e)
    return t.to_dense(), bad


def test_sparse_all_reduce_in_accords_own_api():
    from harness import run_ranks
    for dense, bad in run_ranks(2, accord_sparse, timeout=30):
        assert torch.equal(dense, torch.tensor([1.0, 1.0, 0.0, 4.0]))
        assert "SUM only" in bad
