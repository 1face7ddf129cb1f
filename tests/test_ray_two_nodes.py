"""A real two-node Ray cluster: `ray start --head` in one network namespace, `ray start
--address=...` in another, a veth pair between them (benchmarks/ray_netns_cluster.py).

Four actors, two on each node, form one ACCORD group: an all_reduce and a
broadcast are correct, and the group runs hierarchically, shared memory on
each node and one leader per node on the veth link. Needs root (ip netns):
skipped with the reason where the machine does not allow it. The nodes and
the namespaces are removed even when the test fails.
"""
import json
import os
import sys

import pytest

pytest.importorskip("ray", reason="the Ray tests need ray (pip install accord[ray])")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from ray_netns_cluster import NamespacesUnavailable, TwoNodeCluster  # noqa: E402

BENCH = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "bench_ray_collective.py")

# one xdist worker runs every Ray test file (each starts a local Ray cluster)
pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("ray")]


@pytest.fixture
def cluster():
    c = TwoNodeCluster()
    try:
        c.__enter__()
    except NamespacesUnavailable as e:
        pytest.skip(str(e))
    try:
        yield c
    finally:
        c.close()


def test_group_across_two_nodes_is_hierarchical(cluster):
    res = cluster.run_driver(BENCH, "--address", cluster.address, "--node-ip", cluster.ips[0],
                             "--per-node", "2", "--check", timeout=240)
    assert res.returncode == 0, res.stderr[-4000:] + cluster.log_text()
    members = json.loads(res.stdout.strip().splitlines()[-1])
    assert [m["rank"] for m in members] == [0, 1, 2, 3]
    nodes = [m["node"] for m in members]
    assert nodes[0] == nodes[1] != nodes[2] == nodes[3]         # two actors on each node
    assert all(m["allreduce_ok"] and m["broadcast_ok"] for m in members)
    assert all(m["hierarchical"] for m in members)
    # one leader per node (its first rank), and the leaders' group has one rank per node
    assert [m["leader"] for m in members] == [True, False, True, False]
    assert [m["leaders"] for m in members if m["leader"]] == [2, 2]
