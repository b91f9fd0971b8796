"""hvdrun's elastic flags (``--min-np``, ``--max-np``, ``--host-discovery-script``, ...).

``--min-np`` or ``--host-discovery-script`` makes a job elastic, as with horovodrun (see
:mod:`launcher.supervision.elastic`). The other elastic flags, ``--max-np`` included, have no
effect without them: horovodrun ignores them in a fixed-size job, so hvdrun runs the job and
prints a note for each. Every mistake is a ``click.UsageError``: one line and exit code 2.
The discovery script's first run happens here, so a script that does not work stops hvdrun
before anything starts.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import click

from hvdrun.values import seconds
from launcher.spec.hosts import MAX_PROCESSES, MAX_SLOTS_PER_HOST, HostSpec

F = TypeVar("F", bound=Callable[..., Any])

#: How long an elastic job may wait for --min-np slots, unless --elastic-timeout or
#: :data:`ELASTIC_TIMEOUT_VARIABLE` says.
DEFAULT_ELASTIC_TIMEOUT = 600
#: horovodrun's variable for --elastic-timeout: read only for an elastic job, so that a fixed
#: job runs whatever it holds (horovodrun does not read it there either).
ELASTIC_TIMEOUT_VARIABLE = "HOROVOD_ELASTIC_TIMEOUT"


class Count(click.ParamType):
    """An integer no larger than ``cap``: ``-np 99999999999999999999`` is a typo, refused
    while the command line is read (a job that size would build slot lists forever)."""

    name = "integer"

    def __init__(self, cap: int, unit: str) -> None:
        self.cap = cap
        self.unit = unit

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        number: int = click.INT.convert(value, param, ctx)
        if number > self.cap:
            self.fail(f"{number} is above the limit of {self.cap} {self.unit}", param, ctx)
        return number


#: ``-np``, ``--min-np``, ``--max-np``: at most :data:`MAX_PROCESSES`.
PROCESSES = Count(MAX_PROCESSES, "processes")

_OPTIONS = [
    click.option(
        "--min-np",
        "--min-num-proc",
        "min_np",
        type=PROCESSES,
        metavar="N",
        help="Elastic job: the fewest workers it may run on (default: -np).",
    ),
    click.option(
        "--max-np",
        "--max-num-proc",
        "max_np",
        type=PROCESSES,
        metavar="N",
        help="Elastic job: the most workers it may grow to (default: every discovered slot).",
    ),
    click.option(
        "--host-discovery-script",
        metavar="SCRIPT",
        help="Elastic job: a command that prints the usable hosts, 'host' or 'host:slots' per "
        "line; run every second.",
    ),
    click.option(
        "--slots-per-host",
        type=Count(MAX_SLOTS_PER_HOST, "slots per host"),
        default=1,
        show_default=True,
        metavar="N",
        help="Elastic job: slots of a host the discovery script prints without ':slots'.",
    ),
    click.option(
        "--elastic-timeout",
        type=seconds(),
        metavar="SECONDS",
        help="Elastic job: how long it may wait for --min-np slots before it fails "
        f"(HOROVOD_ELASTIC_TIMEOUT; default {DEFAULT_ELASTIC_TIMEOUT}).",
    ),
    click.option(
        "--reset-limit",
        type=int,
        metavar="N",
        help="Elastic job: fail after more than N resets (default: no limit).",
    ),
    click.option(
        "--blacklist-cooldown-range",
        type=(seconds(positive=False), seconds(positive=False)),
        metavar="MIN MAX",
        help="Elastic job: a failed host may come back after MIN*2^(failures-1) s, at most MAX s "
        "(default: never).",
    ),
]


def elastic_options(fn: F) -> F:
    """Adds the elastic flags to a click command."""
    for option in reversed(_OPTIONS):
        fn = option(fn)
    return fn


def explicit(name: str) -> bool:
    """Whether the user gave option ``name`` on the command line (not its default)."""
    source = click.get_current_context().get_parameter_source(name)
    return source is not None and source != click.core.ParameterSource.DEFAULT


def on_command_line(name: str) -> bool:
    """Whether the user gave option ``name`` on the command line itself."""
    source = click.get_current_context().get_parameter_source(name)
    return source == click.core.ParameterSource.COMMANDLINE


def check_num_proc(num_proc: int) -> None:
    """Rejects an -np below 1 (for fixed and elastic jobs alike)."""
    if num_proc < 1:
        raise click.BadParameter(f"must be at least 1, got {num_proc}", param_hint="'-np'")


@dataclass
class ElasticFlags:
    """The elastic flags as given; ``resolve`` checks them and builds ElasticOptions."""

    min_np: int | None
    max_np: int | None
    script: str | None
    slots_per_host: int
    elastic_timeout: float | None  # None: not given (HOROVOD_ELASTIC_TIMEOUT, else 600)
    reset_limit: int | None
    cooldown: tuple[float, float] | None

    def given(self) -> bool:
        """Whether the job is elastic: as horovodrun's ``_is_elastic``, ``--min-np`` or
        ``--host-discovery-script`` (``--max-np`` alone leaves it fixed)."""
        return self.min_np is not None or self.script is not None

    def unused_notes(self) -> list[str]:
        """The notes for a fixed-size job given elastic-only flags: horovodrun ignores them
        there, so hvdrun runs the job and says, one line per flag, that they do nothing."""
        notes = []
        for name in (
            "max_np",
            "slots_per_host",
            "elastic_timeout",
            "reset_limit",
            "blacklist_cooldown_range",
        ):
            if on_command_line(name):
                flag = "--" + name.replace("_", "-")
                notes.append(
                    f"note: {flag} has no effect: the job is not elastic (--min-np or "
                    "--host-discovery-script makes it elastic)"
                )
        return notes

    def timeout(self) -> float:
        """--elastic-timeout, else HOROVOD_ELASTIC_TIMEOUT (a bad value: the error click
        gives for the flag, naming the variable), else the default."""
        if self.elastic_timeout is not None:
            return self.elastic_timeout
        raw = os.environ.get(ELASTIC_TIMEOUT_VARIABLE)
        if not raw:  # (an empty variable counts as unset, as click takes it)
            return float(DEFAULT_ELASTIC_TIMEOUT)
        ctx = click.get_current_context()
        param = next(p for p in ctx.command.params if p.name == "elastic_timeout")
        try:
            value: float = param.type.convert(raw, param, ctx)
        except click.BadParameter as exc:
            message = f"{exc.message} (from {ELASTIC_TIMEOUT_VARIABLE})"
            raise click.BadParameter(message, ctx=ctx, param=param) from None
        return value

    def resolve(
        self, host_list: list[HostSpec] | None, num_proc: int | None
    ) -> tuple[list[HostSpec], int, Any]:
        from launcher.spec.options import ElasticOptions
        from launcher.supervision.discovery import DiscoveryError, FixedHosts, ScriptDiscovery

        if num_proc is None:
            if self.min_np is None:
                raise click.UsageError("an elastic job needs -np N (the workers to start with)")
            num_proc = self.min_np
        check_num_proc(num_proc)
        min_np = num_proc if self.min_np is None else self.min_np
        if not 1 <= min_np <= num_proc:
            raise click.BadParameter(
                f"must be between 1 and -np ({num_proc}), got {min_np}", param_hint="'--min-np'"
            )
        if self.max_np is not None and self.max_np < num_proc:
            raise click.BadParameter(
                f"must be at least -np ({num_proc}), got {self.max_np}", param_hint="'--max-np'"
            )
        if self.slots_per_host < 1:
            raise click.BadParameter(
                f"must be at least 1, got {self.slots_per_host}", param_hint="'--slots-per-host'"
            )
        if self.reset_limit is not None and self.reset_limit < 0:
            raise click.BadParameter(
                f"must not be negative, got {self.reset_limit}", param_hint="'--reset-limit'"
            )
        if self.cooldown is not None:
            low, high = self.cooldown
            if not 0 < low <= high:
                raise click.BadParameter(
                    f"needs 0 < MIN <= MAX, got {low:g} {high:g}",
                    param_hint="'--blacklist-cooldown-range'",
                )
        discovery: Any
        if self.script is not None:
            if host_list is not None:
                raise click.UsageError(
                    "give the hosts with --host-discovery-script or with -H/--hostfile, not both"
                )
            discovery = ScriptDiscovery(self.script, self.slots_per_host, cwd=os.getcwd())
            try:
                host_list = discovery.find()
            except DiscoveryError as exc:
                raise click.BadParameter(
                    f"{self.script}: {exc}", param_hint="'--host-discovery-script'"
                ) from None
        else:
            if host_list is None:
                host_list = [HostSpec("localhost", self.max_np or num_proc)]
            discovery = FixedHosts(host_list)
        options = ElasticOptions(
            min_np=min_np,
            max_np=self.max_np,
            discovery=discovery,
            elastic_timeout=self.timeout(),
            reset_limit=self.reset_limit,
            cooldown=self.cooldown,
        )
        return host_list, num_proc, options
