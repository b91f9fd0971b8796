"""hvdrun's handle on one host's agent, whatever carries it (a pipe or an SSH channel).

:class:`AgentConnection` holds everything the two transports share, in template-method
style: reading the agent's ``hello``, pumping its events onto the job's queue as
:class:`HostEvent` (tagged with the host name, ending with the connection's own
:class:`AgentExit`), writing requests, keeping the tail of the agent's own stderr for error
messages, heartbeats, and turning an agent that died before its ``hello`` into a message
that says why (no Python at that path, one the loader cannot start, hvdrun not installed, no
such directory). What its host prints on its stdout before the ``hello`` (a login shell's
``~/.bashrc``) is not the agent's: it is skipped, and shown with ``--verbose``.
Subclasses implement ``_open``, ``_write``, ``_close_stdin``, ``_exit_code`` and ``_abort``.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import re
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any, Protocol, TypeVar

from launcher.errors import LauncherError
from launcher.transport.protocol import (
    AgentEvent,
    AgentSpec,
    Exit,
    Hello,
    KillRequest,
    Lines,
    Output,
    PingRequest,
    Prepared,
    PrepareRequest,
    Probe,
    ProbeRequest,
    Reached,
    ReachRequest,
    Request,
    RunRequest,
    SignalRequest,
    Started,
    Stopping,
    TerminateRequest,
    decode_event,
    encode_request,
    find_hello,
    text_of,
)

log = logging.getLogger(__name__)

_A = TypeVar("_A", Probe, Prepared, Reached)

#: Exit code of the remote start-up command when the working directory is missing there.
NO_CWD_EXIT = 200

#: What a Python interpreter may need in its environment to start at all, before its agent
#: can read the job's environment on stdin: where the dynamic loader finds libpython (the
#: Python of an Lmod or Spack ``module load``) and where Python finds its standard library.
#: Not ``LD_PRELOAD``: no interpreter needs one to start (the loader only warns about a
#: preload it cannot find), and a preloaded library (a profiler, an allocator) would run in
#: the agent too; the workers get it with the rest of the job's environment.
INTERPRETER_VARIABLES = ("LD_LIBRARY_PATH", "DYLD_LIBRARY_PATH", "PYTHONHOME")

#: What the dynamic loader says when it cannot load an executable's libraries (glibc, musl,
#: macOS's dyld), up to the end of the line.
_LOADER_FAILURE = re.compile(
    r"(?:error while loading shared libraries|Error loading shared library|Library not loaded)"
    r"\b.*"
)

#: How much of what a host printed before the agent's hello is shown, with --verbose.
_SKIPPED_SHOWN = 200


def interpreter_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The :data:`INTERPRETER_VARIABLES` that ``environ`` sets (to something)."""
    return {name: environ[name] for name in INTERPRETER_VARIABLES if environ.get(name)}


def _close_quietly(stream: object) -> None:
    """Closes one of an agent's output streams that was read to its end (or failed)."""
    close = getattr(stream, "close", None)
    if close is not None:
        with contextlib.suppress(Exception):
            close()


class AgentStartError(LauncherError):
    """A host whose agent could not be started; the message says why, for the user."""


class LineReader(Protocol):
    def readline(self) -> bytes: ...


@dataclass(frozen=True)
class AgentExit:
    """The connection's own last event: the agent process ended (``code`` None: its exit
    status is unknown, the connection was lost). ``reason`` is its last line on stderr."""

    code: int | None
    reason: str
    killed_by_hvdrun: bool = False  # (hvdrun gave up on it: a second signal, a silent agent)


@dataclass(frozen=True)
class StepCancelled:
    """The transport's news that the whole job was cancelled under it (``scancel`` of the
    Slurm step that carries the agents); ``message`` says so, for the user."""

    message: str


@dataclass(frozen=True)
class HostEvent:
    """An event as the supervisors receive it: tagged with the host whose agent sent it, and
    with that agent's connection (``source``): an elastic job may start a new agent on a
    host while the events of its previous one are still on their way."""

    host: str
    event: AgentEvent | AgentExit | StepCancelled
    source: AgentConnection | None = None


class EventQueue(Protocol):
    """Where a launched agent's events go: the supervisor's queue (which may carry more)."""

    def put(self, item: HostEvent, /) -> None: ...

    def room_for_output(self) -> None:
        """Blocks while hvdrun's output is backed up (the reader calls it before it passes
        on a worker's line, holding no lock: see ``OutputSink.wait_for_room``)."""


