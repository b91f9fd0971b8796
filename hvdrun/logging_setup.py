"""``--verbose``, ``--log-level`` and the timestamp flags: Python logging for hvdrun, its
rendezvous server and its agents, and ``HOROVOD_LOG_LEVEL`` for the workers.

hvdrun, the launcher and the rendezvous server log with ``logging.getLogger(__name__)`` and
only warnings and errors show unless asked (as ``hvdrun: warning: ...``): ``--verbose``
shows hvdrun's own debug messages, ``--log-level`` (or ``HOROVOD_LOG_LEVEL``) sets the
level for hvdrun, for every host's agent (the agents run in other processes: the level
travels in their job request) and for the workers, which get ``HOROVOD_LOG_LEVEL``.
Horovod's levels are accepted: TRACE (debug here), DEBUG, INFO, WARNING, ERROR, FATAL.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import click

from rendezvous import worker_env

F = TypeVar("F", bound=Callable[..., Any])

LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")
_PYTHON_LEVELS = {
    "TRACE": logging.DEBUG,
    "DEBUG": logging.DEBUG,
    "INFO": logging.INFO,
    "WARNING": logging.WARNING,
    "ERROR": logging.ERROR,
    "FATAL": logging.CRITICAL,
}


#: Other names of levels, which the workers take too (Python's): read as the level they name.
_SYNONYMS = {"WARN": "WARNING", "CRITICAL": "FATAL"}


class _Level(click.Choice):
    """:data:`LOG_LEVELS`, any case, and their :data:`_SYNONYMS` (an exported
    ``HOROVOD_LOG_LEVEL=WARN`` is a level the workers take; hvdrun must not refuse it)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str):
            value = _SYNONYMS.get(value.strip().upper(), value)
        return super().convert(value, param, ctx)


class _HorovodSwitch(click.types.BoolParamType):
    """A switch's variable read as Horovod reads it: any whole number too, on above 0
    (``HOROVOD_LOG_HIDE_TIME=2`` hides the time, ``-1`` does not)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                return worker_env.switch(value)
        return super().convert(value, param, ctx)  # (its error names the flag)


_OPTIONS = [
    click.option(
        "--verbose",
        is_flag=True,
        help="Show hvdrun's own progress and debug messages (its agents' too).",
    ),
    click.option(
        "--log-level",
        type=_Level(LOG_LEVELS, case_sensitive=False),
        envvar="HOROVOD_LOG_LEVEL",
        help="Level of the messages hvdrun, its agents and the workers log "
        "(HOROVOD_LOG_LEVEL; default WARNING).",
    ),
    click.option(
        "--log-without-timestamp/--log-with-timestamp",
        "log_without_timestamp",
        type=_HorovodSwitch(),
        default=None,
        envvar="HOROVOD_LOG_HIDE_TIME",
        help="Leave the time out of log messages (HOROVOD_LOG_HIDE_TIME for the workers).",
    ),
    # horovodrun's older spelling of the same.
    click.option(
        "--log-hide-timestamp/--no-log-hide-timestamp",
        "log_hide_timestamp",
        default=None,
        hidden=True,
    ),
]

NAMES = ("verbose", "log_level", "log_without_timestamp", "log_hide_timestamp")


def logging_options(fn: F) -> F:
    """Adds the logging flags to a click command."""
    for option in reversed(_OPTIONS):
        fn = option(fn)
    return fn


@dataclass(frozen=True)
class LogSettings:
    verbose: bool = False
    level: str | None = None  # one of LOG_LEVELS, upper case; None: not given
    hide_timestamp: bool | None = None

    @classmethod
    def take(cls, kwargs: dict[str, Any]) -> LogSettings:
        """Removes the logging flags from the command's keyword arguments."""
        values = {name: kwargs.pop(name, None) for name in NAMES}
        hide = values["log_without_timestamp"]
        if hide is None:
            hide = values["log_hide_timestamp"]
        level = values["log_level"]
        return cls(bool(values["verbose"]), level.upper() if level else None, hide)

    @property
    def requested(self) -> bool:
        return self.verbose or self.level is not None or self.hide_timestamp is not None

    def python_level(self) -> int:
        """hvdrun's own level: the more talkative of --verbose and --log-level."""
        level = _PYTHON_LEVELS[self.level] if self.level else logging.WARNING
        return min(level, logging.DEBUG) if self.verbose else level

    def agent_level(self) -> str:
        """The level name the agents get ('' leaves them quiet)."""
        if not self.requested:
            return ""
        return logging.getLevelName(self.python_level())

    def settings(self) -> dict[str, dict[str, str]]:
        """What the workers get, Horovod's logging variables, by the parameter that sets
        each (``--log-hide-timestamp``, horovodrun's older spelling, counts as
        ``--log-without-timestamp``)."""
        settings: dict[str, dict[str, str]] = {}
        if self.level is not None:
            settings["log_level"] = {"HOROVOD_LOG_LEVEL": self.level}
        if self.hide_timestamp is not None:  # (0 wins over an inherited HOROVOD_LOG_HIDE_TIME=1)
            hide = "1" if self.hide_timestamp else "0"
            settings["log_without_timestamp"] = {"HOROVOD_LOG_HIDE_TIME": hide}
        return settings


