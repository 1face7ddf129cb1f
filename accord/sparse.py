"""all_reduce of sparse COO torch tensors, as gloo does it.

Every rank's coalesced indices and values are gathered (uneven all_gather: each
rank holds its own number of non-zeros), concatenated, summed by coalescing,
and written into the caller's tensor in place. SUM only, as in gloo.
"""
import sys

from .reduceops import ReduceOp


def is_sparse(obj) -> bool:
    """True for a torch tensor in a sparse layout (COO or compressed)."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(obj, torch.Tensor):
        return False
    return obj.layout is not torch.strided


def all_reduce_sparse(tensor, op, group, timeout, all_gather):
    """Sum a sparse COO tensor over member group `group`, in place.

    Three collectives on the group, made with all_gather (accord's, which takes
    uneven sizes): the non-zero counts, then the indices and the values. Raises
    ValueError for an op other than SUM or a sparse layout other than COO.
    """
    torch = sys.modules["torch"]
    if tensor.layout is not torch.sparse_coo:
        raise ValueError(f"tensor: all_reduce of {tensor.layout} tensors is not supported "
                         f"(sparse COO tensors are)")
    if op is not ReduceOp.SUM:
        raise ValueError(f"op: sparse tensors are all-reduced with SUM only (as gloo), "
                         f"got {op.name}")
    mine = tensor.detach().coalesce()
    idx = mine.indices().t().contiguous()           # nnz x sparse_dim
    val = mine.values().contiguous()                 # nnz x dense dims
    size = group.size
    counts = [torch.empty(1, dtype=torch.int64) for _ in range(size)]
    all_gather(counts, torch.tensor([idx.shape[0]], dtype=torch.int64), group=group,
                   timeout=timeout)
    counts = [int(c) for c in counts]
    idxs = [torch.empty((n, idx.shape[1]), dtype=idx.dtype) for n in counts]
    vals = [torch.empty((n,) + tuple(val.shape[1:]), dtype=val.dtype) for n in counts]
    all_gather(idxs, idx, group=group, timeout=timeout)
    all_gather(vals, val, group=group, timeout=timeout)
    total = torch.sparse_coo_tensor(torch.cat(idxs).t(), torch.cat(vals), mine.shape,
                                    check_invariants=False).coalesce()
    with torch.no_grad():
        tensor.copy_(total)
