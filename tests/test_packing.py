"""Buckets that pack many small tensors into one array and back (coalescing, broadcast_state)."""
import numpy as np
import pytest

from accord._packing import plan_buckets

pytestmark = pytest.mark.timeout(30)


def _views():
    def base():
        return np.arange(60, dtype=np.float32).reshape(6, 10)
    return [
        np.arange(5, dtype=np.float32),              # 1-d
        base()[:, ::3],                              # strided 2-d
        base().T[2:5],                               # a transposed slice
        np.full((), 7.0, np.float32),                # 0-d
        np.arange(8, dtype=np.float32).reshape(2, 2, 2),
        np.empty(0, np.float32),                     # dropped: no bytes
        np.arange(3, dtype=np.float64),              # another dtype: its own bucket
    ]


def test_plan_groups_by_dtype_and_cuts_at_bucket_bytes():
    views = _views()
    items = [(v, v.dtype.num, i) for i, v in enumerate(views)]
    buckets = plan_buckets(items, 1 << 20)
    assert [b.user for b in buckets] == [[0, 1, 2, 3, 4], [6]]
    assert buckets[0].offsets == [0, 5, 29, 47, 48] and buckets[0].numel == 56
    # 100 bytes a bucket (20, 96, 72, 4 and 32 bytes of float32): a new one when the next
    # view would overflow the open one
    assert [b.user for b in plan_buckets(items, 100)] == [[0], [1], [2, 3], [4], [6]]
    # 72: a view of that size or more goes alone, as it is; the open bucket stays open
    cut = plan_buckets(items, 72)
    assert [b.user for b in cut] == [[0, 3, 4], [1], [2], [6]]
    assert [b.direct for b in cut] == [False, True, True, False]
    assert cut[0].offsets == [0, 5, 6]


def test_pack_then_unpack_restores_every_view_in_c_order():
    views = _views()
    b = plan_buckets([(v, v.dtype.num, None) for v in views[:5]], 1 << 20)[0]
    b.allocate()
    b.pack()
    assert b.array.tolist() == np.concatenate([np.ravel(v) for v in views[:5]]).tolist()
    want = [v.copy() for v in views[:5]]
    for v in views[:5]:
        v[...] = -1
    b.unpack()
    for v, w in zip(views[:5], want):
        assert v.shape == w.shape and v.tolist() == w.tolist()
    # only some views
    for v in views[:5]:
        v[...] = -1
    b.unpack([1, 3])
    assert views[1].tolist() == want[1].tolist() and views[3].tolist() == want[3].tolist()
    assert (views[0] == -1).all() and (views[2] == -1).all()


def test_small_tensor_views_are_kept_by_bytes_not_by_count():
    torch = pytest.importorskip("torch")
    from accord import buffers
    from accord._packing import tensor_view
    # a model's 300 small tensors visited in a loop: every one found on the second pass
    small = [torch.full((256,), float(i)) for i in range(300)]
    for t in small:
        tensor_view(t, "t")
    assert all(buffers.cached_torch_buf(t) is not None for t in small)
    assert all(tensor_view(t, "t")[0][0] == i for i, t in enumerate(small))
    # what is kept stays under the byte bound: 300 tensors of 64 KiB are 18.75 MiB
    big = [torch.zeros(16 << 10) for _ in range(300)]
    for t in big:
        tensor_view(t, "t")
    kept = sum(e[5].nbytes for e in buffers._TORCH_BUFS.values())
    assert kept == buffers._cached_bytes <= buffers._CACHE_TOTAL
    assert buffers.cached_torch_buf(big[-1]) is not None
    assert buffers.cached_torch_buf(big[0]) is None         # the oldest went first
    # a tensor resized in place is not taken for its old self
    t = big[-1]
    t.resize_(10)
    assert buffers.cached_torch_buf(t) is None and tensor_view(t, "t")[0].shape == (10,)
