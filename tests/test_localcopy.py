"""Copies inside one process (accord/localcopy.py) and their optional C helper (copy_core.c)."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from accord import localcopy
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(120)

helper = pytest.mark.skipif(not localcopy.built(), reason="the C helper was not built here")


@helper
@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 63, 64, 65, 1000, (1 << 20) + 3])
@pytest.mark.parametrize("shift", [0, 1, 8, 15])
def test_streamed_copy_equals_numpys_at_any_length_and_alignment(n, shift):
    rng = np.random.default_rng(n + shift)
    src_mem = rng.integers(0, 256, n + 32, dtype=np.uint8)
    dst_mem = np.zeros(n + 32, np.uint8)
    src, dst = src_mem[3:3 + n], dst_mem[shift:shift + n]
    localcopy.stream_copy(dst, src)
    assert dst.tobytes() == src.tobytes()
    assert not dst_mem[:shift].any() and not dst_mem[shift + n:].any()   # nothing outside


@helper
def test_overlapping_buffers_copy_as_memmove():
    a = np.arange(1000, dtype=np.uint8)
    want = a.copy()
    localcopy.stream_copy(a[10:], a[:-10])
    assert a[10:].tobytes() == want[:-10].tobytes() and a[:10].tobytes() == want[:10].tobytes()


@helper
def test_helper_refuses_what_it_cannot_copy():
    with pytest.raises(ValueError, match="dst holds 8 bytes, src 4"):
        localcopy.stream_copy(bytearray(8), bytes(4))
    with pytest.raises(BufferError, match="not writable"):
        localcopy.stream_copy(bytes(4), bytes(4))          # read-only dst
    with pytest.raises(ValueError, match="not C-contiguous"):
        localcopy.stream_copy(np.zeros((4, 4))[:, ::2], np.zeros(8))


def test_copy_into_streams_large_contiguous_pairs_and_copies_the_rest(monkeypatch):
    calls = []
    if localcopy.built():
        real = localcopy.stream_copy
        monkeypatch.setattr(localcopy, "stream_copy",
                            lambda d, s: (calls.append(d.nbytes), real(d, s)))
    monkeypatch.setattr(localcopy, "STREAM_MIN", 4096)
    big = np.arange(2048, dtype=np.float32)
    out = np.zeros_like(big)
    localcopy.copy_into(out, big)                    # 8 KiB, contiguous: streamed
    small = np.zeros(10, np.float32)
    localcopy.copy_into(small, big[:10])             # below STREAM_MIN: numpy
    strided = np.zeros((2048, 2), np.float32)[:, 0]
    localcopy.copy_into(strided, big)                # not contiguous: numpy
    assert (out == big).all() and (small == big[:10]).all() and (strided == big).all()
    if localcopy.built() and localcopy.helper_on():
        assert calls == [8192]
    with pytest.raises(TypeError, match="rule 'no'"):
        localcopy.copy_into(np.zeros(2048, np.float64), big)    # as np.copyto(casting="no")


def test_stream_min_is_half_the_largest_cache_at_least_4_mib(tmp_path):
    for i, size in enumerate(["32K", "1024K", "32768K"]):
        d = tmp_path / f"index{i}"
        d.mkdir()
        (d / "size").write_text(size + "\n")
    assert localcopy._cache_bytes(str(tmp_path)) == 32 << 20
    assert localcopy.stream_min(32 << 20) == 16 << 20
    assert localcopy.stream_min(2 << 20) == 4 << 20
    assert localcopy.stream_min(0) == 16 << 20                  # unknown
    assert localcopy._cache_bytes(str(tmp_path / "missing")) == 0


def test_accord_copy_helper_0_turns_streaming_off():
    code = "from accord import localcopy; print(localcopy.helper_on())"
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, ACCORD_COPY_HELPER="0"), timeout=60)
    on = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        env={k: v for k, v in os.environ.items() if k != "ACCORD_COPY_HELPER"},
                        timeout=60)
    assert off.stdout.strip() == "False"
    assert on.stdout.strip() == str(localcopy.built())


def test_built_wherever_a_c_compiler_was_found():
    """`pip install` builds the helper where it finds a C compiler (make test installs
    with the machine's gcc): a build that silently fell back would go unnoticed."""
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler on this machine: numpy's copies are expected")
    assert localcopy.built(), "a C compiler is here, yet accord/copy_core.c is not built"


def _own_blocks_streamed(rank, world):
    import accord
    from accord import localcopy as lc
    lc.STREAM_MIN = 1 << 16                          # every block below streams
    n = (1 << 18) + 5                                # 1 MiB of float32, an odd length
    x = np.arange(n, dtype=np.float32) + rank * n
    outs = [np.zeros(n, np.float32) for _ in range(world)]
    accord.all_gather(outs, x)
    whole = np.zeros(n * world, np.float32)
    accord.all_gather_into_tensor(whole, x)
    mine = np.zeros(n, np.float32)
    accord.scatter(mine, [np.full(n, r + 0.5, np.float32) for r in range(world)]
                   if rank == 0 else None, src=0)
    want = np.arange(n * world, dtype=np.float32)
    return (all((o == want[r * n:(r + 1) * n]).all() for r, o in enumerate(outs)),
            bool((whole == want).all()), bool((mine == rank + 0.5).all()))


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_collectives_own_blocks_through_the_helper(transport):
    assert run_ranks(2, _own_blocks_streamed, env={"ACCORD_TRANSPORT": transport}) == \
        [(True, True, True)] * 2
