"""Addresses and the interfaces that carry them, found without DNS.

The hosts of a job often have names that resolve nowhere (containers, namespaces, clusters
whose nodes know each other only by address), so nothing here depends on a name resolving.
The interface that faces an address is found the way the kernel would route a packet there:
a connected UDP socket (nothing is sent) tells the local address, and the interface holding
that address is the one Gloo and NCCL should use. Both the launcher (its agents) and the
worker runtime (jobs another launcher started) use these; the module imports neither torch
nor gRPC.
"""

from __future__ import annotations

import collections
import contextlib
import ipaddress
import socket
from collections.abc import Callable, Iterator, Sequence

import psutil

__all__ = [
    "DIRECT",
    "connect_error",
    "gloo_interface",
    "interface_addresses",
    "interface_facing",
    "interface_of",
    "interface_toward",
    "is_ipv6",
    "is_loopback",
    "join_addr",
    "listening_socket",
    "local_networks",
    "missing_interfaces",
    "outward_interface",
    "pick_master",
    "resolve",
    "source_address",
    "split_addr",
]

#: The gRPC channel option that makes a channel dial its address itself. gRPC otherwise
#: sends it through the proxy of ``http_proxy``/``https_proxy``/``grpc_proxy`` (set on many
#: clusters for pip), which cannot reach a job's own ports, not even on loopback; the job's
#: channels are between its own processes, as torch's TCPStore and Gloo are.
DIRECT = ("grpc.enable_http_proxy", 0)


