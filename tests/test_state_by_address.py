"""broadcast_state synced again over shared memory: at two ranks a state under the
single-copy threshold (4 MiB) behind the root's row in the agreement's call, one message
through the ring, and one of the threshold or more (with state.AHEAD_PAIR off, of 1 MiB
or more) copied from each root tensor straight into the receiver's once the rows are in:
process_vm_readv / writev over lists of segments, no packing; beyond
two, through the root's shared slot in chunks (by address only in an arena without
slots). Every rank must end with the root's bytes,
whichever path each call takes, however the dicts change between calls. (A mismatch after syncs by address:
test_state_repeat.py's test of a mismatch on the fast path, at worlds 2 and 3.)"""
import gc

import numpy as np
import pytest

from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(120)


class _paths:
    """with _paths() as took: ... -- how every repeated call moved each bucket:
    "address" (copied between memories), "ring" (through the transport, in the
    agreement's call or a call of its own), or, once per call, "ahead" (the root sent
    every piece behind its row). The general path (a dict seen for the first time)
    adds none of them."""

    _SPIED = {"copy_segments": "address", "_stream_bucket": "ring",
              "_send_ahead": "ahead", "_take_ahead": "ahead", "_take_slotted": "ahead"}

    def __enter__(self):
        from accord import state
        self.state = state
        self.saved = {name: getattr(state, name) for name in self._SPIED}
        took = self.took = []

        def spy(name, fn):
            def spied(*args):
                took.append(self._SPIED[name])
                return fn(*args)
            return spied
        for name, fn in self.saved.items():
            setattr(state, name, spy(name, fn))
        return took

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(self.state, name, fn)


def _fill(state, step, src=0):
    for i, (k, v) in enumerate(state.items()):
        v[...] = (np.arange(v.size).reshape(v.shape) % 251 + 7 * step + i + 1000 * src
                  ).astype(v.dtype)


def _check(state, step, src=0):
    want = {k: np.empty_like(v) for k, v in state.items()}
    _fill(want, step, src)
    for k, v in state.items():
        np.testing.assert_array_equal(v, want[k], err_msg=f"{k} at step {step}")


def _sync(state, rank, step, src=0, **kwargs):
    import accord
    if rank == src:
        _fill(state, step, src)
    accord.broadcast_state(state, src=src, **kwargs)
    _check(state, step, src)


def _state(n=12, dtype=np.float32, start=3):
    # 3 elements to 40000 (160 KiB): ones the ring path packs and ones it sends in place
    return {f"p{i}": np.full(int(start * 1.9 ** i), -1, dtype) for i in range(n)}


# the single-copy threshold at its default, which the group's probe would lower to 1 MiB
# where it found single copy faster (transport/cma_threshold.py)
_THRESHOLD_4M = {"ACCORD_SHM_CMA": "4M"}


def _no_pair():
    """Two ranks copy a state of 1 MiB or more by address: turn off sending it behind
    the root's row through the ring (state.AHEAD_PAIR), the default over shared memory."""
    from accord import state
    state.AHEAD_PAIR = False


def _steady(rank, world, state_fn, steps, kwargs, pair=True):
    if not pair:
        _no_pair()
    state = state_fn()
    with _paths() as took:
        for step in range(steps):
            _sync(state, rank, step, **kwargs)
    return took


def _mixed():
    s = _state(8)
    s.update({"ids": np.full(5000, -1, np.int64), "half": np.full(3001, -1, np.float16),
              "empty": np.zeros(0, np.float32), "flags": np.zeros(33, np.uint8)})
    return s


def _many():
    # more tensors than one system call takes (1024 segments), of odd sizes
    return {f"t{i:04d}": np.full(1 + i % 13, -1, np.float32) for i in range(2500)}


def _bulky(state_fn):
    # the same state and a tensor of 1.2 MB (a float32 bucket, the first, of 1 MiB or
    # more): with AHEAD_PAIR off too large to go behind the root's row, so every bucket
    # is copied by address
    def make():
        s = state_fn()
        s["bulk"] = np.full(300_000, -1, np.float32)
        return s
    return make


