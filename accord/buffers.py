"""Any tensor, array or writable buffer seen as a flat run of bytes.

A `Buf` is what every algorithm works on: `.arr` is a contiguous 1-d numpy
array (the reduction dtype), `.mv` the same memory as a uint8 memoryview for
the transport. Inputs that are not contiguous are copied once and written back
by `.finish()`; contiguous inputs are used in place (no copy).
"""
import sys
import threading

import numpy as np

BF16_CODE = 250      # numpy has no bfloat16: such tensors travel as int16 bits
_TORCH_MODULES = ("torch",)


_DTYPE_NAMES = {}     # dtype -> (num, name): numpy computes dtype.name in Python on every access
_SUPPORTED = {}       # dtype -> None if it may cross a buffer, else why not (TypeError text)
_SENDABLE = {}        # dtype -> (num, name) of the dtypes that may: one lookup per array


def byte_view(arr):
    """A contiguous array's memory as a uint8 memoryview (what transports move).

    memoryview(arr).cast("B") costs a third of memoryview(arr.view(np.uint8)); numpy
    exports some dtypes (datetimes) through no buffer, and those take the long way."""
    try:
        return memoryview(arr).cast("B")
    except (TypeError, ValueError, BufferError):
        return memoryview(arr.reshape(-1).view(np.uint8))


class Buf:
    __slots__ = ("arr", "nbytes", "dtype_code", "dtype_name", "shape", "_writeback", "is_bf16")

    def __init__(self, arr, shape, writeback=None, is_bf16=False, known=None):
        """known: as_buf's (dtype number, name) of arr's dtype, if it looked it up."""
        flat = arr if arr.ndim == 1 else arr.reshape(-1)
        self.arr = flat
        self.nbytes = flat.nbytes
        self.is_bf16 = is_bf16
        if is_bf16:
            known = (BF16_CODE, "bfloat16")
        elif known is None:
            dt = flat.dtype
            known = _DTYPE_NAMES.get(dt)
            if known is None:
                known = _DTYPE_NAMES[dt] = (dt.num, dt.name)
        self.dtype_code, self.dtype_name = known
        self.shape = shape if shape.__class__ is tuple else tuple(shape)
        self._writeback = writeback

    @property
    def mv(self):
        """The same memory as uint8 bytes, for transports."""
        return byte_view(self.arr) if self.arr.size else memoryview(b"")

    @property
    def itemsize(self):
        return self.arr.itemsize

    @property
    def numel(self):
        return self.arr.size

    def finish(self):
        """Copy results back into a non-contiguous original."""
        if self._writeback is not None:
            self._writeback()

    def describe(self):
        return f"{self.dtype_name}{list(self.shape)}"


class _Capsule:
    """What np.from_dlpack takes: an object that exports one CPU tensor through DLPack."""
    __slots__ = ("t",)

    def __init__(self, t):
        self.t = t

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        return _TO_DLPACK(self.t)

    def __dlpack_device__(self):
        return (1, 0)           # kDLCPU


_TO_DLPACK = None
_TORCH = None         # (strided layout, bfloat16, int16) once torch is imported
_from_dlpack = np.from_dlpack


def torch_ndarray(t):
    """A numpy array sharing CPU tensor t's memory (same shape and strides).

    Seen through DLPack, not Tensor.numpy(): numpy() marks the tensor's storage
    non-resizable for good, which breaks code that frees and regrows storage
    (FSDP's `storage.resize_(0)`), while a DLPack view leaves the storage as it was.
    t must not require grad. bfloat16 is returned as its int16 bits. Raises
    TypeError for dtypes numpy has no type for, for layouts other than strided,
    and for tensors with the conjugate or negative bit set (their memory is not
    their value).
    """
    global _TO_DLPACK, _TORCH
    if _TORCH is None:
        torch = sys.modules["torch"]
        # torch's own capsule maker, without Tensor.__dlpack__'s Python checks (2 us a
        # call; the ones that matter here are made below), and the versioned capsule:
        # numpy makes arrays from the old kind read-only
        _TO_DLPACK = (getattr(torch._C, "_to_dlpack_versioned", None)
                      or (lambda x: x.__dlpack__(max_version=(1, 0))))
        _TORCH = (torch.strided, torch.bfloat16, torch.int16)
    strided, bf16, int16 = _TORCH
    if t.layout is not strided:
        raise TypeError(f"{t.layout} tensors have no single buffer")
    if t.is_neg() or t.is_conj():
        raise TypeError(f"tensor has its {'conjugate' if t.is_conj() else 'negative'} bit "
                        f"set; call resolve_conj()/resolve_neg() first")
    if t.dtype is bf16:
        t = t.view(int16)
    try:
        return _from_dlpack(_Capsule(t))
    except (RuntimeError, TypeError, BufferError) as e:
        raise TypeError(f"torch dtype {t.dtype} has no numpy equivalent ({e})") from None


