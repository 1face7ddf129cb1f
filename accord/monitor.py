"""The publisher thread: positions out to the stores, then the deadlock check.

One daemon thread per process, started when the first group with a store gets
its transport. Every debug.PERIOD seconds it publishes where each group stands
(debug.publish, only when something changed) and then asks deadlock.check
whether this rank's blocked call is part of a cycle. It lives apart from debug
(the positions) and deadlock (the cycles) because it drives both: deadlock reads
positions, so debug must not import deadlock back.
"""
import threading
import time

from . import deadlock, debug

_lock = threading.Lock()
_publisher = None


def register(group):
    """Called when a member group gets its transport (and store)."""
    global _publisher
    debug.register(group)
    with _lock:
        if getattr(group, "store", None) is not None and _publisher is None:
            _publisher = threading.Thread(target=_publish_loop, name="accord-positions",
                                          daemon=True)
            _publisher.start()


def _publish_loop():
    seen = {}
    while True:
        time.sleep(debug.PERIOD)
        groups = [g for g in debug.live_groups()
                  if g._closed is None and getattr(g, "store", None) is not None]
        # a position tells of every group of the process: any change republishes all
        state = tuple((id(g.recorder.current), g._seq, g.waiters,
                       tuple(debug.waiting_on(g)) if g.recorder.current is not None else ())
                      for g in groups)
        for g in groups:
            mark = (state, id(g.recorder.last_done), debug.sites_known())
            if seen.get(id(g)) == mark:
                continue
            try:
                debug.publish(g)
                seen[id(g)] = mark
            except Exception:       # the store went away (shutdown): nothing to tell
                pass
        try:
            deadlock.check(groups)
        except Exception as e:      # a check that fails must not stop the publisher
            debug.log.debug("deadlock check failed: %s", e)
