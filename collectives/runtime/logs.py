"""Worker logging from Horovod's variables: ``HOROVOD_LOG_LEVEL`` and ``HOROVOD_LOG_HIDE_TIME``.

``hvdrun --log-level LEVEL`` (or ``--verbose``) passes the level on to every worker, as
horovodrun does; a script started by another launcher may set it itself. The level applies to
this package's and the rendezvous client's loggers; records go to stderr (which hvdrun shows
as the rank's lines), unless the script configured logging itself, whose handlers then get
them. Horovod's names are accepted: TRACE (debug here), DEBUG, INFO, WARNING, ERROR, FATAL.
Unset leaves logging alone: warnings still reach Python's last-resort handler.
"""

from __future__ import annotations

import logging
import os
import sys

from rendezvous import worker_env

LEVEL_VARIABLE = worker_env.LOG_LEVEL
HIDE_TIME_SETTING = "LOG_HIDE_TIME"  # (HOROVOD_LOG_HIDE_TIME, or HVDRUN_'s spelling)
LEVELS = {
    "TRACE": logging.DEBUG,
    "DEBUG": logging.DEBUG,
    "INFO": logging.INFO,
    "WARNING": logging.WARNING,
    "WARN": logging.WARNING,
    "ERROR": logging.ERROR,
    "FATAL": logging.CRITICAL,
    "CRITICAL": logging.CRITICAL,
}
#: The loggers the level applies to.
PACKAGES = ("collectives", "rendezvous")

_handler: logging.Handler | None = None


def configure_from_environment(rank: int | None = None) -> int | None:
    """Applies ``HOROVOD_LOG_LEVEL``; returns the level set (None: unset or unknown)."""
    global _handler
    text = os.environ.get(LEVEL_VARIABLE, "").strip().upper()
    level = LEVELS.get(text)
    if level is None:
        if text:
            logging.getLogger(__name__).warning(
                "%s=%s is not one of %s; logging left as it is",
                LEVEL_VARIABLE,
                text,
                ", ".join(sorted(set(LEVELS) - {"WARN", "CRITICAL"})),
            )
        return None
    for name in PACKAGES:
        logging.getLogger(name).setLevel(level)
    if logging.getLogger().handlers or _handler is not None:
        return level  # the script's own handlers (or ours, from an earlier init) get them
    try:  # (read as Horovod reads a switch: any whole number above 0 is on)
        hide_time = worker_env.flag(HIDE_TIME_SETTING)
    except ValueError:
        hide_time = False
    who = "hvd" if rank is None else f"hvd rank {rank}"
    fmt = f"{who} %(levelname)s %(name)s: %(message)s"
    if not hide_time:
        fmt = "[%(asctime)s] " + fmt
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter(fmt))
    for name in PACKAGES:
        logging.getLogger(name).addHandler(_handler)
    return level
