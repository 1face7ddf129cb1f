"""Which network a job uses: interfaces, ACCORD_SOCKET_IFNAME, addresses (IPv4 and IPv6).

ACCORD_SOCKET_IFNAME is spelled as NCCL_SOCKET_IFNAME (and GLOO_SOCKET_IFNAME,
for a single name): `eth0` selects the interfaces whose names start with eth0,
`=eth0` only the one named exactly eth0, a comma list several (the first
listed that has an address is used), `^docker,lo` every interface except
those. A listed name that matches no interface of this host is a ValueError
naming it, raised before any connection is made.

The address chosen here is the one the data plane listens on (and publishes
for its peers) and, on the host of the rendezvous store, the one the store
listens on: never the wildcard 0.0.0.0 when an interface was chosen.
"""
import fcntl
import ipaddress
import logging
import socket
import struct

_SIOCGIFFLAGS = 0x8913
_SIOCGIFADDR = 0x8915
IFF_UP, IFF_LOOPBACK = 0x1, 0x8
log = logging.getLogger("accord")


def split_host_port(text):
    """'host:port', '[v6]:port' or 'v6:port' -> (host, port as text), brackets removed."""
    text = text.strip()
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":"):
            return text, ""
        return host, rest[1:]
    host, _, port = text.rpartition(":")
    return host, port


def join_host_port(host, port):
    """'host:port', with an IPv6 address in brackets ('[::1]:29500')."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def strip_brackets(host):
    """'[::1]' -> '::1' (a MASTER_ADDR or URL host written as in a URL)."""
    host = (host or "").strip()
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def family_of(host):
    """AF_INET6 for an IPv6 address, else AF_INET."""
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def is_loopback(host):
    """True for 127.0.0.0/8, ::1 and 'localhost'."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(strip_brackets(host)).is_loopback
    except ValueError:
        return False


