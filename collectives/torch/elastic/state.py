"""Training state that survives a reset: commit (save), restore, and sync from rank 0.

``commit()`` saves a copy of the state in memory and then checks for host updates: every
rank contributes the newest membership generation it has heard of to one small allreduce
(max), so all ranks agree whether to raise :class:`HostsUpdatedInterrupt` at this very
commit. A rank of a removed host therefore takes part in the decision like any other and
nobody waits on it afterwards: a graceful removal cannot deadlock.

Horovod scripts also poll ``state._host_messages`` (Horovod's queue of host-change notices)
to learn that hosts changed before they commit, e.g. ``while state._host_messages.empty():``.
Here it is :class:`HostMessages`, a read-only view of the same fact: the membership
generations announced since this worker's own.
"""

from __future__ import annotations

import copy
import enum
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from collectives import runtime
from collectives.common import ReduceOp
from collectives.errors import HostsUpdatedInterrupt
from collectives.torch.functions import (
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from collectives.torch.mpi_ops import allreduce

__all__ = ["HostMessages", "HostUpdateResult", "ObjectState", "State", "TorchState"]


class HostUpdateResult(enum.IntFlag):
    """What a host change did (Horovod's flags; hvdrun's notices say ``mixed``: a new
    membership generation, whether hosts were added, removed or both)."""

    no_update = 0
    removed = 1
    added = 2
    mixed = removed | added


class HostMessages:
    """The host changes this worker has heard of and not acted on yet (``state.commit()``
    acts on them): a read-only stand-in for the queue Horovod's states hold in
    ``_host_messages``. One notice per membership generation announced after this
    worker's; each reads ``(generation, HostUpdateResult.mixed)``."""

    def qsize(self) -> int:
        """How many notices are pending."""
        if not runtime.is_initialized():
            return 0
        return max(0, runtime.newest_generation() - runtime.generation())

    def empty(self) -> bool:
        return self.qsize() == 0

    def __len__(self) -> int:
        return self.qsize()

    def __iter__(self) -> Iterator[tuple[int, HostUpdateResult]]:
        """The pending notices, oldest first (reading them takes none away)."""
        current = runtime.generation() if runtime.is_initialized() else 0
        for generation in range(current + 1, current + 1 + self.qsize()):
            yield generation, HostUpdateResult.mixed


class State:
    """Base of elastic states: subclasses implement ``save``, ``restore`` and ``sync``."""

    def __init__(self) -> None:
        self._reset_callbacks: list[Callable[[], None]] = []
        # Horovod's scripts reset it before waiting on _host_messages; kept for them.
        self._last_updated_timestamp = 0

    @property
    def _host_messages(self) -> HostMessages:
        """Horovod's queue of host-change notices, as a read-only view (see
        :class:`HostMessages`): ``while state._host_messages.empty(): ...`` works."""
        return HostMessages()

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Functions called (in order) after every reset, e.g. to rescale the learning rate
        to the new ``hvd.size()``."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Saves the state (the point a failure rolls back to), then checks for host updates."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raises :class:`HostsUpdatedInterrupt` on every rank at once when hosts were added
        or removed since this generation started (a collective: call it on every rank)."""
        current = runtime.generation()
        newest = torch.tensor([runtime.newest_generation()], dtype=torch.int64)
        agreed = int(allreduce(newest, name="elastic.check_host_updates", op=ReduceOp.MAX))
        if agreed > current:
            raise HostsUpdatedInterrupt(skip_sync=False)

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError


class ObjectState(State):
    """Picklable attributes (``ObjectState(epoch=0, batch=0)`` → ``state.epoch``), saved
    as deep copies and synced from rank 0 with ``broadcast_object``."""

    def __init__(
        self,
        bcast_object: Callable[..., Any] = broadcast_object,
        get_rank: Callable[[], int] = runtime.rank,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        self._bcast_object = bcast_object
        self._get_rank = get_rank
        # Our own broadcast_object gets names; a user's function (Horovod's signature
        # ``bcast_object(obj, root_rank)``) is called without one.
        self._named = bcast_object is broadcast_object
        self._saved_state: dict[str, Any] = copy.deepcopy(kwargs)
        for name, value in kwargs.items():
            setattr(self, name, value)

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes that do not exist; typed as Any so that scripts can
        # use ``state.epoch`` and friends under a type checker.
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        # Declared so that type checkers accept ``state.epoch = ...`` for any attribute.
        super().__setattr__(name, value)

    def _current(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._saved_state}

    def _broadcast(self, obj: Any, name: str) -> Any:
        if self._named:
            return self._bcast_object(obj, 0, name=name)
        return self._bcast_object(obj, 0)

    def save(self) -> None:
        self._saved_state = copy.deepcopy(self._current())

    def restore(self) -> None:
        for name, value in copy.deepcopy(self._saved_state).items():
            setattr(self, name, value)

    def sync(self) -> None:
        if self._saved_state:
            synced = self._broadcast(self._current(), "elastic.object_state")
            for name, value in synced.items():
                setattr(self, name, value)
        self.save()


class TorchState(ObjectState):
    """A model, an optimizer and any other attributes (numbers, lists, an
    :class:`~collectives.torch.elastic.ElasticSampler`), as in Horovod."""

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        **kwargs: Any,
    ) -> None:
        from collectives.torch.elastic.sampler import ElasticSampler

        self.model = model
        self.optimizer = optimizer
        self._samplers = {k: v for k, v in kwargs.items() if isinstance(v, ElasticSampler)}
        plain = {k: v for k, v in kwargs.items() if k not in self._samplers}
        super().__init__(**plain)
        for name, sampler in self._samplers.items():
            setattr(self, name, sampler)
        self._saved_model: dict[str, torch.Tensor] | None = None
        self._saved_optimizer: dict[str, Any] | None = None
        self._saved_samplers: dict[str, dict[str, Any]] = {}
        self._save_torch()

    def _save_torch(self) -> None:
        if self.model is not None:
            self._saved_model = {
                name: tensor.detach().clone() for name, tensor in self.model.state_dict().items()
            }
        if self.optimizer is not None:
            self._saved_optimizer = copy.deepcopy(self.optimizer.state_dict())
        # state_dict() is a fresh dict and load_state_dict() builds its own set: no copies.
        self._saved_samplers = {name: s.state_dict() for name, s in self._samplers.items()}

    def save(self) -> None:
        self._save_torch()
        super().save()

    def restore(self) -> None:
        if self.model is not None and self._saved_model is not None:
            self.model.load_state_dict(self._saved_model)
        if self.optimizer is not None and self._saved_optimizer is not None:
            self.optimizer.load_state_dict(copy.deepcopy(self._saved_optimizer))
        for name, sampler in self._samplers.items():
            sampler.load_state_dict(self._saved_samplers[name])
        super().restore()

    def sync(self) -> None:
        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.optimizer is not None:
            broadcast_optimizer_state(self.optimizer, root_rank=0)
        for name, sampler in self._samplers.items():
            state = self._broadcast(sampler.state_dict(), f"elastic.sampler.{name}")
            sampler.load_state_dict(state)
        super().sync()  # ends with self.save(), which saves the model and optimizer too
