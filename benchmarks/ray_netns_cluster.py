"""A two-node Ray cluster on one machine: `ray start` in two network namespaces.

Namespace A runs the head (`ray start --head`), namespace B a worker node
(`ray start --address=A:port`); a veth pair joins them (optionally capped
with tc tbf), so the nodes reach each other only over that link, as two
machines would. Each node's processes get ACCORD_HOST_ID=<its namespace>: the
namespaces share one kernel, and accord would otherwise take them for one
host (and use shared memory between them). Needs root (ip netns).

    with TwoNodeCluster() as c:     # NamespacesUnavailable (why) where the machine refuses
        c.run_driver("job.py", "--address", c.address, "--node-ip", c.ips[0])

A driver in namespace A passes the head's address as its node IP
(ray.init(_node_ip_address=...)): Ray would guess it from the host name,
which resolves outside the namespace.

Only what this starts is stopped: each `ray start --block` runs in a session
of its own, and teardown signals those process groups, by id, then deletes
the namespaces; `ray stop` is never used (it stops every Ray on the machine).
"""
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


class NamespacesUnavailable(RuntimeError):
    """This machine does not let us build the namespaces (not root, no ip, no veth)."""


def _sh(*cmd, timeout=20):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


class TwoNodeCluster:
    """Two namespaces, a veth pair, a Ray head in one and a Ray worker node in the other."""

    def __init__(self, rate=None, cpus_per_node=2, python=sys.executable):
        tag = f"ray{os.getpid() % 100000}"
        self.ns = (f"{tag}a", f"{tag}b")
        self.veth = (f"{tag}va", f"{tag}vb")
        net = f"10.{random.randint(100, 250)}.{random.randint(1, 250)}"
        self.ips = (f"{net}.1", f"{net}.2")
        self.port = 6379
        self.address = f"{self.ips[0]}:{self.port}"
        self.rate, self.cpus, self.python = rate, cpus_per_node, python
        self.temp = [f"/tmp/{tag}{s}" for s in "ab"]   # short: Ray's socket paths live there
        self.procs = []
        self.logs = []
        # Ray 2.60 authenticates clients of a cluster by a token: this cluster's own
        self.token = secrets.token_hex(32)

    # -- lifetime ----------------------------------------------------------------------
    def __enter__(self):
        try:
            self._network()
            self._node(0, ["--head", f"--port={self.port}", "--include-dashboard=false"])
            self._wait_nodes(1, 90)
            self._node(1, [f"--address={self.address}"])
            self._wait_nodes(2, 90)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        """Stop both nodes, delete the namespaces and the nodes' temporary directories.

        The worker node first: on SIGTERM it leaves in about a second while the head
        still answers it. The head's own orderly stop takes half a minute (seen with
        Ray 2.60), for nothing this throwaway cluster needs: SIGKILL after a short grace.
        Then whatever is left in either node's session: Ray's idle workers sit in
        process groups of their own, and would otherwise linger until they notice.
        """
        for p, grace in zip(reversed(self.procs), [8.0] * (len(self.procs) - 1) + [1.0]):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
            try:
                p.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
            for pid in [p.pid] + _session(p.pid):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            p.wait()
        self.procs = []
        for f in self.logs:
            f.close()
        for ns in self.ns:
            _sh("ip", "netns", "del", ns)
        for d in self.temp:
            shutil.rmtree(d, ignore_errors=True)

    # -- pieces ------------------------------------------------------------------------
    def _network(self):
        if os.geteuid() != 0:
            raise NamespacesUnavailable("network namespaces need root")
        (a, b), (va, vb), (ia, ib) = self.ns, self.veth, self.ips
        steps = [["ip", "netns", "add", a], ["ip", "netns", "add", b],
                 ["ip", "link", "add", va, "type", "veth", "peer", "name", vb],
                 ["ip", "link", "set", va, "netns", a], ["ip", "link", "set", vb, "netns", b],
                 ["ip", "-n", a, "addr", "add", f"{ia}/24", "dev", va],
                 ["ip", "-n", b, "addr", "add", f"{ib}/24", "dev", vb],
                 ["ip", "-n", a, "link", "set", va, "up"], ["ip", "-n", b, "link", "set", vb, "up"],
                 ["ip", "-n", a, "link", "set", "lo", "up"], ["ip", "-n", b, "link", "set", "lo", "up"]]
        if self.rate:
            for ns, dev in ((a, va), (b, vb)):
                steps.append(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root",
                              "tbf", "rate", self.rate, "burst", "256kb", "latency", "100ms"])
        for cmd in steps:
            try:
                res = _sh(*cmd)
            except FileNotFoundError as e:
                raise NamespacesUnavailable(f"cannot build network namespaces here: {e}") from None
            if res.returncode != 0:
                raise NamespacesUnavailable(f"cannot build network namespaces here: {' '.join(cmd)}: "
                                   f"{res.stderr.strip()}")

    def env(self, node):
        """The environment of node's processes (and of a driver run there)."""
        path = [REPO] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        return dict(os.environ, ACCORD_HOST_ID=self.ns[node], PYTHONPATH=os.pathsep.join(path),
                    RAY_USAGE_STATS_ENABLED="0", ACCORD_TIMEOUT="60", RAY_AUTH_MODE="token",
                    RAY_AUTH_TOKEN=self.token,
                    # gloo finds its address from the host name, which resolves outside
                    GLOO_SOCKET_IFNAME=self.veth[node])

    def _node(self, node, args):
        ray_cli = os.path.join(os.path.dirname(self.python), "ray")
        log = open(os.path.join("/tmp", f"{self.ns[node]}.log"), "w+")
        self.logs.append(log)
        cmd = ["ip", "netns", "exec", self.ns[node], ray_cli, "start", "--block",
               f"--node-ip-address={self.ips[node]}", f"--num-cpus={self.cpus}",
               f"--temp-dir={self.temp[node]}", "--disable-usage-stats"] + args
        self.procs.append(subprocess.Popen(cmd, env=self.env(node), stdout=log,
                                           stderr=subprocess.STDOUT, start_new_session=True))

    def _wait_nodes(self, n, timeout):
        code = ("import ray, sys; ray.init(address=sys.argv[1], _node_ip_address=sys.argv[2], "
                "log_to_driver=False); print(sum(1 for x in ray.nodes() if x['Alive']))")
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"ray start exited with {p.returncode}:\n{self.log_text()}")
            res = self.run_driver("-c", code, self.address, self.ips[0], timeout=60)
            last = res.stdout.strip().splitlines()[-1:] or [res.stderr[-500:]]
            if res.returncode == 0 and last[0].isdigit() and int(last[0]) >= n:
                return
            time.sleep(1)
        raise RuntimeError(f"the cluster did not reach {n} nodes in {timeout} s: {last}\n"
                           f"{self.log_text()}")

    def run_driver(self, *args, timeout=300):
        """python ARGS in namespace A (the head's), with the nodes' environment."""
        return subprocess.run(["ip", "netns", "exec", self.ns[0], self.python, *args],
                              env=self.env(0), capture_output=True, text=True, timeout=timeout)

    def log_text(self):
        out = []
        for f in self.logs:
            f.flush()
            f.seek(0)
            out.append(f.read()[-3000:])
        return "\n".join(out)


def _session(sid):
    """The process groups of session sid (the node's `ray start` and everything it
    started), other than sid's own."""
    groups = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pgrp, session = int(fields[2]), int(fields[3])
        if session == sid and pgrp != sid:
            groups.add(pgrp)
    return sorted(groups)
