"""Shared slots (transport/slots.py) and the collectives that use them
(algorithms/slotted.py): a rank writes a piece once into its slot, every peer
copies it out.

Run as real ranks over shared memory. A small arena (8 MiB) makes the pieces
small (168 KiB at world 3, 100 KiB at world 5), so a megabyte already takes
several rounds and wraps around each slot; forcing the algorithms with
ACCORD_ALGORITHMS reaches them at every size.
"""
import os
import time

import numpy as np
import pytest

import accord as dist
from accord.transport import shared_write
from harness import run_ranks, shm_in_threads, timed

pytestmark = pytest.mark.timeout(120)

FORCED = {"ACCORD_TRANSPORT": "shm",
          "ACCORD_ALGORITHMS": "broadcast=slotted,all_gather=slotted"}
SMALL = {**FORCED, "ACCORD_SHM_ARENA": "8M"}


def _room():
    return dist.world.default_group().transport.slots.room


def _data(n, dtype, *seed):
    rng = np.random.default_rng([n, *seed])
    return (rng.random(n) * 1000).astype(dtype)


def _collectives(rank, world, sizes, write=None):
    from harness import spy_algorithms
    from accord.transport import shared_write
    shared_write.FORCE = write         # None: the timed choice, as by default
    with spy_algorithms("broadcast") as b_ran, spy_algorithms("all_gather") as g_ran:
        for n in sizes:
            for dtype in ("uint8", "float32", "float64", "complex64"):
                for root in range(world):
                    x = _data(n, dtype, root) if rank == root else np.zeros(n, dtype)
                    dist.broadcast(x, root)
                    assert np.array_equal(x, _data(n, dtype, root)), (n, dtype, root)
                # uneven blocks: rank r gives n + 1000 r elements
                out = [np.zeros(n + 1000 * r, dtype) for r in range(world)]
                dist.all_gather(out, _data(n + 1000 * rank, dtype, rank, 7))
                for r in range(world):
                    assert np.array_equal(out[r], _data(n + 1000 * r, dtype, r, 7)), (n, r)
                whole = np.zeros(n * world, dtype)
                dist.all_gather_into_tensor(whole, _data(n, dtype, rank, 9))
                assert np.array_equal(whole, np.concatenate(
                    [_data(n, dtype, r, 9) for r in range(world)])), (n, dtype)
    return _room(), set(b_ran), set(g_ran)


@pytest.mark.parametrize("world, write", [(3, None), (4, None), (5, None),
                                          (4, "memcpy"), (4, "stream")])
def test_broadcast_and_all_gather_through_the_slots_match_numpy(world, write):
    # sizes 0 and 1, one piece, and several pieces wrapping around each slot; pieces
    # from shared_write.MIN_BYTES are written by memcpy or streaming stores as timed, or
    # by the one method pinned
    sizes = [0, 1, 40_000, 150_001]
    for room, b_ran, g_ran in run_ranks(world, _collectives, sizes, write, env=SMALL):
        assert b_ran == {"slotted"} and g_ran == {"slotted"}, (b_ran, g_ran)
        assert 2 * room < 150_001 * 8     # float64: more pieces than a slot holds
        if world < 5:                     # (100 KiB pieces at world 5)
            assert room >= shared_write.MIN_BYTES   # whole pieces go through the copier


def _all_reduce(rank, world, write=None):
    import hashlib
    from harness import spy_algorithms
    from accord.transport import shared_write
    shared_write.FORCE = write
    digests = []
    with spy_algorithms("all_reduce") as ran:
        for n in (0, 1, 1001, 150_001):
            for dtype in ("int32", "float32", "float64", "complex64"):
                ops = [dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT]
                if dtype != "complex64":
                    ops += [dist.ReduceOp.MAX, dist.ReduceOp.MIN]
                if dtype != "int32":
                    ops.append(dist.ReduceOp.AVG)
                for op in ops:
                    x = _data(n, dtype, rank, 3)
                    dist.all_reduce(x, op)
                    ins = [_data(n, dtype, r, 3) for r in range(world)]
                    if dtype == "int32" and op != dist.ReduceOp.PRODUCT:
                        ref = {dist.ReduceOp.SUM: np.add, dist.ReduceOp.MAX: np.maximum,
                               dist.ReduceOp.MIN: np.minimum}[op].reduce(ins)
                        assert np.array_equal(x, ref.astype(dtype)), (n, op)
                    elif op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
                        ref = np.sum(np.stack(ins).astype("complex128"), axis=0)
                        if op == dist.ReduceOp.AVG:
                            ref = ref / world
                        assert np.allclose(x, ref.astype(dtype), rtol=1e-5), (n, op, dtype)
                    digests.append(hashlib.sha1(x.tobytes()).hexdigest())
    return set(ran), digests