def ipv4_of(name):
    """(interface flags or None, IPv4 address or None) of interface `name`."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("256s", name.encode()[:15])
        try:
            flags = struct.unpack("H", fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, req)[16:18])[0]
        except OSError:
            flags = None
        try:
            addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)[20:24])
        except OSError:
            addr = None
    return flags, addr


def ipv6_addresses():
    """{interface name: [IPv6 addresses]} from /proc/net/if_inet6 (empty if absent)."""
    out = {}
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6:
                    addr = socket.inet_ntop(socket.AF_INET6, bytes.fromhex(parts[0]))
                    out.setdefault(parts[5], []).append(addr)
    except OSError:
        pass
    return out


def interfaces():
    """This host's interfaces in the kernel's order: [(name, flags or None, [addresses])].

    IPv4 first (the interface's primary address), then its IPv6 addresses.
    """
    try:
        names = [n for _, n in socket.if_nameindex()]
    except OSError:
        return []
    v6 = ipv6_addresses()
    out = []
    for name in names:
        flags, v4 = ipv4_of(name)
        out.append((name, flags, ([v4] if v4 else []) + v6.get(name, [])))
    return out


def parse_ifname(spec):
    """ACCORD_SOCKET_IFNAME -> (exclude, exact, [names]); ValueError for an empty list."""
    text = spec.strip()
    exclude = text.startswith("^")
    if exclude:
        text = text[1:]
    exact = text.startswith("=")
    if exact:
        text = text[1:]
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError(f"ACCORD_SOCKET_IFNAME: expected an interface name, a comma list or "
                         f"a ^ exclusion list, got {spec!r}")
    return exclude, exact, names


def _usable(addr):
    """An address peers can dial: not IPv6 link-local (it needs a scope)."""
    try:
        return not ipaddress.ip_address(addr).is_link_local
    except ValueError:
        return False


def select_interface(spec, ifaces=None, prefer_v6=False):
    """(interface name, address, why) that ACCORD_SOCKET_IFNAME=spec selects.

    ValueError names a listed interface that matches none of this host's, or
    says that the matching interfaces have no usable address.
    """
    exclude, exact, names = parse_ifname(spec)
    ifaces = interfaces() if ifaces is None else ifaces
    known = ", ".join(n for n, _, _ in ifaces) or "none"

    def matches(iface, name):
        return iface == name if exact else iface.startswith(name)

    if exclude:
        candidates = [i for i in ifaces if not any(matches(i[0], n) for n in names)]
        # loopback only when nothing else is left, as NCCL does
        candidates.sort(key=lambda i: bool(i[1] is not None and i[1] & IFF_LOOPBACK))
        why = f"ACCORD_SOCKET_IFNAME={spec}: the first interface not excluded"
    else:
        candidates = []
        for n in names:
            found = [i for i in ifaces if matches(i[0], n)]
            if not found:
                raise ValueError(f"ACCORD_SOCKET_IFNAME={spec}: no network interface of this "
                                 f"host matches {n!r} (this host has: {known})")
            candidates += [i for i in found if i not in candidates]
        why = f"ACCORD_SOCKET_IFNAME={spec}"
    for name, flags, addrs in candidates:
        if flags is not None and not flags & IFF_UP:
            continue
        usable = [a for a in addrs if _usable(a)]
        if prefer_v6:
            usable.sort(key=lambda a: ":" not in a)
        if usable:
            return name, usable[0], why
    raise ValueError(f"ACCORD_SOCKET_IFNAME={spec}: no interface it selects is up with a "
                     f"usable address (this host has: {known})")


def route_address(master_host):
    """The local address of the interface that routes to master_host (IPv4 or IPv6)."""
    host = strip_brackets(master_host)
    if not host or is_loopback(host):
        return "::1" if ":" in host else "127.0.0.1"
    try:
        infos = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)
    except OSError:
        infos = []
    infos.sort(key=lambda ai: ai[0] != socket.AF_INET)     # IPv4 first, as before
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(sockaddr)
                return s.getsockname()[0]
        except OSError:
            continue
    return socket.gethostbyname(socket.gethostname())


def choose_address(options, master_host):
    """(address, interface name or None, why): where this process's data plane listens.

    ACCORD_ADDR wins; then ACCORD_SOCKET_IFNAME; else the interface that routes
    to master_host (MASTER_ADDR). ValueError from a bad ACCORD_SOCKET_IFNAME.
    """
    if options.addr:
        return strip_brackets(options.addr), None, "ACCORD_ADDR"
    if options.socket_ifname:
        name, addr, why = select_interface(options.socket_ifname,
                                           prefer_v6=":" in strip_brackets(master_host or ""))
        return addr, name, why
    addr = route_address(master_host)
    return addr, None, f"the interface that routes to MASTER_ADDR {master_host or '127.0.0.1'}"


def local_address(options, master_host):
    """The address peers reach this process on (see choose_address)."""
    return choose_address(options, master_host)[0]


def store_bind_address(host, options=None):
    """The address a rendezvous store for clients dialling `host` listens on.

    The ACCORD_SOCKET_IFNAME interface's address when one is set; `host` itself
    when it is loopback or an address of this host; the wildcard (0.0.0.0 or
    ::) only when `host` is a name or an address this host cannot bind (behind
    NAT, say), where listening on it alone would refuse the clients.
    """
    if options is None:
        from .options import Options
        options = Options.from_env()
    host = strip_brackets(host)
    if options.socket_ifname:
        return select_interface(options.socket_ifname, prefer_v6=":" in host)[1]
    if host == "localhost":
        return "127.0.0.1"
    try:
        ipaddress.ip_address(host)
    except ValueError:
        # a host name: it may resolve to 127.0.1.1 here and to the real address
        # elsewhere, so only the wildcard is safe
        return "::" if ":" in host else "0.0.0.0"
    try:
        with socket.socket(family_of(host), socket.SOCK_STREAM) as s:
            s.bind((host, 0))
        return host
    except OSError:
        log.info("the store cannot listen on %s alone (not an address of this host); it "
                 "listens on every interface", host)
        return "::" if ":" in host else "0.0.0.0"
