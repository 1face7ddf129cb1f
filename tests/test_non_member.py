"""A call on a group by a rank that is not a member does nothing (torch's rule), and
accord says so once per group at INFO on the `accord` logger."""
import re

import pytest

from test_launch import accord, script

pytestmark = pytest.mark.timeout(90)

# Rank 2 is outside both groups. Every kind of call on them returns None (or an
# empty list) on it; the members' calls run.
PROGRAM = """
    import logging, os
    import numpy as np
    import accord as dist

    if os.environ.get("USER_LOGGING"):
        logging.basicConfig(level=logging.INFO, format="user-log %(name)s %(levelname)s %(message)s")
    dist.init_process_group()
    rank = dist.get_rank()
    pair = dist.new_group([0, 1])
    other = dist.new_group([0, 1])
    x = np.full(2, float(rank + 1))
    results = [
        dist.all_reduce(x, group=pair),                             # line 14
        dist.broadcast(x, src=0, group=pair),
        dist.all_reduce(x, group=pair),
        dist.barrier(group=pair),
        dist.broadcast_object_list([rank], src=0, group=pair),
        dist.broadcast_state({"w": x}, src=0, group=pair),
        dist.batch_isend_irecv([dist.P2POp(dist.isend, x, 1 - rank if rank < 2 else 0,
                                           group=pair)]) if rank == 2 else None,
        dist.all_reduce(x, group=other),                            # line 22
    ]
    if rank == 2:
        print("results", [r if r is None else list(r) for r in results])
    print("x", x.tolist())
    dist.destroy_process_group()
"""


def _notices(output):
    return [line for line in output.splitlines() if "is not a member of group" in line]


def test_debug_info_says_it_once_per_group(tmp_path):
    s = script(tmp_path, "nonmember.py", PROGRAM)
    status, output, _ = accord("run", "-n", 3, s, env={"ACCORD_DEBUG": "INFO"})
    assert status == 0, output
    notices = _notices(output)
    # one line per group, on rank 2 only, naming the first skipped call and its line
    assert len(notices) == 2, output
    assert re.fullmatch(r"\[rank 2\] \[accord rank 2\] INFO rank 2 is not a member of group "
                        r"'group\d+' \(ranks \[0, 1\]\): its all_reduce at nonmember\.py:14 "
                        r"does nothing, as in torch\.distributed, and so will its later calls "
                        r"on that group \(said once per group\)", notices[0]), notices[0]
    assert "its all_reduce at nonmember.py:22 does nothing" in notices[1], notices[1]
    assert notices[0].split("group ")[1][:8] != notices[1].split("group ")[1][:8]
    # the calls still do nothing on the non-member, and run on the members
    assert "[rank 2] results [None, None, None, None, None, None, [], None]" in output, output
    assert "[rank 2] x [3.0, 3.0]" in output, output
    # rank 0 and 1: (1+2) = 3, broadcast keeps 3, then 6, then the last all_reduce 12
    assert "[rank 0] x [12.0, 12.0]" in output and "[rank 1] x [12.0, 12.0]" in output, output


def test_users_logging_at_info_shows_it(tmp_path):
    s = script(tmp_path, "nonmember.py", PROGRAM)
    status, output, _ = accord("run", "-n", 3, s, env={"USER_LOGGING": "1"})
    assert status == 0, output
    notices = _notices(output)
    assert len(notices) == 2, output
    assert all(n.startswith("[rank 2] user-log accord INFO rank 2 is not a member") for n in
               notices), notices


def test_silent_by_default(tmp_path):
    s = script(tmp_path, "nonmember.py", PROGRAM)
    status, output, _ = accord("run", "-n", 3, s)
    assert status == 0, output
    assert _notices(output) == [], output
    assert "[rank 2] results [None, None, None, None, None, None, [], None]" in output, output
