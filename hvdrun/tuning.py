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
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import click

from hvdrun.values import Finite, seconds
from rendezvous import worker_env as we

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
        type=click.Choice(we.CUDA_BACKENDS),
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
        help="Fail every rank's collectives after a stall this long; 0 never, nor does a time "
        "below the warning time, as in Horovod (HVDRUN_STALL_SHUTDOWN_TIME_SECONDS; default 0).",
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


def _number(value: float) -> str:
    return f"{value:g}"


def _on_off(value: bool) -> str:
    """A switch that may be turned off explicitly (False: the config file's ``enabled:
    true`` or ``mark_cycles: false``): written either way."""
    return "1" if value else "0"


def _on(value: bool) -> str | None:
    """A switch whose False is its default: written only when on."""
    return "1" if value else None


#: Each tuning flag: the worker setting it writes, and how its value is spelled there.
_SETTINGS: dict[str, tuple[str, Callable[[Any], str | None]]] = {
    "fusion_threshold_mb": (we.FUSION_THRESHOLD, lambda mb: str(int(mb * 1024 * 1024))),
    "cycle_time_ms": (we.CYCLE_TIME, _number),
    "cuda_backend": (we.CUDA_BACKEND, str),
    "timeline_filename": (we.TIMELINE, os.path.abspath),
    "timeline_mark_cycles": (we.TIMELINE_MARK_CYCLES, _on_off),
    "timeline_all_ranks": (we.TIMELINE_ALL_RANKS, _on),
    "no_stall_check": (we.STALL_CHECK_DISABLE, _on_off),
    "stall_check_warning_time_seconds": (we.STALL_CHECK_TIME_SECONDS, _number),
    "stall_check_shutdown_time_seconds": (we.STALL_SHUTDOWN_TIME_SECONDS, _number),
    "cache_capacity": (we.CACHE_CAPACITY, str),
    "autotune": (we.AUTOTUNE, _on),
    "autotune_log_file": (we.AUTOTUNE_LOG, os.path.abspath),
    "autotune_warmup_samples": (we.AUTOTUNE_WARMUP_SAMPLES, _number),
    "autotune_steps_per_sample": (we.AUTOTUNE_STEPS_PER_SAMPLE, _number),
    "autotune_bayes_opt_max_samples": (we.AUTOTUNE_BAYES_OPT_MAX_SAMPLES, _number),
    "autotune_gaussian_process_noise": (we.AUTOTUNE_GAUSSIAN_PROCESS_NOISE, _number),
}


def tuning_env(name: str, value: Any) -> dict[str, str]:
    """The worker variable that the tuning flag ``name`` (its parameter name) given as
    ``value`` sets: none for a flag left out (None) or a plain switch left off."""
    setting, spell = _SETTINGS[name]
    text = None if value is None else spell(value)
    return {} if text is None else {we.variable(setting): text}


#: The switches that only shape a timeline: without a timeline file they do nothing.
_TIMELINE_SWITCHES = ("timeline_mark_cycles", "timeline_all_ranks")


def tuning_notes(tuning: Mapping[str, Any], env: Mapping[str, str]) -> list[str]:
    """The notes for tuning flags that will do nothing, which the workers would ignore
    without a word: a timeline switch turned on while no timeline file is set (by
    ``--timeline-filename``, the config file or the environment), an autotune setting
    while autotune is off, a stall shutdown time below the stall warning time (the stall
    inspector then never shuts the job down, as Horovod's does not), wherever they were
    set."""
    notes = []
    if we.setting(we.TIMELINE, env) is None:
        notes += [
            f"note: --{name.replace('_', '-')} has no effect without a timeline file "
            "(--timeline-filename FILE)"
            for name in _TIMELINE_SWITCHES
            if tuning.get(name)
        ]
    if not we.flag(we.AUTOTUNE, env):
        for name, (setting, _) in _SETTINGS.items():
            if not name.startswith("autotune_"):
                continue
            given = we.spelled(setting, env)  # (a flag's, -x's, or hvdrun's environment's)
            if tuning.get(name) is not None:
                notes.append(f"note: --{name.replace('_', '-')} has no effect without --autotune")
            elif given is not None:
                notes.append(f"note: {given[0]} has no effect without --autotune")
    if not we.flag(we.STALL_CHECK_DISABLE, env):
        warning = we.number(we.STALL_CHECK_TIME_SECONDS, env=env)
        shutdown = we.number(we.STALL_SHUTDOWN_TIME_SECONDS, env=env)
        if 0 < shutdown < warning:
            given = we.spelled(we.STALL_SHUTDOWN_TIME_SECONDS, env)
            what = (  # (named as it was set: the flag or the config file's key, or a variable)
                f"--stall-check-shutdown-time-seconds {shutdown:g}"
                if tuning.get("stall_check_shutdown_time_seconds") is not None or given is None
                else f"{given[0]}={given[1]}"
            )
            notes.append(
                f"note: {what} is below the stall warning time ({warning:g} s): as in "
                f"Horovod, a stall will not shut the job down; set it to at least {warning:g} s"
            )
    return notes
