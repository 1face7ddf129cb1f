"""The free functions of the public API: the collectives and point to point.

Each one checks its arguments on the calling rank before any byte moves,
turns tensors into `Buf`s, and hands a closure to its group, which runs it in
issue order. Ranks are global in arguments (src, dst) and group-local inside.
"""
from __future__ import annotations

import operator
from typing import Any, Callable, List, Optional, Sequence

import numpy as np

from . import hierarchy, plans, sparse
from .algorithms import rooted, split
from .algorithms.table import choose
from .args import (buf_list, check_len, optional_list, root_rank, same_dtype, same_size,
                   split_counts)
from .buffers import already_in_place, as_buf, message_view, plain_view
from .group import ProcessGroup
from .localcopy import copy_into
from .options import to_seconds
from .reduceops import ReduceOp, as_reduce_op, check_op
from .transport.p2p import Pending
from .work import Work, completed_work
from .world import not_member, resolve_group
from ._types import Tensor, Timeout


def _finish(*bufs):
    for b in bufs:
        if b._writeback is not None:     # only a non-contiguous original needs it
            b._writeback()


# -- collectives ----------------------------------------------------------------

def broadcast(tensor: Tensor, src: Optional[int] = None, group: Optional[ProcessGroup] = None,
              async_op: bool = False, group_src: Optional[int] = None,
              timeout: Timeout = None) -> Optional[Work]:
    """The collective behind `accord.broadcast` (which also queues it inside a
    `coalescing()` block): see `accord.broadcast`.
    """
    g = resolve_group(group)
    lane = g.lane
    if lane is not None and not async_op and lane.broadcast(tensor, src, group_src, timeout):
        return None
    if not g.is_member:
        return not_member(g, "broadcast")
    root = root_rank(g, src, group_src, "src")
    buf = as_buf(tensor, "tensor", writable=g.rank != root)   # the root only reads
    body, stamp = plans.broadcast_run(g, buf, root, finish=True)
    if g.hier is not None and hierarchy.phased(g, "broadcast", buf.nbytes):
        run = g.hier.broadcast(buf, root)

        def body(c):
            run(c)
            buf.finish()
    return plans.run(g, "broadcast", body, async_op, timeout, stamp,
                     ("broadcast", root, {"tensor": tensor}))


def _all_gather_blocks(g, opname, blocks, mine, outs, async_op, timeout, call):
    total = sum([b.nbytes for b in blocks])
    forced = g.options.algorithms

    mine_block = blocks[g.rank]
    in_place = already_in_place(mine.arr, mine_block)

    def own():
        # an input that is this rank's block of the output (all_gather_into_tensor in
        # place, as sharded training does) is already where it belongs
        if not in_place:
            copy_into(mine_block, mine.arr)

    if g.hier is not None and hierarchy.phased(g, "all_gather", total):
        run = g.hier.all_gather(blocks, mine, own)

        def body(c):
            run(c)
            _finish(*outs)
        return plans.run(g, opname, body, async_op, timeout, plans.stamp(mine, count=total),
                         call)

    def body(c):
        if c is None:
            own()
        else:
            # direct: peers copy this rank's block straight from the input while it
            # copies its own
            choose("all_gather", total, c, forced)(c, blocks, mine.arr, own)
        _finish(*outs)
    return plans.run(g, opname, body, async_op, timeout, plans.stamp(mine, count=total), call)


def all_gather(tensor_list: Sequence[Tensor], tensor: Tensor,
               group: Optional[ProcessGroup] = None, async_op: bool = False,
               timeout: Timeout = None) -> Optional[Work]:
    """Every rank's `tensor`, in every rank's `tensor_list`.

    Args:
        tensor_list: one output per rank of the group, in group-rank order;
            `tensor_list[r]` receives rank r's tensor. Unlike torch, sizes may
            differ from rank to rank (uneven all_gather): each entry only has to
            match the size of the rank it receives from.
        tensor: this rank's input (only read; it may be read-only).
        group: the group to run on (default: the default group). On a rank that is
            not a member the call does nothing and returns None, as in torch.
        async_op: return a `Work` at once instead of waiting for the result.
        timeout: seconds (or a timedelta) for this call only; default: the group's
            timeout (`ACCORD_TIMEOUT`, 1800 s). Not in torch.

    Returns:
        None, or a `Work` with `async_op=True` (None on a non-member).

    Raises:
        ValueError, TypeError: bad arguments, raised on the calling rank before any
            byte moves.
        accord.Desync: the ranks of the group called different collectives, or the
            same one with different roots, dtypes or sizes (raised on every rank
            involved).
        accord.PeerLost: a rank of the group died or left.
        accord.CommTimeout: the call did not complete within its timeout.
        accord.GroupClosed: the group was destroyed or broken by an earlier error.
    """
    g = resolve_group(group)
    lane = g.lane
    if lane is not None and not async_op and lane.all_gather(tensor_list, tensor, timeout):
        return None
    if not g.is_member:
        return not_member(g, "all_gather")
    mine = as_buf(tensor, "tensor", writable=False)
    outs = buf_list(g, tensor_list, "tensor_list")
    same_dtype(mine, outs, "tensor_list", "tensor")
    same_size(outs[g.rank], mine, "tensor_list", "tensor", g.rank)
    blocks = [o.arr for o in outs]
    return _all_gather_blocks(g, "all_gather", blocks, mine, outs, async_op, timeout,
                              ("all_gather", -1, {"tensor": tensor, "tensor_list": tensor_list}))


