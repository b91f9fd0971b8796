"""The Ray actor that hosts one worker of a :class:`~collectives.ray.RayExecutor` job.

An actor is a process of its own that lives as long as the executor. It does what an
``hvdrun`` worker's start-up does, in three calls from the driver:

1. :meth:`RayWorker.node` -- where Ray placed it, so the driver can number the ranks of
   each node;
2. :meth:`RayWorker.setup` -- the environment a worker started by ``hvdrun`` gets (placement,
   rendezvous address, job id, secret, TLS certificate), set in this process before any user
   code runs, so ``hvd.init()`` joins the job through the rendezvous exactly as under
   ``hvdrun``; what the actor inherited from the driver that such a worker never gets
   (another launcher's ``SLURM_PROCID``, an enclosing hvdrun job's variables) goes first.
   The secret arrives as a call argument, never on a command line;
3. :meth:`RayWorker.start_executable` -- Horovod's stateful ``executable_cls``, if any.

Before the second, rank 0's actor picks ``MASTER_ADDR``/``MASTER_PORT`` on its node
(:meth:`RayWorker.pick_master`), which every worker then gets, as under ``hvdrun``.

Then it runs what :meth:`~collectives.ray.RayExecutor.run` and
:meth:`~collectives.ray.RayExecutor.execute` send it, one call at a time.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

import ray

from collectives.ray.placement import WorkerNode
from rendezvous import worker_env
from rendezvous.addresses import interface_facing, pick_master
from rendezvous.launchers import is_foreign

__all__ = ["BaseHorovodWorker", "RayWorker"]

#: Gloo's and NCCL's choice of network interface; the rendezvous's when the job set none.
IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
#: An enclosing hvdrun job's per-job variables, which an actor may have inherited from the
#: driver (through its raylet) and which would mislead ``hvd.init()`` here: the placement
#: and connection ones every launcher sets, the host relay and the elastic ones.
HVDRUN_JOB_VARIABLES = worker_env.LAUNCHER_SET | {
    worker_env.RENDEZVOUS_RELAY_ADDR,
    worker_env.GENERATION,
    worker_env.WORKER,
    *worker_env.setting_names(worker_env.ELASTIC),
}


def drop_inherited(environ: MutableMapping[str, str]) -> list[str]:
    """Removes what an ``hvdrun`` worker never inherits: other launchers' per-process
    variables (``SLURM_PROCID``, ``OMPI_COMM_WORLD_RANK``, ``MASTER_ADDR``, ...:
    :data:`rendezvous.launchers.FOREIGN_VARIABLES`) and an enclosing hvdrun job's
    (:data:`HVDRUN_JOB_VARIABLES`); the names removed."""
    dropped = [name for name in environ if name in HVDRUN_JOB_VARIABLES or is_foreign(name)]
    for name in dropped:
        del environ[name]
    return dropped


class RayWorker:
    """One worker's actor (Horovod's ``BaseHorovodWorker``)."""

    def __init__(self) -> None:
        self.executable: Any = None

    def node(self) -> WorkerNode:
        """The Ray node this actor runs on, its process id and the GPUs Ray gave it."""
        context = ray.get_runtime_context()
        gpus = tuple(str(gpu) for gpu in ray.get_gpu_ids())
        return WorkerNode(
            context.get_node_id(),
            ray.util.get_node_ip_address(),
            os.getpid(),
            context.get_actor_id() or "",
            gpus,
        )

    def setup(self, env: Mapping[str, str]) -> None:
        """Takes on a launched worker's environment, without what the actor inherited from
        the driver that an ``hvdrun`` worker never gets (:func:`drop_inherited`); points
        Gloo and NCCL at the interface that faces the rendezvous unless the job chose one."""
        drop_inherited(os.environ)
        os.environ.update(env)
        ifname, _ = interface_facing(env[worker_env.RENDEZVOUS_ADDR])
        for name in IFNAME_VARIABLES:
            if ifname is not None and not os.environ.get(name):
                os.environ[name] = ifname

    def pick_master(self, rendezvous_addr: str) -> tuple[str, int]:
        """``MASTER_ADDR``/``MASTER_PORT`` for plain ``torch.distributed`` scripts, picked
        on rank 0's node as hvdrun's agent there picks them
        (:func:`rendezvous.addresses.pick_master`; no route known: the node's Ray address)."""
        return pick_master(rendezvous_addr, ray.util.get_node_ip_address)

    def update_env_vars(self, env_vars: Mapping[str, Any]) -> None:
        """Horovod's name: sets environment variables in this actor's process."""
        os.environ.update({name: str(value) for name, value in env_vars.items()})

    def env_vars(self) -> dict[str, str]:
        """Horovod's name: this actor's environment."""
        return dict(os.environ)

    def start_executable(
        self,
        executable_cls: type | None = None,
        executable_args: Sequence[Any] | None = None,
        executable_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        """Creates the executable that :meth:`execute` hands to its functions."""
        if executable_cls is not None:
            self.executable = executable_cls(*(executable_args or ()), **(executable_kwargs or {}))

    def execute(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(executable)`` (None without an ``executable_cls``)."""
        return fn(self.executable)

    def run(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        """``fn(*args, **kwargs)``."""
        return fn(*args, **kwargs)


#: Horovod's name for the worker actor class.
BaseHorovodWorker = RayWorker
