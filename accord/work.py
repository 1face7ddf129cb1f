"""Work: the handle of an asynchronous operation, over a concurrent.futures.Future
or an `Outcome` (the light future of point-to-point operations)."""
import concurrent.futures
import threading
from typing import Any, Callable, Optional, Union

from ._types import Timeout
from .errors import CommTimeout
from .options import to_seconds


_PENDING, _OK, _FAILED = range(3)
PENDING = _PENDING                  # an unsettled Outcome's state (transport/p2p.py's Pending
                                    # sets its fields itself, a call fewer per operation)
_SETTLE = threading.Lock()          # orders settling against waiters and callbacks


class Outcome:
    """The result of an operation another thread may settle: what Work needs of a
    future, at a fraction of concurrent.futures.Future's cost.

    A point-to-point operation makes one per isend/irecv, and most settle on the
    caller's own thread within the call; a concurrent.futures.Future builds a
    Condition for each and takes it on every look (about a quarter of a small
    isend's Python calls). Here settling is one short lock, and a threading.Event
    exists only once some thread blocks on the outcome without progressing it.
    Work.get_future() still hands out a real concurrent.futures.Future."""
    __slots__ = ("_state", "_value", "_event", "_callbacks")

    def __init__(self):
        self._state = _PENDING
        self._value = None
        self._event = None
        self._callbacks = None

    @classmethod
    def settled(cls, value: Any = None, exc: Optional[BaseException] = None) -> "Outcome":
        """An outcome that is over already: exc, or else value."""
        o = cls()
        o._state, o._value = (_OK, value) if exc is None else (_FAILED, exc)
        return o

    def done(self) -> bool:
        return self._state != _PENDING

    def set_result(self, value: Any) -> None:
        self._settle(_OK, value)

    def set_exception(self, exc: BaseException) -> None:
        self._settle(_FAILED, exc)

    def _settle(self, state, value):
        with _SETTLE:
            if self._state != _PENDING:
                return
            self._value, self._state = value, state
            event, callbacks, self._callbacks = self._event, self._callbacks, None
        if event is not None:
            event.set()
        for fn in callbacks or ():
            fn(self)

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until settled, or timeout seconds pass; whether it is settled."""
        if self._state != _PENDING:
            return True
        with _SETTLE:
            if self._state != _PENDING:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        return event.wait(timeout) or self._state != _PENDING

    def result(self, timeout: Optional[float] = None) -> Any:
        """The value, or raise the operation's error (CommTimeout if not settled in time)."""
        if self._state == _PENDING and not self.wait(timeout):
            raise CommTimeout(f"not done within {timeout} s")
        if self._state == _FAILED:
            raise self._value
        return self._value

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        if self._state == _PENDING and not self.wait(timeout):
            raise CommTimeout(f"not done within {timeout} s")
        return self._value if self._state == _FAILED else None

    def add_done_callback(self, fn: Callable[["Outcome"], Any]) -> None:
        """Call fn(outcome) once settled (at once, here, if it is already)."""
        with _SETTLE:
            if self._state == _PENDING:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(fn)
                return
        fn(self)

    def as_future(self) -> concurrent.futures.Future:
        """A concurrent.futures.Future that settles with this outcome."""
        f = concurrent.futures.Future()
        f.set_running_or_notify_cancel()

        def copy(o):
            if o._state == _FAILED:
                f.set_exception(o._value)
            else:
                f.set_result(o._value)
        self.add_done_callback(copy)
        return f


class Work:
    """The handle of an operation started with `async_op=True` (or isend/irecv), as torch's Work.

    Methods: `wait()` blocks until it is done and re-raises its error;
    `is_completed()`, `is_success()`, `exception()`; `get_future()` gives a
    `concurrent.futures.Future` (torch gives a torch.futures.Future);
    `result()` is the operation's result (the sender's rank for irecv).
    Unlike torch, `wait(timeout)` raises `accord.CommTimeout` when the
    operation is not done by then (the operation keeps running).
    """
    __slots__ = ("_future", "_desc", "_group", "_waiter", "_cf")

    def __init__(self, future: Union[concurrent.futures.Future, Outcome],
                 desc: Union[str, Callable[[], str], tuple] = "",
                 group: Any = None, waiter: Any = None) -> None:
        # desc: text, or what makes it (only a timeout message or repr() needs it): a
        # callable, or (fn, *args) for fn(*args)
        self._future, self._desc, self._group = future, desc, group
        # point to point: waiter(outcome, seconds) waits while progressing the messages
        self._waiter = waiter
        self._cf = None

    def _description(self):
        d = self._desc
        if d.__class__ is str:
            return d
        return d[0](*d[1:]) if d.__class__ is tuple else d()

    def wait(self, timeout: Timeout = None) -> bool:
        """Block until done; re-raise the operation's error. Returns True."""
        fut = self._future
        if fut.done():
            fut.result()
            return True
        seconds = to_seconds(timeout, "timeout")
        if self._waiter is not None:
            self._waiter(fut, seconds)
            if fut.done():
                fut.result()
                return True
        if isinstance(fut, Outcome):
            return self._wait_outcome(fut, seconds)
        g = self._group
        # the main thread now waits on the group (debug/deadlock.py)
        main = g is not None and threading.current_thread() is threading.main_thread()
        if main:
            g.waiters += 1
        try:
            if g is not None and seconds is None:
                g.run_queued(fut)           # runs it here if the worker has not begun it
            if not fut.done():
                concurrent.futures.wait([fut], seconds)
        finally:
            if main:
                g.waiters -= 1
        if not self._future.done():
            raise self._not_done(seconds)
        # the operation's own error, CommTimeout included, with its message intact
        self._future.result()
        return True

    def _wait_outcome(self, outcome, seconds):
        if not outcome.wait(seconds):
            raise self._not_done(seconds)
        outcome.result()
        return True

    def _not_done(self, seconds):
        return CommTimeout(f"Work.wait: {self._description()} did not complete within "
                           f"{seconds} s (it keeps running; wait again or let the group's "
                           f"timeout end it)")

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
        """The concurrent.futures.Future under this Work (the same one every time)."""
        fut = self._future
        if not isinstance(fut, Outcome):
            return fut
        if self._cf is None:
            self._cf = fut.as_future()
        return self._cf

    def _on_done(self, fn: Callable[[Any], Any]) -> None:
        """Call fn(f) once the operation is over, f being its future (done; its
        exception() and result() answer at once); at once, here, if it is over."""
        self._future.add_done_callback(fn)

    def _progresses(self) -> bool:
        """Whether wait() moves the operation's messages on the waiting thread (a
        point-to-point operation) rather than only waiting for another thread to."""
        return self._waiter is not None

    def result(self) -> Any:
        """The operation's result (for recv-like calls), after waiting."""
        return self._future.result()

    def __repr__(self):
        state = "done" if self._future.done() else "pending"
        return f"<accord.Work {self._description()} {state}>"


def completed_work(desc="", value=None):
    f = concurrent.futures.Future()
    f.set_result(value)
    return Work(f, desc)