def all_gather_into_tensor(output_tensor: Tensor, input_tensor: Tensor,
                           group: Optional[ProcessGroup] = None, async_op: bool = False,
                           timeout: Timeout = None) -> Optional[Work]:
    """Every rank's `input_tensor`, concatenated in rank order into `output_tensor`.

    Args:
        output_tensor: group size x input_tensor's elements, same dtype. An input
            that already is this rank's block of the output (in place) is not
            copied.
        input_tensor: this rank's block (only read).
        group: the group to run on (default: the default group). On a rank that is
            not a member the call does nothing and returns None, as in torch.
        async_op: return a `Work` at once instead of waiting for the result.
        timeout: seconds (or a timedelta) for this call only; default: the group's
            timeout (`ACCORD_TIMEOUT`, 1800 s). Not in torch.

    Returns:
        None, or a `Work` with `async_op=True` (None on a non-member).

    Raises:
        ValueError, TypeError: bad arguments, raised on the calling rank before any
            byte moves.
        accord.Desync: the ranks of the group called different collectives, or the
            same one with different roots, dtypes or sizes (raised on every rank
            involved).
        accord.PeerLost: a rank of the group died or left.
        accord.CommTimeout: the call did not complete within its timeout.
        accord.GroupClosed: the group was destroyed or broken by an earlier error.
    """
    g = resolve_group(group)
    lane = g.lane
    if lane is not None and not async_op and \
            lane.all_gather_into_tensor(output_tensor, input_tensor, timeout):
        return None
    if not g.is_member:
        return not_member(g, "all_gather_into_tensor")
    mine = as_buf(input_tensor, "input_tensor", writable=False)
    out = as_buf(output_tensor, "output_tensor")
    same_dtype(mine, [out], "output_tensor", "input_tensor")
    if out.numel != mine.numel * g.size:
        raise ValueError(f"output_tensor: must hold group size ({g.size}) x input_tensor's "
                         f"{mine.numel} elements, holds {out.numel} ({out.describe()})")
    blocks = split(out.arr, [mine.numel] * g.size)
    return _all_gather_blocks(g, "all_gather", blocks, mine, [out], async_op, timeout,
                              ("all_gather_into_tensor", -1, {"input_tensor": input_tensor,
                                                              "output_tensor": output_tensor}))


def gather(tensor: Tensor, gather_list: Optional[Sequence[Tensor]] = None,
           dst: Optional[int] = None, group: Optional[ProcessGroup] = None,
           async_op: bool = False, group_dst: Optional[int] = None,
           timeout: Timeout = None) -> Optional[Work]:
    """Every rank's `tensor`, into the root's `gather_list`.

    Args:
        tensor: this rank's input (only read).
        gather_list: on the root, one output per rank, in group-rank order; sizes
            may differ from rank to rank (not in torch). None or empty elsewhere.
        dst: the root's global rank (default 0).
        group: the group to run on (default: the default group). On a rank that is
            not a member the call does nothing and returns None, as in torch.
        async_op: return a `Work` at once instead of waiting for the result.
        group_dst: the root as a rank of `group` instead of dst (as torch 2.6+).
        timeout: seconds (or a timedelta) for this call only; default: the group's
            timeout (`ACCORD_TIMEOUT`, 1800 s). Not in torch.

    Returns:
        None, or a `Work` with `async_op=True` (None on a non-member).

    Raises:
        ValueError, TypeError: bad arguments, raised on the calling rank before any
            byte moves.
        accord.Desync: the ranks of the group called different collectives, or the
            same one with different roots, dtypes or sizes (raised on every rank
            involved).
        accord.PeerLost: a rank of the group died or left.
        accord.CommTimeout: the call did not complete within its timeout.
        accord.GroupClosed: the group was destroyed or broken by an earlier error.
    """
    g = resolve_group(group)
    lane = g.lane
    if lane is not None and not async_op and \
            lane.gather(tensor, gather_list, dst, group_dst, timeout):
        return None
    if not g.is_member:
        return not_member(g, "gather")
    root = root_rank(g, dst, group_dst, "dst")
    mine = as_buf(tensor, "tensor", writable=False)
    outs = optional_list(g, gather_list, "gather_list", g.rank == root, "dst")
    if outs is not None:
        same_dtype(mine, outs, "gather_list", "tensor")
        same_size(outs[root], mine, "gather_list", "tensor", root)

    def body(c):
        if outs is not None:
            copy_into(outs[root].arr, mine.arr)
        if c is not None:
            rooted.gather(c, mine.arr, outs and [o.arr for o in outs], root)
        if outs is not None:
            _finish(*outs)
    return plans.run(g, "gather", body, async_op, timeout, plans.stamp(mine, root),
                     ("gather", root, {"tensor": tensor, "gather_list": gather_list}))


