"""The groups this process belongs to, and which threads issue their collectives.

Every member group is registered here when it gets its transport (and store),
and forgotten when destroyed (a WeakSet also forgets one that is dropped). Call
sites are announced to these groups' stores, positions tell of all of them,
and a flight-recorder dump covers them all.
"""
import os
import threading
import weakref

_groups = weakref.WeakSet()
_lock = threading.Lock()


def add(group):
    """Register group; True when its store is one no registered group uses yet."""
    with _lock:
        known = {id(getattr(g, "store", None)) for g in _groups}
        _groups.add(group)
        return id(getattr(group, "store", None)) not in known


def unregister(group):
    with _lock:
        _groups.discard(group)


def live_groups():
    """The registered groups (those with a transport, not yet destroyed)."""
    return list(_groups)


# -- which threads issue collectives ------------------------------------------------

other_issuers = False     # a thread other than the main one has issued a collective
_MAIN_IDENT = threading.main_thread().ident


def _after_fork():
    # a child forked from another thread has that thread as its main one, and no other:
    # the parent's other issuing threads are not in it (a child that believed they were
    # would take no part in deadlock detection, deadlock.py). Nor is it a member of the
    # parent's groups: its copies of them must not publish positions or call sites.
    global _MAIN_IDENT, other_issuers, _groups, _lock
    _MAIN_IDENT = threading.main_thread().ident
    other_issuers = False
    _groups = weakref.WeakSet()
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork)


def on_main_thread():
    """True on the main thread; notes it when another thread issues a collective.

    A process whose main thread is blocked in a call may still make the call its
    peers wait for from another thread: such processes (see threaded()) take no
    part in deadlock cycles (deadlock.py), and fall back to the timeout's
    stuck-rank table."""
    global other_issuers
    if threading.get_ident() == _MAIN_IDENT:
        return True
    other_issuers = True
    return False


def threaded():
    """Whether another thread of this program may issue collectives: one has, or a
    thread that is not accord's own is alive (it may be about to)."""
    if other_issuers:
        return True
    main = threading.main_thread()
    return any(t is not main and not t.name.startswith("accord-")
               for t in threading.enumerate())
