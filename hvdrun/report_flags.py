"""``--report-file``, ``--no-report`` and ``--merge-timelines``: what hvdrun says about where
the ranks' time went.

When a job ends, hvdrun prints a short table of every rank's time in collectives, how long it
waited for the others, how often it arrived last and what that cost the others, and names
the rank that held the job back when one stands out (:mod:`launcher.supervision.insight`);
``--no-report`` leaves the table out and ``--report-file FILE`` writes the full figures as
JSON. Where every rank wrote its own timeline (``--timeline-all-ranks``, or ``{rank}`` in
``--timeline-filename``) hvdrun merges them into one trace afterwards (leaving out the files
an earlier job left there); ``--merge-timelines OUTPUT FILE...`` merges files gathered by
hand (:mod:`hvdrun.timelines`).
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import click

from hvdrun.timelines import (
    TimelineError,
    merge_files,
    merged_path,
    origin,
    rank_files,
)
from rendezvous import worker_env

if TYPE_CHECKING:
    from launcher.spec.options import ReportOptions

F = TypeVar("F", bound=Callable[..., Any])

#: The files named in one line at most (a job of many ranks).
_NAMED = 4

_OPTIONS = [
    click.option(
        "--report-file",
        type=click.Path(dir_okay=False),
        metavar="FILE",
        help="Write the end-of-job report's full figures as JSON: per rank its time in "
        "collectives, its waits for the others, how often it arrived last, what that cost "
        "the others, and the ops waited at most.",
    ),
    click.option(
        "--no-report",
        is_flag=True,
        help="Do not print the end-of-job table of where the ranks' time went.",
    ),
    click.option(
        "--merge-timelines",
        type=click.Path(dir_okay=False),
        metavar="OUTPUT",
        help="Merge the per-rank timelines given as arguments (hvdrun --merge-timelines "
        "OUTPUT trace.0.json trace.1.json ...) into one trace, one process per rank, clocks "
        "aligned, and exit.",
    ),
]


def report_options(fn: F) -> F:
    """Adds the report flags to a click command."""
    for option in reversed(_OPTIONS):
        fn = option(fn)
    return fn


@dataclass(frozen=True)
class ReportFlags:
    report_file: str | None = None
    no_report: bool = False
    merge_timelines: str | None = None

    @classmethod
    def take(cls, params: dict[str, Any]) -> ReportFlags:
        """Removes the report flags from the command's parameters."""
        return cls(
            params.pop("report_file", None),
            bool(params.pop("no_report", False)),
            params.pop("merge_timelines", None),
        )

    def check(self, env: Mapping[str, str], local: bool, origins: Mapping[str, str]) -> None:
        """A report file's directory must exist or be creatable, before the job starts; so
        must the timeline's and the autotune log's where every rank runs on this machine
        (``local``: elsewhere the ranks' hosts write them, and a rank that cannot says so and
        writes none). Errors name the setting as the user gave it: the flag or config key
        that wrote its variable (``origins``), else the variable (``-x``, the environment)."""
        if self.report_file is not None:
            path = os.path.abspath(self.report_file)
            creatable_directory(os.path.dirname(path), "--report-file", path)
        for name in (worker_env.TIMELINE, worker_env.AUTOTUNE_LOG):
            found = worker_env.spelled(name, env)
            if not (local and found):
                continue
            spelling, setting = found
            given_as = origins.get(spelling, spelling)
            file = setting
            if name == worker_env.TIMELINE:  # (rank 0's: every rank's own, where each has one)
                all_ranks = worker_env.flag(worker_env.TIMELINE_ALL_RANKS, env)
                file = worker_env.timeline_file(file, 0, all_ranks) or file
                if file != setting and worker_env.device_or_pipe(setting):
                    raise click.BadParameter(
                        f"{setting} is a device or a pipe: every rank's own timeline would be "
                        f"a new file named after it ({file}, ...); name a regular file, or "
                        "let rank 0 alone write it",
                        param_hint=f"'{given_as}'",
                    )
            file = os.path.abspath(file)
            creatable_directory(os.path.dirname(file), given_as, file)

    def options(self) -> ReportOptions:
        from launcher.spec.options import ReportOptions

        path = os.path.abspath(self.report_file) if self.report_file else None
        return ReportOptions(table=not self.no_report, file=path)


