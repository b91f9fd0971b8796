"""Host lists: ``-H host1:4,host2:4`` (mpirun/horovodrun syntax).

A bare ``host`` means one slot. Malformed entries, zero or negative slot counts and
duplicate hosts are user errors: :class:`HostSpecError` carries a message that names the
offending entry, and the CLI turns it into one line with exit code 2.
"""

from __future__ import annotations

from dataclasses import dataclass


class HostSpecError(ValueError):
    """A host list or hostfile that cannot be parsed; the message is for the user."""


@dataclass(frozen=True)
class HostSpec:
    hostname: str
    slots: int


def parse_host_entry(entry: str) -> HostSpec:
    """Parse one ``host`` or ``host:slots`` entry."""
    text = entry.strip()
    if not text:
        raise HostSpecError("empty host entry")
    hostname, sep, slots_text = text.rpartition(":")
    if not sep:
        hostname, slots_text = text, "1"
    if not hostname:
        raise HostSpecError(f"host name missing in '{text}' (expected host:slots)")
    if not slots_text:
        raise HostSpecError(f"slot count missing in '{text}' (expected host:slots)")
    try:
        slots = int(slots_text)
    except ValueError:
        raise HostSpecError(f"slot count '{slots_text}' in '{text}' is not a number") from None
    if slots < 1:
        raise HostSpecError(f"slot count in '{text}' must be at least 1")
    if any(ch.isspace() for ch in hostname):
        raise HostSpecError(f"host name '{hostname}' contains white space")
    return HostSpec(hostname, slots)


def parse_hosts(text: str) -> list[HostSpec]:
    """Parse a comma-separated ``-H`` list, e.g. ``a:1,b:2``; raises HostSpecError."""
    if not text.strip():
        raise HostSpecError("the host list is empty")
    hosts = [parse_host_entry(entry) for entry in text.split(",")]
    check_unique(hosts)
    return hosts


def check_unique(hosts: list[HostSpec]) -> None:
    seen: set[str] = set()
    for host in hosts:
        if host.hostname in seen:
            raise HostSpecError(
                f"host '{host.hostname}' is listed more than once; give its slots in one entry"
            )
        seen.add(host.hostname)
