"""Key-value stores for rendezvous, with torch.distributed's method names.

Ranks meet through a store: they publish addresses, count arrivals and agree
on names before any data moves. Store defines the protocol; HashStore (one
process), FileStore (one host, a shared file) and PrefixStore (a namespace over
another store) live here; TCPStore (several hosts) is in accord.tcpstore.
"""
import fcntl
import os
import struct
import threading
import time

from .errors import CommTimeout
from .options import to_seconds

DEFAULT_STORE_TIMEOUT = 300.0


def check_key(key):
    if not isinstance(key, str):
        raise TypeError(f"store key must be str, not {type(key).__name__}")
    return key


def check_keys(keys):
    # torch takes a list; a lone str is accepted too, since iterating it
    # character by character is never what the caller meant.
    if isinstance(keys, str):
        return [keys]
    return [check_key(k) for k in keys]


def as_value(value, name="value"):
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"store {name} must be bytes or str, not {type(value).__name__}")


def check_amount(amount):
    if isinstance(amount, bool) or not isinstance(amount, int):
        raise TypeError(f"store add amount must be int, not {type(amount).__name__}")
    return amount


def _added(key, current, amount):
    """New value of `key` after add: values are ASCII decimal, as in torch."""
    if current is None:
        return amount
    try:
        return int(current) + amount
    except ValueError:
        raise ValueError(f"store add({key!r}): current value {current[:40]!r} "
                         f"is not an integer") from None


def _cas(current, expected, desired):
    """torch's compare_set rule: (whether to store desired, value to report).

    A missing key (current None) is set only when expected is b"". Otherwise
    torch reports `expected` back for a missing key, and so do we.
    """
    if current is None:
        return (True, desired) if expected == b"" else (False, expected)
    if current == expected:
        return True, desired
    return False, current


def timeout_error(op, keys, timeout, where=""):
    """The CommTimeout every store raises: names the keys and the timeout."""
    names = ", ".join(repr(k) for k in keys)
    noun = "key" if len(keys) == 1 else "keys"
    return CommTimeout(f"store {op} timed out after {timeout:g} s waiting for "
                       f"{noun} {names}{where}")


