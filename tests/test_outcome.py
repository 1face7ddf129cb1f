"""accord.work.Outcome (the light future of isend/irecv) and Work over one.

In-process: one thread settles, another waits, as the point-to-point engine's
thread and the caller do.
"""
import concurrent.futures
import threading
import time

import pytest

from accord.errors import CommTimeout, PeerLost
from accord.work import Outcome, Work

pytestmark = pytest.mark.timeout(30)


def _settle_later(o, value=None, exc=None, after=0.05):
    def run():
        time.sleep(after)
        if exc is None:
            o.set_result(value)
        else:
            o.set_exception(exc)
    t = threading.Thread(target=run)
    t.start()
    return t


def test_a_waiter_wakes_when_another_thread_settles_it():
    o = Outcome()
    assert not o.done()
    t = _settle_later(o, 3)
    assert o.wait(10) is True and o.done()
    assert o.result() == 3 and o.exception() is None
    t.join()


def test_wait_times_out_and_the_outcome_can_still_settle():
    o = Outcome()
    assert o.wait(0.01) is False
    with pytest.raises(CommTimeout):
        o.result(0.01)
    o.set_result("late")
    assert o.result() == "late"


def test_the_first_settlement_wins_and_an_error_is_raised_as_it_is():
    o = Outcome()
    err = PeerLost("rank 1 is gone")
    o.set_exception(err)
    o.set_result(5)                  # too late: ignored
    with pytest.raises(PeerLost, match="rank 1 is gone") as e:
        o.result()
    assert e.value is err and o.exception() is err


def test_callbacks_run_once_settled_or_at_once_if_already():
    o, seen = Outcome(), []
    o.add_done_callback(lambda x: seen.append(("before", x.result())))
    t = _settle_later(o, 7)
    t.join()
    o.add_done_callback(lambda x: seen.append(("after", x.result())))
    assert seen == [("before", 7), ("after", 7)]


def test_work_over_an_outcome_gives_one_real_future_that_settles_with_it():
    o = Outcome()
    w = Work(o, lambda: "irecv from rank 1 (tag 0, 8 bytes, group 'world')")
    f = w.get_future()
    assert isinstance(f, concurrent.futures.Future) and w.get_future() is f
    assert not w.is_completed() and not f.done()
    with pytest.raises(CommTimeout, match=r"irecv from rank 1 \(tag 0.*did not complete "
                                          r"within 0.05 s"):
        w.wait(timeout=0.05)
    t = _settle_later(o, 1)
    assert f.result(10) == 1
    assert w.wait() is True and w.is_success() and w.result() == 1
    t.join()


def test_work_wait_reraises_the_operations_error():
    o = Outcome()
    w = Work(o, "isend to rank 2")
    t = _settle_later(o, exc=PeerLost("rank 2 died"))
    with pytest.raises(PeerLost, match="rank 2 died"):
        w.wait()
    assert w.is_completed() and not w.is_success()
    assert isinstance(w.get_future().exception(), PeerLost)
    t.join()
