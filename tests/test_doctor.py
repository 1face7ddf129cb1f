"""Smoke tests of `accord doctor`."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTIONS = ("[host]", "[/dev/shm]", "[network]", "[libraries]", "[kernel and environment]")


def doctor(*args, env_update=None, timeout=80):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    env.pop("ACCORD_TRANSPORT", None)
    env.update(env_update or {})
    return subprocess.run([sys.executable, "-m", "accord", "doctor", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(90)
def test_doctor_passes_here():
    p = doctor()
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    for section in SECTIONS + ("[health check]",):
        assert section in out
    assert "/dev/shm:" in out and "free" in out
    assert "loopback TCP: bound 127.0.0.1:" in out
    assert "ptrace_scope" in out
    assert "host identity " in out                         # what decides shm vs TCP
    assert "lo" in out and "127.0.0.1" in out            # interfaces and addresses
    assert "torch" in out and "mpi4py" in out
    health = [l for l in out.splitlines() if "2 ranks, ACCORD_TRANSPORT=" in l]
    assert health and all(l.strip().startswith("OK") for l in health), out
    assert any("ACCORD_TRANSPORT=tcp" in l for l in health)
    if "process_vm_readv: works" in out:
        # single copy works here: the threshold the group measured is named
        assert re.search(r"messages of (1|4) MiB and more single-copy \(measured", out), out
    assert "FAIL" not in out.replace("0 FAIL", "")
    for line in out.splitlines():
        if line.startswith("  "):
            assert line.split()[0] in ("OK", "WARN", "FAIL", "INFO", "|"), line


@pytest.mark.timeout(60)
def test_doctor_says_how_ranks_wait_and_how_large_single_copy_messages_go():
    ncpu = len(os.sched_getaffinity(0))
    p = doctor("--no-health")
    assert (f"waiting for a peer: 200 µs of spinning before sleeping, in groups of at most "
            f"{ncpu} ranks on this host") in p.stdout, p.stdout
    assert (f"large single-copy messages: copied by the receiver and the waiting sender "
            f"together, in groups of at most {ncpu} ranks on this host") in p.stdout, p.stdout
    p = doctor("--no-health", env_update={"ACCORD_SHM_SPLIT": "0"})
    assert "large single-copy messages: read by the receiver alone (ACCORD_SHM_SPLIT=0)" \
        in p.stdout, p.stdout


@pytest.mark.timeout(60)
def test_doctor_fails_on_bad_settings():
    p = doctor("--no-health", env_update={"ACCORD_TRANSPORT": "carrier-pigeon"})
    assert p.returncode == 1, p.stdout + p.stderr
    assert any(l.strip().startswith("FAIL") and "ACCORD_TRANSPORT" in l
               for l in p.stdout.splitlines()), p.stdout
    assert "[health check]" not in p.stdout


@pytest.mark.timeout(90)
def test_doctor_shows_the_host_identity_override():
    p = doctor(env_update={"ACCORD_HOST_ID": "rack3-node7"})
    assert "host identity rack3-node7:" in p.stdout, p.stdout
