"""The torch.distributed side of the runtime: the backend, the CUDA device, and the engine on
process groups of its own.

The default torch process group stays the user's: the collectives engine runs on groups of
its own (per process set, a Gloo group for its negotiation and a data group), so a script may
still call ``torch.distributed`` directly without its collectives interleaving with the
engine's. Those groups wait at most ``HVDRUN_GLOO_TIMEOUT_SECONDS`` (30) for a peer. The
engine does not reach for torch.distributed to make more of them: it is handed
``make_groups``/``destroy_group`` here.

How the default group itself comes about depends on how the process joined its job (see
:mod:`.bootstrap` and :mod:`.registration`); what happens once it exists is the same for all.
A default group that a framework made before ``hvd.init()`` (:mod:`.adopted`) outlives the
runtime: shutdown then destroys the engine's groups only.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from collectives.engine import timeline
from collectives.engine.core import Engine
from collectives.runtime.state import RuntimeState

__all__ = [
    "choose_backend",
    "destroy_groups",
    "destroy_own_groups",
    "select_cuda_device",
    "start_engine",
    "stop_collectives",
]

logger = logging.getLogger(__name__)


def choose_backend() -> str:
    """Gloo for CPU tensors, and NCCL for CUDA tensors where there is a GPU."""
    if torch.cuda.is_available() and dist.is_nccl_available():
        return "cpu:gloo,cuda:nccl"
    return "gloo"


def select_cuda_device(backend: str, local_rank_: int) -> None:
    """With NCCL, makes the GPU of this local rank the current CUDA device."""
    if "nccl" not in backend:
        return
    count = torch.cuda.device_count()
    if local_rank_ < count:
        torch.cuda.set_device(local_rank_)
    else:
        logger.warning(
            "local rank %d has no GPU of its own (%d visible); leaving the CUDA device as is",
            local_rank_,
            count,
        )


def destroy_groups() -> None:
    """Destroys the default process group and every other one (it may be broken already),
    and restarts torch's count of unnamed groups.

    torch names each group by that count, and the names are part of the store keys its
    bootstrap meets peers under. ``destroy_process_group()`` restarts the count, but an
    ``init_process_group`` that failed (an elastic bootstrap superseded by a newer
    generation) counted a default group it never created: the next bootstrap would then look
    for its peers under other keys than theirs, and every rank would wait for the others.
    """
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception as error:  # the groups may be broken already
        logger.debug("destroy_process_group failed: %s", error)
    if not dist.is_initialized():
        distributed_c10d._world.group_count = 0


def start_engine(runtime_: RuntimeState) -> Engine:
    """Creates the engine's own process groups (on every rank, same order) and starts it."""
    topo, cfg = runtime_.topology, runtime_.config
    timeout = datetime.timedelta(seconds=cfg.collective_timeout_seconds)
    everyone = list(range(topo.size))
    own = runtime_.own_groups

    def make_groups(ranks: list[int]) -> tuple[Any, Any]:
        control_ = dist.new_group(ranks, backend="gloo", timeout=timeout)
        data_ = dist.new_group(ranks, backend=runtime_.backend, timeout=timeout)
        own.extend(group for group in (control_, data_) if isinstance(group, dist.ProcessGroup))
        return control_, data_

    def destroy_group(group: Any) -> None:
        if isinstance(group, dist.ProcessGroup):
            if group in own:
                own.remove(group)
            dist.destroy_process_group(group)

    control, data = make_groups(everyone)

    engine = Engine(
        rank=topo.rank,
        size=topo.size,
        config=cfg,
        control_group=control,
        global_group=data,
        make_groups=make_groups,
        destroy_group=destroy_group,
        cuda_device=torch.cuda.current_device() if "nccl" in runtime_.backend else None,
    )
    if cfg.timeline:
        engine.timeline = timeline.open_for_rank(
            cfg.timeline, cfg.timeline_mark_cycles, topo.rank, cfg.timeline_all_ranks, runtime_.host
        )
    engine.start()
    return engine


def destroy_own_groups(runtime_: RuntimeState) -> None:
    """Destroys the engine's process groups only: the default group is a framework's."""
    own, runtime_.own_groups = runtime_.own_groups, []
    for group in own:
        try:
            dist.destroy_process_group(group)
        except Exception as error:  # already destroyed with the whole world, or broken
            logger.debug("destroying an engine group failed: %s", error)


def stop_collectives(runtime_: RuntimeState, timeout: float) -> None:
    """Stops the engine (waiting at most ``timeout`` for its last cycle) and destroys the
    process groups (not a framework's default group); the rendezvous connection stays."""
    engine_, runtime_.engine = runtime_.engine, None
    if engine_ is not None:
        engine_.stop(timeout=timeout)
    if runtime_.adopted:
        destroy_own_groups(runtime_)
    else:
        runtime_.own_groups = []
        destroy_groups()
