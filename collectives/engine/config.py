"""The engine's tuning, read once per ``hvd.init()`` from the environment.

``hvdrun``'s tuning flags (``--fusion-threshold-mb``, ``--cycle-time-ms``, ...) become
``HVDRUN_*`` variables in every worker; each is also read under its Horovod spelling
(``HOROVOD_FUSION_THRESHOLD``, ...) so existing Horovod job scripts keep their settings.
The ``HVDRUN_`` spelling wins when both are set (the names and their parsing are
:mod:`rendezvous.worker_env`'s). Defaults are Horovod's.
"""

from __future__ import annotations

from dataclasses import dataclass

from rendezvous import worker_env

__all__ = ["EngineConfig", "from_environment"]

DEFAULT_FUSION_THRESHOLD = 128 * 1024 * 1024
DEFAULT_CYCLE_TIME_MS = 1.0
DEFAULT_STALL_CHECK_SECONDS = 60.0
DEFAULT_COLLECTIVE_TIMEOUT_SECONDS = 30.0
DEFAULT_CACHE_CAPACITY = 1024
DEFAULT_AUTOTUNE_WARMUP_SAMPLES = 3
DEFAULT_AUTOTUNE_STEPS_PER_SAMPLE = 10
DEFAULT_AUTOTUNE_MAX_SAMPLES = 20
DEFAULT_AUTOTUNE_NOISE = 0.8


@dataclass(frozen=True)
class EngineConfig:
    """What the background engine is tuned with (see docs/engine.md's table of variables)."""

    #: Ready tensors of one kind, dtype, op and process set are packed into one buffer of at
    #: most this many bytes; a tensor larger than this runs on its own, in place. 0 = no fusion.
    fusion_threshold: int = DEFAULT_FUSION_THRESHOLD
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

    @property
    def cycle_time(self) -> float:
        """The cycle time in seconds."""
        return self.cycle_time_ms / 1000.0


def from_environment() -> EngineConfig:
    """Reads the configuration; a malformed value raises ValueError naming the variable."""
    we = worker_env
    return EngineConfig(
        fusion_threshold=int(we.number(we.FUSION_THRESHOLD, DEFAULT_FUSION_THRESHOLD)),
        cycle_time_ms=we.number(we.CYCLE_TIME, DEFAULT_CYCLE_TIME_MS),
        timeline=we.setting(we.TIMELINE),
        timeline_mark_cycles=we.flag(we.TIMELINE_MARK_CYCLES),
        timeline_all_ranks=we.flag(we.TIMELINE_ALL_RANKS),
        stall_check=not we.flag(we.STALL_CHECK_DISABLE),
        stall_warning_seconds=we.number(we.STALL_CHECK_TIME_SECONDS, DEFAULT_STALL_CHECK_SECONDS),
        stall_shutdown_seconds=we.number(we.STALL_SHUTDOWN_TIME_SECONDS, 0.0),
        collective_timeout_seconds=we.number(
            we.GLOO_TIMEOUT_SECONDS, DEFAULT_COLLECTIVE_TIMEOUT_SECONDS, strict=True
        ),
        cache_capacity=int(we.number(we.CACHE_CAPACITY, DEFAULT_CACHE_CAPACITY)),
        autotune=we.flag(we.AUTOTUNE),
        autotune_log=we.setting(we.AUTOTUNE_LOG),
        autotune_warmup_samples=int(
            we.number(we.AUTOTUNE_WARMUP_SAMPLES, DEFAULT_AUTOTUNE_WARMUP_SAMPLES)
        ),
        autotune_steps_per_sample=int(
            we.number(we.AUTOTUNE_STEPS_PER_SAMPLE, DEFAULT_AUTOTUNE_STEPS_PER_SAMPLE, minimum=1)
        ),
        autotune_bayes_opt_max_samples=int(
            we.number(we.AUTOTUNE_BAYES_OPT_MAX_SAMPLES, DEFAULT_AUTOTUNE_MAX_SAMPLES, minimum=1)
        ),
        autotune_gaussian_process_noise=we.number(
            we.AUTOTUNE_GAUSSIAN_PROCESS_NOISE, DEFAULT_AUTOTUNE_NOISE
        ),
    )
