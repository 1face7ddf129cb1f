"""Frozen options read from the environment: the only reader of ACCORD_* variables."""
import datetime
import os
from dataclasses import dataclass, field
from typing import Optional

DEFAULT_TIMEOUT = 1800.0
# a Ray group's members are actors already running when they are told to join:
# a minute is long for them to straggle, and short for a missing one to be noticed
DEFAULT_RAY_JOIN_TIMEOUT = 60.0
_TRANSPORTS = ("auto", "shm", "tcp")
_DEBUG_LEVELS = ("OFF", "INFO", "DETAIL")


def to_seconds(timeout, name="timeout"):
    """Accept seconds (int/float) or a timedelta; None stays None."""
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"{name} must be seconds (float) or a datetime.timedelta, "
                        f"not {type(timeout).__name__}")
    if not timeout > 0:
        raise ValueError(f"{name} must be positive, got {timeout}")
    return float(timeout)


def _parse_algorithms(text):
    """'broadcast=chain,all_reduce=ring' -> {'broadcast': 'chain', ...}."""
    out = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        op, sep, algo = item.partition("=")
        if not sep or not op.strip() or not algo.strip():
            raise ValueError(f"ACCORD_ALGORITHMS: expected op=algorithm, got {item!r}")
        out[op.strip()] = algo.strip()
    return out


def _parse_host_port(text, name):
    """'host:port' (or '') -> the same text, checked."""
    text = text.strip()
    if not text:
        return ""
    if text.startswith("["):            # [v6]:port
        host, sep, port = text[1:].partition("]")
        sep, port = (sep, port[1:]) if port.startswith(":") else ("", "")
    else:
        host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{name} must be host:port, got {text!r}")
    return text


def _parse_ifname(text):
    """ACCORD_SOCKET_IFNAME, checked for shape only (which interfaces exist is
    accord/netif.py's business, asked when a process picks its address)."""
    text = text.strip()
    body = text.lstrip("^").lstrip("=")
    if text and not any(n.strip() for n in body.split(",")):
        raise ValueError(f"ACCORD_SOCKET_IFNAME: expected an interface name, a comma list or "
                         f"a ^ exclusion list, got {text!r}")
    return text


_TLS_VARS = {"tls_cert": "ACCORD_TLS_CERT", "tls_key": "ACCORD_TLS_KEY", "tls_ca": "ACCORD_TLS_CA"}


def _parse_tls(env):
    """The ACCORD_TLS_* files: none, or all three (mutual authentication needs each)."""
    got = {f: env.get(v, "").strip() for f, v in _TLS_VARS.items()}
    missing = [v for f, v in _TLS_VARS.items() if not got[f]]
    if any(got.values()) and missing:
        raise ValueError(f"TLS needs ACCORD_TLS_CERT, ACCORD_TLS_KEY and ACCORD_TLS_CA together "
                         f"(mutual authentication); missing: {', '.join(missing)}")
    return got


def _parse_bytes(text, name, default):
    """'64M', '1g', '65536' -> bytes; '' -> default."""
    text = text.strip().lower()
    if not text:
        return default
    body = text[:-1] if text.endswith("b") and len(text) > 1 and not text[-2].isdigit() else text
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(body[-1:], 1)
    digits = body[:-1] if mult != 1 else body
    if not digits.isdigit():
        raise ValueError(f"{name} must be a byte count like 65536, 64M or 1G, got {text!r}")
    return int(digits) * mult


def _parse_count(text, name):
    """A whole number >= 0 ('' -> 0): ACCORD_RESTART_COUNT, ACCORD_MAX_RESTARTS."""
    text = text.strip()
    if not text:
        return 0
    if not text.isdigit():
        raise ValueError(f"{name} must be a whole number >= 0, got {text!r}")
    return int(text)


def _parse_seconds(text, name, default):
    """A positive number of seconds ('' -> default)."""
    text = text.strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name}: expected a number of seconds, got {text!r}") from None
    return to_seconds(value, name)


def _parse_slot(text):
    """ACCORD_LAUNCH_SLOT: `accord run`'s name for a process, RANK.RESTARTS ('' without
    the launcher). It is part of a process's published identity, whose fields '/'
    separates."""
    text = text.strip()
    if "/" in text:
        raise ValueError(f"ACCORD_LAUNCH_SLOT must not contain '/' (accord run sets it to "
                         f"RANK.RESTARTS), got {text!r}")
    return text


# point-to-point messages go single-copy from this size where ACCORD_SHM_P2P_CMA and
# ACCORD_SHM_CMA are unset and every rank has a core (the reasons at
# Options.shm_p2p_cma_min)
SHM_P2P_CMA_DEFAULT = 8 << 20


