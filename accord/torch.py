"""The "accord" backend of torch.distributed.

    import torch.distributed as dist
    dist.init_process_group("accord")      # every torch.distributed call runs on accord

An installed accord registers the backend at `import torch`, through its
"torch.backends" entry point (_accord_autoload.py, which imports this module
only when the first accord group is made). Importing this module registers
it too (CPU device, torch's extended creator API), for environments where
torch's entry points are off (TORCH_DEVICE_BACKEND_AUTOLOAD=0) or accord is
on the path without being installed. torch then calls `create_group` once per group on every member rank,
with the group's own store (already prefixed by torch), and uses the
`AccordProcessGroup` it returns as the group itself: torch's functions
(dist.all_reduce, ...), DDP's reducer, the object collectives and
new_group/new_subgroups all end up in the methods below, which hand the
tensors to accord's collectives on a private accord group.

Ranks and roots arrive group-local (torch translates global ones first).
Synchronous calls (opts.asyncOp false) run on the caller's thread, as a
direct accord call does; asynchronous ones, and every C++ caller (DDP), go
through the group's worker thread and return an `AccordWork`. A synchronous
call that comes from torch's own functions (dist.all_reduce, ...) returns
None, which torch takes as "already complete" (it would only wait() on a
Work and drop it); any other caller still gets a completed `AccordWork`.
Point to point: torch's blocking dist.send/dist.recv run as accord's blocking
send/recv on the caller's thread; an isend/irecv starts there too, and whoever
waits on its Work moves its messages (the group's engine thread finishes what
nobody waits on).

Errors: accord's own types (CommTimeout, PeerLost, Desync, GroupClosed) reach
the caller unchanged, from the call itself (synchronous) or from
`Work.wait()` / `Work.get_future().wait()` (asynchronous).

Tensors on an accelerator (CUDA, ...) are copied to host memory, reduced
there and copied back, with a one-time warning: correct but slow. Call
`.cpu()` yourself, or use NCCL for device tensors.

This is the only accord module that imports torch at its top; the other,
rendezvous/torchelastic.py, imports it inside torchrun's agent-store path.
"""
import atexit
import datetime
import inspect
import os
import sys
import threading
import time
import warnings
import weakref

import torch
import torch.distributed as dist

from . import api, world
from .errors import CommTimeout
from .options import to_seconds
from .reduceops import ReduceOp
from .work import Outcome
from .rendezvous.torchelastic import agent_store   # in __all__: its old home
from .rendezvous.torchelastic import attempt_store

__all__ = ["AccordProcessGroup", "AccordWork", "agent_store", "BACKEND_NAME", "create_group",
           "default_group", "monitored_barrier", "shrink"]

BACKEND_NAME = "accord"

_live_groups = weakref.WeakSet()
_staging_warned = False

_C = torch._C._distributed_c10d          # the option classes (AllgatherOptions is only here)
_getframe = sys._getframe
# torch's own Python functions (dist.broadcast, ...): for a synchronous call they only
# wait() on the Work a backend returns, and accept None instead ("the backend has
# sync'ed"); they get None, which spares a pybind-built Work per call
_C10D = dist.distributed_c10d.__dict__


# -- work ----------------------------------------------------------------------

