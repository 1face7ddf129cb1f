"""broadcast_state called again on the same dict: what it learnt the first time (its
fast path, accord/flat_state.py) must never outlive a change to the dict or its tensors."""
import gc
import weakref

import numpy as np
import pytest

from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(120)


def _state(rank, n=12, dtype=np.float32):
    # sizes from 3 elements to 40000 (160 KiB): packed ones and ones sent in place
    return {f"p{i}": np.full(int(3 * 1.9 ** i), -1.0, dtype) for i in range(n)}


def _fill(state, step):
    for i, (k, v) in enumerate(state.items()):
        v[...] = np.arange(v.size).reshape(v.shape) * 0.5 + 100 * step + i


def _expected(state, step):
    """What _fill(state, step) writes, in new arrays."""
    want = {k: np.empty_like(v) for k, v in state.items()}
    _fill(want, step)
    return want


def _check(state, step):
    want = _expected(state, step)
    for k, v in state.items():
        np.testing.assert_array_equal(v, want[k], err_msg=f"{k} at step {step}")


def _sync(state, rank, step, **kwargs):
    """One round: rank 0 writes step's values, broadcast_state, every rank has them."""
    import accord
    if rank == 0:
        _fill(state, step)
    accord.broadcast_state(state, src=0, **kwargs)
    _check(state, step)


def _entries():
    from accord import flat_state
    return len(flat_state._ENTRIES)


def _repeat(rank, world):
    state = _state(rank)
    took = []
    for step in range(6):
        before = _entries()
        _sync(state, rank, step)
        took.append(_entries() - before)
    return took


@pytest.mark.parametrize("world", [2, 3])
def test_repeated_calls_move_the_new_bytes_every_time(world):
    # the second call remembers the dict (one entry), later ones use it (none added)
    assert run_ranks(world, _repeat) == [[0, 1, 0, 0, 0, 0]] * world


def _changes(rank, world):
    """Each step changes the dict or a tensor on some rank in a way the remembered
    layout does not describe; every rank must still end with the root's values."""
    state = _state(rank)
    for step, change in enumerate(["none", "new_object", "reshape_in_place", "new_key_both",
                                   "swap_same_size", "none", "resized_storage"]):
        if change == "new_object" and rank == world - 1:
            state["p4"] = np.zeros_like(state["p4"])        # same shape, another array
        if change == "reshape_in_place":
            state["p5"].shape = (state["p5"].size, 1)       # every rank alike
        if change == "new_key_both":
            state["q"] = np.full(7, -1.0, np.float32)
        if change == "swap_same_size" and rank == 0:
            state["p1"], state["p2"] = state["p2"], state["p1"]
            state["p1"], state["p2"] = state["p2"], state["p1"]    # back: same objects
        if change == "resized_storage" and rank == 1:
            # a new array of the old size: the old memory may be gone
            state["p3"] = np.full(state["p3"].shape, -1.0, np.float32)
            gc.collect()
        _sync(state, rank, step)
    return "ok"


@pytest.mark.parametrize("world", [2, 3])
def test_a_changed_dict_or_tensor_takes_the_general_path_and_stays_right(world):
    assert run_ranks(world, _changes) == ["ok"] * world


def _mismatch_after_repeat(rank, world):
    import accord
    from accord.state import StateMismatch
    state = _state(rank, n=6)
    accord.broadcast_state(state, src=0)
    accord.broadcast_state(state, src=0)          # remembered on every rank
    accord.broadcast_state(state, src=0)          # ... and used
    if rank == 1:
        state["p2"] = np.zeros(state["p2"].size + 1, np.float32)
    try:
        accord.broadcast_state(state, src=0)      # all but rank 1 take the fast path
    except StateMismatch as e:
        msg = str(e)
    else:
        msg = None
    t = np.full(1, rank, np.int64)
    accord.broadcast(t, src=0)                    # the group is still usable
    assert t[0] == 0
    return msg


@pytest.mark.parametrize("world", [2, 3])
def test_a_mismatch_is_named_when_the_root_takes_the_fast_path(world):
    msgs = run_ranks(world, _mismatch_after_repeat, timeout=30)
    for m in msgs:
        assert m is not None and "['p2']: rank 1 has a float32 tensor of shape [11]" in m, m


def _readonly_later(rank, world):
    import accord
    state = _state(rank, n=4)
    accord.broadcast_state(state, src=0)
    accord.broadcast_state(state, src=0)
    if rank == 1:
        state["p1"].flags.writeable = False
    try:
        accord.broadcast_state(state, src=0)
    except ValueError as e:
        return str(e)
    return None


def test_an_array_made_read_only_after_a_sync_is_refused_not_written():
    msgs = run_ranks(2, _readonly_later, timeout=30)
    assert all(m is not None and "rank 1: ['p1']: array is read-only" in m for m in msgs), msgs


