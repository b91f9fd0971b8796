"""Agents started by Slurm inside an allocation: one ``srun`` step, one task per host.

``hvdrun`` inside ``salloc``/``sbatch`` (``--launcher slurm``, or ``auto`` when every host is a
node of the allocation) starts no SSH connection. :class:`SlurmStep` runs::

    srun --overlap --whole --nodes=N --ntasks=N --ntasks-per-node=1 --nodelist=HOSTS
         --cpu-bind=none --mpi=none --input=all --label --kill-on-bad-exit=0 --chdir=/
         PYTHON -m launcher.agent --shared-stdin

and every host gets an :class:`SrunAgent`, the same :class:`AgentConnection` as over SSH, fed
from that one process:

* **stdin**: srun gives every task the same stdin (``--input=all``; without it only task 0
  would read it). hvdrun writes ``TASK LINE`` for one agent, and ``TASK EOF`` for its end of
  file (:class:`launcher.agent.session.AddressedStdin` filters them), so the job secret in the
  run request travels on stdin, as over SSH, never in argv.
* **stdout/stderr**: ``--label`` puts ``TASK: `` before every line; lines are handed to the
  agent of that task. It also cuts a line into pieces of 1024 bytes, each labelled as a
  line, so the agents write long event lines as marked pieces of their own
  (``protocol.pieces``), joined here. A task is bound to its host by the node its ``hello`` names
  (``SLURMD_NODENAME``): Slurm orders tasks by its own node order, not the list's.
* **exit codes**: an agent's last line is ``hvdrun-agent-exit CODE``; srun's own
  ``task N: Exited with exit code C``/``Killed`` lines cover agents that die without it.
* **cancellation**: ``scancel`` of the job or the step (or the time limit) makes slurmstepd
  write ``*** STEP|JOB ... CANCELLED ...``; every agent's connection then reports
  :class:`StepCancelled` and hvdrun stops the job with exit code 143. slurmstepd signals
  every process of the step on every node, workers included.
* **teardown**: srun runs in a session of its own (a Ctrl-C reaches hvdrun only, which then
  stops the job); once every agent is done its stdin closes, and a step still running after
  that is cancelled with ``scancel JOB.STEP`` and srun is killed.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import queue
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Sequence

from launcher.transport.connection import AgentConnection, AgentStartError, StepCancelled
from launcher.transport.local import AGENT_MODULE, agent_env
from launcher.transport.protocol import (
    EXIT_MARKER,
    SHARED_STDIN_FLAG,
    Hello,
    Joiner,
    decode_event,
)
from rendezvous.addresses import source_address
from rendezvous.launchers import node_address

log = logging.getLogger(__name__)

_LABEL = re.compile(rb"^\s*(\d+): ?")
_TASK_REPORT = re.compile(
    r"^srun: error: (?P<node>\S+): tasks? (?P<tasks>[\d,\-]+): "
    r"(?:Exited with exit code (?P<code>\d+)|(?P<killed>Killed)|(?P<other>.*))"
)
_CANCELLED = re.compile(r"\*\*\* (?:STEP|JOB) \S+ ON \S+ CANCELLED")
#: How long a task srun reported as exited may take to deliver its last lines.
_LAST_LINES_GRACE = 2.0

CANCELLED_MESSAGE = (
    "the Slurm job step running hvdrun's agents was cancelled (scancel, or the job's time "
    "limit); stopping all workers"
)


def srun_argv(srun: str, nodes: Sequence[str], python: str) -> list[str]:
    """The one srun command that starts an agent on every node (nothing secret in it)."""
    count = str(len(nodes))
    return [
        srun,
        "--overlap",  # share the allocation's CPUs with other steps (and the batch script)
        "--whole",  # the step sees every CPU of its nodes, so workers are not confined
        f"--nodes={count}",
        f"--ntasks={count}",
        "--ntasks-per-node=1",
        f"--nodelist={','.join(nodes)}",
        "--cpu-bind=none",  # the workers place themselves; no pinning to one CPU
        "--mpi=none",
        "--input=all",
        "--label",
        "--kill-on-bad-exit=0",  # one agent's exit code must not end the others
        "--chdir=/",
        "--job-name=hvdrun-agents",
        python,
        "-m",
        AGENT_MODULE,
        SHARED_STDIN_FLAG,
    ]


def expand_tasks(text: str) -> list[int]:
    """srun's task lists: ``3``, ``0-2``, ``0,2-3``."""
    tasks: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        tasks.extend(range(int(low), int(high or low) + 1))
    return tasks