class Store:
    """The store protocol (torch.distributed.Store's names and semantics).

    Keys are str; values are bytes or str (str is stored as UTF-8); get
    returns bytes. Blocking calls wait up to the store's timeout (or the one
    passed) and then raise accord.errors.CommTimeout naming the keys.
    """

    def __init__(self, timeout=DEFAULT_STORE_TIMEOUT):
        self._timeout = to_seconds(timeout)

    @property
    def timeout(self):
        """Default deadline of blocking calls, in seconds."""
        return self._timeout

    def set_timeout(self, timeout):
        self._timeout = to_seconds(timeout)

    def _deadline_s(self, timeout):
        return self.timeout if timeout is None else to_seconds(timeout)

    def set(self, key, value):
        """Store value under key, replacing any previous value."""
        raise NotImplementedError

    def get(self, key, timeout=None):
        """The value of key, waiting until it exists. `timeout` is beyond torch."""
        raise NotImplementedError

    def add(self, key, amount):
        """Atomically add amount to the integer at key (missing = 0); return the sum."""
        raise NotImplementedError

    def compare_set(self, key, expected, desired):
        """Set key to desired if it holds expected (or is missing and expected
        is b""); return the value afterwards (torch's semantics)."""
        raise NotImplementedError

    def wait(self, keys, timeout=None):
        """Return once every key exists; CommTimeout names the missing ones."""
        raise NotImplementedError

    def check(self, keys):
        """True if every key exists, without waiting."""
        raise NotImplementedError

    def delete_key(self, key):
        """Remove key; True if it existed."""
        raise NotImplementedError

    def num_keys(self):
        raise NotImplementedError

    def close(self):
        """Release this handle's resources. Idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Table:
    """A dict guarded by a Condition: the state of HashStore and of the TCP server."""

    def __init__(self):
        self.cond = threading.Condition()
        self.data = {}

    def _wait(self, ready, timeout, stop=None, poll=0.25):
        """Wait (holding cond) until ready() or the deadline; True if ready.

        `stop` lets the TCP server give up early when its client went away;
        it is checked every `poll` seconds since nothing notifies us of that.
        """
        deadline = time.monotonic() + timeout
        while not ready():
            remaining = deadline - time.monotonic()
            if remaining <= 0 or (stop is not None and stop()):
                return False
            self.cond.wait(remaining if stop is None else min(remaining, poll))
        return True

    def set(self, key, value):
        with self.cond:
            self.data[key] = value
            self.cond.notify_all()

    def get(self, key, timeout, stop=None):
        """The value, or None when the deadline passed first."""
        with self.cond:
            if self._wait(lambda: key in self.data, timeout, stop):
                return self.data[key]
            return None

    def wait(self, keys, timeout, stop=None):
        """The keys still missing at the deadline (empty list: all present)."""
        with self.cond:
            self._wait(lambda: all(k in self.data for k in keys), timeout, stop)
            return [k for k in keys if k not in self.data]

    def add(self, key, amount):
        with self.cond:
            total = _added(key, self.data.get(key), amount)
            self.data[key] = str(total).encode("ascii")
            self.cond.notify_all()
            return total

    def compare_set(self, key, expected, desired):
        with self.cond:
            write, result = _cas(self.data.get(key), expected, desired)
            if write:
                self.data[key] = desired
                self.cond.notify_all()
            return result

    def check(self, keys):
        with self.cond:
            return all(k in self.data for k in keys)

    def delete(self, key):
        with self.cond:
            return self.data.pop(key, None) is not None

    def num_keys(self):
        with self.cond:
            return len(self.data)


class HashStore(Store):
    """In-process store, safe to share between threads."""

    def __init__(self, timeout=DEFAULT_STORE_TIMEOUT):
        super().__init__(timeout)
        self._table = Table()

    def set(self, key, value):
        self._table.set(check_key(key), as_value(value))

    def get(self, key, timeout=None):
        t = self._deadline_s(timeout)
        value = self._table.get(check_key(key), t)
        if value is None:
            raise timeout_error("get", [key], t)
        return value

    def add(self, key, amount):
        return self._table.add(check_key(key), check_amount(amount))

    def compare_set(self, key, expected, desired):
        return self._table.compare_set(check_key(key), as_value(expected, "expected"),
                                       as_value(desired, "desired"))

    def wait(self, keys, timeout=None):
        t = self._deadline_s(timeout)
        missing = self._table.wait(check_keys(keys), t)
        if missing:
            raise timeout_error("wait", missing, t)

    def check(self, keys):
        return self._table.check(check_keys(keys))

    def delete_key(self, key):
        return self._table.delete(check_key(key))

    def num_keys(self):
        return self._table.num_keys()


# FileStore record: op, key length, value length, then key and value bytes.
# The file is append-only, so a reader only ever parses what it has not seen.
_REC = struct.Struct("<cII")
_SET, _DEL, _JOIN, _LEAVE = b"S", b"D", b"J", b"L"


class FileStore(Store):
    """A store in a file shared by the processes of one host.

    The file is an append-only log of records (set, delete tombstone, user
    joined, user left) written under an exclusive flock; each handle replays
    it from its cached offset. With world_size > 0 the file is removed when
    world_size handles have closed.
    """

    def __init__(self, path, world_size=-1, timeout=DEFAULT_STORE_TIMEOUT):
        super().__init__(timeout)
        self.path = os.fspath(path)
        self.world_size = world_size
        self._lock = threading.Lock()   # flock is per open file, not per thread
        self._fd = None
        self._closed = False
        self._open()
        with self._lock, self._flocked(fcntl.LOCK_EX):
            self._append(_JOIN, b"", b"")

    def _open(self):
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        self._pid = os.getpid()
        self._offset = 0
        self._data = {}
        self._users_left = 0

    def _check_fd(self):
        if self._closed:
            raise ValueError(f"FileStore {self.path} is closed")
        # A forked child shares the parent's open file, hence its flock:
        # reopen so that parent and child exclude each other again.
        if self._pid != os.getpid():
            os.close(self._fd)
            self._open()

    class _Flock:
        def __init__(self, fd, mode):
            self.fd, self.mode = fd, mode

        def __enter__(self):
            fcntl.flock(self.fd, self.mode)

        def __exit__(self, *exc):
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def _flocked(self, mode):
        self._check_fd()
        return self._Flock(self._fd, mode)

    def _sync(self):
        """Replay records appended since the last call (caller holds a flock)."""
        size = os.fstat(self._fd).st_size
        if size <= self._offset:
            return
        buf = os.pread(self._fd, size - self._offset, self._offset)
        pos = 0
        while pos + _REC.size <= len(buf):
            op, klen, vlen = _REC.unpack_from(buf, pos)
            end = pos + _REC.size + klen + vlen
            if end > len(buf):
                break   # only complete records; writers hold LOCK_EX anyway
            self._apply(op, buf[pos + _REC.size:pos + _REC.size + klen],
                        buf[pos + _REC.size + klen:end])
            pos = end
        self._offset += pos

    def _apply(self, op, key, value):
        if op == _SET:
            self._data[key.decode("utf-8")] = value
        elif op == _DEL:
            self._data.pop(key.decode("utf-8"), None)
        elif op == _LEAVE:
            self._users_left += 1

    def _append(self, op, key, value):
        """Append one record (caller holds LOCK_EX); keeps the cache current."""
        self._sync()
        rec = _REC.pack(op, len(key), len(value)) + key + value
        view = memoryview(rec)
        while view:
            view = view[os.write(self._fd, view):]
        self._apply(op, key, value)
        self._offset += len(rec)

    def _refresh(self):
        with self._lock:
            self._check_fd()
            # Cheap test first: an unchanged size means nothing new to read.
            if os.fstat(self._fd).st_size > self._offset:
                with self._flocked(fcntl.LOCK_SH):
                    self._sync()

    def _poll(self, ready, timeout):
        """Poll the file until ready() (checked under self._lock) or the deadline."""
        deadline = time.monotonic() + timeout
        delay = 0.001
        while True:
            self._refresh()
            with self._lock:
                result = ready()
            if result is not None or time.monotonic() >= deadline:
                return result
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 1.5, 0.01)

    def set(self, key, value):
        key, value = check_key(key).encode("utf-8"), as_value(value)
        with self._lock, self._flocked(fcntl.LOCK_EX):
            self._append(_SET, key, value)

    def get(self, key, timeout=None):
        t = self._deadline_s(timeout)
        check_key(key)
        value = self._poll(lambda: self._data.get(key), t)
        if value is None:
            raise timeout_error("get", [key], t, f" (in the file store {self.path})")
        return value

    def add(self, key, amount):
        check_key(key), check_amount(amount)
        with self._lock, self._flocked(fcntl.LOCK_EX):
            self._sync()
            total = _added(key, self._data.get(key), amount)
            self._append(_SET, key.encode("utf-8"), str(total).encode("ascii"))
            return total

    def compare_set(self, key, expected, desired):
        check_key(key)
        expected, desired = as_value(expected, "expected"), as_value(desired, "desired")
        with self._lock, self._flocked(fcntl.LOCK_EX):
            self._sync()
            write, result = _cas(self._data.get(key), expected, desired)
            if write:
                self._append(_SET, key.encode("utf-8"), desired)
            return result

    def wait(self, keys, timeout=None):
        t = self._deadline_s(timeout)
        keys = check_keys(keys)
        if self._poll(lambda: True if all(k in self._data for k in keys) else None, t):
            return
        with self._lock:
            missing = [k for k in keys if k not in self._data]
        raise timeout_error("wait", missing, t, f" (in the file store {self.path})")

    def check(self, keys):
        keys = check_keys(keys)
        self._refresh()
        with self._lock:
            return all(k in self._data for k in keys)

    def delete_key(self, key):
        check_key(key)
        with self._lock, self._flocked(fcntl.LOCK_EX):
            self._sync()
            if key not in self._data:
                return False
            self._append(_DEL, key.encode("utf-8"), b"")
            return True

    def num_keys(self):
        self._refresh()
        with self._lock:
            return len(self._data)

    def close(self):
        with self._lock:
            if self._closed:
                return
            with self._flocked(fcntl.LOCK_EX):
                self._append(_LEAVE, b"", b"")
                # Unlink while still holding the lock, so no one appends to
                # a file that is about to disappear.
                if 0 < self.world_size <= self._users_left:
                    try:
                        os.unlink(self.path)
                    except FileNotFoundError:
                        pass
            os.close(self._fd)
            self._closed = True


class PrefixStore(Store):
    """Every key of `store` seen through f"{prefix}/": groups share one store.

    num_keys() is the underlying store's count, as in torch. close() leaves the
    underlying store open, since other prefixes still use it. The timeout is
    the underlying store's unless set on this PrefixStore.
    """

    def __init__(self, prefix, store):
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be str, not {type(prefix).__name__}")
        self.prefix = prefix
        self.underlying_store = store
        self._timeout = None

    @property
    def timeout(self):
        return self.underlying_store.timeout if self._timeout is None else self._timeout

    def _k(self, key):
        return f"{self.prefix}/{check_key(key)}"

    def set(self, key, value):
        self.underlying_store.set(self._k(key), value)

    def get(self, key, timeout=None):
        return self.underlying_store.get(self._k(key), timeout=self._deadline_s(timeout))

    def add(self, key, amount):
        return self.underlying_store.add(self._k(key), amount)

    def compare_set(self, key, expected, desired):
        return self.underlying_store.compare_set(self._k(key), expected, desired)

    def wait(self, keys, timeout=None):
        self.underlying_store.wait([self._k(k) for k in check_keys(keys)],
                                   timeout=self._deadline_s(timeout))

    def check(self, keys):
        return self.underlying_store.check([self._k(k) for k in check_keys(keys)])

    def delete_key(self, key):
        return self.underlying_store.delete_key(self._k(key))

    def num_keys(self):
        return self.underlying_store.num_keys()