def scatter(tensor: Tensor, scatter_list: Optional[Sequence[Tensor]] = None,
            src: Optional[int] = None, group: Optional[ProcessGroup] = None,
            async_op: bool = False, group_src: Optional[int] = None,
            timeout: Timeout = None) -> Optional[Work]:
    """The root's `scatter_list[r]` into rank r's `tensor`.

    Args:
        tensor: this rank's output.
        scatter_list: on the root, one input per rank in group-rank order (only
            read); sizes may differ from rank to rank (uneven shards, not in
            torch): entry r must match rank r's tensor. None or empty elsewhere.
        src: the root's global rank (default 0).
        group: the group to run on (default: the default group). On a rank that is
            not a member the call does nothing and returns None, as in torch.
        async_op: return a `Work` at once instead of waiting for the result.
        group_src: the root as a rank of `group` instead of src.
        timeout: seconds (or a timedelta) for this call only; default: the group's
            timeout (`ACCORD_TIMEOUT`, 1800 s). Not in torch.

    Returns:
        None, or a `Work` with `async_op=True` (None on a non-member).

    Raises:
        ValueError, TypeError: bad arguments, raised on the calling rank before any
            byte moves.
        accord.Desync: the ranks of the group called different collectives, or the
            same one with different roots, dtypes or sizes (raised on every rank
            involved).
        accord.PeerLost: a rank of the group died or left.
        accord.CommTimeout: the call did not complete within its timeout.
        accord.GroupClosed: the group was destroyed or broken by an earlier error.
    """
    g = resolve_group(group)
    lane = g.lane
    if lane is not None and not async_op and \
            lane.scatter(tensor, scatter_list, src, group_src, timeout):
        return None
    if not g.is_member:
        return not_member(g, "scatter")
    root = root_rank(g, src, group_src, "src")
    mine = as_buf(tensor, "tensor")
    # the root only reads its scatter_list: read-only sources are fine
    ins = optional_list(g, scatter_list, "scatter_list", g.rank == root, "src", writable=False)
    if ins is not None:
        same_dtype(mine, ins, "scatter_list", "tensor")
        same_size(ins[root], mine, "scatter_list", "tensor", root)

    def body(c):
        own = None
        if ins is not None:
            def own():
                copy_into(mine.arr, ins[root].arr)
        if c is not None:
            # the root copies its own block while the peers take theirs (shared memory)
            rooted.scatter(c, mine.arr, ins and [b.arr for b in ins], root, own)
        elif own is not None:
            own()
        mine.finish()
    return plans.run(g, "scatter", body, async_op, timeout, plans.stamp(mine, root),
                     ("scatter", root, {"scatter_list": scatter_list, "tensor": tensor}))


def reduce(tensor: Tensor, dst: Optional[int] = None, op: ReduceOp = ReduceOp.SUM,
           group: Optional[ProcessGroup] = None, async_op: bool = False,
           group_dst: Optional[int] = None, timeout: Timeout = None) -> Optional[Work]:
    """The collective behind `accord.reduce`: see `accord.reduce`."""
    g = resolve_group(group)
    lane = g.lane
    if lane is not None and not async_op and lane.reduce(tensor, op, dst, group_dst, timeout):
        return None
    if not g.is_member:
        return not_member(g, "reduce")
    root = root_rank(g, dst, group_dst, "dst")
    op = as_reduce_op(op)
    buf = as_buf(tensor, "tensor")
    check_op(op, buf)
    run, stamp = plans.reduce_run(g, buf, root, op)

    def body(c):
        run(c)
        if g.rank == root:
            buf.finish()
    return plans.run(g, "reduce", body, async_op, timeout, stamp,
                     ("reduce", root, {"tensor": tensor}))


