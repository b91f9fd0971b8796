"""The per-host agent's one session: ``python -m launcher.agent`` runs :func:`main`.

One agent runs on every host of a job, for local and remote hosts alike (a subprocess, or
over SSH). It announces its versions with a ``hello`` event, reads its request from stdin
(:mod:`launcher.transport.protocol`), starts the host's workers (each in a new session, so its whole
process group can be signalled), splits their output into lines and reports them, with
exits (and workers stopped or continued, see :mod:`launcher.agent.workers`), as events on
stdout.

Before starting workers it finds the interface that faces the rendezvous server (or, on a
host with several, the one its routes to most of the job's other hosts use) and sets
``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` to it unless they are set: a host's own name
need not resolve anywhere for Gloo and NCCL to find each other. Unless the job sets
``OMP_NUM_THREADS``, each worker gets the host's cores divided by the host's workers (only
the agent knows its host's cores).

The agent is the middleman that guarantees no worker outlives the job: when its stdin
closes (hvdrun exited or was killed with -9, the SSH connection dropped), when it hears
nothing from hvdrun for the heartbeat timeout (a cut network), or when it is told to
terminate, it sends SIGTERM to every worker's process group and every process of its tree,
then SIGKILL after the grace period. It imports neither torch nor grpc, so it starts fast.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, BinaryIO, Protocol

from launcher.agent.workers import ADOPTED_GRACE_S, Emit, HostAgent, adopt_orphans
from launcher.spec.environment import worker_base_env
from launcher.transport.hostinfo import installed_versions
from launcher.transport.protocol import (
    FORWARDED_SIGNALS,
    PIECE_BYTES,
    PROTOCOL_VERSION,
    AgentEvent,
    AgentSpec,
    Done,
    Hello,
    KillRequest,
    Network,
    Ping,
    Prepared,
    PrepareRequest,
    Probe,
    ProbeRequest,
    Reached,
    ReachRequest,
    RunRequest,
    Signalled,
    SignalRequest,
    Stopping,
    TerminateRequest,
    decode_request,
    encode_event,
    pieces,
)
from rendezvous import load_grpc, worker_env
from rendezvous.addresses import (
    gloo_interface,
    interface_facing,
    is_loopback,
    pick_master,
    split_addr,
)

if TYPE_CHECKING:
    from rendezvous.relay import HostRelay

IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
log = logging.getLogger(__name__)


def start_relay(spec: AgentSpec, env: dict[str, str]) -> HostRelay | None:
    """Multi-host fixed jobs: starts the host's rendezvous relay and points the workers at it
    (``HVDRUN_RENDEZVOUS_RELAY_ADDR``, see :mod:`rendezvous.relay`), so the server deals with
    one connection and one heartbeat stream per host. None (workers dial the server) for
    jobs on this machine alone, elastic jobs, ``HVDRUN_RENDEZVOUS_RELAY=0``, or when the
    relay cannot start."""
    env.pop(worker_env.RENDEZVOUS_RELAY_ADDR, None)  # only ever this agent's own relay
    addr = env.get(worker_env.RENDEZVOUS_ADDR, "")
    secret = env.get(worker_env.SECRET, "")
    if not addr or not secret or not spec.workers:
        return None
    try:
        if worker_env.flag(worker_env.ELASTIC, env) or (
            worker_env.setting(worker_env.RENDEZVOUS_RELAY, env) == "0"
        ):
            return None
        if is_loopback(split_addr(addr)[0]):
            return None
        lost_after = worker_env.number(worker_env.RENDEZVOUS_LOST_AFTER_SECONDS, env=env)
    except ValueError:
        return None  # the workers report the bad setting themselves
    load_grpc()  # gRPC: loaded only by agents of multi-host jobs, at ERROR
    from rendezvous.relay import HostRelay

    relay = HostRelay(
        addr,
        secret,
        env.get(worker_env.JOB_ID, ""),
        [worker.rank for worker in spec.workers],
        cert_pem=env.get(worker_env.RENDEZVOUS_CERT) or None,
        lost_after=lost_after,
    )
    try:
        local = relay.start()
    except Exception as error:
        note(f"rendezvous relay did not start ({error}); workers dial the server")
        relay.stop()
        return None
    env[worker_env.RENDEZVOUS_RELAY_ADDR] = local
    return relay


def network_env(
    env: dict[str, str], rendezvous_addr: str, emit: Emit, peers: Sequence[str] = ()
) -> None:
    """Points Gloo and NCCL at the interface facing the rendezvous, unless the user did; a
    host with several interfaces takes the one its routes to most of the job's other hosts
    (``peers``) use, since those are whom the workers connect to."""
    if not rendezvous_addr:
        return
    facing = interface_facing(rendezvous_addr)
    ifname, address = gloo_interface(facing, peers)
    if ifname != facing[0]:
        log.info("Gloo and NCCL use %s, which faces most peers, not %s", ifname, facing[0])
    emit(Network(ifname, address))
    if ifname is None:
        return
    for name in IFNAME_VARIABLES:
        env.setdefault(name, ifname)


class LineSource(Protocol):
    def readline(self) -> bytes: ...


class AddressedStdin:
    """This agent's lines of a stdin that every agent of an srun step reads (``--input=all``).

    hvdrun writes ``TASK LINE`` for one agent (its Slurm task number) and ``* LINE`` for all;
    ``TASK EOF`` is that agent's end of file. Lines for other tasks are skipped.
    """

    def __init__(self, raw: LineSource, task: int) -> None:
        self._raw = raw
        self._me = str(task).encode()
        self._ended = False

    def readline(self) -> bytes:
        while not self._ended:
            line = self._raw.readline()
            if not line:
                self._ended = True
                break
            target, _, payload = line.partition(b" ")
            if target not in (self._me, b"*"):
                continue
            if payload.rstrip(b"\r\n") == b"EOF":
                self._ended = True
                break
            return payload
        return b""


def _own_address() -> str:
    """This host's name's address (where no route to the rendezvous is known)."""
    return socket.gethostbyname(socket.gethostname())


class Emitter:
    """Writes events to stdout, whole lines only; notices when nobody reads any more.
    ``pieced``: long lines go as pieces (an agent under srun; see ``protocol.pieces``)."""

    def __init__(self, stdout: BinaryIO, pieced: bool = False) -> None:
        self._stdout = stdout
        self._lock = threading.Lock()
        self._pieced = pieced
        self.broken = threading.Event()

    def __call__(self, event: AgentEvent) -> None:
        data = encode_event(event)
        if self._pieced and len(data) > PIECE_BYTES:
            data = b"".join(pieces(data))
        with self._lock:
            try:
                self._stdout.write(data)
                self._stdout.flush()
            except (OSError, ValueError):
                self.broken.set()  # hvdrun is gone: nobody to report to

    def try_emit(self, event: AgentEvent, timeout: float) -> None:
        """Emits from a helper thread: a stalled connection must not keep the agent alive."""
        thread = threading.Thread(target=self, args=(event,), daemon=True)
        thread.start()
        thread.join(timeout)


class Control:
    """What hvdrun asked for since the job started, and when it was last heard from."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.kill = False
        self.reason = ""
        self.own = False  # the agent stops the workers of its own accord (hvdrun went silent)
        #: The signal from outside hvdrun that stopped the workers (reported to hvdrun).
        self.signum: int | None = None
        self.last_heard = time.monotonic()
        #: Signals hvdrun forwards to the workers (SIGUSR1, SIGUSR2), taken by the run loop.
        self.forward: list[int] = []

    def request_stop(self, reason: str, kill: bool = False, own: bool = False) -> None:
        if not self.stop.is_set():
            self.reason, self.own = reason, own
        self.kill = self.kill or kill
        self.stop.set()

    def watch_stdin(self, stdin: LineSource, emit: Emitter) -> None:
        while True:
            line = stdin.readline()
            if not line:
                self.request_stop("hvdrun closed the connection")
                return
            self.last_heard = time.monotonic()
            try:
                request = decode_request(line)
            except ValueError:
                continue
            if isinstance(request, TerminateRequest):
                self.request_stop("asked to terminate")
                emit.try_emit(Stopping(), 1.0)  # (at once: hvdrun waits for this answer)
            elif isinstance(request, KillRequest):
                self.request_stop("asked to kill", kill=True)
            elif isinstance(request, SignalRequest) and request.signum in FORWARDED_SIGNALS:
                self.forward.append(request.signum)

    def heartbeat(self, timeout: float, lost_after: float, emit: Emitter) -> None:
        """Pings hvdrun every ``timeout`` / 4 s; stops the workers once hvdrun has been silent
        for ``lost_after`` s (``timeout`` where none is given; hvdrun pings often enough for
        the shorter of the two)."""
        interval = max(timeout / 4, 0.05)
        limit = lost_after if lost_after > 0 else timeout
        while not self.stop.wait(interval):
            emit(Ping())
            if time.monotonic() - self.last_heard > limit:
                self.request_stop(
                    f"it heard nothing from hvdrun for over {limit:g} s (hvdrun stopped or "
                    "starved of CPU, or the network between them down that long)",
                    own=True,
                )


