"""The ``hvdrun`` command line: ``hvdrun -np 4 -H host1:2,host2:2 python train.py ARGS...``.

Parses and checks the user's input, builds a :class:`~launcher.spec.job.JobSpec` and hands it to
the launcher. Every user mistake ends as one ``hvdrun: error: ...`` line and exit code 2,
never a traceback. This process never imports torch (only ``--check-build`` does).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import click

from hvdrun.abbreviations import AbbreviatingCommand
from hvdrun.calls import FunctionCall
from hvdrun.command_check import check_command, hidden_packages_note, stdin_note
from hvdrun.config_file import (
    config_env,
    config_file_option,
    config_key,
    config_keys,
    config_warnings,
)
from hvdrun.dry_run import dry_run_option
from hvdrun.elastic_flags import (
    PROCESSES,
    ElasticFlags,
    check_num_proc,
    elastic_options,
    explicit,
)
from hvdrun.help_sections import SectionedCommand
from hvdrun.horovod_flags import (
    HorovodFlags,
    check_hosts_flag,
    check_local_interfaces,
    horovod_options,
    interfaces,
    named_interfaces,
    notices,
)
from hvdrun.logging_setup import LogSettings, configure_logging, logging_options
from hvdrun.report_flags import (
    ReportFlags,
    creatable_directory,
    merge_after_job,
    merge_command,
    report_options,
)
from hvdrun.tuning import tuning_env, tuning_notes, tuning_options
from hvdrun.values import seconds
from hvdrun.version import __version__
from launcher.spec.environment import (
    EnvSpecError,
    forwarded_env,
    parse_exports,
    unset_exports,
    working_directory,
)
from launcher.spec.hosts import (
    LOCAL_NAMES,
    MAX_PROCESSES,
    MAX_SLOTS_PER_HOST,
    HostSpec,
    HostSpecError,
    is_local_host,
    parse_hostfile,
    parse_hosts,
    this_machine_named,
)
from launcher.spec.options import (
    ELASTIC_FAILURE_TIMEOUT,
    HOST_KEY_POLICIES,
    LAUNCHERS,
    LaunchOptions,
    SSHOptions,
)
from launcher.spec.schedulers import Allocation, AllocationError, read_allocation
from rendezvous import load_grpc
from rendezvous.addresses import LOOPBACK_INTERFACE, loopback_down
from rendezvous.launchers import DetectionError, in_slurm_step, slurm_allocation
from rendezvous.worker_env import (
    HOROVOD_PREFIX,
    LAUNCHER_SET,
    PREFIX,
    RENDEZVOUS_LOST_AFTER_SECONDS,
    check_settings,
    setting_names,
    variable,
)

CONTEXT_SETTINGS = {"allow_interspersed_args": False, "help_option_names": ["-h", "--help"]}


class UserPath(click.Path):
    """A file as OpenSSH takes it, with ``~`` expanded: the shell leaves ``-i=~/.ssh/key``
    unexpanded (``~`` only at a word's start), and horovodrun hands it to ssh, which
    expands it."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str):
            value = os.path.expanduser(value)
        return super().convert(value, param, ctx)


class HvdrunCommand(SectionedCommand, AbbreviatingCommand):
    """hvdrun's command: help in sections, long options abbreviated as horovodrun takes them."""


def _version(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    """``--version``: eager, so that it answers before any other flag or variable is read
    (a bad ``HOROVOD_START_TIMEOUT`` in the environment does not stop it)."""
    if value and not ctx.resilient_parsing:
        click.echo(f"hvdrun {__version__}")
        ctx.exit(0)


def _check_build(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    """``--check-build``: eager, as ``--version``."""
    if value and not ctx.resilient_parsing:
        from hvdrun.check_build import build_report

        for line in build_report():
            click.echo(line)
        ctx.exit(0)


@click.command(cls=HvdrunCommand, context_settings=CONTEXT_SETTINGS)
@click.option(
    "-np",
    "-n",
    "--num-proc",
    "num_proc",
    type=PROCESSES,
    metavar="N",
    help="Number of worker processes (default: every slot in -H or the batch allocation).",
)
@click.option(
    "-H",
    "--hosts",
    "hosts",
    metavar="HOST:SLOTS,...",
    help="Hosts and their slots, e.g. host1:4,host2:4 (default: the batch allocation "
    "hvdrun runs in, else localhost:N).",
)
@click.option(
    "-hostfile",
    "--hostfile",
    type=click.Path(dir_okay=False),
    metavar="FILE",
    help="Hosts from a file: one 'host slots=N' or 'host:N' per line, # comments.",
)
@click.option(
    "--start-timeout",
    type=seconds(),
    default=30.0,
    show_default=True,
    envvar="HOROVOD_START_TIMEOUT",
    metavar="SECONDS",
    help="How long connecting to every host and starting its agent may take "
    "(HOROVOD_START_TIMEOUT).",
)
@click.option(
    "--launcher",
    type=click.Choice(LAUNCHERS),
    default="auto",
    show_default=True,
    help="How agents start on the hosts: srun inside a Slurm allocation (slurm), SSH (ssh), "
    "or on this machine only (local); auto picks slurm when every host is a node of the "
    "Slurm allocation hvdrun runs in, else SSH for remote hosts.",
)
@click.option(
    "-p",
    "--ssh-port",
    type=click.IntRange(1, 65535),
    metavar="PORT",
    help="SSH port of every remote host (default: ~/.ssh/config, else 22).",
)
@click.option(
    "-i",
    "--ssh-identity-file",
    "identity_files",
    multiple=True,
    type=UserPath(exists=True, dir_okay=False),
    metavar="FILE",
    help="Private key for SSH (repeatable); tried before ~/.ssh/config's and ssh-agent's.",
)
@click.option(
    "--ssh-config-file",
    type=UserPath(exists=True, dir_okay=False),
    metavar="FILE",
    help="OpenSSH client config to use instead of ~/.ssh/config.",
)
@click.option(
    "--ssh-host-key-policy",
    type=click.Choice(HOST_KEY_POLICIES),
    help="Unknown hosts: refuse (strict), trust once and record (accept-new, the default "
    "unless ~/.ssh/config sets StrictHostKeyChecking), or skip all checks (off). A changed "
    "key is refused unless off.",
)
@click.option(
    "-x",
    "exports",
    multiple=True,
    metavar="VAR[=VALUE]",
    help="Forward VAR (even a host-specific one) or set VAR=VALUE in every worker (repeatable).",
)
@click.option(
    "--rendezvous-addr",
    metavar="ADDR[:PORT]",
    help="Address (and port) at which every host reaches this machine "
    "(default: the address of each host's SSH connection).",
)
@click.option(
    "--network-interface",
    multiple=True,
    callback=named_interfaces,
    metavar="IFNAME[,IFNAME]",
    help="Interface(s) for Gloo and NCCL on every host (default: the one facing the "
    "rendezvous); sets GLOO_SOCKET_IFNAME to the first (as horovodrun) and "
    "NCCL_SOCKET_IFNAME to all.",
)
@click.option(
    "--agent-timeout",
    type=seconds(),
    default=30.0,
    show_default="30; 5 in elastic jobs",
    metavar="SECONDS",
    help="A remote host silent this long counts as cut off: its agent stops its workers "
    "and hvdrun stops the job (an elastic job carries on without it).",
)
@click.option(
    "--heartbeat-timeout",
    type=seconds(),
    default=30.0,
    metavar="SECONDS",
    help="Workers and agents give the job up (and stop) when hvdrun has been silent this "
    "long: a stopped or overloaded hvdrun is not a lost one (a closed connection counts at "
    "once). Sets HVDRUN_RENDEZVOUS_LOST_AFTER_SECONDS. [default: 30, or --agent-timeout "
    "when only that is given]",
)
@click.option(
    "--skip-version-check",
    is_flag=True,
    help="Start even when hosts' Python, torch or hvdrun versions differ from this one's.",
)
@click.option(
    "--output-filename",
    type=click.Path(file_okay=False),
    metavar="DIR",
    help="Also write each rank's output to DIR/rank.N/stdout and DIR/rank.N/stderr.",
)
@click.option(
    "-prefix-timestamp",
    "--prefix-timestamp",
    "--prefix-output-with-timestamp",
    "prefix_timestamp",
    is_flag=True,
    help="Start every output line with the time hvdrun received it.",
)
@click.option(
    "--term-grace",
    type=seconds(positive=False),
    default=5.0,
    show_default=True,
    metavar="SECONDS",
    help="After a failure or a signal, how long workers get between SIGTERM and SIGKILL.",
)
@click.option(
    "--check-hosts",
    is_flag=True,
    help="Connect to every host of -H/--hostfile, print a table of what it runs, and exit.",
)
@click.option(
    "-cb",
    "--check-build",
    is_flag=True,
    is_eager=True,
    expose_value=False,
    callback=_check_build,
    help="Show which frameworks, controllers and tensor operations are available.",
)
@elastic_options
@click.option(
    "-v",
    "--version",
    is_flag=True,
    is_eager=True,
    expose_value=False,
    callback=_version,
    help="Show hvdrun's version and exit.",
)
@tuning_options
@horovod_options
@logging_options
@report_options
@config_file_option
@dry_run_option
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def cli(
    num_proc: int | None,
    hosts: str | None,
    hostfile: str | None,
    start_timeout: float,
    launcher: str,
    ssh_port: int | None,
    identity_files: tuple[str, ...],
    ssh_config_file: str | None,
    ssh_host_key_policy: str | None,
    exports: tuple[str, ...],
    rendezvous_addr: str | None,
    network_interface: tuple[str, ...],
    agent_timeout: float,
    heartbeat_timeout: float,
    skip_version_check: bool,
    output_filename: str | None,
    prefix_timestamp: bool,
    term_grace: float,
    check_hosts: bool,
    min_np: int | None,
    max_np: int | None,
    host_discovery_script: str | None,
    slots_per_host: int,
    elastic_timeout: float | None,
    reset_limit: int | None,
    blacklist_cooldown_range: tuple[float, float] | None,
    command: tuple[str, ...],
    **tuning: Any,
) -> int:
    """Run COMMAND as N distributed workers, e.g. hvdrun -np 4 -H a:2,b:2 python train.py."""
    report = ReportFlags.take(tuning)
    if report.merge_timelines is not None:
        return merge_command(report.merge_timelines, command)
    log_settings = LogSettings.take(tuning)
    # (from hvdrun.run: the caller's own records stay the caller's)
    in_process = click.get_current_context().find_object(FunctionCall) is not None
    configure_logging(log_settings, in_process=in_process)
    compat = HorovodFlags.take(tuning)
    compat.adjust_tuning(tuning)
    dry_run = bool(tuning.pop("dry_run", False))
    try:
        cwd = working_directory(os.environ)  # (the workers start in it, on every host)
    except FileNotFoundError:
        raise click.UsageError(
            "the current directory no longer exists (it was deleted or moved): cd to one that does"
        ) from None
    if hosts is not None:
        check_hosts_flag(hosts)
    host_list = read_hosts(hosts, hostfile)
    elastic_flags = ElasticFlags(
        min_np,
        max_np,
        host_discovery_script,
        slots_per_host,
        elastic_timeout,
        reset_limit,
        blacklist_cooldown_range,
    )
    elastic = elastic_flags.given()
    if explicit("agent_timeout") and not explicit("heartbeat_timeout"):
        # Who shortens the agent timeout wants cut-off hosts to stop as soon, on their own.
        heartbeat_timeout = agent_timeout
    if elastic and not explicit("agent_timeout"):
        agent_timeout = ELASTIC_FAILURE_TIMEOUT
    if rendezvous_addr is not None:
        check_rendezvous_addr(rendezvous_addr)
    ifnames = interfaces(network_interface, compat.network_interfaces)
    env, exported = worker_env(exports, ifnames)
    ifnames_hint = "'--network-interface'"
    if ifnames is None:
        ifnames = gloo_iface(env)
        ifnames_hint = GLOO_IFACE_VARIABLE
    settings = {name: tuning_env(name, value) for name, value in tuning.items()}
    settings.update(compat.settings())
    settings.update(log_settings.settings())
    origins = apply_settings(env, exported, settings)
    if explicit("heartbeat_timeout"):
        env[variable(RENDEZVOUS_LOST_AFTER_SECONDS)] = f"{heartbeat_timeout:g}"
    for name, value in config_env(click.get_current_context()).items():
        env.setdefault(name, value)
    compat.set_tcp(env)
    try:
        # as every worker will read them, before any starts
        check_settings(env, elastic=elastic)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    launch = LaunchOptions(
        ssh=SSHOptions(ssh_port, identity_files, ssh_config_file, ssh_host_key_policy),
        start_timeout=start_timeout,
        agent_timeout=agent_timeout,
        lost_timeout=heartbeat_timeout,
        rendezvous_addr=rendezvous_addr,
        check_versions=not skip_version_check,
        log_level=log_settings.agent_level(),
    )
    # Inside a batch job the allocation is the default host list (-H/--hostfile win).
    allocation = current_allocation() if host_list is None and not elastic else None
    if check_hosts:
        if dry_run:
            raise click.UsageError("--check-hosts contacts the hosts, --dry-run does not: give one")
        if host_list is None and allocation is not None:
            host_list = allocation.hosts
        if host_list is None:
            raise click.UsageError("--check-hosts needs the hosts: -H HOST:SLOTS,... or --hostfile")
        if command:
            raise click.UsageError("--check-hosts runs no command; remove it")
        launch = replace(launch, launcher=choose_launcher(launcher, host_list, elastic=False))
        load_grpc()  # (its agents' relays: gRPC at ERROR, see rendezvous.load_grpc)
        from launcher.check_hosts import check_hosts as run_check

        return run_check([h.hostname for h in host_list], cwd, env, launch, click.echo)

    if not command:
        raise click.UsageError("no command given: hvdrun -np N COMMAND [ARGS...]")
    elastic_options = None
    unused_notes: list[str] = []
    if elastic:
        if host_list is None and elastic_flags.script is None and _in_allocation():
            unused_notes.append(
                "note: an elastic job's hosts come from --host-discovery-script or -H, not "
                "from the batch allocation: without either, this one runs on this machine only"
            )
        fixed = elastic_flags.script is None  # (a discovery script's list may change)
        host_list, num_proc, elastic_options = elastic_flags.resolve(host_list, num_proc)
        if fixed:
            unused_notes += single_host_warning(host_list, hosts, hostfile)
    else:
        unused_notes = elastic_flags.unused_notes()
        host_list, num_proc = resolve_hosts(host_list, hosts, num_proc, allocation, command)
        unused_notes += same_machine_notes(host_list, num_proc)
    launch = replace(launch, launcher=choose_launcher(launcher, host_list, elastic))
    if any(h.hostname in LOCAL_NAMES for h in host_list) and not dry_run:
        check_command(command, env.get("PATH"))
        hidden = hidden_packages_note(command)
        if hidden:
            unused_notes.append(hidden)
    local_only = all(h.hostname in LOCAL_NAMES for h in host_list)
    if local_only and not dry_run and loopback_down():
        raise click.ClickException(
            f"this machine's loopback interface ({LOOPBACK_INTERFACE}) is down, and a job on "
            f"this machine alone talks over it: bring it up (ip link set {LOOPBACK_INTERFACE} "
            "up)"
        )
    if local_only:
        try:
            check_local_interfaces(ifnames, ifnames_hint)
        except click.BadParameter as error:
            if not dry_run:
                raise
            # (the plan is still shown; it says what a run would stop at)
            unused_notes.append(f"warning: {error.format_message()}: a run stops here")

    if output_filename is not None and not dry_run:
        creatable_directory(output_filename, "--output-filename")
    if not dry_run:
        report.check(env, local_only, origins)
    unused_notes += tuning_notes(tuning, env) + srun_copies_note(os.environ)
    call = click.get_current_context().find_object(FunctionCall)  # (from hvdrun.run)
    if call is None:  # (hvdrun.run's caller's stdin is its own)
        unused_notes += stdin_note()
    ignored = config_warnings(click.get_current_context())
    for notice in [*ignored, *unused_notes, *notices(compat, env, host_list, num_proc)]:
        click.echo(f"hvdrun: {notice}", err=True)

    # Imported here so that --version, --help and input errors stay instant; gRPC first, with
    # its own logging at ERROR (a TLS server printed a line for every failed handshake).
    load_grpc()
    from launcher.output import OutputOptions, OutputSink, is_terminal, use_colour
    from launcher.run import run_job
    from launcher.spec.job import JobSpec
    from launcher.transport.startup import LaunchError, LaunchInterrupted, RendezvousListenError

    spec = JobSpec(
        command=list(command),
        num_proc=num_proc,
        hosts=host_list,
        env=env,
        cwd=cwd,
        term_grace=term_grace,
        launch=launch,
        elastic=elastic_options,
        report=report.options(),
    )
    if call is not None:
        spec.preset, spec.collect = call.preset, call.collect
    if dry_run:
        from hvdrun.dry_run import print_plan

        print_plan(spec, click.echo, origins)
        return 0
    # (None where hvdrun started with the descriptor closed: the sink drops that stream)
    stdout = call.stdout if call else getattr(sys.stdout, "buffer", None)
    stderr = call.stderr if call else getattr(sys.stderr, "buffer", None)
    options = OutputOptions(
        prefix_timestamp=prefix_timestamp,
        colour_stdout=use_colour(stdout, os.environ),
        colour_stderr=use_colour(stderr, os.environ),
        output_dir=output_filename,
        status_line=is_terminal(stderr) and os.environ.get("TERM") != "dumb",
        num_ranks=max(num_proc, (elastic_options.max_np or 0) if elastic_options else 0),
    )
    try:
        sink = OutputSink(stdout, stderr, options=options, background=True)
        started = time.time()  # (timelines that began before are an earlier job's)
        result = run_job(spec, sink)
        if call is not None:
            call.result = result
        code = result.exit_code
        merge_after_job(env, options.num_ranks, started, job=result.job_id)
        return code
    except (LaunchError, RendezvousListenError) as exc:
        raise LaunchFailed(str(exc)) from None
    except LaunchInterrupted as exc:
        click.echo("hvdrun: interrupted while starting the job", err=True)
        if call is not None:
            call.interrupted_by = exc.signum
        return 128 + exc.signum


def read_hosts(hosts: str | None, hostfile: str | None) -> list[HostSpec] | None:
    if hosts is not None and hostfile is not None:
        raise click.UsageError("give the hosts with -H or with --hostfile, not both")
    try:
        if hostfile is not None:
            return parse_hostfile(hostfile)
        if hosts is not None:
            return parse_hosts(hosts)
    except HostSpecError as exc:
        hint = "'--hostfile'" if hostfile is not None else "'-H'"
        raise click.BadParameter(str(exc), param_hint=hint) from None
    return None


def _in_allocation() -> bool:
    try:
        return read_allocation(os.environ) is not None
    except AllocationError:
        return True


def current_allocation() -> Allocation | None:
    """The batch allocation hvdrun runs in (launcher.spec.schedulers), or None."""
    try:
        return read_allocation(os.environ)
    except AllocationError as exc:
        raise click.UsageError(f"cannot use the batch allocation: {exc}") from None


#: hvdrun's options that say how many processes run where.
_PLACEMENT_OPTIONS = ("-np", "-n", "--num-proc", "-H", "--hosts", "-hostfile", "--hostfile")


def _after_the_command(command: Sequence[str]) -> str:
    """Where a placement option came after the command: that it went to the command."""
    misplaced = next((word for word in command[1:] if word in _PLACEMENT_OPTIONS), None)
    if misplaced is None:
        return ""
    return (
        f": the {misplaced} after {command[0]} is the command's own argument (hvdrun's "
        "options go before the command)"
    )


def resolve_hosts(
    host_list: list[HostSpec] | None,
    hosts: str | None,
    num_proc: int | None,
    allocation: Allocation | None = None,
    command: Sequence[str] = (),
) -> tuple[list[HostSpec], int]:
    """The hosts and process count of a fixed-size job: -H/--hostfile, else the batch
    allocation (its first ``-np`` slots; see :func:`beyond_allocation` for more), else
    ``localhost:-np``. ``command``: the job's, to say where an ``-np`` in it went."""
    if num_proc is not None:
        check_num_proc(num_proc)
    if host_list is None and allocation is not None:
        if num_proc is None:
            num_proc = allocation.slots
        if num_proc > allocation.slots:
            return beyond_allocation(allocation, num_proc), num_proc
        return allocation.first_slots(num_proc), num_proc
    if host_list is None:
        if num_proc is None:
            raise click.UsageError(
                "give the number of processes with -np N (or hosts with -H)"
                + _after_the_command(command)
            )
        return [HostSpec("localhost", here(num_proc))], num_proc
    total = sum(h.slots for h in host_list)
    if num_proc is None:
        if total > MAX_PROCESSES:
            raise click.UsageError(
                f"the hosts have {total} slots, above the limit of {MAX_PROCESSES} processes "
                "of one job: give the number of processes with -np N"
            )
        num_proc = total
    if num_proc > total:
        where = f"-H {hosts}" if hosts is not None else "the hostfile"
        raise click.BadParameter(
            f"{num_proc} processes requested but {where} has only {total} slot(s)",
            param_hint="'-np'",
        )
    return host_list, num_proc


#: How to get more slots from each scheduler, for the error of an -np above them.
_MORE_SLOTS = {
    "slurm": "ask Slurm for more tasks (e.g. --ntasks-per-node=N)",
    "pbs": "ask PBS for more slots (e.g. -l select=...:mpiprocs=N)",
    "lsf": "ask LSF for more slots (bsub -n N)",
    "sge": "ask SGE for more slots (-pe NAME N)",
}


def beyond_allocation(allocation: Allocation, num_proc: int) -> list[HostSpec]:
    """The hosts of an ``-np`` above the allocation's slots. An allocation of this machine
    alone (``sbatch -N1 --gres=gpu:8`` has one task slot) runs the N workers here, as
    horovodrun (``localhost:N``) does, with a note; one of several nodes, where the workers'
    places are not clear, is an error that names the ways out."""
    nodes = [host.hostname for host in allocation.hosts]
    if len(nodes) == 1 and is_local_host(nodes[0]):
        here(num_proc)
        click.echo(
            f"hvdrun: note: -np {num_proc} is more than the {allocation.slots} slot(s) of "
            f"{allocation.source}, which holds only this machine ({nodes[0]}): its "
            f"{num_proc} workers run here, as horovodrun runs them",
            err=True,
        )
        return [HostSpec(nodes[0], num_proc)]
    more = _MORE_SLOTS.get(allocation.scheduler, "ask the scheduler for more slots")
    if len(nodes) == 1:
        # (hvdrun runs elsewhere: salloc's shell on a login node, which is no place for them)
        example = f"-H {nodes[0]}:{num_proc} to run them all on its node"
    else:
        share = -(-num_proc // len(nodes))
        example = "e.g. -H " + ",".join(f"{node}:{share}" for node in nodes[:3])
        example += ",..." if len(nodes) > 3 else ""
    raise click.BadParameter(
        f"{num_proc} processes requested but {allocation.source} has only "
        f"{allocation.slots} slot(s) on {len(nodes)} node(s): give the hosts and their slots "
        f"with -H ({example}), or {more}",
        param_hint="'-np'",
    )


def same_machine_notes(host_list: Sequence[HostSpec], num_proc: int) -> list[str]:
    """A note where the hosts name this machine more than once (``-H localhost:1,127.0.0.1:1``):
    they run as that many hosts, each with local ranks from 0, so their workers pick the same
    GPUs. A way to stand in for several hosts on one machine, so a note, not an error."""
    names = this_machine_named(host_list, num_proc)
    if len(names) < 2:
        return []
    return [
        f"note: the hosts name this machine {len(names)} times ({', '.join(names)}): they run "
        f"as {len(names)} hosts, as in horovodrun, each with local ranks from 0, so workers "
        "that choose cuda:<local_rank> share GPUs; name it once (e.g. -H localhost:"
        f"{num_proc}) unless they stand in for several hosts on purpose"
    ]


def srun_copies_note(environ: Mapping[str, str]) -> list[str]:
    """A note where hvdrun runs as one task of a Slurm step of several (``srun hvdrun ...``,
    mpirun's habit): each task runs a job of its own, all training the same thing."""
    tasks = environ.get("SLURM_STEP_NUM_TASKS", "")
    if not in_slurm_step(environ) or not tasks.isdigit() or int(tasks) < 2:
        return []
    return [
        f"note: this hvdrun is one of the {tasks} tasks of a Slurm step (srun hvdrun ...): each "
        "runs a job of its own; run hvdrun once, from the batch script or the salloc shell "
        "(or srun --ntasks=1), and it starts its workers on the allocation's nodes itself"
    ]


def single_host_warning(
    host_list: Sequence[HostSpec], hosts: str | None, hostfile: str | None
) -> list[str]:
    """A warning where an elastic job's fixed host list (``-H``, ``--hostfile``, or none:
    this machine) names one host: a failed worker fails that host, which is blacklisted,
    and no worker is left, so the job ends. horovodrun refuses such a job ("Cannot run in
    fault tolerance mode with fewer than 2 hosts."); hvdrun runs it, as on one machine where
    an elastic script is tried out, and says so."""
    names = list(dict.fromkeys(host.hostname for host in host_list))
    if len(names) != 1:
        return []
    given = "from -H" if hosts else "from --hostfile" if hostfile else "no -H given"
    return [
        f"warning: this elastic job has one host ({names[0]}, {given}): a failure "
        "of any of its workers fails the host and ends the job; list at least 2 hosts (as "
        "horovodrun requires) or use --host-discovery-script to survive failures"
    ]


def here(num_proc: int) -> int:
    """``num_proc``, the workers to run on this machine alone: at most one host's slots."""
    if num_proc > MAX_SLOTS_PER_HOST:
        raise click.BadParameter(
            f"{num_proc} processes on this machine is above the limit of "
            f"{MAX_SLOTS_PER_HOST} slots per host",
            param_hint="'-np'",
        )
    return num_proc


def choose_launcher(requested: str, host_list: Sequence[HostSpec], elastic: bool) -> str:
    """``--launcher`` for these hosts: "slurm" (one srun step) or "ssh" (local or SSH per
    host); see launcher.spec.options.LAUNCHERS."""
    try:
        allocation = slurm_allocation(os.environ)
    except DetectionError as exc:
        if requested == "slurm":
            raise click.UsageError(f"--launcher slurm: {exc}") from None
        allocation = None
    names = [h.hostname for h in host_list]
    if requested == "local":
        remote = [name for name in names if not is_local_host(name)]
        if remote:
            raise click.BadParameter(
                f"'local' starts workers on this machine only, but the hosts include "
                f"{', '.join(remote)}",
                param_hint="'--launcher'",
            )
        return "ssh"
    outside = [] if allocation is None else [n for n in names if n not in allocation.nodes]
    if requested == "slurm":
        if allocation is None:
            raise click.BadParameter(
                "'slurm' starts the agents with srun inside a Slurm allocation; run hvdrun "
                "inside salloc or an sbatch script (not inside srun)",
                param_hint="'--launcher'",
            )
        if elastic:
            raise click.BadParameter(
                "elastic jobs start their agents over SSH; use --launcher ssh (or auto)",
                param_hint="'--launcher'",
            )
        if outside:
            raise click.BadParameter(
                f"srun starts agents on the allocation's nodes "
                f"({','.join(allocation.nodes)}) only, not on {', '.join(outside)}",
                param_hint="'--launcher'",
            )
        return "slurm"
    if requested == "auto" and allocation is not None and not elastic and not outside:
        return "slurm"
    return "ssh"


def worker_env(
    exports: tuple[str, ...], network_interface: str | None
) -> tuple[dict[str, str], dict[str, str]]:
    """What every worker gets from here (see launcher.spec.environment for the rules), and
    the variables ``-x`` exported."""
    try:
        exported = parse_exports(exports, os.environ)
    except EnvSpecError as exc:
        raise click.BadParameter(str(exc), param_hint="'-x'") from None
    for name in unset_exports(exports, os.environ):  # (mpirun warns alike, and runs)
        click.echo(
            f"hvdrun: note: -x {name}: {name} is not set here, so the workers do not get it "
            f"(give a value with -x {name}=VALUE)",
            err=True,
        )
    own = sorted(set(exported) & LAUNCHER_SET)
    if own:
        click.echo(
            f"hvdrun: note: -x {', '.join(own)}: hvdrun sets these for each worker (its place "
            "in the job and the job's rendezvous); the values given are not used",
            err=True,
        )
    env = forwarded_env(os.environ, exported)
    if network_interface:
        # As horovodrun: Gloo the first interface, NCCL them all. (torch's Gloo would use
        # every listed one, in turn, to reach every peer: eth0,lo or eth0,docker0 fails.)
        env["GLOO_SOCKET_IFNAME"] = network_interface.split(",")[0]
        env["NCCL_SOCKET_IFNAME"] = network_interface
    return env, exported


#: Where a parameter's value came from when ``-x`` wins over it: the config file, or the
#: parameter's own environment variable (``HOROVOD_LOG_LEVEL``).
_BELOW_EXPORTS = (click.core.ParameterSource.DEFAULT_MAP, click.core.ParameterSource.ENVIRONMENT)


def apply_settings(
    env: dict[str, str], exported: Mapping[str, str], settings: Mapping[str, Mapping[str, str]]
) -> dict[str, str]:
    """Writes the worker variables of hvdrun's flags, by parameter, into ``env``. One rule
    for all: a flag given on the command line wins over ``-x``; ``-x`` (of either spelling,
    ``HVDRUN_*`` or ``HOROVOD_*``) wins over the config file's value and over the flag's own
    environment variable. Returns where the variables written came from (``--dry-run``
    says it), where that is the flag or the config file's key."""
    ctx = click.get_current_context()
    origins: dict[str, str] = {}
    for param, variables in settings.items():
        source = ctx.get_parameter_source(param)
        below = source in _BELOW_EXPORTS
        for name, value in variables.items():
            if below and any(spelling in exported for spelling in _spellings(name)):
                continue
            env[name] = value
            origin = _origin(ctx, param, source)
            if origin is not None:
                origins[name] = origin
    return origins


def _origin(ctx: click.Context, name: str, source: click.core.ParameterSource | None) -> str | None:
    """Where parameter ``name``'s value came from, in words: the config file's key, or the
    flag spelled out (``--fusion-threshold-mb``); None otherwise (a flag's variable in
    hvdrun's environment: the variable itself says it)."""
    if source == click.core.ParameterSource.DEFAULT_MAP:
        return config_keys(ctx).get(name, "the config file")
    option = next((p for p in ctx.command.params if p.name == name), None)
    if source != click.core.ParameterSource.COMMANDLINE or option is None or not option.opts:
        return None
    return max(option.opts, key=len)


def _spellings(name: str) -> tuple[str, ...]:
    """A worker variable's names: both of a setting's (``HVDRUN_X``, ``HOROVOD_X``)."""
    for prefix in (PREFIX, HOROVOD_PREFIX):
        if name.startswith(prefix):
            return setting_names(name[len(prefix) :])
    return (name,)


def check_rendezvous_addr(addr: str) -> None:
    _, sep, port = addr.rpartition(":")
    has_port = addr.startswith("[") or addr.count(":") == 1
    if has_port and sep and (not port.isdigit() or not 0 < int(port) < 65536):
        raise click.BadParameter(
            f"'{addr}' is not ADDR or ADDR:PORT", param_hint="'--rendezvous-addr'"
        )
    if not addr.strip("[]:"):
        raise click.BadParameter("the address is empty", param_hint="'--rendezvous-addr'")


#: Horovod's variable for the interface Gloo uses: read as ``--network-interface`` when
#: neither ``--network-interface`` nor ``--network-interfaces`` is given.
GLOO_IFACE_VARIABLE = "HOROVOD_GLOO_IFACE"


def gloo_iface(env: dict[str, str]) -> str | None:
    """``HOROVOD_GLOO_IFACE`` (horovodrun users choose Gloo's interface so) as the workers'
    ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME``, unless they have those already (set
    here or with ``-x``); the interface names, or None where it does not apply."""
    value = os.environ.get(GLOO_IFACE_VARIABLE, "")
    names = interfaces([value])
    if names is None or "GLOO_SOCKET_IFNAME" in env:
        return None
    env["GLOO_SOCKET_IFNAME"] = names
    env.setdefault("NCCL_SOCKET_IFNAME", names)
    return names


class LaunchFailed(click.ClickException):
    exit_code = 255  # like ssh when it cannot connect


def run_cli(argv: Sequence[str] | None = None) -> int:
    """Runs the CLI and returns its exit code; errors become one ``hvdrun: error:`` line."""
    try:
        result = cli.main(
            args=list(argv) if argv is not None else None, prog_name="hvdrun", standalone_mode=False
        )
    except click.UsageError as exc:
        click.echo(f"hvdrun: error: {usage_message(exc)}", err=True)
        return 2
    except click.ClickException as exc:
        click.echo(f"hvdrun: error: {exc.format_message()}", err=True)
        return exc.exit_code
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.Abort:  # (Ctrl-C before the job's start: click has ended the ^C line)
        click.echo("hvdrun: interrupted before the job started", err=True)
        return 130
    return result if isinstance(result, int) else 0


def usage_message(exc: click.UsageError) -> str:
    key = config_key(exc)
    if key is not None and isinstance(exc, click.BadParameter):
        return f"{key}: {exc.message}"
    message = exc.format_message()
    variable = _from_environment(exc)
    if variable is not None:
        message += f" (from {variable})"
    if isinstance(exc, click.BadParameter) and exc.param_hint and exc.param is None:
        hint = exc.param_hint if isinstance(exc.param_hint, str) else "/".join(exc.param_hint)
        return f"invalid {hint}: {exc.message}"
    return message.replace("\n", " ")


def _from_environment(exc: click.UsageError) -> str | None:
    """The variable a bad value came from (HOROVOD_START_TIMEOUT=abc), if it did."""
    param = getattr(exc, "param", None)
    if param is None or exc.ctx is None or not param.name or not param.envvar:
        return None
    source = exc.ctx.get_parameter_source(param.name)
    if source != click.core.ParameterSource.ENVIRONMENT:
        return None
    names = [param.envvar] if isinstance(param.envvar, str) else list(param.envvar)
    return next((name for name in names if os.environ.get(name)), None)


def main() -> None:
    sys.exit(run_cli())
