"""The parts of supervision that fixed and elastic jobs share.

:class:`JobResult` and :class:`WorkerFailure` record how a job ended (the failure report
reads them); :class:`Signals` records SIGINT/SIGTERM for the supervision loop;
:func:`agent_spec` is what one host's agent is told to run.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from launcher.output import OutputSink
from launcher.spec.job import JobSpec
from launcher.transport.connection import AgentExit
from launcher.transport.protocol import AgentSpec, Done, WorkerLaunch
from rendezvous import worker_env
from rendezvous.slots import SlotInfo

log = logging.getLogger(__name__)

# How long agents get, beyond the workers' grace period, to report before they are killed.
AGENT_REPORT_SLACK = 10.0


@dataclass
class WorkerFailure:
    rank: int
    hostname: str
    code: int
    error: str | None = None


@dataclass
class JobResult:
    exit_code: int
    failure: WorkerFailure | None = None
    interrupted_by: int | None = None
    exits: dict[int, int] = field(default_factory=dict)
    stopped: set[int] = field(default_factory=set)  # exited after hvdrun began stopping
    lost: dict[int, str] = field(default_factory=dict)  # rank -> why it was never reported
    hosts: dict[int, str] = field(default_factory=dict)  # rank -> host


def agent_spec(
    spec: JobSpec,
    hostname: str,
    slots: Sequence[SlotInfo],
    rendezvous: str,
    job_id: str,
    secret: str,
    heartbeat_timeout: float,
) -> AgentSpec:
    env = dict(spec.env)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(worker_env.connection_env(rendezvous, job_id, secret))
    return AgentSpec(
        hostname=hostname,
        command=list(spec.command),
        cwd=spec.cwd,
        env=env,
        workers=[
            WorkerLaunch(rank=slot.rank, env=worker_env.slot_env(slot))
            for slot in slots
            if slot.hostname == hostname
        ],
        term_grace=spec.term_grace,
        rendezvous_addr=rendezvous,
        heartbeat_timeout=heartbeat_timeout,
    )


def agent_loss_reason(event: Done | AgentExit) -> str:
    """Why a host's agent went away, from its ``Done`` (too early) or its ``AgentExit``."""
    if isinstance(event, Done):
        return "its agent finished early"
    why = (
        "lost the connection to its agent"
        if event.code is None
        else f"its agent exited (code {event.code})"
    )
    if event.reason:
        why += f": {event.reason}"
    return why


class Signals:
    """Records SIGINT/SIGTERM for the supervision loop instead of raising mid-cleanup."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._handled = 0

    def record(self, signum: int, frame: object = None) -> None:
        self.received.append(signum)

    def first(self) -> int | None:
        return self.received[0] if self.received else None

    def handle(
        self,
        result: JobResult,
        sink: OutputSink,
        stop_all: Callable[[], None],
        kill_all: Callable[[], None],
    ) -> None:
        """Acts on the signals received since the last call, as both supervision loops do:
        the first stops every worker (and is the job's outcome unless a worker failed
        first), a second one kills without grace."""
        while self._handled < len(self.received):
            signum = self.received[self._handled]
            if self._handled == 0:
                sink.message(f"received {signal.Signals(signum).name}; stopping all workers")
                if result.failure is None:
                    result.interrupted_by = signum
                    result.exit_code = 128 + signum
                stop_all()
            else:
                sink.message("second signal: killing all workers now")
                kill_all()
            self._handled += 1

    @contextlib.contextmanager
    def installed(self) -> Iterator[Signals]:
        previous = {s: signal.signal(s, self.record) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