@pytest.mark.parametrize("state_fn,kwargs", [
    (_bulky(_state), {}),
    (_bulky(_mixed), {}),                          # dtype buckets, an empty tensor
    (_bulky(_mixed), {"bucket_bytes": 16 << 10}),  # ... and several buckets of one dtype
    (_bulky(_many), {}),
], ids=["one-bucket", "dtypes", "small-buckets", "2500-tensors"])
def test_two_ranks_copy_every_bucket_by_address_once_the_dict_is_known(state_fn, kwargs):
    took = run_ranks(2, _steady, state_fn, 5, kwargs, False)
    n = len(took[0]) // 3
    # calls 1 and 2 learn the dict (general path); calls 3-5 copy by address
    assert took[0] == took[1] == ["address"] * n * 3 and n >= 1, took


@pytest.mark.parametrize("state_fn,kwargs", [
    (_state, {}), (_mixed, {}), (_mixed, {"bucket_bytes": 16 << 10}), (_many, {}),
], ids=["one-bucket", "dtypes", "small-buckets", "2500-tensors"])
def test_two_ranks_send_a_small_state_behind_the_roots_row(state_fn, kwargs):
    # under 1 MiB: calls 3-5 go through the rings in the agreement's own step, every
    # bucket at once (by address they would wait for the agreement's round first)
    assert run_ranks(2, _steady, state_fn, 5, kwargs) == [["ahead"] * 3] * 2


@pytest.mark.parametrize("state_fn,kwargs", [
    (_bulky(_state), {}), (_bulky(_mixed), {"bucket_bytes": 16 << 10}), (_bulky(_many), {}),
], ids=["one-bucket", "small-buckets", "2500-tensors"])
def test_two_ranks_send_a_large_state_behind_the_roots_row_through_the_ring(state_fn, kwargs):
    # 1.2 MB and more, under the single-copy threshold (pinned at its default, 4 MiB:
    # where the group's probe finds single copy faster it is 1 MiB): one message
    # gathered from the root's tensors, streamed through the ring in pieces and
    # scattered into the receiver's as it comes
    assert run_ranks(2, _steady, state_fn, 5, kwargs, env=_THRESHOLD_4M) == \
        [["ahead"] * 3] * 2


def _past_threshold(rank, world, mib):
    # the state of _bulky(_state) with its bulk tensor grown to `mib` MiB
    def make():
        s = _state()
        s["bulk"] = np.full(mib << 18, -1, np.float32)
        return s
    return _steady(rank, world, make, 5, {})


@pytest.mark.parametrize("env,mib,way", [
    (_THRESHOLD_4M, 5, "address"),              # 5.2 MiB
    (_THRESHOLD_4M, 2, "address"),              # 2.2 MiB: half the threshold or more
    (_THRESHOLD_4M, 1, "ahead"),                # 1.2 MiB: through the ring
    ({"ACCORD_SHM_CMA": "8M"}, 3, "ahead"),     # 3.2 MiB under half a raised threshold
    ({"ACCORD_SHM_CMA": "1M"}, 1, "address"),   # 1.2 MiB against a threshold of 1 MiB
    ({"ACCORD_SHM_CMA": "0"}, 5, "ahead"),      # no single copy: the ring at any size
], ids=["5M", "2M", "1M", "3M-under-8M", "1M-threshold", "no-single-copy"])
def test_two_ranks_copy_a_state_past_the_single_copy_threshold_by_address(env, mib, way):
    took = run_ranks(2, _past_threshold, mib, env=env)
    # calls 3-5: by address every bucket once the rows are in, or ahead behind the row
    n = len(took[0]) // 3
    assert took[0] == took[1] == [way] * n * 3 and n >= 1, took


def _large():
    # 1.9 MiB in all (a tensor of 1.4 MiB): no longer sent behind the root's row
    return _state(10, start=2500)


