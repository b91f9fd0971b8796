"""Click types for the numbers of hvdrun's flags.

click's ``FloatRange`` lets ``nan`` through (no comparison with it is true), and a huge
timeout (``inf``, ``1e300``) overflows the clocks the launcher computes deadlines with
("timestamp out of range for platform time_t") or waits for ever. :class:`Finite` refuses
both: a number that is not finite, and seconds beyond :data:`MAX_SECONDS`.
"""

from __future__ import annotations

import math
from typing import Any

import click

from rendezvous import worker_env

__all__ = ["MAX_SECONDS", "Finite", "Seconds", "seconds"]

#: The longest time a flag may give, in seconds (about 31 years: "never" in practice), as
#: for the variables the workers read.
MAX_SECONDS = worker_env.LONGEST_SECONDS


class Finite(click.FloatRange):
    """A ``FloatRange`` whose value must also be a finite number."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value} is not a finite number", param, ctx)
        return number


class Seconds(click.ParamType):
    """A duration in seconds: a finite number above 0 (``positive``) or at least 0, and at
    most :data:`MAX_SECONDS`."""

    name = "seconds"

    def __init__(self, positive: bool = True) -> None:
        self.positive = positive

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value} is not a finite number", param, ctx)
        if number < 0 or (self.positive and number == 0):
            self.fail(
                f"{value} is not in the range {'x>0' if self.positive else 'x>=0'}", param, ctx
            )
        if number > MAX_SECONDS:
            self.fail(f"{value} s is longer than any wait (at most {MAX_SECONDS:g} s)", param, ctx)
        return number


def seconds(positive: bool = True) -> Seconds:
    """A duration in seconds: above 0 (``positive``) or at least 0, at most MAX_SECONDS."""
    return Seconds(positive)
