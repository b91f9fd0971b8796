"""The engine's tuning, read once per ``hvd.init()`` from the environment.

``hvdrun``'s tuning flags (``--fusion-threshold-mb``, ``--cycle-time-ms``, ...) become
``HVDRUN_*`` variables in every worker; each is also read under its Horovod spelling
(``HOROVOD_FUSION_THRESHOLD``, ...) so existing Horovod job scripts keep their settings.
The ``HVDRUN_`` spelling wins when both are set (the names and their parsing are
:mod:`rendezvous.worker_env`'s, with the defaults and bounds of its ``NUMBERS``). Defaults
are Horovod's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rendezvous import worker_env

__all__ = ["EngineConfig", "from_environment", "must_agree", "settings_disagreement"]

_NUMBERS = worker_env.NUMBERS
DEFAULT_FUSION_THRESHOLD = int(_NUMBERS[worker_env.FUSION_THRESHOLD].default)
#: The fusion threshold of CUDA reductions where none was set: DistributedOptimizer's
#: gradient buckets (1 MB first, then 25 MB, as DDP's) then reach the GPU as they are, each
#: starting once its gradients are computed, instead of one buffer of the whole backward
#: pass that waits for its end (two ranks training ResNet-18 on one H200 through Gloo: 0.79x
#: DDP's throughput at 128 MiB, 1.04x at 16 MiB, 1.06x at 4 MiB; docs/gpu.md).
DEFAULT_CUDA_FUSION_THRESHOLD = worker_env.CUDA_FUSION_THRESHOLD_DEFAULT
DEFAULT_CYCLE_TIME_MS = _NUMBERS[worker_env.CYCLE_TIME].default
DEFAULT_STALL_CHECK_SECONDS = _NUMBERS[worker_env.STALL_CHECK_TIME_SECONDS].default
DEFAULT_COLLECTIVE_TIMEOUT_SECONDS = _NUMBERS[worker_env.GLOO_TIMEOUT_SECONDS].default
DEFAULT_CACHE_CAPACITY = int(_NUMBERS[worker_env.CACHE_CAPACITY].default)
DEFAULT_AUTOTUNE_WARMUP_SAMPLES = int(_NUMBERS[worker_env.AUTOTUNE_WARMUP_SAMPLES].default)
DEFAULT_AUTOTUNE_STEPS_PER_SAMPLE = int(_NUMBERS[worker_env.AUTOTUNE_STEPS_PER_SAMPLE].default)
DEFAULT_AUTOTUNE_MAX_SAMPLES = int(_NUMBERS[worker_env.AUTOTUNE_BAYES_OPT_MAX_SAMPLES].default)
DEFAULT_AUTOTUNE_NOISE = _NUMBERS[worker_env.AUTOTUNE_GAUSSIAN_PROCESS_NOISE].default


@dataclass(frozen=True)
class EngineConfig:
    """What the background engine is tuned with (see docs/engine.md's table of variables)."""

    #: Ready tensors of one kind, dtype, op and process set are packed into one buffer of at
    #: most this many bytes; a tensor larger than this runs on its own, in place. 0 = no fusion.
    fusion_threshold: int = DEFAULT_FUSION_THRESHOLD
    #: The same for CUDA reductions: the fusion threshold where one was set, else (None)
    #: :data:`DEFAULT_CUDA_FUSION_THRESHOLD`, at most ``fusion_threshold``. Autotune tunes
    #: ``fusion_threshold`` alone.
    cuda_fusion_threshold: int | None = None
    #: How long (ms) the engine gathers newly submitted ops before negotiating them, and the
    #: pace of negotiation while ops wait for other ranks.
    cycle_time_ms: float = DEFAULT_CYCLE_TIME_MS
    #: Chrome-trace file written from ``hvd.init()`` on (rank 0; ``{rank}`` in it: every rank).
    timeline: str | None = None
    timeline_mark_cycles: bool = False
    #: Every rank writes its own timeline (``{rank}`` in the file name does too).
    timeline_all_ranks: bool = False
    stall_check: bool = True
    stall_warning_seconds: float = DEFAULT_STALL_CHECK_SECONDS
    #: 0 = never; otherwise the job's collectives fail after a stall this long.
    stall_shutdown_seconds: float = 0.0
    #: How long one collective (and one negotiation round) may wait for a peer.
    collective_timeout_seconds: float = DEFAULT_COLLECTIVE_TIMEOUT_SECONDS
    #: Ops the response cache remembers (see :mod:`.cache`); 0 = no cache.
    cache_capacity: int = DEFAULT_CACHE_CAPACITY
    #: Search the fusion threshold, cycle time and cache online (see :mod:`.autotune`).
    autotune: bool = False
    #: CSV written by rank 0: one row per autotune sample.
    autotune_log: str | None = None
    autotune_warmup_samples: int = DEFAULT_AUTOTUNE_WARMUP_SAMPLES
    autotune_steps_per_sample: int = DEFAULT_AUTOTUNE_STEPS_PER_SAMPLE
    autotune_bayes_opt_max_samples: int = DEFAULT_AUTOTUNE_MAX_SAMPLES
    autotune_gaussian_process_noise: float = DEFAULT_AUTOTUNE_NOISE

    def __post_init__(self) -> None:
        if self.cuda_fusion_threshold is None:
            cuda = min(self.fusion_threshold, DEFAULT_CUDA_FUSION_THRESHOLD)
            object.__setattr__(self, "cuda_fusion_threshold", cuda)

    @property
    def cycle_time(self) -> float:
        """The cycle time in seconds."""
        return self.cycle_time_ms / 1000.0


def from_environment() -> EngineConfig:
    """Reads the configuration; a malformed value raises ValueError naming the variable."""
    we = worker_env
    fusion_threshold = int(we.number(we.FUSION_THRESHOLD))
    chosen = we.setting(we.FUSION_THRESHOLD) is not None
    return EngineConfig(
        fusion_threshold=fusion_threshold,
        cuda_fusion_threshold=fusion_threshold if chosen else None,
        cycle_time_ms=we.number(we.CYCLE_TIME),
        timeline=_timeline_file(),
        timeline_mark_cycles=we.flag(we.TIMELINE_MARK_CYCLES),
        timeline_all_ranks=we.flag(we.TIMELINE_ALL_RANKS),
        stall_check=not we.flag(we.STALL_CHECK_DISABLE),
        stall_warning_seconds=we.number(we.STALL_CHECK_TIME_SECONDS),
        stall_shutdown_seconds=we.number(we.STALL_SHUTDOWN_TIME_SECONDS),
        collective_timeout_seconds=we.number(we.GLOO_TIMEOUT_SECONDS),
        cache_capacity=int(we.number(we.CACHE_CAPACITY)),
        autotune=we.flag(we.AUTOTUNE),
        autotune_log=we.setting(we.AUTOTUNE_LOG),
        autotune_warmup_samples=int(we.number(we.AUTOTUNE_WARMUP_SAMPLES)),
        autotune_steps_per_sample=int(we.number(we.AUTOTUNE_STEPS_PER_SAMPLE)),
        autotune_bayes_opt_max_samples=int(we.number(we.AUTOTUNE_BAYES_OPT_MAX_SAMPLES)),
        autotune_gaussian_process_noise=we.number(we.AUTOTUNE_GAUSSIAN_PROCESS_NOISE),
    )


def _timeline_file() -> str | None:
    """The timeline written from ``hvd.init()`` on: ``HOROVOD_TIMELINE=DYNAMIC`` is Horovod's
    way to write none until ``hvd.start_timeline()``."""
    value = worker_env.setting(worker_env.TIMELINE)
    return None if value == "DYNAMIC" else value


def must_agree(config: EngineConfig, cuda: bool) -> dict[str, object]:
    """The settings every rank must run with alike, by what sets each: ranks plan their
    buckets, answer the response cache and end autotune's first sample by them, and ranks
    that differ would run collectives that do not match. (Autotune's other counts are rank
    0's alone: it broadcasts its choices. The process groups' backend may differ where a
    job moves CPU tensors only, so it is not compared.) ``cuda``: this rank can run CUDA
    tensors, so its CUDA threshold counts."""
    we = worker_env
    fusion = we.variable(we.FUSION_THRESHOLD)
    settings: dict[str, object] = {
        fusion: config.fusion_threshold,
        we.variable(we.CACHE_CAPACITY): config.cache_capacity,
        we.variable(we.AUTOTUNE): int(config.autotune),
    }
    if cuda:
        mib = DEFAULT_CUDA_FUSION_THRESHOLD >> 20
        label = f"the fusion threshold of CUDA reductions ({mib} MiB unless {fusion} is set)"
        settings[label] = config.cuda_fusion_threshold
    if config.autotune:
        settings[we.variable(we.AUTOTUNE_STEPS_PER_SAMPLE)] = config.autotune_steps_per_sample
    return settings


def settings_disagreement(settings: Sequence[Mapping[str, object]]) -> str | None:
    """Why ranks cannot run together (``settings``: each rank's :func:`must_agree`, in rank
    order): the first setting they differ on, with each value's ranks; None when they agree.
    A setting some ranks lack (CUDA's, where a rank has no GPU) is compared among the others."""
    names = dict.fromkeys(name for mine in settings for name in mine)
    for name in names:
        by_value: dict[str, list[int]] = {}
        for rank, mine in enumerate(settings):
            if name in mine:
                by_value.setdefault(str(mine[name]), []).append(rank)
        if len(by_value) > 1:
            values = "; ".join(
                f"rank{'s' if len(ranks) > 1 else ''} {_ranks(ranks)}: {value}"
                for value, ranks in by_value.items()
            )
            horovod = name.replace(worker_env.PREFIX, worker_env.HOROVOD_PREFIX, 1)
            spelled = f"{name} (or {horovod})" if name.startswith(worker_env.PREFIX) else name
            return (
                f"the ranks run with different values of {spelled}: {values}. Their "
                "collectives would not match: give every rank's environment the same "
                "settings (hvdrun passes its own to every rank; mpirun needs -x for each)"
            )
    return None


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8]))
    return shown if len(ranks) <= 8 else f"{shown} and {len(ranks) - 8} more"
