"""Work: the handle of an asynchronous operation, over a concurrent.futures.Future."""
import concurrent.futures
import threading
from typing import Any, Optional

from ._types import Timeout
from .errors import CommTimeout
from .options import to_seconds


class Work:
    """The handle of an operation started with `async_op=True` (or isend/irecv), as torch's Work.

    Methods: `wait()` blocks until it is done and re-raises its error;
    `is_completed()`, `is_success()`, `exception()`; `get_future()` gives a
    `concurrent.futures.Future` (torch gives a torch.futures.Future);
    `result()` is the operation's result (the sender's rank for irecv).
    Unlike torch, `wait(timeout)` raises `accord.CommTimeout` when the
    operation is not done by then (the operation keeps running).
    """
    __slots__ = ("_future", "_desc", "_group", "_waiter")

    def __init__(self, future: concurrent.futures.Future, desc: str = "",
                 group: Any = None, waiter: Any = None) -> None:
        self._future, self._desc, self._group = future, desc, group
        # point to point: waiter(future, seconds) waits while progressing the messages
        self._waiter = waiter

    def wait(self, timeout: Timeout = None) -> bool:
        """Block until done; re-raise the operation's error. Returns True."""
        seconds = to_seconds(timeout, "timeout")
        if self._waiter is not None:
            self._waiter(self._future, seconds)
        g = self._group
        if g is not None and not self._future.done() and \
                threading.current_thread() is threading.main_thread():
            g.waiters += 1          # the main thread now waits on the group (debug/deadlock.py)
            try:
                concurrent.futures.wait([self._future], seconds)
            finally:
                g.waiters -= 1
        else:
            concurrent.futures.wait([self._future], seconds)
        if not self._future.done():
            raise CommTimeout(f"Work.wait: {self._desc} did not complete within {seconds} s "
                              f"(it keeps running; wait again or let the group's timeout end it)")
        # the operation's own error, CommTimeout included, with its message intact
        self._future.result()
        return True

    def is_completed(self) -> bool:
        """True once the operation has finished, successfully or not."""
        return self._future.done()

    def is_success(self) -> bool:
        """True once the operation has finished without an error."""
        return self._future.done() and self._future.exception() is None

    def exception(self, timeout: Timeout = None) -> Optional[BaseException]:
        """The operation's error (None if it succeeded), waiting up to timeout."""
        return self._future.exception(to_seconds(timeout, "timeout"))

    def get_future(self) -> concurrent.futures.Future:
        """The concurrent.futures.Future under this Work."""
        return self._future

    def result(self) -> Any:
        """The operation's result (for recv-like calls), after waiting."""
        return self._future.result()

    def __repr__(self):
        state = "done" if self._future.done() else "pending"
        return f"<accord.Work {self._desc} {state}>"


def completed_work(desc="", value=None):
    f = concurrent.futures.Future()
    f.set_result(value)
    return Work(f, desc)