def _every_rank_as_the_root(res):
    """res[rank][step]: {key: array} after each step's sync; every rank's equal rank 0's."""
    for step, want in enumerate(res[0]):
        for k in want:
            for r in range(1, len(res)):
                np.testing.assert_array_equal(res[r][step][k], want[k],
                                              err_msg=f"{k} at step {step} on rank {r}")


def _torch_repeat(rank, world):
    import torch

    import accord
    g = torch.Generator().manual_seed(5)
    sd = {"w": torch.zeros(300, 7), "b": torch.zeros(7, dtype=torch.bfloat16),
          "big": torch.zeros(70_000), "n": torch.zeros(3, dtype=torch.int64)}
    out = []
    for step in range(4):
        if rank == 0:
            for t in sd.values():
                t.copy_(torch.randn(t.shape, generator=g).to(t.dtype) * (step + 1))
        if step == 2 and rank == 1:
            sd["w"].data = torch.zeros(300, 7)       # new storage under the same tensor
        if step == 3 and rank == 1:
            sd["big"].resize_(70_000)                # same size: storage may stay
        accord.broadcast_state(sd, src=0)
        out.append({k: v.float().numpy().copy() for k, v in sd.items()})
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_torch_state_dict_synced_again_and_again(world):
    # the root's pieces behind its row: world 2 through the ring, world 3 its slot
    pytest.importorskip("torch")
    res = run_ranks(world, _torch_repeat)
    _every_rank_as_the_root(res)
    assert res[0][0]["w"].any() and res[0][3]["big"].any()


def _torch_metadata_changes(rank, world):
    """Each step changes a tensor's metadata in place, or swaps it for another object,
    on the root or on a receiver; returns (whether the rank's remembered entry still
    held after the change, the state after the sync) per step."""
    import torch

    import accord
    from accord import flat_state
    from accord._packing import check_bucket_bytes
    from accord.world import resolve_group
    g = resolve_group(None)
    sd = {"sq": torch.zeros(64, 64), "v": torch.zeros(1000), "d": torch.zeros(256)}
    out = []
    for step, change in enumerate(["none", "none", "view", "transpose", "none", "dtype",
                                   "none", "clone", "none"]):
        if change == "view" and rank == 0:
            sd["v"] = sd["v"].view(1000)                 # another object, the same memory
        if change == "transpose" and rank == 0:
            sd["sq"].t_()                                # same address, shape and size
        if change == "dtype":                            # every rank alike
            for k in sd:
                sd[k] = sd[k].contiguous()
            sd["d"].data = sd["d"].view(torch.int32)     # same address, shape, strides
        if change == "clone" and rank == world - 1:
            sd["v"] = sd["v"].clone()                    # another object and memory
        held = flat_state.lookup(g, sd, check_bucket_bytes(None), rank == 0)[0] is not None
        if rank == 0:
            for i, t in enumerate(sd.values()):
                t.copy_((torch.arange(t.numel()).reshape(t.shape) * 3 + 1000 * step + i)
                        .to(t.dtype))
        accord.broadcast_state(sd, src=0)
        out.append((held, {k: v.contiguous().numpy().copy() for k, v in sd.items()}))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_torch_tensors_changed_in_place_are_seen_and_a_view_of_the_same_memory_is_not(world):
    pytest.importorskip("torch")
    res = run_ranks(world, _torch_metadata_changes)
    _every_rank_as_the_root([[arrays for _, arrays in steps] for steps in res])
    held = [[res[r][step][0] for step in range(9)] for r in range(world)]
    # remembered from the second call (and again at the end of a call that found the
    # same dict and first tensor); the root's new view of the same memory keeps its
    # entry, a transpose in place (same address, shape and size) or a new dtype over
    # the same bytes does not, and neither does another tensor's memory
    assert held[0] == [False, False, True, False, False, False, False, True, True]
    assert held[world - 1] == [False, False, True, True, True, False, True, False, True]
    # the transposed root's values, not its memory in order (which holds [1, 0] there)
    assert res[1][3][1]["sq"][0, 1] == 3 * 1 + 1000 * 3
    assert res[1][3][1]["sq"][1, 0] == 3 * 64 + 1000 * 3


def _no_memory_kept(rank, world):
    import accord
    state = _state(rank, n=5)
    probe = weakref.ref(state["p4"])
    accord.broadcast_state(state, src=0)
    accord.broadcast_state(state, src=0)
    del state
    gc.collect()
    return probe() is None


def test_a_remembered_dict_keeps_none_of_its_arrays_alive():
    assert run_ranks(2, _no_memory_kept) == [True, True]