@dataclass(frozen=True)
class Options:
    timeout: float = DEFAULT_TIMEOUT
    transport: str = "auto"
    host_id: str = ""
    debug: str = "OFF"
    trace_dir: str = ""
    # Forced algorithm per collective (tests use it to cover every path).
    algorithms: dict = field(default_factory=dict)
    # Address other hosts reach this process on; empty means "work it out".
    addr: str = ""
    # "host:port" of the rendezvous store hosted by `accord run` (every rank,
    # rank 0 included, connects to it as a client); empty when there is none.
    launcher_store_addr: str = ""
    # Shared secret a TCPStore client must prove it knows (ACCORD_STORE_TOKEN;
    # `accord run` generates one for the store it hosts). Empty: no check.
    store_token: str = ""
    # Bytes of shared memory per group per host (the rings between its local ranks).
    shm_arena: int = 64 << 20
    # Messages of at least this many bytes go single-copy (process_vm_readv) where
    # the kernel allows it; 0 turns that off. None (ACCORD_SHM_CMA unset): measured
    # when a group is created, 1 or 4 MiB (transport/cma_threshold.py): on AMD EPYC
    # guests the rings were faster from 1 to 4 MiB (paired rounds at world 2: all_gather
    # 0.74x, scatter 0.65x, broadcast 0.94x the time at 1 MiB), on an Intel Xeon guest
    # single copy from 1 MiB was (broadcast and scatter 1 MiB 0.48x the time)
    shm_cma_min: Optional[int] = None
    # The same for point-to-point messages (ACCORD_SHM_P2P_CMA; by default
    # ACCORD_SHM_CMA where that is set; None where neither is: 8 MiB, and while more
    # ranks run than there are cores what does not fit whole in a ring, transport/
    # shm.py's p2p_cma_crowded): a blocking send/recv of 1-4 MiB is
    # faster through the ring (both processes copy, the copies stay in cache) than
    # single-copy, even with the sender copying half (transport/split_message.py):
    # 4 MiB 314-399 µs against 353-547; from 6-8 MiB single copy split is faster
    # (8 MiB 527-706 µs against 786-1007, a window of isends 933-1033 against
    # 1070-1184; benchmarks/results/small-messages.md)
    shm_p2p_cma_min: Optional[int] = None
    # ACCORD_SOCKET_IFNAME: the interface(s) the data plane and the store listen on
    # ("eth0", "eth0,ib0", "=eth0", "^docker,lo"; accord/netif.py); empty: the one
    # that routes to MASTER_ADDR
    socket_ifname: str = ""
    # ACCORD_TLS_CERT / ACCORD_TLS_KEY / ACCORD_TLS_CA: PEM files; all three set turns on
    # TLS with mutual authentication for the store and the TCP transport (accord/tls.py)
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    # ACCORD_RESTART_COUNT: set by `accord run --max-restarts` on a restarted process
    # (or by hand); above 0, init_process_group() waits to be admitted (accord.admit)
    restart_count: int = 0
    # ACCORD_MAX_RESTARTS: the launcher's --max-restarts, for the program to read
    max_restarts: int = 0
    # ACCORD_LAUNCH_SLOT: what `accord run` calls this process (RANK.RESTARTS), in its
    # identity, so survivors on other hosts learn from the store that it ended
    launch_slot: str = ""
    # ACCORD_RAY_JOIN_TIMEOUT: how long a member of a Ray collective group (accord.ray)
    # waits for the others to arrive when the group is made, at most the group's timeout
    ray_join_timeout: float = DEFAULT_RAY_JOIN_TIMEOUT

    @classmethod
    def from_env(cls, environ=None):
        env = os.environ if environ is None else environ
        timeout = env.get("ACCORD_TIMEOUT")
        transport = env.get("ACCORD_TRANSPORT", "auto").strip().lower() or "auto"
        if transport not in _TRANSPORTS:
            raise ValueError(f"ACCORD_TRANSPORT must be one of {', '.join(_TRANSPORTS)}, "
                             f"got {transport!r}")
        debug = env.get("ACCORD_DEBUG", "OFF").strip().upper() or "OFF"
        if debug not in _DEBUG_LEVELS:
            raise ValueError(f"ACCORD_DEBUG must be one of {', '.join(_DEBUG_LEVELS)}, "
                             f"got {debug!r}")
        # ACCORD_SHM_CMA (None: unset) is also point-to-point's threshold where that has none
        cma = _parse_bytes(env.get("ACCORD_SHM_CMA", ""), "ACCORD_SHM_CMA", None)
        return cls(
            timeout=to_seconds(float(timeout), "ACCORD_TIMEOUT") if timeout else DEFAULT_TIMEOUT,
            transport=transport,
            host_id=env.get("ACCORD_HOST_ID", ""),
            debug=debug,
            trace_dir=env.get("ACCORD_TRACE_DIR", ""),
            algorithms=_parse_algorithms(env.get("ACCORD_ALGORITHMS", "")),
            addr=env.get("ACCORD_ADDR", ""),
            launcher_store_addr=_parse_host_port(env.get("ACCORD_LAUNCHER_STORE", ""),
                                                 "ACCORD_LAUNCHER_STORE"),
            store_token=env.get("ACCORD_STORE_TOKEN", "").strip(),
            shm_arena=_parse_bytes(env.get("ACCORD_SHM_ARENA", ""), "ACCORD_SHM_ARENA", 64 << 20),
            shm_cma_min=cma,
            shm_p2p_cma_min=_parse_bytes(env.get("ACCORD_SHM_P2P_CMA", ""),
                                         "ACCORD_SHM_P2P_CMA",
                                         cma),
            socket_ifname=_parse_ifname(env.get("ACCORD_SOCKET_IFNAME", "")),
            restart_count=_parse_count(env.get("ACCORD_RESTART_COUNT", ""),
                                       "ACCORD_RESTART_COUNT"),
            max_restarts=_parse_count(env.get("ACCORD_MAX_RESTARTS", ""), "ACCORD_MAX_RESTARTS"),
            launch_slot=_parse_slot(env.get("ACCORD_LAUNCH_SLOT", "")),
            ray_join_timeout=_parse_seconds(env.get("ACCORD_RAY_JOIN_TIMEOUT", ""),
                                            "ACCORD_RAY_JOIN_TIMEOUT", DEFAULT_RAY_JOIN_TIMEOUT),
            **_parse_tls(env),
        )