class _Lines:
    """A line source fed by the step's readers; ``b""`` (end of file) stays once given."""

    def __init__(self) -> None:
        self._queue: queue.Queue[bytes] = queue.Queue()
        self._ended = False

    def put(self, line: bytes) -> None:
        self._queue.put(line)

    def readline(self) -> bytes:
        if self._ended:
            return b""
        line = self._queue.get()
        if not line:
            self._ended = True
        return line


class SrunAgent(AgentConnection):
    """One host's agent, a task of the step; see the module docstring."""

    kind = "srun"

    def __init__(
        self, step: SlurmStep, hostname: str, python: str, cwd: str, heartbeat_timeout: float
    ) -> None:
        super().__init__(hostname, python, cwd)
        self.step = step
        self.heartbeat_timeout = heartbeat_timeout
        self.task: int | None = None
        self.stdout = _Lines()
        self.stderr = _Lines()
        self.code: int | None = None
        self.ended = threading.Event()
        self._address: str | None = None

    @property
    def local_address(self) -> str | None:
        """The address of this machine that the node reaches (for the rendezvous)."""
        if self._address is None:
            self._address = source_address(node_address(self.hostname) or self.hostname)
        return self._address

    def _open(self, deadline: float) -> tuple[_Lines, _Lines]:
        self.step.start()
        self.stage = "starting the agent with srun"
        return self.stdout, self.stderr

    def _write(self, data: bytes) -> None:
        if self.task is None:
            raise OSError("the agent has not said hello")
        self.step.write(f"{self.task} ".encode() + data)

    def _close_stdin(self) -> None:
        if self.task is not None:
            self.step.write(f"{self.task} EOF\n".encode())
        self.step.closed(self)

    def _exit_code(self) -> int | None:
        self.ended.wait()
        return self.code

    def _abort(self) -> None:
        self.end(None)
        self.step.closed(self)

    def end(self, code: int | None) -> None:
        """The agent is gone (its exit line, srun's report, or the step ended)."""
        if self.ended.is_set():
            return
        self.code = code
        self.ended.set()
        self.stdout.put(b"")
        self.stderr.put(b"")


