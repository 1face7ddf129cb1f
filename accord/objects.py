"""Collectives of picklable Python objects: sizes first, then the bytes.

Each is two ordinary collectives on the group (so they keep the group's
order and get every check the tensor ones get). Pickles of different sizes
travel through the uneven-size variants; nothing is padded.
"""
import pickle

import numpy as np

from . import api


def _dump(obj):
    return np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)


def _load(arr):
    return pickle.loads(arr.tobytes())


def broadcast_object_list(object_list, src=None, group=None, device=None, group_src=None,
                          timeout=None):
    g = api._group(group)
    if not g.is_member:
        return None
    if not isinstance(object_list, list):
        raise TypeError(f"object_list: expected a list, got {type(object_list).__name__}")
    root = api._root(g, src, group_src, "src")
    if g.rank == root:
        blobs = [_dump(o) for o in object_list]
        sizes = np.array([b.size for b in blobs], dtype=np.int64)
    else:
        sizes = np.zeros(len(object_list), dtype=np.int64)
    api.broadcast(sizes, group=g, group_src=root, timeout=timeout)
    data = np.concatenate(blobs) if g.rank == root and blobs else np.empty(int(sizes.sum()),
                                                                           np.uint8)
    api.broadcast(data, group=g, group_src=root, timeout=timeout)
    if g.rank != root:
        off = 0
        for i, n in enumerate(sizes.tolist()):
            object_list[i] = _load(data[off:off + n])
            off += n


def all_gather_object(object_list, obj, group=None, timeout=None):
    g = api._group(group)
    if not g.is_member:
        return None
    api._check_len(g, object_list, "object_list")
    blob = _dump(obj)
    sizes = np.zeros(g.size, dtype=np.int64)
    api.all_gather_into_tensor(sizes, np.array([blob.size], dtype=np.int64), group=g,
                               timeout=timeout)
    outs = [np.empty(int(n), np.uint8) for n in sizes]
    api.all_gather(outs, blob, group=g, timeout=timeout)
    for i, o in enumerate(outs):
        object_list[i] = _load(o)


def gather_object(obj, object_gather_list=None, dst=None, group=None, group_dst=None,
                  timeout=None):
    g = api._group(group)
    if not g.is_member:
        return None
    root = api._root(g, dst, group_dst, "dst")
    is_root = g.rank == root
    if is_root:
        api._check_len(g, object_gather_list, "object_gather_list")
    blob = _dump(obj)
    sizes = [np.zeros(1, np.int64) for _ in range(g.size)] if is_root else None
    api.gather(np.array([blob.size], dtype=np.int64), sizes, group=g, group_dst=root,
               timeout=timeout)
    outs = [np.empty(int(s[0]), np.uint8) for s in sizes] if is_root else None
    api.gather(blob, outs, group=g, group_dst=root, timeout=timeout)
    if is_root:
        for i, o in enumerate(outs):
            object_gather_list[i] = _load(o)


def scatter_object_list(scatter_object_output_list, scatter_object_input_list=None, src=None,
                        group=None, group_src=None, timeout=None):
    g = api._group(group)
    if not g.is_member:
        return None
    if not isinstance(scatter_object_output_list, list) or len(scatter_object_output_list) < 1:
        raise ValueError("scatter_object_output_list: expected a list with at least one element")
    root = api._root(g, src, group_src, "src")
    is_root = g.rank == root
    if is_root:
        api._check_len(g, scatter_object_input_list, "scatter_object_input_list")
        blobs = [_dump(o) for o in scatter_object_input_list]
        size_list = [np.array([b.size], np.int64) for b in blobs]
    size = np.zeros(1, np.int64)
    api.scatter(size, size_list if is_root else None, group=g, group_src=root, timeout=timeout)
    mine = np.empty(int(size[0]), np.uint8)
    api.scatter(mine, blobs if is_root else None, group=g, group_src=root, timeout=timeout)
    scatter_object_output_list[0] = _load(mine)
