"""torchrun's agent store: meeting through the TCPStore its agent already hosts.

Under torchrun with TORCHELASTIC_USE_AGENT_STORE=true the elastic agent hosts
the job's store and MASTER_PORT is its port, so rank 0 must not start one of
its own. That store speaks torch's protocol, so the client is torch's, seen
through accord's Store protocol.

torch is imported only inside the functions: this path is taken only under
torchrun, where torch is installed, and `import accord` must not need torch.
Nothing here imports accord.torch (the backend), which sits above the api.
"""
import datetime
import os

from ..options import to_seconds
from ..store import timeout_error


class TorchStore:
    """A torch.distributed Store seen through accord's Store protocol."""

    def __init__(self, store, timeout):
        self._s = store
        self._timeout = float(timeout)

    @property
    def timeout(self):
        return self._timeout

    def set_timeout(self, timeout):
        self._timeout = to_seconds(timeout)

    def set(self, key, value):
        self._s.set(key, value)

    def get(self, key, timeout=None):
        self.wait([key], timeout)
        return self._s.get(key)

    def add(self, key, amount):
        return self._s.add(key, amount)

    def compare_set(self, key, expected, desired):
        return self._s.compare_set(key, expected, desired)

    def wait(self, keys, timeout=None):
        import torch.distributed as dist
        keys = [keys] if isinstance(keys, str) else list(keys)
        t = self._timeout if timeout is None else to_seconds(timeout)
        try:
            self._s.wait(keys, datetime.timedelta(seconds=t))
        except dist.DistStoreError as e:
            if "timeout" in str(e).lower() or "timed out" in str(e).lower():
                raise timeout_error("wait", keys, t) from None
            raise

    def check(self, keys):
        return self._s.check([keys] if isinstance(keys, str) else list(keys))

    def delete_key(self, key):
        return self._s.delete_key(key)

    def num_keys(self):
        return self._s.num_keys()

    def close(self):
        self._s = None


def attempt_namespace(env=None):
    """The store namespace of this torchrun attempt, or None outside torchrun's agent store.

    torchrun's agent keeps one store for the whole job (static and c10d
    rendezvous alike, torch 2.13) and starts the workers of every restart
    attempt on it without a prefix, so what the workers of a failed attempt
    wrote (each rank's address, its shared-memory arena) is still there when
    the next attempt's workers meet: a rank that reads such a key before its
    peer has written it anew follows the dead process's address and waits for
    it. The attempt's number (TORCHELASTIC_RESTART_COUNT) keeps each attempt's
    keys apart, as torch's own env:// rendezvous once did
    ("/worker/attempt_N").

    Returns "/accord/attempt_N" when TORCHELASTIC_USE_AGENT_STORE is true in
    `env` (default os.environ), else None.
    """
    env = os.environ if env is None else env
    if env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None
    return f"/accord/attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def attempt_store(store, env=None):
    """`store` (a torch Store) seen through this torchrun attempt's namespace.

    Unchanged outside torchrun's agent store; see attempt_namespace.
    """
    prefix = attempt_namespace(env)
    if prefix is None:
        return store
    import torch.distributed as dist
    return dist.PrefixStore(prefix, store)


def agent_store(host, port, timeout):
    """A client of the TCPStore torchrun's agent hosts (TORCHELASTIC_USE_AGENT_STORE)."""
    import torch.distributed as dist
    timeout = to_seconds(timeout) or 300.0
    raw = dist.TCPStore(host, int(port), is_master=False,
                        timeout=datetime.timedelta(seconds=timeout))
    # the agent's store outlives each restart attempt: a namespace per attempt
    prefix = attempt_namespace() or "/accord/attempt_0"
    return TorchStore(dist.PrefixStore(prefix, raw), timeout)
