"""ACCORD_DEBUG=DETAIL: agree on every argument's shape and dtype, log tensor summaries.

Before each collective, the ranks of the group exchange a full signature of
the call (operation, root, reduce op, dtype and shape of every tensor
argument, call site) in one extra all-to-all round, and raise the same
`Desync`, listing every rank's signature, on every rank when they disagree.
Then each rank logs one line per tensor argument before and after the call
(shape, dtype, min/max/mean, NaN/Inf counts, a CRC32 of the bytes), and
warns when a source tensor holds NaN/Inf or looks never written (all zeros,
or the denormal/huge values typical of memory from `empty`).

This is the seed article's "print every rank's tensor before and after the
broadcast", one environment variable away. It costs a round trip and a pass
over the data per call: for debugging, not for production.
"""
import json
import zlib

import numpy as np

from ..buffers import as_buf
from ..errors import Desync
from ..transport.wire import OP_CODES, OP_NAMES, Stamp
from .recorder import log

SIG_BYTES = 4096

# api function -> (source arguments, output arguments): the names of its tensor
# arguments, as the call hands them to wrap()
_ARGS = {
    "broadcast": (("tensor",), ("tensor",)),
    "all_gather": (("tensor",), ("tensor_list",)),
    "all_gather_into_tensor": (("input_tensor",), ("output_tensor",)),
    "gather": (("tensor",), ("gather_list",)),
    "scatter": (("scatter_list",), ("tensor",)),
    "reduce": (("tensor",), ("tensor",)),
    "all_reduce": (("tensor",), ("tensor",)),
    "reduce_scatter": (("input_list",), ("output",)),
    "reduce_scatter_tensor": (("input",), ("output",)),
    "all_to_all": (("input_tensor_list",), ("output_tensor_list",)),
    "all_to_all_single": (("input",), ("output",)),
    "barrier": ((), ()),
}
# sources that only the root provides
_ROOT_SOURCES = {"broadcast", "scatter"}
# calls whose first tensor must have the same shape on every rank
_SAME_SHAPE = {"broadcast", "all_reduce", "reduce", "all_gather_into_tensor",
               "reduce_scatter_tensor"}


def _arrays(value):
    """A tensor argument as numpy arrays ([] for None, one per element of a list)."""
    if value is None:
        return []
    items = value if isinstance(value, (list, tuple)) else [value]
    out = []
    for i, t in enumerate(items):
        try:
            b = as_buf(t, "arg", writable=False)
            arr = b.arr.reshape(b.shape) if b.arr.size == int(np.prod(b.shape)) else b.arr
            out.append((b.dtype_name, arr))
        except Exception:
            out.append((type(t).__name__, None))
    return out


def _shapes(value):
    return [[dtype, list(a.shape) if a is not None else None] for dtype, a in _arrays(value)]


def summary(dtype, a):
    """'float32[4] min=0 max=1 mean=0.5 nan=0 inf=0 crc=0x…' for one tensor."""
    if a is None:
        return f"{dtype} (not an array)"
    head = f"{dtype}{list(a.shape)}"
    if a.size == 0:
        return head + " (empty)"
    crc = zlib.crc32(np.ascontiguousarray(a).view(np.uint8).reshape(-1))
    if dtype == "bfloat16":
        return head + f" crc=0x{crc:08x}"
    if a.dtype.kind in "fc":
        finite = np.isfinite(a)
        nan = int(np.isnan(a).sum())
        inf = int(a.size - finite.sum() - nan)
        vals = a[finite]
        if vals.size:
            if a.dtype.kind == "c":
                vals = np.abs(vals)
            stats = f"min={vals.min():.6g} max={vals.max():.6g} mean={vals.mean():.6g}"
        else:
            stats = "no finite values"
        return head + f" {stats} nan={nan} inf={inf} crc=0x{crc:08x}"
    if a.dtype.kind in "biu":
        return head + (f" min={a.min()} max={a.max()} mean={a.mean(dtype=np.float64):.6g} "
                       f"crc=0x{crc:08x}")
    return head + f" crc=0x{crc:08x}"


def suspicious(dtype, a):
    """Why a source tensor looks wrong (NaN/Inf, never written), or None."""
    if a is None or a.size == 0 or dtype == "bfloat16":
        return None
    if a.dtype.kind in "fc":
        nan = int(np.isnan(a).sum())
        inf = int(a.size - np.isfinite(a).sum() - nan)
        if nan or inf:
            return f"holds {nan} NaN and {inf} Inf values"
        mag = np.abs(a)
        if not mag.any():
            return "is all zeros: was it ever written?"
        tiny = np.finfo(a.dtype).tiny
        if ((mag > 0) & (mag < tiny)).any() or (mag > 1e30).any():
            return ("holds denormal or huge values, typical of uninitialised memory "
                    "(np.empty / torch.empty): was it ever written?")
        return None
    if a.dtype.kind in "biu" and a.size > 1 and not a.any():
        return "is all zeros: was it ever written?"
    return None


