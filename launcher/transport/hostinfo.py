"""What an agent can tell about its host without importing torch: versions and interfaces.

Versions come from package metadata (the ``dist-info`` directories), which costs a
millisecond, where ``import torch`` costs seconds. The interface that faces an address is
found the way the kernel would route a packet there: a connected UDP socket (nothing is
sent) tells the local address, and the interface holding that address is the one Gloo and
NCCL should use.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import platform
import socket
import sys

import psutil


def dist_version(name: str) -> str | None:
    """The installed version of distribution ``name``, as ``importlib.metadata`` finds it.

    Reads the ``NAME-VERSION.dist-info`` directory names on ``sys.path`` first: importing
    ``importlib.metadata`` alone costs more than the agent's whole start-up otherwise does.
    """
    prefix = name.lower().replace("-", "_") + "-"
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for candidate in names:
            if candidate.endswith(".dist-info") and candidate.lower().startswith(prefix):
                return candidate[len(prefix) : -len(".dist-info")]
    from importlib import metadata  # egg-info and other layouts

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def installed_versions() -> dict[str, str | None]:
    """This interpreter's Python version and the hvdrun and torch versions it would import."""
    return {
        "python": platform.python_version(),
        "executable": sys.executable,
        "hvdrun": dist_version("hvdrun"),
        "torch": dist_version("torch"),
    }


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


def interface_of(address: str) -> str | None:
    """The name of the interface that holds ``address``."""
    try:
        wanted = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return None
    for name, entries in psutil.net_if_addrs().items():
        for entry in entries:
            if entry.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            with contextlib.suppress(ValueError):
                if ipaddress.ip_address(entry.address.split("%", 1)[0]) == wanted:
                    return name
    return None


def interface_facing(addr: str) -> tuple[str | None, str | None]:
    """(interface name, local address) used to reach ``host:port``; Nones if unknown."""
    try:
        host, port = split_addr(addr)
    except ValueError:
        return None, None
    local = source_address(host, port)
    if local is None:
        return None, None
    return interface_of(local), local
