"""Every user-facing launcher error shares one base, and keeps its other bases."""

from __future__ import annotations

import pytest

from launcher.errors import LauncherError
from launcher.spec.environment import EnvSpecError
from launcher.spec.hosts import HostSpecError
from launcher.supervision.discovery import DiscoveryError
from launcher.transport.connection import AgentStartError
from launcher.transport.ssh_config import SSHConnectError
from launcher.transport.startup import LaunchError, LaunchInterrupted


@pytest.mark.parametrize(
    "error",
    [
        AgentStartError("no Python there"),
        DiscoveryError("exited with code 1"),
        EnvSpecError("'1X' is not VAR or VAR=VALUE"),
        HostSpecError("the host list is empty"),
        SSHConnectError("connection refused"),
        LaunchError({"a": "connection refused"}, 1),
        LaunchInterrupted(2),
    ],
)
def test_every_launcher_error_is_a_launcher_error(error: Exception) -> None:
    assert isinstance(error, LauncherError)


def test_input_errors_stay_value_errors() -> None:
    assert issubclass(HostSpecError, ValueError)
    assert issubclass(EnvSpecError, ValueError)
