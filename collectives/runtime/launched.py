"""Joining a job that another launcher started: srun, mpirun, jsrun, torchrun, Kubernetes.

Under hvdrun, the launcher serves the job's rendezvous and tells every worker where it is.
Here nobody does, so rank 0 serves the same gRPC rendezvous in its own process and every
rank meets it at an address all of them can work out on their own:

* ``MASTER_ADDR:MASTER_PORT`` when set (Kubernetes' PyTorchJob sets them, and ``mpirun -x``
  or an sbatch script can). Without ``MASTER_PORT``: ``HVDRUN_RENDEZVOUS_PORT``, else a port
  derived from the job's id.
* torchrun: its agent already serves a TCPStore on ``MASTER_ADDR:MASTER_PORT``, so that port
  is taken; rank 0 serves on a free port and publishes its address in that store.
* Slurm: the first node of the step (where task 0 runs), found without DNS if need be (its
  ``NodeAddr``), and a port derived from the job and step id (``HVDRUN_RENDEZVOUS_PORT``
  overrides it).
* MPI (Open MPI, MPICH, Intel MPI, Cray) without ``MASTER_ADDR``: rank 0 sends its address
  over MPI when mpi4py is importable, and a fresh secret with it.

Rank 0 listens on every interface; the others dial the address and retry until rank 0
serves or ``HVDRUN_START_TIMEOUT`` passes (a program there that is not a gRPC server holds
the port rank 0 needed: they say so at once, or after ``NOT_GRPC_SECONDS`` when it is
silent). A rank whose Register stays unanswered asks again on a fresh connection every
``REGISTER_ATTEMPT_SECONDS`` (the call may have reached the round before's server as it
stopped, which answers it never). Each rank then points Gloo and NCCL at the
interface that faces the rendezvous (unless ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` are
set): a host's name need not resolve for its peers to reach it.

Authentication: ``HVDRUN_SECRET`` when set (srun and ``mpirun -x`` pass it on); under MPI a
fresh one from rank 0. Otherwise calls carry a token derived from the job's id, which keeps
out anyone who does not know the job, no weaker than torch's own TCPStore (which checks
nothing), and rank 0 says once that the rendezvous is unauthenticated. With a secret, a
rendezvous that other hosts reach speaks TLS: every rank derives the same certificate
authority from the secret (``rendezvous.tls.authority_from_secret``), so the secret never
crosses the network in clear text, and a rank with another secret fails its handshake and
says so at once.

The job ends as under hvdrun: when a rank dies the others' collectives fail within the Gloo
timeout, and when rank 0 (and with it the rendezvous) disappears the others notice on their
heartbeat stream and exit. Rank 0 leaving normally serves on until every other rank has left.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import hashlib
import ipaddress
import logging
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from collectives.runtime.registration import watch_and_join
from collectives.runtime.state import RuntimeState, Topology
from rendezvous import launchers, load_grpc, worker_env
from rendezvous.addresses import (
    interface_facing,
    is_loopback,
    join_addr,
    local_networks,
    outward_interface,
    source_address,
    split_addr,
)
from rendezvous.launchers import Placement, derived_port, node_address

if TYPE_CHECKING:
    from rendezvous.tls import SecretAuthority

__all__ = [
    "JoinError",
    "Joined",
    "Meeting",
    "detect_placement",
    "init_launched",
    "join",
    "plan_meeting",
]

logger = logging.getLogger(__name__)

#: Settings (HVDRUN_<name> or HOROVOD_<name>).
START_TIMEOUT = "START_TIMEOUT"
RENDEZVOUS_PORT = "RENDEZVOUS_PORT"
DEFAULT_START_TIMEOUT_SECONDS = 120.0
#: How often a rank retries a rendezvous that does not answer yet.
RETRY_SECONDS = 0.2
#: A listener at the rendezvous's address that is not a gRPC server (it closes connections,
#: or answers nothing) for this long holds the port: rank 0 could not serve there.
NOT_GRPC_SECONDS = 10.0
#: How long one Register waits for the other ranks before the rank asks again, on a fresh
#: connection: a call that reached a server as it stopped (the round before's, after an
#: ``hvd.shutdown()`` and ``hvd.init()``) can go unanswered while that connection stays
#: open, and would otherwise hold the rank until ``HVDRUN_START_TIMEOUT``.
REGISTER_ATTEMPT_SECONDS = 10.0
#: How much longer than its wait such a Register may go unanswered.
ATTEMPT_SLACK_SECONDS = 2.0
IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


class JoinError(RuntimeError):
    """The job another launcher started cannot be formed; the message says why and the fix."""


@dataclass
class Meeting:
    """Where the ranks of a job meet, and how they prove they belong to it."""

    #: HOST:PORT every rank other than 0 dials (rank 0 dials its own server on loopback).
    addr: str
    #: Rank 0: where its server listens; port 0 = any free port (published afterwards).
    bind_host: str
    port: int
    secret: str
    job_id: str
    #: In words, for messages: how the address was found, where the secret came from.
    how: str
    secret_from: str
    #: The secret is only a token derived from the job's id.
    unauthenticated: bool = False

    @property
    def encrypted(self) -> bool:
        """Whether the rendezvous speaks TLS: where other hosts reach it and the secret is
        one (``HVDRUN_SECRET``, or sent over MPI), not a token that anyone who knows the job
        id can make. Every rank decides alike."""
        return not self.unauthenticated and not is_loopback(self.bind_host)

    def authority(self) -> SecretAuthority | None:
        """Where the rendezvous speaks TLS, the certificate authority every rank derives
        from the secret (see :mod:`rendezvous.tls`); None for plain gRPC."""
        if not self.encrypted:
            return None
        from rendezvous.tls import authority_from_secret

        return authority_from_secret(self.secret)


@dataclass
class Joined:
    """A rank that has joined: its client, its place, and (rank 0) the server it serves."""

    placement: Placement
    meeting: Meeting
    client: Any  # rendezvous.client.RendezvousClient
    info: Any  # rendezvous.client.RankInfo
    server: Any | None = None  # rendezvous.server.RendezvousServer

    def leave(self) -> None:
        """Closes this rank's client; rank 0 serves until every other rank has left."""
        self.client.close()
        server, self.server = self.server, None
        if server is None:
            return
        announced = False
        while server.watching_ranks() - {self.info.rank}:
            if not announced:
                logger.info("rank 0 serves the rendezvous until the other ranks leave")
                announced = True
            time.sleep(0.1)
        server.stop()


