"""Faults under load, each in a job of its own (benchmarks/soak.py's run_fault and
run_partition: `accord run -n 4` with the soak's random collectives and p2p going on):
a rank stopped (SIGSTOP) for less than the timeout, and for longer; a rank SIGKILLed
in the middle of 64 MiB all_reduces; a network partition between two hosts (network
namespaces) that drops every packet. `-m "not soak"` deselects them."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import soak  # noqa: E402

pytestmark = [pytest.mark.soak, pytest.mark.timeout(150)]
TIMEOUT = 4.0


def _errors(report):
    return {r: (e["error"] or [None])[0] for r, e in report["ranks"].items()}


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_rank_stopped_shorter_than_the_timeout_completes(transport):
    r = soak.run_fault("stop-short", transport, TIMEOUT)
    assert sorted(r["ranks"]) == [0, 1, 2, 3], r["problems"]
    assert _errors(r) == {0: None, 1: None, 2: None, 3: None}, r["problems"]
    assert sum(e["wrong"] for e in r["ranks"].values()) == 0
    assert not r["problems"], "\n".join(r["problems"])


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_rank_stopped_longer_than_the_timeout_is_named_by_every_other_rank(transport):
    r = soak.run_fault("stop-long", transport, TIMEOUT)
    for rank in (0, 1, 2):
        name, message, after_s, _ = r["ranks"][rank]["error"]
        assert name == "CommTimeout" and "rank 3" in message, r["ranks"][rank]
        assert after_s < TIMEOUT + 5, r["ranks"][rank]
    assert not r["problems"], "\n".join(r["problems"])


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_rank_killed_mid_64mib_transfer_is_peer_lost_and_leaks_nothing(transport):
    r = soak.run_fault("kill", transport, TIMEOUT)
    assert 3 not in r["ranks"]                       # it died before it could report
    for rank in (0, 1, 2):
        name, message, after_s, _ = r["ranks"][rank]["error"]
        assert name == "PeerLost" and "rank 3" in message, r["ranks"][rank]
    assert r["shm_left"] == [] and r["processes_left"] == []
    assert bool(r["ranks"][0]["arenas"]) == (transport == "shm")
    assert not r["problems"], "\n".join(r["problems"])


def test_partition_that_drops_packets_is_named_within_the_timeout():
    why = soak.partition_unavailable()
    if why:
        pytest.skip(why)
    r = soak.run_partition(TIMEOUT)
    if "skipped" in r:
        pytest.skip(r["skipped"])
    # the problems as text, the job's output in full: pytest shortens a list's repr
    assert sorted(r["ranks"]) == [0, 1, 2, 3], "\n".join(r["problems"])
    for rank in range(4):
        name, message, _, _ = r["ranks"][rank]["error"]
        assert name == "CommTimeout", r["ranks"][rank]
        assert r["error_after_drop_s"][rank] < TIMEOUT + 5, r["error_after_drop_s"]
    # each side names the other: a rank waiting across the cut names who it waited for
    named = {rank: soak.waited_on(r["ranks"][rank]["error"][1], rank) for rank in range(4)}
    # the errors' own words: a text waited_on cannot read is what a failure must show
    said = "\n".join(f"rank {k}'s error: {r['ranks'][k]['error'][1][:1000]}" for k in range(4))
    assert any(named[rank] in (2, 3) for rank in (0, 1)), f"{named}\n{said}"
    assert any(named[rank] in (0, 1) for rank in (2, 3)), f"{named}\n{said}"
    assert not r["problems"], "\n".join(r["problems"])


def test_blame_follows_who_waited_on_whom():
    msg = "rank {}: all_reduce #3: Timed out waiting for data from rank {} (...)"
    ranks = {r: {"error": ["CommTimeout", msg.format(r, w), 4.1, 104.1]}
             for r, w in ((0, 3), (1, 0), (2, 1), (3, 2))}
    assert soak.blame_problems(ranks, 100.0, 4.0) == {}
    ranks[1]["error"][1] = msg.format(1, 0)
    ranks[0]["error"][1] = msg.format(0, 1)            # 0 and 1 blame each other only
    assert set(soak.blame_problems(ranks, 100.0, 4.0)) == {0, 1}
    ranks[0]["error"][3] = 120.0                       # and 0's came far too late
    assert "after the drop" in soak.blame_problems(ranks, 100.0, 4.0)[0]
    del ranks[3]
    assert 3 in soak.blame_problems(ranks, 100.0, 4.0)
    # a rank whose send is blocked across the cut names that side too (it read nothing)
    sending = "rank 0: all_to_all #9: Timed out waiting to send to rank 2 (is a rank stuck"
    assert soak.waited_on(sending) == 2
    both = "rank 0: x: Timed out waiting for data from rank 1; waiting to send to rank 3 ("
    assert soak.waited_on(both) == 1
    # the stuck-rank table says whom each rank waited on; an echo names its reporter
    table = ("rank 1: all_to_all #5 (group 'default'): Timed out waiting for data from rank 0"
             " (...)\nwhere each rank of group 'default' stands (...):\n"
             "  rank 0: waiting in all_to_all #5, int64[8] at soak.py:150 for 5.0 s (on rank 2);"
             " last completed ...\n")
    assert soak.waited_on(table, 0) == 2 and soak.waited_on(table, 1) == 0
    assert soak.waited_on("rank 1: all_to_all #5: Timed out waiting for data from rank 0", 3) == 1
    # the soak's ring of isend/irecv: a point-to-point timeout names the peer (as
    # transport/p2p.py words it)
    irecv = ("rank 2: irecv from rank 1 (tag 7, 64 bytes, group 'default'): Timed out after "
             "4 s: no message with tag 7 arrived from rank 1 (is it sending to this rank "
             "with the same tag and group?)")
    assert soak.waited_on(irecv, 2) == 1
    isend = ("rank 2: isend to rank 3 (tag 7, 64 bytes, group 'default'): Timed out after 4 s: "
             "rank 3 did not take the message (is it receiving from this rank with the same "
             "tag and group?)")
    assert soak.waited_on(isend, 2) == 3
    # a receive whose message was cut off half way (the partition fell inside it)
    cut = ("rank 0: irecv from rank 3 (tag 60, 1896292 bytes, group 'default'): Timed out "
           "after 4 s: the message from rank 3 stopped arriving after 195448 of 1896292 "
           "bytes (nothing more came for 4 s: is that rank stopped, or the network between "
           "them dropping packets?); point-to-point with it is over")
    assert soak.waited_on(cut, 0) == 3