class AccordWork(dist.Work):
    """torch's Work over one or more accord operations of one torch call.

    parts: the accord Works of the call's operations (None for one that ran
    synchronously), or None for a call that is already complete.
    `after` runs once every part is done (copies back staged or coalesced
    tensors) before anyone waiting on this Work sees it complete.
    outputs: the future's value, or a function that makes it (called at most once,
    when someone asks).
    """

    __slots__ = ("_outputs", "_desc", "_after", "_source", "_tfut", "_lock", "_done", "_exc",
                 "_finished", "_left", "_record", "_movers")

    def __init__(self, parts, outputs, desc, after=None, source_rank=-1):
        dist.Work.__init__(self)
        self._outputs = outputs
        self._desc = desc
        self._source = source_rank
        self._tfut = None
        self._done = None           # an accord Outcome (a light future), None once completed inline
        self._exc = None
        self._record = None         # a profiler event to end on completion (_recorded)
        self._movers = None         # parts whose wait() moves their messages (point to point)
        if parts is None or (len(parts) == 1 and parts[0] is None):
            # synchronous: already done on the caller's thread (the fast path)
            self._finished = True
            self._lock = None
            if after is not None:
                after()
            return
        # a part over already (an isend written into its ring at once) adds nothing to wait
        # for: a call whose parts are all over is complete, as a synchronous one
        parts = [p for p in parts if p is not None and not p.is_success()]
        self._finished = not parts
        self._after = after
        self._lock = threading.Lock()
        if not parts:
            if after is not None:
                after()
            return
        self._done = Outcome()
        self._left = len(parts)
        self._movers = [p for p in parts if p._progresses()] or None
        for p in parts:
            p._on_done(self._part_done)

    def _part_done(self, f):
        exc = f.exception()
        with self._lock:
            if exc is not None and self._exc is None:
                self._exc = exc
            self._left -= 1
            if self._left:
                return
        if self._exc is None and self._after is not None:
            try:
                self._after()
            except BaseException as e:       # delivered through wait()
                self._exc = e
        with self._lock:
            self._finished = True
            tfut = self._tfut
            rec, self._record = self._record, None
        if rec is not None:
            rec, began = rec
            if threading.get_ident() == began:
                # settled by the thread that began the event, waiting on a point-to-point
                # part itself: torch counts only an event ended elsewhere as asynchronous
                _end_elsewhere(rec)
            else:
                rec.__exit__(None, None, None)       # on this (the worker's) thread
        if self._exc is None:
            self._done.set_result(self._value())
        else:
            self._done.set_exception(self._exc)
        if tfut is not None:
            # not on this thread (the group's worker): the future's callbacks may issue
            # more operations on this group and wait for them (PowerSGD's hook does)
            _settler().submit(self._settle, tfut)

    def _attach_record(self, rec):
        """End profiler event rec when this Work completes; False if it already has."""
        if self._lock is None:
            return False
        with self._lock:
            if self._finished:
                return False
            self._record = (rec, threading.get_ident())
            return True

    def _value(self):
        out = self._outputs
        if callable(out):
            out = self._outputs = out()
        return out

    def _settle(self, tfut):
        if self._exc is not None:
            tfut.set_exception(self._exc)
        else:
            tfut.set_result(self._value())

    # -- what torch and users call -----------------------------------------
    def wait(self, timeout=None):
        """Block until done; re-raise the operation's error. Returns True.

        timeout: seconds or timedelta; None or 0 (torch's kNoTimeout) waits
        for the operation's own deadline.
        """
        if self._done is None:
            return True
        if isinstance(timeout, datetime.timedelta):
            timeout = timeout.total_seconds()
        if timeout is not None and timeout <= 0:
            timeout = None
        if self._movers is not None:
            self._move(timeout)
        if not self._done.wait(timeout):
            raise CommTimeout(f"Work.wait: Timed out after {timeout:g} s waiting for "
                              f"{self._desc} (it keeps running; wait again or let the "
                              f"group's timeout end it)")
        self._done.result()
        return True

    def _move(self, timeout):
        """Wait on the point-to-point parts through their own wait(), which moves their
        messages on this thread: the group's engine thread would otherwise finish them
        and hand the result over (a thread switch per message; a blocking ping-pong of
        irecv().wait() took 3x the time of accord's recv). Their errors, a timeout's
        included, reach the caller through this Work's future, as any part's."""
        end = None if timeout is None else time.monotonic() + timeout
        for p in self._movers:
            if p.is_completed():
                continue
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                return
            try:
                p.wait(left)
            except Exception:       # (not KeyboardInterrupt and the like: those go up)
                return

    def is_completed(self):
        return self._done is None or self._done.done()

    def is_success(self):
        return self.is_completed() and self._exc is None

    def exception(self):
        return self._exc if self.is_completed() else None

    def get_future(self):
        """A torch.futures.Future whose value is the call's output tensors."""
        if self._lock is None:
            if self._tfut is None:
                self._tfut = torch.futures.Future()
                self._settle(self._tfut)
            return self._tfut
        with self._lock:
            if self._tfut is None:
                self._tfut = torch.futures.Future()
                if self._finished:
                    self._settle(self._tfut)
            return self._tfut

    def result(self):
        self.wait()
        return self._value()

    def _source_rank(self):
        self.wait()
        return self._source() if callable(self._source) else self._source

    def source_rank(self):
        return self._source_rank()

    def synchronize(self):
        pass

    def __repr__(self):
        state = "done" if self.is_completed() else "pending"
        return f"<accord.torch.AccordWork {self._desc} {state}>"


_profiler = torch.autograd.profiler     # its _is_profiler_enabled: one module read per call
_RecordFunctionFast = torch._C._profiler._RecordFunctionFast
class _TLSDefault(threading.local):
    recording = False       # inside _recorded on this thread: record once, not again


_tls = _TLSDefault()

_ender = (None, None)       # (pid, queue of the thread that ends profiler events)