@pytest.mark.parametrize("env,large", [({"ACCORD_SHM_CMA": "0"}, "ahead"),
                                       ({"ACCORD_TRANSPORT": "tcp"}, "ring")],
                         ids=["no-single-copy", "tcp"])
def test_without_single_copy_a_small_state_follows_the_roots_row(env, large):
    # calls 3 and 4 of each: the small state (under 1 MiB) behind the root's row in the
    # agreement's call; the large one too over shared memory (one message the ring takes
    # in pieces), over TCP (whose receive of a scattered message would copy it once
    # more) its bucket through the transport once the rows are in
    assert run_ranks(2, _steady, _state, 4, {}, env=env) == [["ahead", "ahead"]] * 2
    assert run_ranks(2, _steady, _large, 4, {}, env=env) == [[large, large]] * 2


def _wide(rank, world, mib, write=None):
    # a float32 bucket of `mib` MiB and a small int64 one; write: the slot's writer's
    # method pinned (transport/shared_write.py), else timed
    from accord.transport import shared_write
    shared_write.FORCE = write
    state = {"w": np.full(mib << 18, -1, np.float32), "b": np.full(300, -1, np.int64),
             "v": np.full(77, -1, np.float32)}
    with _paths() as took:
        for step in range(4):
            _sync(state, rank, step)
    return took


@pytest.mark.parametrize("world, write", [(3, None), (4, None), (3, "memcpy"), (3, "stream")])
def test_beyond_two_ranks_every_bucket_goes_through_the_roots_slot(world, write):
    # 8 MiB and a little: written into the root's shared slot in eight chunks and a
    # tail, behind its row, and copied out by every receiver (a bucket of each dtype)
    took = run_ranks(world, _wide, 8, write)
    assert took == [["ahead", "ahead"]] * world, took


@pytest.mark.parametrize("world", [3, 4])
def test_without_slots_a_large_bucket_goes_by_address_a_small_one_by_ring(world):
    # an arena too small for shared slots: the large bucket is copied by address, the
    # small one goes through the rings (the receivers' acknowledgements cost more there)
    took = run_ranks(world, _wide, 8, env={"ACCORD_SHM_ARENA": "1M"})
    assert took == [["ring", "address"] * 2] * world, took     # buckets: int64 first


def _short_tail():
    # two pieces of 1 MiB - 4 bytes: the chunks (the 16-byte sizes list, then the bytes)
    # are 1 MiB, 1 MiB and 8 bytes, the last shorter than the sizes list
    return {"a": np.full((1 << 18) - 1, -1, np.float32),
            "b": np.full((1 << 18) - 1, -1, np.float32)}


def test_a_last_chunk_shorter_than_the_sizes_list_is_taken():
    assert run_ranks(3, _steady, _short_tail, 4, {}) == [["ahead", "ahead"]] * 3


class _Unremembered(dict):
    """A dict subclass: broadcast_state never remembers one (iterating it may mean
    something else), so a rank passing it always takes the general path."""


def _general_path_receiver(rank, world):
    # the last rank's state is never remembered: it takes the root's chunks on the
    # general path, into its packed and large pieces, then unpacks them
    from accord import flat_state
    state = {f"p{i}": np.full(int(3 * 1.9 ** i), -1, np.float32) for i in range(20)}
    state["ids"] = np.full(70000, -1, np.int64)
    if rank == world - 1:
        state = _Unremembered(state)
    with _paths() as took:
        for step in range(5):
            _sync(state, rank, step)
    return took, len(flat_state._ENTRIES)


@pytest.mark.parametrize("world", [3, 4])
def test_a_receiver_on_the_general_path_takes_the_roots_chunks(world):
    # about 5 MiB: six chunks; the root and the other receivers sync by their entries
    out = run_ranks(world, _general_path_receiver)
    assert out == [(["ahead"] * 3, 1)] * (world - 1) + [(["ahead"] * 3, 0)], out


def _roots_take_turns(rank, world):
    state = _state()
    for step in range(8):
        _sync(state, rank, step, src=step % world)
    return "ok"


