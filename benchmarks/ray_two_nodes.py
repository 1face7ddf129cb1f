"""accord vs gloo through ray.util.collective on a two-node Ray cluster of network namespaces.

    sudo .venv/bin/python benchmarks/ray_two_nodes.py [--rate 1gbit] [bench_ray_collective args]

Starts the cluster (ray_netns_cluster.py: a Ray head in one namespace, a
worker node in the other, a veth pair between them, capped with tc tbf when
--rate is given), runs bench_ray_collective.py from the head's namespace, prints its
table, and stops the cluster.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ray_netns_cluster import TwoNodeCluster  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", default=None, help="tc tbf rate of the veth link (default: none)")
    args, rest = ap.parse_known_args()
    bench = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_ray_collective.py")
    with TwoNodeCluster(rate=args.rate) as c:
        print(f"two Ray nodes: head {c.ips[0]} ({c.ns[0]}), worker {c.ips[1]} ({c.ns[1]})"
              + (f", veth capped at {args.rate}" if args.rate else ", veth uncapped"))
        res = c.run_driver(bench, "--address", c.address, "--node-ip", c.ips[0], *rest,
                           timeout=1200)
        print(res.stdout)
        if res.returncode != 0:
            print(res.stderr[-4000:], file=sys.stderr)
            sys.exit(res.returncode)


if __name__ == "__main__":
    main()
