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

import contextlib
import datetime
import functools
import logging
import os
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from collectives.engine import timeline
from collectives.engine.config import must_agree, settings_disagreement
from collectives.engine.core import Engine
from collectives.errors import SettingsMismatchError, SharedGpuError
from collectives.runtime.state import RuntimeState
from rendezvous import worker_env
from rendezvous.addresses import missing_interfaces

__all__ = [
    "GpuPlace",
    "check_interfaces",
    "choose_backend",
    "cuda_backend_setting",
    "destroy_groups",
    "destroy_own_groups",
    "init_default_group",
    "job_facts",
    "keep_nccl_off_the_store",
    "select_cuda_device",
    "shared_gpu_error",
    "start_engine",
    "stop_collectives",
    "uses_cuda",
]

logger = logging.getLogger(__name__)


def cuda_backend_setting() -> str | None:
    """``HVDRUN_CUDA_BACKEND`` (``hvdrun --cuda-backend``): "nccl", "gloo" or None (unset)."""
    return worker_env.choice(worker_env.CUDA_BACKEND, worker_env.CUDA_BACKENDS)


def choose_backend() -> str:
    """Gloo for CPU tensors; for CUDA tensors NCCL where there is a GPU, unless the job
    asked for Gloo (``HVDRUN_CUDA_BACKEND=gloo``: through host memory, so that several
    ranks may share a GPU)."""
    wanted = cuda_backend_setting()
    if wanted == "gloo":
        return "gloo"
    if torch.cuda.is_available() and dist.is_nccl_available():
        return "cpu:gloo,cuda:nccl"
    if wanted == "nccl":
        why = "no GPU is visible" if dist.is_nccl_available() else "this torch has no NCCL"
        raise RuntimeError(
            f"{worker_env.variable(worker_env.CUDA_BACKEND)}=nccl (hvdrun --cuda-backend "
            f"nccl), but {why}; leave it unset to run on the CPU with Gloo"
        )
    return "gloo"


#: NCCL's flight-recorder "dump" signal travels through the default group's store: every
#: second NCCL's monitor thread polls it from C++, and its watchdog writes it on an error.
DUMP_SIGNAL_VARIABLE = "TORCH_NCCL_DUMP_ON_TIMEOUT"


def keep_nccl_off_the_store(backend: str) -> None:
    """Turns NCCL's dump signal off (unless the user set it) where the default group's store
    is the rendezvous, a Python store: then no C++ thread of torch calls into Python, which
    aborts the process if it happens while the interpreter shuts down."""
    if "nccl" in backend:
        os.environ.setdefault(DUMP_SIGNAL_VARIABLE, "0")


def uses_cuda(backend: str) -> bool:
    """Whether the job runs CUDA tensors: through NCCL, or through Gloo when asked to."""
    if "nccl" in backend:
        return True
    return cuda_backend_setting() == "gloo" and torch.cuda.is_available()


def select_cuda_device(backend: str, local_rank_: int) -> None:
    """Makes the GPU of this local rank the current CUDA device: with NCCL the GPU of its
    own (a rank beyond the visible GPUs keeps the current one, as under a launcher that
    gives every rank one GPU through CUDA_VISIBLE_DEVICES); with CUDA through Gloo, the
    local ranks take the visible GPUs in turn and may share them."""
    if not uses_cuda(backend):
        return
    count = torch.cuda.device_count()
    if local_rank_ < count:
        torch.cuda.set_device(local_rank_)
    elif "nccl" not in backend and count:
        torch.cuda.set_device(local_rank_ % count)
    else:
        logger.info(
            "local rank %d has no GPU of its own (%d visible); leaving the CUDA device as is",
            local_rank_,
            count,
        )


def check_interfaces() -> None:
    """The interfaces ``GLOO_SOCKET_IFNAME`` names must exist on this host; said plainly
    (Gloo's own error names neither the variable nor the interfaces the host has)."""
    names = os.environ.get("GLOO_SOCKET_IFNAME")
    missing, have = missing_interfaces(names or "")
    if missing:
        raise RuntimeError(
            f"hvd.init(): GLOO_SOCKET_IFNAME={names} names {', '.join(missing)}, which this "
            f"host ({socket.gethostname()}) does not have; its interfaces: {', '.join(have)} "
            "(hvdrun --network-interface sets the variable for every host of a job)"
        )


@dataclass(frozen=True)
class GpuPlace:
    """The GPU one rank runs its CUDA collectives on, as NCCL tells GPUs apart."""

    rank: int
    host: str
    index: int  # its CUDA device index in this process
    gpu: str  # what identifies the physical GPU (its UUID); "" when unknown
    visible: int  # GPUs this process sees

    @staticmethod
    def of_this_process(rank_: int, host: str) -> GpuPlace:
        index = torch.cuda.current_device()
        properties = torch.cuda.get_device_properties(index)
        uuid = getattr(properties, "uuid", None)  # (older torch builds lack it)
        return GpuPlace(rank_, host, index, str(uuid) if uuid else "", torch.cuda.device_count())