def all_reduce(tensor: Tensor, op: ReduceOp = ReduceOp.SUM, group: Optional[ProcessGroup] = None,
               async_op: bool = False, timeout: Timeout = None) -> Optional[Work]:
    """The collective behind `accord.all_reduce`: see `accord.all_reduce`."""
    g = resolve_group(group)
    lane = g.lane
    if lane is not None and not async_op and lane.all_reduce(tensor, op, timeout):
        return None
    if not g.is_member:
        return not_member(g, "all_reduce")
    op = as_reduce_op(op)
    try:
        buf = as_buf(tensor, "tensor")
    except TypeError:
        if not sparse.is_sparse(tensor):
            raise
        # three collectives on this group, run now (a completed Work if async)
        sparse.all_reduce_sparse(tensor, op, g, timeout, all_gather)
        return completed_work("all_reduce") if async_op else None
    check_op(op, buf)
    body, stamp = plans.all_reduce_run(g, buf, op, finish=True)
    if g.hier is not None and hierarchy.phased(g, "all_reduce", buf.nbytes):
        run = g.hier.all_reduce(buf, op)

        def body(c):
            run(c)
            buf.finish()
    return plans.run(g, "all_reduce", body, async_op, timeout, stamp,
                     ("all_reduce", -1, {"tensor": tensor}))


def _reduce_scatter_blocks(g, output, ins, fill, op, async_op, timeout, total_bytes, call,
                           whole=None):
    """ins: this rank's input blocks, one per rank (only read); whole: the input as one
    array, where ins are its consecutive blocks; fill() -> the input as one new array,
    which the hierarchical phases reduce in place."""
    out = output
    hier = hierarchy.phased(g, "reduce_scatter", total_bytes)

    def body(c):
        if hier:
            work = fill()
            blocks = split(work, [b.size for b in ins])
            # in phases; the result arrives averaged where op is AVG
            g.hier.reduce_scatter(work, blocks, out, op)(c)
            copy_into(out.arr, blocks[g.rank])
            out.finish()
            return
        plans.reduce_scatter_moves(c, g, ins, out.arr, op, out.is_bf16, whole)
        out.finish()
    return plans.run(g, "reduce_scatter", body, async_op, timeout,
                     plans.stamp(out, -1, op, total_bytes), call)


def reduce_scatter(output: Tensor, input_list: Sequence[Tensor], op: ReduceOp = ReduceOp.SUM,
                   group: Optional[ProcessGroup] = None, async_op: bool = False,
                   timeout: Timeout = None) -> Optional[Work]:
    """Reduce `input_list[r]` over every rank into rank r's `output`.

    Args:
        output: this rank's result.
        input_list: one input per rank, in group-rank order (only read); entry r
            must match rank r's output, and sizes may differ from rank to rank.
        op: a `ReduceOp` (AVG included).
        group: the group to run on (default: the default group). On a rank that is
            not a member the call does nothing and returns None, as in torch.
        async_op: return a `Work` at once instead of waiting for the result.
        timeout: seconds (or a timedelta) for this call only; default: the group's
            timeout (`ACCORD_TIMEOUT`, 1800 s). Not in torch.

    Returns:
        None, or a `Work` with `async_op=True` (None on a non-member).

    Raises:
        ValueError, TypeError: bad arguments, raised on the calling rank before any
            byte moves.
        accord.Desync: the ranks of the group called different collectives, or the
            same one with different roots, dtypes or sizes (raised on every rank
            involved).
        accord.PeerLost: a rank of the group died or left.
        accord.CommTimeout: the call did not complete within its timeout.
        accord.GroupClosed: the group was destroyed or broken by an earlier error.
    """
    g = resolve_group(group)
    if not g.is_member:
        return not_member(g, "reduce_scatter")
    op = as_reduce_op(op)
    out = as_buf(output, "output")
    ins = [as_buf(t, f"input_list[{i}]", writable=False) for i, t in
           enumerate(check_len(g, input_list, "input_list"))]
    same_dtype(out, ins, "input_list", "output")
    same_size(ins[g.rank], out, "input_list", "output", g.rank)
    check_op(op, out)
    return _reduce_scatter_blocks(g, out, [b.arr for b in ins],
                                  lambda: np.concatenate([b.arr for b in ins]),
                                  op, async_op, timeout, sum(b.nbytes for b in ins),
                                  ("reduce_scatter", -1, {"input_list": input_list,
                                                          "output": output}))


