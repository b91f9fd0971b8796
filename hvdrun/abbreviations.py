"""Abbreviated long options, as horovodrun (argparse) takes them: ``--slots 4`` for
``--slots-per-host 4``, ``--num-p 8``, ``--host-disc=discover.sh``.

horovodrun's parser accepts every prefix of a long option that names one option only, and
command lines copied from Horovod's documentation rely on it. hvdrun does the same for all
of its ``--`` options, with one rule on top: a prefix that names exactly one of horovodrun's
options means that option here too, even where hvdrun has an option of its own that starts
the same way (``--check`` is ``--check-build``, as in horovodrun, although hvdrun also has
``--check-hosts``). Any other prefix that fits several options is an error that lists them.

Single-letter options that take a value also take it after ``=``, as argparse does:
``-H=host1:2`` is ``-H host1:2`` (click alone would read the host ``=host1``). A single-dash
word that is no option (``-host``, ``-verbose``) is named whole in its error, with the
options it resembles, rather than as the first of its letters that is no short option.

Only options are looked at: click stops reading options at the command, so the training
script's own arguments reach it untouched.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

import click

try:  # click >= 8.2
    from click.parser import _OptionParser as _ClickParser
except ImportError:  # click 8.1
    from click.parser import OptionParser as _ClickParser  # type: ignore[no-redef]

#: horovodrun's long options (Horovod 0.28, horovod/runner/launch.py), ``--help`` included.
HOROVODRUN_LONG_OPTIONS: frozenset[str] = frozenset(
    {
        "--help",
        "--version",
        "--num-proc",
        "--check-build",
        "--disable-cache",
        "--start-timeout",
        "--network-interfaces",
        "--network-interface",
        "--output-filename",
        "--verbose",
        "--config-file",
        "--ssh-port",
        "--ssh-identity-file",
        "--fusion-threshold-mb",
        "--cycle-time-ms",
        "--cache-capacity",
        "--hierarchical-allreduce",
        "--no-hierarchical-allreduce",
        "--hierarchical-allgather",
        "--no-hierarchical-allgather",
        "--torus-allreduce",
        "--no-torus-allreduce",
        "--autotune",
        "--no-autotune",
        "--autotune-log-file",
        "--autotune-warmup-samples",
        "--autotune-steps-per-sample",
        "--autotune-bayes-opt-max-samples",
        "--autotune-gaussian-process-noise",
        "--min-np",
        "--min-num-proc",
        "--max-np",
        "--max-num-proc",
        "--slots-per-host",
        "--elastic-timeout",
        "--reset-limit",
        "--blacklist-cooldown-range",
        "--timeline-filename",
        "--timeline-mark-cycles",
        "--no-timeline-mark-cycles",
        "--no-stall-check",
        "--stall-check",
        "--stall-check-warning-time-seconds",
        "--stall-check-shutdown-time-seconds",
        "--mpi-threads-disable",
        "--no-mpi-threads-disable",
        "--mpi-args",
        "--tcp",
        "--binding-args",
        "--num-nccl-streams",
        "--thread-affinity",
        "--gloo-timeout-seconds",
        "--log-level",
        "--log-with-timestamp",
        "--log-without-timestamp",
        "--prefix-output-with-timestamp",
        "--log-hide-timestamp",
        "--no-log-hide-timestamp",
        "--hosts",
        "--hostfile",
        "--host-discovery-script",
        "--gloo",
        "--mpi",
        "--jsrun",
    }
)


def expand(opt: str, options: Mapping[str, Any]) -> str:
    """The option ``opt`` stands for, given the parser's long options (spelling -> option).

    ``opt`` itself when it is spelt out or matches nothing (the parser then says "no such
    option"); raises :class:`click.BadOptionUsage` when it fits several options. Spellings
    that lead to one option (``--min-np``, ``--min-num-proc``) count as one; a flag's two
    sides (``--log-with-timestamp``, ``--log-without-timestamp``) count as two.
    """
    if not opt.startswith("--") or opt in options:
        return opt
    matches = sorted(name for name in options if name.startswith("--") and name.startswith(opt))
    if len({options[name] for name in matches}) == 1:
        return matches[0]
    if not matches:
        return opt
    horovod = [name for name in HOROVODRUN_LONG_OPTIONS if name.startswith(opt)]
    known = horovod and all(name in options for name in horovod)
    if known and len({options[name] for name in horovod}) == 1:
        return sorted(horovod)[0]
    raise click.BadOptionUsage(opt, f"ambiguous option {opt}: it could be {', '.join(matches)}")


def suggestions(word: str, options: Mapping[str, Any]) -> list[str]:
    """The spellings to suggest for the unknown option ``word``, given the parser's options
    (spelling -> option): those of the option one of whose names ``word`` is, else of the
    options whose names are closest to it, closest first. A name spelt with one dash and
    with two is offered once, with as many dashes as ``word`` has."""
    wanted = _name(word)
    names = list(dict.fromkeys(_name(spelling) for spelling in options))
    close = [wanted] if wanted in names else difflib.get_close_matches(wanted, names, n=3)
    dashes = len(word) - len(wanted)
    offered: list[str] = []
    for match in close:
        option = next(options[spelling] for spelling in options if _name(spelling) == match)
        spellings = sorted((s for s in options if options[s] is option), key=len)
        for spelling in spellings:
            same = [s for s in spellings if _name(s) == _name(spelling)]
            best = min(same, key=lambda s: abs(len(s) - len(_name(s)) - dashes))
            if spelling == best and spelling not in offered:
                offered.append(spelling)
    return offered


def _name(spelling: str) -> str:
    return spelling.lstrip("-")


_MPIRUN = (
    "an mpirun option: hvdrun starts its workers itself, as many on a host as -H gives it "
    "slots (-np N in all), without mpirun"
)
_TORCHRUN = (
    "a torchrun option: hvdrun takes -np N (the processes of the whole job) and -H "
    "host1:N,host2:N (each host's share), and serves the rendezvous itself"
)
#: torchrun's options, as it spells them (each also with underscores).
_TORCHRUN_OPTIONS = (
    "--nproc-per-node",
    "--nnodes",
    "--standalone",
    "--rdzv-backend",
    "--rdzv-endpoint",
    "--rdzv-id",
    "--master-addr",
    "--master-port",
    "--node-rank",
    "--max-restarts",
)
#: Other launchers' options typed here out of habit (those that are not a prefix of one of
#: hvdrun's own: ``--host`` is ``--hosts``), and what to use instead.
FOREIGN_OPTIONS: Mapping[str, str] = {
    "--np": "mpirun's spelling: hvdrun takes -np N",
    "--ntasks": "srun's count: hvdrun takes -np N",
    **dict.fromkeys(
        (
            "--oversubscribe",
            "--bind-to",
            "--map-by",
            "--rank-by",
            "--mca",
            "--tag-output",
            "--allow-run-as-root",
            "--report-bindings",
            "--display-map",
        ),
        _MPIRUN,
    ),
    **dict.fromkeys(_TORCHRUN_OPTIONS, _TORCHRUN),
    **dict.fromkeys(("--" + name[2:].replace("-", "_") for name in _TORCHRUN_OPTIONS), _TORCHRUN),
}


def _one_of(spellings: list[str]) -> str:
    return (
        spellings[0] if len(spellings) == 1 else f"{', '.join(spellings[:-1])} or {spellings[-1]}"
    )


class _AbbreviatingParser(_ClickParser):
    """click's parser, reading long options through :func:`expand`, ``-X=value`` as
    ``-X value``, and naming a whole single-dash word that is no option in its error."""

    def _match_long_opt(self, opt: str, explicit_value: str | None, state: Any) -> None:
        try:
            super()._match_long_opt(expand(opt, self._long_opt), explicit_value, state)
        except click.NoSuchOption:
            self._foreign(opt)
            raise

    def _match_short_opt(self, arg: str, state: Any) -> None:
        option = self._short_opt.get(arg[:2])
        if arg[2:3] == "=" and option is not None:  # -H=host1:2, as argparse reads it
            if not option.takes_value:
                raise click.BadOptionUsage(arg[:2], f"Option '{arg[:2]}' does not take a value.")
            state.rargs.insert(0, arg[3:])
            super()._match_short_opt(arg[:2], state)
            return
        if option is not None and option.takes_value and len(arg) > 2:
            self._check_attached_value(option, arg)
        try:
            super()._match_short_opt(arg, state)
        except click.NoSuchOption:
            self._foreign(arg)
            if len(arg) <= 2:
                raise
            self._no_such_word(arg.split("=", 1)[0])

    def _check_attached_value(self, option: Any, arg: str) -> None:
        """``-port 22`` is ``-p ort`` to argparse and click alike; where ``ort`` is no value
        of ``-p`` and the whole word resembles an option, the word is what was mistyped."""
        try:
            option.obj.type.convert(arg[2:], None, self.ctx)
        except click.BadParameter:
            if suggestions(arg, {**self._short_opt, **self._long_opt}):
                self._no_such_word(arg)

    def _foreign(self, word: str) -> None:
        """Raises the error for another launcher's option, saying what to use instead."""
        name = word.split("=", 1)[0]
        hint = FOREIGN_OPTIONS.get(name)
        if hint is not None:
            raise click.NoSuchOption(name, message=f"no such option: {name} ({hint})", ctx=self.ctx)

    def _no_such_word(self, word: str) -> None:
        offered = suggestions(word, {**self._short_opt, **self._long_opt})
        hint = f" (did you mean {_one_of(offered)}?)" if offered else ""
        raise click.NoSuchOption(word, message=f"no such option: {word}{hint}", ctx=self.ctx)


class AbbreviatingCommand(click.Command):
    """A click command that takes unambiguous prefixes of its long options."""

    def make_parser(self, ctx: click.Context) -> Any:
        parser = _AbbreviatingParser(ctx)
        for param in self.get_params(ctx):
            param.add_to_parser(parser, ctx)
        return parser