def _across_hosts(rank, world):
    import os

    import accord
    from accord.state import StateMismatch
    os.environ["ACCORD_HOST_ID"] = "ab"[rank // 2]        # two simulated hosts of two
    accord.init_process_group()
    assert accord.world.default_group().hier is not None
    state = _state(rank, n=8)
    for step in range(3):
        if rank == 1:
            _fill(state, step)
        accord.broadcast_state(state, src=1)
        _check(state, step)
    if rank == 3:
        state["p0"] = np.zeros(4, np.int32)
    try:
        accord.broadcast_state(state, src=1)
    except StateMismatch as e:
        return str(e)
    finally:
        accord.destroy_process_group()
    return None


def test_hierarchical_group_syncs_again_and_names_a_mismatch():
    msgs = run_ranks(4, _across_hosts, init=False, timeout=60)
    for m in msgs:
        assert m is not None and "['p0']: rank 3 has a int32 tensor of shape [4]" in m, m


def _many_small(rank, world, n, elems):
    # odd sizes: tensors straddle the packed area's piece boundaries
    state = {f"t{i:03d}": np.full(elems + 37 * (i % 11), -1.0, np.float32) for i in range(n)}
    for step in range(3):
        _sync(state, rank, step)
    return "ok"


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("n,elems,env", [
    (60, 6000, {}),                                   # 1.5 MB packed: ring (2), chain (3)
    (240, 6000, {}),                                  # 6 MB: split single copy
    (60, 6000, {"ACCORD_ALGORITHMS": "broadcast=chain"}),
], ids=["ring-or-chain", "single-copy", "chain"])
def test_packed_pieces_are_packed_and_unpacked_one_by_one(world, n, elems, env):
    assert run_ranks(world, _many_small, n, elems, env=env) == ["ok"] * world


def _small_bucket_tree(rank, world, forced):
    import accord
    from tests.harness import spy_algorithms
    state = _state(rank)
    with spy_algorithms("broadcast_list") as names:
        for step in range(2):
            if rank == 0:
                _fill(state, step)
            accord.broadcast_state(state, src=0)
            _check(state, step)
    return list(names)


@pytest.mark.parametrize("world", [3, 4])
def test_a_small_bucket_goes_down_the_tree_beyond_two_ranks(world):
    for names in run_ranks(world, _small_bucket_tree, None):
        assert names == ["tree", "tree"], names


def _two_groups(rank, world):
    import accord
    sub = accord.new_group([0, 1])
    state = _state(rank)
    for step in range(4):
        if rank == 0:
            _fill(state, step)
        # the same dict on two groups, turn about: an entry each
        accord.broadcast_state(state, src=0, group=sub if step % 2 else None)
        if rank in (0, 1) or step % 2 == 0:
            _check(state, step)
    return _entries()


def test_one_dict_synced_on_two_groups_gets_an_entry_for_each():
    assert run_ranks(3, _two_groups) == [2, 2, 1]


def _fresh_dicts(rank, world):
    for step in range(4):
        # new arrays in a new dict each call, as module.state_dict() gives
        state = _state(rank)
        _sync(state, rank, step)
        del state
    return _entries()


def test_a_fresh_dict_each_call_is_never_remembered():
    assert run_ranks(2, _fresh_dicts) == [0, 0]


def _ahead_then_mismatch(rank, world, change, n):
    """A small remembered state: the root sends its pieces behind its row. Then one
    rank's state changes; every rank raises, and no rank's tensors are written."""
    import accord
    from accord.state import StateMismatch
    from tests.test_state_by_address import _paths
    state = _state(rank, n=n)
    with _paths() as took:
        for step in range(4):
            _sync(state, rank, step)
    kwargs = {}
    if change == "shape" and rank == world - 1:
        state["p2"] = np.zeros(state["p2"].size + 1, np.float32)
    if change == "bucket_bytes" and rank == world - 1:
        kwargs["bucket_bytes"] = 4 << 10
    if rank == 0:
        _fill(state, 9)                           # what must reach no rank
    try:
        accord.broadcast_state(state, src=0, **kwargs)
    except StateMismatch as e:
        msg = str(e)
    else:
        msg = None
    if rank != 0:
        want = _expected(state, 3)                # step 3's values, the last synced
        for k, v in state.items():
            if change != "shape" or rank != world - 1 or k != "p2":
                np.testing.assert_array_equal(v, want[k], err_msg=k)
    t = np.full(3, rank, np.int64)
    accord.broadcast(t, src=0)                    # the links are clean: the group works
    assert (t == 0).all()
    if change == "shape" and rank == world - 1:
        state["p2"] = np.zeros(state["p2"].size - 1, np.float32)
    _sync(state, rank, 5)                         # and syncs again
    return took, msg


@pytest.mark.parametrize("world,n,env", [
    (2, 10, {"ACCORD_TRANSPORT": "tcp"}),
    # 5.2 MiB, one message the ring streams (with single copy, by address from 4 MiB)
    (2, 20, {"ACCORD_SHM_CMA": "0"}),
    (3, 10, {}),                                # through the root's shared slot
    (3, 10, {"ACCORD_SHM_ARENA": "1M"}),        # ... on the rings (no slots in the arena)
    (4, 10, {}),
    (3, 17, {"ACCORD_SHM_CMA": "64K"}),         # the large pieces read out of the root
    (3, 20, {}),                                # 5.2 MiB: six chunks of the root's slot
], ids=["2-tcp", "2-large", "3", "3-no-slots", "4", "3-single-copy", "3-chunks"])
@pytest.mark.parametrize("change", ["shape", "bucket_bytes"])
def test_a_root_that_sent_its_pieces_with_its_row_writes_nothing_on_a_mismatch(world, n, env,
                                                                               change):
    res = run_ranks(world, _ahead_then_mismatch, change, n, env=env, timeout=60)
    last = world - 1
    for rank, (took, msg) in enumerate(res):
        # calls 3 and 4 went ahead
        assert took == ["ahead", "ahead"], (rank, took)
        want = (f"['p2']: rank {last} has a float32 tensor of shape [11]"
                if change == "shape" else
                f"rank {last}: bucket_bytes=4096, src rank 0: bucket_bytes=26214400")
        assert msg is not None and "(no tensor was written)" in msg and want in msg, msg


def _module_repeat(rank, world):
    import collections

    import torch

    import accord
    torch.manual_seed(rank)                           # every rank starts different
    model = torch.nn.Sequential(torch.nn.Linear(6, 40), torch.nn.LayerNorm(40),
                                torch.nn.Linear(40, 3))
    model[1].register_buffer("steps", torch.zeros(2, dtype=torch.int64))
    sd = model.state_dict()                           # an OrderedDict, as torch makes it
    assert type(sd) is collections.OrderedDict
    took, out = [], []
    for step in range(5):
        if rank == 0:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
                model[1].steps += 1
        if step == 3:
            # a parameter replaced: the module's remembered tensors are not its own any more
            model[2].weight = torch.nn.Parameter(torch.full((3, 40), -7.0))
        before = _entries()
        accord.broadcast_state(model, src=0)
        took.append(_entries() - before)
        out.append({k: v.detach().numpy().copy() for k, v in model.state_dict().items()})
    # the state_dict OrderedDict synced again takes the short path too
    for step in range(3):
        before = _entries()
        accord.broadcast_state(sd, src=0)
        took.append(_entries() - before)
    assert model[0].weight.requires_grad and model[0].weight.grad is None
    return took, out


@pytest.mark.parametrize("world", [2, 3])
def test_a_module_and_its_state_dict_synced_again_are_remembered_and_stay_right(world):
    # the module is remembered on its second sync; a replaced parameter fails the
    # entry's check, and the general path makes it anew under the same module (so the
    # count stays); its OrderedDict state_dict is remembered on its second sync
    pytest.importorskip("torch")
    res = run_ranks(world, _module_repeat)
    for rank, (took, out) in enumerate(res):
        assert took == [0, 1, 0, 0, 0, 0, 1, 0], (rank, took)
        for step in range(5):
            for k, v in res[0][1][step].items():
                np.testing.assert_array_equal(out[step][k], v,
                                              err_msg=f"{k} at step {step} on rank {rank}")
    assert (res[0][1][4]["1.steps"] == 5).all()
    assert (res[0][1][4]["2.weight"] == -6.0).all()      # replaced at step 3 (-7), +1 at step 4


def _module_with_extra_state(rank, world):
    import torch

    import accord

    class Scaled(torch.nn.Linear):
        def __init__(self):
            super().__init__(4, 2)
            self.tag = f"rank{rank}"

        def get_extra_state(self):
            return {"tag": self.tag}

        def set_extra_state(self, state):
            self.tag = state["tag"]

    torch.manual_seed(rank)
    m = torch.nn.Sequential(Scaled(), torch.nn.ReLU())
    out = []
    for step in range(3):
        if rank == 0:
            with torch.no_grad():
                m[0].weight.add_(1.0)
            m[0].tag = f"step{step}"
        accord.broadcast_state(m, src=0)
        out.append((m[0].tag, m[0].weight.detach().numpy().copy(), m[0].weight.requires_grad))
    return out


def test_a_module_with_extra_state_gets_its_object_and_its_tensors_every_time():
    # an object leaf (the extra state) keeps a module on the general path: its tensors
    # are written in place and the object set through load_state_dict, every sync
    pytest.importorskip("torch")
    res = run_ranks(2, _module_with_extra_state)
    for step in range(3):
        assert res[1][step][0] == f"step{step}"
        np.testing.assert_array_equal(res[1][step][1], res[0][step][1])
        assert res[1][step][2]
