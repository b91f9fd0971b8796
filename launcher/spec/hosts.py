"""Host lists: ``-H host1:4,host2:4`` (mpirun/horovodrun syntax) and hostfiles.

A bare ``host`` means one slot. A hostfile holds one host per line, as ``host slots=N``
(mpirun/Horovod) or ``host:N``; ``#`` starts a comment and blank lines are ignored.
A host listed on several lines of a hostfile gets the sum of their slots (as with mpirun),
at the place of its first line; in a ``-H`` list a repeated host is a mistake.
Malformed entries, zero or negative slot counts, counts above :data:`MAX_SLOTS_PER_HOST`
and repeated ``-H`` hosts are user errors:
:class:`HostSpecError` carries a message that names the offending entry (and line), and the
CLI turns it into one line with exit code 2.

:func:`is_local_host` decides which hosts run without SSH: ``localhost``, this machine's
host name (full or short), loopback addresses, and any name that resolves to an address of
one of this machine's interfaces.
"""

from __future__ import annotations

import re
import socket
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass

from launcher.errors import LauncherError
from rendezvous.addresses import is_ipv6, is_loopback
from rendezvous.slots import slots_used

#: The most slots one host may have: no machine runs more workers than this, and a count
#: beyond it is a typo (hvdrun would otherwise build slot lists of that size, and hang).
MAX_SLOTS_PER_HOST = 65536

#: The most worker processes of one job (``-np``, ``--min-np``, ``--max-np``, all slots).
MAX_PROCESSES = 1048576


class HostSpecError(LauncherError, ValueError):
    """A host list or hostfile that cannot be parsed; the message is for the user."""


@dataclass(frozen=True)
class HostSpec:
    hostname: str
    slots: int


def parse_host_entry(entry: str, default_slots: int = 1) -> HostSpec:
    """Parse one ``host`` or ``host:slots`` entry (``default_slots`` when it gives none).

    An IPv6 address goes in brackets, ``[fd00::2]`` or ``[fd00::2]:4``; without them it is
    taken whole (``fd00::2``) when that is its one reading, and refused when the part before
    its last ':' is an address too (``fd00::1:2``: the address, or fd00::1 with 2 slots?).
    """
    text = entry.strip()
    if not text:
        raise HostSpecError("empty host entry")
    hostname, slots_text = split_host_entry(text)
    if slots_text is None:
        return HostSpec(_check_hostname(hostname, text), default_slots)
    if not hostname:
        raise HostSpecError(f"host name missing in '{text}' (expected host:slots)")
    if not slots_text:
        raise HostSpecError(f"slot count missing in '{text}' (expected host:slots)")
    return HostSpec(_check_hostname(hostname, text), _parse_slots(slots_text, text))


_BRACKETED = re.compile(r"^(?P<user>[^@\[\]]*@)?\[(?P<address>[^\[\]]*)\](?P<rest>.*)$")


def split_host_entry(text: str) -> tuple[str, str | None]:
    """``[user@]host[:slots]`` as (``[user@]host``, the slots' text or None), the host of a
    bracketed IPv6 address without its brackets; raises HostSpecError."""
    match = _BRACKETED.match(text)
    if match is not None:
        user, address, rest = match.group("user") or "", match.group("address"), match["rest"]
        if not is_ipv6(address):
            raise HostSpecError(f"'[{address}]' in '{text}' is not an IPv6 address")
        if rest and not rest.startswith(":"):
            raise HostSpecError(
                f"cannot read '{rest}' after ']' in '{text}' (expected [addr]:slots)"
            )
        return user + address, rest[1:] if rest else None
    user, at, host = text.rpartition("@")
    if host.startswith("[") and "]" not in host:
        raise HostSpecError(f"']' missing in {text!r} (expected [addr] or [addr]:slots)")
    head, sep, tail = host.rpartition(":")
    if not sep:
        return text, None
    whole, before = is_ipv6(host), is_ipv6(head) and tail.isdigit()
    if whole and before:
        raise HostSpecError(
            f"'{text}' is ambiguous: write '[{host}]' for that IPv6 address, or "
            f"'[{head}]:{tail}' for {head} with {tail} slot{'' if tail == '1' else 's'}"
        )
    if whole:
        return text, None
    # host:slots (a name with a ':' left in it is refused by _check_hostname)
    return user + at + head, tail