def start_timeout() -> float:
    return worker_env.number(START_TIMEOUT, DEFAULT_START_TIMEOUT_SECONDS, strict=True)


def _token(placement: Placement) -> str:
    return "job-token-" + hashlib.sha256(placement.job_key.encode()).hexdigest()[:32]


def _job_id(placement: Placement, round_: int) -> str:
    """The job's id in its ``round_``-th ``hvd.init()`` (every rank counts its calls alike):
    a rank that calls ``init()`` again at once must not join the rendezvous of the round
    before, which rank 0 still serves until every other rank has left it (its server
    answers such a call as unavailable: the rank tries again)."""
    base = hashlib.sha256(("job-id/" + placement.job_key).encode()).hexdigest()[:16]
    return worker_env.round_job_id(base, round_)


def _port_of(placement: Placement) -> tuple[int, str]:
    configured = worker_env.setting(RENDEZVOUS_PORT)
    if configured is not None:
        if not configured.isdigit() or not 0 < int(configured) < 65536:
            raise JoinError(
                f"HVDRUN_RENDEZVOUS_PORT must be a port number (1-65535), got {configured!r}"
            )
        return int(configured), "HVDRUN_RENDEZVOUS_PORT"
    if placement.master_port is not None and not placement.agent_store:
        return placement.master_port, "MASTER_PORT"
    return derived_port(placement.job_key), "derived from the job id"


def _fix(placement: Placement) -> str:
    """How a user gives the job an address to meet at, in that launcher's words."""
    if placement.launcher == "mpi":
        return (
            "install mpi4py (rank 0 then sends its address over MPI), or pass rank 0's "
            "host: mpirun -x MASTER_ADDR=<rank 0's host> -x MASTER_PORT=<free port> ..."
        )
    if placement.launcher == "jsrun":
        return "export MASTER_ADDR=<rank 0's host> and MASTER_PORT=<free port> before jsrun"
    if placement.launcher == "slurm":
        return "export MASTER_ADDR=<the address of the step's first node> before srun"
    return "export MASTER_ADDR=<rank 0's host> and MASTER_PORT=<free port> on every rank"


