"""How hvdrun reaches the hosts: plain settings, filled in by the CLI (see ``hvdrun --help``).

Kept free of paramiko and grpc so that the CLI can build them without paying for imports
it may not need.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

HOST_KEY_POLICIES = ("strict", "accept-new", "off")


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
    rendezvous_addr: str | None = None  # ADDR[:PORT] every host reaches this machine at
    check_versions: bool = True
    python: str = field(default_factory=lambda: sys.executable)