@pytest.mark.parametrize("write", [None, "stream"])
def test_all_reduce_through_the_slots_is_correct_and_the_same_on_every_rank(write):
    out = run_ranks(4, _all_reduce, write,
                    env={**SMALL, "ACCORD_ALGORITHMS": "all_reduce=slotted"}, timeout=120)
    for ran, digests in out:
        assert ran == {"slotted"}, ran
        assert digests == out[0][1]      # every rank ends with the same bits


def _state(rank, world):
    from harness import spy_algorithms

    def make(seed):
        # packed small tensors, large ones in place, a strided view, an empty one
        rng = np.random.default_rng(seed)
        sd = {f"w{i}": rng.random(n).astype(np.float32)
              for i, n in enumerate([3, 1000, 70_000, 0, 5, 300_000, 17])}
        sd["t"] = rng.random((300, 200)).astype(np.float64).T
        sd["i"] = rng.integers(0, 1 << 40, 1234)
        return sd
    want = make(1)
    with spy_algorithms("broadcast_list") as ran:
        for k in range(3):              # the first sync, then repeated ones
            sd = make(1) if rank == 0 else {key: np.zeros_like(v) for key, v in want.items()}
            dist.broadcast_state(sd, src=0)
            for key, v in want.items():
                assert np.array_equal(sd[key], v), (k, key)
    return set(ran)


def test_broadcast_state_through_the_slots_matches_the_root():
    env = {**SMALL, "ACCORD_ALGORITHMS": "broadcast_list=slotted", "ACCORD_SHM_CMA": "0"}
    for ran in run_ranks(3, _state, env=env):
        assert ran == {"slotted"}, ran


def test_a_list_is_cut_into_the_same_pieces_from_its_lengths():
    from accord.algorithms.slotted import list_pieces
    room, flush = 1000, 100
    # small buffers share a piece until one ends past the flush mark
    assert list_pieces([30, 30, 50, 10], room, flush) == [110, 10]
    # a large buffer fills whole pieces; what is left of it goes once it ends
    assert list_pieces([2500, 40], room, flush) == [1000, 1000, 500, 40]
    # a buffer ending exactly at a piece's end, empty buffers, nothing at all
    assert list_pieces([0, 1000, 0, 0, 5], room, flush) == [1000, 5]
    assert list_pieces([0, 0], room, flush) == [] == list_pieces([], room, flush)
    lengths = list(np.random.default_rng(5).integers(0, 3000, 200))
    pieces = list_pieces(lengths, room, flush)
    assert sum(pieces) == sum(lengths) and max(pieces) <= room and min(pieces) > 0


def _root_runs_ahead(rank, world):
    """The root broadcasts 40 messages of 2.5 pieces each while rank 1 is slow to
    start: the root must wait for its readers before it writes over a piece, and
    every message must arrive as it was sent."""
    n = _room() * 5 // 2
    if rank == 1:
        time.sleep(0.3)
    got = []
    t0 = time.monotonic()
    for i in range(40):
        x = np.full(n, i, np.uint8) if rank == 0 else np.zeros(n, np.uint8)
        x[::4096] = np.arange(x[::4096].size) % 251 if rank == 0 else 0
        dist.broadcast(x, 0)
        want = np.full(n, i, np.uint8)
        want[::4096] = np.arange(want[::4096].size) % 251
        got.append(bool(np.array_equal(x, want)))
    return all(got), time.monotonic() - t0


