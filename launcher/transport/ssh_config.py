"""Turning a host of ``-H`` into SSH settings, the way OpenSSH would.

``~/.ssh/config`` and then ``/etc/ssh/ssh_config`` are read, as ``ssh`` reads them (the first
value obtained for a setting wins; ``--ssh-config-file`` replaces both, like ``ssh -F``).
``Include`` lines are expanded first (relative paths from ``~/.ssh`` in the user's file and
from ``/etc/ssh`` in the system's, globs allowed, also inside ``Host`` blocks), since
paramiko's parser, which reads the result, knows no ``Include``. Honoured: HostName, User,
Port, IdentityFile, IdentitiesOnly, ProxyCommand, ProxyJump, UserKnownHostsFile,
HostKeyAlias and StrictHostKeyChecking; ``user@host``, ``-p`` and ``-i`` take precedence, as
they do for ``ssh``.
"""

from __future__ import annotations

import dataclasses
import getpass
import glob
import io
import logging
import os
import re
import threading
from dataclasses import dataclass
from typing import Any

import paramiko

from launcher.errors import LauncherError
from launcher.spec.options import SSHOptions

DEFAULT_CONFIG = "~/.ssh/config"
SYSTEM_CONFIG = "/etc/ssh/ssh_config"
MAX_INCLUDE_DEPTH = 16  # OpenSSH's limit
log = logging.getLogger(__name__)
DEFAULT_KNOWN_HOSTS = "~/.ssh/known_hosts"
DEFAULT_GLOBAL_KNOWN_HOSTS = "/etc/ssh/ssh_known_hosts"

_STRICT_FROM_CONFIG = {
    "yes": "strict",
    "ask": "strict",
    "accept-new": "accept-new",
    "no": "off",
    "off": "off",
}


class SSHConnectError(LauncherError):
    """A host hvdrun could not log in to; the message says why, for the user."""


#: An option of a command whose value is a secret: ``--token X``, ``-p=X``, ``--api-key X``.
_SECRET_OPTION = re.compile(
    r"(--?[\w-]*(?:secret|token|password|passwd|pass|key|auth)[\w-]*(?:=|\s+))(?!-)\S+",
    re.IGNORECASE,
)


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
    proxy_jump: str | None = None  # ProxyJump: [user@]host[:port][,...], hops in order
    config_file: str | None = None  # --ssh-config-file, for the ProxyJump hosts' settings
    #: GlobalKnownHostsFile: read, never written (OpenSSH's default first)
    global_known_hosts_files: tuple[str, ...] = (DEFAULT_GLOBAL_KNOWN_HOSTS,)

    @property
    def shown_proxy_command(self) -> str | None:
        """The ProxyCommand as logs and plans show it: the value of an option whose name
        says it is a secret (``--service-token-secret X``, ``--password=X``) masked."""
        if self.proxy_command is None:
            return None
        return _SECRET_OPTION.sub(r"\1****", self.proxy_command)

    @property
    def key_name(self) -> str:
        """The name its host key is filed under in known_hosts (OpenSSH's format)."""
        name = self.host_key_alias or self.hostname
        return name if self.port == 22 else f"[{name}]:{self.port}"


_config_lock = threading.Lock()
_config_cache: dict[str, paramiko.SSHConfig | None] = {}


_INCLUDE = re.compile(r"^\s*include(?:\s*=\s*|\s+)(.+?)\s*$", re.IGNORECASE)
_BLOCK = re.compile(r"^\s*(host|match)(?:\s*=\s*|\s+)", re.IGNORECASE)


def expand_includes(path: str, base: str, depth: int = 0) -> str:
    """The text of ssh config ``path`` with every ``Include`` replaced by the files it names.

    After an included file the block that held the ``Include`` is opened again (``Host *``
    at top level), so that the included file's own ``Host`` lines end nothing of the file
    that includes it, as in OpenSSH.
    """
    if depth > MAX_INCLUDE_DEPTH:
        raise SSHConnectError(
            f"ssh config {path}: Include nested more than {MAX_INCLUDE_DEPTH} deep"
        )
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise SSHConnectError(f"cannot read ssh config {path}: {exc}") from None
    out: list[str] = []
    block = "Host *"
    for line in lines:
        match = _INCLUDE.match(line)
        if match is None:
            if _BLOCK.match(line):
                block = line.strip()
            out.append(line)
            continue
        for pattern in match.group(1).split():
            pattern = os.path.expanduser(pattern)
            if not os.path.isabs(pattern):
                pattern = os.path.join(base, pattern)
            for included in sorted(glob.glob(pattern)):
                if os.path.isfile(included):
                    out.append(expand_includes(included, base, depth + 1))
                    out.append(block)
    return "\n".join(out) + "\n"


