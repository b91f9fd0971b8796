"""``--config-file FILE``: Horovod's YAML configuration file, e.g.::

    params:
      fusion_threshold_mb: 32
      cycle_time_ms: 5
    timeline:
      filename: timeline.json
      mark_cycles: true
    stall_check:
      enabled: true
      warning_time_seconds: 120
    library_options:
      gloo_timeout_seconds: 60
    logging:
      level: INFO

Sections ``params``, ``autotune``, ``timeline``, ``stall_check``, ``library_options`` and
``logging`` (and Horovod's top-level ``controller: gloo``), with Horovod's key names. A
flag on the command line wins over the file, and so does the flag's ``HOROVOD_*`` variable
where it has one. Values of the wrong kind are one-line errors that name the key. Unknown
sections and keys are ignored, as horovodrun ignores them, each with a warning that names it
(and the known name it is closest to), so a misspelt setting never goes unnoticed.

The file's values become the defaults of the command's own flags (click's ``default_map``);
a key whose flag this command does not have reaches the workers as its ``HOROVOD_*``
variable directly.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])

#: The kinds of value a key takes.
NUMBER, INTEGER, BOOL, TEXT, LEVEL, FRACTION = "number", "integer", "bool", "text", "level", "0..1"


@dataclass(frozen=True)
class Key:
    param: str  # the click parameter it sets
    kind: str
    variable: str  # Horovod's worker variable, for a key whose flag the command lacks
    invert: bool = False  # stall_check.enabled sets --no-stall-check's opposite


_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")

SECTIONS: dict[str, dict[str, Key]] = {
    "params": {
        "fusion_threshold_mb": Key("fusion_threshold_mb", NUMBER, "HOROVOD_FUSION_THRESHOLD"),
        "cycle_time_ms": Key("cycle_time_ms", NUMBER, "HOROVOD_CYCLE_TIME"),
        "cache_capacity": Key("cache_capacity", INTEGER, "HOROVOD_CACHE_CAPACITY"),
        "hierarchical_allreduce": Key(
            "hierarchical_allreduce", BOOL, "HOROVOD_HIERARCHICAL_ALLREDUCE"
        ),
        "hierarchical_allgather": Key(
            "hierarchical_allgather", BOOL, "HOROVOD_HIERARCHICAL_ALLGATHER"
        ),
        "torus_allreduce": Key("torus_allreduce", BOOL, "HOROVOD_TORUS_ALLREDUCE"),
    },
    "autotune": {
        "enabled": Key("autotune", BOOL, "HOROVOD_AUTOTUNE"),
        "log_file": Key("autotune_log_file", TEXT, "HOROVOD_AUTOTUNE_LOG"),
        "warmup_samples": Key(
            "autotune_warmup_samples", INTEGER, "HOROVOD_AUTOTUNE_WARMUP_SAMPLES"
        ),
        "steps_per_sample": Key(
            "autotune_steps_per_sample", INTEGER, "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE"
        ),
        "bayes_opt_max_samples": Key(
            "autotune_bayes_opt_max_samples", INTEGER, "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES"
        ),
        "gaussian_process_noise": Key(
            "autotune_gaussian_process_noise", FRACTION, "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE"
        ),
    },
    "timeline": {
        "filename": Key("timeline_filename", TEXT, "HOROVOD_TIMELINE"),
        "mark_cycles": Key("timeline_mark_cycles", BOOL, "HOROVOD_TIMELINE_MARK_CYCLES"),
    },
    "stall_check": {
        "enabled": Key("no_stall_check", BOOL, "HOROVOD_STALL_CHECK_DISABLE", invert=True),
        "warning_time_seconds": Key(
            "stall_check_warning_time_seconds", NUMBER, "HOROVOD_STALL_CHECK_TIME_SECONDS"
        ),
        "shutdown_time_seconds": Key(
            "stall_check_shutdown_time_seconds", NUMBER, "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"
        ),
    },
    "library_options": {
        "mpi_threads_disable": Key("mpi_threads_disable", BOOL, "HOROVOD_MPI_THREADS_DISABLE"),
        "num_nccl_streams": Key("num_nccl_streams", INTEGER, "HOROVOD_NUM_NCCL_STREAMS"),
        "thread_affinity": Key("thread_affinity", INTEGER, "HOROVOD_THREAD_AFFINITY"),
        # Horovod 0.28's file also spells it ccl_bgt_affinity, older ones mlsl_bgt_affinity.
        "ccl_bgt_affinity": Key("thread_affinity", INTEGER, "HOROVOD_THREAD_AFFINITY"),
        "mlsl_bgt_affinity": Key("thread_affinity", INTEGER, "HOROVOD_THREAD_AFFINITY"),
        "gloo_timeout_seconds": Key("gloo_timeout_seconds", NUMBER, "HOROVOD_GLOO_TIMEOUT_SECONDS"),
    },
    "logging": {
        "level": Key("log_level", LEVEL, "HOROVOD_LOG_LEVEL"),
        "hide_timestamp": Key("log_without_timestamp", BOOL, "HOROVOD_LOG_HIDE_TIME"),
        "with_timestamp": Key("log_without_timestamp", BOOL, "HOROVOD_LOG_HIDE_TIME", invert=True),
    },
}

TOP_LEVEL = ("controller", *SECTIONS)


class ConfigFileError(click.UsageError):
    """A config file hvdrun cannot use: one line naming the file and the key."""


@dataclass
class ConfigValues:
    """A checked config file: the value of each click parameter it sets."""

    defaults: dict[str, Any]
    #: The key that set each of them (``library_options.gloo_timeout_seconds``), for errors.
    keys: dict[str, str] = field(default_factory=dict)
    #: A warning for each unknown section or key, which is ignored.
    ignored: list[str] = field(default_factory=list)


def _suggest(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    return f" (did you mean '{close[0]}'?)" if close else f" (known: {', '.join(known)})"


def _check(value: Any, kind: str, where: str) -> Any:
    def bad(expected: str) -> ConfigFileError:
        return ConfigFileError(f"{where}: must be {expected}, got {value!r}")

    if kind == BOOL:
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if kind == TEXT:
        if not isinstance(value, str) or not value:
            raise bad("a non-empty text")
        return value
    if kind == LEVEL:
        if not isinstance(value, str) or value.upper() not in _LEVELS:
            raise bad(f"one of {', '.join(_LEVELS)}")
        return value.upper()
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad("a number" if kind != INTEGER else "a whole number")
    if kind == INTEGER and not isinstance(value, int):
        raise bad("a whole number")
    if kind == FRACTION and not 0 <= value <= 1:
        raise bad("between 0 and 1")
    if value < 0:
        raise bad("at least 0")
    return value


def parse_config(data: Any, source: str) -> ConfigValues:
    """Checks a loaded YAML document; ``source`` names the file in errors."""
    if data is None:
        return ConfigValues({})
    if not isinstance(data, dict):
        raise ConfigFileError(f"config file {source}: expected sections such as 'params:'")
    defaults: dict[str, Any] = {}
    keys_of: dict[str, str] = {}
    ignored: list[str] = []
    for section, body in data.items():
        where = f"config file {source}: {section}"
        if section == "controller":
            if not isinstance(body, str) or body.lower() not in ("gloo", "mpi"):
                raise ConfigFileError(f"{where}: must be gloo, got {body!r}")
            if body.lower() == "mpi":
                from hvdrun.horovod_flags import REFUSED

                advice = REFUSED["--mpi"].replace("drop --mpi", "set controller: gloo")
                raise ConfigFileError(f"{where}: mpi: {advice}")
            continue
        if section not in SECTIONS:
            ignored.append(_unknown(source, f"section '{section}'", str(section), list(TOP_LEVEL)))
            continue
        if body is None:
            continue
        if not isinstance(body, dict):
            raise ConfigFileError(f"{where}: expected 'key: value' lines under it")
        keys = SECTIONS[section]
        for key, value in body.items():
            if key not in keys:
                ignored.append(_unknown(source, f"key '{section}.{key}'", str(key), list(keys)))
                continue
            if value is None:  # ('key:' with nothing after it sets nothing, as in horovodrun)
                continue
            spec = keys[key]
            checked = _check(value, spec.kind, f"config file {source}: {section}.{key}")
            defaults[spec.param] = (not checked) if spec.invert else checked
            keys_of[spec.param] = f"{section}.{key}"
    return ConfigValues(defaults, keys_of, ignored)


def _unknown(source: str, what: str, name: str, known: list[str]) -> str:
    """The warning for an unknown section or key, which is ignored as horovodrun ignores it."""
    return (
        f"warning: config file {source}: unknown {what}{_suggest(name, known)}: ignored, as "
        "horovodrun ignores it"
    )


def load_config(path: str) -> ConfigValues:
    """Reads and checks a config file; ConfigFileError for anything wrong with it."""
    import yaml  # only when a config file is given

    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle)
    except OSError as exc:
        raise ConfigFileError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigFileError(f"config file {path} is not UTF-8 text") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "not valid YAML"
        raise ConfigFileError(f"config file {path}{where}: {problem}") from None
    return parse_config(data, path)


def _variable_value(value: Any, key: Key) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if key.variable == "HOROVOD_FUSION_THRESHOLD":
        return str(int(value * 1024 * 1024))
    return str(value)


def _apply(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Eager: the file's values become the defaults of the flags parsed after it."""
    if value is None:
        return None
    config = load_config(value)
    names = {p.name for p in ctx.command.params}
    default_map = dict(ctx.default_map or {})
    env: dict[str, str] = {}
    keys = {key.param: key for section in SECTIONS.values() for key in section.values()}
    for name, setting in config.defaults.items():
        if name in names:
            default_map[name] = setting
        else:
            env[keys[name].variable] = _variable_value(setting, keys[name])
    ctx.default_map = default_map
    ctx.meta[ENV_META] = env
    ctx.meta[KEYS_META] = {name: f"config file {value}: {key}" for name, key in config.keys.items()}
    ctx.meta[IGNORED_META] = config.ignored
    return value


