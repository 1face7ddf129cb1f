"""Cross-memory attach: copy straight out of another process's memory.

process_vm_readv (Linux >= 3.2) through ctypes. It needs permission to ptrace
the peer (same user and a permissive yama ptrace_scope, or CAP_SYS_PTRACE);
`probe` finds out at group creation, and callers fall back to the arena
where it is refused.
"""
import ctypes
import ctypes.util
import os

import numpy as np


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    _readv = _libc.process_vm_readv
    _readv.restype = ctypes.c_ssize_t
    _readv.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                       ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong]
    _writev = _libc.process_vm_writev
    _writev.restype = ctypes.c_ssize_t
    _writev.argtypes = _readv.argtypes
    AVAILABLE = True
except (OSError, AttributeError):        # pragma: no cover
    AVAILABLE = False

_PIECE = 16 << 20


def address(mv):
    """The address of a contiguous buffer's first byte."""
    if not isinstance(mv, memoryview):
        mv = memoryview(mv)
    if not mv.readonly and mv.nbytes:
        return ctypes.addressof(ctypes.c_char.from_buffer(mv))     # ~0.2 µs; numpy's ~1.5
    return np.frombuffer(mv, dtype=np.uint8).ctypes.data


def read(pid, local_addr, remote_addr, n, _call=None):
    """Copy n bytes from remote_addr in process pid to local_addr; OSError on failure."""
    call = _call or _readv
    local, remote = _Iovec(), _Iovec()
    lp, rp = ctypes.byref(local), ctypes.byref(remote)
    done = 0
    while done < n:
        k = min(_PIECE, n - done)
        local.iov_base, local.iov_len = local_addr + done, k
        remote.iov_base, remote.iov_len = remote_addr + done, k
        got = call(pid, lp, 1, rp, 1, 0)
        if got <= 0:
            e = ctypes.get_errno()
            name = "process_vm_writev to" if call is _writev else "process_vm_readv from"
            raise OSError(e, f"{name} pid {pid}: {os.strerror(e)}")
        done += got


def write(pid, local_addr, remote_addr, n):
    """Copy n bytes from local_addr to remote_addr in process pid; OSError on failure."""
    read(pid, local_addr, remote_addr, n, _writev)


IOV_MAX = 1024          # Linux's limit on the iovecs of one call (UIO_MAXIOV)


def iovecs(pairs):
    """A ctypes array of iovecs for (address, length) pairs (at most IOV_MAX)."""
    pairs = list(pairs)
    return (_Iovec * len(pairs))(*pairs)


def read_segments(pid, local, remote, n, _call=None):
    """Copy n bytes from pid's memory at the segments of iovec array remote into the
    segments of iovec array local (iovecs(); the two sides are byte streams, so
    their counts and cuts need not match): one system call, where a buffer per
    tensor would take one each. OSError on failure or a short copy.

    The kernel pins the remote side's pages segment by segment, about 0.6 µs a
    remote segment on the 2-vCPU development VM (4 MiB in 1 and in 300 segments:
    446 and 638 µs), while local segments cost nothing measurable (300 of them
    against 1 remote: 468 µs); callers that can make the remote side fewer, longer
    segments do (algorithms/segments.py)."""
    call = _call or _readv
    got = call(pid, local, len(local), remote, len(remote), 0)
    if got != n:
        e = ctypes.get_errno() if got < 0 else 0
        name = "process_vm_writev to" if call is _writev else "process_vm_readv from"
        raise OSError(e, f"{name} pid {pid}: " +
                      (os.strerror(e) if got < 0 else f"copied {got} of {n} bytes"))


def write_segments(pid, local, remote, n):
    """read_segments the other way: local's bytes into remote's segments in pid."""
    read_segments(pid, local, remote, n, _writev)


def probe(pid, remote_addr, expected):
    """True if this process may read pid's memory (and reads `expected`, 8 bytes, there)."""
    if not AVAILABLE:
        return False
    out = ctypes.create_string_buffer(8)
    try:
        read(pid, ctypes.addressof(out), remote_addr, 8)
    except OSError:
        return False
    return out.raw == expected