def note(text: str) -> None:
    """A line on the agent's stderr, which hvdrun keeps for its error messages."""
    with contextlib.suppress(OSError, ValueError):  # hvdrun may be gone already
        sys.stderr.write(f"hvdrun agent: {text}\n")
        sys.stderr.flush()


def hello(slurm_task: int | None = None) -> Hello:
    step = None
    if slurm_task is not None:
        step = f"{os.environ.get('SLURM_JOB_ID', '?')}.{os.environ.get('SLURM_STEP_ID', '?')}"
    return Hello(
        protocol=PROTOCOL_VERSION,
        hostname=socket.gethostname(),
        pid=os.getpid(),
        **installed_versions(),
        node=os.environ.get("SLURMD_NODENAME") if slurm_task is not None else None,
        task=slurm_task,
        step=step,
    )


def host_cores() -> int:
    """The cores this process may run on (its affinity, else the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def omp_default(env: dict[str, str], workers: int) -> None:
    """OMP_NUM_THREADS unless the job set it: the host's cores shared among its workers
    (torch would otherwise start a thread per core in every worker)."""
    if not env.get("OMP_NUM_THREADS") and workers > 0:
        env["OMP_NUM_THREADS"] = str(max(1, host_cores() // workers))


def configure_logging(level: str) -> None:
    """The level hvdrun asked for (--verbose/--log-level); records go to stderr, which
    hvdrun shows as the agent's lines."""
    if not level:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("hvdrun agent: %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    logging.getLogger("launcher").setLevel(level)


def run(spec: AgentSpec, stdin: LineSource, emit: Emitter) -> int:
    configure_logging(spec.log_level)
    control = Control()

    def on_signal(signum: int, frame: object) -> None:
        if control.signum is None:
            control.signum = signum
        control.request_stop(f"received {signal.Signals(signum).name}")

    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, on_signal)
    threading.Thread(target=control.watch_stdin, args=(stdin, emit), daemon=True).start()
    if spec.heartbeat_timeout > 0:
        threading.Thread(
            target=control.heartbeat,
            args=(spec.heartbeat_timeout, spec.lost_after, emit),
            daemon=True,
        ).start()

    env = worker_base_env(os.environ, spec.env, spec.cwd)
    network_env(env, spec.rendezvous_addr, emit, spec.peers)
    omp_default(env, len(spec.workers))
    log.debug(
        "starting %d worker(s) on %s, OMP_NUM_THREADS=%s",
        len(spec.workers),
        socket.gethostname(),
        env.get("OMP_NUM_THREADS"),
    )
    relay = start_relay(spec, env)
    adopting = adopt_orphans()
    try:
        agent = HostAgent(spec, env, emit, adopting)
        agent.start(stop=control.stop)
        while not control.stop.is_set() and not emit.broken.is_set():
            while control.forward:
                agent.signal(control.forward.pop(0))
            agent.check_stops()
            if agent.wait(timeout=0.1):
                break
        stopped = control.stop.is_set() or emit.broken.is_set()
        if control.signum is not None:  # (hvdrun tells the job's end from a worker's fault)
            emit.try_emit(Signalled(control.signum), timeout=1.0)
        if stopped:
            reason = control.reason or "hvdrun stopped reading"
            note(f"stopping workers: {reason}")
            # (no grace once asked to kill)
            because = reason if control.own else None
            agent.terminate(hurry=lambda: control.kill, because=because)
        # (stopped: they had their SIGTERM and grace with the workers)
        grace = 0.0 if stopped or control.kill else min(spec.term_grace, ADOPTED_GRACE_S)
        agent.end_adopted(grace, hurry=lambda: control.kill)
    finally:
        if relay is not None:
            relay.stop()
    emit.try_emit(Done(), timeout=5.0)
    return 0


