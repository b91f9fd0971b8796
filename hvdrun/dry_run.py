"""``--dry-run``: what hvdrun would do, printed, with nothing started and no host contacted.

The plan lists every rank with its host, local rank and cross rank; how each host is reached
(this machine, or SSH with the user, port, keys and proxy that ``~/.ssh/config`` and the
flags give); the environment every worker gets, with secrets masked; and the tuning values
the workers will run with and where each comes from. An elastic job shows the plan of its
first discovery (the discovery script runs once, as it would at start): its first generation
as the elastic driver decides it when every host listed comes up in time
(:func:`launcher.supervision.membership.first_generation`).
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Callable, Mapping

import click

from launcher.spec.hosts import is_local_host
from launcher.spec.job import JobSpec
from launcher.spec.options import LaunchOptions
from rendezvous import worker_env as we
from rendezvous.slots import SlotInfo, assign_slots

Echo = Callable[[str], None]

dry_run_option = click.option(
    "--dry-run",
    is_flag=True,
    help="Print the plan (ranks, hosts and how each is reached, the workers' environment and "
    "tuning) and exit without contacting any host.",
)

#: Variable names whose values are never printed.
SECRET_NAME = re.compile(
    r"SECRET|TOKEN|PASSWORD|PASSWD|PASSPHRASE|CREDENTIAL|PRIVATE|PRIVKEY|COOKIE|"
    r"(^|_)API_?KEY|ACCESS_KEY|(^|_)AUTH($|_)|AUTHORI[SZ]ATION|(^|_)KEYS?$|WRITE_?KEY|"
    r"_PWD$|(^|_)PASS$|SSHPASS|_PAT$|_CREDS$|_DSN$|JWT|(^|_)SALT$|_HEADERS$|"
    r"CONNECTION_?STRING|WEBHOOK",
    re.IGNORECASE,
)
#: Credentials in a value, whatever the variable's name (``authorization=Bearer ...``).
SECRET_VALUE = re.compile(r"\b(?:bearer|basic)\s+\S|authorization\s*[=:]", re.IGNORECASE)
#: The secret path of a webhook URL (Slack's ``/services/...``, Discord's ``/webhooks/...``).
URL_WEBHOOK_PATH = re.compile(r"(hooks\.slack\.com/services/|/api/webhooks/)[^\s?#]+")
#: The password of a URL's ``user:password@`` part (``DATABASE_URL=postgres://u:pw@h/db``).
URL_PASSWORD = re.compile(r"(?<=://)([^/@:\s]*):[^/@\s]*@")
#: The user part of an http(s) URL without a password, where tokens go
#: (``https://<token>@github.com/...``, a Sentry DSN's key).
URL_TOKEN_USER = re.compile(r"(\bhttps?://)[^/@:\s]+@", re.IGNORECASE)
#: Secret query parameters of a URL: ``?token=...``, ``&sig=...`` (signed URLs), and any
#: parameter whose name looks like a secret's (``X-Amz-Signature``, ``access_token``).
URL_SECRET_QUERY = re.compile(
    r"([?&](?:[^=&#\s]*(?:SECRET|TOKEN|PASSWORD|PASSWD|SIGNATURE|CREDENTIAL|API_?KEY)"
    r"[^=&#\s]*|sig|key|pwd|pass)=)[^&#\s]*",
    re.IGNORECASE,
)
#: Key material in a value, whatever the variable's name.
PRIVATE_KEY_BLOCK = re.compile(r"PRIVATE KEY-----|BEGIN OPENSSH|BEGIN PGP PRIVATE")
MASK = "****"


def masked(name: str, value: str) -> str:
    """``value`` as the plan shows it: masked whole when the name or the value says it is a
    secret; else with the secret parts of any URL in it masked."""
    if SECRET_NAME.search(name) or PRIVATE_KEY_BLOCK.search(value) or SECRET_VALUE.search(value):
        return MASK
    value = URL_WEBHOOK_PATH.sub(rf"\1{MASK}", value)
    value = URL_PASSWORD.sub(rf"\1:{MASK}@", value)
    value = URL_TOKEN_USER.sub(rf"\1{MASK}@", value)
    return URL_SECRET_QUERY.sub(rf"\1{MASK}", value)


def describe_reach(hostname: str, launch: LaunchOptions) -> str:
    """How hvdrun would reach ``hostname``: the same decision launcher.transport.startup
    makes, without connecting."""
    if launch.launcher == "slurm":
        return "srun (one task of hvdrun's job step in the Slurm allocation, no SSH)"
    if is_local_host(hostname):
        return "this machine (agent as a local process)"
    from launcher.transport.ssh_config import SSHConnectError, resolve_target

    try:
        target = resolve_target(hostname, launch.ssh)
    except SSHConnectError as exc:
        return f"ssh: {exc}"
    if target.hostname != hostname.rpartition("@")[2] and is_local_host(target.hostname):
        return f"this machine (ssh config HostName {target.hostname})"
    parts = [f"ssh {target.user}@{target.hostname}:{target.port}"]
    if target.identity_files:
        parts.append("key " + ", ".join(target.identity_files))
    if not target.identities_only:  # the keys OpenSSH (and hvdrun) also offer
        parts.append(
            "ssh-agent keys" if target.identity_files else "ssh-agent and ~/.ssh/id_* keys"
        )
    if target.proxy_jump:
        parts.append(f"via ProxyJump {target.proxy_jump}")
    if target.proxy_command:
        parts.append(f"via ProxyCommand {target.shown_proxy_command!r}")
    parts.append(f"host keys {target.host_key_policy}")
    return ", ".join(part for part in parts if part)


def _default(name: str) -> str:
    value = we.NUMBERS[name].default
    return str(int(value)) if value == int(value) else f"{value:g}"


#: (setting, label, default, unit): what the workers' runtime reads.
TUNING: tuple[tuple[str, str, str, str], ...] = (
    (we.FUSION_THRESHOLD, "fusion threshold", _default(we.FUSION_THRESHOLD), "bytes"),
    (we.CYCLE_TIME, "cycle time", _default(we.CYCLE_TIME), "ms"),
    (we.CACHE_CAPACITY, "response cache", _default(we.CACHE_CAPACITY), "ops"),
    (we.CUDA_BACKEND, "CUDA tensors through", "nccl where there are GPUs", ""),
    (we.TIMELINE, "timeline", "off", ""),
    (we.TIMELINE_MARK_CYCLES, "timeline marks cycles", "0", ""),
    (we.TIMELINE_ALL_RANKS, "timeline of every rank", "0", ""),
    (we.STALL_CHECK_DISABLE, "stall check disabled", "0", ""),
    (
        we.STALL_CHECK_TIME_SECONDS,
        "stall warning after",
        _default(we.STALL_CHECK_TIME_SECONDS),
        "s",
    ),
    (
        we.STALL_SHUTDOWN_TIME_SECONDS,
        "stall shutdown after",
        _default(we.STALL_SHUTDOWN_TIME_SECONDS),
        "s",
    ),
    (we.GLOO_TIMEOUT_SECONDS, "collective timeout", _default(we.GLOO_TIMEOUT_SECONDS), "s"),
    (we.AUTOTUNE, "autotune", "0", ""),
)
#: What 0 means for the settings where it turns something off.
_ZERO_MEANS = {
    we.STALL_CHECK_TIME_SECONDS: "no warnings",
    we.STALL_SHUTDOWN_TIME_SECONDS: "never",
    we.CACHE_CAPACITY: "no cache",
}
#: The autotuner's settings, shown when it is on.
AUTOTUNE: tuple[tuple[str, str, str, str], ...] = (
    (we.AUTOTUNE_LOG, "autotune log", "none", ""),
    (
        we.AUTOTUNE_WARMUP_SAMPLES,
        "autotune warm-up",
        _default(we.AUTOTUNE_WARMUP_SAMPLES),
        "samples",
    ),
    (
        we.AUTOTUNE_STEPS_PER_SAMPLE,
        "autotune sample",
        _default(we.AUTOTUNE_STEPS_PER_SAMPLE),
        "steps",
    ),
    (
        we.AUTOTUNE_BAYES_OPT_MAX_SAMPLES,
        "autotune samples",
        _default(we.AUTOTUNE_BAYES_OPT_MAX_SAMPLES),
        "",
    ),
    (
        we.AUTOTUNE_GAUSSIAN_PROCESS_NOISE,
        "autotune noise",
        _default(we.AUTOTUNE_GAUSSIAN_PROCESS_NOISE),
        "",
    ),
)


def tuning_lines(
    env: Mapping[str, str], elastic: bool, origins: Mapping[str, str] | None = None
) -> list[str]:
    """The tuning the workers run with, each value with where it came from: ``origins``
    (variable -> the flag or config key that wrote it), else the variable itself."""
    origins = origins or {}
    lines = []
    rows = TUNING + AUTOTUNE if we.flag(we.AUTOTUNE, env) else TUNING
    for name, label, default, unit in rows:
        found = we.spelled(name, env)
        if found is not None:
            spelling, value = found
            source = f"from {origins.get(spelling, spelling)}"
        else:
            value = "5" if elastic and name == we.GLOO_TIMEOUT_SECONDS else default
            source = "elastic default" if elastic and name == we.GLOO_TIMEOUT_SECONDS else "default"
        shown = f"{value} {unit}" if unit and value != "off" else value
        if name == we.FUSION_THRESHOLD and value.isdigit():
            shown += f" ({int(value) / 2**20:g} MiB)"
            if found is None:  # (a threshold that was set is CUDA's too)
                shown += f", {we.CUDA_FUSION_THRESHOLD_DEFAULT / 2**20:g} MiB for CUDA reductions"
        if name in _ZERO_MEANS and value in ("0", "0.0"):
            shown += f" ({_ZERO_MEANS[name]})"
        lines.append(f"  {label:<24}{shown}  ({source})")
    return lines


def omp_threads(hostname: str, local_workers: int, env: Mapping[str, str]) -> str:
    if env.get("OMP_NUM_THREADS"):
        return env["OMP_NUM_THREADS"]
    if is_local_host(hostname):
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        cores = cores or os.cpu_count() or 1
        return f"{max(1, cores // local_workers)} ({cores} cores / {local_workers} workers)"
    return f"the host's cores / {local_workers} workers"


def print_plan(spec: JobSpec, echo: Echo, origins: Mapping[str, str] | None = None) -> None:
    """Prints the plan of ``spec``; starts nothing and connects to nothing. ``origins``:
    where hvdrun's flags' worker variables came from (the flag, the config file)."""
    elastic = spec.elastic
    discovered = sum(h.slots for h in spec.hosts)
    if elastic is not None:
        from launcher.supervision.membership import first_generation

        slots = first_generation(elastic, spec.num_proc, spec.hosts)
    else:
        slots = assign_slots([(h.hostname, h.slots) for h in spec.hosts], spec.num_proc)
    planned = len(slots)
    hosts = list(dict.fromkeys(slot.hostname for slot in slots))
    echo(f"hvdrun dry run: {planned} worker(s) on {len(hosts)} host(s); nothing was started")
    echo(f"command: {shlex.join(spec.command)}")
    echo(f"working directory: {spec.cwd}")
    launch = spec.launch
    echo(
        f"start timeout: {launch.start_timeout:g} s; agent timeout: {launch.agent_timeout:g} s; "
        f"heartbeat timeout: {launch.lost_timeout:g} s; "
        f"rendezvous: {launch.rendezvous_addr or 'on this machine, port chosen at start'}"
    )
    if elastic is not None:
        max_np = elastic.max_np if elastic.max_np is not None else "every discovered slot"
        echo(
            f"elastic: min-np {elastic.min_np}, max-np {max_np}, elastic timeout "
            f"{elastic.elastic_timeout:g} s; the plan of the first discovery "
            f"({', '.join(f'{h.hostname}:{h.slots}' for h in spec.hosts)})"
        )
        if discovered < elastic.min_np:
            echo(
                f"elastic: the first discovery offers {discovered} slot(s), fewer than "
                f"min-np {elastic.min_np}: the job waits up to the elastic timeout for more"
            )
        elif planned < spec.num_proc:
            echo(
                f"elastic: the first discovery offers {discovered} slot(s), fewer than -np "
                f"{spec.num_proc} but at least min-np {elastic.min_np}: the job starts with "
                f"{planned} worker(s)"
            )
        elif planned > spec.num_proc:
            echo(
                f"elastic: the job starts on every slot the first discovery offers, up to "
                f"max-np, as Horovod does: {planned} worker(s), more than -np {spec.num_proc}"
            )
    echo("")
    echo("hosts:")
    width = max((len(host) for host in hosts), default=0)
    for host in hosts:
        count = sum(1 for slot in slots if slot.hostname == host)
        echo(f"  {host:<{width}}  {count} worker(s)  {describe_reach(host, spec.launch)}")
    echo("")
    echo(_rank_table(slots))
    echo("")
    echo("every worker's environment (secrets masked; rank variables as in the table):")
    for line in env_lines(spec, slots):
        echo(line)
    echo("")
    echo("tuning the workers run with:")
    for line in tuning_lines(spec.env, elastic is not None, origins):
        echo(line)


def _rank_table(slots: list[SlotInfo]) -> str:
    header = ("rank", "host", "local_rank", "local_size", "cross_rank", "cross_size")
    rows = [header] + [
        (
            str(s.rank),
            s.hostname,
            str(s.local_rank),
            str(s.local_size),
            str(s.cross_rank),
            str(s.cross_size),
        )
        for s in slots
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        "  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows
    ]
    return "ranks:\n" + "\n".join(line.rstrip() for line in lines)


def _one_line(value: str) -> str:
    """A value as one line of the plan: one with line breaks is shown escaped (``\\n``,
    and ``\\\\`` for a backslash); any other as it is."""
    if "\n" not in value and "\r" not in value:
        return value
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")


def env_lines(spec: JobSpec, slots: list[SlotInfo]) -> list[str]:
    env = dict(spec.env)
    env["PYTHONUNBUFFERED"] = "1"
    for name in we.LAUNCHER_SET:  # (hvdrun's own, below, replace these)
        env.pop(name, None)
    elastic = spec.elastic
    per_rank = list(we.slot_env(slots[0]).keys() if slots else ())
    if elastic is not None:
        env.update(we.elastic_env(spec.env, elastic.elastic_timeout, elastic.failure_timeout))
        per_rank += [we.GENERATION, we.WORKER]
    lines = [f"  {name}={_one_line(masked(name, value))}" for name, value in sorted(env.items())]
    lines += [
        f"  {we.RENDEZVOUS_ADDR}=<this machine's address and port, chosen at start>",
        f"  {we.JOB_ID}=<chosen at start>",
        f"  {we.SECRET}={MASK} (made at start)",
        "  set per rank: " + ", ".join(per_rank),
    ]
    if "OMP_NUM_THREADS" not in env:
        per_host: dict[str, int] = {}
        for slot in slots:
            per_host[slot.hostname] = per_host.get(slot.hostname, 0) + 1
        shown = "; ".join(
            f"{host}: {omp_threads(host, count, env)}" for host, count in per_host.items()
        )
        lines.append(f"  OMP_NUM_THREADS=<each host's cores / its workers> ({shown})")
    if not any(name in env for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")):
        lines.append(
            "  GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME=<set by each host's agent: the interface "
            "facing the rendezvous>"
        )
    return lines
