"""hvdrun's rendezvous: the gRPC control plane of a job.

The launcher runs a :class:`~rendezvous.server.RendezvousServer` in-process; workers talk to
it through :class:`~rendezvous.client.RendezvousClient`, and torch.distributed bootstraps its
process groups through :class:`~rendezvous.store.RendezvousStore` (the only module here that
imports torch). This package imports neither ``launcher`` nor ``collectives``. Importing it
amends ``GRPC_TRACE`` where a user set it, so that gRPC's trace never prints the job's token
(:func:`_turn_header_tracers_off`).
"""

from __future__ import annotations

import importlib
import logging
import os
import sys

TOKEN_METADATA_KEY = "x-hvdrun-token"
JOB_METADATA_KEY = "x-hvdrun-job"

#: gRPC's tracers that print every header's value, the job's token included (tried on
#: gRPC 1.85: ``GRPC_TRACE=all`` printed it in full through the first two, and over TLS the
#: first bytes of every decrypted frame, the token's header among them, through the third).
HEADER_TRACERS = ("api", "chttp2_hpack_parser", "secure_endpoint")


def _turn_header_tracers_off() -> None:
    """Where ``GRPC_TRACE`` is set (to debug gRPC), turns :data:`HEADER_TRACERS` off in it
    (``-api``...), before gRPC reads it: gRPC reads the variable once, at its import, and
    every process of a job (hvdrun, its relays, the workers) imports this package before
    gRPC. Children inherit the amended variable (amended once: they import this too)."""
    trace = os.environ.get("GRPC_TRACE", "")
    if not trace.strip():
        return
    entries = {entry.strip() for entry in trace.split(",")}
    missing = [f"-{name}" for name in HEADER_TRACERS if f"-{name}" not in entries]
    if not missing:
        return
    if "grpc" in sys.modules:
        logging.getLogger(__name__).warning(
            "GRPC_TRACE is set and gRPC was imported before hvdrun's rendezvous: its %s and %s "
            "tracers, where on, print the job's token",
            ", ".join(HEADER_TRACERS[:-1]),
            HEADER_TRACERS[-1],
        )
        return
    os.environ["GRPC_TRACE"] = ",".join([trace, *missing])


_turn_header_tracers_off()

#: gRPC's own log threshold, which it reads once, when ``grpc`` is first imported.
GRPC_VERBOSITY_VARIABLE = "GRPC_VERBOSITY"


def load_grpc() -> None:
    """Imports gRPC with its own logging at ERROR unless the job set ``GRPC_VERBOSITY``;
    every process of a job (hvdrun, its agents, the workers) calls it before gRPC is imported.

    Unset, gRPC logs at INFO: hvdrun's TLS server printed a raw line for every connection
    that failed its handshake (a port scanner's, a plain HTTP probe's: "Handshake failed with
    error SSL_ERROR_SSL ..."), as many as anyone on the network cared to cause, and a worker
    forked while its heartbeat stream is open (every DataLoader worker) printed "Other threads
    are currently calling into gRPC, skipping fork() handlers". The variable is set only for
    the import, so the processes started later see the job's environment.
    """
    if "grpc" in sys.modules or GRPC_VERBOSITY_VARIABLE in os.environ:
        return
    os.environ[GRPC_VERBOSITY_VARIABLE] = "ERROR"
    try:
        importlib.import_module("grpc")
    finally:
        os.environ.pop(GRPC_VERBOSITY_VARIABLE, None)
