"""What `accord run` prints: whole prefixed lines from every rank, and the summary of a failed job."""
import re
import textwrap

import pytest

from test_launch import accord, script

pytestmark = pytest.mark.timeout(90)

LINES = 150


def test_every_line_whole_and_prefixed(tmp_path):
    # print() of several arguments makes one write per piece when output is
    # unbuffered (the launcher sets PYTHONUNBUFFERED): the pieces of 4 ranks
    # used to interleave mid-line.
    s = script(tmp_path, "chatty.py", f"""
        import os, sys
        rank = int(os.environ["RANK"])
        for i in range({LINES}):
            print(rank, "x" * 40, i)
            print("err", rank, i, file=sys.stderr)
        sys.stdout.write("no newline at the end from %d" % rank)
        """)
    status, output, _ = accord("run", "-n", 4, s)
    assert status == 0, output
    seen = {r: [] for r in range(4)}
    errs = {r: 0 for r in range(4)}
    for line in output.splitlines():
        m = re.fullmatch(r"\[rank (\d)\] (\d) x{40} (\d+)", line)
        if m:
            assert m.group(1) == m.group(2), line
            seen[int(m.group(1))].append(int(m.group(3)))
            continue
        m = re.fullmatch(r"\[rank (\d)\] err (\d) (\d+)", line)
        if m:
            assert m.group(1) == m.group(2), line
            errs[int(m.group(1))] += 1
            continue
        m = re.fullmatch(r"\[rank (\d)\] no newline at the end from (\d)", line)
        assert m and m.group(1) == m.group(2), f"a line not whole or not prefixed: {line!r}"
    for r in range(4):
        assert seen[r] == list(range(LINES)), f"rank {r}'s lines: {seen[r][:10]}..."
        assert errs[r] == LINES


def test_no_prefix_keeps_lines_whole(tmp_path):
    s = script(tmp_path, "plain.py", """
        import os
        for i in range(50):
            print("plain", os.environ["RANK"], i)
        """)
    status, output, _ = accord("run", "--no-prefix", "-n", 3, s)
    assert status == 0, output
    lines = output.splitlines()
    assert len(lines) == 150, output
    assert all(re.fullmatch(r"plain [012] \d+", line) for line in lines), output


def test_log_dir_has_one_file_per_rank(tmp_path):
    s = script(tmp_path, "logged.py", """
        import os, sys, time
        rank = int(os.environ["RANK"])
        print("hello from", rank)
        print("warning from", rank, file=sys.stderr)
        if rank == 0:
            open("rank0-wrote", "w").close()
            time.sleep(30)                      # until the launcher stops it
        while not os.path.exists("rank0-wrote"):
            time.sleep(0.01)
        raise ValueError("bad input on rank 1")
        """)
    logs = tmp_path / "logs"
    status, output, _ = accord("run", "-n", 2, "--log-dir", logs, s.name, cwd=tmp_path)
    assert status == 1, output
    assert "[rank 0] hello from 0" in output            # the console still shows every line
    assert sorted(p.name for p in logs.iterdir()) == ["rank-0.log", "rank-1.log"]
    # stdout and stderr reach the launcher through two pipes, so which of a rank's
    # two first lines lands first in its log is a race: only the lines are compared
    assert sorted((logs / "rank-0.log").read_text().splitlines()) == \
        ["hello from 0", "warning from 0"]
    log1 = (logs / "rank-1.log").read_text()
    head = log1.split("accord run: this rank's traceback:")[0].splitlines()
    assert "hello from 1" in head and "warning from 1" in head, log1
    assert "accord run: this rank's traceback:\nTraceback (most recent call last):\n" in log1
    assert log1.rstrip().endswith("ValueError: bad input on rank 1"), log1


# ---------------------------------------------------------------- the summary of a failed job

COMMON = """
import os, signal, sys
import numpy as np
import accord as dist

dist.init_process_group()
rank = dist.get_rank()
x = np.ones(4)
dist.all_reduce(x)
"""


def _summary_lines(output):
    return [line for line in output.splitlines() if line.startswith("accord run: ")]


def test_summary_of_an_exception(tmp_path):
    s = script(tmp_path, "job.py", COMMON + textwrap.dedent("""
        def load_batch(step):
            if rank == 1 and step == 3:
                raise ValueError(f"batch {step} is empty")
            return x

        for step in range(5):
            dist.all_reduce(load_batch(step))
        dist.destroy_process_group()
        """))
    status, output, _ = accord("run", "-n", 4, s.name, cwd=tmp_path)
    assert status == 1, output
    lines = output.splitlines()
    assert len(lines) <= 40, f"{len(lines)} lines:\n{output}"
    summary = _summary_lines(output)
    headline = next(line for line in summary if "job failed:" in line)
    assert headline.startswith("accord run: job failed: rank 1 (pid "), output
    assert headline.endswith("raised ValueError: batch 3 is empty (at job.py:13, in load_batch)")
    # the traceback: the user's frames, none of accord's or the launcher's
    assert "[rank 1]   File \"job.py\", line 17, in <module>" in lines, output
    assert "[rank 1]     raise ValueError(f\"batch {step} is empty\")" in lines, output
    assert "[rank 1] ValueError: batch 3 is empty" in lines, output
    assert "accord/" not in output and "_child.py" not in output and "runpy" not in output
    # one line for each other rank
    others = summary[summary.index("accord run: the other ranks:") + 1:]
    assert [re.match(r"accord run:   rank (\d) ", line).group(1) for line in others] == \
        ["0", "2", "3"], output


