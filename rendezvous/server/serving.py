"""RendezvousServer: starting and stopping one job's gRPC server, and the launcher's window
onto its state.

Why it looks the way it does:

* The server runs on the process's shared asyncio loop (:mod:`rendezvous.server.loop`), so
  :meth:`RendezvousServer.start` returns as soon as the port is bound and the launcher keeps
  its own, synchronous, code.
* gRPC core's defaults assume a multi-threaded server: it randomly cancels new calls once
  1000 wait to be picked up. The server raises that backlog limit, since a job's workers all
  call at once by design.
* Every worker, relay and stray connection holds a file descriptor, and the usual soft limit
  of 1024 is reached by a job of a thousand hosts, or by anyone who opens a thousand idle
  connections to the port (new connections then wait in vain, and the job's workers fail
  to register): starting a server raises its process's soft limit towards the hard one
  (:func:`raise_open_files_limit`).
* Stopping sends SHUTDOWN on every Watch stream and waits (boundedly) for those to go out
  before the server cancels what is left, so workers learn why the job ended.
* The job's state belongs to the loop. The launcher's threads (the fixed supervisor's
  status line, the elastic driver, a placed job's rank 0 waiting for the others to leave)
  read it through :meth:`RendezvousServer.registered_count`,
  :meth:`~RendezvousServer.waiting_slots`, :meth:`~RendezvousServer.watching_ranks`,
  :meth:`~RendezvousServer.left_ranks` and
  :meth:`~RendezvousServer.values_under`,
  which run a small coroutine on the loop and wait for its answer: no lock is shared with
  the loop, and an answer is never a half-made change.

Threads: ``_loop_thread``, ``_port`` and ``_stopped`` are read and written under
``_state_lock`` only (any thread may start, stop, publish or ask); ``_server`` is touched on
the loop only (it is made in ``_start_server`` and dropped in ``_stop_server``). The
configuration fields and ``_servicer`` are set in ``__init__`` and never replaced; the
servicer itself is used on the loop only.
"""

from __future__ import annotations

import concurrent.futures
import errno
import logging
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import TypeVar

import grpc
import grpc.aio

from rendezvous import rendezvous_pb2_grpc
from rendezvous.server.common import LOGGER_NAME, SHUTDOWN_MESSAGE
from rendezvous.server.guard import GuardInterceptor
from rendezvous.server.loop import LoopThread
from rendezvous.server.servicer import Servicer
from rendezvous.slots import SlotInfo
from rendezvous.tls import JobCertificate

logger = logging.getLogger(LOGGER_NAME)

_T = TypeVar("_T")


class ListenError(OSError):
    """The server cannot listen on the address it was given; the message is for the user."""


