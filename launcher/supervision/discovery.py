"""Where an elastic job may run: host discovery and the blacklist of failed hosts.

``--host-discovery-script SCRIPT`` is run (through ``/bin/sh``, so it may carry arguments)
every second; it prints one ``host`` or ``host:slots`` per line (a bare host has
``--slots-per-host`` slots; blank lines and ``#`` comments are ignored; a host printed twice
keeps its first place and takes its last line's slots, as in Horovod, with a warning). Its
first run must succeed, or the job does not start; a later failure (non-zero exit,
unparsable output, no answer within the timeout) is logged and the previous answer stays in
force until a run succeeds again. A fixed ``-H`` list is the same without the script.

A host whose worker failed is blacklisted. Without ``--blacklist-cooldown-range`` it stays
out for the rest of the job (Horovod's default); with ``MIN MAX`` its n-th failure keeps it out
for ``min(MAX, MIN * 2**(n-1))`` seconds, after which it comes back as soon as discovery
lists it again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
from dataclasses import dataclass, field

from launcher.errors import LauncherError
from launcher.spec.hosts import HostSpec, HostSpecError, parse_host_entry

log = logging.getLogger(__name__)

#: How long one run of the discovery script may take.
DISCOVERY_TIMEOUT = 10.0


class DiscoveryError(LauncherError):
    """The discovery script failed or printed something that is not a host list."""


def parse_discovery_output(
    text: str, slots_per_host: int, repeated: set[str] | None = None
) -> list[HostSpec]:
    """``host`` / ``host:slots`` lines → hosts in the order printed; raises DiscoveryError.
    A host printed more than once keeps its first place and takes its last line's slots
    (Horovod keeps the hosts in a dict); its name is added to ``repeated``."""
    hosts: dict[str, HostSpec] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            entry = parse_host_entry(line, default_slots=slots_per_host)
        except HostSpecError as exc:
            raise DiscoveryError(f"line {number}: {exc}") from None
        if entry.hostname in hosts and repeated is not None:
            repeated.add(entry.hostname)
        hosts[entry.hostname] = entry
    return list(hosts.values())


class HostDiscovery:
    """A source of the hosts an elastic job may use right now."""

    def find(self) -> list[HostSpec]:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def stop(self) -> None:
        """The job is over: end whatever a run under way started (no process outlives
        hvdrun); later runs find nothing."""


@dataclass
class FixedHosts(HostDiscovery):
    """``-H``/``--hostfile`` in an elastic job: always the same hosts."""

    hosts: list[HostSpec]

    def find(self) -> list[HostSpec]:
        return list(self.hosts)

    def describe(self) -> str:
        return "the host list"


@dataclass
class ScriptDiscovery(HostDiscovery):
    """``--host-discovery-script``: the hosts its latest successful run printed."""

    script: str
    slots_per_host: int = 1
    timeout: float = DISCOVERY_TIMEOUT
    cwd: str | None = None
    #: The hosts already warned about for being printed more than once (warned once each).
    warned: set[str] = field(default_factory=set, repr=False)
    #: The run under way (its session's leader), and whether the job is over (:meth:`stop`).
    _running: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    _stopped: bool = field(default=False, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def describe(self) -> str:
        return f"host discovery script {self.script!r}"

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            if self._running is not None:
                _kill_session(self._running)

    def find(self) -> list[HostSpec]:
        with self._lock:
            if self._stopped:
                raise DiscoveryError("the job is over")
            try:
                # A session of its own, so that a timeout (or the job's end) stops whatever
                # the script started.
                proc = subprocess.Popen(
                    ["/bin/sh", "-c", self.script],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    stdin=subprocess.DEVNULL,
                    cwd=self.cwd,
                    start_new_session=True,
                )
            except OSError as exc:
                raise DiscoveryError(f"cannot run it: {exc.strerror or exc}") from None
            self._running = proc
        try:
            stdout, stderr = proc.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            exited = proc.poll() is not None  # (a child it left holds the output open)
            _kill_session(proc)
            proc.communicate()
            if exited:
                raise DiscoveryError(
                    f"exited, but a process it started still held its output open after "
                    f"{self.timeout:g} s: start background processes with their output "
                    "redirected (cmd >/dev/null 2>&1 &)"
                ) from None
            raise DiscoveryError(f"did not finish within {self.timeout:g} s") from None
        except BaseException:  # (a Ctrl-C while hvdrun waits for the first run)
            _kill_session(proc)
            raise
        finally:
            with self._lock:
                self._running = None
        if proc.returncode != 0:
            lines = stderr.decode("utf-8", "replace").strip().splitlines()
            last = f": {lines[-1]}" if lines else ""
            raise DiscoveryError(f"exited with code {proc.returncode}{last}")
        repeated: set[str] = set()
        text = stdout.decode("utf-8", "replace")
        hosts = parse_discovery_output(text, self.slots_per_host, repeated)
        for name in sorted(repeated - self.warned):
            slots = next(host.slots for host in hosts if host.hostname == name)
            log.warning(
                "%s prints host %s more than once: its last line counts (%d slot(s))",
                self.describe(),
                name,
                slots,
            )
        self.warned |= repeated
        return hosts


def _kill_session(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL to the session (and process group) a discovery run leads."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


class Blacklist:
    """Failed hosts, kept out for good or for an exponentially growing cooldown."""

    def __init__(self, cooldown: tuple[float, float] | None = None) -> None:
        self.cooldown = cooldown
        self._failures: dict[str, int] = {}
        self._until: dict[str, float] = {}

    def add(self, host: str, now: float) -> float | None:
        """Records a failure at ``now`` (monotonic time); returns the cooldown in seconds
        (None: for good)."""
        failures = self._failures[host] = self._failures.get(host, 0) + 1
        if self.cooldown is None:
            self._until[host] = float("inf")
            return None
        low, high = self.cooldown
        delay = min(high, low * 2 ** (failures - 1))
        self._until[host] = now + delay
        return delay

    def blocked(self, host: str, now: float) -> bool:
        return now < self._until.get(host, float("-inf"))

    def failures(self, host: str) -> int:
        return self._failures.get(host, 0)
