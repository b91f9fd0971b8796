"""hvdrun's tuning flags for the collectives runtime, and the worker variables they set.

Each flag becomes an ``HVDRUN_*`` variable in every worker's environment (the runtime also
reads the ``HOROVOD_*`` spelling of each, so Horovod users' settings keep working). A flag
left out sets nothing, so a variable the user exported still applies. A switch turned off
explicitly (the config file's ``stall_check: enabled: true`` or ``timeline: mark_cycles:
false``) writes ``0``, as horovodrun does, so that it wins over the ``HOROVOD_*`` variable
hvdrun's environment may hold.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

import click

from hvdrun.values import Finite, seconds
from rendezvous import worker_env

F = TypeVar("F", bound=Callable[..., Any])

_OPTIONS = [
    click.option(
        "--fusion-threshold-mb",
        type=Finite(min=0),
        metavar="MB",
        help="Tensor fusion buffer size in MiB (HVDRUN_FUSION_THRESHOLD; default 128, and 4 "
        "for reductions of CUDA tensors; a value given applies to both).",
    ),
    click.option(
        "--cycle-time-ms",
        type=Finite(min=0),
        metavar="MS",
        help="How long (ms) submitted collectives are gathered before negotiating them "
        "(HVDRUN_CYCLE_TIME; default 1).",
    ),
    click.option(
        "--cuda-backend",
        type=click.Choice(worker_env.CUDA_BACKENDS),
        help="What carries CUDA tensors: nccl (the default where there are GPUs) or gloo, "
        "through host memory, which lets several ranks share one GPU: for more processes "
        "than GPUs, debugging and tests (HVDRUN_CUDA_BACKEND).",
    ),
    click.option(
        "--timeline-filename",
        type=click.Path(dir_okay=False),
        metavar="FILE",
        help="Write a Chrome-trace timeline of every collective, from rank 0; a {rank} in "
        "FILE gives every rank its own file (HVDRUN_TIMELINE).",
    ),
    click.option(
        "--timeline-mark-cycles",
        is_flag=True,
        default=None,
        help="Mark negotiation cycles in the timeline (HVDRUN_TIMELINE_MARK_CYCLES).",
    ),
    click.option(
        "--timeline-all-ranks",
        is_flag=True,
        default=None,
        help="Every rank writes its own timeline (FILE with the rank before its extension) "
        "and hvdrun merges them into FILE, one process per rank, when the job ends "
        "(HVDRUN_TIMELINE_ALL_RANKS).",
    ),
    click.option(
        "--no-stall-check",
        is_flag=True,
        default=None,
        help="Disable the stall inspector (HVDRUN_STALL_CHECK_DISABLE).",
    ),
    click.option(
        "--stall-check-warning-time-seconds",
        type=seconds(positive=False),
        metavar="SECONDS",
        help="Warn about ranks that did not submit a tensor after this long "
        "(HVDRUN_STALL_CHECK_TIME_SECONDS; default 60).",
    ),
    click.option(
        "--stall-check-shutdown-time-seconds",
        type=seconds(positive=False),
        metavar="SECONDS",
        help="Fail every rank's collectives after a stall this long; 0 never "
        "(HVDRUN_STALL_SHUTDOWN_TIME_SECONDS; default 0).",
    ),
    click.option(
        "--cache-capacity",
        type=click.IntRange(min=0),
        metavar="N",
        help="Ops the response cache remembers, so that repeated ops negotiate in a few "
        "bytes; 0 disables it (HVDRUN_CACHE_CAPACITY; default 1024).",
    ),
    click.option(
        "--autotune",
        is_flag=True,
        default=None,
        help="Tune the fusion threshold, cycle time and response cache online, while the job "
        "runs (HVDRUN_AUTOTUNE).",
    ),
    click.option(
        "--autotune-log-file",
        type=click.Path(dir_okay=False),
        metavar="FILE",
        help="CSV of every autotune sample: its parameters and score (HVDRUN_AUTOTUNE_LOG).",
    ),
    click.option(
        "--autotune-warmup-samples",
        type=click.IntRange(min=0),
        metavar="N",
        help="Samples discarded before autotuning starts (HVDRUN_AUTOTUNE_WARMUP_SAMPLES; "
        "default 3).",
    ),
    click.option(
        "--autotune-steps-per-sample",
        type=click.IntRange(min=1),
        metavar="N",
        help="Engine cycles that carried data per autotune sample "
        "(HVDRUN_AUTOTUNE_STEPS_PER_SAMPLE; default 10).",
    ),
    click.option(
        "--autotune-bayes-opt-max-samples",
        type=click.IntRange(min=1),
        metavar="N",
        help="Samples of Bayesian optimisation before the best settings are kept "
        "(HVDRUN_AUTOTUNE_BAYES_OPT_MAX_SAMPLES; default 20).",
    ),
    click.option(
        "--autotune-gaussian-process-noise",
        type=Finite(min=0, max=1),
        metavar="ALPHA",
        help="Noise of the autotuner's Gaussian process, 0 to 1 "
        "(HVDRUN_AUTOTUNE_GAUSSIAN_PROCESS_NOISE; default 0.8).",
    ),
]


def tuning_options(fn: F) -> F:
    """Adds the tuning flags to a click command."""
    for option in reversed(_OPTIONS):
        fn = option(fn)
    return fn


def tuning_env(
    fusion_threshold_mb: float | None = None,
    cycle_time_ms: float | None = None,
    cuda_backend: str | None = None,
    timeline_filename: str | None = None,
    timeline_mark_cycles: bool | None = None,
    timeline_all_ranks: bool | None = None,
    no_stall_check: bool | None = None,
    stall_check_warning_time_seconds: float | None = None,
    stall_check_shutdown_time_seconds: float | None = None,
    cache_capacity: int | None = None,
    autotune: bool | None = None,
    autotune_log_file: str | None = None,
    autotune_warmup_samples: int | None = None,
    autotune_steps_per_sample: int | None = None,
    autotune_bayes_opt_max_samples: int | None = None,
    autotune_gaussian_process_noise: float | None = None,
) -> dict[str, str]:
    """The worker environment variables for the flags the user gave."""
    we = worker_env
    env: dict[str, str] = {}
    if fusion_threshold_mb is not None:
        env[we.variable(we.FUSION_THRESHOLD)] = str(int(fusion_threshold_mb * 1024 * 1024))
    if cycle_time_ms is not None:
        env[we.variable(we.CYCLE_TIME)] = f"{cycle_time_ms:g}"
    if cuda_backend is not None:
        env[we.variable(we.CUDA_BACKEND)] = cuda_backend
    if timeline_filename is not None:
        env[we.variable(we.TIMELINE)] = os.path.abspath(timeline_filename)
    if timeline_mark_cycles is not None:  # (False: the config file's ``mark_cycles: false``)
        env[we.variable(we.TIMELINE_MARK_CYCLES)] = "1" if timeline_mark_cycles else "0"
    if timeline_all_ranks:
        env[we.variable(we.TIMELINE_ALL_RANKS)] = "1"
    if no_stall_check is not None:  # (False: the config file's ``enabled: true``)
        env[we.variable(we.STALL_CHECK_DISABLE)] = "1" if no_stall_check else "0"
    if stall_check_warning_time_seconds is not None:
        env[we.variable(we.STALL_CHECK_TIME_SECONDS)] = f"{stall_check_warning_time_seconds:g}"
    if stall_check_shutdown_time_seconds is not None:
        seconds = f"{stall_check_shutdown_time_seconds:g}"
        env[we.variable(we.STALL_SHUTDOWN_TIME_SECONDS)] = seconds
    if cache_capacity is not None:
        env[we.variable(we.CACHE_CAPACITY)] = str(cache_capacity)
    if autotune:
        env[we.variable(we.AUTOTUNE)] = "1"
    if autotune_log_file is not None:
        env[we.variable(we.AUTOTUNE_LOG)] = os.path.abspath(autotune_log_file)
    for name, value in (
        (we.AUTOTUNE_WARMUP_SAMPLES, autotune_warmup_samples),
        (we.AUTOTUNE_STEPS_PER_SAMPLE, autotune_steps_per_sample),
        (we.AUTOTUNE_BAYES_OPT_MAX_SAMPLES, autotune_bayes_opt_max_samples),
        (we.AUTOTUNE_GAUSSIAN_PROCESS_NOISE, autotune_gaussian_process_noise),
    ):
        if value is not None:
            env[we.variable(name)] = f"{value:g}"
    return env