def shared_gpu_error(places: Sequence[GpuPlace]) -> str | None:
    """Why NCCL cannot run the job, when two ranks on one host would use one GPU (NCCL
    refuses that, and the failure would look like a dead peer); None when every rank has
    a GPU of its own."""
    users: dict[tuple[str, str], list[GpuPlace]] = {}
    for place in places:
        if place.gpu:
            users.setdefault((place.host, place.gpu), []).append(place)
    shared = next((ranks for ranks in users.values() if len(ranks) > 1), None)
    if shared is None:
        return None
    host = shared[0].host
    local = sum(1 for place in places if place.host == host)
    ranks = ", ".join(str(place.rank) for place in shared)
    return (
        f"{local} ranks run on host {host}, which has {shared[0].visible} visible GPU(s): "
        f"ranks {ranks} would share GPU {shared[0].index}, and NCCL cannot run two ranks "
        "of one job on one GPU. Start at most one process per GPU on each host (-np, "
        "-H HOST:SLOTS), make more GPUs visible (CUDA_VISIBLE_DEVICES), or run CUDA "
        "tensors through Gloo, which lets ranks share a GPU (slower): hvdrun "
        f"--cuda-backend gloo, or {worker_env.variable(worker_env.CUDA_BACKEND)}=gloo"
    )


def job_facts(
    control: Any, place: GpuPlace | None, settings: dict[str, object]
) -> tuple[list[Any], list[dict[str, object]]]:
    """Every rank learns every rank's GPU (None: no NCCL) and engine settings, in rank
    order, in one gather over the Gloo group ``control``."""
    facts: list[Any] = [None] * dist.get_world_size(control)
    dist.all_gather_object(facts, (place, settings), group=control)
    return [fact[0] for fact in facts], [fact[1] for fact in facts]


def init_default_group(backend: str, **options: Any) -> None:
    """``dist.init_process_group``, leaving ``sys.excepthook`` as it was.

    torch wraps the hook on every call, to put ``[rankN]:`` before each line of an uncaught
    traceback: Horovod's tracebacks have no such prefix (hvdrun labels each worker's lines
    already), and after many ``hvd.init()`` rounds or elastic resets the wrappers piled up,
    one prefix per round on every line, deep enough to exhaust the recursion limit."""
    before = sys.excepthook
    try:
        dist.init_process_group(backend, **options)
    finally:
        sys.excepthook = before


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

    def make_groups(ranks: list[int], check: Any = None) -> tuple[Any, Any]:
        control_ = dist.new_group(ranks, backend="gloo", timeout=timeout)
        if isinstance(control_, dist.ProcessGroup):  # (before the check, which may refuse)
            own.append(control_)
        if check is not None:
            check(control_)
        data_ = dist.new_group(ranks, backend=runtime_.backend, timeout=timeout)
        if isinstance(data_, dist.ProcessGroup):
            own.append(data_)
        return control_, data_

    def destroy_group(group: Any) -> None:
        if isinstance(group, dist.ProcessGroup):
            if group in own:
                own.remove(group)
            dist.destroy_process_group(group)

    place = None
    if "nccl" in runtime_.backend:
        # Before the first NCCL group: ranks that would share a GPU learn it together.
        place = GpuPlace.of_this_process(topo.rank, runtime_.host or socket.gethostname())
    control, data = make_groups(everyone, functools.partial(_check_job, runtime_, place))

    engine = Engine(
        rank=topo.rank,
        size=topo.size,
        config=cfg,
        control_group=control,
        global_group=data,
        make_groups=make_groups,
        destroy_group=destroy_group,
        cuda_device=torch.cuda.current_device() if uses_cuda(runtime_.backend) else None,
    )
    if cfg.timeline:
        try:
            engine.timeline = timeline.open_for_job(
                cfg.timeline,
                cfg.timeline_mark_cycles,
                topo.rank,
                cfg.timeline_all_ranks,
                runtime_.host,
                runtime_.generation,
            )
        except OSError as error:
            # As Horovod: the job runs on without a timeline (the path is a setting of the
            # whole job, and this rank's host may lack its directory).
            with contextlib.suppress(Exception):  # (stderr may be closed)
                sys.stderr.write(
                    f"hvdrun: rank {topo.rank} writes no timeline: {error.strerror or error}: "
                    f"{error.filename or cfg.timeline}\n"
                )
    engine.start()
    return engine


def _check_job(runtime_: RuntimeState, place: GpuPlace | None, control: Any) -> None:
    """Ranks whose engine settings differ fail at once, alike. Where ranks would share a GPU
    under NCCL (``place``: this rank's GPU), CUDA collectives fail at the call with the
    reason on every rank (CPU ones run: a CPU job on a GPU machine stays fine), and at once
    when the job asked for NCCL by name."""
    places, settings = job_facts(
        control, place, must_agree(runtime_.config, torch.cuda.is_available())
    )
    mismatch = settings_disagreement(settings)
    if mismatch is not None:
        raise SettingsMismatchError(f"hvd.init(): {mismatch}")
    if place is None:
        return
    runtime_.cuda_refusal = shared_gpu_error(places)
    if runtime_.cuda_refusal is not None and cuda_backend_setting() == "nccl":
        raise SharedGpuError(runtime_.cuda_refusal)


def destroy_own_groups(runtime_: RuntimeState) -> None:
    """Destroys the engine's process groups only: the default group is a framework's."""
    own, runtime_.own_groups = runtime_.own_groups, []
    for group in own:
        try:
            dist.destroy_process_group(group)
        except Exception as error:  # already destroyed with the whole world, or broken
            logger.debug("destroying an engine group failed: %s", error)


def stop_collectives(runtime_: RuntimeState, timeout: float, failure: str = "") -> None:
    """Stops the engine (waiting at most ``timeout`` for its last cycle; ``failure``: how
    this rank's script failed, which the others are told) and destroys the process groups
    (not a framework's default group); the rendezvous connection stays."""
    engine_, runtime_.engine = runtime_.engine, None
    if engine_ is not None:
        engine_.stop(timeout=timeout, failure=failure)
    if runtime_.adopted:
        destroy_own_groups(runtime_)
    else:
        runtime_.own_groups = []
        destroy_groups()