def _end_elsewhere(rec):
    """End profiler event rec on another thread (one long-lived thread, so torch's
    profiler sees an asynchronous event, as gloo's), and wait until it has."""
    global _ender
    pid, q = _ender
    if pid != os.getpid():
        import queue
        q = queue.SimpleQueue()

        def serve():
            while True:
                r, done = q.get()
                try:
                    r.__exit__(None, None, None)
                finally:
                    done.set()
        threading.Thread(target=serve, name="accord-profiler-events", daemon=True).start()
        _ender = (os.getpid(), q)
    done = threading.Event()
    q.put((rec, done))
    done.wait()


_settle_pool = (None, None)       # (pid, executor): threads do not survive a fork


def _settler():
    """The threads that complete torch futures of asynchronous operations.

    A torch Future runs its callbacks (`then`, DDP's reducer, comm hooks) on the
    thread that sets its value. The group's worker thread must not be that
    thread: a callback that starts another operation and waits for it would
    wait for the worker it is running on. A pool, because such a callback holds
    its thread until the inner operation's future, which needs another, is set;
    it grows only when every thread is busy.
    """
    global _settle_pool
    pid, pool = _settle_pool
    if pid != os.getpid():
        import concurrent.futures
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=64,
                                                     thread_name_prefix="accord-torch-future")
        _settle_pool = (os.getpid(), pool)
    return pool


# -- tensors ---------------------------------------------------------------------

def _warn_staging(t):
    global _staging_warned
    if not _staging_warned:
        _staging_warned = True
        warnings.warn(f"accord: tensors on {t.device} are copied to host memory for every "
                      f"collective and back (correct but slow); keep them on the CPU or use "
                      f"NCCL for device tensors", RuntimeWarning, stacklevel=4)


class _Stage:
    """Host views of the call's tensors, and the copies back to devices."""
    __slots__ = ("back",)

    def __init__(self):
        self.back = []

    def inp(self, t):
        if t.is_cpu:
            return t
        _warn_staging(t)
        return t.detach().cpu()

    def out(self, t):
        if t.is_cpu:
            return t
        _warn_staging(t)
        host = t.detach().cpu()
        self.back.append((t, host))
        return host

    def after(self, then=None):
        back = self.back
        if not back and then is None:
            return None

        def run():
            if then is not None:
                then()
            with torch.no_grad():
                for dev, host in back:
                    dev.copy_(host)
        return run


def _all_cpu(tensors):
    for t in tensors:
        if not t.is_cpu:
            return False
    return True


def _finish(w, outputs, desc, st=None, then=None, source=-1):
    """The Work of a torch call that ran one accord operation (w: its Work, or None
    when it ran synchronously); st: its _Stage, or None when every tensor is on
    the CPU. None for torch's own Python functions once the call is complete."""
    after = then if st is None else st.after(then)
    if w is None:
        if after is not None:
            after()
        # the caller's caller: dist.broadcast etc. discard (wait on) a synchronous Work
        try:
            if _getframe(2).f_globals is _C10D:
                return None
        except ValueError:          # called from C++ on a thread without Python frames
            pass
        return AccordWork(None, outputs, desc, None, source)
    return AccordWork([w], outputs, desc, after, source)


def _code(fn):
    return getattr(inspect.unwrap(fn), "__code__", None)


_ISEND, _SEND = _code(dist.distributed_c10d.isend), _code(dist.distributed_c10d.send)
_IRECV, _RECV = _code(dist.distributed_c10d.irecv), _code(dist.distributed_c10d.recv)


def _blocking_caller(inner, outer):
    """Whether the caller of a group's send or recv (the caller of this function's
    caller) is torch's isend (irecv) called by its blocking send (recv), which waits
    on the Work at once."""
    try:
        frame = _getframe(2)
    except ValueError:              # called from C++ on a thread without Python frames
        return False
    if frame.f_code is not inner or inner is None:
        return False
    up = frame.f_back
    return up is not None and up.f_code is outer


def _one(tensors, what):
    if len(tensors) != 1:
        raise ValueError(f"{what}: accord takes exactly one tensor per call, got "
                         f"{len(tensors)}")
    return tensors[0]


_OPS = {}
_AllreduceOptions = _C.AllreduceOptions
_PREMUL_SUM = int(dist.ReduceOp.RedOpType.PREMUL_SUM.value)


def _reduce_op(rop):
    """torch ReduceOp -> (accord ReduceOp, premul factor or None)."""
    # torch's ReduceOp and RedOpType hash to the op's number: a cheap key for the
    # common ops (reading .op.value through pybind costs more than the rest of the call)
    h = hash(rop)
    op = _OPS.get(h)
    if op is not None and h != _PREMUL_SUM:
        return op, None
    kind = getattr(rop, "op", rop)
    value = kind.value
    op = _OPS.get(value)
    if op is None:
        if value == _PREMUL_SUM:
            return ReduceOp.SUM, rop.factor
        try:
            op = _OPS[value] = ReduceOp[kind.name]
        except KeyError:
            raise ValueError(f"op: ReduceOp.{kind.name} is not supported by accord") from None
    return op, None


