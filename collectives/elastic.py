"""Elastic training, shared by every frontend: the state base classes and ``run``.

``run`` is the retry loop around a training function (Horovod's semantics): before each
call the state is synced from rank 0; on :class:`HorovodInternalError` it is restored to its
last commit, on :class:`HostsUpdatedInterrupt` kept; then the worker joins the job's next
membership generation and calls the function again.

``commit()`` saves a copy of the state in memory and then checks for host updates: every
rank contributes the newest membership generation it has heard of to one small allreduce
(max), so all ranks agree whether to raise :class:`HostsUpdatedInterrupt` at this very
commit. A rank of a removed host therefore takes part in the decision like any other and
nobody waits on it afterwards: a graceful removal cannot deadlock.

Horovod scripts also poll ``state._host_messages`` (Horovod's queue of host-change notices)
to learn that hosts changed before they commit, e.g. ``while state._host_messages.empty():``.
Here it is :class:`HostMessages`, a read-only view of the same fact: the membership
generations announced since this worker's own.

Frontends add their framework's states (``collectives.torch.elastic.TorchState``, the
TensorFlow and Keras states); the objects travel through :mod:`collectives.objects`.
"""

from __future__ import annotations

import copy
import enum
import functools
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch

from collectives import ops, runtime
from collectives.common import ReduceOp, global_process_set
from collectives.errors import HorovodInternalError, HostsUpdatedInterrupt
from collectives.objects import allgather_object, broadcast_object
from collectives.runtime.exits import exception_text

__all__ = ["HostMessages", "HostUpdateResult", "ObjectState", "State", "VariablesState", "run"]

logger = logging.getLogger(__name__)

_R = TypeVar("_R")


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
    """Base of elastic states: subclasses implement ``save``, ``restore`` and ``sync``.
    ``bcast_object`` and ``get_rank`` are Horovod's (a subclass written for Horovod passes
    them): kept as ``_bcast_object`` and ``_rank``, as Horovod keeps them."""

    def __init__(
        self,
        bcast_object: Callable[..., Any] = broadcast_object,
        get_rank: Callable[[], int] = runtime.rank,
    ) -> None:
        self._bcast_object = bcast_object
        self._rank = get_rank
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
        """After the worker joined a new generation, before the state is synced: ``reset``,
        then the reset callbacks."""
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def reset(self) -> None:
        """Horovod's hook for a subclass: rebuilds what depends on the job's ranks and size
        (data shards, per-rank objects) after a reset, before the state is synced."""

    def commit(self) -> None:
        """Saves the state (the point a failure rolls back to), then checks for host updates."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raises :class:`HostsUpdatedInterrupt` on every rank at once when hosts were added
        or removed since this generation started (a collective: call it on every rank)."""
        current = runtime.generation()
        newest = torch.tensor([runtime.newest_generation()], dtype=torch.int64)
        handle = ops.submit_allreduce(
            [newest], None, ReduceOp.MAX, 1.0, 1.0, global_process_set,
            "elastic.check_host_updates", ops.first_output, blocking=True,
        )  # fmt: skip
        agreed = int(handle.wait())
        if agreed > current:
            raise HostsUpdatedInterrupt(skip_sync=False)

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError


#: Values a commit keeps as they are (they cannot change in place).
_ATOMS = (type(None), bool, int, float, complex, str, bytes, frozenset)


def _kept(value: Any) -> Any:
    """What a commit keeps of an attribute's value: a copy of plain data (numbers, strings,
    lists, tuples, dicts and sets of them, tensors and arrays), so that a restore also rolls
    back changes made in place (``state.history.append(...)``); any other object (a sampler,
    a dataset, a class of the script's) as it is, as Horovod keeps every value: it is not
    copied at each commit. A tensor is copied detached (one of the autograd graph, such as
    ``state.loss = loss``, cannot be deep-copied)."""
    kind = type(value)
    if kind in _ATOMS:
        return value
    # (their kinds too: defaultdict, OrderedDict, Counter, ...)
    if isinstance(value, list):
        listed: Any = copy.copy(value)
        listed[:] = [_kept(item) for item in value]
        return listed
    if isinstance(value, dict):
        mapped: Any = copy.copy(value)
        mapped.update((key, _kept(item)) for key, item in value.items())
        return mapped
    if isinstance(value, set):
        return copy.copy(value)
    if isinstance(value, tuple):
        items = [_kept(item) for item in value]
        return kind(*items) if hasattr(value, "_fields") else kind(items)
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if kind.__module__ == "numpy" and hasattr(value, "copy"):
        return value.copy()
    return value


