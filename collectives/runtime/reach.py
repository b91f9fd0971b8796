"""What a rank advertises to Gloo, and whether the hosts of a job reach each other there.

Gloo connects every pair of ranks at the address each advertises (the interface
``GLOO_SOCKET_IFNAME`` names, else its host name's). Where a firewall drops the packets to
such an address silently, each of Gloo's connects waits out the kernel's SYN retries (about
130 s) and Gloo tries again until its own timeout: about 7 minutes before hvd.init() fails,
with an error that names only the peer's address.

So while the default group connects, the first rank of every host checks the path to every
other host itself: it listens on its own Gloo address, publishes that in the job's store, and
connects to the other hosts' within :data:`REACH_TIMEOUT_SECONDS`. A connect that is answered
(even refused: a listener closed once its host's group was up) proves the path. One that gets
no answer, or an unreachable network, means Gloo cannot connect either: that rank says which
host and address it could not reach and how to choose another interface, and exits (as a
worker that lost its launcher does: the caller's ``on_unreachable``), so the launcher stops
the job within seconds; in an elastic job it only warns (see :func:`warn_unreachable`).
Where Gloo's connects fail by themselves, :func:`connect_failure` explains them.

The check costs one listening socket per host and a connect per pair of hosts, on a thread
of its own: hvd.init() does not wait for it.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import socket
import threading
from collections.abc import Callable
from typing import Any

from collectives.runtime.state import Topology
from rendezvous.addresses import (
    connect_error,
    interface_addresses,
    is_ipv6,
    is_loopback,
    listening_socket,
    resolve,
)

__all__ = [
    "REACH_TIMEOUT_SECONDS",
    "HostsProbe",
    "connect_failure",
    "gloo_address",
    "out_of_threads",
    "warn_unreachable",
]

logger = logging.getLogger(__name__)

#: How long a connect to another host's Gloo address may go unanswered. The kernel answers
#: a connect to a listening socket by itself, however busy the process is.
REACH_TIMEOUT_SECONDS = 15.0
#: Connect errors that mean the path is broken (a refusal means the host answered).
_UNREACHABLE = {errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH}
#: The fix both explanations end with.
_HOW_TO_CHOOSE = "hvdrun --network-interface IF (or GLOO_SOCKET_IFNAME=IF on every rank)"
#: The peer address in Gloo's connect errors: ``remote=[10.9.51.2]:49055``.
_GLOO_REMOTE = re.compile(r"remote=\[([^\]]+)\]")


def _advertised_interface() -> str:
    """The interface Gloo advertises: the first ``GLOO_SOCKET_IFNAME`` names ("" if none)."""
    return os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()


def gloo_address() -> tuple[str, str] | None:
    """(address, where it comes from) that Gloo advertises for this rank: the first IPv4
    address (else IPv6) of the interface :func:`_advertised_interface` names, else the
    address of this host's name; None when there is none, or it is loopback."""
    ifname = _advertised_interface()
    if ifname:
        held = interface_addresses(ifname)
        ordered = [a for a in held if not is_ipv6(a)] + [a for a in held if is_ipv6(a)]
        address, source = (ordered[0] if ordered else None), ifname
    else:
        address, source = resolve(socket.gethostname()), "the host name"
    if address is None or is_loopback(address):
        return None
    return address, source


def never_joined(rank: int, key: str, timeout: float) -> RuntimeError | None:
    """hvd.init()'s error when the bootstrap timed out waiting for ``key`` in the store: a
    peer's address, under a key that Gloo's rendezvous ends with the peer's rank. That peer
    never reached hvd.init() (or not in time), and it, not the network, held the bootstrap
    up. None for a key of another shape."""
    peer = key.rpartition("/")[2]
    if not peer.isdigit():
        return None
    return RuntimeError(
        f"hvd.init() on rank {rank} waited {timeout:g} s for rank {peer}, which never joined "
        f"the job: rank {peer} has not called hvd.init(), or failed before it. Every rank must "
        f"call hvd.init(), each within {timeout:g} s of the first (slow work before it, such "
        "as loading data, counts against that)"
    )


#: What a process that cannot start another thread is told, by Python and by Gloo (EAGAIN).
_OUT_OF_THREADS = ("can't start new thread", "Resource temporarily unavailable")


def out_of_threads(error: BaseException) -> RuntimeError | None:
    """hvd.init()'s error where ``error`` says this process could not start a thread: the
    limit on processes and threads (``ulimit -u``, a container's pids limit) or on virtual
    memory (``ulimit -v``) was reached, not the network (None: it does not say so)."""
    text = str(error)
    if not any(words in text for words in _OUT_OF_THREADS):
        return None
    return RuntimeError(
        f"hvd.init() could not start the threads it needs ({text}): this process reached "
        "the limit on processes and threads (ulimit -u, a container's pids limit) or on "
        "virtual memory (ulimit -v, where each thread's memory arena counts: "
        "MALLOC_ARENA_MAX=2 leaves fewer); raise the limit, or start fewer workers"
    )