def _loopback_name(host: str) -> bool:
    """Whether ``host`` says loopback itself (127.0.0.1, ::1, localhost), not by resolving."""
    return is_loopback(host) or host == "localhost"


def _wildcard(host: str) -> str:
    if _loopback_name(host):
        return "::1" if ":" in host else "127.0.0.1"
    return "::" if ":" in host else "0.0.0.0"


def plan_meeting(placement: Placement, round_: int = 1) -> Meeting:
    """Where this job's ranks meet in its ``round_``-th ``hvd.init()``, from what every
    rank knows alike (no communication).

    The MPI case without ``MASTER_ADDR`` and torchrun's agent store are settled in
    :func:`join` (they communicate); here they get a placeholder address."""
    secret = os.environ.get(worker_env.SECRET, "")
    secret_from = "HVDRUN_SECRET"
    unauthenticated = not secret
    if unauthenticated:
        secret, secret_from = _token(placement), "a token derived from the job id"
    job_id = _job_id(placement, round_)
    name = placement.name
    if placement.agent_store:
        addr = join_addr(placement.master_addr or "127.0.0.1", placement.master_port or 0)
        return Meeting(
            addr, _wildcard(placement.master_addr or ""), 0, secret, job_id,
            f"the address rank 0 publishes in torchrun's store at {addr}", secret_from,
            unauthenticated,
        )  # fmt: skip
    if placement.master_addr:
        port, port_from = _port_of(placement)
        host = placement.master_addr
        return Meeting(
            join_addr(host, port), _wildcard(host), port, secret, job_id,
            f"MASTER_ADDR={host} and port {port} ({port_from})", secret_from, unauthenticated,
        )  # fmt: skip
    if placement.launcher == "slurm" and placement.first_host:
        first = placement.first_host
        address = node_address(first)
        if address is None:
            raise JoinError(
                f"hvd.init(): started by {name} as rank {placement.rank} of "
                f"{placement.size}, but the address of {first}, the step's first node (where "
                f"rank 0 serves the rendezvous), is unknown: the name does not resolve and "
                f"Slurm knows no NodeAddr for it. Fix: {_fix(placement)}"
            )
        port, port_from = _port_of(placement)
        bind = _wildcard(address)
        if is_loopback(address) and spans_hosts(placement):
            # The first node itself, whose name resolves to loopback here (Debian's
            # 127.0.1.1): listen for the other nodes too, and meet by the name.
            address, bind = first, "::" if ":" in address else "0.0.0.0"
        return Meeting(
            join_addr(address, port), bind, port, secret, job_id,
            f"the step's first node {first} ({address}) and port {port} ({port_from})",
            secret_from, unauthenticated,
        )  # fmt: skip
    if placement.launcher == "mpi":
        return Meeting(
            "", "0.0.0.0", 0, secret, job_id, "sent by rank 0 over MPI", secret_from,
            unauthenticated,
        )  # fmt: skip
    raise JoinError(
        f"hvd.init(): started by {name} as rank {placement.rank} of {placement.size}, but "
        f"there is no address to meet rank 0 at (MASTER_ADDR is not set). Fix: {_fix(placement)}"
    )


# ---- the address sent over MPI -----------------------------------------------------------


def choose_address(own: list[str], peers: list[list[str]]) -> str:
    """Rank 0's address that most other ranks share a network with.

    ``own``/``peers``: each rank's IPv4 interfaces as ``address/prefix`` (rank 0's first);
    loopback when every rank is on rank 0's host (all report the same interfaces)."""
    mine = [ipaddress.IPv4Interface(text) for text in own]
    if not mine or all(sorted(p) == sorted(own) for p in peers):
        return "127.0.0.1"
    best, score = mine[0], -1
    for interface in mine:
        reached = sum(
            any(ipaddress.IPv4Interface(text).ip in interface.network for text in peer)
            for peer in peers
        )
        if reached > score:
            best, score = interface, reached
    return str(best.ip)


