"""Joining a job whose ``torch.distributed`` default process group already exists.

Ray Train's ``TorchTrainer``, Lightning's DDP strategy, Hugging Face Accelerate, Spark's
``TorchDistributor`` and plain torchrun scripts call ``init_process_group()`` before the
user's code runs. ``hvd.init()`` then joins that job instead of forming one:

* rank and size are the default group's; an environment that names another rank or size
  (``RANK``/``WORLD_SIZE``, ``HVDRUN_RANK``/``HVDRUN_SIZE``, or another launcher's variables
  as :mod:`rendezvous.launchers` reads them) is an error naming both, never a guess;
* local and cross ranks come from one exchange over the default group's store, under a
  prefix of hvd's own: each rank publishes its host (and ``LOCAL_RANK`` where its launcher
  set one), and every rank derives the same slot table from them as the rendezvous does
  for jobs other launchers start (:func:`rendezvous.slots.derive_slots`). The store is
  used rather than the group so that the exchange works whatever the group's backend (an
  NCCL group would need the CUDA device chosen first, and that needs the local rank);
* the engine runs on process groups of its own, made with ``new_group`` on the framework's
  default group (its store, torch's own key prefixes), with the backend the runtime
  chooses everywhere (Gloo, and NCCL for CUDA tensors where there is a GPU), so the
  framework's collectives and hvd's never share a communicator;
* ``hvd.shutdown()`` destroys only those groups: the framework's default group stays as it
  was, and ``hvd.init()`` may join it again.

There is no rendezvous connection here: the framework that made the group owns the job and
its failures. Elastic hvdrun jobs are refused (hvd rebuilds their default group for each
membership generation). A non-elastic ``hvdrun`` job whose script made the default group
itself is joined the same way (hvdrun's variables must agree with the group).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from collectives.runtime.launched import start_timeout
from collectives.runtime.state import RuntimeState, Topology
from rendezvous import launchers, worker_env
from rendezvous.slots import derive_slots

__all__ = [
    "ADOPTED_PREFIX",
    "AdoptionError",
    "check_environment",
    "exchange_places",
    "init_adopted",
    "topology_from",
]

logger = logging.getLogger(__name__)

#: hvd's keys in the default group's store (torch's own groups use "<number>/" prefixes).
ADOPTED_PREFIX = "hvdrun/adopted/"


class AdoptionError(RuntimeError):
    """``hvd.init()`` cannot join the existing default process group; the message says why."""


def _pair(rank: int, size: int) -> str:
    return f"rank {rank} of {size}"


def check_environment(rank: int, size: int, env: Mapping[str, str]) -> str:
    """Checks that nothing in ``env`` places this process elsewhere than the default group
    does (``rank`` of ``size``); returns who started the process, in words ("" if unknown).

    Raises :class:`AdoptionError` naming both places. Launcher variables that cannot
    describe a job on their own (``WORLD_SIZE`` without ``RANK``, no address to meet at)
    do not matter here: the group exists, so only the rank and size they name are checked.
    """
    group = f"torch.distributed's default process group says this process is {_pair(rank, size)}"
    started = _env_int(env, worker_env.SIZE) if env.get(worker_env.RENDEZVOUS_ADDR) else None
    if started is not None and started != size:
        # (hvdrun's WORLD_SIZE differs too: the group is the script's, or its framework's)
        raise AdoptionError(
            f"hvd.init(): {group}, but hvdrun started {started} workers: the script or its "
            "framework made a group of its own that does not span them. Make it span hvdrun's "
            "workers (PyTorch Lightning: Trainer(devices=<workers per host>, "
            "num_nodes=<hosts>), as -np and -H give them), or make no group and let "
            "hvd.init() make it"
        )
    for name, expected in (("RANK", rank), ("WORLD_SIZE", size)):
        raw = env.get(name, "").strip()
        if raw and raw != str(expected):
            raise AdoptionError(
                f"hvd.init(): {group}, but {name}={raw} in the environment says otherwise. "
                "Make the environment agree with the group, or unset the variable"
            )
    if worker_env.flag(worker_env.ELASTIC, env) and env.get(worker_env.RENDEZVOUS_ADDR):
        raise AdoptionError(
            "hvd.init(): this is an elastic hvdrun job, whose default process group hvd.init() "
            "builds anew for each membership generation, but torch.distributed already has "
            "one. Remove the init_process_group() call from the script (hvd.init() creates "
            "the group), or run the job without --min-np/--max-np"
        )
    try:
        placement = launchers.detect(env)
    except launchers.DetectionError as error:
        logger.debug("ignoring launcher variables beside an existing default group: %s", error)
        return ""
    if placement is None:
        return ""
    if (placement.rank, placement.size) != (rank, size):
        raise AdoptionError(
            f"hvd.init(): {group}, but {placement.name} says "
            f"{_pair(placement.rank, placement.size)}. The group and the launcher must "
            "describe the same job"
        )
    return placement.name


def _identity(env: Mapping[str, str]) -> str:
    """What this process's local peers have in common (see ``launchers.local_peers``)."""
    host = env.get(worker_env.HOSTNAME) or socket.gethostname()
    return launchers.local_peers(host, launchers.torchrun_agent(env))


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise AdoptionError(f"hvd.init(): {name} must be an integer, got {raw!r}") from None