@pytest.mark.parametrize("world", [2, 3])
def test_the_root_may_change_from_call_to_call(world):
    # each rank holds an entry per role; a receiver's view of a root is per root
    assert run_ranks(world, _roots_take_turns) == ["ok"] * world


def _receiver_replaces_a_tensor(rank, world):
    """A receiver swaps a tensor for a new one and frees the old: the root must not
    write where it used to be (it reads the receiver's new layout once it is known).
    1 MiB and more, so that it goes by address at two ranks (AHEAD_PAIR off)."""
    _no_pair()
    state = _bulky(_state)()
    with _paths() as took:
        for step in range(8):
            if step == 3 and rank == world - 1:
                state["p9"] = np.full(state["p9"].shape, -1, np.float32)
                state["p11"] = np.full(state["p11"].shape, -1, np.float32)
                gc.collect()
            if step == 5 and rank == 0:
                state["p10"] = state["p10"].copy()      # and the root, later
                gc.collect()
            _sync(state, rank, step)
    return took


def test_a_replaced_tensor_on_any_rank_is_never_written_at_its_old_address():
    took = run_ranks(2, _receiver_replaces_a_tensor)
    # steps 2, then 5 and 6 (the receiver learns its new dict at 3 and 4; the root at 5
    # and 6, where the receiver falls back with it), then 7
    assert took[0][-1] == took[1][-1] == "address", took
    assert took[0].count("address") == took[1].count("address") >= 2, took


def _torch_dict(rank, world):
    import torch

    import accord
    _no_pair()
    g = torch.Generator().manual_seed(3)
    sd = {"w": torch.zeros(300, 7), "b": torch.zeros(7, dtype=torch.bfloat16),
          "big": torch.zeros(300_000), "n": torch.zeros(3, dtype=torch.int64),
          "p": torch.nn.Parameter(torch.zeros(40), requires_grad=False)}
    out = []
    with _paths() as took:
        for step in range(5):
            if rank == 0:
                with torch.no_grad():
                    for t in sd.values():
                        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype) * (step + 1))
            accord.broadcast_state(sd, src=0)
            out.append({k: v.detach().float().numpy().copy() for k, v in sd.items()})
    return out, took


def test_torch_tensors_and_parameters_by_address():
    pytest.importorskip("torch")
    res = run_ranks(2, _torch_dict)
    for step in range(5):
        for k in res[0][0][step]:
            np.testing.assert_array_equal(res[1][0][step][k], res[0][0][step][k],
                                          err_msg=f"{k} at step {step}")
    assert res[0][1] == res[1][1] and set(res[0][1]) == {"address"}, res[0][1]


def _sync_where_one_dies(state_dict, rank, victim, fn_name):
    """broadcast_state(state_dict) with accord.state's fn_name made to SIGKILL this
    process on the victim; (outcome, message, seconds) on the others."""
    import os
    import signal
    import time

    import accord
    from accord import state
    if rank == victim:
        def die(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)
        setattr(state, fn_name, die)
    t0 = time.monotonic()
    try:
        accord.broadcast_state(state_dict, src=0)
    except accord.PeerLost as e:
        return "PeerLost", str(e), time.monotonic() - t0
    return "ok", "", time.monotonic() - t0


def _dies_mid_copy(rank, world, victim):
    """The victim dies inside the copy by address (after the agreement, before it has
    copied or said done): the others must get PeerLost naming it, not wait."""
    _no_pair()
    big = {f"w{i}": np.full(1 << 18, -1, np.float32) for i in range(6)}    # 6 MiB
    for step in range(3):
        _sync(big, rank, step)
    return _sync_where_one_dies(big, rank, victim, "copy_segments")


