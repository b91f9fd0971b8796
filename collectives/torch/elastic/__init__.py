"""Elastic training, Horovod's API: ``from collectives.torch import elastic``.

A job started with ``hvdrun -np N --min-np A --max-np B ...`` survives the loss of hosts and
grows or shrinks without restarting the surviving workers::

    state = elastic.TorchState(model=model, optimizer=optimizer, epoch=0, batch=0)

    @elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...
            state.commit()

    train(state)

``run`` syncs the state from rank 0 and calls the function. When a peer dies (the function
raises :class:`HorovodInternalError`) every survivor restores the last commit; when hosts
were added or removed (``commit()`` raises :class:`HostsUpdatedInterrupt` on every rank at
the same commit) the state is kept. Either way the worker leaves the old membership
generation, joins the next one (new rank and size, fresh process groups), syncs the state
from the new rank 0 and calls the function again.

The top layer of ``collectives.torch``: it resets the process runtime
(:func:`collectives.runtime.reset`) and syncs state through the public API
(``functions``, ``mpi_ops``); nothing else in the package imports it but the package's face.
"""

from __future__ import annotations

from collectives.errors import HorovodInternalError, HostsUpdatedInterrupt
from collectives.torch.elastic.runner import run
from collectives.torch.elastic.sampler import ElasticSampler
from collectives.torch.elastic.state import (
    HostMessages,
    HostUpdateResult,
    ObjectState,
    State,
    TorchState,
)

__all__ = [
    "ElasticSampler",
    "HorovodInternalError",
    "HostMessages",
    "HostUpdateResult",
    "HostsUpdatedInterrupt",
    "ObjectState",
    "State",
    "TorchState",
    "run",
]