class AgentConnection:
    kind = "agent"
    heartbeat_timeout = 0.0
    #: Who may print on the agent's stdout before the agent starts, and from where (a guess
    #: for the user), for the note about what was skipped there.
    printed_before = ("Python's start-up", "a sitecustomize or .pth file")

    def __init__(self, hostname: str, python: str, cwd: str) -> None:
        self.hostname = hostname
        self.python = python
        self.cwd = cwd
        #: The :data:`INTERPRETER_VARIABLES` the agent's interpreter starts with (hvdrun's
        #: own, unless a transport passes others), for explaining one that cannot start.
        self.interpreter_env = interpreter_env(os.environ)
        self.stage = "starting the agent"
        self.hello: Hello | None = None
        #: The agent's answer to the latest request that has one (see :meth:`_ask`).
        self._answer: Probe | Prepared | Reached | None = None
        self.rendezvous_host: str | None = None  # where this host can reach hvdrun
        self.exit_code: int | None = None
        self.aborted = False  # hvdrun killed the agent (abort)
        self.worker_pids: list[int] = []
        self._running: dict[int, int] = {}  # rank -> pid of the workers not reported exited
        self.last_heard = time.monotonic()  # when the agent last wrote anything
        #: Whether the agent answered the latest terminate (see Supervision.step).
        self.stop_answered = True
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=20)
        self._events: EventQueue | None = None
        self._early: list[HostEvent] = []
        self._queue_lock = threading.Lock()
        self._answered = threading.Event()  # hello (or probe) arrived, or the agent is gone
        self._finished = threading.Event()
        self._stderr_ended = threading.Event()  # the agent's stderr is read to its end
        self._write_lock = threading.Lock()
        self._stdin_closed = False

    # ---- transport hooks ----------------------------------------------------------------

    def _open(self, deadline: float) -> tuple[LineReader, IO[bytes] | LineReader]:
        """Starts the agent process; returns its stdout and stderr."""
        raise NotImplementedError

    def _write(self, data: bytes) -> None:
        raise NotImplementedError

    def _close_stdin(self) -> None:
        raise NotImplementedError

    def _exit_code(self) -> int | None:
        """Waits for the agent process to end; None when its exit status is unknown."""
        raise NotImplementedError

    def _abort(self) -> None:
        """Tears the transport down without waiting for anything."""
        raise NotImplementedError

    # ---- shared behaviour ---------------------------------------------------------------

    def start(self, deadline: float) -> None:
        """Starts the agent and waits for its hello; raises AgentStartError."""
        stdout, stderr = self._open(deadline)
        threading.Thread(target=self._read_events, args=(stdout,), daemon=True).start()
        threading.Thread(target=self._read_stderr, args=(stderr,), daemon=True).start()
        self.stage = "waiting for the agent's hello"
        if not self._answered.wait(max(deadline - time.monotonic(), 0)):
            raise AgentStartError(f"timed out {self.stage}")
        if self.hello is None:  # it has exited; its last words may be on their way still
            self._stderr_ended.wait(2.0)
            raise AgentStartError(self._explain_early_exit())

    def launch(self, spec: AgentSpec, events: EventQueue) -> None:
        """Sends the job; from now on the agent's events go to ``events``."""
        with self._queue_lock:
            self._events = events
            for event in self._early:
                events.put(event)
            self._early.clear()
        self._send(RunRequest(spec))
        self.last_heard = time.monotonic()
        if self.heartbeat_timeout > 0:
            # Often enough for the shorter of hvdrun's check of the agent and the agent's
            # of hvdrun (--heartbeat-timeout may be the shorter one).
            every = min(t for t in (self.heartbeat_timeout, spec.lost_after) if t > 0) / 4
            threading.Thread(target=self._ping, args=(every,), daemon=True).start()

    def request_probe(
        self,
        connect_back: str | None,
        timeout: float,
        peers: Sequence[str] = (),
        mesh: bool = False,
    ) -> dict[str, Any]:
        """``--check-hosts``: the agent's description of its host; ``peers``: the addresses
        of the other hosts checked; ``mesh``: listen for them too (then
        :meth:`request_reach`)."""
        request = ProbeRequest(connect_back, tuple(peers), mesh)
        return self._ask(request, Probe, timeout, "did not answer the probe").facts

    def request_reach(self, targets: dict[str, str], timeout: float) -> dict[str, str | None]:
        """After a mesh probe: per host of ``targets``, None when this host reached it."""
        silent = "did not say which hosts it reached"
        return self._ask(ReachRequest(targets), Reached, timeout, silent).results

    def request_prepare(
        self, rendezvous_addr: str, timeout: float, peers: Sequence[str] = ()
    ) -> Prepared:
        """Rank 0's host: where plain torch.distributed scripts meet (MASTER_ADDR/PORT);
        ``peers``: the addresses of the job's other hosts."""
        silent = "did not say which port torch.distributed can use there"
        return self._ask(PrepareRequest(rendezvous_addr, tuple(peers)), Prepared, timeout, silent)

    def _ask(self, request: Request, kind: type[_A], timeout: float, silent: str) -> _A:
        """Sends a request the agent answers (with a ``kind`` event) before the job, and
        returns the answer; AgentStartError without one."""
        self._answer = None
        self._answered.clear()
        if self.hello is None:
            raise AgentStartError("the agent is not running")
        self._send(request)
        answered = self._answered.wait(timeout)
        answer = self._answer
        if not answered or not isinstance(answer, kind):
            last = f": {self.stderr_tail[-1]}" if self.stderr_tail else ""
            raise AgentStartError(f"the agent {silent}{last}")
        return answer

    def terminate(self) -> None:
        """Ask the agent to stop its workers (SIGTERM, then SIGKILL after the grace period);
        it answers at once (an agent that has not said hello yet is not expected to)."""
        self.stop_answered = self.hello is None
        self._send(TerminateRequest())

    def signal(self, signum: int) -> None:
        """Pass a signal (SIGUSR1, SIGUSR2) on to the agent's workers."""
        self._send(SignalRequest(signum))

    def kill(self) -> None:
        """Stop the workers without grace and drop the agent."""
        self._send(KillRequest())
        threading.Thread(target=self._abort_later, args=(2.0,), daemon=True).start()

    def close(self) -> None:
        """End of file on the agent's stdin: it stops whatever still runs and exits."""
        with self._write_lock:
            if self._stdin_closed:
                return
            self._stdin_closed = True
        with contextlib.suppress(Exception):
            self._close_stdin()

    def abort(self) -> None:
        self.aborted = True
        with contextlib.suppress(Exception):
            self._abort()

    def current_stage(self) -> str:
        """What the start-up is doing right now, for a timeout message."""
        return self.stage

    def wait_finished(self, timeout: float) -> bool:
        return self._finished.wait(timeout)

    def _abort_later(self, delay: float) -> None:
        if not self._finished.wait(delay):
            self.abort()

    def _send(self, request: Request) -> None:
        data = encode_request(request)
        with self._write_lock:
            if self._stdin_closed:
                return
            try:
                self._write(data)
            except Exception as exc:  # the agent is gone; its reader reports that
                log.debug("cannot write to the agent on %s: %s", self.hostname, exc)

    def _ping(self, every: float) -> None:
        interval = max(every, 0.05)
        while not self._finished.wait(interval):
            self._send(PingRequest())

    def deliver_event(self, event: StepCancelled) -> None:
        """Queues news from the transport itself, as if the agent had sent it."""
        self._deliver(event)

    def _deliver(self, event: AgentEvent | AgentExit | StepCancelled) -> None:
        tagged = HostEvent(self.hostname, event, self)
        with self._queue_lock:
            if self._events is None:
                self._early.append(tagged)
            else:
                self._events.put(tagged)

    def _read_events(self, stdout: LineReader) -> None:
        skipped = bytearray()  # what came before the hello: not the agent's
        while True:
            try:
                line = stdout.readline()
            except Exception:
                line = b""
            if not line:
                break
            self.last_heard = time.monotonic()
            if self.hello is None:  # the agent speaks first: the rest is its host's
                start = find_hello(line)
                skipped += (line if start < 0 else line[:start])[: _SKIPPED_SHOWN - len(skipped)]
                if start < 0:
                    continue
                line = line[start:]
            try:
                event = decode_event(line)
            except ValueError:
                log.warning("agent on %s wrote a malformed event: %r", self.hostname, line[:200])
                continue
            if event is None:  # a kind this hvdrun does not know: it said something, though
                continue
            if isinstance(event, Hello) and self.hello is None:
                self._note_skipped(bytes(skipped))
                self.hello = event
                self._answered.set()
            elif isinstance(event, (Probe, Prepared, Reached)):
                self._answer = event
                self._answered.set()
            elif isinstance(event, Stopping):
                self.stop_answered = True
            else:
                if isinstance(event, Started):
                    self.worker_pids.append(event.pid)
                    self._running[event.rank] = event.pid
                elif isinstance(event, Exit):
                    self._running.pop(event.rank, None)
                elif isinstance(event, (Output, Lines)) and self._events is not None:
                    # (hvdrun's output is slower than the job: stop reading this agent, and
                    # so the agent its workers, until there is room; the supervisor does not
                    # judge heartbeats meanwhile, see Supervision.check_heartbeats)
                    self._events.room_for_output()
                self._deliver(event)
        if self.hello is None:
            self._note_skipped(bytes(skipped))
        _close_quietly(stdout)  # (at its end: hvdrun.run's caller would get a ResourceWarning)
        try:
            self.exit_code = self._exit_code()
        except Exception:
            self.exit_code = None
        if self.exit_code != 0 and self._running:
            # The agent died (killed, out of memory) with workers it never reported: they
            # are orphans now, which nothing on their host will stop.
            with contextlib.suppress(Exception):
                self._stop_orphans(sorted(self._running.values()))
        self._finished.set()
        self._answered.set()
        self._deliver(AgentExit(self.exit_code, self.exit_reason(), self.aborted))

    def _note_skipped(self, skipped: bytes) -> None:
        """Says once (with --verbose) what the agent's host printed on its stdout before the
        agent's hello, which was skipped: harmless, so never a warning."""
        if skipped:
            who, where = self.printed_before
            log.info(
                "%s on %s printed to stdout before hvdrun's agent started (%s?); ignored: %r",
                who,
                self.hostname,
                where,
                skipped,
            )

    def _read_stderr(self, stderr: IO[bytes] | LineReader) -> None:
        try:
            while True:
                try:
                    line = stderr.readline()
                except Exception:
                    return
                if not line:
                    return
                text = text_of(line.rstrip(b"\r\n"))
                self.stderr_tail.append(text)
                log.info("agent on %s: %s", self.hostname, text)
        finally:
            _close_quietly(stderr)
            self._stderr_ended.set()

    def _stop_orphans(self, pids: list[int]) -> None:
        """Kills the process groups (and sessions) of workers whose agent died. Local
        workers are reached by :meth:`_abort`; a transport that can reach a remote host
        without its agent overrides this."""

    def exit_reason(self) -> str:
        """The agent's last words on stderr, for messages about a lost agent."""
        return self.stderr_tail[-1] if self.stderr_tail else ""

    def _explain_early_exit(self) -> str:
        code = self.exit_code
        text = "\n".join(self.stderr_tail)
        if code == NO_CWD_EXIT:
            return (
                f"the working directory {self.cwd} does not exist there (workers start in "
                f"the directory hvdrun runs in: share or mirror it on every host)"
            )
        loader = _LOADER_FAILURE.search(text)
        if loader is not None:
            return (
                f"the Python at {self.python} cannot start there: {loader.group(0).strip()} "
                f"({self._library_path_note(loader.group(0))})"
            )
        if code == 127 or (self.python in text and "No such file" in text):
            return (
                f"no Python at {self.python} there: hvdrun must be installed at the same "
                f"path on every host (as with Horovod)"
            )
        if "No module named" in text:
            return (
                f"hvdrun is not installed for {self.python} there "
                f"({self.stderr_tail[-1].strip()}); install it on every host"
            )
        last = f": {self.stderr_tail[-1].strip()}" if self.stderr_tail else ""
        status = "was lost" if code is None else f"exited with code {code}"
        return f"the agent {status} before it started{last}"

    def _library_path_note(self, loader_said: str) -> str:
        """Where the interpreter the loader could not start looked for its libraries."""
        name = "DYLD_LIBRARY_PATH" if "Library not loaded" in loader_said else "LD_LIBRARY_PATH"
        value = self.interpreter_env.get(name)
        if value:
            return (
                f"it started with hvdrun's {name}={value}: is the library in one of those "
                "directories on that host?"
            )
        return (
            f"hvdrun has no {name} to pass on: set it to the directory that holds the library "
            "there, as a `module load` of that Python does"
        )
