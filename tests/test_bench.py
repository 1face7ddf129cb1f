"""Smoke tests of `accord bench`: real ranks, tiny sizes, table and CSV checked."""
import csv
import importlib.util
import os
import re
import subprocess
import sys

import pytest

from accord.cli.bench import CSV_FIELDS, fmt_size, parse_size

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bench(*args, timeout=50, **setenv):
    env = dict(os.environ, **setenv)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    env.pop("ACCORD_TRANSPORT", None)
    return subprocess.run([sys.executable, "-m", "accord", "bench", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def read_csv(path):
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == CSV_FIELDS
        return list(reader)


def check_rows(rows, lib, ops, sizes, world=2):
    """Every (op, size) and the barrier row of `lib`, each plausible and verified."""
    mine = [r for r in rows if r["lib"] == lib]
    want = {(op, s) for op in ops for s in sizes} | {("barrier", 0)}
    assert {(r["op"], int(r["size_bytes"])) for r in mine} == want
    for r in mine:
        assert int(r["world"]) == world
        assert float(r["lat_us"]) > 0 and float(r["op_p50_us"]) > 0
        assert float(r["blk_min_us"]) > 0
        assert int(r["iters"]) > 0 and int(r["blocks"]) > 0
        assert r["verified"] == "True"
        if r["op"] == "barrier":
            assert r["busbw_GBps"] == "" and r["algbw_GBps"] == ""
        else:
            assert float(r["algbw_GBps"]) > 0 and float(r["busbw_GBps"]) > 0


def test_sizes_parse():
    assert [parse_size(s) for s in ("8", "1K", "64K", "1M", "16M", "64MiB", "1G")] == \
        [8, 1024, 65536, 1 << 20, 16 << 20, 64 << 20, 1 << 30]
    assert fmt_size(64 << 20) == "64 MiB" and fmt_size(8) == "8 B" and fmt_size(1536) == "1536 B"
    for bad in ("3", "0", "1X", "", "-8"):
        with pytest.raises(ValueError):
            parse_size(bad)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("args", [["--sizes", "6"], ["--ops", "broadcast,frobnicate"],
                                  ["--compare", "nccl"], ["-n", "0"], ["--repeat", "0"],
                                  ["-n", "1", "--ops", "pingpong"]])
def test_bad_arguments(args, capsys):
    from accord.cli import main
    assert main(["bench", "--quick", *args]) == 2       # rejected before any rank starts
    assert "error" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_quick_accord(tmp_path):
    out = tmp_path / "out.csv"
    p = bench("--quick", "-n", "2", "--csv", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "## world 2" in p.stdout
    header = next(l for l in p.stdout.splitlines() if l.startswith("op "))
    for col in ("size", "accord lat us", "accord algbw", "accord busbw"):
        assert col in header
    assert "barrier" in p.stdout
    assert "GLIBC_TUNABLES=" in p.stdout            # the run says which setting it used
    assert "[world 2] accord:" in p.stderr          # progress
    # which path the large rows took: the group's measured single-copy threshold
    assert re.search(r"^accord's single-copy threshold \(measured when each group was "
                     r"created\): (1|4) MiB$", p.stdout, re.M), p.stdout
    rows = read_csv(out)
    check_rows(rows, "accord", ["broadcast", "all_gather", "scatter", "all_reduce"],
               [8, 1024, 65536])


@pytest.mark.timeout(60)
def test_the_single_copy_threshold_of_each_run_is_named(tmp_path):
    md = tmp_path / "t.md"
    p = bench("--quick", "-n", "2", "--ops", "broadcast", "--sizes", "8", "--no-barrier",
              "--repeat", "2", "--markdown", str(md), ACCORD_SHM_CMA="0")
    assert p.returncode == 0, p.stdout + p.stderr
    line = "accord's single-copy threshold (set by ACCORD_SHM_CMA): off, off (one per run)"
    assert line in p.stdout.splitlines() and line in md.read_text().splitlines()
    p = bench("--quick", "-n", "2", "--ops", "broadcast", "--sizes", "8", "--no-barrier",
              "--transport", "tcp")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "single-copy threshold" not in p.stdout         # TCP links: no such choice


@pytest.mark.timeout(60)
def test_ops_in_any_order_are_verified_right(tmp_path):
    # the checks know what each op leaves behind in the canonical order (a broadcast
    # first overwrites what all_gather then sends); --ops in another order ran them in
    # that order and reported every row WRONG
    out = tmp_path / "out.csv"
    p = bench("--quick", "-n", "2", "--ops", "all_reduce,all_gather,broadcast", "--sizes", "1K",
              "--no-barrier", "--csv", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "WRONG" not in p.stdout + p.stderr, p.stdout + p.stderr
    rows = read_csv(out)
    assert [r["op"] for r in rows] == ["broadcast", "all_gather", "all_reduce"]


@pytest.mark.timeout(90)
def test_reduce_scatter_is_timed_when_asked_for_and_verified(tmp_path):
    # not among the default ops; beside MPICH's Reduce_scatter_block where mpi4py is here
    out = tmp_path / "out.csv"
    libs = ["--compare", "mpi"] if importlib.util.find_spec("mpi4py") else []
    p = bench("--quick", "-n", "2", "--ops", "reduce_scatter,all_reduce", "--sizes", "8,64K",
              "--csv", str(out), *libs)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "WRONG" not in p.stdout + p.stderr, p.stdout + p.stderr
    rows = read_csv(out)
    check_rows(rows, "accord", ["all_reduce", "reduce_scatter"], [8, 65536])
    if libs:
        assert {r["op"] for r in rows if r["lib"] != "accord"} == {"all_reduce", "barrier",
                                                                    "reduce_scatter"}


@pytest.mark.timeout(120)
def test_all_to_all_is_timed_when_asked_for_and_verified(tmp_path):
    # all_to_all_single beside MPICH's Alltoall and gloo's all_to_all_single, at three
    # ranks so that every block differs
    out = tmp_path / "out.csv"
    libs = [lib for lib, mod in (("mpi", "mpi4py"), ("gloo", "torch"))
            if importlib.util.find_spec(mod)]
    p = bench("--quick", "-n", "3", "--ops", "all_to_all", "--sizes", "8,64K",
              "--csv", str(out), *(["--compare", ",".join(libs)] if libs else []))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "WRONG" not in p.stdout + p.stderr, p.stdout + p.stderr
    rows = read_csv(out)
    check_rows(rows, "accord", ["all_to_all"], [8, 65536], world=3)
    assert {r["lib"] for r in rows} == {"accord", *({"mpi": "mpich"}.get(lib, lib)
                                                   for lib in libs)}


@pytest.mark.timeout(60)
def test_quick_compare_gloo(tmp_path):
    pytest.importorskip("torch")
    out, md = tmp_path / "out.csv", tmp_path / "table.md"
    plot = tmp_path / "plot.png"
    want_plot = importlib.util.find_spec("matplotlib") is not None
    extra = ["--plot", str(plot)] if want_plot else []
    p = bench("--quick", "-n", "2", "--ops", "broadcast,all_reduce", "--sizes", "8,1K",
              "--compare", "gloo", "--csv", str(out), "--markdown", str(md), *extra)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    header = next(l for l in lines if l.startswith("op "))
    for col in ("accord lat us", "gloo lat us", "gloo busbw", "lat accord/gloo",
                "busbw accord/gloo"):
        assert col in header
    body = [l.split() for l in lines if l.startswith(("broadcast ", "all_reduce "))]
    assert len(body) == 4
    for cells in body:                           # the two ratio columns end every data row
        assert all(float(c.rstrip("x")) > 0 for c in cells[-2:])
    rows = read_csv(out)
    for lib in ("accord", "gloo"):
        check_rows(rows, lib, ["broadcast", "all_reduce"], [8, 1024])
    text = md.read_text()
    assert "accord bench" in text and "| op | size |" in text and "lat accord/gloo" in text
    if want_plot:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_libraries_are_skipped_with_a_reason(monkeypatch):
    import accord.cli.bench as bench_mod
    real = bench_mod.importlib.util.find_spec
    monkeypatch.setattr(bench_mod.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("torch", "mpi4py") else real(name, *a))
    assert bench_mod.availability("gloo") == "torch is not installed"
    assert bench_mod.availability("mpi") == "mpi4py is not installed"
    assert bench_mod.availability("accord") is None


def test_ratios_below_a_hundredth_keep_two_digits():
    from accord.cli.bench import _fr
    assert [_fr(r) for r in (None, 0.0, 0.0041, 0.0123, 1.5, 250.0)] == \
        ["-", "0.00x", "0.0041x", "0.01x", "1.50x", "250x"]


def test_merge_runs_takes_the_median():
    from accord.cli.bench import merge_runs
    base = {"lib": "accord", "world": 2, "op": "broadcast", "size_bytes": 1 << 20,
            "op_p50_us": 1.0, "blk_min_us": 1.0, "iters": 1, "blocks": 1, "verified": True}
    runs = [[dict(base, lat_us=lat)] for lat in (300.0, 100.0, 200.0)]
    (row,) = merge_runs(runs)
    assert row["lat_us"] == 200.0 and row["repeats"] == 3
    assert abs(row["busbw_GBps"] - (1 << 20) / 200e-6 / 1e9) < 1e-9


P2P = ["pingpong", "p2p_bw", "halo"]


def available(lib):
    from accord.cli.bench import availability
    return availability(lib) is None


@pytest.mark.timeout(90)
def test_quick_p2p_compare(tmp_path):
    """pingpong, p2p_bw and halo rows for accord and every comparison library installed here,
    verified, in the table (ratio columns), the CSV and the markdown."""
    others = [lib for lib in ("gloo", "mpi") if available(lib)]
    out, md = tmp_path / "out.csv", tmp_path / "table.md"
    extra = ["--compare", ",".join(others)] if others else []
    p = bench("--quick", "-n", "2", "--ops", ",".join(P2P), "--sizes", "8,1K",
              "--csv", str(out), "--markdown", str(md), *extra, timeout=80)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    body = [l.split() for l in lines if l.startswith(("pingpong ", "p2p_bw ", "halo "))]
    assert len(body) == 6
    if others:
        for cells in body:                       # ratio columns end every data row
            ratios = [float(c.rstrip("x")) for c in cells[-2 * len(others):]]
            # (lat accord/X, busbw accord/X) per library; a busbw ratio of a slow run
            # prints as 0.00x at two decimals, a latency ratio is never 0
            assert all(r > 0 for r in ratios[0::2]) and all(r >= 0 for r in ratios[1::2]), cells
    assert "osu_latency" in p.stdout and "osu_bw" in p.stdout   # the legend says how
    rows = read_csv(out)
    labels = ["accord"] + [{"mpi": "mpich"}.get(o, o) for o in others]
    for lib in labels:
        check_rows(rows, lib, P2P, [8, 1024])
        for r in rows:
            if r["lib"] == lib and r["op"] in P2P:
                assert int(r["msgs_per_iter"]) == {"pingpong": 2, "p2p_bw": 64, "halo": 1}[r["op"]]
                assert r["algbw_GBps"] == r["busbw_GBps"]
    text = md.read_text()
    assert "| pingpong | 8 B |" in text and "| p2p_bw | 1 KiB |" in text
    assert "| halo | 8 B |" in text and "both neighbours of a ring" in text


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_quick_p2p_accord_world3(tmp_path, transport):
    """accord's p2p rows over each transport, at world 3 (rank 2 only joins pingpong's and
    p2p_bw's barriers; every rank exchanges halos), with a message above 1 MiB (window of
    4) next to a collective on the same size."""
    out = tmp_path / "out.csv"
    p = bench("--quick", "-n", "3", "--transport", transport, "--ops", "pingpong,p2p_bw,halo,broadcast",
              "--sizes", "8,2M", "--csv", str(out), timeout=80)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = read_csv(out)
    check_rows(rows, "accord", P2P + ["broadcast"], [8, 2 << 20], world=3)
    assert {r["transport"] for r in rows} == {transport}
    bw = [r for r in rows if r["op"] == "p2p_bw" and r["size_bytes"] == str(2 << 20)]
    assert int(bw[0]["msgs_per_iter"]) == 4


class _Loopback:
    """A fake endpoint for one rank: receives deliver `incoming` (or garbage)."""

    def __init__(self, incoming):
        self.incoming, self.to_buf = incoming, lambda a: a

    def send(self, buf, peer, tag):
        pass

    def recv(self, buf, peer, tag):
        buf[:] = self.incoming if buf.size == self.incoming.size else 3.0

    isend = send

    def irecv(self, buf, peer, tag):
        self.recv(buf, peer, tag)

    def wait_all(self, works):
        pass


def test_p2p_verify_catches_wrong_data():
    import numpy as np
    from accord.cli.bench_p2p import p2p_ops, pattern
    numel = 256
    for incoming, want in ((pattern(numel, 0), True), (pattern(numel, 1), False),
                           (np.zeros(numel, np.float32), False)):
        ops, verify = p2p_ops(_Loopback(incoming), 1, 2, numel * 4)
        assert verify([]) is True                # nothing checked before an op has run
        ops["pingpong"]()
        ops["p2p_bw"]()
        ops["halo"]()                            # both neighbours are rank 0
        assert verify(P2P) is want
    ops, verify = p2p_ops(_Loopback(pattern(numel, 0)), 2, 3, numel * 4)   # idle rank
    assert ops["pingpong"]() is None and verify(["pingpong", "p2p_bw"]) is True


class _ByPeer(_Loopback):
    """A fake endpoint whose receives from `peer` deliver pattern(peer + shift)."""

    def __init__(self, numel, shift):
        self.numel, self.shift, self.to_buf = numel, shift, lambda a: a

    def recv(self, buf, peer, tag):
        from accord.cli.bench_p2p import pattern
        buf[:] = pattern(self.numel, (peer + self.shift) % 3)


def test_halo_verify_checks_each_neighbour():
    """At world 3, rank 2's halo takes rank 1's message on the left and rank 0's on
    the right: the check fails where the neighbours' messages are swapped."""
    from accord.cli.bench_p2p import p2p_ops
    numel = 64
    for shift, want in ((0, True), (1, False), (2, False)):
        ops, verify = p2p_ops(_ByPeer(numel, shift), 2, 3, numel * 4)
        assert verify(["halo"]) is False         # nothing received yet: zeros
        ops["halo"]()
        assert verify(["pingpong", "p2p_bw", "halo"]) is want
