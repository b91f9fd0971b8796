"""The ``hvdrun`` command line: ``hvdrun -np 4 -H host1:2,host2:2 python train.py ARGS...``.

Parses and checks the user's input, builds a :class:`~launcher.job.JobSpec` and hands it to
the launcher. Every user mistake ends as one ``hvdrun: error: ...`` line and exit code 2,
never a traceback. This process never imports torch (only ``--check-build`` does).
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Sequence
from typing import Any

import click

from hvdrun import __version__
from hvdrun.tuning import tuning_env, tuning_options
from launcher.hosts import HostSpec, HostSpecError, parse_hosts

CONTEXT_SETTINGS = {"allow_interspersed_args": False, "help_option_names": ["-h", "--help"]}


@click.command(context_settings=CONTEXT_SETTINGS)
@click.option(
    "-np",
    "--num-proc",
    "num_proc",
    type=int,
    metavar="N",
    help="Number of worker processes (default: every slot in -H).",
)
@click.option(
    "-H",
    "--hosts",
    "hosts",
    metavar="HOST:SLOTS,...",
    help="Hosts and their slots, e.g. host1:4,host2:4 (default: localhost:N).",
)
@click.option(
    "--term-grace",
    type=click.FloatRange(min=0),
    default=5.0,
    show_default=True,
    metavar="SECONDS",
    help="After a failure, how long workers get between SIGTERM and SIGKILL.",
)
@click.option(
    "--check-build",
    is_flag=True,
    help="Show which frameworks, controllers and tensor operations are available.",
)
@click.option("--version", is_flag=True, help="Show hvdrun's version and exit.")
@tuning_options
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def cli(
    num_proc: int | None,
    hosts: str | None,
    term_grace: float,
    check_build: bool,
    version: bool,
    command: tuple[str, ...],
    **tuning: Any,
) -> int:
    """Run COMMAND as N distributed workers, e.g. hvdrun -np 4 python train.py."""
    if version:
        click.echo(f"hvdrun {__version__}")
        return 0
    if check_build:
        from hvdrun.check_build import build_report

        for line in build_report():
            click.echo(line)
        return 0

    host_list, num_proc = resolve_hosts(hosts, num_proc)
    if not command:
        raise click.UsageError("no command given: hvdrun -np N COMMAND [ARGS...]")
    check_command(command)

    # Imported here so that --version, --help and input errors stay instant.
    from launcher.job import JobSpec, run_job
    from launcher.output import OutputSink

    spec = JobSpec(
        command=list(command),
        num_proc=num_proc,
        hosts=host_list,
        env={**os.environ, **tuning_env(**tuning)},
        cwd=os.getcwd(),
        term_grace=term_grace,
    )
    sink = OutputSink(sys.stdout.buffer, sys.stderr.buffer)
    return run_job(spec, sink).exit_code


def resolve_hosts(hosts: str | None, num_proc: int | None) -> tuple[list[HostSpec], int]:
    if num_proc is not None and num_proc < 1:
        raise click.BadParameter(f"must be at least 1, got {num_proc}", param_hint="'-np'")
    if hosts is None:
        if num_proc is None:
            raise click.UsageError("give the number of processes with -np N (or hosts with -H)")
        return [HostSpec("localhost", num_proc)], num_proc
    try:
        host_list = parse_hosts(hosts)
    except HostSpecError as exc:
        raise click.BadParameter(str(exc), param_hint="'-H'") from None
    total = sum(h.slots for h in host_list)
    if num_proc is None:
        num_proc = total
    if num_proc > total:
        raise click.BadParameter(
            f"{num_proc} processes requested but -H {hosts} has only {total} slot(s)",
            param_hint="'-np'",
        )
    return host_list, num_proc


def check_command(command: Sequence[str]) -> None:
    """Catch a missing program or script before any process starts."""
    program = command[0]
    if shutil.which(program) is None:
        raise CommandNotFound(f"command not found: {program}")
    if os.path.basename(program).startswith("python") and len(command) > 1:
        script = command[1]
        if not script.startswith("-") and script.endswith(".py") and not os.path.exists(script):
            raise ScriptNotFound(f"script not found: {script} (in {os.getcwd()})")


class CommandNotFound(click.ClickException):
    exit_code = 127


class ScriptNotFound(click.ClickException):
    exit_code = 2  # what python itself exits with for a missing script


def run_cli(argv: Sequence[str] | None = None) -> int:
    """Runs the CLI and returns its exit code; errors become one ``hvdrun: error:`` line."""
    try:
        result = cli.main(
            args=list(argv) if argv is not None else None, prog_name="hvdrun", standalone_mode=False
        )
    except click.UsageError as exc:
        click.echo(f"hvdrun: error: {_usage_message(exc)}", err=True)
        return 2
    except click.ClickException as exc:
        click.echo(f"hvdrun: error: {exc.format_message()}", err=True)
        return exc.exit_code
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.Abort:
        return 130
    return result if isinstance(result, int) else 0


def _usage_message(exc: click.UsageError) -> str:
    message = exc.format_message()
    if isinstance(exc, click.BadParameter) and exc.param_hint and exc.param is None:
        hint = exc.param_hint if isinstance(exc.param_hint, str) else "/".join(exc.param_hint)
        return f"invalid {hint}: {exc.message}"
    return message.replace("\n", " ")


def main() -> None:
    sys.exit(run_cli())