def reduce_scatter_tensor(output: Tensor, input: Tensor, op: ReduceOp = ReduceOp.SUM,
                          group: Optional[ProcessGroup] = None, async_op: bool = False,
                          timeout: Timeout = None) -> Optional[Work]:
    """Reduce `input` (group size blocks of output's size) over every rank; block r to rank r.

    Args:
        output: this rank's result block.
        input: group size x output's elements, same dtype (only read).
        op: a `ReduceOp`.
        group: the group to run on (default: the default group). On a rank that is
            not a member the call does nothing and returns None, as in torch.
        async_op: return a `Work` at once instead of waiting for the result.
        timeout: seconds (or a timedelta) for this call only; default: the group's
            timeout (`ACCORD_TIMEOUT`, 1800 s). Not in torch.

    Returns:
        None, or a `Work` with `async_op=True` (None on a non-member).

    Raises:
        ValueError, TypeError: bad arguments, raised on the calling rank before any
            byte moves.
        accord.Desync: the ranks of the group called different collectives, or the
            same one with different roots, dtypes or sizes (raised on every rank
            involved).
        accord.PeerLost: a rank of the group died or left.
        accord.CommTimeout: the call did not complete within its timeout.
        accord.GroupClosed: the group was destroyed or broken by an earlier error.
    """
    g = resolve_group(group)
    lane = g.lane
    if lane is not None and not async_op and \
            lane.reduce_scatter_tensor(output, input, op, timeout):
        return None
    if not g.is_member:
        return not_member(g, "reduce_scatter_tensor")
    op = as_reduce_op(op)
    out = as_buf(output, "output")
    inp = as_buf(input, "input", writable=False)
    same_dtype(out, [inp], "input", "output")
    if inp.numel != out.numel * g.size:
        raise ValueError(f"input: must hold group size ({g.size}) x output's {out.numel} "
                         f"elements, holds {inp.numel} ({inp.describe()})")
    check_op(op, out)
    return _reduce_scatter_blocks(g, out, split(inp.arr, [out.numel] * g.size),
                                  lambda: inp.arr.copy(), op,
                                  async_op, timeout, inp.nbytes,
                                  ("reduce_scatter_tensor", -1, {"input": input,
                                                                 "output": output}),
                                  inp.arr)


def _all_to_all_blocks(g, ref, outs, out_blocks, in_blocks, async_op, timeout, call):
    def body(c):
        def own():
            copy_into(out_blocks[g.rank], in_blocks[g.rank])
        if c is None:
            own()
        else:
            rooted.all_to_all(c, out_blocks, in_blocks, own)
        _finish(*outs)
    return plans.run(g, "all_to_all", body, async_op, timeout, plans.stamp(ref), call)


def all_to_all(output_tensor_list: Sequence[Tensor], input_tensor_list: Sequence[Tensor],
               group: Optional[ProcessGroup] = None, async_op: bool = False,
               timeout: Timeout = None) -> Optional[Work]:
    """Rank i's `input_tensor_list[j]` into rank j's `output_tensor_list[i]`.

    Args:
        output_tensor_list: one output per rank, in group-rank order.
        input_tensor_list: one input per rank (only read); sizes may differ.
        group: the group to run on (default: the default group). On a rank that is
            not a member the call does nothing and returns None, as in torch.
        async_op: return a `Work` at once instead of waiting for the result.
        timeout: seconds (or a timedelta) for this call only; default: the group's
            timeout (`ACCORD_TIMEOUT`, 1800 s). Not in torch.

    Returns:
        None, or a `Work` with `async_op=True` (None on a non-member).

    Raises:
        ValueError, TypeError: bad arguments, raised on the calling rank before any
            byte moves.
        accord.Desync: the ranks of the group called different collectives, or the
            same one with different roots, dtypes or sizes (raised on every rank
            involved).
        accord.PeerLost: a rank of the group died or left.
        accord.CommTimeout: the call did not complete within its timeout.
        accord.GroupClosed: the group was destroyed or broken by an earlier error.
    """
    g = resolve_group(group)
    lane = g.lane
    if lane is not None and not async_op and \
            lane.all_to_all(output_tensor_list, input_tensor_list, timeout):
        return None
    if not g.is_member:
        return not_member(g, "all_to_all")
    outs = buf_list(g, output_tensor_list, "output_tensor_list")
    ins = [as_buf(t, f"input_tensor_list[{i}]", writable=False) for i, t in
           enumerate(check_len(g, input_tensor_list, "input_tensor_list"))]
    same_dtype(outs[0], outs, "output_tensor_list", "output_tensor_list[0]")
    same_dtype(outs[0], ins, "input_tensor_list", "output_tensor_list[0]")
    same_size(outs[g.rank], ins[g.rank], f"output_tensor_list[{g.rank}]",
               f"input_tensor_list[{g.rank}]")
    return _all_to_all_blocks(g, outs[0], outs, [o.arr for o in outs], [b.arr for b in ins],
                              async_op, timeout,
                              ("all_to_all", -1, {"input_tensor_list": input_tensor_list,
                                                  "output_tensor_list": output_tensor_list}))