_WHOLE_NUMBER = re.compile(r"-?[0-9]+")


def _parse_slots(slots_text: str, entry: str) -> int:
    slots_text = slots_text.strip()  # (-H 'a: 2')
    if not _WHOLE_NUMBER.fullmatch(slots_text):  # (not int()'s '+2', '1_0' or '٢')
        raise HostSpecError(f"slot count '{slots_text}' in '{entry}' is not a number")
    slots = int(slots_text)
    if slots < 1:
        raise HostSpecError(f"slot count in '{entry}' must be at least 1")
    check_slot_cap(slots, f"'{entry}'")
    return slots


def check_slot_cap(slots: int, where: str) -> None:
    """Refuses a slot count above :data:`MAX_SLOTS_PER_HOST` (``where`` names its entry)."""
    if slots > MAX_SLOTS_PER_HOST:
        raise HostSpecError(
            f"slot count {slots} in {where} is above the limit of {MAX_SLOTS_PER_HOST} "
            "slots per host"
        )


def _check_hostname(hostname: str, entry: str) -> str:
    if any(ch.isspace() for ch in hostname):
        raise HostSpecError(f"host name {hostname!r} contains white space")
    if any(unicodedata.category(ch) == "Cs" for ch in hostname):  # (from argv's bytes)
        raise HostSpecError(f"host name {hostname!r} is not UTF-8 text")
    if any(unicodedata.category(ch) in ("Cc", "Cf") for ch in hostname):
        # an invisible character (a byte-order mark, a zero-width space) pasted in; IDNA's
        # joiners in context are left out too, rare in host names as they are
        raise HostSpecError(f"host name {hostname!r} contains an invisible character")
    if hostname.startswith("-"):
        # Would read as an option to ssh and friends.
        raise HostSpecError(f"host name '{hostname}' in '{entry}' starts with '-'")
    if ":" in hostname and not is_ipv6(hostname.rpartition("@")[2]):
        raise HostSpecError(
            f"host name '{hostname}' in '{entry}' contains ':' (expected host:slots, "
            "or [addr]:slots for an IPv6 address)"
        )
    name = hostname.rpartition("@")[2]
    if not is_ipv6(name) and "" in name.removesuffix(".").split("."):
        # (no resolver takes 'a..b' or '.', and SSH says so as a codec's error)
        raise HostSpecError(f"host name {hostname!r} in {entry!r} has an empty part between dots")
    return hostname


def parse_hosts(text: str) -> list[HostSpec]:
    """Parse a comma-separated ``-H`` list, e.g. ``a:1,b:2``; raises HostSpecError. A host
    listed more than once gets the slots of all its entries, as with mpirun (``a,a,b,b``:
    two slots on each, the shape of a PBS node file joined by commas)."""
    if not text.strip():
        raise HostSpecError("the host list is empty")
    hosts: list[HostSpec] = []
    seen: dict[str, int] = {}
    for entry in text.split(","):
        add_host(hosts, seen, parse_host_entry(entry), "entries")
    return hosts


def add_host(hosts: list[HostSpec], seen: dict[str, int], host: HostSpec, what: str) -> None:
    """Appends ``host``, or adds its slots to the entry of the same name (mpirun's rule;
    ``seen``: each name's index in ``hosts``); ``what`` names the entries in the error of a
    sum above the cap."""
    index = seen.get(host.hostname)
    if index is None:
        seen[host.hostname] = len(hosts)
        hosts.append(host)
        return
    slots = hosts[index].slots + host.slots
    check_slot_cap(slots, f"the {what} of host '{host.hostname}' together")
    hosts[index] = HostSpec(host.hostname, slots)


_SLOTS_KEYWORD = re.compile(r"^(?:slots|max_slots|max-slots)=(.*)$")
#: Blanks around a hostfile line's '=': ``host slots = 2`` reads as ``host slots=2``.
_AROUND_EQUALS = re.compile(r"\s*=\s*")