def load_config(path: str | None) -> paramiko.SSHConfig | None:
    """The parsed ssh config (None if there is none); a broken file is a user error.

    Without ``path``: ``~/.ssh/config`` followed by ``/etc/ssh/ssh_config``, as ssh reads
    them; with it, that file alone (``ssh -F``).
    """
    expanded = os.path.expanduser(path or DEFAULT_CONFIG)
    key = expanded if path is not None else f"{expanded}\0{SYSTEM_CONFIG}"
    with _config_lock:
        if key not in _config_cache:
            if path is not None and not os.path.exists(expanded):
                raise SSHConnectError(f"ssh config file {path} does not exist")
            user = ""
            if os.path.exists(expanded):
                user = expand_includes(expanded, os.path.expanduser("~/.ssh"))
            system = _system_config() if path is None else ""
            if not user and not system:
                _config_cache[key] = None
                return None
            try:
                _config_cache[key] = _parse(user + system)
            except Exception as exc:
                if not system:
                    raise SSHConnectError(f"cannot read ssh config {expanded}: {exc}") from None
                # The system's file is not the user's to fix: go on without it.
                log.warning("ignoring %s, which paramiko cannot read: %s", SYSTEM_CONFIG, exc)
                try:
                    _config_cache[key] = _parse(user)
                except Exception as exc:
                    raise SSHConnectError(f"cannot read ssh config {expanded}: {exc}") from None
        return _config_cache[key]


def _system_config() -> str:
    """/etc/ssh/ssh_config with its Includes, as a ``Host *`` block after the user's file."""
    if not os.path.exists(SYSTEM_CONFIG):
        return ""
    try:
        return "Host *\n" + expand_includes(SYSTEM_CONFIG, os.path.dirname(SYSTEM_CONFIG))
    except SSHConnectError as exc:
        log.warning("ignoring %s: %s", SYSTEM_CONFIG, exc)
        return ""


def _parse(text: str) -> paramiko.SSHConfig:
    config = paramiko.SSHConfig()
    config.parse(io.StringIO(text))
    return config


def resolve_target(alias: str, options: SSHOptions) -> SSHTarget:
    """Applies the ssh config and the flags to one ``[user@]host`` from the host list."""
    user, _, name = alias.rpartition("@")
    config = load_config(options.config_file)
    try:  # (paramiko asks for the local user name to expand %u and match Match blocks)
        entry: dict[str, Any] = dict(config.lookup(name)) if config is not None else {}
        user = user or str(entry.get("user") or getpass.getuser())
    except (KeyError, OSError) as exc:  # getpass: a uid with no passwd entry, no USER
        raise SSHConnectError(
            f"cannot read the ssh config for {name}: this process's user id {os.getuid()} "
            f"has no user name ({exc}) and USER is not set (a container's user, say): "
            "export USER=<a name>, and give the remote user as user@host or User in the "
            "ssh config where it differs"
        ) from None
    port = options.port or int(entry.get("port", 22))
    identity_files = [os.path.expanduser(path) for path in options.identity_files]
    identity_files += [os.path.expanduser(path) for path in entry.get("identityfile", [])]
    known_hosts = [
        os.path.expanduser(path)
        for path in str(entry.get("userknownhostsfile", DEFAULT_KNOWN_HOSTS)).split()
    ]
    global_known = [
        os.path.expanduser(path)
        for path in str(entry.get("globalknownhostsfile", DEFAULT_GLOBAL_KNOWN_HOSTS)).split()
    ]
    policy = options.host_key_policy
    if policy is None:
        policy = _STRICT_FROM_CONFIG.get(
            str(entry.get("stricthostkeychecking", "")).lower(), "accept-new"
        )
    proxy = entry.get("proxycommand")
    jump = entry.get("proxyjump")
    return SSHTarget(
        alias=alias,
        hostname=str(entry.get("hostname", name)),
        port=port,
        user=user,
        identity_files=tuple(dict.fromkeys(identity_files)),
        identities_only=str(entry.get("identitiesonly", "no")).lower() == "yes",
        proxy_command=None if proxy in (None, "none") else str(proxy),
        known_hosts_files=tuple(path for path in known_hosts if path not in ("none",)),
        host_key_alias=entry.get("hostkeyalias"),
        host_key_policy=policy,
        proxy_jump=None if jump in (None, "none") else str(jump),
        config_file=options.config_file,
        global_known_hosts_files=tuple(path for path in global_known if path != "none"),
    )


def split_jump(hop: str) -> tuple[str, int | None]:
    """One ProxyJump hop, ``[user@]host[:port]`` (``ssh://`` too), as (alias, port)."""
    hop = hop.strip().removeprefix("ssh://")
    user, at, rest = hop.rpartition("@")
    port: int | None = None
    if rest.startswith("["):  # [IPv6]:port
        host, _, tail = rest[1:].partition("]")
        if tail.startswith(":") and tail[1:].isdigit():
            port = int(tail[1:])
    else:
        host, colon, port_text = rest.partition(":")
        if colon and port_text.isdigit():
            port = int(port_text)
        elif colon:
            host = rest
    if not host:
        raise SSHConnectError(f"ProxyJump hop '{hop}' names no host")
    return f"{user}{at}{host}", port


def jump_target(hops: str, options: SSHOptions) -> SSHTarget:
    """The last hop of a ProxyJump list as a target of its own; the hops before it become
    its ProxyJump. -p and -i are not applied to jump hosts (as with ssh)."""
    *earlier, last = [hop for hop in hops.split(",") if hop.strip()]
    alias, port = split_jump(last)
    own = SSHOptions(config_file=options.config_file, host_key_policy=options.host_key_policy)
    target = resolve_target(alias, own)
    changes: dict[str, Any] = {}
    if port is not None:
        changes["port"] = port
    if earlier:
        changes["proxy_jump"] = ",".join(earlier)
        changes["proxy_command"] = None
    return dataclasses.replace(target, **changes) if changes else target