def _over_mpi(placement: Placement, meeting: Meeting, serve: Any) -> Meeting:
    """MPI without MASTER_ADDR: rank 0 serves, then sends address and secret to everyone.

    MPI's start-up (``MPI_Init`` as mpi4py loads) and the exchange wait for every rank with
    no timeout of their own, holding Python's lock: after :envvar:`HVDRUN_START_TIMEOUT` this
    process says why and exits with status 1 (see :func:`_watchdog`), and mpirun then ends
    the job, as the other launchers' ranks give up by then."""
    timeout = start_timeout()
    message = (
        f"hvdrun: hvd.init(): rank {placement.rank} of {placement.size} ({placement.name}) "
        f"waited {timeout:g} s (HVDRUN_START_TIMEOUT) in MPI's start-up for the other ranks "
        "(MPI_Init and rank 0's rendezvous address, over mpi4py): not every rank has reached "
        "hvd.init(); exiting"
    )
    with _watchdog(timeout, message):
        return _exchange_over_mpi(placement, meeting, serve)


#: The watchdog's voice: says ``$2`` after ``$1`` seconds, unless its stdin (a pipe the
#: parent holds) closes first: the parent is done, or gone.
_WATCHDOG = 'timeout "$1" cat >/dev/null; [ $? -eq 124 ] && printf "%s\\n" "$2" >&2'

#: How long after the message the process exits (the message comes first).
_EXIT_AFTER_MESSAGE = 0.25


@contextlib.contextmanager
def _watchdog(seconds: float, message: str) -> Iterator[None]:
    """Ends this process with exit status 1 once ``seconds`` have passed inside the block,
    a small shell process saying ``message`` first. The exit is faulthandler's: a C thread
    of its own, which needs no Python lock, ``_exit(1)`` after its traceback (which goes to
    /dev/null) -- a status mpirun reports as an exit, where a SIGKILL read as the OOM
    killer's."""
    read, write = os.pipe()
    try:
        voice = subprocess.Popen(
            ["/bin/sh", "-c", _WATCHDOG, "hvdrun-watchdog", f"{seconds:g}", message],
            stdin=read, stdout=subprocess.DEVNULL, close_fds=True,
        )  # fmt: skip
    finally:
        os.close(read)
    sink = open(os.devnull, "w")  # noqa: SIM115 (open until the block ends)
    faulthandler.dump_traceback_later(seconds + _EXIT_AFTER_MESSAGE, exit=True, file=sink)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        sink.close()
        os.close(write)
        voice.wait()


def _exchange_over_mpi(placement: Placement, meeting: Meeting, serve: Any) -> Meeting:
    try:
        from mpi4py import MPI
    except Exception as error:  # ImportError, or no MPI library for it to load
        raise JoinError(
            f"hvd.init(): started by {placement.name} as rank {placement.rank} of "
            f"{placement.size}, but there is no address to meet rank 0 at: MASTER_ADDR is not "
            f"set and mpi4py cannot be used ({type(error).__name__}: {error}). "
            f"Fix: {_fix(placement)}"
        ) from None
    comm = MPI.COMM_WORLD
    if comm.Get_size() != placement.size or comm.Get_rank() != placement.rank:
        raise JoinError(
            f"hvd.init(): MPI's COMM_WORLD says rank {comm.Get_rank()} of {comm.Get_size()}, "
            f"the environment of {placement.name} says rank {placement.rank} of "
            f"{placement.size}"
        )
    networks = [str(interface) for interface in local_networks()]
    everyone = comm.gather(networks, root=0)
    sent: tuple[str, str, str] | None = None
    if everyone is not None:  # rank 0
        address = choose_address(networks, list(everyone[1:]))
        secret = meeting.secret
        if meeting.unauthenticated:
            secret = worker_env.new_secret()
        bind = _wildcard(address)
        port = serve(Meeting("", bind, 0, secret, meeting.job_id, "", ""))
        sent = (join_addr(address, port), secret, meeting.job_id)
    addr, secret, job_id = comm.bcast(sent, root=0)
    from_env = not meeting.unauthenticated
    return Meeting(
        addr, _wildcard(split_addr(addr)[0]), 0, secret, job_id, "sent by rank 0 over MPI",
        meeting.secret_from if from_env else "sent by rank 0 over MPI",
    )  # fmt: skip


