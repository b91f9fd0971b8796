"""Helpers for the tests that drive the server's parts directly on an asyncio loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from rendezvous.server.common import Refusal

T = TypeVar("T")


def run(test: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Runs one test's coroutine on a fresh loop (and fails it after 10 s)."""
    return asyncio.run(asyncio.wait_for(test(), 10))


async def settle() -> None:
    """Lets every ready callback and woken task run."""
    for _ in range(5):
        await asyncio.sleep(0)


def refusal_of(task: asyncio.Task[Any]) -> Refusal:
    error = task.exception()
    assert isinstance(error, Refusal), error
    return error
