"""How this rank's script ended, which its shutdown at exit tells the other ranks.

A rank that leaves the job while the others still run collectives ends their collectives
(see :mod:`collectives.engine.leaving`); their errors should say whether it failed, and
how, rather than send the user looking for a deliberate ``hvd.shutdown()``. At exit
(``atexit``) Python keeps an uncaught exception as ``sys.last_value``, which :func:`describe`
tells. A ``sys.exit(...)`` leaves no trace by then (its SystemExit is handled and dropped
before the atexit hooks run), so it reads as any other end of the script; hvdrun's own
summary still names the rank's exit code.
"""

from __future__ import annotations

import sys

__all__ = ["describe", "exception_text"]

#: At most this many characters of an exception's message are told.
MAX_SHOWN = 200


def describe() -> str:
    """How this rank's script ended, as its peers are told: its uncaught exception, or ""
    where it ended some other way (its last line, ``sys.exit``, ``hvd.shutdown()``)."""
    error = getattr(sys, "last_value", None)
    if error is None or isinstance(error, KeyboardInterrupt):  # (an interrupt: no rank's fault)
        return ""
    return f"its script ended with an uncaught exception ({exception_text(error)})"


def exception_text(error: BaseException) -> str:
    """``module.Type: message`` of ``error``, on one line of at most MAX_SHOWN characters
    of message (as peers are told of it)."""
    kind = type(error)
    name = kind.__qualname__
    if kind.__module__ not in ("builtins", "__main__"):
        name = f"{kind.__module__}.{name}"
    try:
        text = str(error)
    except Exception:  # (a broken __str__ must not stop the shutdown)
        text = ""
    return f"{name}: {_shown(text)}" if text else name


def _shown(text: str) -> str:
    """One line of at most MAX_SHOWN characters."""
    line = " ".join(text.split())
    return line if len(line) <= MAX_SHOWN else line[: MAX_SHOWN - 3] + "..."