def creatable_directory(path: str, option: str, file: str | None = None) -> None:
    """Creates the directory an option writes into (``--report-file``'s,
    ``--output-filename``, ``--timeline-filename``'s, ``--autotune-log-file``'s), before the
    job starts; a usage error naming the option when it cannot be. Where the option's
    ``file`` does not exist yet (or names a directory of files: None), a nameless file is
    made there too, which leaves nothing behind (permissions do not tell root of a read-only
    mount); an existing file (``/dev/null``, a descriptor's) is opened by name, as it is."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise click.BadParameter(
            f"cannot create {path}: {exc.strerror or exc}", param_hint=f"'{option}'"
        ) from None
    if file is not None and os.path.lexists(file):
        _writable_file(file, option)
        return
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        why = exc.strerror or str(exc)
        if exc.errno == errno.ENOENT and os.path.isdir(path):  # (not "no such file": /proc)
            why = "this directory takes no new files"
        raise click.BadParameter(
            f"cannot write in {path}: {why}", param_hint=f"'{option}'"
        ) from None


def _writable_file(file: str, option: str) -> None:
    """An existing regular file an option names is opened for writing, and closed (nothing
    in it changes); a device's or a pipe's is taken as it is."""
    try:
        if not stat.S_ISREG(os.stat(file).st_mode):
            return
        os.close(os.open(file, os.O_WRONLY))
    except OSError as exc:
        raise click.BadParameter(
            f"cannot write {file}: {exc.strerror or exc}", param_hint=f"'{option}'"
        ) from None


def _say(line: str) -> None:
    click.echo(line, err=True)


def merge_command(output: str, inputs: Sequence[str], echo: Callable[[str], None] = _say) -> int:
    """``hvdrun --merge-timelines OUTPUT FILE...``."""
    if not inputs:
        raise click.UsageError(
            "--merge-timelines OUTPUT needs the timelines to merge: hvdrun --merge-timelines "
            "OUTPUT trace.0.json trace.1.json ..."
        )
    try:
        notes = merge_files(output, inputs)
    except TimelineError as exc:
        raise click.ClickException(str(exc)) from None
    for note in notes:
        echo(f"hvdrun: note: {note}")
    merged = f"{len(inputs)} timeline" + ("s" if len(inputs) > 1 else "")
    echo(f"hvdrun: merged {merged} into {output}")
    return 0


def _another_jobs(path: str, job: str, since: float) -> bool:
    """Whether the timeline in ``path`` is another job's than ``job`` (see
    :func:`merge_after_job`)."""
    found = origin(path)  # (its first event read once)
    if found is None:
        return False
    if job and found.job is not None:
        return found.job != job
    return found.started < since


def merge_after_job(
    env: Mapping[str, str],
    ranks: int,
    since: float,
    *,
    job: str = "",
    echo: Callable[[str], None] = _say,
) -> None:
    """Merges the job's per-rank timelines, where every rank wrote one that is on this
    machine (the others are named, for ``--merge-timelines`` by hand). A file that another
    job wrote is left out, and named: one that says which job wrote it, by that job's id
    (``job``: this one's); else one that began before the job (``since``, a ``time.time()``
    taken before it started: a clock behind hvdrun's, another host's on a shared
    filesystem, would leave this job's own files out by it)."""
    path = worker_env.setting(worker_env.TIMELINE, env)
    if not path or (
        "{rank}" not in path and not worker_env.flag(worker_env.TIMELINE_ALL_RANKS, env)
    ):
        return
    files = rank_files(path, ranks)
    here = [name for name in files if os.path.exists(name)]
    missing = [name for name in files if name not in here]
    stale = [name for name in here if _another_jobs(name, job, since)]
    if stale:
        echo(f"hvdrun: left out {len(stale)} timeline(s) that another job wrote: {_some(stale)}")
    fresh = [name for name in here if name not in stale]
    if not fresh:
        return
    output = merged_path(path)
    try:
        notes = merge_files(output, fresh)
    except TimelineError as exc:
        echo(f"hvdrun: the timelines were not merged: {exc}")
        return
    for note in notes:
        echo(f"hvdrun: note: {note}")
    echo(f"hvdrun: merged the timelines of {len(fresh)} rank(s) into {output}")
    if missing:
        echo(
            f"hvdrun: {len(missing)} timeline(s) are not on this machine (e.g. {missing[0]}): "
            "copy them here and merge them all with hvdrun --merge-timelines OUTPUT FILE..."
        )


def _some(names: Sequence[str]) -> str:
    """``names`` in one line: the first few, and how many more."""
    shown = ", ".join(names[:_NAMED])
    return shown if len(names) <= _NAMED else f"{shown} and {len(names) - _NAMED} more"