def answer_probe(request: ProbeRequest, stdin: LineSource, emit: Emitter) -> int:
    """``--check-hosts``: the host's facts; for a mesh probe, also a listener on the address
    its ranks would give Gloo, kept open until hvdrun is done (end of file, or any request
    after the :class:`ReachRequest` it answers), so that every other host can try it."""
    from launcher.agent.probe import gloo_listener, probe_host
    from launcher.transport.reachability import reach_peers

    facts = probe_host(request.connect_back, request.peers)
    listener = gloo_listener(facts) if request.mesh else None
    emit(Probe(facts))
    try:
        for line in iter(stdin.readline, b"") if request.mesh else ():
            try:
                asked = decode_request(line)
            except ValueError:
                continue
            if not isinstance(asked, ReachRequest):
                break
            emit(Reached(reach_peers(asked.targets)))
    finally:
        if listener is not None:
            listener.close()
    emit(Done())
    return 0


def main(shared_stdin: bool = False) -> int:
    """The agent; ``shared_stdin``: one task of an srun step, reading :class:`AddressedStdin`."""
    stdin: LineSource = sys.stdin.buffer
    task = None
    if shared_stdin:
        task = int(os.environ.get("SLURM_PROCID", "0"))
        stdin = AddressedStdin(stdin, task)
    emit = Emitter(sys.stdout.buffer, pieced=shared_stdin)
    # SIGUSR1/SIGUSR2 sent to the agent itself are Slurm's to a step (--signal=USR1@T,
    # scancel --signal): Slurm signals every process of the step, the workers too, so the
    # agent passes nothing on and must not die of them either. (A handler, not SIG_IGN:
    # the workers it starts would inherit an ignored signal.) hvdrun's own forwards come
    # as SignalRequests.
    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, lambda signum, frame: None)
    emit(hello(task))
    while True:
        line = stdin.readline()
        if not line:
            return 0  # hvdrun only wanted the hello, or gave up
        try:
            request = decode_request(line)
        except ValueError as exc:
            note(str(exc))
            return 2
        match request:
            case PrepareRequest(rendezvous_addr, peers):
                emit(Prepared(*pick_master(rendezvous_addr, _own_address, peers)))
                continue
            case ProbeRequest():
                return answer_probe(request, stdin, emit)
            case RunRequest(spec):
                return run(spec, stdin, emit)
            case TerminateRequest() | KillRequest():
                emit(Done())  # (stopped before it ran anything: an elastic host held back)
                return 0
            case SignalRequest():
                continue  # (no worker yet to pass it to: an elastic host held back)
        note(f"unexpected request {request.op!r}")
        return 2
