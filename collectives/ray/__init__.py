"""Horovod's Ray integration: ``from collectives.ray import RayExecutor``.

:class:`RayExecutor` runs a job's workers as Ray actors placed by a placement group, and
they join the job through hvdrun's own rendezvous, served by the executor in the driver's
process: ``hvd.init()`` (:mod:`collectives.torch`) inside a function the executor runs
works as under ``hvdrun``. The parts:

* :mod:`.executor` -- :class:`RayExecutor`: placement, start-up, running, shutting down;
* :mod:`.worker` -- the actor each worker runs in;
* :mod:`.placement` -- the pure decisions: bundles, the slot table of the nodes the actors
  landed on, where the rendezvous listens, which GPUs each worker sees.

Ray Train's ``TorchTrainer`` needs none of this: it starts its workers and their process
group itself, and ``hvd.init()`` in its training function joins that group (docs/ray.md).

This frontend imports no other frontend; it needs Ray (``pip install 'hvdrun[ray]'``).
"""

from __future__ import annotations

try:
    import ray as _ray  # noqa: F401  (only to say what is missing)
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "collectives.ray needs Ray: pip install 'hvdrun[ray]' (or pip install 'ray[train]')"
    ) from error

from collectives.ray.executor import (
    PlacementGroupTimeoutError,
    RayExecutor,
    RayExecutorSettings,
    WorkerDiedError,
)
from collectives.ray.worker import BaseHorovodWorker, RayWorker

__all__ = [
    "BaseHorovodWorker",
    "PlacementGroupTimeoutError",
    "RayExecutor",
    "RayExecutorSettings",
    "RayWorker",
    "WorkerDiedError",
]