@pytest.mark.parametrize("world,victim", [(2, 1), (2, 0), (3, 2)])
def test_a_rank_that_dies_inside_the_copy_is_reported_not_waited_for(world, victim):
    # beyond two ranks only an arena without shared slots copies by address
    env = {"ACCORD_SHM_ARENA": "1M"} if world > 2 else {}
    out = run_ranks(world, _dies_mid_copy, victim, timeout=60, expect_fail=True, env=env)
    assert out[victim][0] == "died", out
    for r in range(world):
        if r == victim:
            continue
        kind, (name, msg, took) = out[r]
        assert kind == "ok" and took < 10, out[r]
        if r == 0 or world == 2:
            # the root waits for every receiver's done (the victim's never comes); at
            # world 2 each side also copies into or out of the other
            assert name == "PeerLost" and f"rank {victim}" in msg, out[r]
        else:
            # another receiver needs nothing of the victim: it may finish this call
            assert name in ("ok", "PeerLost"), out[r]


def _dies_sending_ahead(rank, world, victim):
    """A small state the root sends with its row: the root dies as it would send it, or
    a receiver before it sends its row. Every rank waiting on the dead one gets
    PeerLost naming it within seconds."""
    small = _state()
    with _paths() as took:
        for step in range(3):
            _sync(small, rank, step)
    assert took == ["ahead"], took
    # a receiver dies choosing its all_gather: before its row leaves
    return _sync_where_one_dies(small, rank, victim, "_send_ahead" if victim == 0 else "choose")


@pytest.mark.parametrize("victim", [0, 2])
def test_a_rank_that_dies_as_the_root_sends_ahead_is_reported_not_waited_for(victim):
    out = run_ranks(3, _dies_sending_ahead, victim, timeout=60, expect_fail=True)
    assert out[victim][0] == "died", out
    for r in range(3):
        if r != victim:
            kind, (name, msg, took) = out[r]
            assert kind == "ok" and name == "PeerLost" and f"rank {victim}" in msg, out[r]
            assert took < 10, out[r]


def _dies_taking_chunks(rank, world, victim):
    """A receiver dies as it would take the root's chunks (6 MiB: more than the root's
    slot holds at once, so the root waits for it to copy some out): the root, and
    the other receiver where it needs the victim, get PeerLost naming it."""
    big = {f"w{i}": np.full(1 << 18, -1, np.float32) for i in range(6)}
    with _paths() as took:
        for step in range(3):
            _sync(big, rank, step)
    assert took == ["ahead"], took
    return _sync_where_one_dies(big, rank, victim, "_take_slotted")


def test_a_receiver_that_dies_while_the_root_writes_its_slot_is_reported_not_waited_for():
    out = run_ranks(3, _dies_taking_chunks, 2, timeout=60, expect_fail=True)
    assert out[2][0] == "died", out
    kind, (name, msg, took) = out[0]
    assert kind == "ok" and name == "PeerLost" and "rank 2" in msg, out[0]
    assert took < 10, out[0]
    kind, (name, msg, took) = out[1]
    # rank 1 needs nothing of rank 2 once the rows are in: it may finish this call
    assert kind == "ok" and name in ("ok", "PeerLost") and took < 10, out[1]


def _ahead_how(rank, world):
    """Which receiving side each repeated call of a small state took on this rank."""
    from accord import state
    names = ("_take_ahead", "_take_slotted")
    saved = {name: getattr(state, name) for name in names}
    took = []

    def spy(name, fn):
        def spied(*args):
            took.append(name)
            return fn(*args)
        return spied
    for name, fn in saved.items():
        setattr(state, name, spy(name, fn))
    try:
        small = _state()
        for step in range(4):
            _sync(small, rank, step)
    finally:
        for name, fn in saved.items():
            setattr(state, name, fn)
    return took


@pytest.mark.parametrize("env,want", [({}, "_take_slotted"),
                                      ({"ACCORD_SHM_ARENA": "1M"}, "_take_ahead")],
                         ids=["slots", "arena-without-slots"])
def test_beyond_two_ranks_the_roots_pieces_go_through_its_slot_where_it_has_one(env, want):
    # calls 3 and 4 (the first two learn the dict): written once into the root's shared
    # slot and copied out by each receiver, or, where the arena has no slots, sent on
    # every receiver's ring; either way every receiver ends with the root's bytes
    assert run_ranks(3, _ahead_how, env=env) == [[], [want] * 2, [want] * 2]