class SlurmStep:
    """The srun process that carries every host's agent; see the module docstring."""

    def __init__(
        self,
        hostnames: Sequence[str],
        python: str,
        cwd: str,
        heartbeat_timeout: float,
    ) -> None:
        self.hostnames = list(hostnames)
        self.python = python
        self.agents = {
            name: SrunAgent(self, name, python, cwd, heartbeat_timeout) for name in hostnames
        }
        self.step_id: str | None = None  # "JOB.STEP", from the agents' hellos
        self.cancelled = False
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=20)
        self._cwd = cwd
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._tasks: dict[int, SrunAgent] = {}
        self._unbound: dict[int, list[bytes]] = collections.defaultdict(list)
        self._closed: set[str] = set()
        self._shut = False

    # ---- starting ----------------------------------------------------------------------

    def start(self) -> None:
        """Starts srun once, whichever agent asks first; raises AgentStartError."""
        with self._lock:
            if self._proc is not None:
                return
            srun = shutil.which("srun")
            if srun is None:
                # (a container inside the allocation often lacks it: SSH may still work)
                raise AgentStartError(
                    "srun is not on PATH here, and inside a Slurm allocation hvdrun starts its "
                    "agents with srun; put srun on PATH, or give --launcher ssh to start them "
                    "over SSH"
                )
            env = agent_env(os.environ, self._cwd)
            try:
                self._proc = subprocess.Popen(
                    srun_argv(srun, self.hostnames, self.python),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                    cwd="/",
                    env=env,
                )
            except OSError as exc:
                raise AgentStartError(f"cannot run srun: {exc}") from None
            threading.Thread(target=self._pump_stdout, daemon=True).start()
            threading.Thread(target=self._pump_stderr, daemon=True).start()

    # ---- hvdrun -> agents ----------------------------------------------------------------

    def write(self, data: bytes) -> None:
        proc = self._proc
        if proc is None or proc.stdin is None:
            raise OSError("srun is not running")
        with self._lock:
            proc.stdin.write(data)
            proc.stdin.flush()

    def closed(self, agent: SrunAgent) -> None:
        """``agent``'s stdin is closed (or it was dropped); when every agent's is, srun's
        stdin closes, and a step still running shortly after is cancelled."""
        with self._lock:
            self._closed.add(agent.hostname)
            if len(self._closed) < len(self.agents) or self._shut:
                return
            self._shut = True
        threading.Thread(target=self._shutdown, daemon=True).start()

    def _shutdown(self, grace: float = 3.0) -> None:
        proc = self._proc
        if proc is None:
            return
        with contextlib.suppress(OSError, ValueError), self._lock:
            if proc.stdin is not None:
                proc.stdin.close()
        deadline = time.monotonic() + grace
        while proc.poll() is None and time.monotonic() < deadline:
            if all(agent.ended.is_set() for agent in self.agents.values()):
                deadline = min(deadline, time.monotonic() + 0.5)
            time.sleep(0.05)
        if proc.poll() is not None:
            return
        if self.step_id is not None and shutil.which("scancel"):
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                subprocess.run(
                    ["scancel", "--quiet", self.step_id],
                    timeout=10,
                    stdin=subprocess.DEVNULL,
                    capture_output=True,
                )
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        proc.wait()

    # ---- agents -> hvdrun ----------------------------------------------------------------

    def _bind(self, task: int, hello: Hello | None) -> SrunAgent | None:
        """The agent of ``task``, bound by the node its hello names (or the next free one)."""
        with self._lock:
            if task in self._tasks:
                return self._tasks[task]
            if hello is None:
                return None
            free = [a for a in self.agents.values() if a.task is None]
            node = (hello.node or hello.hostname or "").split(".")[0]
            chosen = next((a for a in free if a.hostname.split(".")[0] == node), None)
            if chosen is None and free:
                chosen = free[0]  # names that differ from Slurm's (an alias, a FQDN)
            if chosen is None:
                return None
            chosen.task = task
            self._tasks[task] = chosen
            if hello.step:
                self.step_id = hello.step
            return chosen

    def _pump_stdout(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        joiners: collections.defaultdict[int, Joiner] = collections.defaultdict(Joiner)
        for line in self._proc.stdout:
            match = _LABEL.match(line)
            if match is None:
                log.info("srun: %s", line.rstrip().decode(errors="replace"))
                continue
            task = int(match.group(1))
            payload = joiners[task].feed(line[match.end() :])
            if payload is None:
                continue  # (a piece of a long event line: more follow)
            agent = self._tasks.get(task)
            if agent is None:
                agent = self._bind(task, _hello_of(payload))
                if agent is None:
                    self._unbound[task].append(payload)
                    continue
                for early in self._unbound.pop(task, []):
                    agent.stdout.put(early)
            if payload.startswith(EXIT_MARKER.encode()):
                status = payload[len(EXIT_MARKER) :].strip()
                agent.end(int(status) if status.isdigit() else None)
            else:
                agent.stdout.put(payload)
        log.info("srun exited with code %s", self._proc.wait())
        for agent in self.agents.values():
            if not agent.ended.is_set() and not agent.stderr_tail and self.stderr_tail:
                agent.stderr_tail.append(self.stderr_tail[-1])
            agent.end(None)

    def _pump_stderr(self) -> None:
        assert self._proc is not None and self._proc.stderr is not None
        for raw in self._proc.stderr:
            match = _LABEL.match(raw)
            text = raw[match.end() if match else 0 :].rstrip(b"\r\n").decode(errors="replace")
            if _CANCELLED.search(text):
                self._on_cancelled(text)
            if match is not None:
                agent = self._tasks.get(int(match.group(1)))
                if agent is not None:
                    agent.stderr.put(raw[match.end() :])
                    continue
            self.stderr_tail.append(text)
            log.info("%s", text)
            report = _TASK_REPORT.match(text)
            if report is not None:
                self._on_task_report(report)
            elif not match and text.startswith("srun: error:"):
                for agent in self.agents.values():  # e.g. the step could not be created
                    if agent.hello is None:
                        agent.stderr_tail.append(text)

    def _on_task_report(self, report: re.Match[str]) -> None:
        code = int(report["code"]) if report["code"] is not None else None
        for task in expand_tasks(report["tasks"]):
            agent = self._tasks.get(task)
            if agent is None:
                continue
            agent.stderr_tail.append(report.group(0))
            # Its exit line may still be on its way through the other pipe.
            timer = threading.Timer(_LAST_LINES_GRACE, agent.end, args=(code,))
            timer.daemon = True
            timer.start()

    def _on_cancelled(self, text: str) -> None:
        with self._lock:
            if self.cancelled:
                return
            self.cancelled = True
        log.info("%s", text)
        self.agents[self.hostnames[0]].deliver_event(StepCancelled(CANCELLED_MESSAGE))


def _hello_of(payload: bytes) -> Hello | None:
    try:
        event = decode_event(payload)
    except ValueError:
        return None
    return event if isinstance(event, Hello) else None