def connect_failure(rank: int, size: int, error: BaseException) -> RuntimeError:
    """hvd.init()'s error when the default group cannot connect: Gloo names only the peer's
    address, so it says what each side advertised and how to choose the interface (unless
    it ran out of threads: :func:`out_of_threads`)."""
    starved = out_of_threads(error)
    if starved is not None:
        return starved
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "")
    own = ", ".join(interface_addresses(_advertised_interface())) if ifname else ""
    mine = f"{ifname} ({own or 'no address'})" if ifname else "the address of its host name"
    peers = list(dict.fromkeys(_GLOO_REMOTE.findall(str(error))))
    theirs = f"; the peer(s) it could not reach advertised {', '.join(peers)}" if peers else ""
    return RuntimeError(
        f"hvd.init() could not connect rank {rank} to its {size - 1} peers: {error}. "
        f"This rank advertised {mine} on {socket.gethostname()}{theirs}. Each host advertises "
        "the interface GLOO_SOCKET_IFNAME names (by default the one facing the rendezvous): "
        f"where those are not on a network every host reaches, choose one that is with "
        + _HOW_TO_CHOOSE
    )


class HostsProbe:
    """The check of one host's first rank, for the length of one bootstrap (see above)."""

    def __init__(
        self,
        store: Any,
        topology: Topology,
        host: str,
        on_unreachable: Callable[[str], None],
        timeout: float = REACH_TIMEOUT_SECONDS,
    ) -> None:
        self._store = store
        self._topology = topology
        self._host = host
        self._on_unreachable = on_unreachable
        self._timeout = timeout
        self._done = threading.Event()
        self._listener: socket.socket | None = None

    @staticmethod
    def wanted(topology: Topology) -> bool:
        """Only the first rank of each host of a job that spans hosts checks."""
        return topology.cross_size > 1 and topology.local_rank == 0

    def start(self) -> None:
        """Listens on this host's Gloo address and publishes it (an empty entry when there is
        none to check), then checks the other hosts' on a thread."""
        found = gloo_address()
        mine: dict[str, Any] = {"host": self._host, "address": None}
        if found is not None:
            address, source = found
            try:
                listener = listening_socket(address, max(16, self._topology.cross_size))
            except OSError as error:
                logger.debug("no reachability check: cannot listen on %s: %s", address, error)
            else:
                self._listener = listener
                mine.update(address=address, source=source, port=listener.getsockname()[1])
        try:
            self._store.set(self._key(self._topology.cross_rank), json.dumps(mine))
        except Exception as error:  # the bootstrap that follows meets the same problem
            logger.debug("no reachability check: %s", error)
            self.stop()
            return
        threading.Thread(target=self._check, name="hvdrun-reach", daemon=True).start()

    def stop(self) -> None:
        """The group is up (or failed otherwise): nothing is reported any more."""
        self._done.set()
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()

    @staticmethod
    def _key(cross_rank: int) -> str:
        return f"hvdrun-reach/{cross_rank}"

    def _check(self) -> None:
        for other in range(self._topology.cross_size):
            if self._done.is_set():
                return
            if other == self._topology.cross_rank:
                continue
            try:
                peer = json.loads(self._store.get(self._key(other)))
            except Exception:  # the store timed out or closed: the bootstrap says why
                return
            problem = self._connect(peer)
            if problem is not None and not self._done.is_set():
                self._on_unreachable(self._explain(peer, problem))
                return

    def _connect(self, peer: dict[str, Any]) -> str | None:
        """None if ``peer`` answered; else what happened."""
        address = peer["address"]
        if address is None or is_loopback(address):
            return None
        error = connect_error(address, int(peer["port"]), self._timeout)
        if isinstance(error, TimeoutError):
            return f"no answer within {self._timeout:g} s"
        if error is not None and error.errno in _UNREACHABLE:
            return os.strerror(error.errno or 0)
        return None

    def _explain(self, peer: dict[str, Any], problem: str) -> str:
        where = peer["source"]
        where = f"{where}, " if where != "the host name" else ""
        return (
            f"hvd.init(): rank {self._topology.rank} cannot reach host {peer['host']} at "
            f"{peer['address']} ({where}the address its ranks advertise to Gloo): {problem}. "
            "Gloo's connections between the hosts would fail only after minutes: a firewall "
            "drops the packets, or the hosts do not share a network on that interface. Choose "
            "an interface every host reaches with " + _HOW_TO_CHOOSE
        )


def warn_unreachable(message: str) -> None:
    """What a rank of an elastic job does: says so and goes on. Its exit would make the
    launcher drop its own host, and each side of a cut sees the other as unreachable, so
    the generation fails as Gloo's connects do, and the launcher decides from there."""
    logger.warning("%s (this elastic job goes on until Gloo gives up)", message)