def all_to_all_single(output: Tensor, input: Tensor,
                      output_split_sizes: Optional[Sequence[int]] = None,
                      input_split_sizes: Optional[Sequence[int]] = None,
                      group: Optional[ProcessGroup] = None, async_op: bool = False,
                      timeout: Timeout = None) -> Optional[Work]:
    """all_to_all over single tensors split along their first dimension, as in torch.

    Args:
        output: the received rows, rank 0's first.
        input: the rows to send, rank 0's first (only read).
        output_split_sizes: rows received from each rank (default: equal splits).
        input_split_sizes: rows sent to each rank (default: equal splits).
        group: the group to run on (default: the default group). On a rank that is
            not a member the call does nothing and returns None, as in torch.
        async_op: return a `Work` at once instead of waiting for the result.
        timeout: seconds (or a timedelta) for this call only; default: the group's
            timeout (`ACCORD_TIMEOUT`, 1800 s). Not in torch.

    Returns:
        None, or a `Work` with `async_op=True` (None on a non-member).

    Raises:
        ValueError, TypeError: bad arguments, raised on the calling rank before any
            byte moves.
        accord.Desync: the ranks of the group called different collectives, or the
            same one with different roots, dtypes or sizes (raised on every rank
            involved).
        accord.PeerLost: a rank of the group died or left.
        accord.CommTimeout: the call did not complete within its timeout.
        accord.GroupClosed: the group was destroyed or broken by an earlier error.
    """
    g = resolve_group(group)
    lane = g.lane
    if lane is not None and not async_op and \
            lane.all_to_all_single(output, input, output_split_sizes, input_split_sizes, timeout):
        return None
    if not g.is_member:
        return not_member(g, "all_to_all_single")
    out = as_buf(output, "output")
    inp = as_buf(input, "input", writable=False)
    same_dtype(out, [inp], "input", "output")
    oc = split_counts(out, output_split_sizes, g.size, "output_split_sizes", "output")
    ic = split_counts(inp, input_split_sizes, g.size, "input_split_sizes", "input")
    if oc[g.rank] != ic[g.rank]:
        raise ValueError(f"output_split_sizes/input_split_sizes: this rank keeps {ic[g.rank]} "
                         f"elements of its input but expects {oc[g.rank]} in its output")
    return _all_to_all_blocks(g, out, [out], split(out.arr, oc), split(inp.arr, ic), async_op,
                              timeout, ("all_to_all_single", -1, {"input": input,
                                                                  "output": output}))


def barrier(group: Optional[ProcessGroup] = None, async_op: bool = False,
            device_ids: Any = None, timeout: Timeout = None) -> Optional[Work]:
    """Wait until every rank of the group has entered the barrier.

    Args:
        group: the group to run on (default: the default group). On a rank that is
            not a member the call does nothing and returns None, as in torch.
        async_op: return a `Work` at once instead of waiting for the result.
        device_ids: accepted for torch compatibility and ignored.
        timeout: seconds (or a timedelta) for this call only; default: the group's
            timeout (`ACCORD_TIMEOUT`, 1800 s). Not in torch.

    Returns:
        None, or a `Work` with `async_op=True` (None on a non-member).

    Raises:
        ValueError, TypeError: bad arguments, raised on the calling rank before any
            byte moves.
        accord.Desync: the ranks of the group called different collectives, or the
            same one with different roots, dtypes or sizes (raised on every rank
            involved).
        accord.PeerLost: a rank of the group died or left.
        accord.CommTimeout: the call did not complete within its timeout.
        accord.GroupClosed: the group was destroyed or broken by an earlier error.
    """
    g = resolve_group(group)
    lane = g.lane
    if lane is not None and not async_op and lane.barrier(timeout):
        return None
    if not g.is_member:
        return not_member(g, "barrier")
    body, stamp = plans.barrier_run(g)
    return plans.run(g, "barrier", body, async_op, timeout, stamp, ("barrier", -1, {}))


# -- point to point ---------------------------------------------------------------

def _p2p(g, peer_global, peer_local, arg):
    peer = root_rank(g, peer_global, peer_local, arg)
    if peer == g.rank:
        raise ValueError(f"{arg}={g.ranks[peer]} is this rank itself")
    return peer


_TAG_MAX = (1 << 63) - 1


def _tag(tag):
    if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)):
        raise TypeError(f"tag: expected an int, got {type(tag).__name__}")
    if not -_TAG_MAX - 1 <= tag <= _TAG_MAX:
        raise ValueError(f"tag: {tag} does not fit in 64 bits")
    return int(tag)


def _p2p_args(g, is_send, tensor, peer_global, peer_local, tag, timeout):
    """One point-to-point call's arguments, checked: (group rank of the peer or None
    for any source, tag, the bytes, what finishes a receive, timeout in seconds)."""
    arg = "dst" if is_send else "src"
    if tag.__class__ is not int or not -_TAG_MAX - 1 <= tag <= _TAG_MAX:
        tag = _tag(tag)
    if timeout is not None:
        timeout = to_seconds(timeout, "timeout")
    if peer_global is None and peer_local is None:
        if is_send:
            raise ValueError("dst: required")
        if g.size == 1:
            raise ValueError("recv with no src: this group has no other rank to receive from")
        peer = None
    else:
        peer = _p2p(g, peer_global, peer_local, arg)
    view, finish = message_view(tensor, "tensor", writable=not is_send)
    return peer, tag, view, None if is_send else finish, timeout


