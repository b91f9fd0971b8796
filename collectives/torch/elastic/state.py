"""The PyTorch frontend's elastic state: models, optimizers, learning-rate schedulers and
samplers besides any picklable attributes (see :mod:`collectives.elastic` for the base
classes and ``run``).

Each attribute of a torch kind gets a handler that keeps the very object the script holds:
``commit()`` copies its ``state_dict()``, ``restore()`` loads the copy back into it and
``sync()`` loads rank 0's into it, so a scheduler stays bound to its optimizer and a model
to the parameters its optimizer steps. Assigning a new object of a handled attribute
(``state.sampler = ElasticSampler(...)``) hands the new object to the handler, which saves
it at once. Every other attribute is an :class:`~collectives.elastic.ObjectState` value
(plain data copied at a commit, other objects kept as they are; broadcast pickled).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from collectives.elastic import ObjectState
from collectives.torch.functions import broadcast_optimizer_state, broadcast_parameters

__all__ = ["TorchState"]


class _Handler:
    """One attribute of a torch kind: its object, and the copy of its state last saved."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.saved: Any = None
        self.save()

    def save(self) -> None:
        # state_dict() is a fresh dict, but it holds the object's own tensors and lists.
        self.saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(copy.deepcopy(self.saved))

    def sync(self, state: TorchState, name: str) -> None:
        self.value.load_state_dict(state.broadcast_value(self.value.state_dict(), name))


class _ModelHandler(_Handler):
    def save(self) -> None:
        self.saved = {k: t.detach().clone() for k, t in self.value.state_dict().items()}

    def restore(self) -> None:
        self.value.load_state_dict(self.saved)  # copies into the model's own tensors

    def sync(self, state: TorchState, name: str) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class _OptimizerHandler(_Handler):
    def sync(self, state: TorchState, name: str) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


class _SamplerHandler(_Handler):
    def save(self) -> None:
        self.saved = self.value.state_dict()  # fresh sets and numbers: nothing shared

    def restore(self) -> None:
        self.value.load_state_dict(self.saved)


def _handler_for(value: Any) -> _Handler | None:
    from collectives.torch.elastic.sampler import ElasticSampler

    if isinstance(value, torch.nn.Module):
        return _ModelHandler(value)
    if isinstance(value, torch.optim.Optimizer):
        return _OptimizerHandler(value)
    if isinstance(value, torch.optim.lr_scheduler.LRScheduler):
        return _Handler(value)
    if isinstance(value, ElasticSampler):
        return _SamplerHandler(value)
    return None


class TorchState(ObjectState):
    """Models, optimizers, learning-rate schedulers, :class:`~collectives.torch.elastic.
    ElasticSampler` objects and any other picklable attributes, as in Horovod:
    ``TorchState(model=model, optimizer=optimizer, scheduler=scheduler, epoch=0)``; any
    number of each kind, under any names."""

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        **kwargs: Any,
    ) -> None:
        values = {"model": model, "optimizer": optimizer, **kwargs}
        handlers = {}
        for name, value in values.items():
            handler = _handler_for(value)
            if handler is not None:
                handlers[name] = handler
        object.__setattr__(self, "_handlers", handlers)
        plain = {k: v for k, v in values.items() if k not in handlers}
        super().__init__(**plain)
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)

    def __setattr__(self, name: str, value: Any) -> None:
        handler = self.__dict__.get("_handlers", {}).get(name)
        if handler is not None:  # a new object of a handled kind: saved as it is now
            replacement = _handler_for(value)
            if replacement is None or type(replacement) is not type(handler):
                raise TypeError(
                    f"TorchState.{name} holds an object of type {type(handler.value).__name__}"
                    f", restored in place: one of type {type(value).__name__} cannot replace it"
                )
            self._handlers[name] = replacement
        super().__setattr__(name, value)

    def broadcast_value(self, value: Any, name: str) -> Any:
        """Rank 0's ``value`` of the attribute ``name`` (a pickled broadcast)."""
        return self._broadcast(value, f"elastic.state.{name}")

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for name, handler in self._handlers.items():
            handler.sync(self, name)
        super().sync()  # ends with self.save(), which saves every handled object too