def test_peers_hear_why_a_rank_died_of_an_exception(tmp_path):
    # the dying rank tells its peers its exception as it leaves, and does not mistake
    # their unread messages (the calls it never made) for a Desync of its own
    s = script(tmp_path, "dies.py", COMMON + textwrap.dedent("""
        if rank == 1:
            raise ValueError("bad input on rank 1")
        dist.all_reduce(x)
        dist.destroy_process_group()
        """))
    status, output, _ = accord("run", "-n", 3, s.name, cwd=tmp_path)
    assert status == 1, output
    assert "Desync" not in output, output
    for peer in (0, 2):
        assert re.search(rf"\[rank {peer}\] accord\.PeerLost: rank 1 left the job: its program "
                         rf"raised ValueError: bad input on rank 1 \[reported by rank 1\]",
                         output), output


def test_accord_frames_are_folded_unless_debugging(tmp_path):
    s = script(tmp_path, "mismatch.py", COMMON + textwrap.dedent("""
        if rank == 0:
            dist.broadcast(x, src=0)
        else:
            dist.all_reduce(x)
        dist.destroy_process_group()
        """))
    status, output, _ = accord("run", "-n", 2, s, cwd=tmp_path)
    assert status == 1, output
    assert len(output.splitlines()) <= 40, output
    assert re.search(r"\[rank \d\]   \[\.\.\. \d+ frames inside accord; ACCORD_DEBUG=INFO shows "
                     r"them\]", output), output
    assert "accord/group.py" not in output and "accord/lane.py" not in output
    assert re.search(r"job failed: rank \d \(pid \d+, local rank \d on node 0\) raised "
                     r"accord\.Desync: rank \d: .* \(at mismatch\.py:1[245], in <module>\)", output)

    status, output, _ = accord("run", "-n", 2, s, cwd=tmp_path, env={"ACCORD_DEBUG": "INFO"})
    assert status == 1, output
    assert "frames inside accord" not in output
    # the call's own frames, whichever path ran it (the group's, or its lean path's)
    assert re.search(r'\[rank \d\]   File ".*accord/(group|lane)\.py", line \d+, in ', output), output


def test_summary_of_a_rank_killed_by_a_signal(tmp_path):
    s = script(tmp_path, "killed.py", COMMON + textwrap.dedent("""
        if rank == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(x)
        dist.destroy_process_group()
        """))
    status, output, _ = accord("run", "-n", 4, s, cwd=tmp_path)
    assert status == 128 + 9, output
    assert len(output.splitlines()) <= 40, output
    assert re.search(r"^accord run: job failed: rank 2 \(pid \d+, local rank 2 on node 0\) was "
                     r"killed by SIGKILL \(signal 9\)", output, re.M), output
    others = [line for line in _summary_lines(output) if line.startswith("accord run:   rank ")]
    assert [line.split()[3] for line in others] == ["0", "1", "3"], output


def test_summary_names_the_rank_that_skipped_a_collective(tmp_path):
    # rank 3 leaves before the last all_reduce; the others, waiting in it, lose it
    # (PeerLost) at about the same time: the summary must name rank 3, not a rank
    # that waited for it
    s = script(tmp_path, "skipped.py", COMMON + textwrap.dedent("""
        if rank != 3:
            dist.all_reduce(x)
        dist.destroy_process_group()
        """))
    status, output, _ = accord("run", "-n", 4, s, cwd=tmp_path)
    assert status == 1, output
    assert len(output.splitlines()) <= 40, output
    headline = next(line for line in _summary_lines(output) if "job failed:" in line)
    assert headline.startswith("accord run: job failed: rank 3 (pid "), output


def test_a_skipped_last_collective_is_named_at_destroy(tmp_path):
    # rank 3 skips the last broadcast; the others' parts of it only send (small
    # messages are buffered), so nobody waits: rank 3 finds the message it never
    # read when it destroys the group, and its Desync says what it did
    s = script(tmp_path, "skipped_late.py", COMMON + textwrap.dedent("""
        if rank != 3:
            dist.broadcast(x, src=0)
        dist.destroy_process_group()
        """))
    status, output, _ = accord("run", "-n", 4, s.name, cwd=tmp_path)
    assert status == 1, output
    assert len(output.splitlines()) <= 40, output
    headline = next(line for line in _summary_lines(output) if "job failed:" in line)
    assert re.match(r"accord run: job failed: rank 3 \(pid \d+, local rank 3 on node 0\) raised "
                    r"accord\.Desync: rank 3: destroying group 'default': ranks disagree: rank \d "
                    r"sent broadcast #1, root 0, float64, 32 bytes at skipped_late\.py:12, which no "
                    r"call of this rank read \(this rank made 1 call on it\)", headline), output
    assert "rank 3 skipped a collective its peers made" in output, output
    assert "the root" not in output, output
