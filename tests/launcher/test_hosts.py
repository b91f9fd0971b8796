import pytest

from launcher.hosts import HostSpec, HostSpecError, parse_hosts
from rendezvous.slots import SlotInfo, assign_slots


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("localhost:4", [HostSpec("localhost", 4)]),
        ("a:1,b:2", [HostSpec("a", 1), HostSpec("b", 2)]),
        ("a", [HostSpec("a", 1)]),
        (" a:2 , b ", [HostSpec("a", 2), HostSpec("b", 1)]),
        ("10.0.0.1:8,node-2.cluster:8", [HostSpec("10.0.0.1", 8), HostSpec("node-2.cluster", 8)]),
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
        ("a:1,a:2", "'a' is listed more than once"),
    ],
)
def test_parse_hosts_rejects(text: str, message: str) -> None:
    with pytest.raises(HostSpecError, match=message):
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