def test_a_root_waits_for_slow_readers_and_overwrites_nothing():
    out = run_ranks(3, _root_runs_ahead, env=SMALL)
    assert all(ok for ok, _ in out), out
    # 100 pieces through a slot of two: the root cannot have finished before rank 1
    # started reading
    assert out[0][1] > 0.25, out


def _reader_dies(rank, world):
    n = _room() * 4
    x = np.ones(n, np.uint8)
    dist.barrier()
    if rank == 2:
        os._exit(3)                 # no goodbye: a crash as far as the peers can tell
    return timed(lambda: [dist.broadcast(x, 0) for _ in range(20)])


def test_a_reader_that_dies_fails_the_writer_waiting_for_it():
    out = run_ranks(3, _reader_dies, env=SMALL, timeout=30, expect_fail=True)
    assert out[2][0] == "died"
    kind, (err, msg, took) = out[0]
    assert kind == "ok" and err == "PeerLost", out[0]
    assert "rank 2" in msg and "died" in msg and "broadcast" in msg, msg
    assert took < 8, took


def _reader_elsewhere(rank, world):
    n = _room() * 4
    x = np.ones(n, np.uint8)
    dist.barrier()
    if rank == 0:
        return timed(lambda: [dist.broadcast(x, 0, timeout=2) for _ in range(5)])
    if rank == 2:
        time.sleep(4)               # never takes part: stuck elsewhere
        return "slept", "", 0
    for _ in range(5):
        dist.broadcast(x, 0)
    return "ok", "", 0


def test_a_writer_waiting_for_a_reader_times_out_naming_it():
    out = run_ranks(3, _reader_elsewhere, env=SMALL, timeout=20, expect_fail=True)
    kind, (err, msg, took) = out[0]
    assert kind == "ok" and err == "CommTimeout", out[0]
    assert "rank 2" in msg and "shared slot" in msg and "broadcast" in msg, msg
    assert 1.5 < took < 6, took


def _reader_calls_something_else(rank, world):
    """The root broadcasts well ahead of its readers; rank 2 calls an all_reduce
    instead. The root, waiting for its slot, meets rank 2's stamps (a Desync naming
    both calls) instead of waiting for the deadline, and aborts the group."""
    n = _room() * 4
    dist.barrier()
    if rank == 2:
        return timed(lambda: dist.all_reduce(np.ones(n, np.uint8)))
    return timed(lambda: [dist.broadcast(np.ones(n, np.uint8), 0) for _ in range(10)])


def test_a_writer_waiting_for_its_slot_finds_a_rank_in_another_call():
    out = run_ranks(3, _reader_calls_something_else, env={**SMALL, "ACCORD_TIMEOUT": "30"},
                    timeout=30, expect_fail=True)
    for rank in range(3):
        kind, (err, msg, took) = out[rank]
        assert kind == "ok" and err == "Desync", out[rank]
        assert "broadcast #1" in msg and "rank 2 called all_reduce #1" in msg, msg
        assert took < 8, took


def _reader_revokes(rank, world):
    """Rank 2 breaks the group on purpose (as shrink does) while the root waits for
    it to read: the root hears why, from rank 2, at once."""
    n = _room() * 4
    dist.barrier()
    if rank == 2:
        time.sleep(0.3)
        dist.world.default_group().revoke(dist.PeerLost("rank 2 leaves this group"))
        return "revoked", "", 0
    return timed(lambda: [dist.broadcast(np.ones(n, np.uint8), 0) for _ in range(10)])


def test_a_writer_waiting_for_its_slot_hears_an_abort():
    out = run_ranks(3, _reader_revokes, env={**SMALL, "ACCORD_TIMEOUT": "30"}, timeout=30,
                    expect_fail=True)
    kind, (err, msg, took) = out[0]
    assert kind == "ok" and err == "PeerLost", out[0]
    assert "rank 2 leaves this group" in msg and "[reported by rank 2" in msg, msg
    assert took < 5, took