def split_addr(addr: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` → (host, port); raises ValueError."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"'{addr}' is not HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host:
        raise ValueError(f"'{addr}' has no host part")
    return host, int(port)


def join_addr(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_loopback(address: str) -> bool:
    """Whether ``address`` is a loopback IP address (a name is not)."""
    try:
        return ipaddress.ip_address(address.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def is_ipv6(address: str) -> bool:
    """Whether ``address`` is an IPv6 address (a name is not)."""
    try:
        return ipaddress.ip_address(address.split("%", 1)[0]).version == 6
    except ValueError:
        return False


def source_address(host: str, port: int = 9) -> str | None:
    """The local address the kernel would use to reach ``host`` (None if unroutable)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return None
    for family, kind, proto, _, sockaddr in infos:
        with contextlib.suppress(OSError), socket.socket(family, kind, proto) as sock:
            sock.connect(sockaddr)
            return str(sock.getsockname()[0]).split("%", 1)[0]
    return None


def resolve(name: str) -> str | None:
    """The first address ``name`` resolves to, without its %scope; None if it resolves to
    none."""
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return None
    return str(infos[0][4][0]).split("%", 1)[0] if infos else None


def _ip_addresses() -> Iterator[tuple[str, str]]:
    """(interface name, address without its %scope) of every IPv4 and IPv6 address here."""
    for name, entries in psutil.net_if_addrs().items():
        for entry in entries:
            if entry.family in (socket.AF_INET, socket.AF_INET6):
                yield name, entry.address.split("%", 1)[0]


def interface_of(address: str) -> str | None:
    """The name of the interface that holds ``address``."""
    try:
        wanted = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return None
    for name, held in _ip_addresses():
        with contextlib.suppress(ValueError):
            if ipaddress.ip_address(held) == wanted:
                return name
    return None


def interface_addresses(name: str) -> list[str]:
    """The IPv4 and IPv6 addresses of interface ``name`` (none if it has none)."""
    return [address for owner, address in _ip_addresses() if owner == name]


#: Addresses no host holds (TEST-NET-3, the IPv6 documentation prefix): the route the kernel
#: picks for them is the default route. A UDP connect sends nothing.
_NOWHERE = ("203.0.113.1", "2001:db8::1")


def outward_interface() -> str | None:
    """The interface of the default route, else the first non-loopback interface that is up
    and has an address that is not link-local; None when there is none."""
    for nowhere in _NOWHERE:
        local = source_address(nowhere)
        if local is not None and not is_loopback(local):
            name = interface_of(local)
            if name is not None:
                return name
    stats = psutil.net_if_stats()
    for name, address in _ip_addresses():
        if name in stats and stats[name].isup and not is_loopback(address):
            with contextlib.suppress(ValueError):
                if not ipaddress.ip_address(address).is_link_local:
                    return name
    return None


def interface_facing(addr: str) -> tuple[str | None, str | None]:
    """(interface name, local address) used to reach ``host:port``; Nones if unknown.

    For an address of this host itself that is the interface holding it."""
    try:
        host, port = split_addr(addr)
    except ValueError:
        return None, None
    local = source_address(host, port)
    if local is None:
        return None, None
    return interface_of(local), local


def interface_toward(peers: Sequence[str], preferred: str | None) -> tuple[str, str] | None:
    """(interface, its address) through which the kernel routes to most ``peers`` (a UDP
    connect: no packet is sent; unroutable peers do not count), ``preferred`` on a tie;
    None when no peer is routable."""
    counts: collections.Counter[str] = collections.Counter()
    addresses: dict[str, str] = {}
    for peer in peers:
        local = source_address(peer)
        name = interface_of(local) if local is not None else None
        if name is None or local is None:
            continue
        counts[name] += 1
        addresses.setdefault(name, local)
    if not counts:
        return None
    most = max(counts.values())
    if preferred is not None and counts.get(preferred) == most:
        return preferred, addresses[preferred]
    name = next(name for name, count in counts.items() if count == most)
    return name, addresses[name]


def gloo_interface(
    facing: tuple[str | None, str | None], peers: Sequence[str]
) -> tuple[str | None, str | None]:
    """(interface, its address) a host's Gloo and NCCL get, of ``facing`` (what
    :func:`interface_facing` says of the rendezvous) and the interface toward most of the
    job's other hosts (``peers``): the latter where it is another one."""
    toward = interface_toward(peers, facing[0])
    return toward if toward is not None and toward[0] != facing[0] else facing


def pick_master(
    rendezvous_addr: str, fallback: Callable[[], str], peers: Sequence[str] = ()
) -> tuple[str, int]:
    """``MASTER_ADDR``/``MASTER_PORT`` on this host, for plain ``torch.distributed``
    scripts: its address on the interface its Gloo and NCCL get (:func:`gloo_interface`, so
    the other hosts can route to it; ``fallback()`` where that is unknown) and a TCP port
    free on every interface, as torch's store will bind it."""
    _, address = gloo_interface(interface_facing(rendezvous_addr), peers)
    if address is None:
        address = fallback()
    family = socket.AF_INET6 if is_ipv6(address) else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", 0))
        port: int = probe.getsockname()[1]
    return address, port


def listening_socket(address: str, backlog: int = 128) -> socket.socket:
    """A TCP socket listening on ``address`` at a free port (the kernel completes the
    handshake of a connect to it, up to ``backlog`` at a time, whether or not anyone
    accepts): what a connection to this host is tried with. Raises OSError."""
    listener = socket.socket(socket.AF_INET6 if is_ipv6(address) else socket.AF_INET)
    try:
        listener.bind((address, 0))
        listener.listen(backlog)
    except OSError:
        listener.close()
        raise
    return listener


def connect_error(host: str, port: int, timeout: float) -> OSError | None:
    """None when a TCP connection to ``host``:``port`` is made within ``timeout`` s, else
    the error (a ``TimeoutError`` when nothing answered)."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as error:
        return error


def local_networks() -> list[ipaddress.IPv4Interface]:
    """This host's IPv4 addresses with their networks, loopback excluded, by interface name."""
    found = []
    for _, entries in sorted(psutil.net_if_addrs().items()):
        for entry in entries:
            if entry.family != socket.AF_INET or not entry.netmask:
                continue
            with contextlib.suppress(ValueError):
                interface = ipaddress.IPv4Interface(f"{entry.address}/{entry.netmask}")
                if not interface.ip.is_loopback:
                    found.append(interface)
    return found


#: The loopback interface's name (Linux).
LOOPBACK_INTERFACE = "lo"


def loopback_down() -> bool:
    """Whether this host's loopback interface is there but down (a fresh network namespace,
    ``unshare -n``, a container started without networking set up): nothing on this host
    reaches 127.0.0.1 then."""
    try:
        stats = psutil.net_if_stats().get(LOOPBACK_INTERFACE)
    except (OSError, psutil.Error):
        return False
    return stats is not None and not stats.isup


def missing_interfaces(names: str) -> tuple[list[str], list[str]]:
    """Of the comma-separated interface ``names`` (``GLOO_SOCKET_IFNAME``'s), those this host
    lacks, and the names it has (both empty where it cannot tell)."""
    try:
        have = [name for _, name in socket.if_nameindex()]
    except OSError:
        return [], []
    missing = [name for name in names.split(",") if name and name not in have]
    return missing, have