def _torchrun_store(placement: Placement, timeout: float) -> Any:
    import torch.distributed as dist

    return dist.TCPStore(
        placement.master_addr or "127.0.0.1",
        placement.master_port or 29500,
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout),
    )


# ---- joining -------------------------------------------------------------------------------


def spans_hosts(placement: Placement) -> bool:
    """Whether the job may have ranks on other hosts than this one: WORLD_SIZE above
    LOCAL_WORLD_SIZE (or the launcher's like), or, where the local size is unknown, any
    other rank at all."""
    if placement.local_size is not None:
        return placement.size > placement.local_size
    return placement.size > 1


def _point_gloo_at(
    addr: str, before: Sequence[str] = (), spans: bool = False, guessed: bool = False
) -> list[str]:
    """Gloo and NCCL use the interface that faces the rendezvous, unless the user chose;
    returns the variables it set. ``before``: those a call for another address set.
    ``spans``: the job has ranks on other hosts, where loopback would not do: a rendezvous
    by a name this host resolves to a loopback address (Debian's 127.0.1.1 for its own name)
    gets the default route's interface instead. ``guessed``: whether it does is not known
    (no local size), so it may."""
    for name in before:
        os.environ.pop(name, None)
    chosen = [name for name in IFNAME_VARIABLES if not os.environ.get(name)]
    if not chosen:
        return []
    ifname, local = interface_facing(addr)
    # (``local`` is known only for an address that parses)
    named_loopback = (
        local is not None and is_loopback(local) and not _loopback_name(split_addr(addr)[0])
    )
    if spans and named_loopback:
        outward = outward_interface()
        if outward is not None:
            has = (
                "may have ranks on other hosts (the launcher gives no local size; "
                "LOCAL_WORLD_SIZE tells)"
                if guessed
                else "has ranks on other hosts"
            )
            logger.warning(
                "hvd.init(): the rendezvous %s is reached over loopback on this host "
                "(%s), but the job %s: Gloo and NCCL use %s, the default route's "
                "interface, instead (set GLOO_SOCKET_IFNAME to choose)",
                addr, local, has, outward,
            )  # fmt: skip
            ifname = outward
    if ifname is None:
        return []
    for name in chosen:
        os.environ[name] = ifname
    return chosen


def _other_secret(placement: Placement, meeting: Meeting, refusal: str) -> str:
    """A rank that reached the rendezvous but whose secret or TLS differs from rank 0's."""
    if not meeting.encrypted:
        what = f"this rank sent {meeting.secret_from}"
    else:
        what = (
            "this rank speaks TLS to it, trusting only the certificate authority derived "
            f"from {meeting.secret_from}"
        )
    return (
        f"hvd.init(): rank {placement.rank} of {placement.size} ({placement.name}) reached "
        f"{meeting.addr} ({meeting.how}), but {refusal} ({what}): rank 0 "
        "has another HVDRUN_SECRET, or none. Give every rank the same HVDRUN_SECRET (or "
        "another program holds that port: then give every rank a free one with "
        "HVDRUN_RENDEZVOUS_PORT or MASTER_PORT)"
    )


#: Rank 0 of a job whose rendezvous speaks TLS, on the ranks that never registered: a rank
#: whose secret differs fails its handshake, which the server never sees.
_UNSEEN_OVER_TLS = (
    ". This rendezvous speaks TLS: a rank whose HVDRUN_SECRET differs from rank 0's cannot "
    "connect to it at all, and says so in its own output"
)


#: What a rank says of a server that answered its registration with UNIMPLEMENTED.
_UNKNOWN_CALL = (
    "answers as a gRPC (HTTP/2) server without the rendezvous' calls (or is the rendezvous "
    "of an hvdrun of another version)"
)


def _foreign(rank: int, placement: Placement, meeting: Meeting, what: str, certain: bool) -> str:
    """The error of a rank that reached another program than rank 0's rendezvous."""
    return (
        f"hvd.init(): rank {rank} of {placement.size} ({placement.name}) reached "
        f"{meeting.addr} ({meeting.how}), but the program there is not hvdrun's rendezvous: "
        f"it {what}. Another program holds that port, so rank 0 cannot serve the job there: "
        "give every rank a free port with HVDRUN_RENDEZVOUS_PORT (or MASTER_PORT)"
        + _tls_hint(meeting, certain)
    )