_IS_TORCH = {}         # type -> whether its instances are torch tensors


def is_torch_tensor(obj):
    """obj is a torch tensor (or a subclass's instance), without importing torch.

    Decided once per type: the module-name test and hasattr cost 0.4 µs a call."""
    tp = type(obj)
    known = _IS_TORCH.get(tp)
    if known is None:
        known = _IS_TORCH[tp] = (tp.__module__.split(".")[0] in _TORCH_MODULES
                                 and hasattr(tp, "data_ptr"))
    return known


# The Buf of the small contiguous CPU tensors seen last, by id(tensor): making one
# (the device, grad, layout and sign-bit checks, a DLPack export, a numpy array)
# costs 3-4 µs, more than all the rest of a small collective's argument checks. An
# entry is used only for the same tensor object with the same memory address, shape,
# strides and dtype, so resize_, set_, .data = and FSDP's storage resizing all make a
# fresh one. An entry keeps its tensor alive (its array holds the tensor's memory
# through DLPack, and torch then keeps the Python object too), so only tensors of at
# most CACHE_BYTES are kept, the latest of them up to _CACHE_TOTAL bytes in all (and
# _CACHE_MAX entries). The bound is in bytes, not entries: a loop over a model's 300
# small tensors, each once a step, found none of them in the 256 entries kept before
# (the oldest goes first, and the loop always asks for the oldest), at 3-4 µs a call.
_TORCH_BUFS = {}       # id(t) -> (t, data_ptr, shape, stride, dtype, Buf)
_CACHE_MAX = 4096
_CACHE_TOTAL = 16 << 20
CACHE_BYTES = 64 << 10
_cache_lock = threading.Lock()
_cached_bytes = 0


def cached_torch_buf(t):
    """The Buf kept for tensor t if it still describes t's memory, else None."""
    e = _TORCH_BUFS.get(id(t))
    if e is not None and e[0] is t and t.data_ptr() == e[1] and t.shape == e[2] and \
            t.dtype is e[4] and t.stride() == e[3]:
        return e[5]
    return None


def remember_torch_buf(t, buf):
    """Keep buf (a view of all of contiguous tensor t, no write-back) if t is small."""
    global _cached_bytes
    n = buf.nbytes
    if buf._writeback is not None or n > CACHE_BYTES:
        return
    with _cache_lock:
        old = _TORCH_BUFS.pop(id(t), None)
        if old is not None:
            _cached_bytes -= old[5].nbytes
        while _TORCH_BUFS and (len(_TORCH_BUFS) >= _CACHE_MAX or
                               _cached_bytes + n > _CACHE_TOTAL):
            _cached_bytes -= _TORCH_BUFS.pop(next(iter(_TORCH_BUFS)))[5].nbytes   # oldest
        _TORCH_BUFS[id(t)] = (t, t.data_ptr(), t.shape, t.stride(), t.dtype, buf)
        _cached_bytes += n


def _from_torch(t, name, writable):
    buf = cached_torch_buf(t)
    if buf is None:
        buf = _make_torch_buf(t, name, writable)
        remember_torch_buf(t, buf)
    return buf


def _make_torch_buf(t, name, writable):
    torch = sys.modules["torch"]
    if not t.is_cpu:
        raise TypeError(f"{name}: tensor on device {t.device} is not supported by accord's "
                        f"core; move it to the CPU or use the torch backend (accord.torch)")
    orig = t
    if t.requires_grad:
        t = t.detach()              # a tensor that records gradients is exported detached
    writeback = None
    if not t.is_contiguous():
        if t.layout is not torch.strided:
            raise TypeError(f"{name}: {t.layout} tensors have no single buffer (all_reduce "
                            f"accepts sparse COO tensors)")
        t = t.contiguous()
        if writable:
            def writeback(src=t, dst=orig):
                with torch.no_grad():
                    dst.copy_(src)
    is_bf16 = t.dtype is torch.bfloat16
    try:
        arr = torch_ndarray(t)
    except TypeError as e:
        raise TypeError(f"{name}: torch dtype {t.dtype} cannot cross a buffer: {e}") from None
    # the array's own shape is the tensor's: no torch.Size to tuple conversion
    return Buf(arr, arr.shape, writeback, is_bf16)


