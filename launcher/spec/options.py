"""How hvdrun reaches the hosts, and how far an elastic job may grow and shrink: plain
frozen settings, filled in by the CLI (see ``hvdrun --help``) and only read by the launcher.

Kept free of paramiko and grpc so that the CLI can build them without paying for imports
it may not need.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

HOST_KEY_POLICIES = ("strict", "accept-new", "off")
#: ``--launcher``: how agents start. auto: srun inside a Slurm allocation whose nodes are the
#: hosts, else SSH for remote hosts; local hosts always get a subprocess except under srun.
LAUNCHERS = ("auto", "ssh", "slurm", "local")


@dataclass(frozen=True)
class SSHOptions:
    """What the command line says about SSH; None leaves it to the ssh config file."""

    port: int | None = None
    identity_files: tuple[str, ...] = ()
    config_file: str | None = None
    host_key_policy: str | None = None


@dataclass(frozen=True)
class LaunchOptions:
    ssh: SSHOptions = field(default_factory=SSHOptions)
    start_timeout: float = 30.0  # connecting to every host and starting its agent
    agent_timeout: float = 30.0  # silence after which a remote host counts as cut off
    #: hvdrun's silence after which its agents and workers give the job up (a stopped or
    #: overloaded hvdrun; a closed connection counts at once): --heartbeat-timeout.
    lost_timeout: float = 30.0
    rendezvous_addr: str | None = None  # ADDR[:PORT] every host reaches this machine at
    check_versions: bool = True
    log_level: str = ""  # the agents' logging level (--verbose/--log-level); "" quiet
    python: str = field(default_factory=lambda: sys.executable)
    #: "slurm": every agent is a task of one srun step; otherwise local or SSH per host.
    launcher: str = "ssh"


#: Elastic jobs: how long a silent peer or host may stay silent before it counts as failed
#: (the workers' Gloo timeout and the agents' heartbeat timeout, unless set explicitly).
ELASTIC_FAILURE_TIMEOUT = 5.0


@dataclass(frozen=True)
class ElasticOptions:
    """``--min-np``/``--max-np``/``--host-discovery-script``...: see the elastic driver."""

    min_np: int
    max_np: int | None  # None: as many as discovery offers
    discovery: Any  # a launcher.supervision.discovery.HostDiscovery
    elastic_timeout: float = 600.0
    reset_limit: int | None = None
    cooldown: tuple[float, float] | None = None
    discovery_interval: float = 1.0
    failure_timeout: float = ELASTIC_FAILURE_TIMEOUT


@dataclass(frozen=True)
class ReportOptions:
    """``--no-report`` (``table`` False) and ``--report-file``."""

    table: bool = True
    file: str | None = None

    @property
    def details(self) -> str:
        """Where the live warning says the details are ("": nowhere)."""
        if self.table:
            return "the end-of-job table has the details"
        return f"{self.file} will have the details" if self.file else ""