def _listen_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be bound here, found by binding a plain socket first (as
    gRPC would, with SO_REUSEADDR): gRPC itself only says "Failed to bind to address", and
    logs a line of its own. None when it can be bound (or the name does not resolve: gRPC
    then says so)."""
    try:
        infos = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE | socket.AI_NUMERICSERV
        )
    except (OSError, UnicodeError):
        return None
    problems: list[str] = []
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(sockaddr)
        except OSError as error:
            problems.append(_bind_problem(error, port))
            continue
        return None
    return problems[0] if problems else None


def _bind_problem(error: OSError, port: int) -> str:
    if error.errno == errno.EADDRINUSE:
        return f"port {port} is in use"
    if error.errno == errno.EADDRNOTAVAIL:
        return "it is not an address of this machine"
    if error.errno == errno.EACCES:
        return f"port {port} needs privileges to listen on"
    return error.strerror or str(error)


#: How long a question to the server's loop (the supervisor's, about the job's state) waits
#: for its answer; then it raises TimeoutError, which the supervisors ride out.
ASK_SECONDS = 30.0


#: What :func:`raise_open_files_limit` raises the soft open-files limit to, at most.
OPEN_FILES = 65536


def raise_open_files_limit(wanted: int = OPEN_FILES) -> None:
    """Raises this process's soft limit on open files to ``wanted``, or to its hard limit
    where that is lower; never lowers it. (Processes it starts inherit the new limit.)"""
    try:
        import resource
    except ImportError:  # (not on Unix)
        return
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        if soft == resource.RLIM_INFINITY or soft >= target:
            return
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (OSError, ValueError) as error:
        logger.debug("cannot raise the limit on open files: %s", error)
        return
    logger.debug("raised the limit on open files from %d to %d", soft, target)


def _check_slots(slots: Sequence[SlotInfo]) -> None:
    seen: set[tuple[str, int]] = set()
    for slot in slots:
        if (slot.hostname, slot.local_rank) in seen:
            raise ValueError(f"duplicate slot: host {slot.hostname!r} local_rank {slot.local_rank}")
        seen.add((slot.hostname, slot.local_rank))


class RendezvousServer:
    """One job's rendezvous service, served from a daemon thread of the calling process.

    ``slots`` is the job's slot table (see :func:`rendezvous.slots.assign_slots`); workers
    register with ``(hostname, local_rank)`` and learn their :class:`SlotInfo`. A job that
    another launcher placed passes ``placed_size`` (its number of ranks) and no slots:
    workers register with the rank that launcher gave them, and the table is derived from the
    hosts they register from (:func:`rendezvous.slots.derive_slots`).

    ``tls`` (the job's :class:`~rendezvous.tls.JobCertificate`) makes it serve TLS only; its
    clients then pin that certificate. Without it the server speaks plain HTTP/2, which is
    only for servers bound to loopback.
    """

    def __init__(
        self,
        slots: Sequence[SlotInfo],
        secret: str,
        job_id: str,
        *,
        bind_host: str = "0.0.0.0",
        port: int = 0,
        heartbeat_interval: float = 1.0,
        max_value_bytes: int = 4 * 1024 * 1024,
        elastic: bool = False,
        placed_size: int | None = None,
        tls: JobCertificate | None = None,
    ) -> None:
        if not secret:
            raise ValueError("the job secret must not be empty")
        if heartbeat_interval <= 0:
            raise ValueError(f"heartbeat_interval must be positive, got {heartbeat_interval}")
        if max_value_bytes < 1:
            raise ValueError(f"max_value_bytes must be positive, got {max_value_bytes}")
        if placed_size is not None and (placed_size < 1 or slots or elastic):
            raise ValueError("placed_size: a positive job size, with no slots, not elastic")
        _check_slots(slots)
        self._secret = secret
        self._job_id = job_id
        self._bind_host = bind_host
        self._requested_port = port
        self._max_value_bytes = max_value_bytes
        self._tls = tls
        self._servicer = Servicer(
            list(slots), heartbeat_interval, max_value_bytes, elastic, placed_size
        )
        self._loop_thread: LoopThread | None = None
        self._server: grpc.aio.Server | None = None
        self._port: int | None = None
        self._state_lock = threading.Lock()
        self._stopped = False

    def __repr__(self) -> str:  # never shows the secret
        with self._state_lock:
            port = self._port
        return f"RendezvousServer(job_id={self._job_id!r}, port={port})"

    @property
    def port(self) -> int:
        """The bound port; only valid after :meth:`start`."""
        with self._state_lock:
            port = self._port
        if port is None:
            raise RuntimeError("the rendezvous server has not been started")
        return port

    def start(self) -> int:
        """Binds and starts serving on the rendezvous loop thread; returns the bound port."""
        with self._state_lock:
            if self._stopped:
                raise RuntimeError("a stopped rendezvous server cannot be started again")
            if self._port is not None:
                return self._port
            raise_open_files_limit()
            loop_thread = LoopThread.get()
            port = loop_thread.run(self._start_server(), timeout=30)
            self._loop_thread = loop_thread
            self._port = port
        logger.info("rendezvous server for job %s listening on port %d", self._job_id, port)
        return port

    async def _start_server(self) -> int:
        message_limit = 2 * self._max_value_bytes + 1024 * 1024
        server = grpc.aio.server(
            interceptors=[GuardInterceptor(self._secret, self._job_id)],
            options=[
                # A value somewhat over the limit must still reach the handler, which answers
                # INVALID_ARGUMENT with a clear message instead of a transport error.
                ("grpc.max_receive_message_length", message_limit),
                ("grpc.max_send_message_length", message_limit),
                # Two servers must never share a port silently.
                ("grpc.so_reuseport", 0),
                # gRPC core randomly cancels new calls once more than 1000 wait to be picked
                # up by the (single-threaded) server loop. Thousands of workers calling at
                # once are normal here, so allow a deep backlog instead.
                ("grpc.server.max_pending_requests", 100_000),
                ("grpc.server.max_pending_requests_hard_limit", 200_000),
                # Clients ping during long blocking calls to notice a cut network.
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_recv_ping_interval_without_data_ms", 5000),
                ("grpc.http2.max_ping_strikes", 0),
            ],
        )
        rendezvous_pb2_grpc.add_RendezvousServicer_to_server(self._servicer, server)
        host = self._bind_host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        address = f"{host}:{self._requested_port}"
        problem = _listen_problem(self._bind_host.strip("[]"), self._requested_port)
        if problem is not None:
            raise ListenError(f"cannot listen on {address}: {problem}")
        try:
            if self._tls is not None:
                port = server.add_secure_port(address, self._tls.server_credentials())
            else:
                port = server.add_insecure_port(address)
        except RuntimeError as error:
            raise ListenError(f"cannot listen on {address}: {error}") from None
        if port == 0:
            raise ListenError(f"cannot listen on {address}")
        await server.start()
        self._server = server
        return port

    def stop(self, grace: float = 0.5) -> None:
        """Sends SHUTDOWN on every Watch stream, fails blocked calls, and stops serving."""
        with self._state_lock:
            if self._stopped:
                return
            self._stopped = True
            loop_thread = self._loop_thread
        if loop_thread is None:
            return
        try:
            loop_thread.run(self._stop_server(grace), timeout=max(grace, 1.0) + grace + 10)
        except Exception:
            logger.exception("error while stopping the rendezvous server")
        logger.info("rendezvous server for job %s stopped", self._job_id)

    async def _stop_server(self, grace: float) -> None:
        self._servicer.begin_shutdown(SHUTDOWN_MESSAGE)
        # Let every Watch stream send its SHUTDOWN before the server cancels what is left
        # (bounded: a stalled client must not hold up the launcher).
        await self._servicer.wait_watches_closed(max(grace, 1.0))
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace)

    def registered_count(self) -> int:
        """How many distinct slots have registered so far (elastic: in the newest generation)."""
        return self._ask(self._servicer.registered_count, 0)

    def registered_slots(self) -> frozenset[tuple[str, int]]:
        """The (host, local rank) slots that registered so far (elastic: in the newest
        generation)."""
        return self._ask(self._servicer.registered_slots, frozenset())

    def publish(self, slots: Sequence[SlotInfo]) -> int:
        """Elastic jobs: makes ``slots`` the newest membership generation; returns its number.

        Workers waiting in ``Register`` for it get their new places; running workers see the
        number on their Watch stream; bootstraps of older generations that still wait fail.
        """
        _check_slots(slots)
        with self._state_lock:
            loop_thread = self._loop_thread
        if loop_thread is None:
            raise RuntimeError("the rendezvous server has not been started")

        async def publish() -> int:
            return self._servicer.publish(slots)

        return loop_thread.run(publish(), timeout=30)

    def waiting_slots(self) -> set[tuple[str, int]]:
        """Elastic jobs: (host, local_rank) of workers blocked in Register until a generation
        newer than the newest is published (survivors of a failed collective)."""
        return self._ask(self._servicer.waiting_slots, set())

    def state_holders(self) -> dict[int, int]:
        """Elastic jobs: the workers that hold the training state (by number), and the
        generation each last synced it in."""
        return self._ask(self._servicer.state_holders, {})

    def abandon(self, message: str) -> None:
        """The job cannot connect: every read of the store that waits for a key, blocked now
        or later, fails with ABORTED ``message`` (the ranks then leave; it serves on)."""
        self._ask(lambda: self._servicer.abandon(message), None)

    def call_roll(self) -> int:
        """Elastic jobs: every worker's watch stream carries a new roll call, which each
        worker answers from its watch thread; returns its number (0: the server is down)."""
        return self._ask(self._servicer.call_roll, 0)

    def present_workers(self, roll: int) -> set[int]:
        """The workers (by number) that answered roll call ``roll`` (or a later one)."""
        return self._ask(lambda: self._servicer.present_workers(roll), set())

    def watching_ranks(self) -> set[int]:
        """Ranks that hold an open Watch stream right now."""
        return self._ask(self._servicer.watching_ranks, set())

    def left_ranks(self) -> set[int]:
        """Ranks that held a Watch stream and hold none now (they left, or were cut off)."""
        return self._ask(self._servicer.left_ranks, set())

    def values_under(self, prefix: str) -> dict[str, bytes]:
        """The store's keys under ``prefix`` and their values (the workers' reports, such
        as their arrival figures under ``worker_env.INSIGHT_KEY_PREFIX``)."""
        return self._ask(lambda: self._servicer.values_under(prefix), {})

    def put_values(self, values: Mapping[str, bytes]) -> None:
        """Stores ``values`` (key -> bytes, each within the value limit) before the workers
        ask for them, such as ``hvdrun.run``'s function; the server must be started."""
        with self._state_lock:
            started = self._loop_thread is not None
        if not started:
            raise RuntimeError("the rendezvous server has not been started")
        self._ask(lambda: self._servicer.put_values(values), None)

    def _ask(self, question: Callable[[], _T], unstarted: _T) -> _T:
        """``question()`` answered on the server's loop, which owns the job's state: callers
        on any other thread see it as the loop left it between two steps, with no lock. (Not
        from the loop's own thread.) A server never started has served nothing, so
        ``unstarted`` is its answer. Raises TimeoutError when the loop does not answer
        within :data:`ASK_SECONDS` (a machine too loaded to run it)."""
        with self._state_lock:
            loop_thread = self._loop_thread
        if loop_thread is None:
            return unstarted

        async def ask() -> _T:
            return question()

        try:
            return loop_thread.run(ask(), timeout=ASK_SECONDS)
        except concurrent.futures.TimeoutError:  # (not TimeoutError itself before 3.11)
            raise TimeoutError(
                f"the rendezvous server did not answer within {ASK_SECONDS:g} s"
            ) from None

    def __enter__(self) -> RendezvousServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
