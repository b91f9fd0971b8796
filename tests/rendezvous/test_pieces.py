"""Values larger than one store key takes, as pieces: through a real server and client."""

from __future__ import annotations

import pytest

from rendezvous import pieces
from rendezvous.server import RendezvousServer
from rendezvous.server.common import Refusal
from tests.rendezvous.conftest import ClientFactory


def test_pieces_round_trip_through_a_server_whose_values_are_small(
    server: RendezvousServer, make_client: ClientFactory
) -> None:
    # The module's server takes at most 4096 bytes per value.
    data = bytes(range(256)) * 40 + b"tail"  # 10244 bytes: three pieces
    stored, head = pieces.split("job/blob", data, {"rank": 3}, piece_bytes=4096)
    assert sorted(stored) == ["job/blob/0", "job/blob/1", "job/blob/2"]
    server.put_values({**stored, "job/blob": head})
    client = make_client(server)
    read, fields = pieces.joined("job/blob", lambda key: client.get(key, 5.0))
    assert read == data
    assert fields == {"pieces": 3, "rank": 3}
    # what the launcher reads back at the end: a dict of everything under a prefix
    under = server.values_under("job/")
    assert pieces.joined("job/blob", under.__getitem__)[0] == data


def test_empty_bytes_have_a_header_and_no_piece() -> None:
    stored, head = pieces.split("k", b"")
    assert stored == {}
    assert pieces.joined("k", {"k": head}.__getitem__) == (b"", {"pieces": 0})


@pytest.mark.parametrize("raw", [b"", b"not json", b"[1]", b'{"pieces": -1}', b'{"pieces": true}'])
def test_a_value_that_is_no_header_is_refused(raw: bytes) -> None:
    with pytest.raises(pieces.PiecesError, match="not a header"):
        pieces.header(raw)


def test_a_value_over_the_limit_is_refused_whole(
    server: RendezvousServer, make_client: ClientFactory
) -> None:
    with pytest.raises(Refusal, match="limit"):
        server.put_values({"job/ok": b"x", "job/big": b"y" * 5000})
    assert make_client(server).check(["job/ok"]) is False  # nothing of it was stored
