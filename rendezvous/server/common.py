"""What the rendezvous server's parts share: refusals, and how they quote untrusted text.

The parts (the key-value store, membership, the watch streams) know nothing of gRPC calls:
a call they cannot serve raises :class:`Refusal`, which carries the status code and the
message the client gets, and the servicer (:mod:`rendezvous.server.servicer`) ends the call
with it. So each part can be driven directly on an asyncio loop, and its answers checked
without a server.

Nothing here holds state: the module is constants, pure functions and exception types.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import grpc

from rendezvous.client import SUPERSEDED

#: Every part logs under this one name, the name the server has always logged under: it is
#: what ``--verbose`` prints in front of each line and what logging filters select on.
LOGGER_NAME = "rendezvous.server"

#: Untrusted strings quoted back in error messages are cut to this many characters.
QUOTE_LIMIT = 200

#: What blocked calls and Watch streams are told when the server stops.
SHUTDOWN_MESSAGE = "the rendezvous server is shutting down"


def quote(text: str) -> str:
    """``repr`` of an untrusted string, shortened so an error message stays readable."""
    if len(text) > QUOTE_LIMIT:
        text = text[:QUOTE_LIMIT] + "..."
    return repr(text)


def quote_keys(keys: Sequence[str], limit: int = 10) -> str:
    shown = ", ".join(quote(key) for key in keys[:limit])
    if len(keys) > limit:
        shown += f" and {len(keys) - limit} more"
    return shown


def list_ranks(ranks: Sequence[int], limit: int = 10) -> str:
    shown = ", ".join(map(str, ranks[:limit]))
    return shown + (f" and {len(ranks) - limit} more" if len(ranks) > limit else "")


def seconds(timeout_ms: int) -> str:
    return f"{timeout_ms / 1000:g} s"


class Refusal(Exception):
    """Ends a call with ``code`` and ``message``, which the client gets as they are."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class ShuttingDown(Refusal):
    """The server stops: set on blocked callers' futures, so their calls end at once."""

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, message)


class Superseded(Refusal):
    """A call about a key of a generation older than the newest published one."""

    def __init__(self, old: int, new: int) -> None:
        super().__init__(
            grpc.StatusCode.ABORTED,
            SUPERSEDED.format(old=old, new=new) + " (hosts joined or left the job)",
        )


def check_timeout(timeout_ms: int) -> None:
    """Refuses a negative ``timeout_ms`` (INVALID_ARGUMENT)."""
    if timeout_ms < 0:
        raise Refusal(
            grpc.StatusCode.INVALID_ARGUMENT, f"timeout_ms must not be negative, got {timeout_ms}"
        )


#: Store keys of one membership generation start with this (see collectives' runtime).
GENERATION_KEY = re.compile(r"^hvdrun/g(\d+)/")


def generation_of(key: str) -> int | None:
    """The membership generation a store key belongs to, or None for other keys."""
    match = GENERATION_KEY.match(key)
    return int(match.group(1)) if match else None
