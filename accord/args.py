"""Argument checks shared by the collectives (api.py) and the calls built on them
(objects, state, coalescing): ranks, tensor lists, dtypes and sizes.

Each raises the ValueError or TypeError the caller's docstring promises, naming
the argument, before any byte moves.
"""
import numpy as np

from .buffers import as_buf


def root_rank(g, glob, local, arg):
    """The rank within g of a peer given as a global rank (arg) or as group_<arg>
    (local); src/dst default to the group's first member."""
    if local is None and glob.__class__ is int and glob in g.ranks:
        return g.ranks.index(glob)           # the usual case: a member's global rank
    if local is not None:
        if glob is not None:
            raise ValueError(f"pass either {arg} or group_{arg}, not both")
        if not 0 <= local < g.size:
            raise ValueError(f"group_{arg}={local} outside group {g.name!r} of size {g.size}")
        return local
    if glob is None:
        glob = g.ranks[0] if arg in ("src", "dst") else None
    if isinstance(glob, bool) or not isinstance(glob, (int, np.integer)):
        raise TypeError(f"{arg}: expected an int rank, got {type(glob).__name__}")
    return g.group_rank_of(int(glob), arg)


def buf_list(g, value, arg, writable=True):
    """One Buf per rank of g from a list of tensors."""
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{arg}: expected a list of {g.size} tensors, got {type(value).__name__}")
    if len(value) != g.size:
        raise ValueError(f"{arg}: expected {g.size} tensors (one per rank of group {g.name!r}), "
                         f"got {len(value)}")
    try:
        return [as_buf(t, arg, writable) for t in value]
    except (TypeError, ValueError):
        # an entry's error names it: the names are made only then (an f-string per
        # entry per call is most of a small all_gather's argument checks)
        for i, t in enumerate(value):
            as_buf(t, f"{arg}[{i}]", writable)
        raise


def same_dtype(ref, bufs, arg, ref_arg):
    """Every buf of arg has ref's dtype."""
    code = ref.dtype_code
    for b in bufs:
        if b.dtype_code != code:
            i = bufs.index(b)
            raise TypeError(f"{arg}[{i}]: dtype {b.dtype_name} differs from {ref_arg}'s "
                            f"{ref.dtype_name}")


def same_size(a, b, arg, ref_arg, index=None):
    """a holds as many bytes as b; a is arg[index] when index is given (named so
    only in the error: formatting it on every call cost more than the check)."""
    if a.nbytes != b.nbytes:
        if index is not None:
            arg = f"{arg}[{index}]"
        raise ValueError(f"{arg}: holds {a.numel} elements ({a.describe()}) but {ref_arg} holds "
                         f"{b.numel} ({b.describe()})")


def optional_list(g, value, arg, is_root, root_arg, writable=True):
    """A list required on the root and None or empty elsewhere (None there)."""
    if is_root:
        if value is None:
            raise ValueError(f"{arg}: required on the {root_arg} rank")
        return buf_list(g, value, arg, writable)
    if value is not None and len(value):
        raise ValueError(f"{arg}: must be None or empty on ranks other than {root_arg} "
                         f"(this is rank {g.global_rank})")
    return None


def check_len(g, value, arg):
    """value: a list or tuple of one item per rank of g (returned as is)."""
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{arg}: expected a list of {g.size} tensors, got {type(value).__name__}")
    if len(value) != g.size:
        raise ValueError(f"{arg}: expected {g.size} tensors (one per rank of group {g.name!r}), "
                         f"got {len(value)}")
    return value


def split_counts(buf, sizes, n, arg, tensor_arg):
    """Element counts of n blocks of buf along its first dimension: rows per rank
    from sizes, or equal splits when sizes is empty."""
    return row_counts(buf.shape, buf.numel, sizes, n, arg, tensor_arg)


def row_counts(shape, numel, sizes, n, arg, tensor_arg):
    """split_counts for a tensor of that shape and element count."""
    rows = shape[0] if shape else 1
    per_row = numel // rows if rows else 0
    if sizes is None or len(sizes) == 0:
        if rows % n:
            raise ValueError(f"{tensor_arg}: first dimension {rows} is not divisible by the group "
                             f"size {n}; pass {arg}")
        return [rows // n * per_row] * n
    sizes = [int(s) for s in sizes]
    if len(sizes) != n or any(s < 0 for s in sizes):
        raise ValueError(f"{arg}: expected {n} non-negative sizes, got {sizes}")
    if sum(sizes) != rows:
        raise ValueError(f"{arg}: sizes {sizes} sum to {sum(sizes)}, but {tensor_arg} has "
                         f"{rows} rows")
    return [s * per_row for s in sizes]
