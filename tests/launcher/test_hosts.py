import re
from pathlib import Path

import pytest

from launcher.spec.hosts import (
    HostSpec,
    HostSpecError,
    is_local_host,
    local_addresses,
    parse_hostfile,
    parse_hostfile_text,
    parse_hosts,
)
from rendezvous.slots import SlotInfo, assign_slots


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("localhost:4", [HostSpec("localhost", 4)]),
        ("a:1,b:2", [HostSpec("a", 1), HostSpec("b", 2)]),
        ("a", [HostSpec("a", 1)]),
        (" a:2 , b ", [HostSpec("a", 2), HostSpec("b", 1)]),
        ("10.0.0.1:8,node-2.cluster:8", [HostSpec("10.0.0.1", 8), HostSpec("node-2.cluster", 8)]),
        ("a:65536", [HostSpec("a", 65536)]),  # the most slots a host may have
        ("a: 2", [HostSpec("a", 2)]),
        # A host listed more than once gets the slots of all its entries, as with mpirun and
        # a hostfile (a PBS node file joined by commas: one entry per slot).
        ("a,a,b,b,a", [HostSpec("a", 3), HostSpec("b", 2)]),
        ("b:2,a:1,b:4,[::1]:2,::1", [HostSpec("b", 6), HostSpec("a", 1), HostSpec("::1", 3)]),
    ],
)
def test_parse_hosts(text: str, expected: list[HostSpec]) -> None:
    assert parse_hosts(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty"),
        ("host:", "slot count missing in 'host:'"),
        (":4", "host name missing in ':4'"),
        ("host:x", "'x' in 'host:x' is not a number"),
        ("host:0", "must be at least 1"),
        ("host:-2", "must be at least 1"),
        ("a:1,,b:1", "empty host entry"),
        ("a:60000,b:1,a:6000", "the entries of host 'a' together is above the limit"),
        (
            "a:1,b:99999999999999999999",
            "slot count 99999999999999999999 in 'b:99999999999999999999' is above the limit "
            "of 65536 slots per host",
        ),
        ("a:65537", "above the limit of 65536 slots per host"),
        # int() reads these, a user who typed them did not mean a number
        ("a:+2", "'+2' in 'a:+2' is not a number"),
        ("a:1_0", "'1_0' in 'a:1_0' is not a number"),
        # names no resolver takes, refused before any host is tried
        ("a..b:1", "host name 'a..b' in 'a..b:1' has an empty part between dots"),
        (".:1", "host name '.' in '.:1' has an empty part between dots"),
        ("node\u200b1:2", "host name 'node\\u200b1' contains an invisible character"),
        ("[::1", "']' missing in '[::1'"),
    ],
)
def test_parse_hosts_rejects(text: str, message: str) -> None:
    with pytest.raises(HostSpecError, match=re.escape(message)):
        parse_hosts(text)


def _table(slots: list[SlotInfo]) -> list[tuple[str, int, int, int, int, int]]:
    return [
        (s.hostname, s.rank, s.local_rank, s.local_size, s.cross_rank, s.cross_size) for s in slots
    ]


@pytest.mark.parametrize(
    ("hosts", "np", "expected"),
    [
        # (host, rank, local_rank, local_size, cross_rank, cross_size)
        (
            [("h", 4)],
            4,
            [
                ("h", 0, 0, 4, 0, 1),
                ("h", 1, 1, 4, 0, 1),
                ("h", 2, 2, 4, 0, 1),
                ("h", 3, 3, 4, 0, 1),
            ],
        ),
        (
            [("a", 2), ("b", 2)],
            4,
            [
                ("a", 0, 0, 2, 0, 2),
                ("a", 1, 1, 2, 0, 2),
                ("b", 2, 0, 2, 1, 2),
                ("b", 3, 1, 2, 1, 2),
            ],
        ),
        # heterogeneous: local_rank 1 exists only on b, so b is cross_rank 0 of 1 there
        (
            [("a", 1), ("b", 2)],
            3,
            [("a", 0, 0, 1, 0, 2), ("b", 1, 0, 2, 1, 2), ("b", 2, 1, 2, 0, 1)],
        ),
        (
            [("a", 2), ("b", 1), ("c", 3)],
            6,
            [
                ("a", 0, 0, 2, 0, 3),
                ("a", 1, 1, 2, 0, 2),
                ("b", 2, 0, 1, 1, 3),
                ("c", 3, 0, 3, 2, 3),
                ("c", 4, 1, 3, 1, 2),
                ("c", 5, 2, 3, 0, 1),
            ],
        ),
        # fewer processes than slots: hosts fill in order, the last ones partly or not at all
        (
            [("a", 2), ("b", 2), ("c", 2)],
            3,
            [("a", 0, 0, 2, 0, 2), ("a", 1, 1, 2, 0, 1), ("b", 2, 0, 1, 1, 2)],
        ),
    ],
)
def test_assign_slots(hosts: list[tuple[str, int]], np: int, expected: list[tuple]) -> None:
    slots = assign_slots(hosts, np)
    assert _table(slots) == expected
    assert all(s.size == np for s in slots)


