"""Any tensor, array or writable buffer seen as a flat run of bytes.

A `Buf` is what every algorithm works on: `.arr` is a contiguous 1-d numpy
array (the reduction dtype), `.mv` the same memory as a uint8 memoryview for
the transport. Inputs that are not contiguous are copied once and written back
by `.finish()`; contiguous inputs are used in place (no copy).
"""
import sys

import numpy as np

BF16_CODE = 250      # numpy has no bfloat16: such tensors travel as int16 bits
_TORCH_MODULES = ("torch",)


_DTYPE_NAMES = {}     # dtype -> name: numpy computes dtype.name in Python on every access


class Buf:
    __slots__ = ("arr", "nbytes", "dtype_code", "dtype_name", "shape", "_writeback", "is_bf16")

    def __init__(self, arr, shape, writeback=None, is_bf16=False):
        flat = arr.reshape(-1)
        self.arr = flat
        self.nbytes = flat.nbytes
        self.is_bf16 = is_bf16
        dt = flat.dtype
        self.dtype_code = BF16_CODE if is_bf16 else dt.num
        if is_bf16:
            self.dtype_name = "bfloat16"
        else:
            name = _DTYPE_NAMES.get(dt)
            if name is None:
                name = _DTYPE_NAMES[dt] = dt.name
            self.dtype_name = name
        self.shape = shape if type(shape) is tuple else tuple(shape)
        self._writeback = writeback

    @property
    def mv(self):
        """The same memory as uint8 bytes, for transports."""
        return memoryview(self.arr.view(np.uint8)) if self.arr.size else memoryview(b"")

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


def is_torch_tensor(obj):
    mod = type(obj).__module__
    return mod.split(".")[0] in _TORCH_MODULES and hasattr(obj, "data_ptr")


def _from_torch(t, name, writable):
    torch = sys.modules["torch"]
    if not t.is_cpu:
        raise TypeError(f"{name}: tensor on device {t.device} is not supported by accord's "
                        f"core; move it to the CPU or use the torch backend (accord.torch)")
    orig = t
    if t.requires_grad:
        t = t.detach()              # numpy() refuses tensors that record gradients
    writeback = None
    if not t.is_contiguous():
        t = t.contiguous()
        if writable:
            def writeback(src=t, dst=orig):
                with torch.no_grad():
                    dst.copy_(src)
    is_bf16 = t.dtype is torch.bfloat16
    if is_bf16:
        arr = t.view(torch.int16).numpy()
    else:
        try:
            arr = t.numpy()
        except (TypeError, RuntimeError) as e:
            raise TypeError(f"{name}: torch dtype {t.dtype} cannot cross a buffer: {e}") from None
    # the array's own shape is the tensor's: no torch.Size to tuple conversion
    return Buf(arr, arr.shape, writeback, is_bf16)


def as_buf(obj, name, writable=True):
    """Wrap a numpy array, CPU torch tensor or buffer-protocol object."""
    if isinstance(obj, np.ndarray):
        if writable and not obj.flags.writeable:
            raise ValueError(f"{name}: array is read-only but the call writes into it")
        if obj.dtype.hasobject:
            raise TypeError(f"{name}: object arrays cannot be sent; use the *_object collectives")
        if obj.dtype.kind not in "biufcmMV" :
            raise TypeError(f"{name}: dtype {obj.dtype} is not supported")
        if obj.flags.c_contiguous:
            return Buf(obj, obj.shape)
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


def temp_like(buf, numel=None):
    """A fresh contiguous array with buf's dtype (bfloat16 stays int16 bits)."""
    return np.empty(buf.numel if numel is None else numel, dtype=buf.arr.dtype)