def _tls_hint(meeting: Meeting, certain: bool) -> str:
    """Where a rank without a secret finds its connections closed: rank 0 may be one with
    a secret, whose rendezvous speaks TLS only."""
    if certain or not meeting.unauthenticated or is_loopback(meeting.bind_host):
        return ""
    return (
        ". Or rank 0 has HVDRUN_SECRET and this rank has none: then rank 0's rendezvous "
        "speaks TLS only, and every rank needs the same HVDRUN_SECRET"
    )


#: How each launcher hands a variable exported where it starts to every rank.
_PASSES_ON = {
    "slurm": "srun passes it on",
    "mpi": "with mpirun -x HVDRUN_SECRET",
    "jsrun": "jsrun passes it on",
    "torchrun": "torchrun passes it on",
}


def unauthenticated_warning(placement: Placement, meeting: Meeting) -> str:
    """What rank 0 says of a rendezvous without HVDRUN_SECRET (once a process)."""
    how = _PASSES_ON.get(placement.launcher, "the same on every rank")
    return (
        "hvd.init(): this job's rendezvous is not authenticated (no HVDRUN_SECRET): a process "
        f"that knows the job id and reaches {meeting.addr} could join it. Export "
        f"HVDRUN_SECRET=<a random string> to every rank ({how}) to require it."
    )


def _say_unauthenticated(placement: Placement, meeting: Meeting) -> None:
    with contextlib.suppress(Exception):  # stderr may be closed
        sys.stderr.write(unauthenticated_warning(placement, meeting) + "\n")
        sys.stderr.flush()