def test_assign_slots_rejects_too_many() -> None:
    with pytest.raises(ValueError, match="only 4 slots"):
        assign_slots([("a", 2), ("b", 2)], 5)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("a slots=2\nb slots=1\n", [HostSpec("a", 2), HostSpec("b", 1)]),
        # blanks around '=', as horovodrun reads them
        (
            "localhost slots = 2\nb slots= 3\nc\tslots =4 max_slots = 4\n",
            [HostSpec("localhost", 2), HostSpec("b", 3), HostSpec("c", 4)],
        ),
        ("a:4\nb\n", [HostSpec("a", 4), HostSpec("b", 1)]),
        ("node_1.example.org. slots=2\n", [HostSpec("node_1.example.org.", 2)]),
        # names no resolver need take: ssh-config aliases, long or not; IDN names
        (
            f"{'n' * 70} slots=1\nعربي1.example:2\n",
            [HostSpec("n" * 70, 1), HostSpec("عربي1.example", 2)],
        ),
        (
            "# cluster\n\n  node-1 slots=8 max_slots=8  # the head\nnode-2:8\n\t\n",
            [HostSpec("node-1", 8), HostSpec("node-2", 8)],
        ),
        (
            "10.0.0.1 slots=2\nuser@10.0.0.2:3\n",
            [HostSpec("10.0.0.1", 2), HostSpec("user@10.0.0.2", 3)],
        ),
        ("fe80::1 slots=2\n", [HostSpec("fe80::1", 2)]),
        ("a:65535\na slots=1\n", [HostSpec("a", 65536)]),  # the most slots a host may have
        # a repeated host adds its slots, at the place of its first line (mpirun's rule)
        ("a slots=2\nb:1\na:3\na\n", [HostSpec("a", 6), HostSpec("b", 1)]),
    ],
)
def test_parse_hostfile(text: str, expected: list[HostSpec]) -> None:
    assert parse_hostfile_text(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "hosts lists no hosts"),
        ("# only a comment\n\n", "lists no hosts"),
        ("a slots=x\n", "hosts line 1: slot count 'x' in 'a slots=x' is not a number"),
        ("a slots=0\n", "hosts line 1: slot count in 'a slots=0' must be at least 1"),
        ("a cpus=2\n", "hosts line 1: cannot read 'cpus=2' in 'a cpus=2'"),
        ("a max_slots=2\n", "hosts line 1: no slots= in 'a max_slots=2'"),
        ("a:2 slots=2\n", "gives slots twice"),
        ("b:1\na:\n", "hosts line 2: slot count missing in 'a:'"),
        # an -H list pasted into a file, and a line that says its slots twice
        ("a,b slots=1\n", "hosts line 1: 'a,b' lists several hosts: a hostfile has one host"),
        ("a slots=2 slots=3\n", "hosts line 1: 'a slots=2 slots=3' gives slots= twice"),
        (
            "a slots=99999999999999999999\n",
            "hosts line 1: slot count 99999999999999999999 in 'a slots=99999999999999999999' "
            "is above the limit of 65536 slots per host",
        ),
        (
            "a:40000\nb:1\na:40000\n",
            "hosts line 3: slot count 80000 in the lines of host 'a' together is above the "
            "limit of 65536 slots per host",
        ),
    ],
)
def test_parse_hostfile_rejects(text: str, message: str) -> None:
    with pytest.raises(HostSpecError, match=re.escape(message)):
        parse_hostfile_text(text, source="hosts")


def test_parse_hostfile_from_disk(tmp_path: Path) -> None:
    path = tmp_path / "hostfile"
    path.write_text("x slots=3\n")
    assert parse_hostfile(str(path)) == [HostSpec("x", 3)]
    with pytest.raises(HostSpecError, match=f"cannot read hostfile {tmp_path}/missing"):
        parse_hostfile(str(tmp_path / "missing"))
    # a byte-order mark (saved so by Windows editors) is not part of the first host's name
    path.write_bytes("\ufeffx slots=3\r\n".encode())
    assert parse_hostfile(str(path)) == [HostSpec("x", 3)]
    path.write_bytes("\ufeff\r\nx:3\r\n".encode())
    assert parse_hostfile(str(path)) == [HostSpec("x", 3)]
    path.write_bytes(b"\xff\xfe slots=1\n")
    with pytest.raises(HostSpecError, match="is not UTF-8 text"):
        parse_hostfile(str(path))