#: The loggers the flags set the level of; others (grpc, asyncio, paramiko) stay at WARNING.
PACKAGES = ("hvdrun", "launcher", "rendezvous")

#: In a caller's process (``hvdrun.run``): the loggers hvdrun's handler serves instead of
#: the root logger's, so that the caller's own records stay the caller's. (Not paramiko's:
#: launcher.transport.ssh silences it, as hvdrun reports SSH's failures itself.)
IN_PROCESS = (*PACKAGES, "grpc")

#: The levels configure_logging replaced, by logger name (reset_logging restores them).
_replaced_levels: dict[str, int] = {}
#: In a caller's process: the loggers configure_logging took off propagation (its own and
#: paramiko's, which is silenced for the job: hvdrun reports SSH's failures itself), with
#: their propagation and handlers before, for reset_logging to give back.
_taken: dict[str, tuple[bool, list[logging.Handler]]] = {}
_handler: logging.Handler | None = None


def log_format(hide_timestamp: bool, who: str) -> logging.Formatter:
    fmt = f"{who} %(levelname)s %(name)s: %(message)s"
    if not hide_timestamp:
        fmt = "[%(asctime)s] " + fmt
    return logging.Formatter(fmt)


class _Stderr(logging.StreamHandler):  # (not StreamHandler[Any]: Python 3.10 cannot subscript it)
    """Writes to whatever ``sys.stderr`` is when a record comes (as Python's own fallback
    does), not the stream of the moment it was made: callers in one process (tests) swap it."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


class _Plain(logging.Formatter):
    """Warnings and errors when no logging was asked for: worded like hvdrun's other
    messages (``hvdrun: warning: ...``), where Python's fallback printed them bare."""

    def __init__(self, who: str) -> None:
        super().__init__()
        self.who = who

    def format(self, record: logging.LogRecord) -> str:
        return f"{self.who}: {record.levelname.lower()}: {record.getMessage()}"


def configure_logging(settings: LogSettings, who: str = "hvdrun", in_process: bool = False) -> None:
    """Sends log records at the requested level to stderr; unless asked for, only warnings
    and errors, worded as hvdrun's own messages. In hvdrun's own process the root logger's
    records (grpc's and asyncio's too); ``in_process`` (``hvdrun.run``), only those of
    :data:`IN_PROCESS`, which then do not reach the caller's handlers."""
    global _handler
    _give_back_loggers()
    _handler = _Stderr()
    if in_process:
        for name in IN_PROCESS:
            _take(name, _handler)
        _take("paramiko", logging.NullHandler())
    else:
        logging.getLogger().addHandler(_handler)
    if not settings.requested:
        _handler.setLevel(logging.WARNING)
        _handler.setFormatter(_Plain(who))
        return
    _handler.setFormatter(log_format(bool(settings.hide_timestamp), who))
    for name in PACKAGES:
        logger = logging.getLogger(name)
        _replaced_levels.setdefault(name, logger.level)
        logger.setLevel(settings.python_level())


def _take(name: str, handler: logging.Handler) -> None:
    """Takes the logger ``name`` off propagation, ``handler`` added (see :data:`_taken`)."""
    logger = logging.getLogger(name)
    _taken.setdefault(name, (logger.propagate, list(logger.handlers)))
    logger.propagate = False
    logger.addHandler(handler)


def _give_back_loggers() -> None:
    """Removes configure_logging's handler and gives the loggers it took back."""
    global _handler
    if _handler is not None:
        logging.getLogger().removeHandler(_handler)
        _handler = None
    for name, (propagate, handlers) in _taken.items():
        logger = logging.getLogger(name)
        logger.propagate, logger.handlers[:] = propagate, handlers
    _taken.clear()


def reset_logging() -> None:
    """Undoes :func:`configure_logging` (for in-process callers: ``hvdrun.run``, tests):
    its handler goes, the loggers it took are given back, and its packages' loggers get
    back the levels they had before."""
    _give_back_loggers()
    for name, level in _replaced_levels.items():
        logging.getLogger(name).setLevel(level)
    _replaced_levels.clear()
