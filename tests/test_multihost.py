"""Two hosts for real: network namespaces joined by a veth pair, one launcher in each.

Each namespace has its own network stack, so ranks on "host B" reach "host A"
only over the veth link, as separate machines would. Needs root (ip netns);
skipped with the reason where the machine does not allow it.
"""
import json
import os
import random
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(120)

SCRIPT = textwrap.dedent("""
    import os, socket, sys
    import numpy as np
    import accord as dist
    dist.init_process_group()
    r, n = dist.get_rank(), dist.get_world_size()
    hier = dist.world.default_group().hier is not None
    assert hier == (os.environ.get("EXPECT_HIER") == "1"), hier
    t = np.arange(1000, dtype=np.float64) if r == 0 else np.zeros(1000)
    dist.broadcast(t, src=0)
    assert (t == np.arange(1000)).all()
    x = np.full(300_001, r + 1, dtype=np.int64)
    dist.all_reduce(x)
    assert (x == n * (n + 1) // 2).all(), x[:4]
    outs = [np.empty(r2 + 1, np.int32) for r2 in range(n)]
    dist.all_gather(outs, np.full(r + 1, r, np.int32))
    assert all((o == i).all() for i, o in enumerate(outs))
    big = np.full(3 << 20, r, np.uint8)
    dist.broadcast(big, src=n - 1)
    assert (big == n - 1).all()
    sub = dist.new_group([1, 2])        # one rank on each host
    if sub is not None and dist.get_rank(sub) >= 0:
        y = np.ones(5)
        dist.all_reduce(y, group=sub)
        assert (y == 2).all()
    with open(os.path.join(sys.argv[1], f"ok{r}"), "w") as f:
        f.write(os.environ["MASTER_ADDR"])
    dist.destroy_process_group()
""")


def _sh(*cmd):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=20)


@pytest.fixture
def two_hosts():
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    tag = f"acc{os.getpid() % 100000}"
    net = f"10.{random.randint(100, 250)}.{random.randint(1, 250)}"
    a, b = f"{tag}a", f"{tag}b"
    steps = [
        ["ip", "netns", "add", a], ["ip", "netns", "add", b],
        ["ip", "link", "add", f"{tag}va", "type", "veth", "peer", "name", f"{tag}vb"],
        ["ip", "link", "set", f"{tag}va", "netns", a], ["ip", "link", "set", f"{tag}vb", "netns", b],
        ["ip", "-n", a, "addr", "add", f"{net}.1/24", "dev", f"{tag}va"],
        ["ip", "-n", b, "addr", "add", f"{net}.2/24", "dev", f"{tag}vb"],
        ["ip", "-n", a, "link", "set", f"{tag}va", "up"], ["ip", "-n", b, "link", "set", f"{tag}vb", "up"],
        ["ip", "-n", a, "link", "set", "lo", "up"], ["ip", "-n", b, "link", "set", "lo", "up"],
    ]
    try:
        for cmd in steps:
            res = _sh(*cmd)
            if res.returncode != 0:
                pytest.skip(f"cannot build network namespaces here: {' '.join(cmd)}: "
                            f"{res.stderr.strip()}")
        yield (a, f"{net}.1"), (b, f"{net}.2")
    finally:
        _sh("ip", "netns", "del", a)
        _sh("ip", "netns", "del", b)


def _run_on_two_hosts(hosts, addr_a, script, tmp_path, extra=()):
    """One `accord run --nnodes 2 -n 2` per namespace host, node ranks in order;
    hosts: [(namespace, env)]. Returns [(exit status, output)] per host (fails the
    test if a host's launcher is not done within 90 s)."""
    port = str(random.randint(20000, 40000))
    procs = []
    for node, (ns, env) in enumerate(hosts):
        procs.append(subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-m", "accord", "run", "--nnodes", "2",
             "--node-rank", str(node), "--master-addr", addr_a, "--master-port", port, "-n", "2",
             *extra, str(script), str(tmp_path)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=90)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("multi-host job hung:\n" + "\n".join(outs))
    return [(p.returncode, out) for p, out in zip(procs, outs)]


@pytest.mark.parametrize("mode", ["tcp", "hierarchical"])
def test_two_hosts_over_veth(two_hosts, tmp_path, mode):
    # namespaces share the kernel (and its host identity): ACCORD_HOST_ID tells the hosts
    # apart, so that auto gives each its shared memory and the leaders the veth link
    (ns_a, addr_a), (ns_b, addr_b) = two_hosts
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    hosts = []
    for ns in (ns_a, ns_b):
        env = dict(os.environ, ACCORD_TIMEOUT="60")
        if mode == "tcp":
            env.update(ACCORD_TRANSPORT="tcp", EXPECT_HIER="0")
        else:
            env.update(ACCORD_TRANSPORT="auto", ACCORD_HOST_ID=ns, EXPECT_HIER="1")
        hosts.append((ns, env))
    for status, out in _run_on_two_hosts(hosts, addr_a, script, tmp_path):
        assert status == 0, out
    for r in range(4):
        assert (tmp_path / f"ok{r}").read_text() == addr_a