def _unsupported(dt):
    """Why arrays of dtype dt cannot be sent (None: they can)."""
    if dt.hasobject:
        return "object arrays cannot be sent; use the *_object collectives"
    if dt.kind not in "biufcmMV":
        return f"dtype {dt} is not supported"
    return None


def sendable(dt):
    """(dtype number, name) if arrays of numpy dtype dt may be sent, else None (and
    _SUPPORTED[dt] says why not)."""
    known = _SENDABLE.get(dt)
    if known is None:
        why = _SUPPORTED.get(dt, 0)
        if why == 0:
            why = _SUPPORTED[dt] = _unsupported(dt)
        if why is None:
            known = _SENDABLE[dt] = (dt.num, dt.name)
    return known


def as_buf(obj, name, writable=True):
    """Wrap a numpy array, CPU torch tensor or buffer-protocol object."""
    if isinstance(obj, np.ndarray):
        flags = obj.flags
        if writable and not flags.writeable:
            raise ValueError(f"{name}: array is read-only but the call writes into it")
        dt = obj.dtype
        known = _SENDABLE.get(dt) or sendable(dt)
        if known is None:
            raise TypeError(f"{name}: {_SUPPORTED[dt]}")
        if flags.c_contiguous:
            return Buf(obj, obj.shape, None, False, known)
        tmp = np.ascontiguousarray(obj)
        wb = (lambda src=tmp, dst=obj: np.copyto(dst, src)) if writable else None
        return Buf(tmp, obj.shape, wb)
    if is_torch_tensor(obj):
        return _from_torch(obj, name, writable)
    try:
        mv = memoryview(obj)
    except TypeError:
        raise TypeError(f"{name}: expected a numpy array, a CPU torch tensor or a buffer, "
                        f"got {type(obj).__name__}") from None
    if writable and mv.readonly:
        raise ValueError(f"{name}: buffer of type {type(obj).__name__} is read-only")
    arr = np.asarray(mv)
    if not arr.flags.c_contiguous:
        return as_buf(arr, name, writable)
    return Buf(arr, arr.shape)


def plain_view(arr, writable):
    """A numpy array's bytes as a uint8 memoryview where it is the usual message: C
    contiguous, not empty, of a supported dtype, writable if asked; else None (as_buf
    then looks closer, and raises where it must)."""
    flags = arr.flags
    if flags.c_contiguous and (flags.writeable or not writable) and \
            _SUPPORTED.get(arr.dtype, 0) is None and arr.size:
        return byte_view(arr)
    return None


def message_view(obj, name, writable):
    """(the bytes of a message as a uint8 memoryview, what finishes a receive or None):
    what point-to-point calls need of a tensor, with as_buf's checks and errors.

    A contiguous numpy array of a supported dtype, the usual message, goes without
    a Buf: a message carries no dtype, shape or reduction."""
    if obj.__class__ is np.ndarray:
        view = plain_view(obj, writable)
        if view is not None:
            return view, None
    buf = as_buf(obj, name, writable)
    return buf.mv, (None if buf._writeback is None else buf._writeback)


def temp_like(buf, numel=None):
    """A fresh contiguous array with buf's dtype (bfloat16 stays int16 bits)."""
    return np.empty(buf.numel if numel is None else numel, dtype=buf.arr.dtype)


IN_PLACE_MIN = 64 << 10


def already_in_place(arr, block):
    """Whether `arr` is `block` itself (same first byte): an all_gather input that is
    already this rank's block of the output, as sharded training passes it, needs no
    copy. Below IN_PLACE_MIN bytes the copy (onto itself, if it is) costs less than
    finding out (an array's address costs microseconds)."""
    return arr.nbytes >= IN_PLACE_MIN and np.may_share_memory(arr, block) and \
        arr.ctypes.data == block.ctypes.data