ENV_META = "hvdrun.config_file.env"
KEYS_META = "hvdrun.config_file.keys"
IGNORED_META = "hvdrun.config_file.ignored"


def config_keys(ctx: click.Context) -> dict[str, str]:
    """Parameter -> the config file's key that set it (``config file F: params.x``)."""
    return dict(ctx.meta.get(KEYS_META, {}))


def config_key(exc: click.UsageError) -> str | None:
    """Where a bad value came from when the config file gave it (``config file F:
    library_options.gloo_timeout_seconds``): a flag's own check of it names the key, not
    the flag the user never typed."""
    param = getattr(exc, "param", None)
    ctx = exc.ctx
    if param is None or ctx is None or not param.name:
        return None
    if ctx.get_parameter_source(param.name) != click.core.ParameterSource.DEFAULT_MAP:
        return None
    return config_keys(ctx).get(param.name)


config_file_option = click.option(
    "--config-file",
    type=click.Path(dir_okay=False),
    is_eager=True,
    expose_value=False,
    callback=_apply,
    metavar="FILE",
    help="Horovod's YAML settings file (params, autotune, timeline, stall_check, "
    "library_options, logging); flags on the command line win.",
)


def config_env(ctx: click.Context) -> dict[str, str]:
    """Worker variables from config keys whose flag the command does not have."""
    return dict(ctx.meta.get(ENV_META, {}))


def config_warnings(ctx: click.Context) -> list[str]:
    """The warnings for the config file's unknown sections and keys, which are ignored."""
    return list(ctx.meta.get(IGNORED_META, []))