def _premul(t, factor):
    with torch.no_grad():
        if isinstance(factor, torch.Tensor):
            factor = factor.to(device=t.device)
        t.mul_(factor)


def _timeout(opts):
    t = opts.timeout.total_seconds()
    return t if t > 0 else None


# -- the process group ---------------------------------------------------------------

def _mark_cpu(pg):
    """Declare the CPU device type on a Python group, with no backend object behind it.

    torch asks a group which device types it serves (`group._device_types`): sharded
    state dicts (FSDP's ShardedTensor, through _get_pg_default_device), async
    checkpoint saves and a few more refuse a group that names none. A real torch
    Backend cannot be made from Python in torch 2.13 (`torch._C._distributed_c10d.
    Backend` has no constructor a subclass can call), so the device type is
    registered alone; `group._get_backend(cpu)` still raises, as before.
    """
    try:
        pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.CUSTOM, None)
    except (AttributeError, TypeError, RuntimeError):     # a torch without the hook
        pass


class AccordProcessGroup(dist.ProcessGroup):
    """A torch.distributed ProcessGroup whose every operation runs on accord."""

    def __init__(self, group, rank, size):
        super().__init__(rank, size)
        self._g = group
        self._rank = rank
        self._size = size
        self._group_name = ""
        self._group_desc = ""
        _mark_cpu(self)
        _live_groups.add(self)

    @property
    def accord_group(self):
        """The accord ProcessGroup underneath (accord's functions accept it)."""
        return self._g

    # identity: torch's Python functions ask group.rank() (scatter, gather, ...); the
    # inherited methods answer the same through pybind in ~1 us, these in ~0.05 us
    def rank(self):
        return self._rank

    def size(self):
        return self._size

    def getBackendName(self):
        return BACKEND_NAME

    def setGroupName(self, name):
        self._group_name = name

    def getGroupName(self):
        return self._group_name

    def setGroupDesc(self, desc):
        self._group_desc = desc

    def getGroupDesc(self):
        return self._group_desc

    def __repr__(self):
        return (f"<accord.torch.AccordProcessGroup {self._group_name!r} rank={self.rank()} "
                f"size={self.size()}>")

    # helpers
    def _recorded(self, name, inputs, method, args):
        """Run method(self, *args) as one profiler event "accord:<name>" with the
        inputs' shapes, as gloo's backend records its calls: begun on the calling
        thread and ended on another (torch counts such events as asynchronous), before
        the call's Work completes. Only while torch's profiler is on."""
        rec = _RecordFunctionFast(f"{BACKEND_NAME}:{name}", list(inputs))
        rec.__enter__()
        _tls.recording = True
        try:
            work = method(self, *args)
        except BaseException:
            _end_elsewhere(rec)
            raise
        finally:
            _tls.recording = False
        if not (isinstance(work, AccordWork) and work._attach_record(rec)):
            _end_elsewhere(rec)
        return work

    def _work(self, parts, outputs, desc, stage=None, then=None, source=-1):
        after = stage.after(then) if stage is not None else then
        for p in parts:
            if p is not None:
                return AccordWork(parts, outputs, desc, after, source)
        try:
            torch_caller = _getframe(2).f_globals is _C10D
        except ValueError:          # called from C++ on a thread without Python frames
            torch_caller = False
        if not torch_caller:
            return AccordWork(parts, outputs, desc, after, source)
        # all synchronous and done: torch's own functions need no Work (see _finish)
        if after is not None:
            after()
        return None

    # -- collectives -----------------------------------------------------------
    # The common case (CPU tensors) takes no _Stage; a synchronous call issued by
    # torch's own functions returns no Work (_finish).

    def broadcast(self, tensors, opts=None):
        if _profiler._is_profiler_enabled and not _tls.recording:
            return self._recorded("broadcast", tensors, AccordProcessGroup.broadcast, (tensors, opts))
        if opts is None:
            opts = _C.BroadcastOptions()
        t = tensors[0] if len(tensors) == 1 else _one(tensors, "broadcast")
        st = None if t.is_cpu else _Stage()
        w = api.broadcast(t if st is None else st.out(t), group=self._g,
                          group_src=opts.rootRank, async_op=opts.asyncOp, timeout=_timeout(opts))
        return _finish(w, tensors, "broadcast", st)

    def allreduce(self, tensors, opts=None):
        if _profiler._is_profiler_enabled and not _tls.recording:
            return self._recorded("all_reduce", tensors, AccordProcessGroup.allreduce, (tensors, opts))
        if opts is None:
            opts = _C.AllreduceOptions()
        elif type(opts) is not _AllreduceOptions and not hasattr(opts, "reduceOp"):
            o = _C.AllreduceOptions()            # allreduce(tensors, op) overload
            o.reduceOp = opts
            opts = o
        op, factor = _reduce_op(opts.reduceOp)
        t = tensors[0] if len(tensors) == 1 else _one(tensors, "allreduce")
        st = None
        if not t.is_cpu:
            st = _Stage()
            t = st.out(t)
        if factor is not None:
            _premul(t, factor)
        w = api.all_reduce(t, op=op, group=self._g, async_op=opts.asyncOp,
                           timeout=_timeout(opts))
        return _finish(w, tensors, "allreduce", st)

    def allreduce_coalesced(self, tensors, opts=None):
        if _profiler._is_profiler_enabled and not _tls.recording:
            return self._recorded("all_reduce", tensors, AccordProcessGroup.allreduce_coalesced, (tensors, opts))
        if opts is None:
            opts = _C.AllreduceCoalescedOptions()
        op, factor = _reduce_op(opts.reduceOp)
        st = _Stage()
        host = [st.out(t) for t in tensors]
        by_dtype = {}
        for t in host:
            by_dtype.setdefault(t.dtype, []).append(t)
        parts, copies = [], []
        for group in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            if factor is not None:
                _premul(flat, factor)
            parts.append(api.all_reduce(flat, op=op, group=self._g, async_op=opts.asyncOp,
                                        timeout=_timeout(opts)))
            copies.append((flat, group))

        def unflatten():
            with torch.no_grad():
                for flat, group in copies:
                    off = 0
                    for t in group:
                        n = t.numel()
                        t.copy_(flat[off:off + n].view(t.shape))
                        off += n
        return self._work(parts, tensors, "allreduce_coalesced", st, unflatten)

    def reduce(self, tensors, opts=None):
        if _profiler._is_profiler_enabled and not _tls.recording:
            return self._recorded("reduce", tensors, AccordProcessGroup.reduce, (tensors, opts))
        if opts is None:
            opts = _C.ReduceOptions()
        op, factor = _reduce_op(opts.reduceOp)
        t = tensors[0] if len(tensors) == 1 else _one(tensors, "reduce")
        st = None
        if not t.is_cpu:
            st = _Stage()
            t = st.out(t)
        if factor is not None:
            _premul(t, factor)
        w = api.reduce(t, op=op, group=self._g, group_dst=opts.rootRank, async_op=opts.asyncOp,
                       timeout=_timeout(opts))
        return _finish(w, tensors, "reduce", st)

    def allgather(self, output_tensors, input_tensors, opts=None):
        if _profiler._is_profiler_enabled and not _tls.recording:
            return self._recorded("all_gather", input_tensors, AccordProcessGroup.allgather, (output_tensors, input_tensors, opts))
        if opts is None:
            opts = _C.AllgatherOptions()
        outs = _one(output_tensors, "allgather")
        inp = input_tensors[0] if len(input_tensors) == 1 else _one(input_tensors, "allgather")
        st = None
        if not (inp.is_cpu and _all_cpu(outs)):
            st = _Stage()
            outs = [st.out(t) for t in outs]
            inp = st.inp(inp)
        w = api.all_gather(outs, inp, group=self._g, async_op=opts.asyncOp,
                           timeout=_timeout(opts))
        return _finish(w, output_tensors, "allgather", st)

    def all_gather_single(self, output, input, opts=None):
        if _profiler._is_profiler_enabled and not _tls.recording:
            return self._recorded("all_gather_into_tensor", [input], AccordProcessGroup.all_gather_single, (output, input, opts))
        if opts is None:
            opts = _C.AllgatherOptions()
        st = None
        if not (output.is_cpu and input.is_cpu):
            st = _Stage()
        w = api.all_gather_into_tensor(output if st is None else st.out(output),
                                       input if st is None else st.inp(input), group=self._g,
                                       async_op=opts.asyncOp, timeout=_timeout(opts))
        # gloo's future holds the output cut in per-rank blocks; so does ours (cut only
        # when someone asks for it)
        n = self._size
        return _finish(w, lambda: list(output.chunk(n)), "all_gather_into_tensor", st)

    _allgather_base = all_gather_single

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        if _profiler._is_profiler_enabled and not _tls.recording:
            return self._recorded("all_gather", input_list, AccordProcessGroup.allgather_coalesced, (output_lists, input_list, opts))
        if opts is None:
            opts = _C.AllgatherOptions()
        st = _Stage()
        parts = []
        for j, inp in enumerate(input_list):
            outs = [st.out(per_rank[j]) for per_rank in output_lists]
            parts.append(api.all_gather(outs, st.inp(inp), group=self._g, async_op=opts.asyncOp,
                                        timeout=_timeout(opts)))
        return self._work(parts, output_lists, "allgather_coalesced", st)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        if _profiler._is_profiler_enabled and not _tls.recording:
            return self._recorded("all_gather_into_tensor_coalesced", inputs, AccordProcessGroup.all_gather_single_coalesced, (outputs, inputs, opts))
        if opts is None:
            opts = _C.AllgatherOptions()
        st = _Stage()
        parts = [api.all_gather_into_tensor(st.out(o), st.inp(i), group=self._g,
                                            async_op=opts.asyncOp, timeout=_timeout(opts))
                 for o, i in zip(outputs, inputs)]
        return self._work(parts, outputs, "all_gather_into_tensor_coalesced", st)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def _rooted(self, mine, root_lists, root, name, listed):
        """(this rank's tensor, the root's per-rank list or None, _Stage or None) of a
        gather or scatter; listed: "output" (gather) or "input" (scatter), what the
        root's list holds."""
        t = mine[0] if len(mine) == 1 else _one(mine, name)
        lst = None
        if self._g.rank == root:
            lst = _one(root_lists, name)
        elif root_lists and any(len(x) for x in root_lists):
            raise ValueError(f"{name}: {listed} tensors are only given on the root rank")
        st = None
        if not (t.is_cpu and (lst is None or _all_cpu(lst))):
            st = _Stage()
            if listed == "output":
                t, lst = st.inp(t), lst and [st.out(x) for x in lst]
            else:
                t, lst = st.out(t), lst and [st.inp(x) for x in lst]
        return t, lst, st

    def gather(self, output_lists, input_tensors, opts=None):
        if _profiler._is_profiler_enabled and not _tls.recording:
            return self._recorded("gather", input_tensors, AccordProcessGroup.gather, (output_lists, input_tensors, opts))
        if opts is None:
            opts = _C.GatherOptions()
        root = opts.rootRank
        inp, outs, st = self._rooted(input_tensors, output_lists, root, "gather", "output")
        w = api.gather(inp, outs, group=self._g, group_dst=root, async_op=opts.asyncOp,
                       timeout=_timeout(opts))
        return _finish(w, output_lists, "gather", st)

    def scatter(self, output_tensors, input_lists, opts=None):
        if _profiler._is_profiler_enabled and not _tls.recording:
            return self._recorded("scatter", [t for lst in input_lists for t in lst], AccordProcessGroup.scatter, (output_tensors, input_lists, opts))
        if opts is None:
            opts = _C.ScatterOptions()
        root = opts.rootRank
        out, ins, st = self._rooted(output_tensors, input_lists, root, "scatter", "input")
        w = api.scatter(out, ins, group=self._g, group_src=root, async_op=opts.asyncOp,
                        timeout=_timeout(opts))
        return _finish(w, output_tensors, "scatter", st)

    def reduce_scatter(self, output_tensors, input_lists, opts=None):
        if _profiler._is_profiler_enabled and not _tls.recording:
            return self._recorded("reduce_scatter", [t for lst in input_lists for t in lst], AccordProcessGroup.reduce_scatter, (output_tensors, input_lists, opts))
        if opts is None:
            opts = _C.ReduceScatterOptions()
        op, factor = _reduce_op(opts.reduceOp)
        st = _Stage()
        ins = [st.inp(t) for t in _one(input_lists, "reduce_scatter")]
        if factor is not None:
            ins = [t.detach() * factor for t in ins]
        w = api.reduce_scatter(st.out(_one(output_tensors, "reduce_scatter")), ins, op=op,
                               group=self._g, async_op=opts.asyncOp, timeout=_timeout(opts))
        return _finish(w, output_tensors, "reduce_scatter", st)

    def reduce_scatter_single(self, output, input, opts=None):
        if _profiler._is_profiler_enabled and not _tls.recording:
            return self._recorded("reduce_scatter_tensor", [output], AccordProcessGroup.reduce_scatter_single, (output, input, opts))
        if opts is None:
            opts = _C.ReduceScatterOptions()
        op, factor = _reduce_op(opts.reduceOp)
        st = _Stage()
        inp = st.inp(input)
        if factor is not None:
            inp = inp.detach() * factor
        w = api.reduce_scatter_tensor(st.out(output), inp, op=op, group=self._g,
                                      async_op=opts.asyncOp, timeout=_timeout(opts))
        return _finish(w, [output], "reduce_scatter_tensor", st)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        if _profiler._is_profiler_enabled and not _tls.recording:
            return self._recorded("reduce_scatter_tensor_coalesced", inputs, AccordProcessGroup.reduce_scatter_single_coalesced, (outputs, inputs, opts))
        if opts is None:
            opts = _C.ReduceScatterOptions()
        op, factor = _reduce_op(opts.reduceOp)
        st = _Stage()
        parts = []
        for o, i in zip(outputs, inputs):
            i = st.inp(i)
            if factor is not None:
                i = i.detach() * factor
            parts.append(api.reduce_scatter_tensor(st.out(o), i, op=op, group=self._g,
                                                   async_op=opts.asyncOp,
                                                   timeout=_timeout(opts)))
        return self._work(parts, outputs, "reduce_scatter_tensor_coalesced", st)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def alltoall(self, output_tensors, input_tensors, opts=None):
        if _profiler._is_profiler_enabled and not _tls.recording:
            return self._recorded("all_to_all", input_tensors, AccordProcessGroup.alltoall, (output_tensors, input_tensors, opts))
        if opts is None:
            opts = _C.AllToAllOptions()
        st = _Stage()
        w = api.all_to_all([st.out(t) for t in output_tensors],
                           [st.inp(t) for t in input_tensors], group=self._g,
                           async_op=opts.asyncOp, timeout=_timeout(opts))
        return _finish(w, output_tensors, "all_to_all", st)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes,
                          opts=None):
        if _profiler._is_profiler_enabled and not _tls.recording:
            return self._recorded("all_to_all", [input], AccordProcessGroup.all_to_all_single, (output, input, output_split_sizes, input_split_sizes, opts))
        if opts is None:
            opts = _C.AllToAllOptions()
        st = _Stage()
        w = api.all_to_all_single(st.out(output), st.inp(input),
                                  list(output_split_sizes) or None,
                                  list(input_split_sizes) or None, group=self._g,
                                  async_op=opts.asyncOp, timeout=_timeout(opts))
        return _finish(w, [output], "all_to_all_single", st)

    alltoall_base = all_to_all_single

    def barrier(self, opts=None):
        if _profiler._is_profiler_enabled and not _tls.recording:
            return self._recorded("barrier", [], AccordProcessGroup.barrier, (opts,))
        if opts is None:
            opts = _C.BarrierOptions()
        w = api.barrier(group=self._g, async_op=opts.asyncOp, timeout=_timeout(opts))
        return _finish(w, [], "barrier")

    # -- point to point ----------------------------------------------------------
    # isend/irecv start on the caller's thread and the engine thread finishes what is
    # left, unless someone waits on the Work (AccordWork._move). torch's blocking
    # dist.send/dist.recv make the same calls and wait at once: for them the operation
    # runs as accord's own blocking send/recv (_blocking_caller)
    def send(self, tensors, dst, tag=0):
        if _profiler._is_profiler_enabled and not _tls.recording:
            return self._recorded("send", tensors, AccordProcessGroup.send, (tensors, dst, tag))
        t = _one(tensors, "send")
        if t.is_cpu and _blocking_caller(_ISEND, _SEND):
            api.send(t, group=self._g, group_dst=dst, tag=tag)
            return None             # dist.send waits on a Work only where it gets one
        st = _Stage()
        w = api.isend(st.inp(t), group=self._g, group_dst=dst, tag=tag)
        return AccordWork([w], tensors, "send")

    def recv(self, tensors, src, tag=0):
        if _profiler._is_profiler_enabled and not _tls.recording:
            return self._recorded("recv", tensors, AccordProcessGroup.recv, (tensors, src, tag))
        t = _one(tensors, "recv")
        if t.is_cpu and _blocking_caller(_IRECV, _RECV):
            api.recv(t, group=self._g, group_src=src, tag=tag)
            return AccordWork(None, tensors, "recv", None, src)
        st = _Stage()
        w = api.irecv(st.out(t), group=self._g, group_src=src, tag=tag)
        return AccordWork([w], tensors, "recv", st.after(), src)

    def recv_anysource(self, tensors, tag=0):
        if _profiler._is_profiler_enabled and not _tls.recording:
            return self._recorded("recvAnySource", tensors, AccordProcessGroup.recv_anysource, (tensors, tag))
        t = _one(tensors, "recv")
        if t.is_cpu and _blocking_caller(_IRECV, _RECV):
            sender = api.recv(t, group=self._g, tag=tag)
            return AccordWork(None, tensors, "recv", None, self._g.ranks.index(sender))
        st = _Stage()
        w = api.irecv(st.out(t), group=self._g, tag=tag)
        g = self._g
        # known once the message is in: the api's Work yields the sender's rank in g's
        # numbering of the world; torch wants it within the group
        return AccordWork([w], tensors, "recv", st.after(),
                          lambda: g.ranks.index(w.result()))

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        """torch's ProcessGroup.monitored_barrier: see accord.monitored_barrier."""
        from .monitored import monitored_barrier
        monitored_barrier(self._g, timeout, wait_all_ranks)

    # -- lifetime ------------------------------------------------------------------
    def shutdown(self):
        _live_groups.discard(self)
        self._g.destroy()

    def abort(self):
        self.shutdown()