def exchange_places(
    store: Any,
    rank: int,
    size: int,
    identity: str,
    local_rank: int | None,
    timeout: float,
) -> list[tuple[str, int | None]]:
    """Every rank's ``(identity, local rank or None)``, through ``store`` (rank order).

    Each call of the job draws one number from a shared counter, so the keys of a later
    ``hvd.init()`` (after ``hvd.shutdown()``) never meet those of an earlier one: a
    call's keys are written only after every rank drew its number for it.
    """
    prefixed = dist.PrefixStore(ADOPTED_PREFIX, store)
    round_ = (int(prefixed.add("calls", 1)) - 1) // size
    prefixed.set(f"{round_}/place/{rank}", json.dumps([identity, local_rank]))
    keys = [f"{round_}/place/{peer}" for peer in range(size)]
    try:
        prefixed.wait(keys, datetime.timedelta(seconds=timeout))
    except RuntimeError:  # DistStoreError: the store's own timeout
        missing = [peer for peer, key in enumerate(keys) if not prefixed.check([key])]
        raise AdoptionError(
            f"hvd.init(): {len(missing)} of the {size} ranks of torch.distributed's default "
            f"process group did not call hvd.init() within {timeout:g} s "
            f"(HVDRUN_START_TIMEOUT): ranks {', '.join(map(str, missing))}. Every rank of the "
            "group must call it"
        ) from None
    places = []
    for value in prefixed.multi_get(keys):
        found, local = json.loads(bytes(value).decode())
        places.append((str(found), None if local is None else int(local)))
    return places


def topology_from(
    places: list[tuple[str, int | None]], rank: int, local_size: int | None
) -> Topology:
    """This rank's topology from every rank's place; ``local_size`` is ``LOCAL_WORLD_SIZE``
    where set, which must agree with the ranks that share this rank's host."""
    try:
        slots = derive_slots([host for host, _ in places], [local for _, local in places])
    except ValueError as error:
        raise AdoptionError(f"hvd.init(): {error}") from None
    slot = slots[rank]
    if local_size is not None and local_size != slot.local_size:
        raise AdoptionError(
            f"hvd.init(): LOCAL_WORLD_SIZE={local_size}, but {slot.local_size} rank(s) of "
            f"torch.distributed's default process group run on this host "
            f"({slot.hostname.partition('#')[0]})"
        )
    return Topology(
        slot.rank, slot.size, slot.local_rank, slot.local_size, slot.cross_rank, slot.cross_size
    )


def _choose_cuda_device(backend: str, local_rank: int) -> None:
    """Keeps the CUDA device the framework made current; where it made none (device 0 on a
    local rank other than 0), takes the local rank's GPU as ``hvd.init()`` does elsewhere."""
    if "nccl" not in backend or local_rank == 0:
        return
    if torch.cuda.current_device() == 0 and local_rank < torch.cuda.device_count():
        torch.cuda.set_device(local_rank)


def init_adopted(backend: str, env: Mapping[str, str] | None = None) -> RuntimeState:
    """Joins the job of the existing default process group (see the module's docstring)."""
    source = os.environ if env is None else env
    rank, size = dist.get_rank(), dist.get_world_size()
    started_by = check_environment(rank, size, source)
    timeout = start_timeout()
    local_rank = _env_int(source, "LOCAL_RANK")
    local_size = _env_int(source, "LOCAL_WORLD_SIZE")
    store = distributed_c10d._get_default_store()
    places = exchange_places(store, rank, size, _identity(source), local_rank, timeout)
    topology = topology_from(places, rank, local_size)
    _choose_cuda_device(backend, topology.local_rank)
    host = source.get(worker_env.HOSTNAME) or socket.gethostname()
    return RuntimeState(
        topology=topology,
        backend=backend,
        timeout=datetime.timedelta(seconds=timeout),
        store=store,
        started_by=started_by or "the framework that created torch.distributed's default group",
        host=host,
        adopted=True,
    )