def test_host_name_starting_with_dash_is_rejected() -> None:
    with pytest.raises(HostSpecError, match="starts with '-'"):
        parse_hosts("-oProxyCommand=x:1")


def test_an_entry_with_two_colons_is_refused_unless_the_host_is_ipv6() -> None:
    with pytest.raises(HostSpecError, match=r"host name 'localhost:2' in 'localhost:2:3' contains"):
        parse_hosts("localhost:2:3")
    with pytest.raises(HostSpecError, match="contains ':'"):
        parse_hostfile_text("node1:2:3\n")
    assert parse_hosts("1:2:3:4:5:6:7:8:2") == [HostSpec("1:2:3:4:5:6:7:8", 2)]  # one reading


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[::1]", [HostSpec("::1", 1)]),
        ("[::1]:2", [HostSpec("::1", 2)]),
        ("[fd00::1:2]:3,[fd00::1]", [HostSpec("fd00::1:2", 3), HostSpec("fd00::1", 1)]),
        ("::1", [HostSpec("::1", 1)]),  # the whole is an address; '::' before ':1' is none
        ("fd00::2", [HostSpec("fd00::2", 1)]),
        ("root@[fd00::2]:4", [HostSpec("root@fd00::2", 4)]),
        ("root@fd00::2", [HostSpec("root@fd00::2", 1)]),
        ("[fe80::1%eth0]:2", [HostSpec("fe80::1%eth0", 2)]),
    ],
)
def test_ipv6_addresses_in_brackets_or_whole(text: str, expected: list[HostSpec]) -> None:
    assert parse_hosts(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "fd00::1:2",
            r"'fd00::1:2' is ambiguous: write '\[fd00::1:2\]' for that IPv6 address, "
            r"or '\[fd00::1\]:2' for fd00::1 with 2 slots",
        ),
        ("::1:2", r"'::1:2' is ambiguous"),
        ("[node1]:2", r"'\[node1\]' in '\[node1\]:2' is not an IPv6 address"),
        ("[::1]2", r"cannot read '2' after '\]' in '\[::1\]2'"),
        ("[::1]:x", r"'x' in '\[::1\]:x' is not a number"),
    ],
)
def test_ambiguous_or_malformed_ipv6_entries_are_refused(text: str, message: str) -> None:
    with pytest.raises(HostSpecError, match=message):
        parse_hosts(text)


def test_ipv6_addresses_in_a_hostfile() -> None:
    text = "::1 slots=2\n[fd00::2] slots=3\nfd00::1:2 slots=1\n[fd00::5]:2\n"
    assert parse_hostfile_text(text) == [
        HostSpec("::1", 2),
        HostSpec("fd00::2", 3),
        HostSpec("fd00::1:2", 1),  # (slots= says the whole is the address)
        HostSpec("fd00::5", 2),
    ]
    with pytest.raises(HostSpecError, match="line 1: '\\[::1\\]:2 slots=2' gives slots twice"):
        parse_hostfile_text("[::1]:2 slots=2\n")
    with pytest.raises(HostSpecError, match="line 1: 'fd00::1:2' is ambiguous"):
        parse_hostfile_text("fd00::1:2\n")


@pytest.mark.parametrize(
    ("name", "local"),
    [
        ("localhost", True),
        ("127.0.0.1", True),
        ("127.0.0.5", True),  # all of 127/8 is this machine
        ("::1", True),
        ("user@localhost", False),  # logging in as someone goes through SSH
        ("192.0.2.7", False),  # TEST-NET-1: never assigned to anything
    ],
)
def test_is_local_host(name: str, local: bool) -> None:
    assert is_local_host(name) is local


def test_own_addresses_are_local() -> None:
    # (numeric addresses only: a test must not send DNS queries off this machine)
    for address in local_addresses():
        assert is_local_host(address), address


def test_this_machines_host_name_is_local_full_or_short(monkeypatch: pytest.MonkeyPatch) -> None:
    """A scheduler names nodes by short host name (Slurm's ``node7`` of ``node7.cluster``):
    either spelling of this machine's name starts its workers without SSH."""
    import socket

    monkeypatch.setattr(socket, "gethostname", lambda: "node7.cluster.invalid")
    assert is_local_host("node7.cluster.invalid")
    assert is_local_host("node7")
    assert not is_local_host("node8.cluster.invalid")
