"""Turning a host of ``-H`` into SSH settings, the way OpenSSH would.

``~/.ssh/config`` (or ``--ssh-config-file``) is read with paramiko's parser and honoured for
HostName, User, Port, IdentityFile, IdentitiesOnly, ProxyCommand, UserKnownHostsFile,
HostKeyAlias and StrictHostKeyChecking; ``user@host``, ``-p`` and ``-i`` take precedence, as
they do for ``ssh``.
"""

from __future__ import annotations

import getpass
import os
import threading
from dataclasses import dataclass
from typing import Any

import paramiko

from launcher.errors import LauncherError
from launcher.spec.options import SSHOptions

DEFAULT_CONFIG = "~/.ssh/config"
DEFAULT_KNOWN_HOSTS = "~/.ssh/known_hosts"

_STRICT_FROM_CONFIG = {
    "yes": "strict",
    "ask": "strict",
    "accept-new": "accept-new",
    "no": "off",
    "off": "off",
}


class SSHConnectError(LauncherError):
    """A host hvdrun could not log in to; the message says why, for the user."""


@dataclass(frozen=True)
class SSHTarget:
    """One host's connection settings after the config file and the flags are applied."""

    alias: str
    hostname: str
    port: int
    user: str
    identity_files: tuple[str, ...]
    identities_only: bool
    proxy_command: str | None
    known_hosts_files: tuple[str, ...]
    host_key_alias: str | None
    host_key_policy: str

    @property
    def key_name(self) -> str:
        """The name its host key is filed under in known_hosts (OpenSSH's format)."""
        name = self.host_key_alias or self.hostname
        return name if self.port == 22 else f"[{name}]:{self.port}"


_config_lock = threading.Lock()
_config_cache: dict[str, paramiko.SSHConfig | None] = {}


def load_config(path: str | None) -> paramiko.SSHConfig | None:
    """The parsed ssh config (None if there is none); a broken file is a user error."""
    expanded = os.path.expanduser(path or DEFAULT_CONFIG)
    with _config_lock:
        if expanded not in _config_cache:
            if not os.path.exists(expanded):
                if path is not None:
                    raise SSHConnectError(f"ssh config file {path} does not exist")
                _config_cache[expanded] = None
            else:
                try:
                    _config_cache[expanded] = paramiko.SSHConfig.from_path(expanded)
                except Exception as exc:
                    raise SSHConnectError(f"cannot read ssh config {expanded}: {exc}") from None
        return _config_cache[expanded]


def resolve_target(alias: str, options: SSHOptions) -> SSHTarget:
    """Applies the ssh config and the flags to one ``[user@]host`` from the host list."""
    user, _, name = alias.rpartition("@")
    config = load_config(options.config_file)
    entry: dict[str, Any] = dict(config.lookup(name)) if config is not None else {}
    port = options.port or int(entry.get("port", 22))
    identity_files = [os.path.expanduser(path) for path in options.identity_files]
    identity_files += [os.path.expanduser(path) for path in entry.get("identityfile", [])]
    known_hosts = [
        os.path.expanduser(path)
        for path in str(entry.get("userknownhostsfile", DEFAULT_KNOWN_HOSTS)).split()
    ]
    policy = options.host_key_policy
    if policy is None:
        policy = _STRICT_FROM_CONFIG.get(
            str(entry.get("stricthostkeychecking", "")).lower(), "accept-new"
        )
    proxy = entry.get("proxycommand")
    return SSHTarget(
        alias=alias,
        hostname=str(entry.get("hostname", name)),
        port=port,
        user=user or str(entry.get("user") or getpass.getuser()),
        identity_files=tuple(dict.fromkeys(identity_files)),
        identities_only=str(entry.get("identitiesonly", "no")).lower() == "yes",
        proxy_command=None if proxy in (None, "none") else str(proxy),
        known_hosts_files=tuple(path for path in known_hosts if path not in ("none",)),
        host_key_alias=entry.get("hostkeyalias"),
        host_key_policy=policy,
    )