def _tiny_block(rank, world):
    """Rank 0 gives 1 byte (then nothing), the others 200 KiB, 300 times: rank 0's tiny
    pieces must not pile up in its memory of pieces to protect."""
    from accord.transport import slots
    sizes = [1] + [200 << 10] * (world - 1)
    for k in range(300):
        if k == 150:
            sizes[0] = 0
        out = [np.zeros(n, np.uint8) for n in sizes]
        dist.all_gather(out, np.full(sizes[rank], rank + k % 7, np.uint8))
        assert all((o == r + k % 7).all() for r, o in enumerate(out)), k
    return len(dist.world.default_group().transport.slots._live), slots._LIVE_MAX


def test_tiny_pieces_do_not_pile_up():
    for kept, most in run_ranks(3, _tiny_block, env=SMALL):
        assert kept <= most + 1, (kept, most)


def _sizes_differ(rank, world):
    # the same total on every rank, cut differently: only the pieces show it
    sizes = [300_000, 200_000, 250_000] if rank != 1 else [200_000, 300_000, 250_000]
    out = [np.zeros(s, np.uint8) for s in sizes]
    try:
        dist.all_gather(out, np.ones(sizes[rank], np.uint8))
    except dist.Desync as e:
        return "Desync", str(e)
    return "ok", ""


def test_blocks_cut_differently_are_a_desync_before_a_byte_is_copied():
    out = run_ranks(3, _sizes_differ, env=SMALL, timeout=30, expect_fail=True)
    kinds = [o[1][0] if o[0] == "ok" else o[0] for o in out]
    assert "Desync" in kinds, out
    for kind, payload in out:
        if kind == "ok" and payload[0] == "Desync":
            assert "shared slot" in payload[1] and "expects" in payload[1], payload[1]


def _choices(rank, world):
    from harness import spy_algorithms
    with spy_algorithms("broadcast") as b_ran, spy_algorithms("all_gather") as g_ran:
        for n in (64 << 10, 512 << 10, 1 << 20):
            x = np.zeros(n, np.uint8)
            dist.broadcast(x, 0)
            dist.all_gather([np.zeros(n, np.uint8) for _ in range(world)], x)
    return b_ran, g_ran


def test_the_default_choice_takes_the_slots_for_large_messages_only():
    for world in (2, 3):
        b_ran, g_ran = run_ranks(world, _choices, env={"ACCORD_TRANSPORT": "shm"})[0]
        if world == 2:
            assert "slotted" not in b_ran + g_ran        # no slots at two ranks
        else:
            # three ranks: a broadcast from 1 MiB, an all-gather of blocks from 512 KiB
            assert b_ran == ["tree", "chain", "slotted"], b_ran
            assert g_ran[0] != "slotted" and g_ran[1:] == ["slotted", "slotted"], g_ran


def test_a_writer_woken_by_an_abort_says_why_even_if_the_aborter_left_too():
    # In-process ranks (threads): rank 2 never reads rank 0's pieces. It has left
    # (its departed flag) by the time its abort wakes rank 0, whose liveness check
    # is due: rank 0 must report the abort's reason, not only that rank 2 left.
    import threading

    from accord.transport import shm
    from accord.transport.wire import Stamp
    with shm_in_threads("slots-abort", 3, arena_bytes=8 << 20, cma_min=0) as (t0, _, t2):
        s = t0.slots
        stamp = Stamp(2, 1, 0, 0, 0, 4 * s.room, "uint8")
        for _ in range(2):                          # fill the slot for rank 2
            s.claim([2], s.room, stamp, time.monotonic() + 5)
        got = []

        def writer():
            try:
                s.claim([2], s.room, stamp, time.monotonic() + 10)
                got.append(None)
            except Exception as e:
                got.append(e)
        w = threading.Thread(target=writer)
        w.start()
        time.sleep(0.1)                             # rank 0 sleeps on its doorbell
        t0._last_check = 0.0                        # its liveness check is due when it wakes
        t2.q[(t2.rank_offset(2) + shm._R_DEPARTED) // 8] = 1
        t2.abort(dist.PeerLost("rank 2 gives up"))
        w.join(10)
        assert not w.is_alive()
        assert isinstance(got[0], dist.PeerLost), got
        assert "rank 2 gives up" in str(got[0]) and "[reported by rank 2]" in str(got[0]), got
