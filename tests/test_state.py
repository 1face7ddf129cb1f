"""broadcast_state: pytrees, modules, buckets, async, and structure mismatches."""
import numpy as np
import pytest

from tests.harness import run_ranks, spy_algorithms

pytestmark = pytest.mark.timeout(120)


def _seq():
    import accord.world
    return accord.world.default_group()._seq


def _tree(rank, seed):
    rng = np.random.default_rng(seed if rank == 1 else 1000 + rank)
    return {
        "w": rng.standard_normal((7, 5)).astype(np.float32),
        "layers": [{"b": rng.standard_normal(11), "n": rng.integers(0, 9, 3, dtype=np.int32)}
                   for _ in range(3)],
        "pair": (rng.standard_normal(4).astype(np.float32), np.zeros(0, np.int64)),
        "strided": rng.standard_normal((6, 6))[:, ::2],
        "step": int(rng.integers(1000)),
        "name": f"rank{rank}",
        "flags": [True, rank],
    }


def _pytree(rank, world):
    import accord
    tree = _tree(rank, 7)
    ids = [id(tree["w"]), id(tree["layers"][2]["b"]), id(tree["pair"])]
    before = _seq()
    out = accord.broadcast_state(tree, src=1, bucket_bytes=256)
    used = _seq() - before
    want = _tree(1, 7)
    assert out is tree
    assert [id(tree["w"]), id(tree["layers"][2]["b"]), id(tree["pair"])] == ids
    np.testing.assert_array_equal(tree["w"], want["w"])
    for a, b in zip(tree["layers"], want["layers"]):
        np.testing.assert_array_equal(a["b"], b["b"])
        np.testing.assert_array_equal(a["n"], b["n"])
    np.testing.assert_array_equal(tree["pair"][0], want["pair"][0])
    np.testing.assert_array_equal(tree["strided"], want["strided"])
    assert tree["step"] == want["step"] and tree["name"] == "rank1"
    assert tree["flags"] == [True, 1]
    return used


def test_pytree_numpy_world3():
    used = run_ranks(3, _pytree)
    # 1 structure check + 2 object broadcast + a handful of buckets, not one per tensor
    assert all(u == used[0] for u in used)
    assert used[0] <= 12, used


