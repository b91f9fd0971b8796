"""SSH connections to remote hosts with paramiko, the way OpenSSH users expect.

Settings come from :mod:`launcher.transport.ssh_config`. Keys are tried in OpenSSH's order: ``-i``,
IdentityFile, the ssh-agent, and (without IdentityFile) ``~/.ssh/id_*``; passwords never.

Host keys (``--ssh-host-key-policy``):

* ``strict``: only hosts already in known_hosts are accepted.
* ``accept-new`` (default): an unseen host is trusted once and its key appended to the user's
  known_hosts; a host whose key *changed* is refused.
* ``off``: no checking and nothing recorded (throw-away test clusters only).

Every failure becomes an :class:`SSHConnectError` whose message says what failed in words a
user can act on: DNS, refused, timeout, no route, authentication, host key.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import select
import shlex
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Any, cast

import paramiko

from launcher.spec.options import SSHOptions
from launcher.transport.ssh_config import SSHConnectError, SSHTarget, jump_target

# paramiko logs the errors it raises; hvdrun reports them itself, once, in its own words.
logging.getLogger("paramiko").addHandler(logging.NullHandler())
logging.getLogger("paramiko").propagate = False
log = logging.getLogger(__name__)

KEEPALIVE_SECONDS = 10
MAX_JUMPS = 8  # a ProxyJump chain longer than this is a loop in the ssh config


class UnknownHostKeyError(paramiko.SSHException):
    def __init__(self, name: str, key: paramiko.PKey) -> None:
        super().__init__(f"unknown host key for {name}")
        self.name = name
        self.key = key


def fingerprint(key: paramiko.PKey) -> str:
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


_known_hosts_lock = threading.Lock()


def load_known_hosts(host_keys: paramiko.HostKeys, path: str) -> set[bytes]:
    """Adds a known_hosts file's keys to ``host_keys`` line by line, as OpenSSH reads it: a
    line paramiko cannot parse is skipped (paramiko's own loader stops the whole file at
    it), ``@cert-authority`` lines are skipped (no certificates here), and the keys of
    ``@revoked`` lines are returned, to be refused."""
    revoked: set[bytes] = set()
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return revoked
    for line in lines:
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        marker = ""
        if text.startswith("@"):
            marker, _, text = text.partition(" ")
            if marker != "@revoked":
                continue  # @cert-authority
        try:
            entry = paramiko.hostkeys.HostKeyEntry.from_line(text)
        except Exception:  # (paramiko raises plain exceptions for bad base64)
            entry = None
        if entry is None:
            log.debug("%s: skipping a known_hosts line paramiko cannot read", path)
            continue
        if marker:
            revoked.add(entry.key.asbytes())
            continue
        for name in entry.hostnames:
            host_keys.add(name, entry.key.get_name(), entry.key)
    return revoked


def append_whole_line(fd: int, line: bytes) -> None:
    """Appends ``line`` to the file open (to read, and to append) at ``fd``, whole or not
    at all: a full disk cut it short, and the next host's line then ran on from the fragment
    (``10.0.0.10.0.0.12 ssh-ed25519 ...``). A file that does not end with a newline gets
    one first."""
    size = os.lseek(fd, 0, os.SEEK_END)
    if size and os.pread(fd, 1, size - 1) != b"\n":
        line = b"\n" + line
    try:
        written = 0
        while written < len(line):
            written += os.write(fd, line[written:])
    except OSError:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, size)
        raise


class _RecordNewKey(paramiko.MissingHostKeyPolicy):
    """accept-new: trust an unseen host once and append its key to known_hosts."""

    def __init__(self, path: str | None) -> None:
        self.path = path

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: Any) -> None:
        client.get_host_keys().add(hostname, key.get_name(), key)
        if self.path is None or self.path == os.devnull:
            return
        line = f"{hostname} {key.get_name()} {key.get_base64()}\n"
        directory = os.path.dirname(self.path)
        try:
            with _known_hosts_lock:
                if directory and not os.path.isdir(directory):
                    os.makedirs(directory, mode=0o700, exist_ok=True)
                with open(self.path, "a+b", buffering=0) as handle:
                    fcntl.flock(handle, fcntl.LOCK_EX)  # other hvdrun processes may append
                    append_whole_line(handle.fileno(), line.encode())
        except OSError as error:  # (a read-only home: trusted for this job, as ssh does)
            log.warning(
                "could not add the host key of %s to %s (%s); trusting it for this job",
                hostname,
                self.path,
                error.strerror or error,
            )


class _RejectUnknown(paramiko.MissingHostKeyPolicy):
    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: Any) -> None:
        raise UnknownHostKeyError(hostname, key)


class _AcceptAny(paramiko.MissingHostKeyPolicy):
    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: Any) -> None:
        return None


@dataclass
class SSHSession:
    client: paramiko.SSHClient
    # This machine's address on the connection's socket: remote hosts can route to it.
    # None when the connection runs through a ProxyCommand or a ProxyJump host.
    local_address: str | None


class SSHConnector:
    """Opens one connection; ``stage`` says what it is doing, ``abort()`` gives up on it."""

    def __init__(self, target: SSHTarget, depth: int = 0) -> None:
        self.target = target
        self.stage = "resolving the host name"
        self._sock: Any = None
        self._client: paramiko.SSHClient | None = None
        self._address = f"{target.hostname} port {target.port}"
        self._aborted = False
        # Jump hosts are looked up in the same config, under the same host key policy.
        self._options = SSHOptions(
            config_file=target.config_file, host_key_policy=target.host_key_policy
        )
        self._depth = depth
        self._jump: SSHConnector | None = None  # the ProxyJump host's connection
        self._revoked: set[bytes] = set()  # host keys known_hosts marks @revoked

    def abort(self) -> None:
        self._aborted = True
        if self._jump is not None:
            self._jump.abort()
        with contextlib.suppress(Exception):
            if self._client is not None:
                self._client.close()
        with contextlib.suppress(Exception):
            if self._sock is not None:
                self._sock.close()

    def connect(self, deadline: float) -> SSHSession:
        target = self.target
        local_address: str | None = None
        via = (
            f" via ProxyJump {target.proxy_jump}"
            if target.proxy_jump
            else f" via ProxyCommand {target.shown_proxy_command!r}"
            if target.proxy_command
            else ""
        )
        log.debug(
            "%s: connecting to %s@%s port %d%s",
            target.alias,
            target.user,
            target.hostname,
            target.port,
            via,
        )
        if target.proxy_jump:
            self._sock = self._open_jump_channel(target.proxy_jump, deadline)
        elif target.proxy_command:
            self.stage = "starting its ProxyCommand"
            try:
                self._sock = _ProxyCommand(target.proxy_command)
            except Exception as exc:
                raise SSHConnectError(f"ProxyCommand failed: {exc}") from None
        else:
            self._sock = self._open_socket(deadline)
            local_address = str(self._sock.getsockname()[0]).split("%", 1)[0]
        self.stage = "in the SSH handshake"
        client = self._client = paramiko.SSHClient()
        self._load_host_keys(client)
        remaining = max(deadline - time.monotonic(), 0.1)
        keys = [path for path in target.identity_files if os.path.exists(path)]
        look_for_keys = not target.identity_files and not target.identities_only
        allow_agent = not target.identities_only
        try:
            client.connect(
                hostname=target.host_key_alias or target.hostname,
                port=target.port,
                username=target.user,
                key_filename=keys or None,  # type: ignore[arg-type]  # a list works too
                allow_agent=allow_agent,
                look_for_keys=look_for_keys,
                sock=self._sock,
                timeout=remaining,
                banner_timeout=remaining,
                auth_timeout=remaining,
                channel_timeout=remaining,
            )
        except paramiko.BadHostKeyException as exc:
            self.abort()
            raise SSHConnectError(self._changed_key_message(exc)) from None
        except UnknownHostKeyError as exc:
            self.abort()
            raise SSHConnectError(
                f"host key of {exc.name} is not in known_hosts "
                f"({', '.join(target.known_hosts_files) or 'none'}) and the host key policy "
                f"is strict: check its fingerprint {fingerprint(exc.key)} and add it "
                f"(ssh-keyscan), or use --ssh-host-key-policy accept-new"
            ) from None
        except paramiko.AuthenticationException as exc:
            self.abort()
            message = self._auth_message(exc, keys, allow_agent, look_for_keys)
            raise SSHConnectError(message) from None
        except Exception as exc:
            proxy_failure = self._proxy_failure()
            transport = client.get_transport()
            # paramiko tries a key file as each kind of key in turn and raises the last kind's
            # parse error ("encountered RSA key, expected OPENSSH key") where the server
            # refused the key: past the key exchange (a session id), unauthenticated, it is
            # the login that failed.
            refused = (
                transport is not None
                and transport.session_id is not None
                and transport.is_active()
                and not transport.is_authenticated()
            )
            self.abort()
            if proxy_failure:
                raise SSHConnectError(proxy_failure) from None
            if refused or str(exc).startswith("No authentication methods available"):
                message = self._auth_message(exc, keys, allow_agent, look_for_keys)
                raise SSHConnectError(message) from None
            if time.monotonic() >= deadline - 0.2:  # paramiko's own timeouts fired
                raise SSHConnectError(
                    f"the SSH handshake with {self._address} did not finish in time "
                    f"(is an SSH server listening there?)"
                ) from None
            raise SSHConnectError(self._handshake_message(exc)) from None
        transport = client.get_transport()
        if transport is not None:
            key = transport.get_remote_server_key()
            if key.asbytes() in self._revoked:
                self.abort()
                raise SSHConnectError(
                    f"the host key of {target.key_name} ({fingerprint(key)}) is marked "
                    "@revoked in known_hosts"
                )
            transport.set_keepalive(KEEPALIVE_SECONDS)
        log.debug("%s: logged in as %s", target.alias, target.user)
        return SSHSession(client, local_address)

    def _open_jump_channel(self, hops: str, deadline: float) -> paramiko.Channel:
        """ProxyJump: log in to the jump host, then have it open a TCP channel to the target
        (``direct-tcpip``, what ``ssh -J`` does); the SSH session runs over that channel."""
        if self._depth >= MAX_JUMPS:
            raise SSHConnectError(
                f"more than {MAX_JUMPS} ProxyJump hops: a loop in the ssh config?"
            )
        last = hops.split(",")[-1].strip()
        self.stage = f"connecting to its ProxyJump host {last}"
        jump = jump_target(hops, self._options)
        self._jump = SSHConnector(jump, self._depth + 1)
        if self._aborted:
            raise SSHConnectError("aborted")
        try:
            session = self._jump.connect(deadline)
        except SSHConnectError as exc:
            raise SSHConnectError(f"ProxyJump host {last}: {exc}") from None
        transport = session.client.get_transport()
        target = self.target
        self.stage = f"opening a channel from {last} to {target.hostname} port {target.port}"
        try:
            assert transport is not None
            channel = transport.open_channel(
                "direct-tcpip",
                (target.hostname, target.port),
                ("127.0.0.1", 0),
                timeout=max(deadline - time.monotonic(), 0.1),
            )
        except Exception as exc:
            raise SSHConnectError(
                f"the ProxyJump host {last} could not connect to {target.hostname} port "
                f"{target.port}: {exc or type(exc).__name__}"
            ) from None
        self._address = f"{target.hostname} port {target.port} (via {last})"
        return channel

    def _open_socket(self, deadline: float) -> socket.socket:
        target = self.target
        try:
            infos = socket.getaddrinfo(target.hostname, target.port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise SSHConnectError(
                f"cannot resolve host name '{target.hostname}' (DNS): {exc.strerror}"
            ) from None
        errors: list[str] = []
        for family, kind, proto, _, sockaddr in infos:
            ip, port = cast(tuple[str, int], sockaddr[:2])
            address = f"{ip} port {port}"
            self.stage = f"connecting to {address}"
            sock = socket.socket(family, kind, proto)
            self._sock = sock
            sock.settimeout(max(deadline - time.monotonic(), 0.1))
            started = time.monotonic()
            try:
                sock.connect(sockaddr)
            except TimeoutError:
                sock.close()
                waited = time.monotonic() - started
                errors.append(f"timed out after {waited:.0f} s connecting to {address}")
                continue
            except OSError as exc:
                sock.close()
                errors.append(_socket_error(exc, address))
                continue
            sock.settimeout(None)
            self._address = address
            return sock
        raise SSHConnectError("; ".join(errors) or f"no address for '{target.hostname}'")

    def _load_host_keys(self, client: paramiko.SSHClient) -> None:
        target = self.target
        if target.host_key_policy == "off":
            client.set_missing_host_key_policy(_AcceptAny())
            return
        self._revoked.clear()
        for path in (*target.global_known_hosts_files, *target.known_hosts_files):
            if os.path.isfile(path):
                self._revoked |= load_known_hosts(client.get_host_keys(), path)
        if target.host_key_policy == "strict":
            client.set_missing_host_key_policy(_RejectUnknown())
        else:
            first = target.known_hosts_files[0] if target.known_hosts_files else None
            client.set_missing_host_key_policy(_RecordNewKey(first))

    def _changed_key_message(self, exc: paramiko.BadHostKeyException) -> str:
        target = self.target
        files = ", ".join(target.known_hosts_files or target.global_known_hosts_files)
        name = target.host_key_alias or target.hostname
        remove = f"ssh-keygen -R '{target.key_name}'"
        if target.known_hosts_files:
            remove += f" -f {target.known_hosts_files[0]}"
        return (
            f"HOST KEY CHANGED: {target.key_name} now presents {exc.key.get_name()} key "
            f"{fingerprint(exc.key)} but known_hosts ({files}) has "
            f"{fingerprint(exc.expected_key)}. Someone may be intercepting the connection, or "
            f"{name} was reinstalled; if the change is expected, remove the old key with: "
            f"{remove}"
        )

    def _auth_message(
        self, exc: Exception, keys: list[str], allow_agent: bool, look_for_keys: bool
    ) -> str:
        offered = [f"key {path}" for path in keys]
        if look_for_keys:
            offered += [path for path in DEFAULT_KEYS if os.path.exists(os.path.expanduser(path))]
        if allow_agent and os.environ.get("SSH_AUTH_SOCK"):
            count = _agent_key_count()
            if count:
                offered.append(f"{count} ssh-agent key(s)")
        message = f"authentication failed for user {self.target.user}"
        if offered:
            message += f"; the server accepted none of: {', '.join(offered)}"
        else:
            message += (
                ": no key to offer (give one with -i or IdentityFile in ~/.ssh/config, "
                "or load one into ssh-agent)"
            )
        if isinstance(exc, paramiko.PasswordRequiredException) or any(
            _needs_passphrase(path) for path in keys
        ):
            message += "; a key needs its passphrase: load it into ssh-agent"
        missing = [path for path in self.target.identity_files if path not in keys]
        if missing:
            message += f"; missing key file(s): {', '.join(missing)}"
        return message + " (hvdrun logs in with keys only, never with passwords)"

    def _proxy_failure(self) -> str | None:
        """Where the handshake failed because the ProxyCommand exited: its exit code and
        last words (ssh shows a ProxyCommand's stderr; paramiko keeps it in a pipe)."""
        if not isinstance(self._sock, paramiko.ProxyCommand):
            return None
        process = self._sock.process
        try:
            code = process.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            return None  # still running: the failure lies beyond it
        said = b""
        if process.stderr is not None:
            with contextlib.suppress(OSError):
                os.set_blocking(process.stderr.fileno(), False)
                said = process.stderr.read(65536) or b""
        lines = [line.strip() for line in said.decode(errors="replace").splitlines()]
        last = [line for line in lines if line][-3:]
        return f"its ProxyCommand exited with code {code}" + (
            f": {' / '.join(last)}" if last else " and said nothing on stderr"
        )

    def _handshake_message(self, exc: Exception) -> str:
        text = str(exc) or type(exc).__name__
        if "banner" in text.lower():
            return (
                f"no SSH server answered at {self._address}: the connection opened but no "
                f"SSH greeting came ({text})"
            )
        if isinstance(exc, EOFError | ConnectionResetError):
            return f"the connection was closed {self.stage}"
        if isinstance(exc, TimeoutError):
            return f"timed out {self.stage}"
        return f"SSH failed {self.stage}: {text}"


class _ProxyCommand(paramiko.ProxyCommand):
    """paramiko's ProxyCommand, but a command that exited reads as a closed socket: paramiko's
    own ``recv`` loops on the end of its output until the handshake's timeout. The command
    runs in a session of its own, as the local agents do: a Ctrl-C at the terminal reaches
    hvdrun's whole process group, and a proxy that died of it first made hvdrun blame the
    host's lost connection instead of stopping the job for the Ctrl-C."""

    def __init__(self, command_line: str) -> None:  # (no call of paramiko's: it starts one)
        self.cmd = shlex.split(command_line)
        self.process = subprocess.Popen(
            self.cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            bufsize=0,
            start_new_session=True,
        )
        self.timeout = None

    def recv(self, size: int) -> bytes:
        stdout = self.process.stdout
        assert stdout is not None
        ready, _, _ = select.select([stdout], [], [], self.timeout)
        if not ready:
            raise TimeoutError()
        try:
            return os.read(stdout.fileno(), size)  # b"" at its end: paramiko's EOFError
        except OSError as exc:
            raise paramiko.ProxyCommandFailure(" ".join(self.cmd), str(exc)) from None


DEFAULT_KEYS = ("~/.ssh/id_rsa", "~/.ssh/id_ecdsa", "~/.ssh/id_ed25519", "~/.ssh/id_dsa")


def _needs_passphrase(path: str) -> bool:
    """Whether the key file is encrypted (paramiko's error for it may name another thing)."""
    try:
        paramiko.PKey.from_path(path)
    except paramiko.PasswordRequiredException:
        return True
    except TypeError as exc:  # (a PEM key: cryptography's "... private key is encrypted")
        return "encrypted" in str(exc)
    except Exception:
        return False
    return False


def _agent_key_count() -> int:
    try:
        agent = paramiko.Agent()
        try:
            return len(agent.get_keys())
        finally:
            agent.close()
    except Exception:
        return 0


def _socket_error(exc: OSError, address: str) -> str:
    if exc.errno == errno.ECONNREFUSED:
        return f"connection refused by {address} (is sshd running there?)"
    if exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN):
        return f"no route to {address} (host down or unreachable: {exc.strerror})"
    return f"cannot connect to {address}: {exc.strerror or exc}"