@pytest.fixture
def two_hosts_v6(two_hosts):
    """two_hosts with an IPv6 address on each end of the veth pair as well (no duplicate
    address detection, so they are usable at once)."""
    (ns_a, _), (ns_b, _) = two_hosts
    out = []
    for ns, addr in ((ns_a, "fd42:acc::1"), (ns_b, "fd42:acc::2")):
        dev = ns[:-1] + "v" + ns[-1]
        res = _sh("ip", "-n", ns, "addr", "add", f"{addr}/64", "dev", dev, "nodad")
        if res.returncode != 0:
            pytest.skip(f"cannot add an IPv6 address: {res.stderr.strip()}")
        out.append((ns, addr, dev))
    return out


def test_two_hosts_over_ipv6_with_socket_ifname(two_hosts_v6, tmp_path):
    # every rank and both launchers' stores pick the veth by name; the store listens on
    # that interface's IPv6 address only
    (ns_a, addr_a, dev_a), (ns_b, _, dev_b) = two_hosts_v6
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    hosts = [(ns, dict(os.environ, ACCORD_TIMEOUT="60", ACCORD_TRANSPORT="tcp", EXPECT_HIER="0",
                       ACCORD_SOCKET_IFNAME=dev, ACCORD_STORE_TOKEN="shared-by-both-hosts"))
             for ns, dev in ((ns_a, dev_a), (ns_b, dev_b))]
    for status, out in _run_on_two_hosts(hosts, addr_a, script, tmp_path):
        assert status == 0, out
    for r in range(4):
        assert (tmp_path / f"ok{r}").read_text() == addr_a


def test_socket_ifname_matching_nothing_fails_every_rank_at_once(two_hosts, tmp_path):
    (ns_a, addr_a), _ = two_hosts
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, ACCORD_TIMEOUT="60", ACCORD_SOCKET_IFNAME="nosuch0",
               ACCORD_STORE_TOKEN="t")
    p = subprocess.run(["ip", "netns", "exec", ns_a, sys.executable, "-m", "accord", "run",
                        "-n", "2", "--master-addr", addr_a, str(script), str(tmp_path)],
                       env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0
    assert "nosuch0" in p.stdout + p.stderr


SHRINK_SCRIPT = textwrap.dedent("""
    import json, os, signal, sys, time
    import numpy as np
    import accord as dist
    dist.init_process_group()
    r = dist.get_rank()
    dist.barrier()
    if r == 3:
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)     # a rank of host B dies
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 30:
            dist.all_reduce(np.ones(1 << 16, np.float32))
    except (dist.PeerLost, dist.GroupClosed):
        pass
    dist.shrink(timeout=30)
    x = np.full(300_001, r + 1, dtype=np.int64)
    dist.all_reduce(x)
    hier = dist.world.default_group().hier is not None
    with open(os.path.join(sys.argv[1], f"ok{r}"), "w") as f:
        json.dump([dist.get_rank(), dist.get_world_size(), int(x.min()), int(x.max()), hier], f)
    dist.destroy_process_group()
""")


@pytest.mark.parametrize("mode,token", [("tcp", ""), ("hierarchical", ""),
                                        ("tcp", "shared-by-both-hosts")])
def test_a_rank_on_the_second_host_dies_and_the_others_shrink(two_hosts, tmp_path, mode,
                                                               token):
    # every rank's host is its namespace (ACCORD_HOST_ID): ranks 0 and 1 on host A cannot
    # look at host B's processes and learn of rank 3's death from host B's launcher, which
    # marks its slot ended in the store on host A (proving ACCORD_STORE_TOKEN, when the
    # job has one, though that launcher hosts no store of its own)
    (ns_a, addr_a), (ns_b, _) = two_hosts
    script = tmp_path / "job.py"
    script.write_text(SHRINK_SCRIPT)
    hosts = []
    for ns in (ns_a, ns_b):
        env = dict(os.environ, ACCORD_TIMEOUT="60", ACCORD_HOST_ID=ns,
                   ACCORD_TRANSPORT="tcp" if mode == "tcp" else "auto")
        if token:
            env["ACCORD_STORE_TOKEN"] = token
        hosts.append((ns, env))
    runs = _run_on_two_hosts(hosts, addr_a, script, tmp_path, extra=("--keep-going",))
    for status, out in runs:
        assert status == 0, out
    outs = [out for _, out in runs]
    assert "rank 3 was killed by SIGKILL" in outs[1], outs[1]
    assert "cannot mark rank 3 ended" not in outs[1], outs[1]
    want_hier = mode == "hierarchical"      # host A's two ranks and host B's one
    for r in range(3):
        got = json.loads((tmp_path / f"ok{r}").read_text())
        assert got == [r, 3, 6, 6, want_hier], (r, got, outs)
    assert not (tmp_path / "ok3").exists()
