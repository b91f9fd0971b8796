"""``elastic.run``: the retry loop around a training function (Horovod's semantics)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from collectives import runtime
from collectives.errors import HorovodInternalError, HostsUpdatedInterrupt
from collectives.torch.elastic.state import State

__all__ = ["run"]

logger = logging.getLogger(__name__)

_R = TypeVar("_R")


def run(func: Callable[..., _R]) -> Callable[..., _R]:
    """Decorates ``func(state, *args, **kwargs)`` to survive peer failures and host changes.

    Before each call the state is synced from rank 0. On :class:`HorovodInternalError` the
    state is restored to its last commit; on :class:`HostsUpdatedInterrupt` it is kept. Then
    the worker joins the job's next membership generation and calls ``func`` again.
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> _R:
        started_by = runtime.started_by()
        if started_by not in ("hvdrun", ""):
            raise RuntimeError(
                f"elastic training needs hvdrun: this job was started by {started_by}, which "
                "cannot replace a lost host; start it with hvdrun --min-np N --max-np M ..."
            )
        reset_needed = False
        skip_sync = False
        while True:
            if reset_needed:
                runtime.reset()
                state.on_reset()
            try:
                if not skip_sync:
                    state.sync()
                runtime.state_synced()  # (hvdrun starts no generation without a holder)
                return func(state, *args, **kwargs)
            except HorovodInternalError as error:
                logger.warning("a peer failed (%s); restoring the last commit", error)
                state.restore()
                skip_sync = False
            except HostsUpdatedInterrupt as interrupt:
                skip_sync = interrupt.skip_sync
            reset_needed = True

    return wrapper