class ObjectState(State):
    """Picklable attributes (``ObjectState(epoch=0, batch=0)`` → ``state.epoch``), saved
    in memory by a commit (plain data copied, other objects as they are: see
    :func:`_kept`) and synced from rank 0 with ``broadcast_object``."""

    def __init__(
        self,
        bcast_object: Callable[..., Any] = broadcast_object,
        get_rank: Callable[[], int] = runtime.rank,
        **kwargs: Any,
    ) -> None:
        super().__init__(bcast_object, get_rank)
        # Our own broadcast_object gets names; a user's function is called as Horovod calls
        # it, ``bcast_object(obj)`` (from rank 0: Horovod's broadcast_object's default).
        self._named = bcast_object is broadcast_object
        self._saved_state: dict[str, Any] = {name: _kept(v) for name, v in kwargs.items()}
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
        return self._bcast_object(obj)

    def save(self) -> None:
        self._saved_state = {name: _kept(value) for name, value in self._current().items()}

    def restore(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, _kept(value))

    def sync(self) -> None:
        if self._saved_state:
            synced = self._broadcast(self._current(), "elastic.object_state")
            for name, value in synced.items():
                setattr(self, name, value)
        self.save()


class VariablesState(ObjectState):
    """A framework's variables and picklable attributes: commit copies the variables'
    values to host memory, restore assigns them back, sync broadcasts them from rank 0.
    A frontend says which variables (:meth:`_variables`), how to read one
    (:meth:`_value_of`) and how to broadcast them (:meth:`_broadcast_variables`)."""

    def __init__(self, **kwargs: Any) -> None:
        self._saved_variables: list[Any] = []
        self._saved_values: list[Any] = []
        super().__init__(**kwargs)
        self._save_variables()

    def _variables(self) -> list[Any]:
        raise NotImplementedError

    def _value_of(self, variable: Any) -> Any:
        import numpy as np

        return np.array(variable.numpy(), copy=True)

    def _broadcast_variables(self, variables: list[Any]) -> None:
        raise NotImplementedError

    def _save_variables(self) -> None:
        self._saved_variables = self._variables()
        self._saved_values = [self._value_of(v) for v in self._saved_variables]

    def save(self) -> None:
        self._save_variables()
        super().save()

    def restore(self) -> None:
        # The variables of the commit, each given its value back: the list may have grown
        # since (a Keras model built at its first batch, an optimizer's slots built later).
        for variable, value in zip(self._saved_variables, self._saved_values, strict=True):
            variable.assign(value)
        super().restore()

    def sync(self) -> None:
        variables = self._variables()
        counts = allgather_object(len(variables), "elastic.variables")
        if len(set(counts)) > 1:
            held = ", ".join(f"rank {rank}: {count}" for rank, count in enumerate(counts))
            raise ValueError(
                f"{type(self).__name__}.sync(): the ranks hold different numbers of variables "
                f"({held}); a model that is built on some ranks only (a worker that joins an "
                "elastic job has not run a batch yet) cannot be synced: build the model before "
                "the state syncs (an Input layer, or model.build(input_shape))"
            )
        if variables:
            self._broadcast_variables(variables)
        super().sync()  # ends with save(), which saves the variables too


def run(func: Callable[..., _R]) -> Callable[..., _R]:
    """Decorates ``func(state, *args, **kwargs)`` to survive peer failures and host changes.

    Before each call the state is synced from rank 0. On :class:`HorovodInternalError` the
    state is restored to its last commit; on :class:`HostsUpdatedInterrupt` it is kept. Then
    the worker joins the job's next membership generation and calls ``func`` again.

    In a job that is not elastic (a fixed hvdrun job, or one started by srun, mpirun,
    torchrun, ...) the function runs as plain training, as Horovod's does under mpirun:
    there is no next generation to join, so a failed peer's error ends the worker (after the
    restore), as it would without ``run``.
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> _R:
        runtime.require("hvd.elastic.run")  # (not the first collective of state.sync())
        why = ""  # (what made the last reset, which the peers still in it are told)
        skip_sync = False
        while True:
            if why:
                runtime.reset(why)
                state.on_reset()
            try:
                if not skip_sync:
                    state.sync()
                runtime.state_synced()  # (hvdrun starts no generation without a holder)
                return func(state, *args, **kwargs)
            except HorovodInternalError as error:
                elastic = runtime.is_elastic()
                if elastic:  # (otherwise nothing replaces the peer: see the docstring)
                    logger.warning("a collective failed (%s); restoring the last commit", error)
                state.restore()
                if not elastic:
                    raise
                skip_sync = False
                why = f"hvd.elastic.run restored its last commit after {exception_text(error)}"
            except HostsUpdatedInterrupt as interrupt:
                skip_sync = interrupt.skip_sync
                why = "the job's hosts changed"

    return wrapper
