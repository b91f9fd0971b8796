"""Values larger than the rendezvous store takes in one key, kept as numbered pieces.

The server refuses a value over its limit (4 MiB by default), and one gRPC message may not
pass 64 MiB. What ``hvdrun.run`` sends its workers (a pickled function and its arguments)
and what they return can be larger, so :func:`split` cuts such bytes into pieces stored
under ``KEY/0``, ``KEY/1``, ..., with a small header under ``KEY`` itself: JSON holding the
number of pieces and whatever else the writer adds (a rank's size and generation). A writer
stores the pieces first and the header last, so a reader that finds the header finds every
piece; :func:`joined` reads them back through any ``get`` (a client's, or a dict's).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["PIECE_BYTES", "PiecesError", "header", "joined", "split"]

#: The size of one piece: under the server's default value limit, with room to spare.
PIECE_BYTES = 3 * 1024 * 1024


class PiecesError(ValueError):
    """A header that is not one :func:`split` wrote."""


def split(
    key: str, data: bytes, extra: Mapping[str, Any] | None = None, piece_bytes: int = PIECE_BYTES
) -> tuple[dict[str, bytes], bytes]:
    """``data`` as ``({KEY/i: piece}, header)``: store the pieces, then the header under
    ``key``. ``extra`` (JSON values) travels in the header."""
    if piece_bytes < 1:
        raise ValueError(f"piece_bytes must be positive, got {piece_bytes}")
    view = memoryview(data)
    pieces = {
        f"{key}/{number}": bytes(view[start : start + piece_bytes])
        for number, start in enumerate(range(0, len(data), piece_bytes))
    }
    fields = {**(extra or {}), "pieces": len(pieces)}
    return pieces, json.dumps(fields, sort_keys=True).encode("ascii")


def header(raw: bytes) -> dict[str, Any]:
    """The fields of a header :func:`split` wrote; :class:`PiecesError` for anything else."""
    try:
        fields = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        fields = None
    pieces = fields.get("pieces") if isinstance(fields, dict) else None
    if not isinstance(pieces, int) or isinstance(pieces, bool) or pieces < 0:
        raise PiecesError(f"not a header of stored pieces: {raw[:80]!r}")
    return fields


def joined(key: str, get: Callable[[str], bytes]) -> tuple[bytes, dict[str, Any]]:
    """The bytes stored under ``key`` by :func:`split`, and their header's fields, each value
    read with ``get`` (a KeyError or the client's error passes through)."""
    fields = header(get(key))
    data = b"".join(get(f"{key}/{number}") for number in range(fields["pieces"]))
    return data, fields
