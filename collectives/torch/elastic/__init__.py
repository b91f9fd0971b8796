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

The top layer of ``collectives.torch``: ``run`` and the base states are the neutral
:mod:`collectives.elastic`'s (every frontend shares them); ``TorchState`` syncs a model and
an optimizer through ``functions``. Nothing else in the package imports it but its face.
"""

from __future__ import annotations

from collectives.elastic import HostMessages, HostUpdateResult, ObjectState, State, run
from collectives.errors import HorovodInternalError, HostsUpdatedInterrupt
from collectives.torch.elastic.sampler import ElasticSampler
from collectives.torch.elastic.state import TorchState

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