def default_group():
    """torch's default group if it runs on accord (an AccordProcessGroup), else None."""
    if not dist.is_initialized():
        return None
    pg = dist.distributed_c10d._get_default_group()
    return pg if isinstance(pg, AccordProcessGroup) else None


def monitored_barrier(group=None, timeout=None, wait_all_ranks=False) -> None:
    """torch.distributed.monitored_barrier for groups on backend "accord".

    torch's own function refuses every backend but gloo; this one takes the same
    arguments (a torch group or None for the default group, a timedelta or seconds)
    and has the same meaning: see accord.monitored_barrier.
    """
    from .monitored import monitored_barrier as run
    if group is None:
        group = default_group()
        if group is None:
            raise ValueError("monitored_barrier: torch's default group does not run on "
                             "backend 'accord'")
    run(group, timeout, wait_all_ranks)


def shrink(timeout=None) -> None:
    """Replace torch's default group (backend "accord") by one of the live ranks.

    accord.shrink for torch programs: called by every survivor after a call
    failed with accord.PeerLost (or GroupClosed because of one). The survivors
    agree through the default group's store on who is alive (as accord.shrink
    does), then torch's default group is destroyed and a new one made with
    `torch.distributed.init_process_group("accord", store=..., rank=...,
    world_size=...)`: `dist.get_rank()`/`dist.get_world_size()` describe the
    survivors, ranked in their old order, and torch's own calls use it.

    Every other torch group (new_group, DeviceMesh, DDP's and FSDP's) is
    destroyed with the default group, as torch's destroy_process_group does:
    the program makes them again (wrap the model in a new DDP, for instance).
    The store must outlive the dead rank (torchrun's agent store does; with a
    plain env:// or tcp:// rendezvous torch's own TCPStore lives in rank 0's
    process, and rank 0's death takes it).

    Raises:
        ValueError: torch's default group does not run on backend "accord".
        accord.CommTimeout: the survivors did not all answer within the timeout
            (default: the group's), naming the members that did not.
    """
    import time
    from . import elastic
    pg = default_group()
    if pg is None:
        raise ValueError("accord.torch.shrink: torch's default group does not run on "
                         "backend 'accord'")
    g = pg.accord_group
    seconds = to_seconds(timeout) or g.timeout
    result, _, _ = elastic.decide_survivors(g, None, time.monotonic() + seconds)
    alive = result["alive"]
    new_rank, store = alive.index(g.rank), g.store
    dist.destroy_process_group()
    dist.init_process_group(BACKEND_NAME, store=dist.PrefixStore(f"accord/{result['name']}",
                                                                   store),
                            rank=new_rank, world_size=len(alive),
                            timeout=datetime.timedelta(seconds=g.timeout))


