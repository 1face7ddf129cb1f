"""Find rank, world size and a shared store, however the job was started.

Sources, in order: explicit arguments; torchrun / `accord run` (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT); Open MPI (OMPI_COMM_WORLD_*); MPICH
hydra (PMI_*); Slurm's srun (SLURM_*). Under an MPI or Slurm launcher without
MASTER_PORT, every rank derives the same port from the job's identity.
Under torchrun's agent store the client is torch's own (torchelastic.py).
"""
import logging
import os
import re
import urllib.parse
import zlib

from ..netif import split_host_port, strip_brackets
from ..store import FileStore, PrefixStore
from ..store_process import HostedStore
from ..tcpstore import AddressInUse, TCPStore
from .torchelastic import agent_store

_log = logging.getLogger("accord")

_RANK_VARS = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")
_SIZE_VARS = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")
_LOCAL_RANK_VARS = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")


def _first_int(env, names):
    for name in names:
        v = env.get(name)
        if v not in (None, ""):
            try:
                return int(v), name
            except ValueError:
                raise ValueError(f"environment variable {name}={v!r} is not an integer") from None
    return None, None


def rank_and_size(rank, world_size, env=None):
    env = os.environ if env is None else env
    if rank is None or rank < 0:
        rank, _ = _first_int(env, _RANK_VARS)
    if world_size is None or world_size < 0:
        world_size, _ = _first_int(env, _SIZE_VARS)
    if rank is None or world_size is None:
        raise ValueError("init_process_group: rank and world_size are unknown: pass rank= and "
                         "world_size=, or start the script with `accord run -n N`, torchrun, "
                         "mpiexec or srun (which set RANK/WORLD_SIZE or their equivalents)")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    return rank, world_size


def local_rank(env=None):
    value, _ = _first_int(os.environ if env is None else env, _LOCAL_RANK_VARS)
    return value


def _job_identity(env):
    if env.get("SLURM_JOB_ID"):
        return f"slurm:{env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID', '')}"
    for name in ("OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE", "OMPI_MCA_orte_hnp_uri"):
        if env.get(name):
            return f"ompi:{env[name]}"
    if env.get("PMI_RANK") is not None:
        # hydra names no job id; its per-node proxy is every local rank's parent
        return f"hydra:{os.getppid()}"
    return None


def _slurm_first_host(env):
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if not nodes:
        return None
    m = re.match(r"([^,\[]+)(?:\[(\d+))?", nodes)
    return m.group(1) + (m.group(2) or "") if m else None


def master_address(env=None):
    env = os.environ if env is None else env
    addr = strip_brackets(env.get("MASTER_ADDR")) or _slurm_first_host(env) or "127.0.0.1"
    port = env.get("MASTER_PORT")
    if port:
        return addr, int(port)
    job = _job_identity(env)
    if job is None:
        raise ValueError("init_process_group(init_method='env://'): MASTER_PORT is not set; "
                         "start the script with `accord run`, or set MASTER_ADDR and MASTER_PORT")
    # below Linux's ephemeral range (32768 up), where a local client's own source
    # port may be the one it dials
    return addr, 20000 + zlib.crc32(job.encode()) % 12768


def _rank0_store(host, port, world_size, timeout, restarted):
    """Rank 0's store where no launcher hosts one: the server in a process of its own
    (store_process.py), so that rank 0's death leaves the survivors their store. A
    restarted process (restarted: ACCORD_RESTART_COUNT > 0) finds it still there and
    is a client like the others."""
    if restarted:
        return TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    try:
        return HostedStore(host, port, world_size, timeout=timeout)
    except AddressInUse:
        raise
    except OSError as e:
        # no interpreter to start (an embedded Python, say): serve it from this process,
        # as torch does, and say what that costs
        _log.warning("accord: cannot start the store's own process (%s); rank 0 serves it "
                     "itself, and its death will end the job", e)
        return TCPStore(host, port, world_size, is_master=True, timeout=timeout)


def make_store(init_method, rank, world_size, timeout, launcher_store, env=None,
               restarted=False):
    """The store of the default group, before job-generation prefixing.

    launcher_store: "host:port" of a store `accord run` already hosts, or "".
    restarted: this process is a restart joining a running job (it never hosts the
    store: the job's is still up).
    """
    env = os.environ if env is None else env
    url = urllib.parse.urlparse(init_method)
    if url.scheme == "env":
        if launcher_store:
            host, port = split_host_port(launcher_store)
            return TCPStore(host, int(port), world_size, is_master=False, timeout=timeout)
        host, port = master_address(env)
        if env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
            # torchrun's agent hosts a torch TCPStore
            return agent_store(host, port, timeout)
        if rank == 0:
            return _rank0_store(host, port, world_size, timeout, restarted)
        return TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    if url.scheme == "tcp":
        if not url.hostname or not url.port:
            raise ValueError(f"init_method {init_method!r}: expected tcp://host:port")
        if rank == 0:
            return _rank0_store(url.hostname, url.port, world_size, timeout, restarted)
        return TCPStore(url.hostname, url.port, world_size, is_master=False, timeout=timeout)
    if url.scheme == "file":
        path = urllib.parse.unquote(url.path)
        if not path:
            raise ValueError(f"init_method {init_method!r}: expected file:///absolute/path")
        return FileStore(path, world_size, timeout=timeout)
    raise ValueError(f"init_method {init_method!r}: expected env://, tcp://host:port or "
                     f"file:///path")


def job_prefix(store, world_size):
    """Keys of one init generation: re-initialising on the same store never collides."""
    generation = (store.add("accord/init", 1) - 1) // world_size
    return PrefixStore(f"accord/{generation}", store)
