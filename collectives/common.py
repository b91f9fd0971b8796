"""Reduction ops and process sets: data shared by every layer of ``collectives``.

The numeric values of the reduction ops are Horovod's, so code that stores or compares them
keeps working. A :class:`ProcessSet` is a subset of the job's ranks that collectives run over;
it gets its ``process_set_id`` when registered (``hvd.add_process_set`` or
``hvd.init(process_sets=[...])``), on every rank in the same order.

This module is a leaf: the engine, the runtime, the submission layer and the frontends import it,
so it imports none of them. A process set still answers ``size()`` and ``rank()``, which
depend on the running job: the runtime hands its rank queries in with :func:`bind_job` when
it is imported, instead of this module calling up into the runtime. Until then (and before
``hvd.init()``, through the runtime's queries) they raise ``NotInitializedError``.
"""

from __future__ import annotations

import contextlib
import enum
import numbers
import operator
from collections.abc import Callable, Iterable
from typing import Any

from collectives.errors import NotInitializedError

__all__ = [
    "ModelVariables",
    "ProcessSet",
    "ReduceOp",
    "bind_job",
    "checked_groups",
    "global_process_set",
    "layer_variables",
    "mark_reduced",
    "optimizer_variables",
    "reduced_over",
    "variable_key",
]


class _ReduceOpType(enum.EnumMeta):
    """``ReduceOp(value)`` takes a member or an integer only. An object that merely compares
    equal to an integer is refused: ``torch.distributed.ReduceOp.SUM`` equals 0, Horovod's
    Average, and ``AVG`` and ``PRODUCT`` equal Sum and Adasum, so a script written for
    torch.distributed would silently reduce with another op."""

    def __call__(cls, value: Any, *args: Any, **kwargs: Any) -> Any:
        if type(value) is cls and not args and not kwargs:  # a member: itself
            return value
        if args or kwargs:  # (enum's functional API)
            return super().__call__(value, *args, **kwargs)
        number = None
        if (isinstance(value, int) and not isinstance(value, bool)) or (
            type(value).__module__ == "numpy" and hasattr(value, "__index__")
        ):
            number = operator.index(value)  # (numpy integers too)
        if number is None:
            raise TypeError(
                "op must be hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max or "
                f"hvd.Product, got {value!r} ({type(value).__name__})"
                + (
                    " (torch.distributed's ReduceOp numbers its ops differently)"
                    if "ReduceOp" in type(value).__qualname__
                    else ""
                )
            )
        return super().__call__(number)


class ReduceOp(enum.IntEnum, metaclass=_ReduceOpType):
    """How an allreduce combines the tensors of the ranks (values as in Horovod)."""

    AVERAGE = 0
    SUM = 1
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5


def _unbound_size() -> int:
    raise NotInitializedError("hvd.size()")


def _unbound_rank() -> int:
    raise NotInitializedError("hvd.rank()")


_job_size: Callable[[], int] = _unbound_size
_job_rank: Callable[[], int] = _unbound_rank


def bind_job(*, size: Callable[[], int], rank: Callable[[], int]) -> None:
    """Where process sets learn the job's size and this process's rank: the runtime passes
    its ``size()`` and ``rank()`` queries here when it is imported."""
    global _job_size, _job_rank
    _job_size, _job_rank = size, rank


class ProcessSet:
    """A subset of the job's ranks that a collective runs over (Horovod's ``ProcessSet``).

    ``ProcessSet([0, 2])`` is only a description until it is registered with
    ``hvd.add_process_set`` (or passed to ``hvd.init(process_sets=...)``); then
    ``process_set_id`` is set and the set can be passed as ``process_set=`` to any op.
    Ranks within the set (``rank()``, and ``root_rank`` of a broadcast on it) count from 0
    in the order of the sorted global ranks.
    """

    def __init__(self, ranks_or_comm: Iterable[int] | Any) -> None:
        if hasattr(ranks_or_comm, "Get_rank"):
            raise NotImplementedError(
                "process sets from MPI communicators are not supported: hvdrun does not use MPI"
            )
        ranks = [int(r) for r in ranks_or_comm]
        if not ranks:
            raise ValueError("a process set needs at least one rank")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"a process set lists each rank once, got {ranks}")
        self._ranks: list[int] | None = sorted(ranks)
        self.process_set_id: int | None = None

    @property
    def ranks(self) -> list[int]:
        """The global ranks in the set, sorted."""
        if self._ranks is None:  # the global set: every rank of the job
            return list(range(_job_size()))
        return list(self._ranks)

    def is_global(self) -> bool:
        """Whether this is the process set of all ranks."""
        return self.process_set_id == 0

    def size(self) -> int:
        """Number of ranks in the process set."""
        if self._ranks is None:
            return _job_size()
        return len(self._ranks)

    def rank(self) -> int:
        """This process's rank within the process set (-1 if it is not a member)."""
        own = _job_rank()
        ranks = self.ranks
        return ranks.index(own) if own in ranks else -1

    def included(self) -> bool:
        """Whether this process is a member of the process set."""
        return self.rank() >= 0

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ProcessSet):
            return NotImplemented
        if self.is_global() or other.is_global():
            return self.is_global() and other.is_global()
        return self._ranks == other._ranks and self.process_set_id == other.process_set_id

    def __hash__(self) -> int:
        return hash((self.process_set_id, tuple(self._ranks or ())))

    def __repr__(self) -> str:
        if self.is_global():
            return "ProcessSet(global)"
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self._ranks})"