# -- registration ----------------------------------------------------------------

def create_group(common_opts, backend_options=None) -> "AccordProcessGroup":
    """torch's creator of "accord" groups (extended API): this rank's accord group
    over the group's store, as the torch ProcessGroup torch will use.

    Under torchrun the group meets in its restart attempt's own namespace of the
    store (rendezvous/torchelastic.py: the agent's store keeps the keys of failed
    attempts)."""
    rank, size = common_opts.group_rank, common_opts.group_size
    ranks = list(common_opts.global_ranks_in_group) or list(range(size))
    timeout = to_seconds(common_opts.timeout)
    name = f"torch:{common_opts.group_id}"
    store = attempt_store(common_opts.store)
    g = world.group_from_store(store, rank, size, timeout, name, ranks)
    if size > 1:
        # every member has finished reading the store before any may leave (rank 0
        # hosts torch's store: peers still reading it would fail if it exited)
        api.barrier(group=g)
    return AccordProcessGroup(g, rank, size)


def _register():
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND_NAME, create_group, extended_api=True,
                                  devices=["cpu"])


_register()


@atexit.register
def _close_at_exit():
    # say goodbye on every link, so peers know this exit was not a crash
    for pg in list(_live_groups):
        try:
            pg.shutdown()
        except Exception:
            pass
