"""Kernel waits and wake-ups on 32-bit words of shared memory, through ctypes.

Only the shared (not the private) futex operations: the words live in a
mapping several processes share. `add_and_wake` is FUTEX_WAKE_OP, which adds
1 to a word atomically (in the kernel, under the futex lock) and wakes its
waiter, so a sleeper that passed FUTEX_WAIT the value it last read can never
miss a wake-up. `fence` is the cheapest full memory barrier Python reaches
(see fence_ops).
"""
import ctypes
import ctypes.util
import errno
import platform
import threading

_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98,
              "ppc64le": 221, "s390x": 238, "riscv64": 98}.get(platform.machine().lower())

FUTEX_WAIT, FUTEX_WAKE, FUTEX_WAKE_OP = 0, 1, 5
# FUTEX_OP(FUTEX_OP_ADD, 1, FUTEX_OP_CMP_EQ, 0): *uaddr2 += 1; the second wake's
# condition does not matter (its count is 0)
_OP_ADD_ONE = (1 << 28) | (0 << 24) | (1 << 12) | 0


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _syscall_of(lib):
    f = lib.syscall
    f.restype = ctypes.c_long
    f.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                  ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    return f


try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    _syscall = _syscall_of(_libc)      # releases the GIL: for waits, which block
    # Wake-ups keep the GIL (a PyDLL call does not release it): a wake never blocks and
    # takes about a microsecond, but a call that releases the GIL hands it to another
    # thread of the process that wants it (the point-to-point engine, a worker) and
    # then waits for it back, up to the interpreter's switch interval (5 ms) on a busy
    # machine; measured here as 300 µs a wake on average under load
    _syscall_held = _syscall_of(ctypes.PyDLL(ctypes.util.find_library("c") or None,
                                             use_errno=True))
    _labs = _libc.labs
    _labs.restype = ctypes.c_long
    _labs.argtypes = [ctypes.c_long]
    AVAILABLE = _SYS_FUTEX is not None
except (OSError, AttributeError):        # pragma: no cover - exotic platforms
    _libc = _syscall = _syscall_held = _labs = None
    AVAILABLE = False


def wait(addr, expected, timeout_s):
    """Sleep while the word at addr holds `expected` (signed 32-bit), at most timeout_s."""
    ts = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
    r = _syscall(_SYS_FUTEX, addr, FUTEX_WAIT, expected, ctypes.addressof(ts), None, 0)
    if r < 0:
        e = ctypes.get_errno()
        if e not in (errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR):
            raise OSError(e, f"futex wait: {errno.errorcode.get(e, e)}")


def wake(addr, n=1):
    _syscall_held(_SYS_FUTEX, addr, FUTEX_WAKE, n, None, None, 0)


WAKE_ALL = (1 << 31) - 1


def add_and_wake(addr, n=1):
    """Atomically add 1 to the word at addr and wake n of its waiters (WAKE_ALL: all)."""
    _syscall_held(_SYS_FUTEX, addr, FUTEX_WAKE_OP, n, None, addr, _OP_ADD_ONE)


def _labs_fence():
    _labs(0)


def fence_ops():
    """(enter, leave): calling both, in that order, is a full memory barrier (store-load
    ordering included), the cheapest Python reaches.

    On x86 a lock's acquire and release are locked instructions (CPython's locks are
    semaphores, taken and given with lock cmpxchg / lock xadd), and any locked
    instruction orders every earlier store before every later load: about 0.1 µs,
    where a foreign call (releasing and retaking the GIL) costs 0.5 µs. Elsewhere
    the foreign call, whose GIL hand-over is a full barrier there too."""
    if platform.machine().lower() in ("x86_64", "amd64"):
        lock = threading.Lock()
        return lock.acquire, lock.release
    return _labs_fence, _nothing


def _nothing():
    pass


_enter, _leave = fence_ops()


def fence():
    """A full memory barrier (store-load ordering included)."""
    _enter()
    _leave()