def parse_hostfile_text(text: str, source: str = "hostfile") -> list[HostSpec]:
    """Parse a hostfile's lines (``host slots=N`` or ``host:N``); raises HostSpecError."""
    hosts: list[HostSpec] = []
    seen: dict[str, int] = {}  # host name -> its index in hosts
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source} line {number}"
        fields = _AROUND_EQUALS.sub("=", line).split()  # (horovodrun reads 'a slots = 2' too)
        try:
            if "," in fields[0]:
                raise HostSpecError(
                    f"{fields[0]!r} lists several hosts: a hostfile has one host a line "
                    "(commas separate hosts in -H)"
                )
            if len(fields) == 1:
                host = parse_host_entry(fields[0])
            else:
                host = _parse_keyword_line(fields, line)
        except HostSpecError as exc:
            raise HostSpecError(f"{where}: {exc}") from None
        try:
            add_host(hosts, seen, host, "lines")
        except HostSpecError as exc:
            raise HostSpecError(f"{where}: {exc}") from None
    if not hosts:
        raise HostSpecError(f"{source} lists no hosts")
    return hosts


def _parse_keyword_line(fields: list[str], line: str) -> HostSpec:
    field, *options = fields
    slots: int | None = None
    for option in options:
        match = _SLOTS_KEYWORD.match(option)
        if match is None:
            raise HostSpecError(f"cannot read '{option}' in '{line}' (expected 'host slots=N')")
        if option.startswith("slots="):
            if slots is not None:
                raise HostSpecError(f"'{line}' gives slots= twice")
            slots = _parse_slots(match.group(1), line)
    if is_ipv6(field.rpartition("@")[2]):  # (an address, whatever its last ':' might say)
        hostname, slots_text = field, None
    else:
        hostname, slots_text = split_host_entry(field)
    if slots_text is not None:
        raise HostSpecError(f"'{line}' gives slots twice (use 'host slots=N' or 'host:N')")
    if slots is None:
        raise HostSpecError(f"no slots= in '{line}'")
    return HostSpec(_check_hostname(hostname, line), slots)


def parse_hostfile(path: str) -> list[HostSpec]:
    """Read and parse a hostfile; raises HostSpecError (also for an unreadable file)."""
    try:
        with open(path, encoding="utf-8-sig") as handle:  # (a byte-order mark, dropped)
            text = handle.read()
    except OSError as exc:
        raise HostSpecError(f"cannot read hostfile {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise HostSpecError(f"hostfile {path} is not UTF-8 text") from None
    return parse_hostfile_text(text, source=path)


LOCAL_NAMES = frozenset({"localhost", "localhost.localdomain", "127.0.0.1", "::1"})


def local_addresses() -> set[str]:
    """Every address of this machine's interfaces (IPv6 without zone suffix)."""
    import psutil  # only when a host name needs it: the CLI imports this module at start

    addresses: set[str] = set()
    for entries in psutil.net_if_addrs().values():
        for entry in entries:
            if entry.family in (socket.AF_INET, socket.AF_INET6):
                addresses.add(entry.address.split("%", 1)[0])
    return addresses


def this_machine_named(hosts: Sequence[HostSpec], num_proc: int) -> list[str]:
    """The hosts that get workers whose names say they are this machine without a lookup
    (:func:`names_this_machine`). Each runs as a host of its own, as in horovodrun."""
    used = slots_used([(host.hostname, host.slots) for host in hosts], num_proc)
    return [hostname for hostname, _ in used if names_this_machine(hostname)]


def names_this_machine(hostname: str) -> bool:
    """Whether the name says it is this machine without a lookup: ``localhost``, a loopback
    address, this machine's own host name (or its short form, as schedulers give it)."""
    if hostname in LOCAL_NAMES or is_loopback(hostname):
        return True
    own = socket.gethostname()
    return hostname in (own, own.split(".", 1)[0])


def is_local_host(hostname: str) -> bool:
    """True for this machine: hvdrun then starts the host's agent without SSH.

    A name that does not resolve is not local (SSH will report it). ``user@host`` always
    goes through SSH, since the user asked to log in as someone.
    """
    if "@" in hostname:
        return False
    if names_this_machine(hostname):
        return True
    try:
        infos = socket.getaddrinfo(hostname, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    resolved = {str(info[4][0]).split("%", 1)[0] for info in infos}
    if any(is_loopback(address) for address in resolved):
        return True
    return bool(resolved & local_addresses())