def _many(rank, world, n):
    import accord
    state = {f"p{i}": np.full(10 + i % 7, rank * 1.0 + i, np.float32) for i in range(n)}
    state.update({f"i{i}": np.full(3, rank + i, np.int64) for i in range(n // 10)})
    before = _seq()
    accord.broadcast_state(state, src=0)
    used = _seq() - before
    for i in range(n):
        assert (state[f"p{i}"] == i).all()
    for i in range(n // 10):
        assert (state[f"i{i}"] == i).all()
    return used


def test_thousands_of_tensors_cost_a_few_collectives():
    used = run_ranks(2, _many, 2000)
    assert used == [3, 3]         # the check + one bucket per dtype


def _buckets(rank, world):
    import accord
    state = [np.full(1000, rank, np.float64) for _ in range(10)]   # 8000 B each
    big = np.full(5000, rank, np.float64)
    state.append(big)
    before = _seq()
    accord.broadcast_state(state, src=0, bucket_bytes=20000)
    used = _seq() - before
    assert all((a == 0).all() for a in state)
    return used


def test_bucket_size_is_configurable():
    # 10 x 8000 B in 20000 B buckets: 5 buckets (2 each); the 40000 B one goes alone
    assert run_ranks(2, _buckets) == [7, 7]


def _mlp(seed):
    import torch
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                            torch.nn.ReLU(), torch.nn.Linear(16, 3))
    m.register_buffer("bf16buf", torch.randn(5).to(torch.bfloat16))
    return m


def _module(rank, world):
    import torch
    import accord
    m = _mlp(rank)
    m(torch.randn(4, 8))                         # running stats differ per rank
    params = [p for p in m.parameters()]
    ptrs = [p.data_ptr() for p in params]
    accord.broadcast_state(m, src=0)
    assert [p.data_ptr() for p in m.parameters()] == ptrs
    assert all(p.requires_grad for p in m.parameters())
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    # a state dict (from a module) with a non-contiguous tensor, bf16 and int leaves
    t = torch.arange(24.0).reshape(4, 6).t() * (rank + 1)
    sd2 = {"t": t, "bf": torch.full((3,), float(rank), dtype=torch.bfloat16),
           "epoch": rank * 10}
    accord.broadcast_state(sd2, src=world - 1)
    assert torch.equal(sd2["t"], torch.arange(24.0).reshape(4, 6).t() * world)
    assert sd2["bf"].tolist() == [float(world - 1)] * 3
    assert sd2["epoch"] == (world - 1) * 10
    return {k: v.float().numpy() for k, v in sd.items()}


def test_torch_module_and_state_dict():
    pytest.importorskip("torch")
    res = run_ranks(3, _module)
    for k in res[0]:
        for r in res[1:]:
            np.testing.assert_array_equal(r[k], res[0][k], err_msg=k)
    assert "1.running_mean" in res[0] and "bf16buf" in res[0]


def _mismatch(rank, world, case):
    import accord
    from accord.state import StateMismatch
    state = {"a": np.zeros(4, np.float32), "b": {"c": np.zeros((2, 3)), "d": 1}}
    if case == "missing" and rank == 2:
        del state["b"]["c"]
    if case == "shape" and rank == 1:
        state["b"]["c"] = np.zeros((3, 2))
    if case == "dtype" and rank == 0:
        state["a"] = np.zeros(4, np.float64)
    if case == "readonly" and rank == 2:
        state["a"].flags.writeable = False
    try:
        accord.broadcast_state(state, src=0)
    except StateMismatch as e:
        msg = str(e)
    else:
        msg = None
    # the group is still usable
    t = np.full(1, rank, np.int64)
    accord.broadcast(t, src=0)
    assert t[0] == 0
    return msg


@pytest.mark.parametrize("case,needle", [
    ("missing", "['b']['c']: missing on rank 2"),
    ("shape", "['b']['c']: rank 1 has a float64 tensor of shape [3, 2], src rank 0 has a "
              "float64 tensor of shape [2, 3]"),
    ("dtype", "['a']: rank 1 has a float32 tensor"),
    ("readonly", "rank 2: ['a']: array is read-only"),
])
def test_mismatch_raises_on_every_rank(case, needle):
    msgs = run_ranks(3, _mismatch, case, timeout=30)
    for m in msgs:
        assert m is not None and needle in m, m


def _async(rank, world):
    import accord
    state = [np.full(100_000, rank, np.float32), np.full(50, rank, np.int16)]
    w = accord.broadcast_state(state, src=1, async_op=True, bucket_bytes=1 << 16)
    x = np.ones((200, 200)) @ np.ones((200, 200))    # compute meanwhile
    assert w.wait() is True and w.is_completed()
    assert (state[0] == 1).all() and (state[1] == 1).all()
    return float(x[0, 0])


def test_async_op():
    assert run_ranks(2, _async) == [200.0, 200.0]


def test_first_difference_messages():
    from accord.state import first_difference, flatten
    _, a = flatten({"x": [np.zeros(2), 3], "y": np.zeros(1)})
    _, b = flatten({"x": [np.zeros(2)], "y": np.zeros(1)})
    assert first_difference(b, a, 3, 0) == ("['x']: rank 3 has a list of length 1, src rank 0 "
                                            "has a list of length 2")
    _, c = flatten({"x": [np.zeros(2), 3], "z": np.zeros(1)})
    assert first_difference(c, a, 1, 0).startswith("['y']: missing on rank 1")


# -- world 2 over shared memory: buckets through the ring, both cores copying --

def _bucket_state(rank, salt):
    rng = np.random.default_rng(salt)
    sizes = [int(s) for s in rng.integers(1, 300_000, 60)] + [131_072] * 20 + [7, 0, 1]
    want = {f"t{i}": rng.standard_normal(s).astype(np.float32) for i, s in enumerate(sizes)}
    base = rng.standard_normal((300, 200))
    want["strided"] = base[:, ::3]                                      # non-contiguous
    want["f64"] = [rng.standard_normal(s) for s in (5, 70_000, 600_000)]
    want["i16"] = np.arange(33, dtype=np.int16)
    if rank == salt % 2:
        mine = {k: (v.copy() if isinstance(v, np.ndarray) else [a.copy() for a in v])
                for k, v in want.items()}
        mine["strided"] = base.copy()[:, ::3]       # every rank's layout is the same
        return want, mine
    got = {k: (np.zeros_like(v) if isinstance(v, np.ndarray) else [np.zeros_like(a) for a in v])
           for k, v in want.items()}
    got["strided"] = np.zeros((300, 200))[:, ::3]
    return want, got


def _vectored(rank, world):
    import time
    import accord
    with spy_algorithms("broadcast_list") as names:
        for salt in (4, 5):                     # root 0, then root 1
            want, state = _bucket_state(rank, salt)
            ptr = state["t3"].ctypes.data
            accord.broadcast_state(state, src=salt % 2)
            assert state["t3"].ctypes.data == ptr
            for k, v in want.items():
                for a, b in zip(v if isinstance(v, list) else [v],
                                state[k] if isinstance(v, list) else [state[k]]):
                    assert a.tobytes() == b.tobytes(), k
        # a small bucket
        small = [np.full(1000, rank, np.float32) for _ in range(10)]
        accord.broadcast_state(small, src=1)
        assert all((a == 1).all() for a in small)
        # both ranks think they are the root: each meets the other's stamp, no hang
        x = [np.zeros(1 << 20, np.float32) for _ in range(8)]
        t0 = time.monotonic()
        with pytest.raises(accord.Desync):
            accord.broadcast_state(x, src=rank, timeout=10)
        assert time.monotonic() - t0 < 5
    # every bucket went through the ring or the split copy, none down the plain chain
    return [name != "chain" for name in names]


@pytest.mark.parametrize("env", [{"ACCORD_TRANSPORT": "shm"},
                                 {"ACCORD_TRANSPORT": "shm", "ACCORD_SHM_CMA": "0"},
                                 {"ACCORD_TRANSPORT": "shm", "ACCORD_SHM_ARENA": "64K"}],
                         ids=["default", "no-cma", "small-arena"])
def test_two_rank_buckets_go_through_the_ring(env):
    out = run_ranks(2, _vectored, env=env, timeout=60)
    for ran in out:
        # per root: two float32 buckets, one float64, one int16; then the small state,
        # and the two-roots call (the desync raises inside it)
        assert ran == [True] * 10, ran


def test_ring_sends_skip_single_copy_even_when_large():
    assert run_ranks(2, _ring_only, env={"ACCORD_TRANSPORT": "shm"}, timeout=60) == [0, 0]


def _ring_only(rank, world):
    import accord
    from accord.transport import shm
    t = accord.world.default_group().transport
    sent = []
    real = shm.ShmTransport._send

    def spy(self, peer, header, buf, ring=False):
        s = real(self, peer, header, buf, ring)
        sent.append(s.seq)                  # seq: the single-copy number, 0 for the ring
        return s
    shm.ShmTransport._send = spy
    try:
        state = [np.full(3 << 20, rank, np.uint8), np.full(5 << 20, rank + 1, np.uint8)]
        accord.broadcast_state(state, src=1)
        assert (state[0] == 1).all() and (state[1] == 2).all()
    finally:
        shm.ShmTransport._send = real
    assert type(t).__name__ == "ShmTransport"
    return max(sent, default=0)


# -- memory layout: only paths, shapes and dtypes decide the buckets and pieces --

# (name, library, shape, dtype, how the strided variant is made)
_LAYOUTS = [
    ("np_t", "numpy", (700, 300), "float32", "t"),            # 820 KiB: moved in place
    ("np_cols", "numpy", (1100, 1000), "float64", "cols"),    # 8.4 MiB: several pieces
    ("np_f", "numpy", (64, 48), "int32", "F"),                 # small: packed
    ("np_rev", "numpy", (90_000,), "float32", "rev"),          # negative stride
    ("np_step", "numpy", (40,), "int16", "step"),
    ("t_t", "torch", (1200, 900), "float32", "t"),             # 4.1 MiB
    ("t_cols", "torch", (300, 200), "float64", "cols"),
    ("t_empty_t", "torch", (500, 96), "float32", "empty_t"),   # torch.empty(...).t()
    ("t_bf16", "torch", (256, 160), "bfloat16", "t"),
    ("t_small", "torch", (3, 5), "int64", "t"),
]


def _make(lib, shape, dtype, how, strided):
    """An empty tensor of `shape`: C-contiguous, or strided the way `how` says."""
    if lib == "numpy":
        dt = np.dtype(dtype)
        if not strided:
            return np.empty(shape, dt)
        if how in ("t", "F"):
            a = np.empty(shape[::-1], dt).T if how == "t" else np.empty(shape, dt, order="F")
        elif how == "cols":
            a = np.empty((shape[0], shape[1] * 2), dt)[:, ::2]
        elif how == "rev":
            a = np.empty(shape, dt)[::-1]
        else:
            a = np.empty(shape[0] * 3, dt)[::3]
        assert not a.flags.c_contiguous
        return a
    import torch
    dt = getattr(torch, dtype)
    if not strided:
        return torch.empty(shape, dtype=dt)
    if how in ("t", "empty_t"):
        t = torch.empty(shape[::-1], dtype=dt).t()
    else:
        t = torch.empty((shape[0], shape[1] * 2), dtype=dt)[:, ::2]
    assert not t.is_contiguous()
    return t


def _bits(x):
    """x's values as C-order bytes (bfloat16 as its int16 bits)."""
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x).tobytes()
    import torch
    if x.dtype == torch.bfloat16:
        x = x.view(torch.int16)
    return x.contiguous().numpy().tobytes()


def _fill(x, seed):
    rng = np.random.default_rng(seed)
    if isinstance(x, np.ndarray):
        x[...] = (rng.standard_normal(x.shape) * 100).astype(x.dtype)
    else:
        import torch
        vals = torch.from_numpy(rng.standard_normal(tuple(x.shape)) * 100)
        x.copy_(vals.to(x.dtype))


def _layout_state(rank, world, src, strided_on, specs):
    state = {}
    for i, (name, lib, shape, dtype, how) in enumerate(specs):
        x = _make(lib, shape, dtype, how, strided_on(rank, i))
        _fill(x, (rank * 7919 + i) if rank != src else i)
        state[name] = x
    return state


def _addr(x):
    return x.ctypes.data if isinstance(x, np.ndarray) else x.data_ptr()


def _layouts(rank, world, src, who, specs, bucket_bytes):
    import accord
    strided_on = {
        "src": lambda r, i: r == src,                 # source strided, receivers contiguous
        "receivers": lambda r, i: r != src,           # the reverse
        "mixed": lambda r, i: (r + i) % 2 == 0,       # each tensor differs between ranks
    }[who]
    state = _layout_state(rank, world, src, strided_on, specs)
    want = {k: _bits(v) for k, v in _layout_state(src, world, src, strided_on, specs).items()}
    where = {k: (_addr(v), tuple(v.strides) if isinstance(v, np.ndarray) else v.stride())
             for k, v in state.items()}
    ring = world == 2 and type(accord.world.default_group().transport).__name__ == "ShmTransport"
    with spy_algorithms("broadcast_list") as names:
        accord.broadcast_state(state, src=src, bucket_bytes=bucket_bytes)
    if ring:    # strided tensors do not knock a bucket off the ring
        assert names and "chain" not in names, names
    for k, v in state.items():
        assert (_addr(v), tuple(v.strides) if isinstance(v, np.ndarray) else v.stride()) \
            == where[k], f"{k} was not written in place"
        assert _bits(v) == want[k], f"{k} differs from src's"
    # the group still works afterwards
    t = np.full(3, rank, np.int64)
    accord.broadcast(t, src=src)
    assert (t == src).all()
    return True


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("who", ["src", "receivers", "mixed"])
def test_contiguous_and_strided_ranks_agree(transport, world, who):
    pytest.importorskip("torch")
    src = world - 1
    assert run_ranks(world, _layouts, src, who, _LAYOUTS, None, timeout=90,
                     env={"ACCORD_TRANSPORT": transport}) == [True] * world


def _many_layouts():
    """Many tensors of three dtypes, large and small, across several buckets."""
    specs = []
    for i in range(40):
        big = i % 5 == 0
        lib = "torch" if i % 2 else "numpy"
        dtype = ("float32", "float64", "int32")[i % 3]
        shape = (300 + i, 120) if big else (9 + i % 4, 6 + i % 3)
        how = ("t", "cols")[i % 2] if lib == "torch" else ("t", "cols", "F")[i % 3]
        specs.append((f"p{i:02d}", lib, shape, dtype, how))
    return specs


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("world", [2, 3])
def test_strided_tensors_across_many_buckets(transport, world):
    pytest.importorskip("torch")
    # 256 KiB buckets: the large tensors fill several buckets of each dtype
    assert run_ranks(world, _layouts, 0, "mixed", _many_layouts(), 256 << 10, timeout=90,
                     env={"ACCORD_TRANSPORT": transport}) == [True] * world


# -- beyond two ranks over shared memory with single copy: the copy split between the
# root and each receiver (two ranks stream through the ring, both cores copying) --

def _split_spy(rank, world, src):
    import accord
    with spy_algorithms("broadcast_list") as names:
        want, state = _bucket_state(rank, src + 6)
        accord.broadcast_state(state, src=src)
        for k, v in want.items():
            for a, b in zip(v if isinstance(v, list) else [v],
                            state[k] if isinstance(v, list) else [state[k]]):
                assert a.tobytes() == b.tobytes(), k
    return names


@pytest.mark.parametrize("world,src", [(2, 0), (2, 1), (3, 1), (4, 0)])
def test_large_buckets_split_their_copy_between_root_and_receivers(world, src):
    for ran in run_ranks(world, _split_spy, src, env={"ACCORD_TRANSPORT": "shm"}, timeout=90):
        if world == 2:
            # two ranks: every bucket through the ring (faster than the split copy here)
            assert ran == ["ring"] * 4, ran
        else:
            # the two float32 buckets and the float64 one are over 4 MiB; the int16 one
            # is not (it goes down the tree or the chain)
            assert ran.count("single_copy") == 3 and len(ran) == 4, ran


def _split_layouts_differ(rank, world):
    import accord
    from accord.algorithms import single_copy
    g = accord.world.default_group()
    # the same total, cut differently: each rank would copy into the other's memory
    first = (4 << 20) if rank == 0 else (4 << 20) - 8
    fill = 1 if rank == 0 else 0
    bufs = [np.full(first, fill, np.uint8), np.full((4 << 20) + 8 - first, fill, np.uint8)]
    with pytest.raises(accord.Desync) as info:
        accord.plans.run(g, "broadcast", lambda c: single_copy.broadcast_list(c, bufs, 0),
                         False, 10, (0, 0, 0, (4 << 20) + 8, "uint8"))
    assert (bufs[0] == fill).all() and (bufs[1] == fill).all()
    return str(info.value)


@pytest.mark.parametrize("world", [2, 3])
def test_split_copy_with_different_buffer_lengths_is_a_desync_before_any_copy(world):
    for msg in run_ranks(world, _split_layouts_differ, env={"ACCORD_TRANSPORT": "shm"},
                         timeout=60):
        assert "ranks disagree on the buffers of this broadcast" in msg, msg
        assert "buffer 0 holds" in msg, msg
