"""The PyTorch frontend's elastic state: a model, an optimizer and samplers besides any
picklable attributes (see :mod:`collectives.elastic` for the base classes and ``run``)."""

from __future__ import annotations

import copy
from typing import Any

import torch

from collectives.elastic import ObjectState
from collectives.torch.functions import broadcast_optimizer_state, broadcast_parameters

__all__ = ["TorchState"]


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
