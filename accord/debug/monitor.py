"""The publisher thread: positions out to the stores, then the deadlock check.

One daemon thread per process, started when the first group with a store gets
its transport. Every positions.PERIOD seconds it publishes where each group
stands (positions.publish, only when something changed) and then asks
deadlock.check whether this rank's blocked call is part of a cycle. It lives
apart from positions and deadlock because it drives both: deadlock reads
positions, so positions must not import deadlock back. register() is also
where a group joins the rest of debugging (its call sites, SIGUSR1, logging).
"""
import os
import threading
import time

from . import callsite, deadlock, groups, positions, recorder

_lock = threading.Lock()
_publisher = None


def _after_fork():
    # the parent's publisher thread is not in a forked child: the child starts its own
    # with its first group (it would otherwise publish nothing and never see a deadlock)
    global _publisher, _lock
    _publisher = None
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork)


def register(group):
    """Called when a member group gets its transport (and store)."""
    global _publisher
    if groups.add(group):
        # the sites used so far, for peers of this group (its store is new)
        callsite.announce(callsite.known(), [group])
    recorder.install_signal(group.options)
    recorder.setup_logging(group.options, group.global_rank)
    with _lock:
        if getattr(group, "store", None) is not None and _publisher is None:
            _publisher = threading.Thread(target=_publish_loop, name="accord-positions",
                                          daemon=True)
            _publisher.start()


def _publish_loop():
    seen = {}
    while True:
        time.sleep(positions.PERIOD)
        live = [g for g in groups.live_groups()
                if g._closed is None and getattr(g, "store", None) is not None]
        # a position tells of every group of the process: any change republishes all
        state = tuple((g.recorder.added, id(g.recorder.current), g._seq, g.waiters,
                       tuple(positions.waiting_on(g)) if g.recorder.current is not None else (),
                       len(g.p2p.waited) if g.p2p is not None else 0)
                      for g in live)
        for g in live:
            mark = (state, id(g.recorder.last_done), callsite.count())
            if seen.get(id(g)) == mark:
                continue
            try:
                positions.publish(g)
                seen[id(g)] = mark
            except Exception:       # the store went away (shutdown): nothing to tell
                pass
        try:
            deadlock.check(live)
        except Exception as e:      # a check that fails must not stop the publisher
            recorder.log.debug("deadlock check failed: %s", e)