def _quick_args(g, is_send, tensor, peer, tag):
    """The usual point-to-point call's arguments, checked in one place: (the peer's
    group rank, the message's bytes) for another member's global rank, an int tag and
    a contiguous numpy array of a supported dtype (writable to receive); None where
    anything differs, for _p2p_args to check the long way (and raise its errors)."""
    if tensor.__class__ is not np.ndarray or tag.__class__ is not int or \
            peer.__class__ is not int or not -_TAG_MAX - 1 <= tag <= _TAG_MAX:
        return None
    view = plain_view(tensor, not is_send)
    if view is None:
        return None
    ranks = g.ranks
    if peer not in ranks:
        return None
    peer = ranks.index(peer)
    if peer == g.rank:
        return None
    return peer, view


def _p2p_quick(tensor, peer, group, tag, is_send):
    """isend/irecv's usual call (_quick_args, with the group's timeout): its Work, or
    None where anything differs (_p2p_call then takes it)."""
    g = resolve_group(group)
    if not g.is_member:
        return None
    args = _quick_args(g, is_send, tensor, peer, tag)
    if args is None:
        return None
    return _p2p_work(g, "isend" if is_send else "irecv", is_send, args[0], tag, args[1],
                     None, None)


def _p2p_call(tensor, peer, group, tag, group_peer, timeout, is_send, async_op):
    g = resolve_group(group)
    opname = ("isend" if async_op else "send") if is_send else ("irecv" if async_op else "recv")
    if not g.is_member:
        return not_member(g, opname)
    if not async_op:
        peer, tag, view, finish, timeout = _p2p_args(g, is_send, tensor, peer, group_peer, tag,
                                                     timeout)
        return g.p2p_blocking(opname, is_send, peer, view, tag, timeout, finish)
    return _p2p_work(g, opname, is_send, *_p2p_args(g, is_send, tensor, peer, group_peer, tag,
                                                     timeout))


_pending_desc = operator.attrgetter("desc")


def _p2p_work(g, opname, is_send, peer, tag, view, finish, timeout):
    """Start a checked isend or irecv; its Work."""
    op = g.p2p_start(opname, is_send, peer, view, tag, timeout, finish)
    if op.__class__ is not Pending:
        # over already: its Work needs its description only for repr(). What makes
        # it is a tuple: a closure's cells (one per argument, the buffer's view held
        # by one) made a window of 64 isends at 64 KiB spend a tenth of its time in
        # the garbage collector
        return Work(op, (g.p2p_text, opname, is_send, peer, tag, len(view)))
    return Work(op, (_pending_desc, op), waiter=g.p2p.wait)


def send(tensor: Tensor, dst: Optional[int] = None, group: Optional[ProcessGroup] = None,
         tag: int = 0, group_dst: Optional[int] = None, timeout: Timeout = None) -> None:
    """Send tensor to rank dst (global; or group_dst within group); returns once its
    bytes are out of tensor's memory.

    That is once they are delivered or copied where the peer will find them, so a
    small message returns at once even if the peer has not posted its receive; a
    large one may wait until the peer's side takes it (MPI's standard mode). Messages
    match by (group, source, tag) and are never overtaken between one sender and one
    receiver with one tag. Unlike torch: timeout= per call.

    Raises:
        ValueError, TypeError: before anything is posted: a peer outside the group
            or this rank itself, a tag that is not an int of 64 bits, a read-only
            receive buffer.
        accord.Desync: (receives) the message is not the buffer's size; the sender
            is released and the group stays usable.
        accord.PeerLost: the peer died or left; receives from other peers go on.
        accord.CommTimeout: nothing matched within timeout (default: the group's).
        accord.GroupClosed: the group was destroyed or broken by an earlier error.
    """
    _p2p_call(tensor, dst, group, tag, group_dst, timeout, True, False)


def recv(tensor: Tensor, src: Optional[int] = None, group: Optional[ProcessGroup] = None,
         tag: int = 0, group_src: Optional[int] = None, timeout: Timeout = None) -> int:
    """Receive into tensor from rank src (None: the first message with tag from any
    rank); returns the sender's global rank. The message must be tensor's size.

    Raises:
        ValueError, TypeError: before anything is posted: a peer outside the group
            or this rank itself, a tag that is not an int of 64 bits, a read-only
            receive buffer.
        accord.Desync: (receives) the message is not the buffer's size; the sender
            is released and the group stays usable.
        accord.PeerLost: the peer died or left; receives from other peers go on.
        accord.CommTimeout: nothing matched within timeout (default: the group's).
        accord.GroupClosed: the group was destroyed or broken by an earlier error.
    """
    return _p2p_call(tensor, src, group, tag, group_src, timeout, False, False)