def join(placement: Placement, host: str, round_: int = 1) -> Joined:
    """Meets the job's other ranks (rank 0 serves) in the process's ``round_``-th
    ``hvd.init()`` and registers; raises :class:`JoinError`."""
    load_grpc()
    from rendezvous.client import (
        RendezvousAuthError,
        RendezvousClient,
        RendezvousError,
        RendezvousTimeout,
        RendezvousUnavailable,
    )
    from rendezvous.server import RendezvousServer

    timeout = start_timeout()
    deadline = time.monotonic() + timeout
    rank = placement.rank
    meeting = plan_meeting(placement, round_)
    servers: list[RendezvousServer] = []
    published = f"hvdrun/{placement.job_key}/rendezvous/{round_}"  # (torchrun's store)

    def serve(served: Meeting) -> int:
        authority = served.authority()
        server = RendezvousServer(
            [], served.secret, served.job_id, bind_host=served.bind_host, port=served.port,
            placed_size=placement.size,
            tls=authority.server_certificate() if authority is not None else None,
        )  # fmt: skip
        try:
            bound = server.start()
        except OSError as error:
            raise JoinError(
                f"hvd.init(): rank 0 cannot serve the rendezvous on port {served.port} "
                f"({meeting.how}): {error}. Choose a free port with HVDRUN_RENDEZVOUS_PORT "
                "(or MASTER_PORT) on every rank"
            ) from None
        servers.append(server)
        return bound

    try:
        agent_store = _torchrun_store(placement, timeout) if placement.agent_store else None
        if placement.launcher == "mpi" and not meeting.addr:
            meeting = _over_mpi(placement, meeting, serve)
        elif rank == 0:
            port = serve(meeting)
            if agent_store is not None:
                host_part = placement.master_addr or "127.0.0.1"
                if not is_loopback(host_part) and host_part != "localhost":
                    host_part = source_address(host_part) or host_part
                meeting.addr = join_addr(host_part, port)
                agent_store.set(published, meeting.addr.encode())
        elif agent_store is not None:
            try:
                meeting.addr = agent_store.get(published).decode()
            except RuntimeError as error:  # (torch's DistStoreError: a timeout)
                raise JoinError(
                    f"hvd.init(): rank {rank} of {placement.size} ({placement.name}) did not "
                    f"hear from rank 0 within {timeout:g} s (HVDRUN_START_TIMEOUT): rank 0 "
                    "publishes the job's rendezvous in its hvd.init(); did it get there? "
                    f"({error})"
                ) from None
        if rank == 0 and meeting.unauthenticated and round_ == 1:  # (said once a process)
            _say_unauthenticated(placement, meeting)
        spans, guessed = spans_hosts(placement), placement.local_size is None
        pointed = _point_gloo_at(meeting.addr, spans=spans, guessed=guessed)
        dial = meeting.addr
        if servers:  # rank 0 reaches its own server on loopback, whatever the address
            loopback = "::1" if ":" in meeting.bind_host else "127.0.0.1"
            dial = join_addr(loopback, servers[0].port)
        local_rank = placement.local_rank if placement.local_rank is not None else -1
        peers = launchers.local_peers(placement.host or host, placement.agent)
        authority = meeting.authority()
        root_pem = authority.root_pem if authority is not None else None
        # Who registers: the server refuses this rank to another process while this one
        # holds it (two jobs meeting at one address), but lets this one ask again.
        process = f"pid {os.getpid()} on host {placement.host or host!r}, {secrets.token_hex(3)}"
        foreign_since: float | None = None  # (see NOT_GRPC_SECONDS)
        while True:
            # Each try on a fresh connection: the server there may be the round before's,
            # whose shutdown (and a call it took but never answers) is none of this one's.
            client = RendezvousClient(dial, meeting.secret, meeting.job_id, cert_pem=root_pem)
            remaining = deadline - time.monotonic()
            last = remaining <= REGISTER_ATTEMPT_SECONDS + ATTEMPT_SLACK_SECONDS
            wait = max(remaining, 0.1) if last else REGISTER_ATTEMPT_SECONDS
            try:
                info = client.register(
                    peers, local_rank, timeout=wait, rank=rank, size=placement.size,
                    deadline=None if last else wait + ATTEMPT_SLACK_SECONDS, process=process,
                )  # fmt: skip
                break
            except RendezvousError as error:
                client.close()
                if isinstance(error, RendezvousTimeout):
                    if not last:  # (the others still coming, or a call lost: see above)
                        continue
                    raise JoinError(
                        f"hvd.init(): {placement.name} started {placement.size} processes, "
                        f"but not all of them joined within {timeout:g} s "
                        f"(HVDRUN_START_TIMEOUT): {error}"
                        + (_UNSEEN_OVER_TLS if servers and authority is not None else "")
                    ) from None
                if isinstance(error, RendezvousAuthError) and error.refused_secret:
                    raise JoinError(
                        _other_secret(placement, meeting, "it refused this rank's secret")
                    ) from None
                if error.unknown_call:
                    raise JoinError(
                        _foreign(rank, placement, meeting, _UNKNOWN_CALL, certain=True)
                    ) from None
                if not isinstance(error, RendezvousUnavailable):
                    raise JoinError(
                        f"hvd.init(): rank {rank} ({placement.name}) could not join the job "
                        f"at {meeting.addr}: {error}"
                    ) from None
                refusal = error.tls_refusal()
                if refusal is not None:
                    raise JoinError(_other_secret(placement, meeting, refusal)) from None
                foreign = error.not_grpc()
                if foreign is None:
                    foreign_since = None
                else:
                    what, certain = foreign
                    foreign_since = foreign_since or time.monotonic()
                    if certain or time.monotonic() - foreign_since >= NOT_GRPC_SECONDS:
                        raise JoinError(_foreign(rank, placement, meeting, what, certain)) from None
                if time.monotonic() + RETRY_SECONDS >= deadline:
                    raise JoinError(
                        f"hvd.init(): rank {rank} of {placement.size} ({placement.name}) could "
                        f"not reach the rendezvous that rank 0 serves at {meeting.addr} "
                        f"({meeting.how}) within {timeout:g} s: {error}. Is rank 0 running "
                        "there? (HVDRUN_START_TIMEOUT sets how long to wait)"
                    ) from None
                time.sleep(RETRY_SECONDS)
                if agent_store is not None and rank != 0:
                    # torchrun's store outlives its worker groups: what this rank read may
                    # be the address of the group before's rank 0 (a scale-up keeps the
                    # restart count); the one rank 0 publishes now replaces it.
                    with contextlib.suppress(RuntimeError):
                        fresh = agent_store.get(published).decode()
                        if fresh != meeting.addr:
                            dial = meeting.addr = fresh
                            pointed = _point_gloo_at(fresh, pointed, spans, guessed)
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return Joined(placement, meeting, client, info, servers[0] if servers else None)