def _make_global() -> ProcessSet:
    process_set = ProcessSet.__new__(ProcessSet)
    process_set._ranks = None
    process_set.process_set_id = 0
    return process_set


global_process_set = _make_global()


def variable_key(variable: Any) -> int:
    """One key per variable, whichever object stands for it: a Keras 3 variable (which has
    no ``ref()`` and no hash) and the backend variable it holds (a ``tf.Variable``, a torch
    parameter) get the same key, so that a variable registered as local is recognised in
    whichever form the gradients come."""
    inner = getattr(variable, "_value", None)
    if inner is not None and type(variable).__module__.startswith("keras"):
        return id(inner)
    return id(variable)


#: The attribute that marks a gradient a ``DistributedGradientTape`` returned: the process set
#: it was reduced over, so that a ``DistributedOptimizer`` over that set applies it as it
#: comes instead of reducing it again (on the tensor itself: a record by variable would go
#: stale between a traced step and an eager one).
_REDUCED_OVER = "_hvd_reduced_over"


def mark_reduced(tensors: Iterable[Any], process_set: ProcessSet) -> None:
    """Marks ``tensors`` (None among them skipped) as reduced over ``process_set``. A tensor
    type that takes no attribute stays unmarked: it is reduced again, as before."""
    for tensor in tensors:
        if tensor is not None:
            with contextlib.suppress(AttributeError, TypeError):
                setattr(tensor, _REDUCED_OVER, process_set)


def reduced_over(tensor: Any) -> ProcessSet | None:
    """The process set a ``DistributedGradientTape`` reduced ``tensor`` over, or None."""
    mark = getattr(tensor, _REDUCED_OVER, None)
    return mark if isinstance(mark, ProcessSet) else None


def layer_variables(layers: Any) -> list[Any]:
    """The trainable variables of a layer or of a list of layers (None: none); a clear
    error for anything that is not a layer."""
    if layers is None:
        return []
    if hasattr(layers, "trainable_weights"):
        layers = [layers]
    elif not isinstance(layers, Iterable):
        raise ValueError(f"local_layers must be Keras layers, got {type(layers).__name__}")
    layers = list(layers)
    bad = [type(layer).__name__ for layer in layers if not hasattr(layer, "trainable_weights")]
    if bad:
        raise ValueError(f"All local layers must be Keras layers, got {', '.join(bad)}")
    return [variable for layer in layers for variable in layer.trainable_weights]


def checked_groups(groups: Any, num_groups: int = 0) -> Any:
    """Horovod's ``groups`` argument (``num_groups``, its old name, where it is None): None, a
    number of groups above 0 or a list of lists of variables, as Horovod accepts; anything
    else is a ValueError (as Horovod raises), here when the tape or optimizer is made."""
    name = "groups"
    if num_groups and groups is None:
        groups, name = num_groups, "num_groups"
    if groups is None or isinstance(groups, list | tuple):
        return groups
    if isinstance(groups, numbers.Integral) and not isinstance(groups, bool) and int(groups) > 0:
        return int(groups)
    raise ValueError(
        f"{name} should be a positive integer (the number of groups) or a list of lists of "
        f"variables, got {groups!r}"
    )


def optimizer_variables(optimizer: Any, model: Any) -> list[Any]:
    """The optimizer's variables, built first where Keras builds them lazily (Keras 3): every
    rank must hold the same ones before they are broadcast. Not while the model has no
    variables yet (a model built at its first batch): an optimizer built on none refuses
    the model's variables at its first step, so it is built once they exist."""
    if optimizer is None:
        return []
    if not getattr(optimizer, "built", True) and hasattr(optimizer, "build"):
        trainable = list(model.trainable_variables)
        if trainable:
            optimizer.build(trainable)
    variables = getattr(optimizer, "variables", None) or []
    return list(variables() if callable(variables) else variables)


class ModelVariables:
    """What the elastic states of a Keras model share: the model and its optimizer (the
    model's own where none is given, looked up again while ``compile`` has made none), and
    their variables for the state to sync, commit and restore."""

    def __init__(self, model: Any, optimizer: Any, **kwargs: Any) -> None:
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        super().__init__(**kwargs)

    def _variables(self) -> list[Any]:
        """The model's variables and its optimizer's (see :func:`optimizer_variables`);
        none while the model is not built (tf_keras raises for them then)."""
        if self.optimizer is None:  # (a state made before model.compile)
            self.optimizer = getattr(self.model, "optimizer", None)
        if not getattr(self.model, "built", True):
            return []
        return list(self.model.variables) + optimizer_variables(self.optimizer, self.model)