def wrap(group, call, stamp, body):
    """body(c) preceded by the signature check and summaries, followed by summaries.

    call: (name, root, tensors) from the api function that makes the call: its
    name (a key of _ARGS), its root as a rank of the group (-1: none) and its
    tensor arguments by name. None for calls that are not the api's own (the
    phases of a hierarchical call, broadcast_state's buckets): body runs as is.
    """
    if call is None:
        return body
    fname, root, args = call
    sources, outputs = _ARGS[fname]
    is_root = root == group.rank
    me = group.global_rank
    call = f"{fname} #{stamp.seq}" + (f" at {stamp.where}" if stamp.where else "")
    sig = {"rank": me, "op": fname, "root": group.ranks[root] if root is not None and root >= 0
           else -1, "redop": int(stamp.redop), "dtype": stamp.dtype_name, "where": stamp.where,
           "args": {name: _shapes(args.get(name)) for name in dict.fromkeys(sources + outputs)}}

    def run(c):
        if c is not None:
            _agree(c, group, stamp, sig, fname)
        for name in dict.fromkeys(sources + outputs):
            arrays = _arrays(args.get(name))
            for i, (dtype, a) in enumerate(arrays):
                label = name if len(arrays) == 1 and not isinstance(args.get(name), (list, tuple)) \
                    else f"{name}[{i}]"
                log.info("rank %d %s before: %s %s", me, call, label, summary(dtype, a))
                if name in sources and (fname not in _ROOT_SOURCES or is_root):
                    why = suspicious(dtype, a)
                    if why:
                        log.warning("rank %d %s: source %s %s", me, call, label, why)
        result = body(c)
        for name in outputs:
            arrays = _arrays(args.get(name))
            for i, (dtype, a) in enumerate(arrays):
                label = name if len(arrays) == 1 and not isinstance(args.get(name), (list, tuple)) \
                    else f"{name}[{i}]"
                log.info("rank %d %s after: %s %s", me, call, label, summary(dtype, a))
        return result
    return run


def _agree(c, group, stamp, sig, fname):
    blob = json.dumps(sig).encode()[:SIG_BYTES].ljust(SIG_BYTES)
    mine = np.frombuffer(blob, np.uint8).copy()
    peers = [p for p in range(c.size) if p != c.rank]
    theirs = {p: np.empty(SIG_BYTES, np.uint8) for p in peers}
    check = Stamp(OP_CODES["signature"], stamp.seq, -1, 0, 0, SIG_BYTES, "", site=stamp.site,
                  where=stamp.where)
    # a round of its own, stamped "signature": a peer that skipped the check is a Desync
    c.restamped(check).exchange([(p, memoryview(mine)) for p in peers],
                                [(p, memoryview(theirs[p])) for p in peers])
    sigs = {c.rank: sig}
    for p, arr in theirs.items():
        try:
            sigs[p] = json.loads(arr.tobytes().rstrip())
        except ValueError:
            sigs[p] = {"rank": group.ranks[p], "op": "?", "args": {}}
    ref = _key(sigs[0], fname)
    if all(_key(s, fname) == ref for s in sigs.values()):
        return
    lines = [f"rank {group.global_rank}: {OP_NAMES[stamp.op]} #{stamp.seq} (group "
             f"{group.name!r}): ACCORD_DEBUG=DETAIL: ranks disagree on the call's signature:"]
    for r in range(c.size):
        lines.append("  " + _describe_sig(sigs[r]))
    raise Desync("\n".join(lines))


def _key(sig, fname):
    args = sig.get("args", {})
    first = None
    if sig.get("op") in _SAME_SHAPE:
        for shapes in args.values():
            if shapes:
                first = shapes[0]
                break
    return (sig.get("op"), sig.get("root"), sig.get("redop"), sig.get("dtype"), str(first))


def _describe_sig(s):
    args = ", ".join(f"{name}=" + ("None" if not shapes else
                                   " ".join(f"{d}{sh}" for d, sh in shapes))
                     for name, shapes in s.get("args", {}).items())
    root = f", root rank {s['root']}" if s.get("root", -1) >= 0 else ""
    redop = f", op {s['redop']}" if s.get("redop") else ""
    where = f" at {s['where']}" if s.get("where") else ""
    return f"rank {s.get('rank')}: {s.get('op')}({args}{root}{redop}){where}"