def isend(tensor: Tensor, dst: Optional[int] = None, group: Optional[ProcessGroup] = None,
          tag: int = 0, group_dst: Optional[int] = None, timeout: Timeout = None) -> Work:
    """Start sending tensor to dst; returns a Work (leave tensor alone until it completes).

    Any number of isend/irecv may be outstanding, per peer, tag and group, posted in
    any order relative to each other and to collectives: a posted receive never
    holds up a collective, nor a collective a send. They progress on their own
    (a thread per group), whether or not this rank is inside an accord call.

    Raises:
        ValueError, TypeError: before anything is posted: a peer outside the group
            or this rank itself, a tag that is not an int of 64 bits, a read-only
            receive buffer.
        accord.Desync: (receives) the message is not the buffer's size; the sender
            is released and the group stays usable.
        accord.PeerLost: the peer died or left; receives from other peers go on.
        accord.CommTimeout: nothing matched within timeout (default: the group's).
        accord.GroupClosed: the group was destroyed or broken by an earlier error.
    """
    if group_dst is None and timeout is None:
        w = _p2p_quick(tensor, dst, group, tag, True)
        if w is not None:
            return w
    return _p2p_call(tensor, dst, group, tag, group_dst, timeout, True, True)


def irecv(tensor: Tensor, src: Optional[int] = None, group: Optional[ProcessGroup] = None,
          tag: int = 0, group_src: Optional[int] = None, timeout: Timeout = None) -> Work:
    """Start receiving into tensor from src (None: any rank); returns a Work whose
    result() is the sender's global rank. Receives match in the order posted.

    Raises:
        ValueError, TypeError: before anything is posted: a peer outside the group
            or this rank itself, a tag that is not an int of 64 bits, a read-only
            receive buffer.
        accord.Desync: (receives) the message is not the buffer's size; the sender
            is released and the group stays usable.
        accord.PeerLost: the peer died or left; receives from other peers go on.
        accord.CommTimeout: nothing matched within timeout (default: the group's).
        accord.GroupClosed: the group was destroyed or broken by an earlier error.
    """
    if group_src is None and timeout is None:
        w = _p2p_quick(tensor, src, group, tag, False)
        if w is not None:
            return w
    return _p2p_call(tensor, src, group, tag, group_src, timeout, False, True)



class P2POp:
    """One operation for `batch_isend_irecv`, as torch.distributed.P2POp.

    Args:
        op: accord.isend or accord.irecv.
        tensor: what to send, or where to receive.
        peer: the other rank (global), or group_peer: its rank within group.
        group: the group (None: the default one); every op of a batch shares it.
        tag: an int; messages match by (group, source, tag).

    Raises:
        ValueError: op is neither accord.isend nor accord.irecv (the other
            arguments are checked when the batch is posted).
    """
    __slots__ = ("op", "tensor", "peer", "group", "tag", "group_peer")

    def __init__(self, op: Callable, tensor: Tensor, peer: Optional[int] = None,
                 group: Optional[ProcessGroup] = None, tag: int = 0,
                 group_peer: Optional[int] = None) -> None:
        if op not in (isend, irecv):
            raise ValueError(f"op: expected accord.isend or accord.irecv, got {op!r}")
        self.op, self.tensor, self.peer, self.group = op, tensor, peer, group
        self.tag, self.group_peer = tag, group_peer

    def __repr__(self):
        peer = self.peer if self.group_peer is None else f"group rank {self.group_peer}"
        return f"P2POp({self.op.__name__}, peer={peer}, tag={self.tag})"


def batch_isend_irecv(p2p_op_list: List[P2POp]) -> List[Work]:
    """Post every send and receive of the list at once; returns their Works, in order.

    As torch: every op must use the same group. The order within the list does
    not matter (receives may come before the sends they answer, as in MPI
    programs). Unlike torch: every op is checked before any is posted, so a bad
    op posts nothing; a non-member of the group gets an empty list.

    Raises:
        ValueError: an empty list, an item that is not a P2POp, ops of different
            groups, or any op's bad peer or tag (TypeError for a tag that is not
            an int); nothing is posted then.
        accord.GroupClosed: the group was destroyed or broken.
    """
    ops = list(p2p_op_list) if isinstance(p2p_op_list, (list, tuple)) else None
    if not ops or not all(isinstance(o, P2POp) for o in ops):
        raise ValueError("p2p_op_list: expected a non-empty list of accord.P2POp")
    if any(o.group is not ops[0].group for o in ops):
        raise ValueError("p2p_op_list: all ops need to use the same group")
    g = resolve_group(ops[0].group)
    if not g.is_member:
        not_member(g, "batch_isend_irecv")
        return []
    checked = []
    for o in ops:
        is_send = o.op is isend
        quick = None if o.group_peer is not None else \
            _quick_args(g, is_send, o.tensor, o.peer, o.tag)
        if quick is not None:
            checked.append((is_send, (quick[0], o.tag, quick[1], None, None)))
        else:
            checked.append((is_send, _p2p_args(g, is_send, o.tensor, o.peer, o.group_peer,
                                               o.tag, None)))
    g.check_open()
    # started in the list's order, each as isend/irecv would start it
    return [_p2p_work(g, "isend" if is_send else "irecv", is_send, *args)
            for is_send, args in checked]