# ---- the runtime's entry points ------------------------------------------------------------


def detect_placement() -> Placement | None:
    """Who started this process, if another launcher did; None for a process on its own.

    Raises :class:`JoinError` for launcher variables that cannot describe a job, and for a
    process inside a Slurm allocation of several tasks but outside any job step (a batch
    script or an ``salloc`` shell that forgot ``srun``), which would otherwise train alone.
    """
    try:
        placement = launchers.detect()
        if placement is not None or os.environ.get(launchers.LAUNCHER_VARIABLE) == "none":
            return placement
        allocation = launchers.slurm_allocation()
    except launchers.DetectionError as error:
        raise JoinError(f"hvd.init(): {error}") from None
    if allocation is not None and allocation.tasks > 1:
        raise JoinError(
            f"hvd.init(): this process runs in the Slurm {allocation.where} of job "
            f"{allocation.job_id} ({allocation.tasks} tasks on {len(allocation.nodes)} "
            "node(s)), not as a task of a job step, so it would train alone. Start it with "
            "srun (srun python train.py) or hvdrun (hvdrun python train.py); "
            "HVDRUN_LAUNCHER=none runs it alone on purpose"
        )
    return None


def init_launched(
    placement: Placement, backend: str, timeout: datetime.timedelta, counter: int
) -> RuntimeState:
    """Joins the job ``placement`` describes and creates the default process group."""
    joined = join(placement, socket.gethostname(), counter)
    info = joined.info
    runtime_ = RuntimeState(
        topology=Topology(
            info.rank, info.size, info.local_rank, info.local_size, info.cross_rank, info.cross_size
        ),
        backend=backend,
        timeout=timeout,
        store=None,
        client=joined.client,
        rendezvous_addr=joined.meeting.addr,
        started_by=placement.name,
        leave=joined.leave,
        host=placement.host or socket.gethostname(),
    )
    try:
        with _departures_fail_the_set_up(joined, placement):
            watch_and_join(runtime_, counter)
    except BaseException:
        joined.leave()
        raise
    return runtime_


#: How often rank 0 looks for ranks that left while the job's ranks connect.
DEPARTURE_POLL_SECONDS = 0.2
#: How long after joining a rank may go without its rendezvous stream (each opens it at
#: once) before rank 0 counts it as gone: one that fails at once may close before it opened.
DEPARTURE_GRACE_SECONDS = 10.0


@contextlib.contextmanager
def _departures_fail_the_set_up(joined: Joined, placement: Placement) -> Iterator[None]:
    """Rank 0, while the ranks connect (``init_process_group``): a rank whose connection to
    the rendezvous closes there, or never opens (its CUDA or NCCL set-up raised, it was
    killed; see :data:`DEPARTURE_GRACE_SECONDS`), makes every rank's wait in the rendezvous
    store fail at once, naming it. Without this the others would wait out the collectives'
    timeout (300 s), since no launcher may stop them (srun without -K, a Kubernetes job)."""
    server = joined.server
    if server is None:
        yield
        return
    from rendezvous.server.common import list_ranks  # (rank 0 serves: gRPC is loaded)

    done = threading.Event()

    def watch() -> None:
        grace_ends = time.monotonic() + DEPARTURE_GRACE_SECONDS
        while not done.wait(DEPARTURE_POLL_SECONDS):
            try:
                left = server.left_ranks()
                if time.monotonic() > grace_ends:  # (one that left before its stream opened)
                    left |= set(range(placement.size)) - server.watching_ranks()
            except TimeoutError:  # (a loaded machine: ask again)
                continue
            if left:
                ranks = ("rank " if len(left) == 1 else "ranks ") + list_ranks(sorted(left))
                server.abandon(
                    f"{ranks} of {placement.size} ({placement.name}) left the job after "
                    "joining it, before connecting to the others (its own output says why)"
                )
                return

    thread = threading.Thread(target=watch, name="hvdrun-departures", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
